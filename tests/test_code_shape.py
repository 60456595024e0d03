"""The code's shape stays as the design says: no C, C++ or Python function longer than the limit
of scripts/function_lengths.py except the table-like ones it names."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_function_over_the_limit():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "function_lengths.py")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, "functions over the limit (split them by job):\n" + r.stdout


def test_the_scanner_finds_functions():
    # A check that finds nothing passes vacuously: it must see the core's known functions.
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "function_lengths.py"),
                        "--all"], capture_output=True, text=True, timeout=60)
    names = {line.split()[-1] for line in r.stdout.splitlines() if line.strip()}
    assert {"rpl_comm_create", "coord_core_handle", "ProcessGroupRipples::submit"} <= names
    assert {"wrap", "RipplesAverager.__init__", "RipplesStrategy.__init__"} <= names
    assert len(names) > 300


def test_python_lengths_leave_out_docstrings(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import function_lengths
    finally:
        sys.path.pop(0)
    src = tmp_path / "m.py"
    src.write_text('def f():\n    """Doc\n    more doc\n    """\n    a = 1\n    return a\n\n\n'
                   'class C:\n    def g(self):\n        def h():\n            pass\n'
                   '        return h\n')
    got = {name: n for name, _, n in function_lengths.py_functions(src)}
    assert got == {"f": 3, "C.g": 4, "C.g.h": 2}
