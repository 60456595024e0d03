"""The part of the build that must be code: CMake builds the C core (the one list of C
sources), then torch's BuildExtension compiles the thin C++ shim and links the core's static
archives into it. Metadata lives in pyproject.toml.

Build against the torch you run with, without build isolation (as torch extensions do):
    pip install --no-build-isolation .            # or -e . for development
    python -m build --wheel --no-isolation        # scripts/wheel.sh: + the auditwheel repair

The extension's C++ ABI ties it to the torch minor version it is compiled against, so a
build records that version (ripples_pg/_build_info.py, generated) and the built wheel
requires torch>=X.Y,<X.(Y+1); ripples_pg checks it at import (ripples_pg/backend/_register.py).

Environment (scripts/wheel.sh sets them so a wheel build never touches the dev build):
    RIPPLES_BUILD_BASE  setuptools' build directory (default: build); CMake builds the C
                        core in <RIPPLES_BUILD_BASE>/cmake-ext
    RIPPLES_CMAKE_ARGS  extra CMake arguments, e.g. -DRIPPLES_WITH_UCX=OFF
"""
import glob
import os
import shlex
import subprocess
import sys

from setuptools import setup

# The range of torch versions the sources build against (an sdist says this); a built wheel
# narrows it to the one minor version it was compiled with.
TORCH_SOURCE_RANGE = "torch>=2.4,<3"

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # pragma: no cover - a clear message instead of a traceback
    sys.exit(
        "ripples_pg builds against the installed torch, and no torch is importable here.\n"
        "If pip or `python -m build` is building it in an isolated environment, build without "
        "isolation so that it compiles against the torch you run with (an isolated build "
        "would download a second torch and produce an extension for that one):\n"
        "    pip install --no-build-isolation .\n"
        "    python -m build --wheel --no-isolation\n"
        f"Otherwise install torch first (pip install '{TORCH_SOURCE_RANGE}')."
    )

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_BASE = os.environ.get("RIPPLES_BUILD_BASE") or "build"


def _torch_minor() -> str:
    """'X.Y' of the torch this build compiles against (local tags like +cpu dropped)."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return f"{int(major)}.{int(minor)}"


def _wheel_requirement() -> str:
    major, minor = (int(p) for p in _torch_minor().split("."))
    floor = f"{major}.{minor}"
    if any(c.isalpha() for c in torch.__version__.split("+")[0]):
        # A nightly or release candidate (2.14.0.dev..., 2.14.0rc1) sorts below 2.14: the floor
        # must name a pre-release for the wheel to accept the torch it was built with.
        floor += ".0.dev0"
    return f"torch>={floor},<{major}.{minor + 1}"


def _build_info_text() -> str:
    return (
        '"""Written by setup.py when the extension is built: the torch it was compiled against.\n'
        'The C++ ABI ties the extension to this torch minor version (checked at import)."""\n'
        f'TORCH_VERSION = "{_torch_minor()}"\n'
        f'TORCH_VERSION_FULL = "{torch.__version__}"\n'
    )


class CMakeThenTorchExt(BuildExtension):
    """Runs CMake for the C core before compiling the C++ extension, and records the torch
    version next to the extension."""

    def run(self):
        build_dir = os.path.join(HERE, BUILD_BASE, "cmake-ext")
        os.makedirs(build_dir, exist_ok=True)
        cfg = ["cmake", "-S", HERE, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
               "-DRIPPLES_BUILD_TESTS=OFF"]
        cfg += shlex.split(os.environ.get("RIPPLES_CMAKE_ARGS", ""))
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 2)
        try:
            subprocess.check_call(cfg)
            subprocess.check_call(["cmake", "--build", build_dir, "--parallel", jobs])
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
        inplace = self.inplace  # setuptools' run() builds into build_lib, then copies back
        super().run()
        # Next to the extension in build_lib (what a wheel packs) and, for in-place and
        # editable builds, in the source package that is imported.
        targets = [os.path.dirname(self.get_ext_fullpath("ripples_pg._C"))]
        if inplace:
            targets.append(os.path.join(HERE, "ripples_pg"))
        for d in targets:
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "_build_info.py"), "w") as f:
                f.write(_build_info_text())


# One extension: the backend and the Group Generator's binding (shim/GroupGenerator.cpp:
# policies, coordinator, client and CLI), over the C libraries CMake built.
ext = CppExtension(
    name="ripples_pg._C",
    sources=sorted(glob.glob(os.path.join("shim", "*.cpp"))),
    include_dirs=[os.path.join(HERE, "csrc"), os.path.join(HERE, "csrc", "sched"),
                  os.path.join(HERE, "coordinator")],
    extra_compile_args=["-O2", "-Wall"],
)

# An sdist is source: it accepts every torch the sources build against. Anything built here
# (wheel, editable, in-place) is tied to this torch's minor version.
building_sdist = "sdist" in sys.argv[1:]

setup(
    ext_modules=[ext],
    cmdclass={"build_ext": CMakeThenTorchExt},
    install_requires=[TORCH_SOURCE_RANGE if building_sdist else _wheel_requirement()],
    options={"build": {"build_base": BUILD_BASE}},
)
