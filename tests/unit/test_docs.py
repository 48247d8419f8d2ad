"""Every repository path, link and command named in docs/*.md and README.md exists or parses.

- Paths: every word in backticks or in a code block that starts with a
  repository folder (`src/`, `python/`, `tools/`, `tests/`, `jobs/`, `docs/`,
  `examples/`, `spack/`, `.ci/`) exists (a glob matches something).
- Links: every relative link target exists, and an anchor into a Markdown file
  names one of its headings (GitHub's slugs).
- Prose names no commit hash (a results table's stamp column and commands may).
- Commands: in shell code blocks (and backticked `moe-a2a ...` spans) every
  `moe-a2a ...` command, also under `mpirun`/`srun` or as `python -m moe_a2a`,
  parses with the real argparse parser (nothing is run); `python -m MODULE`
  and `torchrun -m MODULE` name a module that exists, and a `moe_a2a` module
  that declares `add_arguments(parser)` parses its arguments; `python FILE.py`,
  `bash FILE` and `tools/...` commands name a file that exists.

Not checked, and why:
- other programs' options (`nvcc`, `git`, `spack`, `sbatch`, `ip`, `tc`,
  mpirun's own): their parsers are not ours; the repository paths they name are;
- another distribution's module (`python -m pytest`, `torch.distributed.run`):
  only that its top-level package is installed, since importing it is slow;
- printed output that starts with the program's name (see `_is_cli_line`) and
  a printed table's rows;
- a backticked span that names a command without its required values
  (`moe-a2a trace summary`), see `NAMING_ERRORS`;
- names with no repository folder in front (`shm.cc`, `test_overlap.py`):
  which file they mean is the prose's to say.

A failure names the document, the line and what it names. One process, no
subprocess: the parser is built once and only parses.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from moe_a2a import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
FOLDERS = ("src", "python", "tools", "tests", "jobs", "docs", "examples", "spack", ".ci")
PATH_RE = re.compile(r"(?<![\w./$-])(?:" + "|".join(map(re.escape, FOLDERS)) + r")/[\w./*?{},\[\]-]*")
SHELL_LANGS = ("", "sh", "bash", "console", "shell", "shell-session")
#: Where a backticked span names a command rather than a whole command line, these
#: parse errors only say that an argument's value is left out, which naming allows.
NAMING_ERRORS = ("the following arguments are required", "expected one argument", "expected a command")
MAX_DOC_LINES = 500


@dataclass(frozen=True)
class Named:
    """One thing a document names: where, and the text."""

    doc: str
    line: int
    text: str

    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def _rel(doc: Path) -> str:
    return str(doc.relative_to(ROOT)) if doc.is_relative_to(ROOT) else doc.name


def _blocks(doc: Path) -> tuple[list[str], list[tuple[int, str, list[str]]]]:
    """The prose lines (code blocks blanked, so line numbers hold) and each code block:
    (line of its first body line, language, body lines)."""
    prose, blocks = [], []
    fence, lang, body, start = "", "", [], 0
    for number, line in enumerate(doc.read_text().splitlines(), start=1):
        stripped = line.lstrip()
        if not fence and stripped.startswith(("```", "~~~")):
            fence, lang, body, start = stripped[:3], stripped[3:].strip().lower(), [], number + 1
            prose.append("")
        elif fence and stripped.startswith(fence):
            blocks.append((start, lang, body))
            fence = ""
            prose.append("")
        elif fence:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    return prose, blocks


def _spans(doc: Path) -> Iterator[Named]:
    """Backticked spans of the prose (a span may wrap onto the next line)."""
    prose, _ = _blocks(doc)
    text = "\n".join(prose)
    for m in re.finditer(r"(`+)(.+?)\1", text, flags=re.S):
        yield Named(_rel(doc), text.count("\n", 0, m.start()) + 1, m.group(2).replace("\n", " ").strip())


def _links(doc: Path) -> Iterator[Named]:
    prose, _ = _blocks(doc)
    for number, line in enumerate(prose, start=1):
        line = re.sub(r"`[^`]*`", "", line)
        for m in re.finditer(r"\]\(([^)\s]+)\)", line):
            yield Named(_rel(doc), number, m.group(1))


def _command_lines(doc: Path) -> Iterator[Named]:
    """Logical lines of shell code blocks (continuations joined; console: `$ ` lines)."""
    _, blocks = _blocks(doc)
    for start, lang, body in blocks:
        if lang not in SHELL_LANGS:
            continue
        logical, first = "", start
        for offset, line in enumerate(body):
            if lang in ("console", "shell-session") and not logical:
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if not logical:
                first = start + offset
            if line.rstrip().endswith("\\"):
                logical += line.rstrip()[:-1] + " "
                continue
            logical += line
            if logical.strip():
                yield Named(_rel(doc), first, logical.strip())
            logical = ""


def _expand_braces(word: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", word)
    if not m:
        return [word]
    return [
        w
        for part in m.group(1).split(",")
        for w in _expand_braces(word[: m.start()] + part + word[m.end() :])
    ]


def _path_words(text: str) -> Iterator[str]:
    """Repository paths in a text: `a.{h,cc}` gives both; `::test_id` is dropped."""
    for m in PATH_RE.finditer(text):
        word = m.group(0).split("::")[0].rstrip(".,;:")
        yield from _expand_braces(word)


#: A package path (`moe_a2a/bench/train.py`) or a dotted name (`moe_a2a.bench.train`).
PACKAGE_PATH_RE = re.compile(r"(?<![\w./-])moe_a2a/[\w./-]*")
DOTTED_RE = re.compile(r"(?<![\w./-])moe_a2a(?:\.\w+)+")


def _dotted_problem(name: str) -> str | None:
    """A dotted name under moe_a2a: each part a package, a module, or a name its file defines."""
    path = ROOT / "python" / "moe_a2a"
    parts = name.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if part == "_core":
            return None  # the native module: its names are the stub's to check
        if (path / part).is_dir():
            path = path / part
            continue
        module = path / f"{part}.py"
        if module.is_file():
            rest = parts[i + 1 : i + 2]
            if rest and not re.search(rf"\b{re.escape(rest[0])}\b", module.read_text()):
                return f"{_rel(module)} does not name {rest[0]}"
            return None
        init = path / "__init__.py"
        if init.is_file() and re.search(rf"\b{re.escape(part)}\b", init.read_text()):
            return None
        return f"{_rel(path)} has no module or name {part}"
    return None


def _path_problem(word: str) -> str | None:
    # An upper-case placeholder (`jobs/presets/NAME.sh`) stands for any name: a glob.
    word = re.sub(r"(?<![A-Za-z])[A-Z][A-Z_]+(?![A-Za-z])", "*", word)
    if any(c in word for c in "*?["):
        return None if list(ROOT.glob(word)) else "matches no file"
    return None if (ROOT / word).exists() else "does not exist"


def _slug(heading: str) -> str:
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    prose, _ = _blocks(doc)
    seen: dict[str, int] = {}
    anchors = set()
    for line in prose:
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        anchors.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return anchors


def _doc_id(doc: Path) -> str:
    return _rel(doc)


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_named_paths_exist(doc: Path) -> None:
    problems = []
    for named in _spans(doc):
        for word in _path_words(named.text):
            why = _path_problem(word)
            if why:
                problems.append(f"{named.where()}: names `{word}`, which {why}")
        for m in PACKAGE_PATH_RE.finditer(named.text):
            word = m.group(0).rstrip(".,;:")
            why = _path_problem(f"python/{word}")
            if why:
                problems.append(f"{named.where()}: names `{word}`, and python/{word} {why}")
        for m in DOTTED_RE.finditer(named.text):
            why = _dotted_problem(m.group(0))
            if why:
                problems.append(f"{named.where()}: names `{m.group(0)}`, but {why}")
    for named in _command_lines(doc):
        for word in _path_words(named.text):
            why = _path_problem(word)
            if why:
                problems.append(f"{named.where()}: a command names {word}, which {why}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_links_resolve(doc: Path) -> None:
    problems = []
    for named in _links(doc):
        target = named.text
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        if not resolved.exists():
            problems.append(f"{named.where()}: links to {target}, and {path} does not exist")
            continue
        if anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            problems.append(
                f"{named.where()}: links to {target}, and {_rel(resolved)} has no heading #{anchor}"
            )
    assert not problems, "\n".join(problems)


def _simple_commands(line: str) -> Iterator[list[str]]:
    """The simple commands of one shell line: split at ; && || | and at do/then."""
    loops = dict(re.findall(r"\bfor\s+(\w+)\s+in\s+(\S+)", line))
    for name, first in loops.items():  # a loop variable takes its first value
        line = re.sub(rf"\$\{{?{name}\}}?", first, line)
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words: list[str] = []
    skip_next = False
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote: take the line's words as they are
        tokens = line.split()
    for token in tokens:
        if skip_next:
            skip_next = False
            continue
        if token and set(token) <= set(";&|()"):
            if words:
                yield words
            words = []
        elif token in (">", ">>", "<", "2>", "&>"):
            skip_next = True
        elif not words and token in ("do", "then", "else", "done", "fi", "{", "}"):
            continue
        else:
            words.append(token)
    if words:
        yield words


LAUNCHERS = ("mpirun", "mpiexec", "srun", "env", "time", "sudo", "nohup", "exec", "timeout")
PYTHONS = re.compile(r"^(?:\S*/)?python(?:3(?:\.\d+)?)?$")


def _program(words: list[str]) -> list[str]:
    """The command without environment assignments and launchers (mpirun and its options)."""
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
        words = words[1:]
    if words and words[0] in LAUNCHERS:
        for i, word in enumerate(words[1:], start=1):
            if word == "moe-a2a" or PYTHONS.match(word) or word.startswith(("tools/", "./tools/")):
                return _program(words[i:])
        return []
    return words


def _module_problem(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "moe_a2a":
        base = ROOT / "python" / Path(*parts)
        if base.with_suffix(".py").is_file() or (base / "__main__.py").is_file():
            return None
        return f"module {module} has no python/{'/'.join(parts)}.py (or __main__.py)"
    # Another distribution's module: its top-level package must be importable here.
    return None if importlib.util.find_spec(parts[0]) else f"module {module} is not installed"


@functools.cache
def _parser() -> argparse.ArgumentParser:
    return cli.build_parser()


@functools.cache
def _module_parser(module: str) -> argparse.ArgumentParser | None:
    """The parser of a module run with `python -m` that declares `add_arguments(parser)`."""
    add_arguments = getattr(importlib.import_module(module), "add_arguments", None)
    if add_arguments is None:
        return None
    parser = argparse.ArgumentParser(prog=f"python -m {module}", allow_abbrev=False)
    add_arguments(parser)
    return parser


def _parse_problem(args: list[str], parser: argparse.ArgumentParser | None = None) -> str | None:
    """Why ARGS do not parse (argparse's last line), or None; `moe-a2a`'s parser by default."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            (parser or _parser()).parse_args(args)
    except SystemExit as exc:
        if exc.code in (0, None):
            return None  # --help, --version
        message = err.getvalue().strip().splitlines()
        return f"does not parse: {message[-1] if message else exc.code}"
    return None


def _is_cli_line(args: list[str]) -> bool:
    """Whether the words after `moe-a2a` are a command line, not printed output.

    Output and prose also start with the program's name: a message prefix
    (`moe-a2a run: step 3/23`), a note (`moe-a2a CUDA tests: skipped`), a Spack
    spec (`moe-a2a +cuda`, `moe-a2a ~efa`), an ellipsis (`moe-a2a ...`) or an
    error's form (`moe-a2a trace COMMAND: error: MESSAGE`). A
    command's next word is a subcommand (lower case) or an option, or nothing.
    """
    if any(word.endswith(":") for word in args[:3]):  # `moe-a2a trace COMMAND: error: ...`
        return False
    return not args or re.fullmatch(r"-.*|[a-z][a-z0-9-]*", args[0]) is not None


def _command_problem(words: list[str], naming: bool = False) -> str | None:
    words = _program(words)
    if not words:
        return None
    head = words[0]
    if head == "moe-a2a":
        if not _is_cli_line(words[1:]):
            return None
        # A synopsis's optional parts (`[--warmup N]`) are parsed as given, and an
        # upper-case placeholder (FILE, N) as "1", which any value's type accepts.
        args = [w.removeprefix("[").removesuffix("]") for w in words[1:]]
        why = _parse_problem([re.sub(r"^[A-Z][A-Z_]*$", "1", w) for w in args])
        if why and naming and any(e in why for e in NAMING_ERRORS):
            return None
        return why
    if head == "torchrun" and "-m" in words:
        return _module_problem(words[words.index("-m") + 1])
    if PYTHONS.match(head) and len(words) > 1:
        if words[1] == "-m" and len(words) > 2:
            if words[2] == "moe_a2a":
                return _command_problem(["moe-a2a", *words[3:]], naming)
            why = _module_problem(words[2])
            if why or not words[2].startswith("moe_a2a."):
                return why
            parser = _module_parser(words[2])
            return _parse_problem(words[3:], parser) if parser else None
        if words[1].endswith(".py") and "/" in words[1]:
            return None if (ROOT / words[1]).is_file() else f"script {words[1]} does not exist"
        return None
    if head == "bash" and len(words) > 1 and words[1].startswith("tools/"):
        head = words[1]
    if head.startswith(("tools/", "./tools/")):
        path = head.removeprefix("./")
        return None if (ROOT / path).is_file() else f"script {path} does not exist"
    return None


def _commands(doc: Path) -> Iterator[tuple[Named, bool]]:
    """Command lines of code blocks, then backticked spans that name a command (naming=True)."""
    for named in _command_lines(doc):
        # A printed table's row: Markdown pipes, or columns padded with spaces.
        if not named.text.startswith("|") and not re.match(r"\S+ {2,}", named.text):
            yield named, False
    for named in _spans(doc):
        if re.match(r"(moe-a2a|python3? -m moe_a2a|mpirun)\b", named.text):
            yield named, True


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_named_commands_parse(doc: Path) -> None:
    problems = []
    for named, naming in _commands(doc):
        for words in _simple_commands(named.text):
            why = _command_problem(words, naming)
            if why:
                problems.append(f"{named.where()}: `{' '.join(words)}` {why}")
    assert not problems, "\n".join(problems)


#: A word of 7 to 40 hex digits with a letter and a digit: a commit's hash.
HASH_RE = re.compile(r"(?<![\w.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-]|\.\w)")


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_no_commit_hashes_in_prose(doc: Path) -> None:
    """Docs say what is; a commit belongs only in a results table's stamp or a command."""
    prose, _ = _blocks(doc)
    problems = [
        f"{_rel(doc)}:{number}: names commit {m.group(0)} in prose"
        for number, line in enumerate(prose, start=1)
        if not line.lstrip().startswith("|")
        for m in HASH_RE.finditer(line)
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_doc_is_short(doc: Path) -> None:
    lines = len(doc.read_text().splitlines())
    assert lines < MAX_DOC_LINES, f"{_rel(doc)} has {lines} lines; a doc stays under {MAX_DOC_LINES}"


def test_the_checks_catch_a_broken_name(tmp_path: Path) -> None:
    """The checks above fail on what a stale doc holds: a moved file, a lost heading, a bad flag."""
    doc = tmp_path / "probe.md"
    (tmp_path / "other.md").write_text("# Other\n")
    doc.write_text(
        "# Probe\n\nSee `tools/no_such_tool.sh` and [a section](other.md#no-such-heading).\n\n"
        "```sh\nmpirun -n 2 moe-a2a bench a2a --no-such-flag\npython -m moe_a2a.no_such_module\n```\n"
        "\nMeasured on 1d88b1b.\n"
    )
    with pytest.raises(AssertionError, match=r"probe.md:3: names `tools/no_such_tool.sh`, which does not"):
        test_named_paths_exist(doc)
    with pytest.raises(AssertionError, match=r"probe.md:3: links to other.md#no-such-heading, and other"):
        test_links_resolve(doc)
    with pytest.raises(AssertionError, match=r"probe.md:6: .*--no-such-flag.* does not parse") as caught:
        test_named_commands_parse(doc)
    assert "probe.md:7: `python -m moe_a2a.no_such_module` module moe_a2a.no_such_module" in str(caught.value)
    with pytest.raises(AssertionError, match=r"probe.md:10: names commit 1d88b1b in prose"):
        test_no_commit_hashes_in_prose(doc)
