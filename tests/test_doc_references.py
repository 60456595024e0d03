"""Every document the code cites exists in the repository: a path such as ``docs/x.md`` or
``coordinator/PROTOCOL.md`` in a source, test, benchmark or script file resolves, a
``docs/design.md §N`` names a section that docs/design.md has, and nothing cites a document
outside the repository (the design notes the project started from, a tool's notes)."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIRS = ("csrc", "coordinator", "shim", "fuzz", "ripples_pg", "tests", "benchmarks", "scripts",
        "examples", ".ci")
EXTS = (".c", ".h", ".cpp", ".py", ".sh", ".txt", ".cmake")
TOP = ("docs", "benchmarks", "coordinator", "csrc", "examples", "fuzz", "shim", "tests",
       "scripts")
PATH = re.compile(r"\b((?:%s)/[A-Za-z0-9_./-]*[A-Za-z0-9_-]\.md)\b" % "|".join(TOP))
SECTION = re.compile(r"docs/design\.md §(\d+)")
# (The raw straggler traces do live outside: benchmarks/traces/derive.py reads them from there.)
OUTSIDE = re.compile(r"DESIGN(?:\.md)?[ §]|/work/\.library|shared/(?:DESIGN|notes|papers)")


def _sources():
    for d in DIRS:
        for base, dirs, files in os.walk(os.path.join(ROOT, d)):
            dirs[:] = [x for x in dirs if x not in ("__pycache__", "results")]
            for f in files:
                if f.endswith(EXTS) or f in ("Makefile", "CMakeLists.txt", "run"):
                    yield os.path.join(base, f)
    yield os.path.join(ROOT, "Makefile")


def test_cited_documents_exist():
    with open(os.path.join(ROOT, "docs", "design.md")) as f:
        sections = set(re.findall(r"^## (\d+)\.", f.read(), re.M))
    bad = []
    for path in _sources():
        if os.path.abspath(path) == os.path.abspath(__file__):
            continue
        with open(path, errors="replace") as f:
            text = f.read()
        rel = os.path.relpath(path, ROOT)
        for m in PATH.finditer(text):
            if not os.path.exists(os.path.join(ROOT, m.group(1))):
                bad.append(f"{rel}: {m.group(1)} does not exist")
        for m in SECTION.finditer(text):
            if m.group(1) not in sections:
                bad.append(f"{rel}: docs/design.md has no §{m.group(1)}")
        for m in OUTSIDE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            bad.append(f"{rel}:{line}: cites a document outside the repository "
                       f"({m.group(0).strip()!r})")
    assert not bad, "\n".join(bad)
