# Spack recipe of moe-a2a (Package API v1: Spack 0.22, 0.23 and 1.x).
#
# Spack 1.x puts the build-system classes (PythonPackage, CudaPackage) in front of
# every v1 recipe by itself; Spack 0.2x exports them from spack.package. Either
# way `from spack.package import *` is the only import a v1 recipe needs.
#
# The project publishes no releases and has no public address yet: `homepage` and
# `git` name the checkout this recipe lives in (so `spack info` and a `@main`
# fetch work from it), and the top-level spack.yaml builds that checkout through
# its `develop` entry (docs/spack.md).
#
# Spack recipes use the star import and the names it brings (PythonPackage,
# variant, depends_on, ...): ruff's star-import checks do not apply here.
# ruff: noqa: F403, F405

import os

from spack.package import *

# spack/repo/packages/moe-a2a/package.py -> the repository root
_CHECKOUT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 4))


class MoeA2a(PythonPackage, CudaPackage):
    """Expert-parallel all-to-all for Mixture-of-Experts models: the dispatch and
    combine steps over NVLink inside a node and RDMA between nodes, with a
    transfer engine on libfabric (EFA, verbs, tcp, shm) and an MPI/Python front
    end that runs whole MoE decode and prefill layers and writes HDF5 traces."""

    homepage = f"file://{_CHECKOUT}/README.md"
    git = f"file://{_CHECKOUT}"

    license("Apache-2.0")

    # `main` fetches that branch of the checkout. There is no release to checksum:
    # spack.yaml's `develop` entry builds moe-a2a@=0.1.0 (pyproject.toml's version)
    # from the sources in place, which needs no version() entry of its own.
    version("main", branch="main")
    # No maintainers() yet: it takes the GitHub handles of the people who review
    # changes to this recipe, and the project has no public repository to name them on.

    # Fabrics. tcp and shm (and ofi_rxm, which layers reliable datagrams over tcp
    # and verbs) are always built: the tests and CPU-only clusters need them. efa
    # and verbs are off by default so that a site without that NIC does not build
    # rdma-core and those providers; spack.yaml picks them with MOE_A2A_FABRIC.
    variant("efa", default=False, description="libfabric with the efa provider (AWS EFA)")
    variant(
        "verbs",
        default=False,
        description="libfabric with the verbs provider (InfiniBand/RoCE, e.g. ConnectX-7), and rdma-core",
    )
    # pyproject.toml's [plot] extra: only `moe-a2a trace plot` needs matplotlib.
    variant("plot", default=True, description="matplotlib for `moe-a2a trace plot`")
    # `cuda` and `cuda_arch` come from CudaPackage. Without +cuda the CUDA kernels
    # are not built and the package runs on CPUs only.
    conflicts(
        "cuda_arch=none",
        when="+cuda",
        msg="moe-a2a's CUDA kernels need a GPU architecture: add cuda_arch=90 (H100/H200) or similar",
    )

    # Build (pyproject.toml: scikit-build-core drives CMake; nanobind builds _core)
    depends_on("cxx", type="build")
    depends_on("python@3.10:", type=("build", "link", "run"))
    depends_on("cmake@3.24:", type="build")
    # CMakeLists.txt finds libfabric with pkg-config.
    depends_on("pkgconfig", type="build")
    # +pyproject: the PEP 517 backend (scikit_build_core.build), not only the CMake helpers.
    depends_on("py-scikit-build-core+pyproject@0.11:", type="build")
    depends_on("py-nanobind@2.0:", type="build")

    # The transfer engine (src/fabric): libfabric >= 1.17, the version the engine
    # is written against (FI_VERSION(1, 17)).
    depends_on("libfabric@1.17: fabrics=tcp,rxm,shm")
    depends_on("libfabric fabrics=efa", when="+efa")
    depends_on("libfabric fabrics=verbs", when="+verbs")
    # libibverbs and librdmacm under the verbs provider (and, later, the engine's
    # own ibverbs backend).
    depends_on("rdma-core", when="+verbs")
    with when("+cuda"):
        depends_on("cuda@12:")
        # GPU memory registered with the NIC (FI_HMEM) needs a CUDA-aware libfabric.
        depends_on("libfabric+cuda")
        depends_on("py-torch+cuda")
        for arch in CudaPackage.cuda_arch_values:
            depends_on(f"py-torch cuda_arch={arch}", when=f"cuda_arch={arch}")

    # Run: the Python front end (pyproject.toml [project] dependencies) and an MPI
    # whose mpirun/srun starts the ranks.
    depends_on("mpi", type="run")
    depends_on("py-mpi4py@3.1:", type="run")
    depends_on("py-numpy@1.24:", type="run")
    depends_on("py-torch@2.4:", type="run")
    depends_on("py-h5py@3.8:", type="run")
    depends_on("py-tabulate@0.9:", type="run")
    depends_on("py-tqdm@4.64:", type="run")
    depends_on("py-matplotlib@3.7:", type="run", when="+plot")

    def config_settings(self, spec, prefix):
        """scikit-build-core settings: the CMake options of CMakeLists.txt."""
        settings = {}
        if spec.satisfies("+cuda"):
            archs = [a for a in spec.variants["cuda_arch"].value if a != "none"]
            settings["cmake.define.MOE_A2A_CUDA"] = "ON"
            settings["cmake.define.MOE_A2A_CUDA_ARCHITECTURES"] = ";".join(archs)
            settings["cmake.define.CMAKE_CUDA_COMPILER"] = spec["cuda"].prefix.bin.nvcc
        else:
            # Not just "no nvcc found": a CPU build stays CPU-only even where the
            # build machine happens to have a CUDA toolkit on PATH.
            settings["cmake.define.MOE_A2A_CUDA"] = "OFF"
        return settings
