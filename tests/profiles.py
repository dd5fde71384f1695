"""Hypothesis strategies for random DAG profiles, and an independent reference of the unplanned
memory curve (written from docs/cost-model.md, not from the Rust code)."""

from __future__ import annotations

from typing import Any, Dict, List

from hypothesis import strategies as st


@st.composite
def dag_profiles(draw: Any, max_units: int = 10, transients: bool = True, held: bool = True,
                 segments: bool = True, checkpointable: bool = False, forward_held: bool = True) -> Dict[str, Any]:
    """Random DAG profiles. `checkpointable`: the profiles where checkpoint segments of several
    units pay off: every unit reads the one before it, a unit holds its inputs' unsaved outputs for
    a replay (all of them, attributed in held_from, which a segment regenerates instead), and the
    units are named as repeated blocks of 2 or 3 units (so the profile has default segment
    starts) two times in three; transients, gradients and constant memory are small, so that
    activations decide the peak; forward times are short and copies slow, so that recomputing
    pays off more often than swapping. `forward_held`: some units carry `forward_held_until`
    (never the checkpointable ones)."""
    n = draw(st.integers(min(3, max_units) if checkpointable else 1, max_units))
    small = 5 if checkpointable else 1
    units: List[Dict[str, Any]] = []
    block = draw(st.sampled_from([0, 2, 3])) if checkpointable else 0
    for i in range(n):
        inputs = sorted(set(draw(st.lists(st.integers(0, i - 1), max_size=2)))) if i else []
        if checkpointable and i:
            inputs = sorted(set(inputs[:1]) | {i - 1})
        out = draw(st.integers(0, 1000))
        saved = draw(st.booleans())
        if not transients and not saved:
            out = 0  # an unsaved output is a transient of the unit's forward (and of its replay)
        extra = draw(st.integers(0, 300 // small))
        act = (out if saved else 0) + extra
        units.append(
            {
                "name": f"b{i // block}.u{i % block}" if block else f"u{i}",
                "kind": f"k{i % block}" if block else "other",
                "inputs": inputs,
                "model_inputs": [] if inputs else [0],
                "fwd_time": draw(st.floats(0.0, 2.0 / small)),
                "bwd_time": draw(st.floats(0.0, 4.0)),
                "act_bytes": act,
                "output_bytes": out,
                "output_saved": saved,
                "read_by": [],
                "held_input_bytes": draw(st.integers(0, 200)) if held else 0,
                "fwd_transient_bytes": draw(st.integers(0, 300 // small)) if transients else 0,
                "bwd_transient_bytes": draw(st.integers(0, 300 // small)),
                "grad_bytes": draw(st.integers(0, 100 // small)),
            }
        )
    # Who reads each unit's activations in backward: itself (usually) and consumers (sometimes).
    for i, u in enumerate(units):
        readers = {i} if draw(st.booleans()) or not u["inputs"] else set()
        for c in range(i + 1, n):
            if i in units[c]["inputs"] and draw(st.booleans()):
                readers.add(c)
        if u["act_bytes"] > 0 and not readers:
            readers.add(i)
        u["read_by"] = sorted(readers)
    if segments:
        # What a unit holds for a replay, split by producer (held_from), and the saved values it
        # reads of its inputs (saved_from): checkpoint segments use both.
        for i, u in enumerate(units):
            held_from, left = [], u["held_input_bytes"]
            for p in u["inputs"]:
                if not units[p]["output_saved"] and left > 0 and draw(st.booleans()):
                    b = draw(st.integers(0, left))
                    held_from.append([p, b])
                    left -= b
            if checkpointable:
                held_from = [[p, units[p]["output_bytes"]] for p in u["inputs"] if not units[p]["output_saved"]]
                u["held_input_bytes"] = sum(b for _, b in held_from) + (draw(st.integers(0, 50)) if held else 0)
            u["held_from"] = held_from
            # as the profiler records it: the values of its inputs whose activations its backward
            # reads (an output it saves, or a saved glue value: the producer's activations)
            u["saved_from"] = [[p, min(units[p]["output_bytes"], units[p]["act_bytes"])
                                if units[p]["output_saved"] else units[p]["act_bytes"]]
                               for p in u["inputs"] if i in units[p]["read_by"]]
    # A unit whose activations the forward lets go of before its last forward reader (the
    # replay step's `forward_held_until`: no earlier than the units that save them). Not in the
    # checkpointable profiles, made for optima with segments (cheaper swaps work against that).
    for i, u in enumerate(units):
        last_fwd = max([i] + [c for c in range(i + 1, n) if i in units[c]["inputs"]])
        held = max([i] + u["read_by"])
        if forward_held and not checkpointable and u["act_bytes"] > 0 and held < last_fwd and draw(st.booleans()):
            u["forward_held_until"] = draw(st.integers(held, last_fwd - 1))
    bw = draw(st.floats(10.0, 50.0 if checkpointable else 10000.0))
    return {
        "format": "tensorplace.profile",
        "version": 1,
        "model": "random",
        "device": "test",
        "memory": {"parameters": draw(st.integers(0, 1000 // small)), "optimizer_state": 0, "inputs": 0, "workspace": 0},
        "d2h_bandwidth": bw,
        "h2d_bandwidth": bw * draw(st.floats(0.5, 2.0)),
        "copy_engines": draw(st.sampled_from([1, 2])),
        "units": units,
    }


def reference_unplanned(profile: Dict[str, Any]) -> Dict[str, float]:
    """Step time and peak of the all-retain plan, straight from the cost-model document."""
    units = profile["units"]
    n = len(units)
    last_fwd = list(range(n))
    for i, u in enumerate(units):
        for p in u["inputs"]:
            last_fwd[p] = max(last_fwd[p], i)
    mem = sum(profile["memory"].values())
    peak = mem
    for i, u in enumerate(units):
        alloc = u["act_bytes"] + (0 if u["output_saved"] else u["output_bytes"])
        peak = max(peak, mem + alloc + u["fwd_transient_bytes"])
        mem += alloc
        for p in range(n):
            if last_fwd[p] == i and not units[p]["output_saved"]:
                mem -= units[p]["output_bytes"]
        peak = max(peak, mem)
    for i in reversed(range(n)):
        u = units[i]
        peak = max(peak, mem + u["bwd_transient_bytes"] + u["grad_bytes"])
        mem += u["grad_bytes"]
        for p in range(n):
            if units[p]["read_by"] and min(units[p]["read_by"]) == i:
                mem -= units[p]["act_bytes"]
    time = sum(u["fwd_time"] + u["bwd_time"] for u in units)
    return {"step_time": time, "peak_bytes": peak}


def multi_unit_segments(actions: List[str], starts: List[int]) -> int:
    """How many checkpoint segments of a plan have more than one unit: runs of consecutive
    recomputed units, split before every unit in `starts` (docs/cost-model.md)."""
    count, length = 0, 0
    split = set(starts)
    for u, a in enumerate(actions + ["retain"]):
        if a == "recompute" and length and u not in split:
            length += 1
            continue
        count += length > 1
        length = 1 if a == "recompute" else 0
    return count
