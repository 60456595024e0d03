"""Smoke test of an installed ripples_pg: what scripts/wheel-check.sh runs in a fresh virtualenv
that holds only torch, pytest and the wheel, from a directory outside the repository.

The functional checks (2 real processes: exact collectives against gloo, partial rounds, the
coordinator CLI) pass on any working install and also run in the main suite. The checks of
the installed wheel itself (imported from the venv, not the source tree; libzmq and its
dependencies bundled, nothing else needed from the system; torch pinned to the minor version it
was built for; no UCX) run only when RIPPLES_WHEEL_CHECK=1 (set by wheel-check.sh): a dev
build links the system's libraries and has no wheel metadata. Standard library, torch and
pytest only: nothing from the repository's test helpers.
"""
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import ripples_pg

HERE = os.path.dirname(os.path.abspath(__file__))
WHEEL_CHECK = os.environ.get("RIPPLES_WHEEL_CHECK") == "1"
wheel_only = pytest.mark.skipif(not WHEEL_CHECK, reason="checks of an installed wheel: "
                                "scripts/wheel-check.sh (RIPPLES_WHEEL_CHECK=1)")

# What an extension in the wheel may need from the system: glibc, the C++ runtime (the
# manylinux policies' own list) and torch's libraries (from the torch package). Everything
# else must be in the wheel.
SYSTEM_LIBS = {
    "libc.so.6", "libm.so.6", "libdl.so.2", "librt.so.1", "libpthread.so.0", "libresolv.so.2",
    "libutil.so.1", "libnsl.so.1", "ld-linux-x86-64.so.2", "libstdc++.so.6", "libgcc_s.so.1",
}
TORCH_LIB = re.compile(r"^lib(torch[a-z_]*|c10[a-z_]*|shm)\.so$")


def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


# ----------------------------------------------------------------------------- functional


def test_two_ranks_exact_collectives_and_partial_rounds(tmp_path):
    worker = os.path.join(HERE, "_smoke_worker.py")
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, worker, str(r), "2", store], cwd=str(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    log = "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{o}"
                    for r, (p, o) in enumerate(zip(procs, outs)))
    for r, out in enumerate(outs):
        lines = [line for line in out.splitlines() if line.startswith("CHECK ")]
        failed = [line for line in lines if not line.endswith(" ok")]
        assert not failed, log
        names = {line.split()[1] for line in lines}
        want = {"backend", "all_reduce_sum_f32", "all_reduce_max_i64", "all_reduce_sum_f64",
                "broadcast", "all_gather", "partial_round_0", "partial_round_1",
                "partial_round_2", "partial_stats"}
        assert names == want, f"rank {r} ran {sorted(names)}\n{log}"
    assert all(p.returncode == 0 for p in procs), log


def _coordinator_script():
    path = os.path.join(os.path.dirname(sys.executable), "ripples-coordinator")
    if not os.path.exists(path):
        if WHEEL_CHECK:
            pytest.fail(f"the wheel did not install the console script {path}")
        pytest.skip("ripples-coordinator is not installed (pip install -e . installs it)")
    return path


@pytest.mark.parametrize("how", ["script", "module"])
def test_coordinator_cli_help(how, tmp_path):
    cmd = [_coordinator_script()] if how == "script" else \
        [sys.executable, "-m", "ripples_pg.coordinator"]
    res = _run(cmd + ["--help"], cwd=str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    text = res.stdout + res.stderr
    assert "usage: ripples-coordinator --workers N" in text, text
    assert "--status ENDPOINT" in text, text


# ----------------------------------------------------------------------------- the wheel


@wheel_only
def test_imported_from_the_venv_not_the_source_tree():
    pkg = os.path.realpath(os.path.dirname(ripples_pg.__file__))
    assert pkg.startswith(os.path.realpath(sys.prefix) + os.sep), \
        f"ripples_pg imported from {pkg}, not from the venv {sys.prefix}"
    assert glob.glob(os.path.join(pkg, "_C*.so")), os.listdir(pkg)
    # PEP 561: type checkers read the package's hints only with this marker beside it
    assert os.path.isfile(os.path.join(pkg, "py.typed")), os.listdir(pkg)


def _dynamic(path):
    """(NEEDED entries, RUNPATH/RPATH directories with $ORIGIN resolved) of an ELF file."""
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.fail("readelf (binutils) is needed to check the wheel's libraries")
    out = _run([readelf, "-d", path]).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
    dirs = []
    for m in re.findall(r"\((?:RUNPATH|RPATH)\)\s+Library (?:runpath|rpath): \[([^\]]+)\]", out):
        for d in m.split(":"):
            dirs.append(os.path.normpath(d.replace("$ORIGIN", os.path.dirname(path))))
    return needed, dirs


@wheel_only
def test_extension_needs_nothing_from_the_system_but_glibc_cxx_runtime_and_torch():
    from ripples_pg import _C

    bundled_dir = os.path.realpath(sys.prefix)
    seen, todo, bundled = set(), [os.path.realpath(_C.__file__)], []
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        needed, dirs = _dynamic(path)
        for name in needed:
            if name in SYSTEM_LIBS or TORCH_LIB.match(name):
                continue
            found = [os.path.join(d, name) for d in dirs if os.path.exists(os.path.join(d, name))]
            assert found, (f"{os.path.basename(path)} needs {name}, which is neither glibc, the "
                           f"C++ runtime, torch's nor bundled in the wheel (searched {dirs})")
            lib = os.path.realpath(found[0])
            assert lib.startswith(bundled_dir + os.sep), f"{name} resolves outside the venv: {lib}"
            bundled.append(name)
            todo.append(lib)
    # libzmq (the Group Generator's transport) is among the bundled libraries.
    assert any(n.startswith("libzmq") for n in bundled), bundled
    assert not any(n.startswith(("libucp", "libucs", "libuct")) for n in bundled), bundled


@wheel_only
def test_loaded_libzmq_is_the_bundled_one():
    from ripples_pg import _C  # noqa: F401

    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libzmq" in line}
    assert paths, "libzmq is not mapped after loading the extension"
    prefix = os.path.realpath(sys.prefix) + os.sep
    assert all(os.path.realpath(p).startswith(prefix) for p in paths), paths


@wheel_only
def test_wheel_requires_the_torch_minor_it_was_built_for():
    from importlib.metadata import requires

    from ripples_pg import _build_info

    major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert _build_info.TORCH_VERSION == f"{major}.{minor}"
    reqs = [r.replace(" ", "") for r in requires("ripples_pg") or []]
    torch_reqs = [r for r in reqs if re.match(r"torch\b", r) and "extra==" not in r]
    assert len(torch_reqs) == 1, reqs
    assert set(torch_reqs[0][len("torch"):].split(",")) == \
        {f">={major}.{minor}", f"<{major}.{minor + 1}"}, torch_reqs


@wheel_only
def test_no_ucx_in_the_wheel():
    assert ripples_pg.has_ucx() is False


@wheel_only
def test_torch_autoload_registers_the_backend(tmp_path):
    """The wheel's torch.backends entry point: `import torch` alone registers "ripples"."""
    res = _run([sys.executable, "-c",
                "import torch, torch.distributed as d; print('HAS', hasattr(d.Backend, 'RIPPLES'))"],
               cwd=str(tmp_path))
    assert res.returncode == 0 and "HAS True" in res.stdout, res.stdout + res.stderr
