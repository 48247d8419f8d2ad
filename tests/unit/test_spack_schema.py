"""spack.yaml against a JSON Schema: Spack's environment schema for the sections this project uses.

The schema was written from Spack's own schema modules (`lib/spack/spack/schema/`:
env.py, merged.py, spec_list.py, definitions.py, develop.py, view.py,
concretizer.py, packages.py, repos.py, config.py) and keeps to what Spack 0.22
through 1.x all accept: the top level allows exactly Spack's section names, so a
misspelt section fails here as it would in Spack.

Concretizing the environment needs Spack and a network: see docs/spack.md.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from spack_check import load_env

_STRINGS = {"type": "array", "items": {"type": "string"}}

#: A list of specs: strings, nulls, or a matrix (spec_list.py).
_SPEC_LIST: dict[str, Any] = {
    "type": "array",
    "items": {
        "anyOf": [
            {"type": "string"},
            {"type": "null"},
            {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "matrix": {"type": "array", "items": _STRINGS},
                    "exclude": _STRINGS,
                },
            },
        ]
    },
}

#: packages:<name>:require (packages.py): one spec, or a list of specs / groups.
_REQUIRE = {
    "oneOf": [
        {"type": "string"},
        {
            "type": "array",
            "items": {
                "oneOf": [
                    {"type": "string"},
                    {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "one_of": _STRINGS,
                            "any_of": _STRINGS,
                            "spec": {"type": "string"},
                            "message": {"type": "string"},
                            "when": {"type": "string"},
                        },
                    },
                ]
            },
        },
    ]
}

_PREFER = {
    "type": "array",
    "items": {
        "oneOf": [
            {"type": "string"},
            {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "spec": {"type": "string"},
                    "message": {"type": "string"},
                    "when": {"type": "string"},
                },
            },
        ]
    },
}

_PERMISSIONS = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "read": {"enum": ["user", "group", "world"]},
        "write": {"enum": ["user", "group", "world"]},
        "group": {"type": "string"},
    },
}

_VARIANTS = {"oneOf": [{"type": "string"}, _STRINGS]}

_COMMON_PACKAGE_KEYS: dict[str, Any] = {
    "require": _REQUIRE,
    "prefer": _PREFER,
    "conflict": _PREFER,
    "buildable": {"type": "boolean"},
    "permissions": _PERMISSIONS,
    "package_attributes": {"type": "object"},
    "variants": _VARIANTS,
}

_PACKAGES = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "all": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                **_COMMON_PACKAGE_KEYS,
                "target": _STRINGS,
                "compiler": _STRINGS,
                "providers": {
                    "type": "object",
                    "additionalProperties": False,
                    "patternProperties": {r"^\w[\w-]*$": _STRINGS},
                },
            },
        }
    },
    "patternProperties": {
        r"^(?!all$)\w[\w-]*$": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                **_COMMON_PACKAGE_KEYS,
                "version": {"type": "array", "items": {"type": ["string", "number"]}},
                "externals": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["spec"],
                        "properties": {
                            "spec": {"type": "string"},
                            "prefix": {"type": "string"},
                            "modules": _STRINGS,
                            "extra_attributes": {"type": "object"},
                        },
                    },
                },
            },
        }
    },
}

_CONCRETIZER = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "reuse": {"oneOf": [{"type": "boolean"}, {"enum": ["dependencies"]}, {"type": "object"}]},
        "unify": {"oneOf": [{"type": "boolean"}, {"enum": ["when_possible"]}]},
        "enable_node_namespace": {"type": "boolean"},
        "targets": {
            "type": "object",
            "properties": {
                "host_compatible": {"type": "boolean"},
                "granularity": {"enum": ["generic", "microarchitectures"]},
            },
        },
        "duplicates": {
            "type": "object",
            "properties": {"strategy": {"enum": ["none", "minimal", "full"]}},
        },
        "splice": {"type": "object"},
        "static_analysis": {"type": "boolean"},
        "timeout": {"type": "integer", "minimum": 0},
        "error_on_timeout": {"type": "boolean"},
        "os_compatible": {"type": "object"},
    },
}

_VIEW = {
    "anyOf": [
        {"type": "boolean"},
        {"type": "string"},
        {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["root"],
                "additionalProperties": False,
                "properties": {
                    "root": {"type": "string"},
                    "link": {"enum": ["roots", "all", "run"]},
                    "link_type": {"enum": ["symlink", "hardlink", "copy"]},
                    "select": _STRINGS,
                    "exclude": _STRINGS,
                    "projections": {"type": "object"},
                },
            },
        },
    ]
}

#: repos: a list of paths (every version), or namespace -> path (Spack 1.x).
_REPOS = {
    "anyOf": [
        _STRINGS,
        {"type": "object", "additionalProperties": {"type": ["string", "object"]}},
    ]
}

_DEVELOP = {
    "type": "object",
    "additionalProperties": False,
    "patternProperties": {
        r"^\w[\w-]*$": {
            "type": "object",
            "additionalProperties": False,
            "required": ["spec"],
            "properties": {"spec": {"type": "string"}, "path": {"type": "string"}},
        }
    },
}

_DEFINITIONS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"when": {"type": "string"}},
        "additionalProperties": _SPEC_LIST,
        "minProperties": 1,
    },
}

# Spack's config.yaml keys (schema/config.py).
# fmt: off
_CONFIG_KEYS = [
    "shared_linking", "install_tree", "install_hash_length", "build_stage", "test_stage", "stage_name",
    "extensions", "template_dirs", "license_dir", "source_cache", "misc_cache", "environments_root",
    "connect_timeout", "verify_ssl", "ssl_certs", "suppress_gpg_warnings", "debug", "checksum",
    "deprecated", "locks", "dirty", "build_language", "build_jobs", "concurrent_packages", "ccache",
    "db_lock_timeout", "package_lock_timeout", "allow_sgid", "install_status", "binary_index_ttl",
    "flags", "aliases", "url_fetch_method", "additional_external_search_paths",
]
# fmt: on

# fmt: off
#: The other sections Spack accepts in an environment (merged.py), checked by name only.
_OTHER_SECTIONS = (
    "bootstrap", "cdash", "ci", "compilers", "container", "mirrors", "modules", "upstreams",
    "toolchains", "env_vars",
)
# fmt: on

#: The `spack:` mapping of an environment file (env.py = merged.py sections + env-only ones).
SPACK_ENV_SCHEMA: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "Spack environment file, the sections moe-a2a uses (after Spack's schema/env.py)",
    "type": "object",
    "additionalProperties": False,
    "required": ["spack"],
    "properties": {
        "spack": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                # checked in depth: what this project's spack.yaml uses or is likely to
                "specs": _SPEC_LIST,
                "definitions": _DEFINITIONS,
                "view": _VIEW,
                "concretizer": _CONCRETIZER,
                "packages": _PACKAGES,
                "repos": _REPOS,
                "develop": _DEVELOP,
                "include": _STRINGS,
                "include_concrete": _STRINGS,
                "config": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {key: {} for key in _CONFIG_KEYS},
                },
                # the other configuration sections Spack accepts here, by name only
                **{section: {"type": "object"} for section in _OTHER_SECTIONS},
            },
        }
    },
}


def _schema_errors(document: Any) -> list[str]:
    validator = jsonschema.Draft7Validator(SPACK_ENV_SCHEMA)
    return [
        f"spack.yaml: {'/'.join(str(p) for p in error.absolute_path) or '(top)'}: {error.message}"
        for error in sorted(validator.iter_errors(document), key=lambda e: list(map(str, e.path)))
    ]


@pytest.fixture(scope="module")
def env() -> dict[str, Any]:
    return load_env()


def test_schema_itself_is_valid() -> None:
    jsonschema.Draft7Validator.check_schema(SPACK_ENV_SCHEMA)


def test_spack_yaml_matches_the_environment_schema(env: dict[str, Any]) -> None:
    errors = _schema_errors(env)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize(
    ("mutate", "what"),
    [
        (lambda s: s.update(spec=s.pop("specs")), "misspelt section 'spec'"),
        (lambda s: s["concretizer"].update(unify="yes"), "unify must be a boolean or when_possible"),
        (lambda s: s.update(view={"default": {"link": "roots"}}), "a view needs a root"),
        (lambda s: s["develop"]["moe-a2a"].pop("spec"), "a develop entry needs a spec"),
        (lambda s: s["packages"].update(libfabric={"varients": "fabrics=efa"}), "unknown package key"),
        (lambda s: s["specs"].append({"matrix": "moe-a2a"}), "a matrix is a list of lists"),
        (lambda s: s.update(repos="spack/repo"), "repos is a list or a mapping"),
    ],
)
def test_schema_rejects_broken_environments(env: dict[str, Any], mutate: Any, what: str) -> None:
    """The schema is strict enough to catch the mistakes people make in spack.yaml."""
    import copy

    broken = copy.deepcopy(env)
    mutate(broken["spack"])
    assert _schema_errors(broken), f"schema accepted: {what}"
