"""What the documentation generators (options_doc.py, stats_doc.py) share: write a generated
page, or, with --check, say whether it is up to date."""
import argparse
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def check_args(description: str, argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    return ap.parse_args(argv)


def write_or_check(path: pathlib.Path, text: str, check: bool, script: str) -> int:
    """Writes ``text`` to ``path``, or with ``check`` returns 1 (saying so) if it differs."""
    name = path.relative_to(ROOT)
    if check:
        if not path.exists() or path.read_text() != text:
            print(f"{name} is out of date: run python scripts/{script}")
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {name}")
    return 0
