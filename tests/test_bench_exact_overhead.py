"""benchmarks/exact_overhead.py's arithmetic on made-up records (fast): the paired
differences are taken block by block and per phase, the "cpu" column is the phases' sum, and
the report says when a wrapped model left its exact steps. The launches themselves are a
benchmark (no timing is asserted here)."""
import pytest

import _dist


def bench():
    return _dist.load_benchmark("bench_exact_overhead", "exact_overhead.py")


def _rec(ddp, wrap, exact=True, bg=None):
    return {"blocks": {"ddp": ddp, "wrap": wrap}, "exact": exact,
            "background_ms_per_step": bg or {}}


def test_paired_differences_per_phase_and_block():
    b = bench()
    # rows: forward, backward, optimizer, wall; wrap's backward 0.5 ms cheaper, its optimizer
    # 0.1 ms dearer in every block, while the host drifts by whole milliseconds between blocks
    ddp = [[2.0, 4.0, 1.0, 9.0], [3.0, 6.0, 2.0, 13.0], [2.5, 5.0, 1.5, 11.0]]
    wrap = [[f, bw - 0.5, o + 0.1, w + 0.2] for f, bw, o, w in ddp]
    s = b.summarize([_rec(ddp, wrap, bg={"rpl-prog-0:11": 0.2}),
                     _rec(ddp, wrap, bg={"rpl-prog-0:12": 0.4})])
    assert s["diff"]["forward"] == pytest.approx(0.0)
    assert s["diff"]["backward"] == pytest.approx(-0.5)
    assert s["diff"]["optimizer"] == pytest.approx(0.1)
    assert s["diff"]["cpu"] == pytest.approx(-0.4)
    assert s["diff"]["wall"] == pytest.approx(0.2)
    assert s["ddp"]["cpu"] == pytest.approx(9.0)  # the middle block's 2.5 + 5.0 + 1.5
    assert s["wrap"]["backward"] == pytest.approx(4.5)
    assert s["background_ms_per_step"] == {"rpl-prog-0": pytest.approx(0.3)}
    assert s["exact"] is True


def test_report_flags_a_variant_that_left_warmup():
    b = bench()
    rows = [[2.0, 4.0, 1.0, 9.0], [2.0, 4.0, 1.0, 9.0]]
    doc = {"command": "python benchmarks/exact_overhead.py", "workers": 2, "host": "h",
           "cpus": 2, "when": "now", "torch": "x", "blocks": 2, "steps": 5,
           "results": {"even": b.summarize([_rec(rows, rows)]),
                       "every_step": b.summarize([_rec(rows, rows, exact=False)])}}
    md = b.render(doc)
    assert "| even | forward | 2.000 | 2.000 | +0.000" in md
    assert "**no**" in md
    doc["results"].pop("every_step")
    assert "still exact at the end: yes." in b.render(doc)


def test_unknown_variant_is_refused():
    b = bench()
    with pytest.raises(SystemExit):
        b.main(["--variants", "even,nope", "--out", "/nonexistent"])
