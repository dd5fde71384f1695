"""Small models of many families, for checking that a budget holds on any model (issue 7).

Each entry builds ``(model, inputs, loss_fn)`` small enough for a CPU: torchvision families
(DenseNet, MobileNet, EfficientNet, RegNet, ConvNeXt, ViT, Swin; small widths, so that
activations outweigh parameters as in real training) and hand-written ones for what
torchvision lacks: a UNet with concatenated skips, an LSTM and a GRU, ``nn.TransformerEncoder``,
a model whose tensors are saved by functional code between modules (residual adds,
``torch.cat``, ``chunk``, ``split``), tied weights, and in-place ops.

``tensorplace-bench`` accepts every name with ``--model`` (they are registered in its zoo); where
torchvision has a model of the same name (``mobilenet_v2``, ``mobilenet_v3_small``,
``efficientnet_b0``) the bare name is torchvision's full-size model and this zoo's is
``--model zoo.NAME`` (every zoo model answers to ``zoo.NAME``). ``tensorplace-bench budgets``
plans and measures them at three budgets (its ``--model`` takes the zoo's own names).

>>> model, inputs, loss_fn = build("unet", batch=2)
>>> loss_fn(model(*inputs)).shape
torch.Size([])
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MODELS", "build", "names"]

Built = Tuple[nn.Module, Tuple[Any, ...], Callable[[Any], torch.Tensor]]


class UNet(nn.Module):
    """Two levels down, two up, skips joined by ``torch.cat``."""

    def __init__(self, width: int = 8, classes: int = 3) -> None:
        super().__init__()

        def conv(i: int, o: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(inplace=True))

        w = width
        self.down1, self.down2, self.mid = conv(3, w), conv(w, 2 * w), conv(2 * w, 4 * w)
        self.up2 = nn.ConvTranspose2d(4 * w, 2 * w, 2, stride=2)
        self.dec2 = conv(4 * w, 2 * w)
        self.up1 = nn.ConvTranspose2d(2 * w, w, 2, stride=2)
        self.dec1 = conv(2 * w, w)
        self.head = nn.Conv2d(w, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(x)
        d2 = self.down2(F.max_pool2d(d1, 2))
        m = self.mid(F.max_pool2d(d2, 2))
        u2 = self.dec2(torch.cat([self.up2(m), d2], dim=1))
        u1 = self.dec1(torch.cat([self.up1(u2), d1], dim=1))
        return self.head(u1)


class Recurrent(nn.Module):
    """Embedding, a two-layer LSTM or GRU, a linear head over every step."""

    def __init__(self, cell: str, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rnn = (nn.LSTM if cell == "lstm" else nn.GRU)(dim, dim, num_layers=2, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(x))
        return self.head(out)


class Encoder(nn.Module):
    """``nn.TransformerEncoder`` over embedded tokens (pre-norm, GELU, dropout)."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=2 * dim, dropout=0.1,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)))


class FunctionalGlue(nn.Module):
    """Tensors saved by code between modules: residual adds, ``torch.cat``, ``chunk``,
    ``split``, a gating product and a softmax."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(16, dim)
        self.a = nn.Linear(dim, 2 * dim)
        self.b = nn.Linear(dim, dim)
        self.c = nn.Linear(2 * dim, dim)
        self.out = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        gate, value = self.a(h).chunk(2, dim=-1)
        h = h + torch.sigmoid(gate) * value
        left, right = self.b(h).split([h.shape[-1] // 2, h.shape[-1] - h.shape[-1] // 2], dim=-1)
        h = self.c(torch.cat([left.relu(), right * right, h], dim=-1)) + h
        return self.out((torch.softmax(h, dim=-1) * h).mean(dim=1))


class TiedWeights(nn.Module):
    """A language model whose output layer is its embedding (one parameter, used twice)."""

    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.LayerNorm(dim), nn.Linear(dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)))


class InPlace(nn.Module):
    """In-place activations and in-place adds on module outputs."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.act1 = nn.ReLU(inplace=True)
        self.c2 = nn.Conv2d(width, width, 3, padding=1)
        self.act2 = nn.Hardswish(inplace=True)
        self.c3 = nn.Conv2d(width, width, 3, padding=1)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act1(self.bn1(self.c1(x)))
        y = self.c2(h)
        y.add_(h)
        y = self.act2(y)
        z = self.c3(y)
        z.mul_(0.5).add_(y)
        return self.head(F.relu_(z).mean(dim=(2, 3)))


def _classify(model: nn.Module, x: torch.Tensor, classes: int) -> Built:
    y = torch.randint(0, classes, (x.shape[0],))
    return model, (x,), lambda out: F.cross_entropy(out, y)


def _tokens(model: nn.Module, batch: int, seq: int, vocab: int = 64) -> Built:
    x = torch.randint(0, vocab, (batch, seq))
    y = torch.randint(0, vocab, (batch, seq))
    return model, (x,), lambda out: F.cross_entropy(out.flatten(0, 1), y.flatten())


def _vision(make_model: Callable[[], nn.Module], image: int) -> Callable[[int], Built]:
    def make(batch: int) -> Built:
        return _classify(make_model(), torch.randn(batch, 3, image, image), 10)

    return make


def _densenet() -> nn.Module:
    from torchvision.models import DenseNet

    return DenseNet(growth_rate=16, block_config=(3, 3, 3), num_init_features=32, num_classes=10)


def _mobilenet(name: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import torchvision

        return torchvision.models.get_model(name, weights=None, num_classes=10, width_mult=0.5)

    return make


def _efficientnet() -> nn.Module:
    import torchvision

    return torchvision.models.get_model("efficientnet_b0", weights=None, num_classes=10)


def _regnet() -> nn.Module:
    from torchvision.models.regnet import BlockParams, RegNet

    params = BlockParams.from_init_params(depth=6, w_0=16, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25)
    return RegNet(params, num_classes=10)


def _convnext() -> nn.Module:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt([CNBlockConfig(24, 48, 2), CNBlockConfig(48, 96, 2), CNBlockConfig(96, None, 2)],
                    stochastic_depth_prob=0.1, num_classes=10)


def _swin() -> nn.Module:
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer(patch_size=[2, 2], embed_dim=24, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4],
                           stochastic_depth_prob=0.1, num_classes=10)


def _vit() -> nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=4, num_layers=4, num_heads=4, hidden_dim=64, mlp_dim=128,
                             num_classes=10)


def _segmentation(batch: int) -> Built:
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 3, (batch, 32, 32))
    return UNet(), (x,), lambda out: F.cross_entropy(out, y)


#: name -> (what it is, builder(batch) -> (model, inputs, loss_fn))
MODELS: Dict[str, Tuple[str, Callable[[int], Built]]] = {
    "densenet": ("torchvision DenseNet (concatenated features): growth 16, blocks 3-3-3, 64 px", _vision(_densenet, 64)),
    "mobilenet_v2": ("torchvision MobileNetV2 at width 0.5 (inverted residuals, ReLU6), 64 px",
                     _vision(_mobilenet("mobilenet_v2"), 64)),
    "mobilenet_v3_small": ("torchvision MobileNetV3-Small at width 0.5 (squeeze-excitation, hardswish), 64 px",
                           _vision(_mobilenet("mobilenet_v3_small"), 64)),
    "efficientnet_b0": ("torchvision EfficientNet-B0 (SiLU, stochastic depth), 64 px", _vision(_efficientnet, 64)),
    "regnet": ("torchvision RegNetY: depth 6, width 16, squeeze-excitation, 64 px", _vision(_regnet, 64)),
    "convnext": ("torchvision ConvNeXt: widths 24-48-96, 2 blocks each (LayerNorm, layer scale), 64 px",
                 _vision(_convnext, 64)),
    "vit": ("torchvision VisionTransformer: 4 layers, width 64, patch 4, 32 px", _vision(_vit, 32)),
    "swin": ("torchvision Swin: width 24, depths 2-2, window 4 (shifted windows), 32 px", _vision(_swin, 32)),
    "unet": ("a UNet: two levels, skips joined by torch.cat, 32 px, 3 classes per pixel", _segmentation),
    "lstm": ("embedding, 2-layer LSTM (width 32), head; 64 tokens", lambda b: _tokens(Recurrent("lstm"), b, 64)),
    "gru": ("embedding, 2-layer GRU (width 32), head; 64 tokens", lambda b: _tokens(Recurrent("gru"), b, 64)),
    "transformer_encoder": ("nn.TransformerEncoder: 2 pre-norm layers, width 32, 4 heads; 64 tokens",
                            lambda b: _tokens(Encoder(), b, 64)),
    "functional_glue": ("residual adds, torch.cat, chunk, split and a softmax between modules",
                        lambda b: _classify(FunctionalGlue(), torch.randn(b, 64, 16), 10)),
    "tied_weights": ("an embedding that is also the output layer; 64 tokens", lambda b: _tokens(TiedWeights(), b, 64)),
    "inplace": ("in-place ReLU, Hardswish, add_ and mul_ on module outputs, 32 px",
                lambda b: _classify(InPlace(), torch.randn(b, 3, 32, 32), 10)),
}


def names() -> List[str]:
    """The zoo's model names."""
    return list(MODELS)


def build(name: str, batch: int = 4) -> Built:
    """``(model, inputs, loss_fn)`` of zoo model ``name`` with ``batch`` samples (seeded: the
    same weights and inputs every call)."""
    if name not in MODELS:
        raise KeyError(f"no zoo model {name!r}; the zoo has {', '.join(MODELS)}")
    torch.manual_seed(0)
    return MODELS[name][1](batch)
