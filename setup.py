"""Builds ripples_pg: CMake builds the C core (the one list of C sources), then torch's
BuildExtension compiles the thin C++ shim and links the core's static archives into it.

Build without isolation so the extension compiles against the torch you run with:
    pip install --no-build-isolation .
"""
import glob
import os
import subprocess
import sys

from setuptools import find_packages, setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # pragma: no cover - a clear message instead of a traceback
    sys.exit(
        "ripples_pg builds against the installed torch: install torch first "
        "(pip install 'torch>=2.4,<3') and build with --no-build-isolation."
    )

HERE = os.path.dirname(os.path.abspath(__file__))


class CMakeThenTorchExt(BuildExtension):
    """Runs CMake for the C core before compiling the C++ extension."""

    def run(self):
        build_dir = os.path.join(HERE, "build", "cmake-ext")
        os.makedirs(build_dir, exist_ok=True)
        cfg = ["cmake", "-S", HERE, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
               "-DRIPPLES_BUILD_TESTS=OFF"]
        try:
            subprocess.check_call(cfg)
            subprocess.check_call(["cmake", "--build", build_dir, "--parallel",
                                   str(os.cpu_count() or 2)])
        except FileNotFoundError:
            sys.exit("ripples_pg needs cmake (>= 3.18) to build its C core: "
                     "apt-get install cmake, or pip install cmake.")
        with open(os.path.join(build_dir, "ripples_link.txt")) as f:
            items = [line.strip() for line in f if line.strip()]
        archives = [i for i in items if not i.startswith("-l")]
        syslibs = [i[2:] for i in items if i.startswith("-l")]
        for ext in self.extensions:
            ext.extra_objects = archives + list(ext.extra_objects or [])
            ext.libraries = list(ext.libraries or []) + syslibs
        super().run()


# One extension: the backend and the Group Generator's binding (csrc/torch/GroupGenerator.cpp:
# policies, coordinator, client and CLI), over the C libraries CMake built.
ext = CppExtension(
    name="ripples_pg._C",
    sources=sorted(glob.glob(os.path.join("csrc", "torch", "*.cpp"))),
    include_dirs=[os.path.join(HERE, "csrc"), os.path.join(HERE, "csrc", "sched"),
                  os.path.join(HERE, "coordinator")],
    extra_compile_args=["-O2", "-Wall"],
)

setup(
    name="ripples_pg",
    version="0.1.0",
    description="A PyTorch c10d backend with Partial All-Reduce for straggler-tolerant "
                "data-parallel training (Ripples, ASPLOS 2020)",
    packages=find_packages(include=["ripples_pg", "ripples_pg.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": CMakeThenTorchExt},
    python_requires=">=3.9",
    install_requires=["torch>=2.4,<3"],
    entry_points={
        "torch.backends": ["ripples = ripples_pg:_autoload"],
        # The coordinator CLI: the C binary's own command line (coordinator/cli.c), in-process.
        "console_scripts": ["ripples-coordinator = ripples_pg.coordinator:main"],
    },
)
