"""The keys of ripples_pg.stats() come from the core's tables (RPL_COMM_COUNTERS,
RPL_PARTIAL_STATS in csrc/ripples.h, the shim's SHIM_COUNTERS): the dicts a group returns hold
exactly those keys, in that order, and docs/stats.md is generated from them."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_docs_stats_md_is_generated_from_the_tables():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "stats_doc.py"), "--check"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_groups_dicts_hold_exactly_the_tables_keys(tmp_path):
    code = textwrap.dedent(f"""
        import json, torch, torch.distributed as dist
        import ripples_pg
        from ripples_pg.backend._api import _ripples_backend
        from ripples_pg.backend._extension import load_extension
        dist.init_process_group("ripples", store=dist.FileStore({str(tmp_path / "s")!r}, 1),
                                rank=0, world_size=1)
        t = torch.ones(4)
        dist.all_reduce(t)
        with ripples_pg.partial():
            dist.all_reduce(t)
        be = _ripples_backend()
        print(json.dumps({{"fields": load_extension().stats_fields(),
                           "counters": list(be.counters()),
                           "partial": list(be.partial_stats()),
                           "stats": list(ripples_pg.stats()),
                           "ops": be.counters()["ops_completed"],
                           "rounds": be.partial_stats()["rounds"]}}))
        dist.destroy_process_group()
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    import json

    got = json.loads(r.stdout.strip().splitlines()[-1])
    fields = got["fields"]
    assert got["counters"] == [k for a, k, _ in fields if a == "counters"]
    assert got["partial"] == [k for a, k, _ in fields if a == "partial_stats"]
    assert all(doc.strip() for _, _, doc in fields)  # every key says what it counts
    assert set(got["counters"]) | set(got["partial"]) <= set(got["stats"])
    assert got["ops"] >= 2 and got["rounds"] == 1  # the values are the struct's, not zeros
