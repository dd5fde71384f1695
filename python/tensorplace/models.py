"""Small example models (sized for a 2-core CPU), used by tensorplace-bench and the tests.

* :class:`TinyInception`: branches joined with ``torch.cat``, BatchNorm, in-place ReLU, pooling,
  dropout, functional glue between modules.
* :class:`TinyGPT`: a GPT-style transformer (token and position embeddings, causal self-attention
  with dropout written with functional glue: view, transpose, matmul, masked_fill, softmax;
  LayerNorm, GELU MLP, residual adds, tied-free head).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class ConvBN(nn.Module):
    def __init__(self, cin: int, cout: int, k: int, padding: int = 0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


class InceptionBlock(nn.Module):
    def __init__(self, cin: int, c1: int, c3: int, c5: int, cp: int) -> None:
        super().__init__()
        self.b1 = ConvBN(cin, c1, 1)
        self.b3a = ConvBN(cin, c3, 1)
        self.b3b = ConvBN(c3, c3, 3, padding=1)
        self.b5a = ConvBN(cin, c5, 1)
        self.b5b = ConvBN(c5, c5, 3, padding=1)
        self.b5c = ConvBN(c5, c5, 3, padding=1)
        self.pool = nn.MaxPool2d(3, stride=1, padding=1)
        self.bp = ConvBN(cin, cp, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.b1(x)
        b = self.b3b(self.b3a(x))
        c = self.b5c(self.b5b(self.b5a(x)))
        d = self.bp(self.pool(x))
        out = torch.cat([a, b, c, d], dim=1)
        return out * torch.sigmoid(out.mean(dim=(2, 3), keepdim=True))  # functional gating glue


class TinyInception(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = ConvBN(3, 16, 3, padding=1)
        self.block1 = InceptionBlock(16, 8, 12, 4, 4)
        self.down = nn.MaxPool2d(2)
        self.block2 = InceptionBlock(28, 12, 16, 8, 8)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(44, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.block1(x)
        x = self.down(x)
        x = self.block2(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(self.drop(x))


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, block: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        self.register_buffer("mask", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_drop(att)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, block: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, block, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.out(self.act(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 32, heads: int = 4, layers: int = 2, block: int = 16,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(dim, heads, block, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))
