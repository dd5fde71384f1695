"""What the subcommands share: the model zoo, measuring, argument types, tables, progress bars
and the figures that ``--json`` writes."""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import inspect
import json
import platform
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from ..budget import format_bytes, parse_budget

# --- argument types (argparse turns their ValueError/ArgumentTypeError into a usage error) ------


def positive_int(text: str) -> int:
    return _whole_number(text, 1)


def non_negative_int(text: str) -> int:
    return _whole_number(text, 0)


def _whole_number(text: str, least: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {text!r}") from None
    if v < least:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {v}")
    return v


def fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, e.g. 0.25, got {text!r}") from None
    if not 0.0 < v < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number strictly between 0 and 1, e.g. 0.25, got {v}")
    return v


def budget(text: str) -> int:
    try:
        return parse_budget(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def search_args(p: argparse.ArgumentParser, iterations: int = 500, particles: int = 500) -> None:
    """--iterations, --particles, --seed of the PSO search."""
    p.add_argument("--iterations", type=positive_int, default=iterations, help=f"PSO iterations (default {iterations})")
    p.add_argument("--particles", type=positive_int, default=particles, help=f"PSO particles (default {particles})")
    p.add_argument("--seed", type=int, default=0, help="search seed (default 0)")


def search_settings(a: argparse.Namespace) -> Dict[str, Any]:
    return {"iterations": a.iterations, "particles": a.particles, "seed": a.seed}


# --- output ---------------------------------------------------------------------------------


STDOUT = "-"  # `--json -`: the figures go to stdout at the end, everything printed to stderr


class Output:
    """The figures a subcommand prints, collected for ``--json``: ``out[key] = value``,
    ``out.append(key, row)``. With a path, the file is rewritten after every change, so a run
    that dies later keeps what it measured; the bench's main writes it once more at the end
    with the exit code (for ``-``, only then, to stdout)."""

    def __init__(self, path: Optional[str] = None, header: Optional[Dict[str, Any]] = None) -> None:
        self.path = path
        self.header: Dict[str, Any] = dict(header or {})
        self.data: Dict[str, Any] = {}

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.flush()

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def update(self, **kv: Any) -> None:
        self.data.update(kv)
        self.flush()

    def append(self, key: str, value: Any) -> None:
        self.data.setdefault(key, []).append(value)
        self.flush()

    def payload(self, **extra: Any) -> Dict[str, Any]:
        return {**self.header, **extra, **self.data}

    def flush(self, **extra: Any) -> None:
        if self.path and self.path != STDOUT:
            write_json(self.path, self.payload(**extra))


def loss_and_grads(module: Any, params: Any, x: Any, loss_fn: Callable[[Any], Any]) -> List[Any]:
    """One step of ``module`` on ``x`` (seed 0): copies of the loss and of ``params``' gradients,
    which are set to None before and after (the values two engines' steps are compared on)."""
    import torch

    for p in params.parameters():
        p.grad = None
    torch.manual_seed(0)
    loss = loss_fn(module(x))
    loss.backward()
    out = [loss.detach().clone()] + [p.grad.detach().clone() for p in params.parameters() if p.grad is not None]
    for p in params.parameters():
        p.grad = None
    return out


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print a table (rich when available)."""
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for h in header:
            t.add_column(h, justify="right" if h != header[0] else "left")
        for r in rows:
            t.add_row(*[str(c) for c in r])
        Console().print(t)
    except ImportError:  # rich is a dependency, but keep the CLI usable without it
        print(title)
        print("  ".join(f"{h:>14}" for h in header))
        for r in rows:
            print("  ".join(f"{str(c):>14}" for c in r))


def ms(s: Optional[float]) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def where(device: Any = None) -> str:
    """The device measured figures come from: ``device`` (a torch device or its name; default: the
    bench's default device, the GPU when there is one)."""
    import torch

    dev = default_device() if device is None else torch.device(device)
    if dev.type == "cuda":
        return f"GPU {torch.cuda.get_device_name(dev)}"
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


# --- the device the bench measures on (--device) ------------------------------------------------


def default_device() -> Any:
    """``cuda`` when torch sees a GPU, else ``cpu``."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_arg(p: argparse.ArgumentParser) -> None:
    """--device: where the model, its inputs and labels live and every step is measured."""
    p.add_argument("--device", default=None, metavar="DEVICE",
                   help="where the model, inputs and labels are put and measured: cpu, cuda or cuda:N (default: "
                        "cuda when torch sees a GPU, else cpu); the executor's host tier follows (the CUDA backend "
                        "on a GPU)")


def resolve_device(text: Optional[str]) -> Any:
    """The torch device of ``--device`` (None: :func:`default_device`), or SystemExit saying why
    it cannot be used here."""
    import torch

    if text is None:
        return default_device()
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise SystemExit(f"--device {text!r} is not a device: use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise SystemExit(f"--device {text!r}: the bench measures on cpu or cuda (cuda:N), not {dev.type}")
    if not torch.cuda.is_available():
        raise SystemExit(
            f"--device {text}: torch sees no CUDA device here (torch.cuda.is_available() is False; torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda or 'none: a CPU-only build'}); measure on "
            "the CPU with --device cpu, or run the bench on a GPU machine (docs/gpu.md)")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise SystemExit(f"--device {text}: there {'is' if count == 1 else 'are'} {count} CUDA device(s) here, "
                         f"cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())


def placement(model: Any, inputs: Sequence[Any]) -> Dict[str, Any]:
    """Where a model's parameters and buffers and its input tensors are (device names), for the
    JSON: what the bench really measured on."""
    import torch

    tensors = list(model.parameters()) + list(model.buffers())
    return {"parameters": sorted({str(t.device) for t in tensors}),
            "inputs": sorted({str(t.device) for t in inputs if isinstance(t, torch.Tensor)})}


def on_device(model: Any, inputs: Tuple[Any, ...], device: Any) -> Tuple[Any, Tuple[Any, ...]]:
    """``model`` and ``inputs`` on ``device``: what a factory made elsewhere (a tensor created with
    an explicit device) is moved there."""
    import torch

    if any(t.device != device for t in list(model.parameters()) + list(model.buffers())):
        model = model.to(device)
    return model, tuple(t.to(device) if isinstance(t, torch.Tensor) and t.device != device else t for t in inputs)


def versions() -> Dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "torchvision", "tensorplace"):
        try:
            out[name] = str(importlib.import_module(name).__version__)
        except Exception:  # noqa: BLE001 - a missing package is reported as absent
            out[name] = "absent"
    return out


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
HOST_MALLOC_MODES = ("keep", "default")
#: the environment variable with the default of --host-malloc (unset: keep); the test suite sets it
#: to "default" so that the bench commands it runs in its own process leave that process's heap alone
HOST_MALLOC_ENV = "TENSORPLACE_HOST_MALLOC"


def default_host_malloc() -> str:
    import os

    return os.environ.get(HOST_MALLOC_ENV, "keep")


def host_malloc(mode: str) -> str:
    """Set how this process's C heap hands freed memory back, for the measured steps; returns what
    was set, for the output's header.

    ``keep`` (the bench's default): glibc keeps freed memory in the process (no heap trimming, no
    mmap'd blocks), as a GPU's caching allocator keeps device memory. With glibc's defaults a CPU
    step pays page faults whenever a free leaves a large block at the top of the heap, and how
    often that happens depends on the order of allocations, not on the plan's memory (the plain
    GPT-style step took 3,000-8,000 faults a step on this CPU, torch's checkpoint of its blocks
    none; docs/benchmarks.md, benches/step_faults.py). ``default`` leaves glibc as it is. A no-op
    where the C library is not glibc."""
    if mode not in HOST_MALLOC_MODES:
        raise SystemExit(f"--host-malloc must be one of {', '.join(HOST_MALLOC_MODES)}, got {mode!r}")
    if mode == "default":
        return "default"
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return "default (not glibc)"
    if not (mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) and mallopt(_M_MMAP_MAX, 0)):
        return "default (mallopt refused)"
    return "keep"


class _Bar:
    def __init__(self, progress: Any, task: Any) -> None:
        self._p, self._t = progress, task

    def advance(self, n: float = 1) -> None:
        if self._p is not None:
            self._p.advance(self._t, n)

    def describe(self, text: str) -> None:
        if self._p is not None:
            self._p.update(self._t, description=text)


_ACTIVE: Any = None  # the live rich Progress, if any (rich allows one live display at a time)
_FORCE_PROGRESS = False  # tests: draw the bars even when stderr is no terminal


@contextlib.contextmanager
def progress(description: str, total: Optional[float] = None) -> Iterator[_Bar]:
    """A rich progress bar on stderr (a spinner when `total` is None) for work that takes more
    than a second or two; it disappears when done and shows nothing when stderr is no terminal.
    What is printed meanwhile stays on stdout."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    except ImportError:
        yield _Bar(None, None)
        return
    global _ACTIVE
    if _ACTIVE is not None:  # nested: another line in the display already live
        task = _ACTIVE.add_task(description, total=total)
        try:
            yield _Bar(_ACTIVE, task)
        finally:
            _ACTIVE.remove_task(task)
        return
    console = Console(stderr=True, force_terminal=True if _FORCE_PROGRESS else None)
    if not console.is_terminal:
        yield _Bar(None, None)
        return
    # what is printed meanwhile goes through the live display only when stdout is a terminal
    # too; else (a pipe, a file) it would be moved to stderr
    same_screen = bool(getattr(sys.stdout, "isatty", lambda: False)())
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console, transient=True, redirect_stdout=same_screen) as p:
        _ACTIVE = p
        try:
            yield _Bar(p, p.add_task(description, total=total))
        finally:
            _ACTIVE = None


def save_figure(fig: Any, path: str) -> None:
    """Every PNG the bench writes: same resolution and layout."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--png needs matplotlib: pip install 'tensorplace[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# --- the model zoo ----------------------------------------------------------------------------


@dataclass
class RealModel:
    """A model with synthetic inputs for one training step."""

    name: str
    model: Any
    inputs: Tuple[Any, ...]
    loss_fn: Optional[Callable[[Any], Any]]
    build: Callable[[int], "RealModel"] = field(repr=False)
    device: Any = None  #: where the model, inputs and labels were made (torch.device)

    @property
    def batch(self) -> int:
        return int(self.inputs[0].shape[0])

    def shapes(self) -> str:
        return ", ".join(str(tuple(t.shape)) for t in self.inputs)

    def at_batch(self, batch: int) -> "RealModel":
        """The same model (same parameters) with inputs of another batch size."""
        other = self.build(batch)
        other.model = self.model
        return other


# name -> (description, builder(batch, image, seq, classes) -> (model, inputs, loss_fn))
Builder = Callable[[int, int, int, int], Tuple[Any, Tuple[Any, ...], Optional[Callable[[Any], Any]]]]
_OWN: Dict[str, Tuple[str, Builder]] = {}


def register_model(name: str, description: str, builder: Builder) -> None:
    """Add a model to the zoo under `name` (the budget work registers its zoo models this way).
    `builder(batch, image, seq, classes)` returns (model, inputs tuple, loss_fn or None)."""
    _OWN[name] = (description, builder)


def _classification(model: Any, x: Any, classes: int) -> Tuple[Any, Tuple[Any, ...], Callable[[Any], Any]]:
    import torch

    y = torch.randint(0, classes, (x.shape[0],))
    return model, (x,), lambda out: torch.nn.functional.cross_entropy(out, y)


def _gpt(vocab: int, dim: int, heads: int, layers: int) -> Builder:
    def build(batch: int, image: int, seq: int, classes: int) -> Tuple[Any, Tuple[Any, ...], Callable[[Any], Any]]:
        import torch

        from ..models import TinyGPT

        model = TinyGPT(vocab=vocab, dim=dim, heads=heads, layers=layers, block=seq, dropout=0.1)
        x = torch.randint(0, vocab, (batch, seq))
        y = torch.randint(0, vocab, (batch, seq))
        return model, (x,), lambda out: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())

    return build


def _inception(batch: int, image: int, seq: int, classes: int) -> Tuple[Any, Tuple[Any, ...], Callable[[Any], Any]]:
    import torch

    from ..models import TinyInception

    return _classification(TinyInception(num_classes=classes), torch.randn(batch, 3, image, image), classes)


register_model("gpt", "the package's TinyGPT: 4 layers, width 256, 4 heads, vocabulary 512; --seq tokens", _gpt(512, 256, 4, 4))
register_model("gpt6", "TinyGPT: 6 layers, width 256, 4 heads, vocabulary 512; --seq tokens (issue 6's CPU comparison)",
               _gpt(512, 256, 4, 6))
register_model("gpt12", "TinyGPT at GPT-2 small's shape: 12 layers, width 768, 12 heads, vocabulary 8192; --seq tokens "
               "(the GPT measured on the H100, shared/GPU.md)", _gpt(8192, 768, 12, 12))
register_model("gpt6s", "TinyGPT: 6 layers, width 64, 4 heads, vocabulary 512; --seq tokens (with batch 1, 64 tokens and "
               "--torch-threads 1: tiny kernels, a fast GPU's regime on a CPU, issue 17)", _gpt(512, 64, 4, 6))
register_model("tinygpt", "TinyGPT: 2 layers, width 32, 4 heads, vocabulary 64; --seq tokens (for tests)", _gpt(64, 32, 4, 2))
register_model("inception", "the package's TinyInception (two inception blocks); --image images", _inception)


def _zoo_model(name: str) -> Builder:
    def build(batch: int, image: int, seq: int, classes: int) -> Tuple[Any, Tuple[Any, ...], Callable[[Any], Any]]:
        from .. import zoo

        return zoo.build(name, batch=batch)

    return build


ZOO_PREFIX = "zoo."  # `--model zoo.NAME`: tensorplace.zoo's NAME, also where torchvision has a model of that name


def _register_zoo() -> None:
    """The budget work's zoo (tensorplace.zoo) under its own names, except where torchvision has a
    model of the same name (mobilenet_v2, efficientnet_b0, ...): the bare name stays torchvision's
    (full size, --image and --classes apply) and the zoo's small one is ``zoo.NAME``. Every zoo
    model is also reachable as ``zoo.NAME`` (build_model), listed only where it is needed."""
    from .. import zoo

    tv = set(torchvision_names())
    for name, (what, _) in zoo.MODELS.items():
        listed = ZOO_PREFIX + name if name in tv else name
        register_model(listed, f"{what} (tensorplace.zoo; fixed size, --batch only)", _zoo_model(name))


def _zoo_names() -> List[str]:
    from .. import zoo

    return zoo.names()


def torchvision_names() -> List[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


_register_zoo()


def zoo() -> Dict[str, str]:
    """Every model name --model accepts, with a description."""
    out = {name: desc for name, (desc, _) in _OWN.items()}
    for name in torchvision_names():
        out.setdefault(name, f"torchvision.models.{name} (random weights); --image images")
    return out


def _torchvision(name: str, batch: int, image: int, classes: int) -> Tuple[Any, Tuple[Any, ...], Callable[[Any], Any]]:
    import torch
    import torchvision

    kwargs: Dict[str, Any] = {"weights": None, "num_classes": classes}
    if name in ("inception_v3", "googlenet"):
        kwargs.update(aux_logits=False, init_weights=False)
    model = torchvision.models.get_model(name, **kwargs)
    return _classification(model, torch.randn(batch, 3, image, image), classes)


def _import_factory(spec: str) -> Callable[..., Any]:
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise SystemExit(f"--model {spec!r}: write an import path as 'package.module:factory'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise SystemExit(f"--model {spec!r}: cannot import {mod_name!r} ({e}); is it on PYTHONPATH?") from None
    obj: Any = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SystemExit(f"--model {spec!r}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise SystemExit(f"--model {spec!r}: {attr!r} is not callable")
    return obj


def _from_factory(spec: str, batch: int, image: int, seq: int, classes: int,
                  input_shape: Optional[Sequence[int]]) -> Tuple[Any, Tuple[Any, ...], Optional[Callable[[Any], Any]]]:
    import torch

    factory = _import_factory(spec)
    offered = {"batch": batch, "image": image, "seq": seq, "classes": classes}
    try:
        params = inspect.signature(factory).parameters
        takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())
        kwargs = offered if takes_all else {k: v for k, v in offered.items() if k in params}
    except (TypeError, ValueError):
        kwargs = {}
    got = factory(**kwargs)
    if isinstance(got, torch.nn.Module):
        shape = tuple(input_shape) if input_shape else (3, image, image)
        return got, (torch.randn(batch, *shape),), None
    if isinstance(got, tuple) and len(got) in (2, 3) and isinstance(got[0], torch.nn.Module):
        inputs = got[1] if isinstance(got[1], (tuple, list)) else (got[1],)
        return got[0], tuple(inputs), got[2] if len(got) == 3 else None
    raise SystemExit(
        f"--model {spec!r}: the factory returned {type(got).__name__}; return an nn.Module, or a tuple "
        "(model, inputs) or (model, inputs, loss_fn)"
    )


def build_model(spec: str, batch: int, image: int = 128, seq: int = 256, classes: int = 100,
                input_shape: Optional[Sequence[int]] = None, device: Any = "cpu") -> RealModel:
    """A zoo model by name, or the user's own by import path ``package.module:factory``.

    The factory is called with those of the keywords batch, image, seq, classes that it accepts
    and returns an nn.Module (its inputs: ``randn(batch, *input_shape)``, default 3 x image x
    image), or (model, inputs) or (model, inputs, loss_fn). Inputs are synthetic, seed 0.

    Everything is made on ``device`` (torch's default device while the builder runs: the model,
    its inputs and the labels its loss function holds); a model or inputs a factory puts
    elsewhere explicitly are moved there."""
    import torch

    dev = torch.device(device)

    def build(b: int) -> RealModel:
        torch.manual_seed(0)
        with torch.device(dev):
            model, inputs, loss_fn = make(b)
        model, inputs = on_device(model, tuple(inputs), dev)
        return RealModel(spec, model, inputs, loss_fn, build, dev)

    def make(b: int) -> Tuple[Any, Tuple[Any, ...], Optional[Callable[[Any], Any]]]:
        if ":" in spec:
            model, inputs, loss_fn = _from_factory(spec, b, image, seq, classes, input_shape)
        elif spec in _OWN:
            model, inputs, loss_fn = _OWN[spec][1](b, image, seq, classes)
        elif spec.startswith(ZOO_PREFIX) and spec[len(ZOO_PREFIX):] in _zoo_names():
            model, inputs, loss_fn = _zoo_model(spec[len(ZOO_PREFIX):])(b, image, seq, classes)
        elif spec in torchvision_names():
            model, inputs, loss_fn = _torchvision(spec, b, image, classes)
        else:
            from .. import examples

            close = [n for n in zoo() if spec.lower() in n or n in spec.lower()][:6]
            hint = f" Close names: {', '.join(close)}." if close else ""
            if spec in examples.names():
                hint += f" {spec!r} is a builtin modelled profile: pass --builtin {spec} where the command takes it."
            raise SystemExit(
                f"unknown model {spec!r}: use one of {', '.join(_OWN)}, a torchvision model name "
                f"(e.g. resnet18, vit_b_16; `tensorplace-bench models` lists them), or an import path "
                f"'package.module:factory'.{hint}"
            )
        return model, inputs, loss_fn

    return build(batch)


def model_args(p: argparse.ArgumentParser, batch: int = 32, default: Optional[str] = "resnet18",
               group: Optional[Any] = None) -> None:
    """--model (into `group`, a mutually exclusive group, when given) and its input options."""
    (group or p).add_argument(
        "--model", default=default,
        help="a real model: a zoo name (gpt, gpt12, tinygpt, inception, any torchvision model: resnet18, ...; "
             "tensorplace.zoo's models: unet, lstm, ..., zoo.NAME where torchvision has NAME too) or "
             f"'package.module:factory'{f' (default {default})' if default else ''}; "
             "`tensorplace-bench models` lists them")
    p.add_argument("--batch", type=positive_int, default=batch, help=f"batch size (default {batch})")
    p.add_argument("--image", type=positive_int, default=128, help="image side for image models (default 128)")
    p.add_argument("--seq", type=positive_int, default=256, help="sequence length for token models (default 256)")
    p.add_argument("--classes", type=positive_int, default=100, help="classes of image models (default 100)")
    p.add_argument("--input-shape", type=shape, default=None,
                   help="per-sample input shape for a factory that returns a bare module, e.g. 3x64x64")
    device_arg(p)


def repeats_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=positive_int, default=3, help="timed steps, median taken (default 3)")


def real_args(p: argparse.ArgumentParser, batch: int = 32, search: Optional[Tuple[int, int]] = (200, 200)) -> None:
    """--model and its input options, --repeats, and the search settings."""
    model_args(p, batch)
    repeats_arg(p)
    if search is not None:
        search_args(p, *search)


def shape(text: str) -> Tuple[int, ...]:
    parts = re.split(r"[x,]", text.strip())
    try:
        dims = tuple(int(s) for s in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected dimensions like 3x64x64, got {text!r}") from None
    if not dims or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"expected positive dimensions like 3x64x64, got {text!r}")
    return dims


def model_from_args(a: argparse.Namespace, batch: Optional[int] = None) -> RealModel:
    """The real model of --model and its input options, on --device (resolved by the bench's
    main); the JSON records where its tensors are."""
    dev = getattr(a, "device", None)
    rm = build_model(a.model, a.batch if batch is None else batch, a.image, a.seq, a.classes, a.input_shape,
                     device=dev if dev is not None else "cpu")
    out = getattr(a, "out", None)
    if out is not None:
        out["tensors_on"] = placement(rm.model, rm.inputs)
    return rm


# --- measuring --------------------------------------------------------------------------------


def measure(module: Any, inputs: Tuple[Any, ...], loss_fn: Optional[Callable[[Any], Any]], repeats: int) -> Dict[str, Any]:
    """Unplanned-style training steps of `module`: measured peak (torch's allocation records,
    constant memory included) and median step time."""
    from ..profiler import unplanned_step_stats

    return unplanned_step_stats(module, inputs, loss_fn=loss_fn, repeats=repeats)


def profile(rm: RealModel, repeats: int) -> Dict[str, Any]:
    """Profile one training step of a zoo model (with a spinner) and record in the profile what
    ``plan`` needs to write a plan that ``run()`` checks against the model."""
    from ..api import _describe_inputs, inputs_fingerprint, parameters_fingerprint
    from ..profiler import profile_model
    from ..shapes import input_specs, specs_json

    with progress(f"profiling {rm.name} {rm.shapes()}"):
        prof = profile_model(rm.model, rm.inputs, loss_fn=rm.loss_fn, repeats=repeats, name=rm.name)
    prof["model_fingerprint"] = (
        f"params:{parameters_fingerprint(rm.model)};inputs:{inputs_fingerprint(rm.inputs)}"
    )
    prof["input_shapes"] = _describe_inputs(rm.inputs)
    prof["input_specs"] = specs_json(input_specs(rm.inputs))
    return prof


def fixed_bytes(prof: Dict[str, Any]) -> int:
    """What no plan moves: parameters, inputs, optimizer state, workspace, and all gradients."""
    return int(sum(prof["memory"].values()) + sum(u["grad_bytes"] for u in prof["units"]))


def cut_budget(base: Dict[str, Any], prof: Dict[str, Any], frac: float) -> int:
    """The unplanned peak minus `frac` of the activation peak (the peak less what no plan
    moves: parameters, inputs, optimizer state and gradients)."""
    fixed = base["constant_bytes"] + sum(u["grad_bytes"] for u in prof["units"])
    return int(base["peak_bytes"] - frac * (base["peak_bytes"] - fixed))


def repeated_blocks(model: Any) -> List[Tuple[Any, str, Any]]:
    """The repeated blocks of a model, outermost first: children of the same class that appear
    at least twice in an nn.ModuleList or nn.Sequential (ResNet's BasicBlocks, a GPT's Blocks).
    Returns (container, child name, child) triples."""
    import torch.nn as nn

    found: List[Tuple[Any, str, Any]] = []

    def walk(m: Any) -> None:
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            kids = list(m.named_children())
            counts: Dict[type, int] = {}
            for _, c in kids:
                counts[type(c)] = counts.get(type(c), 0) + 1
            rep = [(n, c) for n, c in kids if counts[type(c)] >= 2 and any(True for _ in c.parameters())
                   and len(list(c.children())) > 0]
            if rep:
                found.extend((m, n, c) for n, c in rep)
                for n, c in kids:
                    if (n, c) not in rep:
                        walk(c)
                return
        for _, c in m.named_children():
            walk(c)

    walk(model)
    return found


def with_block_checkpoints(model: Any) -> Tuple[Any, int]:
    """A deep copy of `model` whose repeated blocks run under torch.utils.checkpoint
    (non-reentrant; only the block inputs are kept, the block is replayed in backward).
    Returns (model, number of blocks wrapped)."""
    import torch
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            if self.training and torch.is_grad_enabled():
                return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)
            return self.inner(*args, **kwargs)

    clone = copy.deepcopy(model)
    blocks = repeated_blocks(clone)
    for container, name, child in blocks:
        setattr(container, name, Checkpointed(child))
    return clone, len(blocks)


def write_json(path: str, payload: Dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        dump_json(payload, f)


def dump_json(payload: Dict[str, Any], f: Any) -> None:
    json.dump(payload, f, indent=1, default=str)
    f.write("\n")


def fmt_bytes(n: Optional[float]) -> str:
    return "-" if n is None else format_bytes(n)


def eprint(*args: Any) -> None:
    print(*args, file=sys.stderr)


# --- builtin or saved profiles (planner-only subcommands) -------------------------------------


def builtin_profile(text: str) -> str:
    """A builtin modelled profile's name (--builtin); for a real model's name, says to use --model."""
    from .. import examples

    if text in examples.names():
        return text
    how = f"; {text!r} is a real model: pass --model {text}" if _real_model_name(text) else ""
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a builtin profile (choose from {', '.join(examples.names())}){how}")


def _real_model_name(text: str) -> bool:
    return ":" in text or text in _OWN or text in torchvision_names() or (
        text.startswith(ZOO_PREFIX) and text[len(ZOO_PREFIX):] in _zoo_names())


def profile_source_args(p: argparse.ArgumentParser, default_builtin: Optional[str], batch: int = 32,
                        profiles: int = 1) -> None:
    """Where the profile comes from, one of: --model (a real model, profiled here with its input
    options and --repeats), --builtin (a builtin modelled profile, at --batch) or --profile (a
    saved profile; `profiles` files). Without any: the builtin `default_builtin`, or the real
    model resnet18 when it is None."""
    from .. import examples

    g = p.add_mutually_exclusive_group()
    model_args(p, batch, default=None if default_builtin else "resnet18", group=g)
    g.add_argument("--builtin", type=builtin_profile, default=None, metavar="NAME",
                   help=f"a builtin modelled profile: {', '.join(examples.names())}"
                        + (f" (the default: {default_builtin})" if default_builtin else ""))
    what = "a profile" if profiles == 1 else f"{profiles} profiles of one model at different batches"
    g.add_argument("--profile", metavar="FILE", nargs=None if profiles == 1 else profiles,
                   help=f"{what} saved by `tensorplace-bench profile` (or plan files that carry theirs)")
    repeats_arg(p)
    p.set_defaults(default_builtin=default_builtin)


def read_profile(path: str, what: str, hint: str = "") -> Dict[str, Any]:
    """The profile at ``path`` (a profile file, or a plan file with its profile), or SystemExit
    saying why not (``what`` names the argument)."""
    from .._core import PlannerError
    from ..planning import load_profile, profile_json

    try:
        return load_profile(path)
    except FileNotFoundError:
        raise SystemExit(f"{what} {path!r}: no such file{hint}") from None
    except (PlannerError, ValueError) as e:
        error = e
    # a plan file: the profile it was planned from, which plan() and save() keep in it
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError:
        data = None
    if isinstance(data, dict) and data.get("format") == "tensorplace.plan":
        if not isinstance(data.get("profile"), dict):
            raise SystemExit(f"{what} {path!r} is a plan that does not carry its profile (plans made by "
                             "plan_profile do not); give the profile it was planned from")
        try:
            return json.loads(profile_json(data["profile"]))
        except (PlannerError, ValueError) as e:
            raise SystemExit(f"{what} {path!r} is a plan whose profile is not valid: {e}") from None
    raise SystemExit(f"{what} {path!r} is not a valid profile: {error}") from None


def load_source(a: argparse.Namespace) -> Tuple[str, Dict[str, Any]]:
    """(label, profile) from --profile, --model (profiled here, with a spinner) or --builtin."""
    from .. import examples

    if a.profile:
        prof = read_profile(a.profile, "--profile")
        return f"{prof.get('model', a.profile)} batch {prof.get('batch_size')}", prof
    if a.model:
        rm = model_from_args(a)
        return f"{rm.name} batch {rm.batch}", profile(rm, a.repeats)
    name = a.builtin or a.default_builtin
    return f"{name} batch {a.batch}", examples.profile(name, batch_size=a.batch)


PSEUDO_METHODS = ("unplanned", "torch-checkpoint")


def planner_knows(method: str) -> bool:
    """Whether the planner has `method` (methods arrive in the planner over time)."""
    from .. import examples
    from .._core import BudgetError, PlannerError
    from ..planning import plan_profile

    try:
        plan_profile(examples.profile("plain20", batch_size=1), 1 << 40, method, iterations=1, particles=2)
    except BudgetError:
        return True
    except PlannerError as e:
        if "unknown method" in str(e):
            return False
        raise
    return True


def known_methods(methods: Sequence[str], a: Any, extra: Sequence[str] = ()) -> List[str]:
    """`methods` less those the planner does not know (skipped with a message, and listed under
    "skipped_methods" in --json)."""
    keep = []
    for m in methods:
        if m in extra or planner_knows(m):
            keep.append(m)
        else:
            print(f"skipping method {m!r}: this planner does not know it (update tensorplace, or drop it from --methods)")
            a.out.append("skipped_methods", m)
    return keep
