"""Builtin example profiles: modelled training steps of the six CNNs HOME evaluates.

These are *modelled* profiles, not measurements. Each model is rebuilt layer by layer from its
published architecture, every layer's output shape is computed, and sizes and times follow from
the shapes, the parameter counts and the device model below. They exist so the planner can be
run, tested and benchmarked without a GPU or a profiler; a profile measured by the profiler on a
real device replaces them for any real decision.

Models (`names()`), at their default input size, 1000 classes unless noted:

    name           units  parameters  architecture
    vgg16             40  138357544   VGG configuration D (Simonyan & Zisserman 2015), no BN,
                                      7x7 adaptive average pool before the classifier (as
                                      torchvision), two dropout layers; 224x224 input
    resnet50         175   25557032   ResNet-50 (He et al. 2016), bottleneck blocks [3, 4, 6, 3],
                                      stride on the 3x3 conv ("v1.5", as torchvision), projection
                                      shortcut (1x1 conv + BN) in the first block of each stage;
                                      224x224 input
    mobilenet_v1      84    4231976   MobileNet v1 (Howard et al. 2017, the one HOME cites), width
                                      1.0, 13 depthwise-separable blocks, BN + ReLU; 224x224 input
    mobilenet_v2     153    3504872   MobileNetV2 (Sandler et al. 2018), width 1.0, inverted
                                      residual blocks with ReLU6, residual adds where stride 1 and
                                      channels match, dropout 0.2 before the classifier; 224x224
    squeezenet        66    1248424   SqueezeNet v1.0 (Iandola et al. 2016), fire2..fire9,
                                      max pools after conv1, fire4, fire8 (ceil mode), dropout,
                                      conv10, global average pool; 224x224 input
    plain20           60     269722   the 20-layer plain CIFAR network of He et al. 2016 (sec. 4.2):
                                      3x3 conv 16, then 3 stages of 6 3x3 convs (16, 32, 64
                                      channels, stride 2 entering stages 2 and 3), each conv
                                      followed by BN and ReLU, global average pool, fc; 32x32
                                      input, 10 classes
    inception_v3     314   23834568   Inception-v3 (Szegedy et al. 2016) as torchvision builds it:
                                      Mixed_5b..Mixed_7c with the four branches of each module,
                                      factorised 1x7/7x1 and 1x3/3x1 convolutions, each conv
                                      followed by BN (eps 1e-3) and ReLU as three units; the
                                      auxiliary classifier is left out (aux_logits=False);
                                      299x299 input

Every model ends with a `loss` unit (cross-entropy: log-softmax + NLL) reading the logits and the
labels (model input 1); the images are model input 0.

Units. One unit per layer invocation: conv, batch norm (kind `norm`), ReLU/ReLU6 (`activation`),
max/average pool (`pool`), linear, dropout, residual add (kind `add`, two inputs), channel concat
(kind `concat`), loss (kind `loss`). Flatten is a view and is not a unit; the linear layer after
it reads the pooling unit directly. Layers are modelled as not in-place (`inplace=False`).

What autograd saves (checked against torch's autograd for each op, fp32 everywhere):
- conv, linear: their input (owned by the input's producer) and their weight (a parameter, not
  counted);
- batch norm: its input, plus its own per-channel save_mean and save_invstd (2 x C x 4 bytes);
- ReLU: its output; ReLU6 (hardtanh, not in place): its input;
- max pool: its input and its own int64 indices (8 bytes per output element);
- average pool with a window (3x3 branch pools, VGG's 7x7 adaptive pool): its input; global
  average pool to 1x1 (a mean): nothing;
- dropout: its own mask, 1 byte per element (the CUDA fused kernel's bool mask);
- add, concat: nothing;
- loss: its own log-softmax output (the labels are a model input).
Ownership follows docs/formats.md: a saved tensor belongs to the unit that produced it, so a
unit's `act_bytes` = its output (if anyone saves it) + the extra tensors it saves of its own;
`read_by` lists every unit whose backward reads them (the consumers that save the output, and the
unit itself when it saves its output or owns extra tensors); `output_saved` says whether the
output is among them; `held_input_bytes` is the sum of the outputs of its input units that
nobody saves.

Sizes. `output_bytes` = 4 x batch x elements per sample (the loss output is one fp32 scalar).
`grad_bytes` = 4 x parameter count of the layer (weights, biases, BN affine). `fwd_transient_bytes`
= 0 (no scratch is modelled; cuDNN workspaces are not). `bwd_transient_bytes` = the gradient of
the output + the gradients of the unit inputs (none for the model input). `memory.parameters` =
4 x parameter count; `memory.optimizer_state` = 0 for "sgd" (no momentum), 4 per parameter for
"momentum", 8 per parameter for "adam"; `memory.inputs` = the image batch (fp32) + the labels
(int64); `memory.workspace` = 0. `measured` is empty: nothing was measured.

Device models (`DEVICE_MODELS`), a roofline per kernel:
    time = launch + max(flops / flop_rate, bytes moved / bandwidth)
- "gpu-model" (default), an RTX 2080 Ti-class GPU (HOME's platform): 13.4 TFLOP/s fp32 peak,
  616 GB/s; modelled at flop_rate 8.0e12 FLOP/s (60% of peak) for conv and linear, bandwidth
  4.5e11 B/s (73% of peak) for everything memory-bound, launch 5 us per kernel; host link PCIe 3.0
  x16: d2h = h2d = 12e9 B/s.
- "cpu-model", a small multicore CPU: flop_rate 1.0e11, bandwidth 1.0e10, launch 2 us, copies
  to the host tier 5e9 B/s each way.
Per layer (n = elements of the tensor named, B = batch, F = forward FLOPs):
- conv / linear: F = 2 x B x output elements x (input channels / groups) x kernel area
  (x in_features for linear); forward moves input + output + weights; backward is two kernels
  (input gradient and weight gradient) of F FLOPs each, so 2x forward, and only the weight
  gradient (1x) when the input is the model input;
- batch norm: forward moves 3 x n (statistics pass, normalise pass), backward 5 x n;
- ReLU / ReLU6: forward 2 x n, backward 3 x n;
- max pool: forward input + output + indices, backward input (zeroing) + output gradient +
  indices + input gradient;
- average pool: forward input + output, backward output gradient + input gradient;
- dropout: forward 2 x n x 4 + n mask bytes, backward the same;
- add: forward 3 x n, backward 3 x n (the gradient accumulation at the fork);
- concat: 2 x output forward and backward;
- loss: 3 x logits forward and backward.
All FLOP counts are exact for the shapes; the efficiencies are assumptions, so absolute times are
indicative only; their ratios (compute vs copy time) are what make the examples useful.

Use:
    from tensorplace import examples
    p = examples.profile("resnet50", batch_size=64)          # a Profile dict (docs/formats.md)
    examples.write_all("python/tensorplace/examples")        # the bundled batch-32 JSON files
    python -m tensorplace.examples --write DIR [--batch-size N] [--device D] [--list]
    python python/tensorplace/examples.py --write DIR      # the same, without the package
"""

from __future__ import annotations

import json
import os
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

__all__ = [
    "DEVICE_MODELS",
    "UNIT_COUNTS",
    "PARAMETER_COUNTS",
    "names",
    "profile",
    "parameter_count",
    "to_json",
    "write_all",
    "bundled_path",
    "load_bundled",
    "main",
]

FLOAT_BYTES = 4
INDEX_BYTES = 8  # int64 max-pool indices, int64 labels
MASK_BYTES = 1  # bool dropout mask

DEVICE_MODELS: Dict[str, Dict[str, float]] = {
    "gpu-model": {
        "flop_rate": 8.0e12,
        "bandwidth": 4.5e11,
        "launch": 5e-6,
        "d2h_bandwidth": 12e9,
        "h2d_bandwidth": 12e9,
    },
    "cpu-model": {
        "flop_rate": 1.0e11,
        "bandwidth": 1.0e10,
        "launch": 2e-6,
        "d2h_bandwidth": 5e9,
        "h2d_bandwidth": 5e9,
    },
}

OPTIMIZER_STATE_BYTES_PER_PARAMETER = {"sgd": 0, "momentum": 4, "adam": 8}

# The unit and parameter counts of each model at its default image size and class count; the
# module docstring's table says the same (the tests check both against the built profiles).
UNIT_COUNTS = {
    "vgg16": 40,
    "resnet50": 175,
    "mobilenet_v1": 84,
    "mobilenet_v2": 153,
    "squeezenet": 66,
    "plain20": 60,
    "inception_v3": 314,
}
PARAMETER_COUNTS = {
    "vgg16": 138357544,
    "resnet50": 25557032,
    "mobilenet_v1": 4231976,
    "mobilenet_v2": 3504872,
    "squeezenet": 1248424,
    "plain20": 269722,
    "inception_v3": 23834568,
}

Shape = Tuple[int, ...]
IntPair = Union[int, Tuple[int, int]]


def _pair(v: IntPair) -> Tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _prod(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _round_time(t: float) -> float:
    return float(f"{t:.6g}")


class _T:
    """A tensor in the forward pass: the output of a unit, or a model input."""

    __slots__ = ("unit", "model_input", "shape")

    def __init__(self, unit: Optional[int], model_input: Optional[int], shape: Shape):
        self.unit = unit
        self.model_input = model_input
        self.shape = shape

    @property
    def elems(self) -> int:
        return _prod(self.shape)


class _Unit:
    __slots__ = (
        "name", "kind", "inputs", "model_inputs", "out_bytes", "params", "saves_inputs",
        "saves_output", "extra_bytes", "fwd_time", "bwd_time", "bwd_transient",
    )


class _Builder:
    def __init__(self, model: str, batch: int, device: str):
        if device not in DEVICE_MODELS:
            raise ValueError(f"unknown device model {device!r}; known: {sorted(DEVICE_MODELS)}")
        self.model = model
        self.B = batch
        self.dev = DEVICE_MODELS[device]
        self.units: List[_Unit] = []
        self.names: set = set()

    # -- time model ---------------------------------------------------------------------------
    def _kernel(self, flops: float, nbytes: float) -> float:
        d = self.dev
        return d["launch"] + max(flops / d["flop_rate"], nbytes / d["bandwidth"])

    # -- unit creation ------------------------------------------------------------------------
    def _add(
        self,
        name: str,
        kind: str,
        xs: Sequence[_T],
        out_shape: Shape,
        *,
        params: int = 0,
        saves_inputs: bool = False,
        saves_output: bool = False,
        extra_bytes: int = 0,
        fwd_time: float,
        bwd_time: float,
        out_bytes: Optional[int] = None,
    ) -> _T:
        if name in self.names:
            raise AssertionError(f"duplicate unit name {name}")
        if any(d < 1 for d in out_shape):
            raise ValueError(
                f"{self.model}: layer {name} would have output shape {out_shape}; the image is too small"
            )
        self.names.add(name)
        u = _Unit()
        u.name = name
        u.kind = kind
        u.inputs = [x.unit for x in xs if x.unit is not None]
        u.model_inputs = [x.model_input for x in xs if x.model_input is not None]
        u.out_bytes = self.B * _prod(out_shape) * FLOAT_BYTES if out_bytes is None else out_bytes
        u.params = params
        u.saves_inputs = saves_inputs
        u.saves_output = saves_output
        u.extra_bytes = extra_bytes
        u.fwd_time = fwd_time
        u.bwd_time = bwd_time
        grad_in = sum(self.B * x.elems * FLOAT_BYTES for x in xs if x.unit is not None)
        u.bwd_transient = u.out_bytes + grad_in
        self.units.append(u)
        return _T(len(self.units) - 1, None, tuple(out_shape))

    def image(self, shape: Shape) -> _T:
        return _T(None, 0, tuple(shape))

    def conv(self, name: str, x: _T, cout: int, k: IntPair, stride: IntPair = 1,
             padding: IntPair = 0, groups: int = 1, bias: bool = False) -> _T:
        cin, h, w = x.shape
        kh, kw = _pair(k)
        sh, sw = _pair(stride)
        ph, pw = _pair(padding)
        assert cin % groups == 0 and cout % groups == 0, (name, cin, cout, groups)
        ho = (h + 2 * ph - kh) // sh + 1
        wo = (w + 2 * pw - kw) // sw + 1
        params = cout * (cin // groups) * kh * kw + (cout if bias else 0)
        out_elems = cout * ho * wo
        flops = 2.0 * self.B * out_elems * (cin // groups) * kh * kw
        moved = FLOAT_BYTES * (self.B * (x.elems + out_elems) + params)
        fwd = self._kernel(flops, moved)
        bwd = self._kernel(flops, moved)  # weight gradient
        if x.unit is not None:
            bwd += self._kernel(flops, moved)  # input gradient
        return self._add(name, "conv", [x], (cout, ho, wo), params=params, saves_inputs=True,
                         fwd_time=fwd, bwd_time=bwd)

    def linear(self, name: str, x: _T, out_features: int, bias: bool = True) -> _T:
        fin = x.elems
        params = fin * out_features + (out_features if bias else 0)
        flops = 2.0 * self.B * fin * out_features
        moved = FLOAT_BYTES * (self.B * (fin + out_features) + params)
        fwd = self._kernel(flops, moved)
        bwd = self._kernel(flops, moved)
        if x.unit is not None:
            bwd += self._kernel(flops, moved)
        return self._add(name, "linear", [x], (out_features,), params=params, saves_inputs=True,
                         fwd_time=fwd, bwd_time=bwd)

    def bn(self, name: str, x: _T) -> _T:
        c = x.shape[0]
        nb = FLOAT_BYTES * self.B * x.elems
        return self._add(name, "norm", [x], x.shape, params=2 * c, saves_inputs=True,
                         extra_bytes=2 * c * FLOAT_BYTES,
                         fwd_time=2 * self._kernel(0, 1.5 * nb), bwd_time=2 * self._kernel(0, 2.5 * nb))

    def relu(self, name: str, x: _T) -> _T:
        nb = FLOAT_BYTES * self.B * x.elems
        return self._add(name, "activation", [x], x.shape, saves_output=True,
                         fwd_time=self._kernel(0, 2 * nb), bwd_time=self._kernel(0, 3 * nb))

    def relu6(self, name: str, x: _T) -> _T:
        nb = FLOAT_BYTES * self.B * x.elems
        return self._add(name, "activation", [x], x.shape, saves_inputs=True,
                         fwd_time=self._kernel(0, 2 * nb), bwd_time=self._kernel(0, 3 * nb))

    @staticmethod
    def _pool_out(n: int, k: int, s: int, p: int, ceil: bool) -> int:
        if ceil:
            o = -(-(n + 2 * p - k) // s) + 1
            if (o - 1) * s >= n + p:  # the last window must start inside the input
                o -= 1
            return o
        return (n + 2 * p - k) // s + 1

    def maxpool(self, name: str, x: _T, k: int, s: int, p: int = 0, ceil: bool = False) -> _T:
        c, h, w = x.shape
        out = (c, self._pool_out(h, k, s, p, ceil), self._pool_out(w, k, s, p, ceil))
        n_in = self.B * x.elems
        n_out = self.B * _prod(out)
        idx = INDEX_BYTES * n_out
        return self._add(
            name, "pool", [x], out, saves_inputs=True, extra_bytes=idx,
            fwd_time=self._kernel(0, FLOAT_BYTES * (n_in + n_out) + idx),
            bwd_time=self._kernel(0, FLOAT_BYTES * (2 * n_in + n_out) + idx),
        )

    def avgpool(self, name: str, x: _T, k: int, s: int, p: int = 0) -> _T:
        c, h, w = x.shape
        out = (c, self._pool_out(h, k, s, p, False), self._pool_out(w, k, s, p, False))
        nb = FLOAT_BYTES * self.B * (x.elems + _prod(out))
        return self._add(name, "pool", [x], out, saves_inputs=True,
                         fwd_time=self._kernel(0, nb), bwd_time=self._kernel(0, nb))

    def adaptive_avgpool(self, name: str, x: _T, size: int) -> _T:
        """torch's adaptive_avg_pool2d: a mean (saves nothing) for 1x1, else saves its input."""
        c = x.shape[0]
        out = (c, size, size)
        nb = FLOAT_BYTES * self.B * (x.elems + _prod(out))
        return self._add(name, "pool", [x], out, saves_inputs=size != 1,
                         fwd_time=self._kernel(0, nb), bwd_time=self._kernel(0, nb))

    def dropout(self, name: str, x: _T) -> _T:
        n = self.B * x.elems
        mask = MASK_BYTES * n
        t = self._kernel(0, 2 * FLOAT_BYTES * n + mask)
        return self._add(name, "dropout", [x], x.shape, extra_bytes=mask, fwd_time=t, bwd_time=t)

    def add(self, name: str, a: _T, b: _T) -> _T:
        assert a.shape == b.shape, (name, a.shape, b.shape)
        t = self._kernel(0, 3 * FLOAT_BYTES * self.B * a.elems)
        return self._add(name, "add", [a, b], a.shape, fwd_time=t, bwd_time=t)

    def concat(self, name: str, xs: Sequence[_T]) -> _T:
        hw = xs[0].shape[1:]
        assert all(x.shape[1:] == hw for x in xs), (name, [x.shape for x in xs])
        out = (sum(x.shape[0] for x in xs),) + tuple(hw)
        t = self._kernel(0, 2 * FLOAT_BYTES * self.B * _prod(out))
        return self._add(name, "concat", xs, out, fwd_time=t, bwd_time=t)

    def loss(self, name: str, logits: _T) -> _T:
        labels = _T(None, 1, ())
        nb = FLOAT_BYTES * self.B * logits.elems
        t = self._kernel(0, 3 * nb)
        return self._add(name, "loss", [logits, labels], (1,), extra_bytes=nb, fwd_time=t,
                         bwd_time=t, out_bytes=FLOAT_BYTES)

    # -- composites ---------------------------------------------------------------------------
    def conv_bn_relu(self, prefix: str, x: _T, cout: int, k: IntPair, stride: IntPair = 1,
                     padding: IntPair = 0, groups: int = 1, act: str = "relu",
                     names: Tuple[str, str, str] = ("conv", "bn", "relu")) -> _T:
        y = self.conv(f"{prefix}{names[0]}", x, cout, k, stride, padding, groups)
        y = self.bn(f"{prefix}{names[1]}", y)
        if act == "relu":
            return self.relu(f"{prefix}{names[2]}", y)
        return self.relu6(f"{prefix}{names[2]}", y)

    # -- output -------------------------------------------------------------------------------
    def finish(self, image_shape: Shape, optimizer: str, device: str) -> dict:
        n = len(self.units)
        savers: List[set] = [set() for _ in range(n)]
        for i, u in enumerate(self.units):
            if u.saves_output:
                savers[i].add(i)
            if u.saves_inputs:
                for p in u.inputs:
                    savers[p].add(i)
        out_saved = [bool(s) for s in savers]
        units = []
        total_params = 0
        for i, u in enumerate(self.units):
            total_params += u.params
            read_by = set(savers[i])
            if u.extra_bytes:
                read_by.add(i)
            held = sum(self.units[p].out_bytes for p in sorted(set(u.inputs)) if not out_saved[p])
            units.append({
                "name": u.name,
                "kind": u.kind,
                "inputs": list(u.inputs),
                "model_inputs": list(u.model_inputs),
                "fwd_time": _round_time(u.fwd_time),
                "bwd_time": _round_time(u.bwd_time),
                "act_bytes": (u.out_bytes if out_saved[i] else 0) + u.extra_bytes,
                "output_bytes": u.out_bytes,
                "output_saved": out_saved[i],
                "read_by": sorted(read_by),
                "held_input_bytes": held,
                "fwd_transient_bytes": 0,
                "bwd_transient_bytes": u.bwd_transient,
                "grad_bytes": FLOAT_BYTES * u.params,
            })
        if optimizer not in OPTIMIZER_STATE_BYTES_PER_PARAMETER:
            raise ValueError(
                f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_STATE_BYTES_PER_PARAMETER)}"
            )
        dev = self.dev
        return {
            "format": "tensorplace.profile",
            "version": 1,
            "model": self.model,
            "device": device,
            "batch_size": self.B,
            "memory": {
                "parameters": FLOAT_BYTES * total_params,
                "optimizer_state": OPTIMIZER_STATE_BYTES_PER_PARAMETER[optimizer] * total_params,
                "inputs": self.B * (FLOAT_BYTES * _prod(image_shape) + INDEX_BYTES),
                "workspace": 0,
            },
            "d2h_bandwidth": dev["d2h_bandwidth"],
            "h2d_bandwidth": dev["h2d_bandwidth"],
            "measured": {},
            "units": units,
        }


# ---------------------------------------------------------------------------------------------
# Architectures
# ---------------------------------------------------------------------------------------------

def _vgg16(b: _Builder, x: _T, classes: int) -> _T:
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    i = 0
    for v in cfg:
        if v == "M":
            x = b.maxpool(f"features.{i}", x, 2, 2)
            i += 1
        else:
            x = b.conv(f"features.{i}", x, v, 3, 1, 1, bias=True)
            x = b.relu(f"features.{i + 1}", x)
            i += 2
    x = b.adaptive_avgpool("avgpool", x, 7)
    x = b.linear("classifier.0", x, 4096)
    x = b.relu("classifier.1", x)
    x = b.dropout("classifier.2", x)
    x = b.linear("classifier.3", x, 4096)
    x = b.relu("classifier.4", x)
    x = b.dropout("classifier.5", x)
    return b.linear("classifier.6", x, classes)


def _resnet50(b: _Builder, x: _T, classes: int) -> _T:
    x = b.conv("conv1", x, 64, 7, 2, 3)
    x = b.bn("bn1", x)
    x = b.relu("relu", x)
    x = b.maxpool("maxpool", x, 3, 2, 1)
    for stage, (width, blocks, stride) in enumerate([(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]):
        for j in range(blocks):
            p = f"layer{stage + 1}.{j}."
            s = stride if j == 0 else 1
            identity = x
            y = b.conv(p + "conv1", x, width, 1)
            y = b.bn(p + "bn1", y)
            y = b.relu(p + "relu1", y)
            y = b.conv(p + "conv2", y, width, 3, s, 1)
            y = b.bn(p + "bn2", y)
            y = b.relu(p + "relu2", y)
            y = b.conv(p + "conv3", y, 4 * width, 1)
            y = b.bn(p + "bn3", y)
            if j == 0:
                identity = b.conv(p + "downsample.0", x, 4 * width, 1, s)
                identity = b.bn(p + "downsample.1", identity)
            y = b.add(p + "add", y, identity)
            x = b.relu(p + "relu3", y)
    x = b.adaptive_avgpool("avgpool", x, 1)
    return b.linear("fc", x, classes)


def _mobilenet_v1(b: _Builder, x: _T, classes: int) -> _T:
    x = b.conv_bn_relu("conv0.", x, 32, 3, 2, 1)
    blocks = [(64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2)] + [(512, 1)] * 5 + [
        (1024, 2), (1024, 1)]
    for i, (cout, s) in enumerate(blocks):
        cin = x.shape[0]
        p = f"block{i + 1}."
        x = b.conv_bn_relu(p, x, cin, 3, s, 1, groups=cin, names=("dw", "dw_bn", "dw_relu"))
        x = b.conv_bn_relu(p, x, cout, 1, names=("pw", "pw_bn", "pw_relu"))
    x = b.adaptive_avgpool("avgpool", x, 1)
    return b.linear("fc", x, classes)


def _mobilenet_v2(b: _Builder, x: _T, classes: int) -> _T:
    x = b.conv_bn_relu("features.0.", x, 32, 3, 2, 1, act="relu6", names=("0", "1", "2"))
    settings = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                (6, 160, 3, 2), (6, 320, 1, 1)]
    idx = 1
    for t, c, n, s in settings:
        for j in range(n):
            stride = s if j == 0 else 1
            cin = x.shape[0]
            hidden = cin * t
            p = f"features.{idx}.conv."
            y = x
            k = 0
            if t != 1:
                y = b.conv_bn_relu(p, y, hidden, 1, act="relu6", names=("0.0", "0.1", "0.2"))
                k = 1
            y = b.conv_bn_relu(p, y, hidden, 3, stride, 1, groups=hidden, act="relu6",
                               names=(f"{k}.0", f"{k}.1", f"{k}.2"))
            y = b.conv(f"{p}{k + 1}", y, c, 1)
            y = b.bn(f"{p}{k + 2}", y)
            if stride == 1 and cin == c:
                y = b.add(f"features.{idx}.add", x, y)
            x = y
            idx += 1
    x = b.conv_bn_relu(f"features.{idx}.", x, 1280, 1, act="relu6", names=("0", "1", "2"))
    x = b.adaptive_avgpool("avgpool", x, 1)
    x = b.dropout("classifier.0", x)
    return b.linear("classifier.1", x, classes)


def _fire(b: _Builder, p: str, x: _T, squeeze: int, e1: int, e3: int) -> _T:
    s = b.conv(p + "squeeze", x, squeeze, 1, bias=True)
    s = b.relu(p + "squeeze_activation", s)
    a = b.conv(p + "expand1x1", s, e1, 1, bias=True)
    a = b.relu(p + "expand1x1_activation", a)
    c = b.conv(p + "expand3x3", s, e3, 3, 1, 1, bias=True)
    c = b.relu(p + "expand3x3_activation", c)
    return b.concat(p + "cat", [a, c])


def _squeezenet(b: _Builder, x: _T, classes: int) -> _T:
    x = b.conv("features.0", x, 96, 7, 2, bias=True)
    x = b.relu("features.1", x)
    x = b.maxpool("features.2", x, 3, 2, ceil=True)
    x = _fire(b, "features.3.", x, 16, 64, 64)      # fire2
    x = _fire(b, "features.4.", x, 16, 64, 64)      # fire3
    x = _fire(b, "features.5.", x, 32, 128, 128)    # fire4
    x = b.maxpool("features.6", x, 3, 2, ceil=True)
    x = _fire(b, "features.7.", x, 32, 128, 128)    # fire5
    x = _fire(b, "features.8.", x, 48, 192, 192)    # fire6
    x = _fire(b, "features.9.", x, 48, 192, 192)    # fire7
    x = _fire(b, "features.10.", x, 64, 256, 256)   # fire8
    x = b.maxpool("features.11", x, 3, 2, ceil=True)
    x = _fire(b, "features.12.", x, 64, 256, 256)   # fire9
    x = b.dropout("classifier.0", x)
    x = b.conv("classifier.1", x, classes, 1, bias=True)  # conv10
    x = b.relu("classifier.2", x)
    return b.adaptive_avgpool("classifier.3", x, 1)


def _plain20(b: _Builder, x: _T, classes: int) -> _T:
    x = b.conv_bn_relu("", x, 16, 3, 1, 1, names=("conv1", "bn1", "relu1"))
    for stage, width in enumerate([16, 32, 64]):
        for j in range(6):
            s = 2 if (stage > 0 and j == 0) else 1
            x = b.conv_bn_relu(f"layer{stage + 1}.{j}.", x, width, 3, s, 1)
    x = b.adaptive_avgpool("avgpool", x, 1)
    return b.linear("fc", x, classes)


def _inception_a(b: _Builder, p: str, x: _T, pool_features: int) -> _T:
    b1 = b.conv_bn_relu(p + "branch1x1.", x, 64, 1)
    b5 = b.conv_bn_relu(p + "branch5x5_1.", x, 48, 1)
    b5 = b.conv_bn_relu(p + "branch5x5_2.", b5, 64, 5, 1, 2)
    b3 = b.conv_bn_relu(p + "branch3x3dbl_1.", x, 64, 1)
    b3 = b.conv_bn_relu(p + "branch3x3dbl_2.", b3, 96, 3, 1, 1)
    b3 = b.conv_bn_relu(p + "branch3x3dbl_3.", b3, 96, 3, 1, 1)
    bp = b.avgpool(p + "avg_pool", x, 3, 1, 1)
    bp = b.conv_bn_relu(p + "branch_pool.", bp, pool_features, 1)
    return b.concat(p + "cat", [b1, b5, b3, bp])


def _inception_b(b: _Builder, p: str, x: _T) -> _T:
    b3 = b.conv_bn_relu(p + "branch3x3.", x, 384, 3, 2)
    bd = b.conv_bn_relu(p + "branch3x3dbl_1.", x, 64, 1)
    bd = b.conv_bn_relu(p + "branch3x3dbl_2.", bd, 96, 3, 1, 1)
    bd = b.conv_bn_relu(p + "branch3x3dbl_3.", bd, 96, 3, 2)
    bp = b.maxpool(p + "max_pool", x, 3, 2)
    return b.concat(p + "cat", [b3, bd, bp])


def _inception_c(b: _Builder, p: str, x: _T, c7: int) -> _T:
    b1 = b.conv_bn_relu(p + "branch1x1.", x, 192, 1)
    b7 = b.conv_bn_relu(p + "branch7x7_1.", x, c7, 1)
    b7 = b.conv_bn_relu(p + "branch7x7_2.", b7, c7, (1, 7), 1, (0, 3))
    b7 = b.conv_bn_relu(p + "branch7x7_3.", b7, 192, (7, 1), 1, (3, 0))
    bd = b.conv_bn_relu(p + "branch7x7dbl_1.", x, c7, 1)
    bd = b.conv_bn_relu(p + "branch7x7dbl_2.", bd, c7, (7, 1), 1, (3, 0))
    bd = b.conv_bn_relu(p + "branch7x7dbl_3.", bd, c7, (1, 7), 1, (0, 3))
    bd = b.conv_bn_relu(p + "branch7x7dbl_4.", bd, c7, (7, 1), 1, (3, 0))
    bd = b.conv_bn_relu(p + "branch7x7dbl_5.", bd, 192, (1, 7), 1, (0, 3))
    bp = b.avgpool(p + "avg_pool", x, 3, 1, 1)
    bp = b.conv_bn_relu(p + "branch_pool.", bp, 192, 1)
    return b.concat(p + "cat", [b1, b7, bd, bp])


def _inception_d(b: _Builder, p: str, x: _T) -> _T:
    b3 = b.conv_bn_relu(p + "branch3x3_1.", x, 192, 1)
    b3 = b.conv_bn_relu(p + "branch3x3_2.", b3, 320, 3, 2)
    b7 = b.conv_bn_relu(p + "branch7x7x3_1.", x, 192, 1)
    b7 = b.conv_bn_relu(p + "branch7x7x3_2.", b7, 192, (1, 7), 1, (0, 3))
    b7 = b.conv_bn_relu(p + "branch7x7x3_3.", b7, 192, (7, 1), 1, (3, 0))
    b7 = b.conv_bn_relu(p + "branch7x7x3_4.", b7, 192, 3, 2)
    bp = b.maxpool(p + "max_pool", x, 3, 2)
    return b.concat(p + "cat", [b3, b7, bp])


def _inception_e(b: _Builder, p: str, x: _T) -> _T:
    b1 = b.conv_bn_relu(p + "branch1x1.", x, 320, 1)
    b3 = b.conv_bn_relu(p + "branch3x3_1.", x, 384, 1)
    b3a = b.conv_bn_relu(p + "branch3x3_2a.", b3, 384, (1, 3), 1, (0, 1))
    b3b = b.conv_bn_relu(p + "branch3x3_2b.", b3, 384, (3, 1), 1, (1, 0))
    b3 = b.concat(p + "branch3x3_cat", [b3a, b3b])
    bd = b.conv_bn_relu(p + "branch3x3dbl_1.", x, 448, 1)
    bd = b.conv_bn_relu(p + "branch3x3dbl_2.", bd, 384, 3, 1, 1)
    bda = b.conv_bn_relu(p + "branch3x3dbl_3a.", bd, 384, (1, 3), 1, (0, 1))
    bdb = b.conv_bn_relu(p + "branch3x3dbl_3b.", bd, 384, (3, 1), 1, (1, 0))
    bd = b.concat(p + "branch3x3dbl_cat", [bda, bdb])
    bp = b.avgpool(p + "avg_pool", x, 3, 1, 1)
    bp = b.conv_bn_relu(p + "branch_pool.", bp, 192, 1)
    return b.concat(p + "cat", [b1, b3, bd, bp])


def _inception_v3(b: _Builder, x: _T, classes: int) -> _T:
    x = b.conv_bn_relu("Conv2d_1a_3x3.", x, 32, 3, 2)
    x = b.conv_bn_relu("Conv2d_2a_3x3.", x, 32, 3)
    x = b.conv_bn_relu("Conv2d_2b_3x3.", x, 64, 3, 1, 1)
    x = b.maxpool("maxpool1", x, 3, 2)
    x = b.conv_bn_relu("Conv2d_3b_1x1.", x, 80, 1)
    x = b.conv_bn_relu("Conv2d_4a_3x3.", x, 192, 3)
    x = b.maxpool("maxpool2", x, 3, 2)
    x = _inception_a(b, "Mixed_5b.", x, 32)
    x = _inception_a(b, "Mixed_5c.", x, 64)
    x = _inception_a(b, "Mixed_5d.", x, 64)
    x = _inception_b(b, "Mixed_6a.", x)
    x = _inception_c(b, "Mixed_6b.", x, 128)
    x = _inception_c(b, "Mixed_6c.", x, 160)
    x = _inception_c(b, "Mixed_6d.", x, 160)
    x = _inception_c(b, "Mixed_6e.", x, 192)
    x = _inception_d(b, "Mixed_7a.", x)
    x = _inception_e(b, "Mixed_7b.", x)
    x = _inception_e(b, "Mixed_7c.", x)
    x = b.adaptive_avgpool("avgpool", x, 1)
    x = b.dropout("dropout", x)
    return b.linear("fc", x, classes)


# name -> (builder, default image size, default class count)
_MODELS: Dict[str, Tuple[Callable[[_Builder, _T, int], _T], int, int]] = {
    "vgg16": (_vgg16, 224, 1000),
    "resnet50": (_resnet50, 224, 1000),
    "mobilenet_v1": (_mobilenet_v1, 224, 1000),
    "mobilenet_v2": (_mobilenet_v2, 224, 1000),
    "squeezenet": (_squeezenet, 224, 1000),
    "plain20": (_plain20, 32, 10),
    "inception_v3": (_inception_v3, 299, 1000),
}


def names() -> List[str]:
    """The example models, in a fixed order."""
    return list(_MODELS)


def profile(
    name: str,
    batch_size: int = 32,
    image_size: Optional[int] = None,
    device: str = "gpu-model",
    optimizer: str = "sgd",
    num_classes: Optional[int] = None,
) -> dict:
    """A modelled Profile (docs/formats.md, version 1) of one training step of `name`.

    `image_size` defaults to the model's own (224; 299 for inception_v3; 32 for plain20);
    `num_classes` to 1000 (10 for plain20). `device` names an entry of DEVICE_MODELS;
    `optimizer` is "sgd", "momentum" or "adam" (0, 4 or 8 bytes of state per parameter).
    """
    if name not in _MODELS:
        raise ValueError(f"unknown example model {name!r}; known: {names()}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    build, default_size, default_classes = _MODELS[name]
    size = default_size if image_size is None else int(image_size)
    classes = default_classes if num_classes is None else int(num_classes)
    if size < 1 or classes < 1:
        raise ValueError("image_size and num_classes must be positive")
    b = _Builder(name, batch_size, device)
    image_shape = (3, size, size)
    logits = build(b, b.image(image_shape), classes)
    if len(logits.shape) != 1:  # squeezenet ends in a (classes, 1, 1) pool; flatten is a view
        logits = _T(logits.unit, None, (logits.elems,))
    b.loss("loss", logits)
    return b.finish(image_shape, optimizer, device)


def parameter_count(p: dict) -> int:
    """The parameter count of a profile (its `memory.parameters` / 4)."""
    return p["memory"]["parameters"] // FLOAT_BYTES


def to_json(p: dict) -> str:
    """The profile as JSON text: compact, one unit per line."""
    head = {k: v for k, v in p.items() if k != "units"}
    text = json.dumps(head, separators=(",", ":"))[:-1]
    lines = [json.dumps(u, separators=(",", ":")) for u in p["units"]]
    return text + ',"units":[\n' + ",\n".join(lines) + "\n]}\n"


def bundled_path(name: str) -> str:
    """Path of the bundled batch-32 JSON file of `name` (python/tensorplace/examples/)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "examples", f"{name}.json")


def load_bundled(name: str) -> dict:
    """The bundled batch-32 profile of `name`, read from its JSON file."""
    with open(bundled_path(name), "r", encoding="utf-8") as f:
        return json.load(f)


def write_all(directory: str, batch_size: int = 32, device: str = "gpu-model") -> List[str]:
    """Write `<name>.json` for every example model into `directory`; returns the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name in names():
        path = os.path.join(directory, f"{name}.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(to_json(profile(name, batch_size=batch_size, device=device)))
        paths.append(path)
    return paths


def _summary_line(p: dict) -> str:
    units = p["units"]
    act = sum(u["act_bytes"] for u in units)
    t = sum(u["fwd_time"] + u["bwd_time"] for u in units)
    return (f"{p['model']:<14} units {len(units):>4}  params {parameter_count(p):>11,}  "
            f"activations {act / 2**20:>9.1f} MiB  compute {t * 1e3:>8.2f} ms  (batch {p['batch_size']})")


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tensorplace.examples",
                                 description="Write or list the modelled example profiles.")
    ap.add_argument("--write", metavar="DIR", help="write <name>.json for every model into DIR")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--device", default="gpu-model", choices=sorted(DEVICE_MODELS))
    ap.add_argument("--list", action="store_true", help="print a summary line per model")
    args = ap.parse_args(argv)
    if args.write:
        for path in write_all(args.write, args.batch_size, args.device):
            print(f"wrote {path} ({os.path.getsize(path):,} bytes)")
    if args.list or not args.write:
        for name in names():
            print(_summary_line(profile(name, args.batch_size, device=args.device)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
