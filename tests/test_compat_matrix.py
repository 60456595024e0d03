"""docs/compatibility.md is generated from the cells in scripts/compat_matrix.py: it must be up
to date, and every test a cell names must exist."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_compatibility_matrix_is_generated_and_its_tests_exist():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compat_matrix.py"),
                          "--check"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
