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


class _Wrapper:  # Accelerate's and Ripples' wrappers keep the optimizer as .optimizer
    def __init__(self, inner):
        self.optimizer = inner


class _LightningLike:
    def __init__(self, inner):
        self._optimizer = inner


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
    lambda p: _Wrapper(torch.optim.AdamW(p)), lambda p: _LightningLike(torch.optim.AdamW(p)),
    lambda p: _Wrapper(_Wrapper(torch.optim.NAdam(p)))])
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
