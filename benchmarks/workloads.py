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
  docs         the same model on *documents* of the same text -- its definitions (a
               ``def`` or ``class`` with its decorators), 2009 of them, 71 bytes to 10 KB
               long -- trained on each one's first --context bytes, while a batch costs what
               its documents padded to the longest (up to DOC_MAX_LEN) would cost an
               accelerator (``doc_cost``): the cost of a step varies from step to step and
               from worker to worker with the documents drawn, the imbalance sequence lengths
               make in real jobs (benchmarks/train.md, scenario ``doclen``)

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

WORKLOADS = ("digits", "cnn", "transformer", "docs")
# docs: batches drawn to estimate the mean padded length (every worker draws the same), and
# the longest a document counts in a batch's cost (a job's maximum sequence length; 30 % of the
# standard library's definitions are longer than 1 KB, 14 % of them past this)
DOC_COST_SAMPLES = 2000
DOC_MAX_LEN = 1024
DOC_EVAL = 128  # documents of the training and validation sets every evaluation scores

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
    # docs: each training example's length (its padding beyond it is left out of the loss),
    # and the mean longest length of a batch of ``batch`` examples (doc_cost's unit)
    lengths: object = None
    mean_batch_len: float = 0.0

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
    (B, T) for the language model; targets of -100 (docs' padding) are left out."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def loss_and_acc(out: torch.Tensor, y: torch.Tensor):
    real = y != -100
    acc = ((out.argmax(-1) == y) & real).float().sum() / real.float().sum().clamp(min=1)
    return loss_fn(out, y).item(), acc.item()


def load(args) -> Data:
    """The data of ``args.workload`` (the same on every worker; sharding is the caller's)."""
    if args.workload == "transformer":
        return load_text(args)
    if args.workload == "docs":
        return load_docs(args)
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


# ----------------------------------------------------------------------------- documents


def split_documents(text: bytes) -> list:
    """Python source as documents: a new one starts at every definition (a line that opens a
    ``def``, ``async def`` or ``class``, or a decorator, at any indentation), unless the line
    before did too (decorators stay with what they decorate). Blank ones are dropped."""
    docs, cur, opened = [], [], False
    for line in text.splitlines(keepends=True):
        starts = line.lstrip().startswith((b"def ", b"async def ", b"class ", b"@"))
        if starts and not opened and cur:
            docs.append(b"".join(cur))
            cur = []
        opened = starts
        cur.append(line)
    if cur:
        docs.append(b"".join(cur))
    return [d for d in docs if d.strip()]


def doc_windows(docs: list, context: int):
    """(x, y): each document's first ``context`` + 1 bytes as inputs and next-byte targets,
    (N, context) each, a short one padded with 0 in x and -100 in y (left out of the loss)."""
    n = len(docs)
    x = torch.zeros(n, context, dtype=torch.long)
    y = torch.full((n, context), -100, dtype=torch.long)
    for i, d in enumerate(docs):
        t = torch.frombuffer(bytearray(d[:context + 1]), dtype=torch.uint8).long()
        k = len(t) - 1
        x[i, :k], y[i, :k] = t[:-1], t[1:]
    return x, y


def mean_batch_len(lengths: torch.Tensor, batch: int, seed: int) -> float:
    """The mean over random batches of ``batch`` documents of the longest one's length: the
    padded length of an average batch (one generator, the same on every worker)."""
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    idx = torch.randint(0, n, (DOC_COST_SAMPLES, min(batch, n)), generator=g)
    return float(lengths[idx].max(dim=1).values.float().mean())


def doc_cost(data: "Data", lengths) -> float:
    """What a docs batch (its documents' lengths) costs relative to an average one: its
    padded tokens over the mean (batches have the same number of documents); 1.0 for the
    other workloads."""
    if lengths is None or not data.mean_batch_len:
        return 1.0
    return float(lengths.max()) / data.mean_batch_len


def load_docs(args) -> Data:
    """The docs workload: documents of the training modules; the model trains on the first
    --context bytes of each (a CPU cannot train this model on their whole length in the
    benchmark's time), and a batch costs what its documents padded to the longest would cost
    an accelerator, up to DOC_MAX_LEN bytes each (``doc_cost``)."""
    docs = split_documents(read_modules(LM_TRAIN_FILES))
    x, y = doc_windows(docs, args.context)
    lengths = torch.tensor([min(len(d), DOC_MAX_LEN) for d in docs])
    # validation: the held-out modules' documents, as the training ones are seen
    vx, vy = doc_windows(split_documents(read_modules(LM_VALID_FILES)), args.context)
    va = evenly(torch.arange(len(vx)), DOC_EVAL)
    ev = evenly(torch.arange(len(x)), DOC_EVAL)
    return Data(x, y, vx[va], vy[va], x[ev], y[ev],
                lambda: TinyGPT(args.width, args.layers, args.context), lengths=lengths,
                mean_batch_len=mean_batch_len(lengths, args.batch_size, args.seed))
