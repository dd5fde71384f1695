"""Allocator simulation: recorded GPU traces replay to their recorded peaks; invariants on random
allocation sequences; the `tensorplace-bench allocator` command; errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorplace import allocator
from tensorplace.allocator import AllocatorError
from tensorplace.bench import main
from traces import small_trace

# As in CI: the repository's parent folder holds shared/.
TRACES_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "gpu-traces"
TRACES = sorted(TRACES_DIR.glob("*.json")) if TRACES_DIR.is_dir() else []
needs_traces = pytest.mark.skipif(not TRACES, reason=f"no recorded allocator traces in {TRACES_DIR}")

MIB = 1 << 20


@needs_traces
@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_trace_replays_to_its_recorded_peaks(path: Path) -> None:
    trace = json.loads(path.read_text())
    r = allocator.replay(path)
    assert r["model"] == "caching"
    assert r["alloc_conf"] == trace["alloc_conf"]
    assert r["recorded"]["max_reserved"] == trace["max_reserved"]
    assert abs(r["max_reserved"] - trace["max_reserved"]) <= 0.01 * trace["max_reserved"], r
    assert r["max_allocated"] == trace["max_allocated"], r
    assert r["max_reserved"] >= r["max_allocated"]


@needs_traces
def test_replay_takes_a_dict_or_json_text_alike() -> None:
    path = TRACES[0]
    text = path.read_text()
    by_path = allocator.replay(path)
    assert allocator.replay(text) == by_path
    assert allocator.replay(json.loads(text)) == by_path


@needs_traces
def test_alloc_conf_selects_expandable_segments() -> None:
    plain = next(p for p in TRACES if "expandable" not in p.name and "resnet50-unplanned" in p.name)
    r = allocator.replay(plain)
    forced = allocator.replay(plain, alloc_conf="expandable_segments:True")
    assert forced["alloc_conf"] == ""  # what the trace was recorded under
    # the same allocations waste less in segments that grow by pages
    assert forced["max_reserved"] < r["max_reserved"]
    assert forced["max_allocated"] <= r["max_allocated"]


@needs_traces
def test_offset_pool_model_replays_too() -> None:
    r = allocator.replay(TRACES[0], "offset-pool", check_merged=True)
    assert r["model"] == "offset-pool"
    assert r["max_reserved"] >= r["max_allocated"] > 0
    assert r["unmerged_free_pairs"] == 0


# ------------------------------------------------------------------------- properties

sizes = st.one_of(
    st.integers(1, MIB),  # small pool
    st.integers(MIB + 1, 10 * MIB),  # 20 MiB segments
    st.integers(10 * MIB, 100 * MIB),  # own segments
)


@st.composite
def sequences(draw: Any) -> List[Tuple[Any, ...]]:
    """Random allocations and frees on two streams, everything freed at the end."""
    events: List[Tuple[Any, ...]] = []
    live: List[int] = []
    for i in range(draw(st.integers(1, 60))):
        if live and draw(st.booleans()):
            events.append(("free", live.pop(draw(st.integers(0, len(live) - 1)))))
        events.append(("alloc", i, draw(sizes), draw(st.integers(0, 1))))
        live.append(i)
    order = draw(st.permutations(live))
    events.extend(("free", i) for i in order)
    return events


confs = st.sampled_from([
    ("caching", ""),
    ("caching", "expandable_segments:True"),
    ("caching", "max_split_size_mb:32"),
    ("offset-pool", ""),
])
common = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _run(events: List[Tuple[Any, ...]], conf: Tuple[str, str]) -> Dict[str, Any]:
    return allocator.simulate(events, conf[0], alloc_conf=conf[1], timeline=True, check_merged=True)


@common
@given(sequences(), confs)
def test_reserved_is_at_least_allocated_at_every_event(events: List[Tuple[Any, ...]], conf: Tuple[str, str]) -> None:
    r = _run(events, conf)
    assert len(r["timeline"]) == len(events)
    assert all(res >= alloc for alloc, res in r["timeline"])
    assert r["max_reserved"] == max(res for _, res in r["timeline"])
    assert r["max_allocated"] == max(alloc for alloc, _ in r["timeline"])


@common
@given(sequences(), confs)
def test_everything_is_returned_at_the_end(events: List[Tuple[Any, ...]], conf: Tuple[str, str]) -> None:
    r = _run(events, conf)
    assert r["allocated"] == 0
    assert r["live_blocks"] == 0
    # with every block free, releasing the cache gives every segment back
    assert r["reserved_after_release"] == 0


@common
@given(sequences(), confs)
def test_no_two_adjacent_free_blocks_stay_unmerged(events: List[Tuple[Any, ...]], conf: Tuple[str, str]) -> None:
    assert _run(events, conf)["unmerged_free_pairs"] == 0


@common
@given(sequences(), confs)
def test_a_replay_is_deterministic(events: List[Tuple[Any, ...]], conf: Tuple[str, str]) -> None:
    assert _run(events, conf) == _run(list(events), conf)


# ------------------------------------------------------------------------- CLI and errors


@needs_traces
def test_bench_allocator_prints_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps long names at 80 columns otherwise
    two = [str(TRACES[0]), str(TRACES[-1])]
    out = tmp_path / "alloc.json"
    assert main(["allocator", *two, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert TRACES[0].stem in printed and "error" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [r["trace"] for r in rows] == two
    for row, path in zip(rows, two):
        trace = json.loads(Path(path).read_text())
        assert row["recorded"]["max_reserved"] == trace["max_reserved"]
        assert row["max_reserved"] == allocator.replay(path)["max_reserved"]
        assert row["reserved_error_pct"] == pytest.approx(
            (row["max_reserved"] - trace["max_reserved"]) / trace["max_reserved"] * 100)


def test_bench_allocator_json_has_a_header_and_the_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On traces made here: the header names the traces and the settings, a row per trace."""
    monkeypatch.setenv("COLUMNS", "200")
    paths = [tmp_path / "exact.json", tmp_path / "over.json"]
    paths[0].write_text(json.dumps(small_trace(20 * MIB)))
    paths[1].write_text(json.dumps(small_trace(25 * MIB)))
    out = tmp_path / "alloc.json"
    args = ["allocator", *map(str, paths), "--capacity", str(64 * MIB), "--alloc-conf", "expandable_segments:True",
            "--json", str(out)]
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert data["command"] == "allocator" and data["argv"] == args and data["exit_code"] == 0
    assert data["traces"] == [str(p) for p in paths] and data["model"] == "caching"
    assert (data["alloc_conf"], data["capacity"], data["trace_layout"]) == ("expandable_segments:True", 64 * MIB, True)
    printed = capsys.readouterr().out
    assert [r["trace"] for r in data["rows"]] == data["traces"]
    for row, path in zip(data["rows"], paths):
        assert path.stem in printed
        again = allocator.replay(path, alloc_conf="expandable_segments:True", capacity=64 * MIB)
        assert row["max_reserved"] == again["max_reserved"] and row["max_allocated"] == again["max_allocated"] == 8 * MIB
        rec = json.loads(path.read_text())["max_reserved"]
        assert row["recorded"]["max_reserved"] == rec
        assert row["reserved_error_pct"] == pytest.approx((row["max_reserved"] - rec) / rec * 100)
    assert data["rows"][0]["reserved_error_pct"] != data["rows"][1]["reserved_error_pct"]
    # the defaults are in the header too
    assert main(["allocator", str(paths[0]), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert (data["alloc_conf"], data["capacity"], data["trace_layout"]) == (None, None, True)


def test_bad_input_says_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(AllocatorError, match="not allocated"):
        allocator.simulate([("free", 3)])
    with pytest.raises(AllocatorError, match="unknown allocator model"):
        allocator.simulate([("alloc", 1, 10)], "buddy")
    with pytest.raises(AllocatorError, match="cuda-caching-allocator-trace"):
        allocator.replay({"format": "tensorplace.plan", "version": 1})
    with pytest.raises(AllocatorError, match="version 9"):
        allocator.replay({"format": "cuda-caching-allocator-trace", "version": 9, "events": []})
    with pytest.raises(AllocatorError, match="cannot read allocator trace"):
        allocator.replay(tmp_path / "missing.json")
    with pytest.raises(AllocatorError, match="not modelled"):
        allocator.simulate([("alloc", 1, 10)], alloc_conf="gpu_magic:1")
    with pytest.raises(AllocatorError, match=r"\('alloc', id, size"):
        allocator.simulate([("malloc", 1, 10)])


def test_an_allocation_past_an_expandable_segments_address_space_is_an_error_not_a_crash() -> None:
    with pytest.raises(AllocatorError, match="address space"):
        allocator.simulate([("alloc", 1, 2**41), ("free", 1)], alloc_conf="expandable_segments:True")
