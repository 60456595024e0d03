"""What a partial step is worth by optimizer and job size (ripples_pg.training._worth): the
warm-up exit's bar is a gain in time to the same model, so an adaptive optimizer, whose partial
steps are worth less as the job grows, needs a larger gain in steps per second."""
import pytest
import torch

from ripples_pg.training._worth import adaptive_optimizer, partial_step_worth


def _params():
    return [torch.nn.Parameter(torch.ones(3))]


def _stepped(opt):
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    opt.step()
    return opt


class _Wrapper:
    """A wrapper as Accelerate's (``optimizer``), Lightning's (``_optimizer``) or
    ZeroRedundancyOptimizer's and Ripples' own (``optim``) keep theirs: its own face proxies
    the inner optimizer's groups and state."""

    def __init__(self, inner, attr="optimizer"):
        setattr(self, attr, inner)
        self.param_groups, self.state = inner.param_groups, inner.state


def _listed(*optimizers):
    from ripples_pg.training._optimizers import OptimizerList

    return OptimizerList(list(optimizers))


class _ThirdPartyAdam(torch.optim.Optimizer):
    """Not a torch.optim class, but Adam's state names: counted once it has stepped."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st.setdefault("exp_avg_sq", torch.zeros_like(p)).mul_(0.9).add_(p.grad ** 2)
                p.data.add_(-group["lr"] * p.grad / (st["exp_avg_sq"].sqrt() + 1e-8))


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.AdamW(p), lambda p: torch.optim.Adam(p), lambda p: torch.optim.Adagrad(p),
    lambda p: torch.optim.RMSprop(p), lambda p: torch.optim.Adamax(p),
    lambda p: _Wrapper(torch.optim.AdamW(p)), lambda p: _Wrapper(torch.optim.AdamW(p), "optim"),
    lambda p: _Wrapper(torch.optim.AdamW(p), "_optimizer"),
    lambda p: _Wrapper(_Wrapper(torch.optim.NAdam(p), "optim")),
    lambda p: _listed(torch.optim.SGD(p, lr=0.1, momentum=0.9), torch.optim.AdamW(_params())),
    lambda p: _listed(torch.optim.AdamW(p), torch.optim.SGD(_params(), lr=0.1))])
def test_adaptive_optimizers_are_recognised(make):
    assert adaptive_optimizer(make(_params()))


@pytest.mark.parametrize("make", [lambda p: torch.optim.SGD(p, lr=0.1),
                                  lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                  lambda p: _Wrapper(torch.optim.SGD(p, lr=0.1))])
def test_sgd_is_not_adaptive_and_a_step_keeps_its_worth(make):
    opt = make(_params())
    assert not adaptive_optimizer(opt)
    assert all(partial_step_worth(opt, n) == 1.0 for n in (2, 4, 8, 16, 64))
    inner = getattr(opt, "optimizer", opt)
    _stepped(inner)  # momentum state is not a per-coordinate normaliser
    assert not adaptive_optimizer(opt)


def test_only_attributes_that_hold_an_optimizer_are_followed():
    class NamedSGD(torch.optim.SGD):
        def __init__(self, params):
            super().__init__(params, lr=0.1)
            self.optimizer = "adamw"  # a label, not an optimizer: not followed

    class NamedAdamW(torch.optim.AdamW):
        def __init__(self, params):
            super().__init__(params)
            self.optim = object()

    assert not adaptive_optimizer(NamedSGD(_params()))
    assert adaptive_optimizer(NamedAdamW(_params()))
    assert not adaptive_optimizer(object()) and not adaptive_optimizer("adamw")


def test_a_third_party_optimizer_counts_by_its_state_once_it_has_stepped():
    opt = _ThirdPartyAdam(_params())
    assert not adaptive_optimizer(opt)  # unknown class, no state yet
    assert adaptive_optimizer(_stepped(opt))
    assert partial_step_worth(opt, 8) < 1.0


def test_no_optimizer_or_one_worker_is_worth_a_step():
    assert partial_step_worth(None, 8) == 1.0
    assert partial_step_worth(torch.optim.AdamW(_params()), 1) == 1.0


def test_an_adaptive_step_is_worth_less_as_the_job_grows():
    opt = torch.optim.AdamW(_params())
    sizes = [2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 1024]
    worth = [partial_step_worth(opt, n) for n in sizes]
    assert all(a >= b for a, b in zip(worth, worth[1:])), worth
    assert all(0.6 <= w < 1.0 for w in worth), worth
    # the measured points (ripples_pg/training/_worth.py says where from)
    assert partial_step_worth(opt, 4) == pytest.approx(0.93)
    assert partial_step_worth(opt, 8) == pytest.approx(0.79)
    assert partial_step_worth(opt, 4) > partial_step_worth(opt, 6) > partial_step_worth(opt, 8)


@pytest.mark.parametrize("worth,ends", [(None, True), (0.96, False)])
def test_fsdp_replica_groups_ask_the_gain_over_the_worth(monkeypatch, worth, ends):
    # two replica groups at 10 and 11.5 ms a step: a gain of 1.075, above 1.05 but below 1.05
    # over an AdamW step's worth between 2 replica groups (1.094). The exchange is replaced by
    # those times; the penalty is the one this rank's row carries.
    import ripples_pg.training._fsdp_warmup as fw

    def fixed_times(row, k, group):
        return [[0.01] * k, [0.0115] * k], 0.0, 0.0, float(row[k + 2])

    monkeypatch.setattr(fw, "gather_warmup_rows", fixed_times)
    warm = fw.ReplicaWarmup(None, None, 1, torch.device("cpu"), 1.05,
                            None if worth is None else (lambda: worth))
    try:
        results = [warm.check(step) for step in range(8)]
    finally:
        warm.close()
    assert warm.gain == pytest.approx(1.0749, rel=1e-3)
    assert warm.need == pytest.approx(1.05 if worth is None else 1.05 / worth)
    assert any(r is not None for r in results) == ends, results
