"""How the benchmarks store a run's results: its table as Markdown (what the docs show) beside
the record it was made from as JSON (what comparisons and re-renders read), written one way."""
import json
import os


def store(out_dir: str, name: str, md: str, record) -> None:
    """Writes ``md`` to <out_dir>/<name>.md and ``record`` to <out_dir>/<name>.json."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(record, f, indent=1)

