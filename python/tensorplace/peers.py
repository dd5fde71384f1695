"""tensorplace against what a user would try first, measured on the current device.

`compare_peers(model, x, loss_fn)` runs one training step of: the plain model; torch's
checkpoint around every repeated block; checkpoint around sqrt(n)-sized groups of blocks;
`torch.autograd.graph.save_on_cpu` (pinned on CUDA); tensorplace's own per-block checkpoint
plan; and tensorplace plans searched at the measured peak of each recipe (and at given budgets).
Each row has the peak of allocated memory (torch's own records), the peak of reserved memory
(CUDA), the median step time, the ratios to the plain step, whether the loss and every gradient
are bitwise equal to the plain step's, and, for plans, the prediction.
`tensorplace-bench peers` prints it.

Rows are measured one at a time, each on its own: the recipes wrap the model's blocks in place
and unwrap them after, and every plan's executor is closed before the next row, so no row runs
with another's hooks; before each row ``gc.collect()``, and on CUDA ``synchronize()``,
``empty_cache()`` and ``reset_peak_memory_stats()``, so its allocated and reserved peaks are its
own, whatever ran before it (the plain step's gradients, kept for the bitwise check, wait on the
host). ``order="reversed"`` measures the rows in the other order (the recipes before the plans
at their memory, as those need the recipes' peaks), to check exactly that.

Step times are taken in rounds once every row is measured: each row then runs on its own copy of
the model (a deep copy: no executor's hooks on another row's modules), each round times one step
of every row, in turn (reversed every other round), and a row's time is its median over the
rounds. A machine whose load changes during the run then slows every row alike instead of the
rows measured at the time. Each timed step follows an untimed step of the same row: in training
the same model steps again and again, with its data in the caches; a step timed right after
another row's (other weights, other buffers) took 5-9% longer on this project's CPU with tiny
kernels (GPT6 of width 64, one thread), a cost no training run pays.

``time_limit``: seconds a row may take in all (its search, its measured steps, its timed steps);
a row that runs out is reported with an ``error`` and the others go on. The limit is checked
between Python-level operations (a SIGALRM in the main thread, else after each step): a single
long kernel or search finishes first. ``log`` gets a line as each row starts and ends.

Repeated blocks are the modules the planner's `checkpoint-blocks` method finds (the unit-name
prefixes of its blocks), so the recipe and the plan checkpoint the same segments.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import signal
import statistics
import threading
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["Checkpointed", "RowTimeout", "block_modules", "checkpoint_blocks", "checkpoint_sqrt", "compare_peers"]


class Checkpointed(nn.Module):
    """``torch.utils.checkpoint`` (non-reentrant) around ``inner``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def _common_prefix(names: Sequence[str]) -> str:
    parts = [n.split("#")[0].split(".") for n in names]
    out: List[str] = []
    for group in zip(*parts):
        if len(set(group)) != 1:
            break
        out.append(group[0])
    return ".".join(out)


def block_modules(plan: Any) -> List[str]:
    """Qualified names of the repeated blocks of a `checkpoint-blocks` plan, in forward order."""
    units = plan.units
    return [_common_prefix(units[a:b + 1]) for a, b in plan.settings.get("blocks", [])]


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new) if not child.isdigit() else parent.__setitem__(int(child), new)


def _block_replacements(model: nn.Module, blocks: Iterable[str]) -> Dict[str, nn.Module]:
    """Submodule name -> its replacement: torch's checkpoint around every named block."""
    return {name: Checkpointed(model.get_submodule(name)) for name in blocks}


def _sqrt_replacements(model: nn.Module, blocks: Sequence[str]) -> Optional[Dict[str, nn.Module]]:
    """Container name -> its replacement: the blocks in groups of about sqrt(n), every group
    checkpointed but the very last (as ``checkpoint_sequential``). None if the blocks are not the
    whole of ``nn.Sequential`` or ``nn.ModuleList`` containers."""
    by_parent: Dict[str, List[int]] = {}
    for name in blocks:
        parent, _, idx = name.rpartition(".")
        if not idx.isdigit():
            return None
        by_parent.setdefault(parent, []).append(int(idx))
    size = max(1, round(math.sqrt(len(blocks))))
    parents = list(by_parent)
    out: Dict[str, nn.Module] = {}
    for parent, idxs in by_parent.items():
        container = model.get_submodule(parent)
        if not isinstance(container, (nn.Sequential, nn.ModuleList)) or idxs != list(range(len(container))):
            return None
        groups = [nn.Sequential(*[container[i] for i in idxs[k:k + size]]) for k in range(0, len(idxs), size)]
        last = parent == parents[-1]
        wrapped = [Checkpointed(g) for g in (groups[:-1] if last else groups)] + ([groups[-1]] if last else [])
        out[parent] = nn.Sequential(*wrapped) if isinstance(container, nn.Sequential) else nn.ModuleList(wrapped)
    return out


@contextlib.contextmanager
def _swapped(model: nn.Module, replacements: Dict[str, nn.Module]) -> Iterator[nn.Module]:
    """``model`` with the named submodules replaced (sharing their parameters), put back after."""
    old = {name: model.get_submodule(name) for name in replacements}
    try:
        for name, new in replacements.items():
            _replace(model, name, new)
        yield model
    finally:
        for name, module in old.items():
            _replace(model, name, module)


def checkpoint_blocks(model: nn.Module, blocks: Iterable[str]) -> nn.Module:
    """A copy of ``model`` (sharing nothing) with torch's checkpoint around every named block."""
    out = copy.deepcopy(model)
    for name, new in _block_replacements(out, list(blocks)).items():
        _replace(out, name, new)
    return out


def checkpoint_sqrt(model: nn.Module, blocks: Sequence[str]) -> Optional[nn.Module]:
    """A copy of ``model`` with torch's checkpoint around groups of about sqrt(n) consecutive
    blocks of the same container (an ``nn.Sequential`` or ``nn.ModuleList`` whose blocks run one
    after another), like ``checkpoint_sequential``. None if the blocks are not in such containers."""
    out = copy.deepcopy(model)
    repl = _sqrt_replacements(out, blocks)
    if repl is None:
        return None
    for name, new in repl.items():
        _replace(out, name, new)
    return out


def _step(module: nn.Module, x: Any, loss_fn: Callable[[Any], torch.Tensor], seed: int = 0,
          context: Any = None) -> Tuple[torch.Tensor, List[Optional[torch.Tensor]]]:
    """One step's loss and gradients, copied to the host (kept there for the bitwise check, so
    that they take no device memory while other rows are measured)."""
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(seed)
    with context() if context is not None else contextlib.nullcontext():
        loss = loss_fn(module(x))
        loss.backward()
    out = (loss.detach().cpu(), [None if p.grad is None else p.grad.detach().cpu() for p in module.parameters()])
    for p in module.parameters():
        p.grad = None
    return out


def _fresh(dev: torch.device) -> None:
    """What a row starts from: no garbage of earlier rows, and on CUDA an empty cache and peak
    counters reset, so that the row's allocated and reserved peaks are its own."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def _measure(module: nn.Module, x: Any, loss_fn: Callable[[Any], torch.Tensor], repeats: int,
             context: Any = None) -> Dict[str, Any]:
    """Peak allocated (torch's records), peak reserved and allocated (CUDA's counters, from a
    fresh start: see :func:`_fresh`), median step time."""
    from .profiler import unplanned_step_stats

    dev = next(module.parameters()).device
    _fresh(dev)
    if context is None:
        stats = unplanned_step_stats(module, (x,), loss_fn=loss_fn, repeats=repeats)
    else:
        class _InContext(nn.Module):
            def __init__(self, inner: nn.Module) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, *a: Any) -> Any:
                return self.inner(*a)

        wrapper = _InContext(module)
        with context():
            stats = unplanned_step_stats(wrapper, (x,), loss_fn=loss_fn, repeats=repeats)
    reserved = allocated = None
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        reserved = int(torch.cuda.max_memory_reserved(dev))
        allocated = int(torch.cuda.max_memory_allocated(dev))
    return {"peak_bytes": stats["peak_bytes"], "reserved_bytes": reserved, "cuda_peak_allocated_bytes": allocated,
            "step_time": stats["step_time"]}


class RowTimeout(BaseException):
    """A row of the peers table ran past its time limit (a BaseException, as KeyboardInterrupt:
    no ``except Exception`` on the way swallows it)."""


_DEADLINE: List[Tuple[float, str]] = []  # (perf_counter deadline, what) of the running time limits


def _check_deadline() -> None:
    """Raise :class:`RowTimeout` if the innermost time limit has passed: called between the
    steps of a row, in case the alarm's exception was lost on its way (raised where something
    caught and dropped it)."""
    if _DEADLINE and time.perf_counter() > _DEADLINE[-1][0]:
        raise RowTimeout(f"time limit reached during {_DEADLINE[-1][1]}")


@contextlib.contextmanager
def _time_limit(seconds: Optional[float], what: str) -> Iterator[None]:
    """Raise :class:`RowTimeout` once ``seconds`` have passed (SIGALRM in the main thread: at the
    next Python-level operation; elsewhere, and as a backstop, at :func:`_check_deadline` and
    after the block). None: no limit."""
    if seconds is None:
        yield
        return
    if seconds <= 0:
        raise RowTimeout(f"no time left for {what}")
    _DEADLINE.append((time.perf_counter() + seconds, what))
    alarmed = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    previous: Any = None
    if alarmed:
        def alarm(signum: int, frame: Any) -> None:
            raise RowTimeout(f"time limit reached during {what}")

        previous = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
        _check_deadline()
    finally:
        if alarmed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        _DEADLINE.pop()


def _equal(a: Tuple[torch.Tensor, List[Optional[torch.Tensor]]], b: Tuple[torch.Tensor, List[Optional[torch.Tensor]]]) -> bool:
    if not torch.equal(a[0], b[0]) or len(a[1]) != len(b[1]):
        return False
    return all((g is None and h is None) or (g is not None and h is not None and torch.equal(g, h))
               for g, h in zip(a[1], b[1]))


class _Row:
    """One row of the table: how to run it on the model (``enter``: a context manager yielding
    (module, step context)), on its own copy (``copy``), and its time spent so far."""

    def __init__(self, name: str, kind: str, **info: Any) -> None:
        self.name, self.kind, self.info = name, kind, info
        self.record: Dict[str, Any] = {"name": name}
        self.spent = 0.0
        self.enter: Callable[[], Any] = contextlib.nullcontext
        self.copy: Callable[[], Tuple[nn.Module, Any, Callable[[], None]]] = lambda: (None, None, lambda: None)

    def left(self, limit: Optional[float]) -> Optional[float]:
        return None if limit is None else limit - self.spent


def _fmt(n: Optional[int]) -> str:
    from .budget import format_bytes

    return "-" if n is None else format_bytes(n)


def compare_peers(
    model: nn.Module,
    x: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    budgets: Sequence[int] = (),
    backend: Any = None,
    repeats: int = 3,
    search: Optional[Dict[str, Any]] = None,
    progress: Optional[Callable[[str], None]] = None,
    log: Optional[Callable[[str], None]] = None,
    time_limit: Optional[float] = None,
    order: str = "listed",
    profile: Optional[Dict[str, Any]] = None,
) -> List[Dict[str, Any]]:
    """The rows of the peers table (module docstring), the plain step first. ``budgets``: extra
    tensorplace budgets in bytes; ``backend``: the executor's host tier (e.g. a CpuBackend with
    a bandwidth cap); ``repeats``: rounds of timed steps (0: none, the rows' peaks and bitwise
    checks only); ``search``: settings of the search (particles, iterations, seed);
    ``progress``: told what is running (a progress bar's description); ``log``: a line as each row
    starts and ends; ``time_limit``: seconds per row; ``order``: "listed" or "reversed" (the
    order the rows are measured in; the table keeps its order); ``profile``: plan on this profile
    of the model and input (e.g. saved by ``tensorplace-bench profile``) instead of profiling here."""
    import tensorplace as tp

    if int(repeats) < 0:
        raise ValueError(f"repeats must be 0 (no timed rounds) or more, got {repeats!r}")
    if order not in ("listed", "reversed"):
        raise ValueError(f"order must be 'listed' or 'reversed', got {order!r}")
    if time_limit is not None and time_limit <= 0:
        raise ValueError(f"time_limit must be a positive number of seconds, got {time_limit!r}")
    search = dict(search or {})
    note = progress or (lambda _msg: None)
    say = log or (lambda _msg: None)
    dev = next(model.parameters()).device

    from .profiler import _preserved

    with _preserved(model, dev):
        note("plain step")
        reference = _step(model, x, loss_fn)
        note("profiling")
        t0 = time.perf_counter()
        if profile is not None:
            say("peers: planning on the given profile")
            probe = _probe_of(profile, model, x)
        else:
            say("peers: profiling the model")
            probe = tp.plan(model, x, budget=2**50, loss_fn=loss_fn, method="retain", backend=backend,
                            repeats=max(1, repeats))
        say(f"peers: profile ready in {time.perf_counter() - t0:.1f} s")
        try:
            blocks = block_modules(probe.replan(2**50, method="checkpoint-blocks"))
        except tp.PlannerError:
            blocks = []

        rows: List[_Row] = [_Row("unplanned", "plain")]
        recipes: List[_Row] = []
        if blocks:
            recipes.append(_Row("checkpoint per block", "recipe", replacements=lambda m: _block_replacements(m, blocks)))
            if _sqrt_replacements(model, blocks) is not None:
                recipes.append(_Row("checkpoint sqrt(n)", "recipe", replacements=lambda m: _sqrt_replacements(m, blocks)))
        pin = dev.type == "cuda"
        recipes.append(_Row("save_on_cpu", "recipe", context=lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin)))
        rows += recipes
        plans: List[_Row] = []
        if blocks:  # the per-block recipe as a plan: the executor's segments against torch's checkpoint
            plans.append(_Row("tensorplace checkpoint-blocks", "plan", budget=None, method="checkpoint-blocks"))
        plans += [_Row(f"tensorplace at {r.name}", "plan", budget_of=r, method="pso") for r in recipes]
        plans += [_Row(f"tensorplace at {tp.format_bytes(b)}", "plan", budget=int(b), method="pso") for b in budgets]
        rows += plans
        measured = rows[:1 + len(recipes)]
        measured = (measured + plans) if order == "listed" else (measured[::-1] + plans[::-1])

        for k, row in enumerate(measured, 1):
            note(row.name)
            say(f"peers: row {k}/{len(measured)} {row.name}: started")
            t0 = time.perf_counter()
            left = row.left(time_limit)
            # what the row sets up (a plan's executor, the recipe's wrappers) is undone here, outside
            # the time limit, whatever happened inside it
            with contextlib.ExitStack() as undo:
                try:
                    with _time_limit(left, f"row {row.name!r}"):
                        _measure_row(row, model, x, loss_fn, reference, probe, backend, search, undo)
                except tp.BudgetError as exc:
                    row.record["error"] = str(exc.args[0]).splitlines()[0]
                except torch.cuda.OutOfMemoryError as exc:  # this row does not fit the device: the others may
                    row.record["error"] = "out of memory: " + str(exc).splitlines()[0]
                except BaseException as exc:  # noqa: BLE001 - a timeout, maybe wrapped (raised in a hook)
                    if not _timed_out(exc, t0, left):
                        raise
                    # what the row measured before it ran out is not reported: the row is not measured
                    row.record = {"name": row.name, **{k: v for k, v in row.record.items() if k == "budget"},
                                  "error": f"time limit ({time_limit:g} s) reached: {exc}"}
                finally:
                    for p in model.parameters():
                        p.grad = None
            row.spent += time.perf_counter() - t0
            r = row.record
            if "error" in r:
                say(f"peers: row {k}/{len(measured)} {row.name}: not measured after {row.spent:.1f} s ({r['error']})")
            else:
                say(f"peers: row {k}/{len(measured)} {row.name}: done in {row.spent:.1f} s, peak {_fmt(r['peak_bytes'])}"
                    + (f", reserved {_fmt(r['reserved_bytes'])}" if r.get("reserved_bytes") is not None else "")
                    + f", bitwise {'yes' if r['bitwise'] else 'NO'}")

        timed = [row for row in rows if "error" not in row.record]
        if repeats == 0:  # peaks only: the one step each row's measurement timed is no step time
            for row in timed:
                row.record.pop("step_time", None)
            say("peers: no step times (0 rounds)")
        else:
            note(f"step times: {repeats} rounds of {len(timed)} steps, each after an untimed step of its row")
            say(f"peers: step times, {repeats} rounds of one step (after an untimed one) of each of {len(timed)} "
                "rows, each on its own copy of the model")
            t0 = time.perf_counter()
            _time_in_rounds(timed, model, x, loss_fn, repeats, time_limit, backend)
            say(f"peers: step times done in {time.perf_counter() - t0:.1f} s")
    gc.collect()
    out = [row.record for row in rows]
    base = out[0]
    # every prediction is on the profile's clock: the unplanned row's step over the profile's plain
    # step is how much the machine's speed moved between profiling and the timed rounds
    measured = probe.to_dict()["profile"].get("measured") or {}
    if measured.get("step_time"):
        base["profile_step_time"] = float(measured["step_time"])
    for r in out:
        if "peak_bytes" in r and "peak_bytes" in base:
            r["peak_ratio"] = r["peak_bytes"] / base["peak_bytes"]
        if "step_time" in r and "step_time" in base:
            r["time_ratio"] = r["step_time"] / base["step_time"]
    return out


def _probe_of(profile: Dict[str, Any], model: nn.Module, x: Any) -> Any:
    """A retain plan carrying ``profile`` (to replan from), once the profile is checked to be of
    this model and input (its fingerprints, when it has them: `tensorplace-bench profile` writes them)."""
    import tensorplace as tp

    from .api import _inputs_tuple, inputs_fingerprint, parameters_fingerprint

    fp = dict(p.split(":", 1) for p in str(profile.get("model_fingerprint") or "").split(";") if ":" in p)
    modules = {name or "(root)" for name, _ in model.named_modules()}
    missing = sorted({str(u["name"]).split("#")[0] for u in profile.get("units", [])} - modules)
    if missing or fp.get("params") not in (None, parameters_fingerprint(model)) or \
            fp.get("inputs") not in (None, inputs_fingerprint(_inputs_tuple(x))):
        raise tp.PlannerError(
            f"the profile given is of another model or input ({profile.get('model')}, inputs "
            f"{profile.get('input_shapes', '?')}); profile this one with `tensorplace-bench profile` and the same "
            "model options, or leave the profile out")
    data = tp.plan_profile(profile, 2**50, "retain").to_dict()
    data["profile"] = profile
    for key in ("model_fingerprint", "input_shapes", "input_specs"):
        if profile.get(key) is not None:
            data[key] = profile[key]
    return tp.Plan(data)


def _timed_out(exc: BaseException, t0: float, left: Optional[float]) -> bool:
    """Whether ``exc`` is the time limit's (raised as it is, or wrapped by autograd when the
    alarm went off inside a backward hook)."""
    if isinstance(exc, RowTimeout):
        return True
    return (isinstance(exc, Exception) and left is not None and time.perf_counter() - t0 >= left
            and "time limit" in str(exc))


def _measure_row(row: _Row, model: nn.Module, x: Any, loss_fn: Callable[[Any], torch.Tensor],
                 reference: Tuple[torch.Tensor, List[Optional[torch.Tensor]]], probe: Any, backend: Any,
                 search: Dict[str, Any], undo: contextlib.ExitStack) -> None:
    """Measure ``row`` on ``model`` itself (its peaks and bitwise check) and set how it runs on a
    copy of the model for the timing rounds. What it sets up on the model is undone by ``undo``."""
    import tensorplace as tp

    r = row.record
    if row.kind == "plain":
        r.update(_measure(model, x, loss_fn, 1))
        _check_deadline()
        r.update(bitwise=_equal(_step(model, x, loss_fn), reference))
        row.copy = lambda: (model, None, lambda: None)
        return
    if row.kind == "recipe":
        context = row.info.get("context")
        make = row.info.get("replacements")  # model -> {submodule name: its checkpointed replacement}
        module = undo.enter_context(_swapped(model, make(model) if make is not None else {}))
        r.update(_measure(module, x, loss_fn, 1, context))
        _check_deadline()
        r.update(bitwise=_equal(_step(module, x, loss_fn, context=context), reference))

        def on_copy() -> Tuple[nn.Module, Any, Callable[[], None]]:
            if make is None:  # save_on_cpu: the model itself, in its context
                return model, context, lambda: None
            clone = copy.deepcopy(model)
            for name, new in make(clone).items():
                _replace(clone, name, new)
            return clone, context, lambda: None

        row.copy = on_copy
        return
    # a plan
    budget = row.info.get("budget")
    if "budget_of" in row.info:
        source = row.info["budget_of"].record
        if "peak_bytes" not in source:
            raise tp.BudgetError(f"no budget: the row {row.info['budget_of'].name!r} was not measured", None)
        budget = int(source["peak_bytes"])
    method = row.info["method"]
    r["budget"] = budget
    plan = probe.replan(2**50 if budget is None else budget, method=method, **(search if method == "pso" else {}))
    _check_deadline()
    fast = tp.run(model, plan, backend=backend)
    undo.callback(fast.close)  # its hooks leave the model before the next row
    stats = _measure(fast, x, loss_fn, 1)
    _check_deadline()
    same = _equal(_step(fast, x, loss_fn), reference)
    r.update(method=method, **stats, bitwise=same, predicted_peak_bytes=plan.predicted["peak_bytes"],
             predicted_step_time=plan.predicted["step_time"], counts=plan.counts(), actions=plan.actions)

    def on_copy() -> Tuple[nn.Module, Any, Callable[[], None]]:
        own = tp.run(copy.deepcopy(model), plan, backend=backend)
        own.memory_check.left = 0  # the other rows' copies are on the device by design: nothing to report
        return own, None, own.close

    row.copy = on_copy


def _time_in_rounds(rows: Sequence[_Row], model: nn.Module, x: Any, loss_fn: Callable[[Any], torch.Tensor],
                    rounds: int, time_limit: Optional[float], backend: Any) -> None:
    """Set ``step_time`` (median) and ``step_times`` of every row from ``rounds`` rounds of one
    timed step (after an untimed one) of each row, on its own copy of the model, in turn (module docstring)."""
    from .profiler import _Clock, _timed_plain_step

    dev = next(model.parameters()).device
    clock = _Clock(dev)
    made = [row.copy() for row in rows]
    times: List[List[float]] = [[] for _ in rows]
    live = [True] * len(rows)
    try:
        for r in range(-1, rounds):  # round -1: one untimed step of each copy (its first: lazy set-up)
            order = range(len(rows)) if r % 2 == 0 else range(len(rows) - 1, -1, -1)
            for i in order:
                if not live[i]:
                    continue
                row, (module, context, _) = rows[i], made[i]
                module.train()
                t0 = time.perf_counter()
                left = row.left(time_limit)
                try:
                    with _time_limit(left, f"row {row.name!r}'s timed steps"):
                        with context() if context is not None else contextlib.nullcontext():
                            if r >= 0:  # an untimed step first: the row's caches warm (module docstring)
                                _timed_plain_step(module, (x,), loss_fn, clock)
                            seconds = _timed_plain_step(module, (x,), loss_fn, clock)
                    if r >= 0:
                        times[i].append(seconds)
                except BaseException as exc:  # noqa: BLE001 - see _timed_out
                    if not _timed_out(exc, t0, left):
                        raise
                    live[i] = False
                    row.record["error"] = f"time limit ({time_limit:g} s) reached: {exc}"
                finally:
                    for p in module.parameters():
                        p.grad = None
                    row.spent += time.perf_counter() - t0
    finally:
        for _module, _context, close in made:
            close()
        del made
    for row, ts, ok in zip(rows, times, live):
        if ok and ts:
            row.record["step_time"] = statistics.median(ts)
            row.record["step_times"] = ts


def _print_table(rows: List[Dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    from .budget import format_bytes

    t = Table(title="tensorplace against its peers (one training step)")
    for col in ("", "peak", "reserved", "step", "peak / unplanned", "time / unplanned", "bitwise",
                "predicted peak", "predicted step"):
        t.add_column(col, justify="left" if not col else "right")
    def num(r: Dict[str, Any], key: str, fmt: Callable[[Any], str]) -> str:
        return fmt(r[key]) if r.get(key) is not None else "-"

    for r in rows:
        t.add_row(
            r["name"], num(r, "peak_bytes", format_bytes), num(r, "reserved_bytes", format_bytes),
            num(r, "step_time", lambda v: f"{v * 1e3:.0f} ms"), num(r, "peak_ratio", lambda v: f"{v:.2f}"),
            num(r, "time_ratio", lambda v: f"{v:.2f}"),
            ("yes" if r["bitwise"] else "NO") if "bitwise" in r else "-",
            r["error"][:60] if "error" in r else num(r, "predicted_peak_bytes", format_bytes).replace("-", ""),
            "" if "error" in r else num(r, "predicted_step_time", lambda v: f"{v * 1e3:.0f} ms").replace("-", ""),
        )
    Console().print(t)
    base = rows[0] if rows else {}
    if base.get("step_time") and base.get("profile_step_time"):
        Console().print(f"The unplanned step measured {base['step_time'] / base['profile_step_time']:.3f}x the "
                        f"profile's plain step ({base['profile_step_time'] * 1e3:.1f} ms), on which every "
                        "predicted step is: the machine's speed between profiling and the timed rounds.")


def _stderr_line(text: str) -> None:
    """A progress line on stderr, flushed at once, whether or not stderr is a terminal (a log
    file of a long GPU run shows which row is running)."""
    import sys

    print(text, file=sys.stderr, flush=True)


def add_cli(subparsers: Any, model_args: Callable[[Any], None], load_model: Callable[[Any], Tuple[Any, Any, Any]],
            write_json: Callable[[Any, Any], None]) -> None:
    """Register ``tensorplace-bench peers``: ``model_args(parser)`` adds the model options,
    ``load_model(args)`` returns (model, input, loss_fn), ``write_json(args, data)`` honours ``--json``."""
    from .bench.common import budget as budget_arg, non_negative_int, positive_int, progress

    p = subparsers.add_parser("peers", help="measure tensorplace against checkpointing recipes and save_on_cpu")
    model_args(p)
    p.add_argument("--budget", action="append", default=[], type=budget_arg,
                   help="extra tensorplace budget (repeatable), e.g. 200MiB")
    p.add_argument("--link", type=float, default=None, metavar="GB/s",
                   help="cap the CPU backend's host copies at this bandwidth (a GPU-like copy/compute ratio)")
    p.add_argument("--repeats", type=non_negative_int, default=3,
                   help="rounds of timed steps, one step of every row per round after an untimed one (median per "
                        "row); 0: peaks and bitwise checks only, no step times")
    p.add_argument("--particles", type=positive_int, default=100)
    p.add_argument("--iterations", type=positive_int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=300.0, metavar="SECONDS",
                   help="seconds a row may take in all (search, measured steps, timed steps; default 300); a row "
                        "that runs out is reported as such and the others go on")
    p.add_argument("--order", choices=("listed", "reversed"), default="listed",
                   help="the order the rows are measured in (the table keeps its order; the recipes come before "
                        "the plans at their memory either way): a row's peaks must not depend on it")
    p.add_argument("--profile", metavar="FILE", default=None,
                   help="plan the rows on this profile of the same model and inputs (`tensorplace-bench profile`) "
                        "instead of profiling here")

    def run(a: Any) -> int:
        if a.link is not None and a.link <= 0:
            raise SystemExit(f"--link must be a positive bandwidth in GB/s, got {a.link}")
        if a.time_limit is not None and a.time_limit <= 0:
            raise SystemExit(f"--time-limit must be a positive number of seconds, got {a.time_limit}")
        budgets = list(a.budget)  # bytes (parsed by the argument's type)
        prof = None
        if a.profile:
            from .bench.common import read_profile

            prof = read_profile(a.profile, "--profile", " (write one with `tensorplace-bench profile`)")
        model, x, loss_fn = load_model(a)
        backend = None
        device = next(model.parameters()).device
        if a.link is not None:
            if device.type != "cpu":
                raise SystemExit("--link caps the CPU backend; on a GPU the link is the real one")
            from cuda_exec.cpu_backend import CpuBackend

            backend = CpuBackend(bandwidth_cap=a.link * 1e9)
        from ._core import PlannerError

        try:
            with progress("peers") as bar:  # on stderr
                rows = compare_peers(model, x, loss_fn, budgets=budgets, backend=backend, repeats=a.repeats,
                                     search={"particles": a.particles, "iterations": a.iterations, "seed": a.seed},
                                     progress=bar.describe, log=_stderr_line, time_limit=a.time_limit,
                                     order=a.order, profile=prof)
        except PlannerError as exc:
            if prof is None:
                raise
            raise SystemExit(f"--profile {a.profile!r}: {exc}") from None
        finally:
            if backend is not None:
                backend.close()
        _print_table(rows)
        write_json(a, {"command": "peers", "device": str(device), "link_gbps": a.link, "order": a.order,
                       "time_limit_s": a.time_limit, "profile": a.profile, "rows": rows})
        return 0

    p.set_defaults(func=run)
