"""Loading the C extension ``ripples_pg._C``: the package's lowest layer, imported by the
backend's creator (_register.py) and the coordinator's binding (_gg.py).

Nothing here loads the extension or torch at import time: torch's backend autoload imports
this package inside ``import torch`` (ripples_pg/__init__.py), so both are imported inside the
functions that need them.
"""
from __future__ import annotations

from typing import Optional


def _major_minor(version: str) -> str:
    """'2.13' of '2.13.0+cpu' (and of '2.13.0a0+git...')."""
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2])


def torch_version_error() -> Optional[str]:
    """Why the extension cannot be used with the running torch, or None.

    The extension's C++ ABI ties it to the torch minor version it was compiled against, which
    the build records in ``ripples_pg/_build_info.py``. A checkout without a build has no
    record (loading the extension then reports that it is missing)."""
    try:
        from .. import _build_info  # late: written by the build, absent without one
    except ImportError:
        return None
    import torch  # late: the backend autoload imports us inside `import torch`

    built, running = _build_info.TORCH_VERSION, _major_minor(torch.__version__)
    if built == running:
        return None
    major, minor = (int(p) for p in built.split("."))
    return (
        f"ripples_pg: this build of ripples_pg was compiled against torch {built} "
        f"({_build_info.TORCH_VERSION_FULL}), but torch {torch.__version__} is installed. Its "
        f"C++ extension works only with the torch minor version it was built for. Either "
        f"install a matching torch (pip install 'torch>={major}.{minor},<{major}.{minor + 1}') "
        f"or the ripples_pg wheel built for torch {running}, or rebuild ripples_pg from source "
        f"against this torch: pip install --no-build-isolation <ripples_pg source directory> "
        f"(docs/install.md)."
    )


def _load_error_message(exc: BaseException) -> str:
    """A message naming the cause of a failure to load ``ripples_pg._C``."""
    text = str(exc)
    if isinstance(exc, ModuleNotFoundError) and exc.name == "ripples_pg._C":
        return (f"ripples_pg: the C extension ripples_pg._C is not built ({text}). In a source "
                f"checkout build it with: pip install --no-build-isolation -e . (or python "
                f"setup.py build_ext --inplace).")
    if "undefined symbol" in text:
        import torch  # late: the backend autoload imports us inside `import torch`

        return (f"ripples_pg: the C extension does not match the installed torch "
                f"{torch.__version__} ({text}); it was built against another torch build. "
                f"Rebuild it from source against this torch (pip install --no-build-isolation "
                f"<ripples_pg source directory>), or install the wheel built for this torch.")
    if "cannot open shared object file" in text:
        lib = text.split(":", 1)[0].strip()
        hint = ""
        if "zmq" in lib or "sodium" in lib or "pgm" in lib or "norm" in lib:
            hint = (" ripples_pg's wheels bundle libzmq; a source build links the system's "
                    "(Debian: apt-get install libzmq5).")
        elif "ucp" in lib or "ucs" in lib or "uct" in lib:
            hint = (" This build has the UCX transport and links the system's UCX "
                    "(Debian: apt-get install libucx0), or rebuild with -DRIPPLES_WITH_UCX=OFF.")
        return (f"ripples_pg: the C extension needs the shared library {lib}, which is not "
                f"installed or not on the loader's path ({text}).{hint}")
    return f"ripples_pg: could not load the C extension ripples_pg._C: {text}"


def load_extension():
    """The C extension ``ripples_pg._C``, loaded on first use after checking that it was built
    for the running torch (an extension for another torch fails with undefined symbols, or
    worse). Raises ImportError naming the cause."""
    err = torch_version_error()
    if err is not None:
        raise ImportError(err)
    import torch  # noqa: F401  (first: the extension links against the libraries torch loads)

    try:
        from .. import _C  # late: after the version check
    except (ImportError, OSError) as exc:
        raise ImportError(_load_error_message(exc)) from exc
    return _C
