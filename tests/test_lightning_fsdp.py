"""RipplesStrategy with a model sharded by FSDP2 in ``configure_model``: refused by name.

Lightning's docs shard a model in ``LightningModule.configure_model`` (``fully_shard`` on its
layers, for ModelParallelStrategy). Under RipplesStrategy -- a DDPStrategy whose replicas are
whole models -- such a model must fail at fit setup with a TypeError naming the sharding and
pointing to ``ripples_pg.fsdp`` (docs/fsdp.md), on every rank, not with DDP's obscure error on
its DTensors (or a hang). Real processes, the harness of tests/test_lightning.py.
"""
from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import test_lightning as tl  # noqa: E402  (the harness: data, module, process launcher)


def _worker(scenario, out_dir):
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    import ripples_pg.lightning as rl
    pl = rl.pl
    rank = int(os.environ["LOCAL_RANK"])
    ws = int(os.environ["TEST_WORLD_SIZE"])

    class ShardedNet(tl._module_cls(pl)):
        def configure_model(self):  # as Lightning's docs shard (mesh: the default, 1-D)
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            fully_shard(self)

    trainer = pl.Trainer(strategy=rl.RipplesStrategy(timeout=30), max_steps=3, logger=False,
                         enable_checkpointing=False, accelerator="cpu", devices=ws,
                         num_nodes=1, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    try:
        trainer.fit(ShardedNet(), torch.utils.data.DataLoader(tl._data(), batch_size=32))
        result = {"error": None, "global_step": trainer.global_step}
    except Exception as exc:  # noqa: BLE001 - what the user sees is the result
        result = {"error": f"{type(exc).__name__}: {exc}"}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


try:  # skip cleanly without Lightning (either package)
    import lightning.pytorch  # noqa: F401
except ImportError:
    pytest.importorskip("pytorch_lightning")
pytest.importorskip("sklearn")


@pytest.mark.slow
def test_fully_shard_in_configure_model_is_refused_on_every_rank(tmp_path):
    res = tl.run_job("sharded", 2, str(tmp_path), script=os.path.abspath(__file__))
    for r in res:  # every rank exited (no hang) with the same, clear error
        err = r["error"]
        assert err is not None and err.startswith("TypeError: RipplesStrategy: "), r
        assert "sharded with FSDP2 (fully_shard)" in err and "configure_model" in err, err
        assert "ripples_pg.fsdp.wrap()" in err and "docs/fsdp.md" in err, err
        assert "RipplesFSDPStrategy" in err, err  # the Lightning strategy that trains it
        assert "got mixed torch.Tensor and DTensor" not in err, err  # not DDP's error
    assert res[0] == res[1]


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
