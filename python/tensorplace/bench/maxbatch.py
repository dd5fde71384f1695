"""``maxbatch``: the largest batch each method fits into a memory budget (HOME's Table 2).

On a real model (``--model``): the batch is found with the cost model on a profile extrapolated
from two measured probe profiles (sizes and times are linear in the batch), then confirmed by a
measured step at that batch (profiled, planned and run there; stepped down by 5% while the
measured peak is over the budget), with the measured throughput. Next to the planner's methods:
``unplanned`` (plain steps) and ``torch-checkpoint`` (torch.utils.checkpoint around each repeated
block), whose batches come from measured peaks at the probe batches, confirmed the same way.

On a builtin modelled profile (``--builtin``), or on two saved profiles of a model at different
batches (``--profile A B``, extrapolated as above): predicted only, by bisection on the batch.
"""

from __future__ import annotations

import argparse
import copy
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import examples
from .._core import BudgetError
from ..budget import format_bytes
from ..planning import Plan, evaluate, plan_profile, unplanned_peak, without_executor
from . import common

UNIT_INTS = ("act_bytes", "output_bytes", "held_input_bytes", "fwd_transient_bytes", "bwd_transient_bytes",
             "grad_bytes", "replay_transient_bytes", "lingering_bytes", "bwd_replay_bytes", "replay_slack_bytes")
UNIT_FLOATS = ("fwd_time", "bwd_time")
UNIT_PAIRS = ("held_from", "saved_from")
STRUCTURE = ("name", "kind", "inputs", "model_inputs", "output_saved", "read_by", "saved_inputs", "lingering_until")


def extrapolate(p1: Dict[str, Any], b1: int, p2: Dict[str, Any], b2: int, b: int) -> Dict[str, Any]:
    """The profile at batch `b`, every size and time linear in the batch through the profiles at
    batches b1 and b2 (which must have the same units)."""
    if b1 == b2:
        raise ValueError("the two probe batches must differ")
    u1, u2 = p1["units"], p2["units"]
    if len(u1) != len(u2) or any(x.get(k) != y.get(k) for x, y in zip(u1, u2) for k in STRUCTURE):
        raise ValueError(f"the profiles at batches {b1} and {b2} have different units: the model's structure "
                         "changes with the batch, so it cannot be extrapolated")
    f = (b - b1) / (b2 - b1)

    def lin(x: float, y: float) -> float:
        return max(0.0, x + (y - x) * f)

    out = copy.deepcopy(p2)
    out["batch_size"] = b
    out["memory"] = {k: int(round(lin(p1["memory"][k], v))) for k, v in p2["memory"].items()}
    if p1.get("measured") and p2.get("measured"):
        out["measured"] = {"peak_bytes": int(round(lin(p1["measured"]["peak_bytes"], p2["measured"]["peak_bytes"]))),
                           "step_time": lin(p1["measured"]["step_time"], p2["measured"]["step_time"])}
    for x, y, o in zip(u1, u2, out["units"]):
        for k in UNIT_INTS:
            if k in x and k in y:
                o[k] = int(round(lin(x[k], y[k])))
        for k in UNIT_FLOATS:
            o[k] = lin(x[k], y[k])
        for k in UNIT_PAIRS:  # [[producer, bytes], ...]: the bytes scale, the producers stay
            if k in x and k in y:
                if [p for p, _ in x[k]] != [p for p, _ in y[k]]:
                    raise ValueError(f"unit {o['name']}: {k} differs between the probe batches")
                o[k] = [[p, int(round(lin(bx, by)))] for (p, bx), (_, by) in zip(x[k], y[k])]
        if "held_from" in o and "held_input_bytes" in o:  # rounding must not push the parts above the whole
            o["held_input_bytes"] = max(o["held_input_bytes"], sum(b for _, b in o["held_from"]))
    for k in ("model_fingerprint", "input_shapes", "input_specs"):
        out.pop(k, None)
    for x, y, o in zip(u1, u2, out["units"]):  # value ids of one profiling run; the cost model falls back to held_from/saved_from
        o.pop("held_values", None)
        o.pop("saved_values", None)
        o.pop("lingering_values", None)
        if "bwd_replay_bytes" not in x or "bwd_replay_bytes" not in y:  # not one batch's: the stage's whole peak
            o.pop("bwd_replay_bytes", None)
        if "replay_slack_bytes" in x and "replay_slack_bytes" not in y:  # measured at one batch only: kept
            o["replay_slack_bytes"] = x["replay_slack_bytes"]
    return out


def linear_batch(b1: int, y1: float, b2: int, y2: float, limit: float, cap: int) -> int:
    """The largest batch whose linear prediction through (b1, y1), (b2, y2) is within `limit`."""
    slope = (y2 - y1) / (b2 - b1)
    if slope <= 0:
        return cap
    return max(0, min(cap, int(math.floor(b1 + (limit - y1) / slope))))


def bisect_batch(fits: Callable[[int], Optional[float]], cap: int) -> Tuple[int, Optional[float]]:
    """The largest batch <= cap for which fits() gives a value (assumed monotone), and that value."""
    lo, hi, t = 0, 1, None
    while hi <= cap and (th := fits(hi)) is not None:
        lo, hi, t = hi, hi * 2, th
    hi = min(hi, cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        tm = fits(mid)
        if tm is not None:
            lo, t = mid, tm
        else:
            hi = mid
    return lo, t


# --- builtin or saved profiles (predicted) ---------------------------------------------------


def saved_profiles(paths: List[str]) -> Tuple[str, Callable[[int], Dict[str, Any]]]:
    """(label, profile at a batch) from two saved profiles of one model at different batches."""
    p1, p2 = sorted((common.read_profile(path, "--profile") for path in paths), key=lambda p: p.get("batch_size") or 0)
    b1, b2 = p1.get("batch_size"), p2.get("batch_size")
    if not b1 or b1 == b2:
        raise SystemExit(f"--profile: give two profiles of one model at different batch sizes (these have {b1} and "
                         f"{b2}), e.g. from `tensorplace-bench profile --batch 4 ...` and `... --batch 8 ...`")
    try:
        extrapolate(p1, b1, p2, b2, b2)
    except ValueError as e:
        raise SystemExit(f"--profile: {e}") from None
    return f"{p2.get('model')} (profiles at batches {b1} and {b2})", lambda b: extrapolate(p1, b1, p2, b2, b)


def _predicted(a: argparse.Namespace, methods: List[str], label: str,
               profile_at: Callable[[int], Dict[str, Any]]) -> int:
    memory = a.memory
    rows = []

    def fits_fn(method: str) -> Callable[[int], Optional[float]]:
        def fits(batch: int) -> Optional[float]:
            prof = profile_at(batch)
            if method == "unplanned":
                if unplanned_peak(prof) > memory:
                    return None
                return evaluate(without_executor(prof), ["retain"] * len(prof["units"]), memory)["step_time"]
            try:
                return plan_profile(prof, memory, method, iterations=a.iterations, particles=a.particles,
                                    seed=a.seed).predicted["step_time"]
            except BudgetError:
                return None
        return fits

    with common.progress("bisecting the batch", total=len(methods)) as bar:
        for method in methods:
            bar.describe(f"bisecting the batch: {method}")
            b, t = bisect_batch(fits_fn(method), a.max_batch)
            bar.advance()
            # no rate where the step time is not positive: the two probes' timings (noisy on tiny
            # models) can extrapolate every stage time to 0 at a large batch
            rate = b / t if t is not None and t > 0 else None
            rows.append([method, b, "-" if rate is None else f"{rate:.0f}"])
            a.out.append("rows", {"method": method, "max_batch": b, "predicted_step_time": t,
                                  "predicted_samples_per_s": rate})
    common.table(f"{label}: largest batch in {format_bytes(memory)} (predicted)", ["method", "max batch", "samples/s"], rows)
    a.out.update(model=label, memory_bytes=memory, mode="predicted")
    return 0


# --- real models (found with the cost model, confirmed by measured steps) ----------------------


class _Real:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.rm = common.model_from_args(a, batch=a.probe_batches[0])
        self.profiles: Dict[int, Dict[str, Any]] = {}

    def model_at(self, batch: int) -> common.RealModel:
        return self.rm.at_batch(batch)

    def profile_at(self, batch: int) -> Dict[str, Any]:
        if batch not in self.profiles:
            self.profiles[batch] = common.profile(self.model_at(batch), self.a.repeats)
        return self.profiles[batch]

    def search(self) -> Dict[str, Any]:
        return {"iterations": self.a.iterations, "particles": self.a.particles, "seed": self.a.seed}

    def predicted(self, method: str) -> Tuple[int, Optional[float]]:
        """Cost-model batch for a planner method on extrapolated profiles."""
        (b1, b2), memory = self.a.probe_batches, self.a.memory
        p1, p2 = self.profile_at(b1), self.profile_at(b2)

        def fits(b: int) -> Optional[float]:
            try:
                return plan_profile(extrapolate(p1, b1, p2, b2, b), memory, method, **self.search()).predicted["step_time"]
            except BudgetError:
                return None

        return bisect_batch(fits, self.a.max_batch)

    def smallest_need(self) -> int:
        """The lower bound of the profile extrapolated to batch 1: what any plan needs."""
        from ..planning import lower_bound

        (b1, b2) = self.a.probe_batches
        return lower_bound(extrapolate(self.profile_at(b1), b1, self.profile_at(b2), b2, 1))

    def measured_linear(self, module_at: Callable[[int], Tuple[Any, common.RealModel]]) -> Tuple[int, float]:
        """(largest batch by the measured peaks at the probe batches, the peak they give at batch 1)."""
        (b1, b2), memory = self.a.probe_batches, self.a.memory
        peaks = []
        for b in (b1, b2):
            module, rm = module_at(b)
            peaks.append(common.measure(module, rm.inputs, rm.loss_fn, 1)["peak_bytes"])
        at1 = peaks[0] + (peaks[1] - peaks[0]) * (1 - b1) / (b2 - b1)
        return linear_batch(b1, peaks[0], b2, peaks[1], memory, self.a.max_batch), at1

    def run_planned(self, method: str, batch: int) -> Optional[Dict[str, Any]]:
        from ..api import run
        from .plan import plan_from_profile

        rm = self.model_at(batch)
        try:
            p: Plan = plan_from_profile(self.profile_at(batch), self.a.memory, method, **self.search())
        except BudgetError:
            return None
        fast = run(rm.model, p)
        try:
            m = common.measure(fast, rm.inputs, rm.loss_fn, self.a.repeats)
        finally:
            fast.close()
        m["predicted_step_time"] = p.predicted["step_time"]
        return m


def _confirm(batch: int, attempt: Callable[[int], Optional[Dict[str, Any]]], memory: int, tries: int,
             bar: Any, label: str) -> Tuple[Optional[int], Optional[Dict[str, Any]], List[Dict[str, Any]]]:
    """Measure at `batch`, stepping down by 5% while the step does not fit; (batch, figures, log)."""
    log = []
    for _ in range(tries):
        if batch < 1:
            break
        bar.describe(f"{label}: measuring batch {batch}")
        m = attempt(batch)
        fits = m is not None and m["peak_bytes"] <= memory
        log.append({"batch": batch, "planned": m is not None, "peak_bytes": None if m is None else m["peak_bytes"],
                    "fits": fits})
        if fits:
            return batch, m, log
        batch -= max(1, math.ceil(batch * 0.05))
    return None, None, log


def _real(a: argparse.Namespace, methods: List[str]) -> int:
    memory = a.memory
    r = _Real(a)
    b1, b2 = a.probe_batches
    print(f"{r.rm.name}: largest batch in {format_bytes(memory)}, measured on {common.where(r.rm.device)} "
          f"(probe profiles at batches {b1} and {b2})")
    rows = []
    with common.progress("maxbatch", total=len(methods)) as bar:
        for method in methods:
            bar.describe(f"{method}: finding the batch")
            pred_t: Optional[float] = None
            note = ""
            if method == "unplanned":
                predicted, need = r.measured_linear(lambda b: (r.rm.model, r.model_at(b)))

                def attempt(b: int) -> Optional[Dict[str, Any]]:
                    rm = r.model_at(b)
                    return common.measure(rm.model, rm.inputs, rm.loss_fn, a.repeats)
            elif method == "torch-checkpoint":
                wrapped, nblocks = common.with_block_checkpoints(r.rm.model)
                if nblocks == 0:
                    print("skipping torch-checkpoint: no repeated blocks found (children of one class repeated "
                          "in an nn.ModuleList or nn.Sequential)")
                    a.out.append("skipped_methods", method)
                    bar.advance()
                    continue
                note = f"{nblocks} blocks"
                predicted, need = r.measured_linear(lambda b: (wrapped, r.model_at(b)))

                def attempt(b: int) -> Optional[Dict[str, Any]]:
                    rm = r.model_at(b)
                    return common.measure(wrapped, rm.inputs, rm.loss_fn, a.repeats)
            else:
                predicted, pred_t = r.predicted(method)
                need = float(r.smallest_need()) if predicted < 1 else 0.0

                def attempt(b: int, method: str = method) -> Optional[Dict[str, Any]]:
                    return r.run_planned(method, b)
            if predicted < 1:
                print(f"{method}: no batch fits {format_bytes(memory)}: at batch 1 it needs about {format_bytes(need)}; "
                      "raise --memory")
            got, m, log = _confirm(predicted, attempt, memory, a.tries, bar, method) if predicted >= 1 else (None, None, [])
            bar.advance()
            step = None if m is None else m["step_time"]
            if m is not None and m.get("predicted_step_time") is not None:
                pred_t = m["predicted_step_time"]
            rows.append([method + (f" ({note})" if note else ""), predicted, "-" if got is None else got,
                         common.fmt_bytes(None if m is None else m["peak_bytes"]), common.ms(step),
                         "-" if step is None else f"{got / step:.1f}",
                         "-" if pred_t is None or got is None else f"{got / pred_t:.1f}"])
            a.out.append("rows", {
                "method": method, "note": note, "predicted_batch": predicted, "confirmed_batch": got,
                "measured_peak_bytes": None if m is None else m["peak_bytes"], "measured_step_time": step,
                "samples_per_s": None if step is None else got / step,
                "predicted_step_time": pred_t, "attempts": log,
            })
    common.table(
        f"{r.rm.name} ({r.rm.shapes().split(',')[0]} per probe): largest batch in {format_bytes(memory)}, measured on {common.where(r.rm.device)}",
        ["method", "cost model", "confirmed", "measured peak", "step ms", "samples/s", "predicted samples/s"], rows)
    a.out.update(model=r.rm.name, memory_bytes=memory, mode="real, measured", probe_batches=[b1, b2])
    return 0


def cmd_maxbatch(a: argparse.Namespace) -> int:
    """The largest batch each method fits into --memory."""
    if a.probe_batches[0] == a.probe_batches[1]:
        raise SystemExit("--probe-batches: give two different batch sizes, e.g. --probe-batches 4 8")
    a.probe_batches = sorted(a.probe_batches)
    extra = common.PSEUDO_METHODS
    methods = common.known_methods(a.methods, a, extra=extra)
    if a.builtin or a.profile:
        if "torch-checkpoint" in methods:
            print("skipping torch-checkpoint: it is measured on a real model (--model), not predicted on a profile")
            a.out.append("skipped_methods", "torch-checkpoint")
        label, profile_at = ((a.builtin, lambda b: examples.profile(a.builtin, batch_size=b)) if a.builtin
                             else saved_profiles(a.profile))
        return _predicted(a, [m for m in methods if m != "torch-checkpoint"], label, profile_at)
    return _real(a, methods)


def add_cli(sub: Any) -> None:
    m = sub.add_parser("maxbatch", help="largest batch per method in a memory budget (real model: measured)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.profile_source_args(m, None, batch=4, profiles=2)
    common.search_args(m, 50, 50)
    m.add_argument("--memory", type=common.budget, required=True, help="the device memory budget, e.g. 300MiB or 11GiB")
    m.add_argument("--methods", nargs="+",
                   default=["pso", "swap-all", "recompute-all", "checkpoint-blocks", "torch-checkpoint", "unplanned"],
                   help="planner methods, plus unplanned and torch-checkpoint; methods the planner does not know are skipped")
    m.add_argument("--probe-batches", type=common.positive_int, nargs=2, default=[4, 8], metavar=("B1", "B2"),
                   help="batches of the two measured profiles the cost model extrapolates from (default 4 8)")
    m.add_argument("--max-batch", type=common.positive_int, default=4096, help="largest batch tried (default 4096)")
    m.add_argument("--tries", type=common.positive_int, default=6,
                   help="measured attempts per method, 5%% smaller each time (default 6)")
    m.set_defaults(fn=cmd_maxbatch)
