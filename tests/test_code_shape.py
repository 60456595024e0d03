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


# The package's layers, lowest first (docs/design.md, section 6), each a folder of ripples_pg/:
# a module imports only modules of its own layer or below. The top folder holds the face
# (__init__, the public paths of ripples_pg/_public.py) and the extension with its build record.
LAYERS = ["", "backend", "training", "integrations", "tools", "face"]
SAME_LEVEL = {"tools": "integrations"}   # neither imports the other
BASE = {"_C", "_build_info"}             # the top folder's lowest modules


def _layer(mod: str) -> str:
    """The layer of a module named relative to ripples_pg ("training._wrap", "averager")."""
    if "." in mod or mod in LAYERS:
        return mod.split(".")[0]
    return "" if mod in BASE else "face"


# Imports a function may make instead of the module's top: each must wait for something an
# import of the package must not do (torch's backend autoload imports the package inside
# `import torch`), or is an optional dependency. A module of the package, with the reason:
LAZY_IMPORTS = {
    "_C": "the C extension: loaded with the first group, after backend/_extension.py checks it",
    "_build_info": "written by the build: absent in a checkout without one",
    "backend.coordinator": "loads the extension's coordinator: only for an embedded one",
    "integrations.lightning": "Lightning is optional: registered once Lightning itself is imported",
}
# Other packages, with the reason and the layers whose modules may wait for them:
LAZY_EXTERNAL = {
    "torch": ("`import ripples_pg` runs inside `import torch` (the backend autoload): the "
              "modules it imports wait for torch", {"", "backend", "face"}),
    "matplotlib": ("optional: only `report --png` draws", {"tools"}),
}


def _modules():
    """{name relative to ripples_pg: path} of every module of the package."""
    import pathlib

    pkg = pathlib.Path(ROOT, "ripples_pg")
    out = {}
    for path in sorted(pkg.rglob("*.py")):
        parts = path.relative_to(pkg).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    out.setdefault("_C", None)
    return out


def _target(mods, name: str):
    """The package module an import of ``name`` (relative to ripples_pg) loads: the longest
    known prefix."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in mods:
            return ".".join(parts[:n])
    return None


def _imports_of(mod: str, path, mods):
    """(imported, inside a function?, external?) for every import a module makes."""
    import ast

    tree = ast.parse(path.read_text())
    here = mod.split(".")[:-1] if path.name != "__init__.py" else mod.split(".")
    here = [] if mod == "__init__" else here
    out = []

    def names(node):
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if node.level:
            base = here[:len(here) - (node.level - 1)] + ([node.module] if node.module else [])
            base = "ripples_pg" + "".join("." + b for b in base)
        else:
            base = node.module
        return [f"{base}.{a.name}" for a in node.names] + ([base] if node.module else [])

    def visit(node, inside):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", "") == "TYPE_CHECKING":
                continue  # never runs
            now = inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found = set()
                for n in names(child):
                    if n.startswith("ripples_pg."):
                        t = _target(mods, n[len("ripples_pg."):])
                        if t is not None:
                            found.add((t, False))
                    elif n.split(".")[0] not in ("__future__",):
                        found.add((n.split(".")[0], True))
                out.extend((t, inside, ext) for t, ext in found)
            visit(child, now)

    visit(tree, False)
    return out


def _package_imports():
    """(module, imported, inside a function?, external?) for every import in ripples_pg/."""
    mods = _modules()
    return mods, [(m, t, inside, ext) for m, path in mods.items() if path is not None
                  for t, inside, ext in _imports_of(m, path, mods)]


def test_no_import_cycle_even_through_functions():
    # A cycle closed by an import inside a function still ties both layers together: each
    # layer imports only those below it.
    mods, imports = _package_imports()
    graph = {m: {t for f, t, _, ext in imports if f == m and not ext and t != m}
             for m in mods}
    cycles = []

    def dfs(start, node, path):
        for nxt in graph.get(node, ()):
            if nxt == start:
                cycles.append(path + [nxt])
            elif nxt > start and nxt not in path:
                dfs(start, nxt, path + [nxt])

    for m in sorted(graph):
        dfs(m, m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
    # the scan sees imports, relative ones across folders too
    assert graph["training._wrap"] >= {"backend._api", "training.averager", "training.hooks"}


def test_function_level_imports_only_where_they_must_wait():
    _, imports = _package_imports()
    late = sorted({(m, t) for m, t, inside, ext in imports if inside and not (
        (not ext and t in LAZY_IMPORTS) or
        (ext and t in LAZY_EXTERNAL and _layer(m) in LAZY_EXTERNAL[t][1]))})
    assert not late, f"imports inside functions with no reason to wait: {late}"
    assert any(t == "_C" and inside for _, t, inside, _ in imports)  # the scan sees them
    assert any(t == "torch" and inside and ext for _, t, inside, ext in imports)


def test_function_level_imports_say_why():
    # each late import says why it waits, on its line or on the import just above it (a run
    # of imports shares one reason)
    import ast

    silent = []
    for m, path in _modules().items():
        if path is None:
            continue
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    n = node.lineno - 1
                    while "#" not in lines[n] and n > 0 and \
                            lines[n - 1].strip().startswith(("import ", "from ")):
                        n -= 1
                    if "#" not in lines[n]:
                        silent.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not silent, f"imports inside functions that do not say why they wait: {silent}"


def test_layers_import_downward_only():
    mods, imports = _package_imports()
    unplaced = sorted(m for m in mods if _layer(m) not in LAYERS)
    assert not unplaced, f"modules outside the layers' folders (place them): {unplaced}"

    def level(m):
        layer = _layer(m)
        return LAYERS.index(SAME_LEVEL.get(layer, layer))

    up = sorted({(m, t) for m, t, _, ext in imports
                 if not ext and t != "__init__" and level(t) > level(m)})
    assert not up, f"imports of a higher layer (module, imported): {up}"
    assert ("training._wrap", "backend._api") in {(m, t) for m, t, _, _ in imports}


def test_public_paths_are_the_modules_of_the_layers():
    # ripples_pg.averager (and each public path of the face) is the module in its folder: one
    # module object, so a class, a global or a monkeypatch is the same through either name.
    import importlib
    import re

    mods = _modules()
    face = sorted(m for m in mods if _layer(m) == "face" and not m.startswith("_"))
    assert {"averager", "lightning", "hf", "report", "options"} <= set(face)
    for m in face:
        text = mods[m].read_text()
        real = re.search(r'alias\(__name__, "ripples_pg\.([\w.]+)"\)', text).group(1)
        assert real.split(".")[-1] == m and _layer(real) != "face", (m, real)
        if m in ("lightning", "hf"):
            continue  # their frameworks are optional (tests/test_lightning.py, test_hf.py)
        assert importlib.import_module(f"ripples_pg.{m}") is \
            importlib.import_module(f"ripples_pg.{real}")
