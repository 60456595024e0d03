"""The torch-version contract (docs/install.md): the extension is tied to the torch minor
version it was built against (recorded in ripples_pg/_build_info.py); importing ripples_pg
with another torch is a clear ImportError before the extension is loaded, torch's backend
autoload only warns, and creating a group then raises the same error. Plus the messages for
an extension that fails to load.

Each case runs in a fresh interpreter with a stand-in ``ripples_pg._build_info`` module, so the
recorded version is whatever the case needs, whatever this checkout's build recorded.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ripples_pg.backend._extension as extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNING = ".".join(torch.__version__.split("+")[0].split(".")[:2])


def _run(code: str, built: str) -> subprocess.CompletedProcess:
    """Runs ``code`` after installing a _build_info that says the build was for ``built``."""
    prelude = textwrap.dedent(f"""
        import sys, types
        info = types.ModuleType("ripples_pg._build_info")
        info.TORCH_VERSION = {built!r}
        info.TORCH_VERSION_FULL = {built + ".0"!r}
        sys.modules["ripples_pg._build_info"] = info
    """)
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=240)


def _other_minor() -> str:
    major, minor = (int(p) for p in RUNNING.split("."))
    return f"{major}.{minor + 1}"


def test_import_with_another_torch_is_a_clear_import_error():
    other = _other_minor()
    res = _run("""
        try:
            import ripples_pg
        except ImportError as exc:
            print("IMPORTERROR", exc)
            print("LOADED", "ripples_pg._C" in sys.modules)
        else:
            print("NO ERROR")
    """, other)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "IMPORTERROR" in out, out
    assert f"compiled against torch {other}" in out, out      # the built version
    assert torch.__version__ in out, out                       # the running one
    assert "--no-build-isolation" in out, out                  # what to do
    assert f"torch>={other},<" in out, out
    assert "LOADED False" in out, out  # checked before the extension was loaded


def test_autoload_only_warns_and_group_creation_raises():
    """Inside torch's autoload (torch._import_device_backends) the import must not fail
    `import torch`: it registers the backend and warns; creating a group raises the error."""
    res = _run("""
        import tempfile, warnings
        import torch
        import torch.distributed as dist

        def _import_device_backends():  # the name torch's autoload loader has
            import ripples_pg
            ripples_pg._autoload()

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _import_device_backends()
        print("WARNED", any("compiled against torch" in str(w.message) for w in caught))
        import ripples_pg
        print("REGISTERED", ripples_pg.is_registered())
        store = dist.FileStore(tempfile.mktemp(), 1)
        try:
            dist.init_process_group("ripples", store=store, rank=0, world_size=1)
        except ImportError as exc:
            print("GROUP IMPORTERROR", "compiled against torch" in str(exc))
        else:
            print("GROUP CREATED")
        print("LOADED", "ripples_pg._C" in sys.modules)
    """, _other_minor())
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "WARNED True" in out, out + res.stderr
    assert "REGISTERED True" in out, out
    assert "GROUP IMPORTERROR True" in out, out + res.stderr
    assert "LOADED False" in out, out


def test_matching_torch_imports():
    res = _run("""
        import ripples_pg
        print("OK", ripples_pg._version_error is None)
    """, RUNNING)
    assert res.returncode == 0, res.stderr
    assert "OK True" in res.stdout, res.stdout


def test_load_error_messages_name_the_cause():
    exc = OSError("libzmq.so.5: cannot open shared object file: No such file or directory")
    msg = extension._load_error_message(exc)
    assert "libzmq.so.5" in msg and "bundle libzmq" in msg, msg

    exc = ImportError("/x/_C.so: undefined symbol: _ZN3c106detail14torchCheckFailEPKc")
    msg = extension._load_error_message(exc)
    assert "does not match the installed torch" in msg and torch.__version__ in msg, msg
    assert "--no-build-isolation" in msg, msg

    exc = ModuleNotFoundError("No module named 'ripples_pg._C'", name="ripples_pg._C")
    msg = extension._load_error_message(exc)
    assert "not built" in msg and "build_ext --inplace" in msg, msg


def test_major_minor():
    assert extension._major_minor("2.13.0+cpu") == "2.13"
    assert extension._major_minor("2.4.1") == "2.4"
    assert extension._major_minor("2.14.0a0+git1234") == "2.14"


def test_build_records_the_torch_it_compiled_against():
    """A built checkout (python setup.py build_ext --inplace, pip install -e .) has the
    record next to the extension, naming this torch."""
    import glob

    import ripples_pg

    pkg = os.path.dirname(ripples_pg.__file__)
    if not glob.glob(os.path.join(pkg, "_C*.so")) or \
            not os.path.exists(os.path.join(pkg, "_build_info.py")):
        pytest.skip("extension built before the torch version was recorded (rebuild it)")
    from ripples_pg import _build_info

    assert _build_info.TORCH_VERSION == RUNNING
    assert _build_info.TORCH_VERSION_FULL == torch.__version__


def test_type_hints_marker_ships_in_wheel_and_sdist():
    """PEP 561: the package has its py.typed marker, and the build configuration carries it
    into the wheel (package-data) and the sdist (MANIFEST.in). tests/wheel/test_smoke.py checks
    that an installed wheel has it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    assert os.path.isfile(os.path.join(ROOT, "ripples_pg", "py.typed"))
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["ripples_pg"], package_data
    with open(os.path.join(ROOT, "MANIFEST.in")) as f:
        assert "include ripples_pg/py.typed" in f.read().splitlines()
