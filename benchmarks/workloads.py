"""The data and models of benchmarks/digits_worker.py (--workload), all without a download.

  digits       scikit-learn's 8x8 digits (1797 images, 10 classes); an MLP (--model mlp,
               --hidden) or a small plain CNN (--model cnn)
  cnn          a ResNet-style CNN with BatchNorm (a stem and three residual blocks, --width
               channels) on the same digits: BatchNorm's running statistics are buffers that
               data-parallel training has to keep consistent across workers
  transformer  a small causal Transformer language model (pre-LayerNorm blocks, --layers,
               --width, --context bytes) predicting the next byte of Python source code: the
               standard library's own files, present wherever Python is. A fixed list of
               long-lived modules is the training text; three other modules are held out for
               the validation loss

Every workload is a classification problem to the training loop: inputs x and targets y,
cross-entropy of model(x) against y over the last dimension (the LM predicts a class per
position). ``Data.evaluate`` gives the numbers every evaluation records.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

WORKLOADS = ("digits", "cnn", "transformer")

# The language model's text. Modules that every Python 3 since 3.8 ships, long enough to
# matter; a missing one (a trimmed installation) is skipped. The validation modules are
# held out whole: the loss on them is a loss on code the model never saw.
LM_TRAIN_FILES = ("argparse.py", "ast.py", "collections/__init__.py", "configparser.py",
                  "dataclasses.py", "difflib.py", "enum.py", "functools.py", "inspect.py",
                  "pathlib.py", "subprocess.py", "tarfile.py", "threading.py", "typing.py",
                  "zipfile.py")
LM_VALID_FILES = ("shutil.py", "textwrap.py", "tempfile.py")
LM_EVAL_WINDOWS = 48  # windows of the training and validation text every evaluation scores
CNN_EVAL_IMAGES = 512  # training images whose loss an evaluation of the cnn reports


@dataclass
class Data:
    """Training and test tensors (first dimension: examples) and the model to train.
    ``xev, yev``: the training examples whose loss an evaluation reports (all of them for
    the digits MLP; a fixed sample for the cnn and the text, whose full sets would make the
    evaluations after training take longer than the training)."""
    xtr: torch.Tensor
    ytr: torch.Tensor
    xte: torch.Tensor
    yte: torch.Tensor
    xev: torch.Tensor
    yev: torch.Tensor
    make_model: object  # () -> nn.Module

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict:
        """The model's loss on the training examples ``xev`` ("loss"), and its loss and
        accuracy on the test set ("test_loss", "acc"), in eval mode (BatchNorm's running
        statistics, not the batch's)."""
        was_training = model.training
        model.eval()
        try:
            test_loss, acc = loss_and_acc(model(self.xte), self.yte)
            train_loss, _ = loss_and_acc(model(self.xev), self.yev)
        finally:
            model.train(was_training)
        return {"loss": train_loss, "acc": acc, "test_loss": test_loss}


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension: (B, C) against (B,), or (B, T, C) against
    (B, T) for the language model."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def loss_and_acc(out: torch.Tensor, y: torch.Tensor):
    return loss_fn(out, y).item(), (out.argmax(-1) == y).float().mean().item()


def load(args) -> Data:
    """The data of ``args.workload`` (the same on every worker; sharding is the caller's)."""
    if args.workload == "transformer":
        return load_text(args)
    xtr, ytr, xte, yte = load_digits_split(args.seed)
    if args.workload == "cnn":  # a convolution costs more: the training loss on a sample
        xev, yev = evenly(xtr, CNN_EVAL_IMAGES), evenly(ytr, CNN_EVAL_IMAGES)
        return Data(xtr, ytr, xte, yte, xev, yev, lambda: ResNet(args.width))
    return Data(xtr, ytr, xte, yte, xtr, ytr, lambda: make_digits_model(args.model, args.hidden))


def evenly(w: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` rows spread evenly over ``w``: a fixed sample of the whole set (of the whole
    text, not its first module only)."""
    return w[torch.linspace(0, len(w) - 1, min(n, len(w))).long()]


# ----------------------------------------------------------------------------- digits


def load_digits_split(seed: int, test_fraction: float = 0.2):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=test_fraction, random_state=seed,
                                          stratify=y)
    return (torch.from_numpy(xtr), torch.from_numpy(ytr).long(),
            torch.from_numpy(xte), torch.from_numpy(yte).long())


def make_digits_model(kind: str, hidden: int) -> nn.Module:
    if kind == "mlp":
        return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                             nn.ReLU(), nn.Linear(hidden, 10))
    if kind == "cnn":
        return nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 16, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    raise ValueError(f"unknown model {kind!r}")


class Block(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm, and a shortcut (a strided
    1x1 convolution with BatchNorm where the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.short(x))


class ResNet(nn.Module):
    """A ResNet for 8x8 inputs: stem, a block at 8x8, a strided block to 4x4 with twice the
    channels, a block at 4x4, global average pooling, a linear classifier."""

    def __init__(self, width: int = 16, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(Block(width, width), Block(width, 2 * width, 2),
                                    Block(2 * width, 2 * width))
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = self.blocks(self.stem(x.view(-1, 1, 8, 8)))
        return self.head(x.mean((2, 3)))


# ----------------------------------------------------------------------------- text


def stdlib_dir() -> str:
    return os.path.dirname(os.__file__)


def read_modules(names) -> bytes:
    out = []
    for name in names:
        try:
            with open(os.path.join(stdlib_dir(), name), "rb") as f:
                out.append(f.read())
        except OSError:
            continue
    if not out:
        raise SystemExit(f"--workload transformer: none of {', '.join(names)} found in "
                         f"{stdlib_dir()}")
    return b"\n".join(out)


def windows(text: bytes, context: int) -> torch.Tensor:
    """Non-overlapping windows of context + 1 bytes, as int64 (N, context + 1)."""
    t = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    n = (len(t) - 1) // (context + 1)
    return t[:n * (context + 1)].view(n, context + 1)


def load_text(args) -> Data:
    tr = windows(read_modules(LM_TRAIN_FILES), args.context)
    va = evenly(windows(read_modules(LM_VALID_FILES), args.context), LM_EVAL_WINDOWS)
    ev = evenly(tr, LM_EVAL_WINDOWS)
    return Data(tr[:, :-1], tr[:, 1:], va[:, :-1], va[:, 1:], ev[:, :-1], ev[:, 1:],
                lambda: TinyGPT(args.width, args.layers, args.context))


class Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(
            2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A byte-level GPT: token and position embeddings, ``layers`` blocks, a final
    LayerNorm and a linear head over the 256 byte values."""

    def __init__(self, width: int = 64, layers: int = 2, context: int = 64):
        super().__init__()
        heads = max(1, width // 32)
        self.tok = nn.Embedding(256, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.Sequential(*[TransformerBlock(width, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256)
        for m in self.modules():  # GPT-2's initialisation: small weights, zero biases
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        nn.init.normal_(self.pos, std=0.02)
        for blk in self.blocks:  # residual projections scaled down by depth (GPT-2)
            nn.init.normal_(blk.attn.proj.weight, std=0.02 / math.sqrt(2 * layers))
            nn.init.normal_(blk.mlp[2].weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx):
        x = self.tok(idx) + self.pos[:idx.shape[1]]
        return self.head(self.ln(self.blocks(x)))
