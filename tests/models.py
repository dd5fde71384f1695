"""Models for the tests: the example models of the package (tensorplace.models, used by
tensorplace-bench too) and `Tricky`, a test-only model full of glue hazards."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tensorplace.models import Block, CausalSelfAttention, ConvBN, InceptionBlock, TinyGPT, TinyInception  # noqa: F401


class Tricky(nn.Module):
    """Glue that writes in place into earlier units' outputs, ``__setitem__``, functional
    dropout between modules, a module called twice, saved views, a buffer updated by glue, and an
    unsaved value read by one unit and then overwritten in place by the next."""

    def __init__(self, dim: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.shared = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)
        self.sig = nn.Sigmoid()
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(dim, classes)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        g = self.b(x)
        self.calls.add_(1)
        h.mul_(2)  # in place on a's output, in b's segment
        h[:, :2] = g[:, :2] * 0.5  # __setitem__ on it
        s = self.shared(torch.sin(h))
        s = F.dropout(s, 0.3, training=self.training)  # RNG in glue
        t = self.shared(s.t().contiguous().t())  # second call of the same module
        n = self.bn(t + g)
        side = self.sig(n)  # sigmoid saves its result, not n: n is a held input of sig
        u = self.act(n)  # ... which ReLU(inplace=True) then overwrites
        return self.head(u.view(u.shape[0], -1) + side)
