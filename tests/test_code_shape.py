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
    assert {"rpl_comm_create", "coord_core_handle", "Submitter::submit"} <= names
    assert {"wrap", "RipplesAverager.__init__", "RipplesStrategy.__init__"} <= names
    # the Python of benchmarks/, examples/ and tests/ too
    assert {"run_world", "print_result", "task_wrap_bn"} <= names
    assert len(names) > 300


def _function_lengths():
    """scripts/function_lengths.py as a module."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import function_lengths
    finally:
        sys.path.pop(0)
    return function_lengths


def test_python_lengths_leave_out_docstrings(tmp_path):
    function_lengths = _function_lengths()
    src = tmp_path / "m.py"
    src.write_text('def f():\n    """Doc\n    more doc\n    """\n    a = 1\n    return a\n\n\n'
                   'class C:\n    def g(self):\n        def h():\n            pass\n'
                   '        return h\n')
    got = {name: n for name, _, n in function_lengths.py_functions(src)}
    assert got == {"f": 3, "C.g": 4, "C.g.h": 2}


def test_allowed_names_one_file():
    # a table-like function is allowed where it is, not every function of its name
    import pathlib

    function_lengths = _function_lengths()
    assert function_lengths.allowed(pathlib.Path("benchmarks/train.py"), "parse_args")
    assert not function_lengths.allowed(pathlib.Path("benchmarks/other.py"), "parse_args")


# Package modules a function may import instead of the module's top: each must wait for
# something an import of the package must not do (torch's backend autoload imports it inside
# `import torch`), or is optional.
LAZY_IMPORTS = {
    "_C": "the C extension: loaded with the first group, after _extension.py checks it",
    "_build_info": "written by the build: absent in a checkout without one",
    "coordinator": "loads the extension's coordinator: only for an embedded one",
    "lightning": "Lightning is optional: registered only once Lightning itself is imported",
}


def _package_imports():
    """(module, imported package module, inside a function?) for every import in ripples_pg/
    of a module of the package itself."""
    import ast

    pkg = os.path.join(ROOT, "ripples_pg")
    mods = {f[:-3] for f in os.listdir(pkg) if f.endswith(".py")}
    out = []
    for mod in sorted(mods):
        tree = ast.parse(open(os.path.join(pkg, mod + ".py")).read())

        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                inside = in_function or isinstance(child, (ast.FunctionDef,
                                                           ast.AsyncFunctionDef))
                if isinstance(child, ast.If) and getattr(child.test, "id", "") == "TYPE_CHECKING":
                    continue  # never runs
                targets = []
                if isinstance(child, ast.ImportFrom) and child.level == 1:
                    targets = [child.module.split(".")[0]] if child.module else \
                        [a.name for a in child.names]
                elif isinstance(child, ast.ImportFrom) and (child.module or "").startswith(
                        "ripples_pg."):
                    targets = [child.module.split(".")[1]]
                elif isinstance(child, ast.Import):
                    targets = [a.name.split(".")[1] for a in child.names
                               if a.name.startswith("ripples_pg.")]
                out.extend((mod, t, inside) for t in targets)
                visit(child, inside)

        visit(tree, False)
    return mods, out


def test_no_import_cycle_even_through_functions():
    # A cycle closed by an import inside a function still ties both layers together: each
    # layer imports only those below it.
    mods, imports = _package_imports()
    graph = {m: {t for f, t, _ in imports if f == m and t in mods and t != "__init__"}
             for m in mods}
    cycles = []

    def dfs(start, node, path):
        for nxt in graph[node]:
            if nxt == start:
                cycles.append(path + [nxt])
            elif nxt > start and nxt not in path:
                dfs(start, nxt, path + [nxt])

    for m in sorted(graph):
        dfs(m, m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
    assert graph["_wrap"] >= {"_api", "averager", "hooks"}  # the scan sees imports


def test_function_level_imports_only_where_they_must_wait():
    _, imports = _package_imports()
    late = sorted({(m, t) for m, t, inside in imports if inside and t not in LAZY_IMPORTS})
    assert not late, f"imports inside functions with no reason to wait: {late}"
    assert any(t == "_C" and inside for _, t, inside in imports)  # the scan sees them


# The package's layers, lowest first (docs/design.md, section 6): a module imports only modules
# of its own layer or below. A new module must be placed here.
LAYERS = [
    ("base", {"options", "_extension", "_build_info", "attribution", "whatif", "_records",
              "_incarnation", "_schedstat", "_moments", "_optimizers"}),
    ("backend", {"_api", "_gg", "coordinator", "_group_coordinators", "_backend", "_groups"}),
    ("training", {"_args", "overlap", "progress", "sampler", "lr", "hooks", "averager",
                  "diloco", "_wrap", "checkpoint"}),
    ("integrations and tools", {"lightning", "_pl", "_pl_progress", "_pl_checkpoint",
                                "_pl_autoregister", "hf", "report", "schedule",
                                "_gg_cli"}),
    ("the package's face", {"__init__"}),
]


def test_layers_import_downward_only():
    mods, imports = _package_imports()
    level = {m: i for i, (_, ms) in enumerate(LAYERS) for m in ms}
    unplaced = sorted(mods - set(level))
    assert not unplaced, f"modules in no layer of LAYERS (place them): {unplaced}"
    up = sorted({(m, t) for m, t, _ in imports
                 if t in level and t != "__init__" and level[t] > level[m]})
    assert not up, f"imports of a higher layer (module, imported): {up}"
