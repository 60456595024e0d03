"""Shared by tests/test_diloco.py and its torchft worker (tests/_diloco_torchft.py): the model,
the inner optimizer and the fixed data sequence of each rank, so that partial DiLoCo, the
in-process reference and torchft's DiLoCo train on exactly the same thing."""
import torch
import torch.nn as nn

IN, HID, OUT = 6, 8, 3


def make_model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, OUT))


def make_inner(params):
    # inner state (momentum) stays local, as in DiLoCo
    return torch.optim.SGD(params, lr=0.05, momentum=0.5)


_TEACHER = torch.Generator().manual_seed(99)
_W = torch.randn(IN, OUT, generator=_TEACHER)


def batch(rank: int, step: int):
    """Rank ``rank``'s batch at inner step ``step``: a fixed, known sequence (a linear
    teacher with a tanh), different on every rank."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, IN, generator=g)
    return x, torch.tanh(x @ _W)


def loss_of(model, x, y):
    return (model(x) - y).square().mean()


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def reference_diloco(ranks, H: int, rounds: int, lr=0.7, momentum=0.9):
    """Global DiLoCo, simulated in one process: one replica per rank in ``ranks`` (each on
    that rank's data, with its own inner optimizer); every H steps the pseudo-gradients
    anchor - theta_i are averaged and one Nesterov SGD steps the (shared) anchor; every replica
    restarts from it. Returns the anchor (flat) after every outer step."""
    ranks = list(ranks)
    world = len(ranks)
    models = [make_model() for _ in range(world)]
    inners = [make_inner(m.parameters()) for m in models]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    outer = torch.optim.SGD(anchor, lr=lr, momentum=momentum, nesterov=True)
    out = []
    step = 0
    for _ in range(rounds):
        for _ in range(H):
            for r, m, o in zip(ranks, models, inners):
                x, y = batch(r, step)
                o.zero_grad()
                loss_of(m, x, y).backward()
                o.step()
            step += 1
        with torch.no_grad():
            for i, a in enumerate(anchor):
                a.grad = sum(a - list(m.parameters())[i] for m in models) / world
            outer.step()
            outer.zero_grad()
            for m in models:
                for p, a in zip(m.parameters(), anchor):
                    p.copy_(a)
        out.append(torch.cat([a.detach().reshape(-1).clone() for a in anchor]))
    return out
