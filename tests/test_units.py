"""Unit discovery and saved-tensor ownership (cuda_exec.units)."""

from __future__ import annotations

from typing import Dict

import pytest
import torch
from torch import nn

import models  # noqa: E402
from cuda_exec.units import (  # noqa: E402
    UnitRecord,
    UnitTracker,
    discover_units,
    sequence_mismatch,
    unit_kind,
)

torchvision = pytest.importorskip("torchvision")


def track(model: nn.Module, *args: torch.Tensor, units=None) -> UnitTracker:
    with UnitTracker(model, units) as tr:
        out = model(*args)
    out.sum().backward()
    return tr


def by_name(tr: UnitTracker) -> Dict[str, UnitRecord]:
    return {r.name: r for r in tr.records}


def nbytes(*shape: int, dtype: torch.dtype = torch.float32) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


# ----------------------------------------------------------------------------- discovery


def test_leaves_by_default_and_coarse_units() -> None:
    gpt = models.TinyGPT(layers=2)
    leaves = discover_units(gpt)
    assert all(not list(m.children()) for m in leaves)
    assert "blocks.0.attn.qkv" in leaves.values()
    coarse = discover_units(gpt, [models.Block])
    names = set(coarse.values())
    assert {"blocks.0", "blocks.1", "tok", "pos", "drop", "ln_f", "head"} == names
    one = discover_units(gpt, [gpt.blocks[1].attn])
    assert "blocks.1.attn" in one.values() and "blocks.1.attn.qkv" not in one.values()
    assert "blocks.0.attn.qkv" in one.values()
    lin = nn.Linear(3, 3)
    assert discover_units(lin) == {lin: "(root)"}


def test_kinds() -> None:
    assert unit_kind(nn.Conv2d(1, 1, 1)) == "conv"
    assert unit_kind(nn.BatchNorm2d(1)) == "norm"
    assert unit_kind(nn.LayerNorm(2)) == "norm"
    assert unit_kind(nn.ReLU()) == "activation"
    assert unit_kind(nn.MaxPool2d(2)) == "pool"
    assert unit_kind(nn.Dropout()) == "dropout"
    assert unit_kind(nn.Embedding(2, 2)) == "embedding"
    assert unit_kind(nn.Linear(2, 2)) == "linear"
    assert unit_kind(nn.MultiheadAttention(4, 2)) == "attention"


def test_reused_module_gives_one_unit_per_call() -> None:
    tr = track(torchvision.models.resnet18(num_classes=10), torch.randn(2, 3, 32, 32))
    names = [r.name for r in tr.records]
    assert names.count("layer1.0.relu") == 1 and "layer1.0.relu#1" in names
    r = by_name(tr)["layer1.0.relu#1"]
    assert r.call == 1 and r.module_name == "layer1.0.relu"
    assert [r.index for r in tr.records] == list(range(len(tr.records)))
    assert len(tr.records) == 60


# ----------------------------------------------------------------------------- ownership


def test_resnet_inplace_relu_owns_its_output_and_bn_does_not() -> None:
    tr = track(torchvision.models.resnet18(num_classes=10), torch.randn(2, 3, 32, 32))
    r = by_name(tr)
    act = nbytes(2, 64, 16, 16)
    # conv1's output is saved by bn1: conv1 owns it
    assert r["conv1"].act_bytes == act and r["conv1"].output_saved and r["conv1"].read_by == [1]
    assert r["conv1"].model_inputs == [0] and r["conv1"].inputs == []
    # bn1 only owns its saved mean and invstd; its output is overwritten by relu
    assert r["bn1"].act_bytes == 2 * nbytes(64) and not r["bn1"].output_saved
    # ReLU(inplace=True) produced the current version of bn1's storage: it owns it
    assert r["relu"].inplace and r["relu"].act_bytes == act and r["relu"].output_saved
    assert r["relu"].read_by == [3, 2]  # maxpool saves it, relu itself saves its result
    # nobody saves bn1's output before relu overwrites it: held if relu is recomputed
    assert r["relu"].held_input_bytes == act
    # maxpool owns its output and its indices
    pooled = nbytes(2, 64, 8, 8)
    assert r["maxpool"].act_bytes == pooled + nbytes(2, 64, 8, 8, dtype=torch.int64)
    # the skip connection: the glue `out += identity` after bn2 reads maxpool's output
    assert r["layer1.0.bn2"].inputs == [3, 7]
    assert r["layer1.0.relu#1"].inplace
    # parameters are never activations
    assert all(r_.act_bytes < 10 * act for r_ in tr.records)
    assert r["fc"].act_bytes == 0 and r["fc"].inputs == [r["avgpool"].index]


def test_views_are_owned_by_the_producer_and_counted_once() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(4, 4)
            self.c = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)  # (6, 8)
            v = h.view(6, 2, 4)[:, 1, :]  # a strided view of a's output
            g = self.b(v)  # saves the view
            w = h.t().sin()  # glue: saves another view of a's output, produces a new tensor
            return g.sum() + self.c(w.t()).sum()

    tr = track(M(), torch.randn(6, 8))
    r = by_name(tr)
    assert r["a"].act_bytes == nbytes(6, 8)  # one storage, saved through two different views
    assert r["a"].saved_tensors == 2
    assert r["a"].read_by == [1]  # b saves one view; the glue after b (b's segment) saves the other
    # sin's output was produced by glue in b's segment: b owns it, c saves it
    assert r["b"].act_bytes == nbytes(6, 8) and r["b"].read_by == [2]
    assert r["c"].inputs == [1]


def test_glue_results_belong_to_the_last_finished_unit() -> None:
    gpt = models.TinyGPT(layers=1, dropout=0.1)
    tr = track(gpt, torch.randint(0, 50, (2, 16)))
    r = by_name(tr)
    qkv = r["blocks.0.attn.qkv"]
    drop = r["blocks.0.attn.attn_drop"]
    proj = r["blocks.0.attn.proj"]
    # the glue after qkv (q @ k^T, the causal mask, softmax) saves tensors qkv owns, among
    # them the softmax output and the mask comparison
    assert qkv.act_bytes >= nbytes(2, 4, 16, 16) + nbytes(1, 1, 16, 16, dtype=torch.bool)
    assert qkv.read_by == [qkv.index]
    assert drop.inputs == [qkv.index]
    # the glue after attn_drop computes att @ v and the head merge, whose result proj saves
    assert proj.inputs == [drop.index] and proj.act_bytes == 0
    assert r["blocks.0.attn.attn_drop"].output_saved
    # the residual add reads the block input (the embedding dropout's output)
    assert r["blocks.0.attn.resid_drop"].inputs == [r["drop"].index, proj.index]
    # the tokens are model input 0; the position embedding reads torch.arange made before any unit
    assert r["tok"].model_inputs == [0] and r["pos"].model_inputs == []
    # v is a view of qkv's output that nobody saves (matmul saved a copy): held by attn_drop
    assert drop.held_input_bytes == nbytes(2, 16, 96)
    # but the softmax output attn_drop reads is among qkv's saved tensors, although qkv's module
    # output is not: a replay of attn_drop needs qkv's activations (chained recomputation)
    assert not qkv.output_saved and drop.saved_inputs == [qkv.index]
    assert proj.saved_inputs == [drop.index]
    assert r["blocks.0.attn.resid_drop"].saved_inputs == [r["drop"].index]  # proj's output is held


def test_inplace_glue_makes_the_segment_unit_owner() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.c = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            g = self.b(x)
            h.mul_(2)  # glue in b's segment: a new version of a's storage, owned by b
            return self.c(torch.sin(h) + g)  # sin saves h; c saves sin(h) + g

    tr = track(M(), torch.randn(3, 4))
    r = by_name(tr)
    assert r["a"].act_bytes == 0 and not r["a"].output_saved
    assert r["b"].act_bytes == 2 * nbytes(3, 4) and r["b"].read_by == [2, 1]
    assert r["b"].inputs == [0]  # its glue reads a's output
    assert r["c"].inputs == [1]


def test_held_inputs_are_inputs_nobody_saves() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.drop = nn.Dropout(0.5)
            self.relu = nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return self.relu(self.drop(h))  # dropout saves its mask, not its input

    tr = track(M(), torch.randn(5, 4))
    r = by_name(tr)
    assert r["drop"].held_input_bytes == nbytes(5, 4)
    assert r["relu"].held_input_bytes == nbytes(5, 4)  # relu saves its result, not its input
    assert r["lin"].held_input_bytes == 0  # the model input is kept by the caller


def test_parameters_and_buffers_are_not_activations() -> None:
    m = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    tr = track(m, torch.randn(2, 64))
    r = tr.records
    # Linear saves its input (a model input) and its weight: neither is an activation it owns;
    # its output is saved by LayerNorm
    assert r[0].act_bytes == nbytes(2, 64) and r[0].read_by == [1] and r[0].saved_tensors == 1
    # LayerNorm saves its input (owned by the Linear), weight, bias, and its mean and rstd
    assert r[1].act_bytes == 2 * nbytes(2, 1) and r[1].inputs == [0]


# ----------------------------------------------------------------------------- control flow and cleanup


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:
            h = self.c(h)
        return self.b(h)


def test_changed_unit_sequence_is_detected() -> None:
    m = Branchy()
    with torch.no_grad():
        m.a.bias.fill_(10.0)
    seq1 = track(m, torch.ones(2, 4)).sequence()
    with torch.no_grad():
        m.a.bias.fill_(-10.0)
    seq2 = track(m, torch.ones(2, 4)).sequence()
    assert seq1 == [("a", "linear"), ("c", "activation"), ("b", "linear")]
    assert sequence_mismatch(seq1, seq1) is None
    msg = sequence_mismatch(seq1, seq2)
    assert msg is not None and "unit 1" in msg


def test_tracker_removes_everything_on_exceptions() -> None:
    class Fail(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("inside a unit")

    m = nn.Sequential(nn.Linear(2, 2), Fail())
    with pytest.raises(ValueError):
        with UnitTracker(m):
            m(torch.randn(1, 2))
    for mod in m.modules():
        assert not mod._forward_hooks and not mod._forward_pre_hooks
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert torch._C._len_torch_function_stack() == 0
    tr = UnitTracker(m)
    with tr:
        pass
    with pytest.raises(RuntimeError):
        tr.__enter__()  # one tracker, one forward
