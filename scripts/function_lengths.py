#!/usr/bin/env python3
"""Lists functions longer than a limit: C/C++ in csrc/, coordinator/, shim/, benchmarks/ and
fuzz/, Python in the package (ripples_pg/), scripts/, benchmarks/, examples/ and tests/.

Our C and C++ put a function's opening line and its closing brace at column 0, so a function
is the text from a column-0 header holding "(" to the next column-0 "}". A Python function
(or method) is measured by its syntax tree, from its ``def`` to its last line, less its
docstring: documentation is not code to split. Table-like functions (a field list, a flag
list) may be longer; they are named in ALLOWED with the reason, as "path:name" (or a bare
name, for every function of that name).

    python3 scripts/function_lengths.py            # report, exit 1 if any is over
    python3 scripts/function_lengths.py --all      # every function, longest first
"""
import argparse
import ast
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DIRS = ("csrc", "coordinator", "shim", "benchmarks", "fuzz")
PY_DIRS = ("ripples_pg", "scripts", "benchmarks", "examples", "tests")
LIMIT = 80
# "path:name" (or name) -> why it may be longer than LIMIT (one entry per table-like function)
ALLOWED = {
    "benchmarks/digits_worker.py:parse_args": "the worker's flag table (argparse, one "
    "add_argument per flag with its help) and the checks between flags",
    "benchmarks/train.py:parse_args": "the benchmark's flag table (argparse, one add_argument "
    "per flag with its help) and the checks between flags",
}

_NOT_FUNCTION = re.compile(r"^(struct|enum|union|namespace|extern|class|typedef)\b|=\s*\{$")


def functions(path: pathlib.Path):
    """Yields (name, first line, length in lines) of each function defined in path."""
    lines = path.read_text(errors="replace").splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        # A header starts at column 0 and names a function: "type name(" ... ") {".
        if line[:1] in ("", " ", "\t", "#", "/", "}", "*") or _NOT_FUNCTION.search(line) \
                or "(" not in line:
            i += 1
            continue
        j = i
        while j < len(lines) and not lines[j].rstrip().endswith(("{", ";", "}")) \
                and j - i < 12:
            j += 1
        if j >= len(lines) or not lines[j].rstrip().endswith("{") \
                or _NOT_FUNCTION.search(lines[j].strip()):
            i = j + 1
            continue
        header = " ".join(lines[i:j + 1])
        name = re.findall(r"([A-Za-z_][\w:~]*)\s*\(", header)
        end = j + 1
        while end < len(lines) and not lines[end].startswith("}"):
            end += 1
        yield (name[0] if name else "?"), i + 1, end - i + 1
        i = end + 1


def py_functions(path: pathlib.Path):
    """Yields (name, first line, length in lines less the docstring) of each function and
    method defined in a Python file (nested ones too, named outer.inner)."""
    tree = ast.parse(path.read_text(errors="replace"), str(path))

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = child.end_lineno - child.lineno + 1
                doc = child.body[0] if child.body else None
                if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and \
                        isinstance(doc.value.value, str):
                    n -= doc.end_lineno - doc.lineno + 1
                yield prefix + child.name, child.lineno, n
                yield from walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")

    yield from walk(tree, "")


def scan():
    for d in DIRS:
        base = ROOT / d
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            if path.suffix in (".c", ".cpp", ".h", ".hpp") and "build" not in path.parts:
                for name, line, n in functions(path):
                    yield path.relative_to(ROOT), name, line, n
    for d in PY_DIRS:
        base = ROOT / d
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            if "build" not in path.parts:
                for name, line, n in py_functions(path):
                    yield path.relative_to(ROOT), name, line, n


def allowed(path: pathlib.Path, name: str) -> bool:
    """Whether ALLOWED names the function ``name`` of ``path`` (relative to ROOT)."""
    return name in ALLOWED or f"{path.as_posix()}:{name}" in ALLOWED


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="print every function, longest first")
    ap.add_argument("--limit", type=int, default=LIMIT)
    args = ap.parse_args()
    found = sorted(scan(), key=lambda r: -r[3])
    over = [r for r in found if r[3] > args.limit and not allowed(r[0], r[1])]
    for path, name, line, n in (found if args.all else over):
        print(f"{n:5d}  {path}:{line}  {name}")
    for name, why in ALLOWED.items():
        if not args.all:
            print(f"allowed  {name}: {why}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
