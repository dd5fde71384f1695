"""Allocator traces made in the tests (the recorded ones are in ../shared, not always there)."""

from __future__ import annotations

from typing import Any, Dict, List

MIB = 1 << 20


def small_trace(recorded_reserved: int) -> Dict[str, Any]:
    """A cuda-caching-allocator-trace of one 20 MiB segment holding a 3 MiB and a 5 MiB block,
    both freed; it says the real allocator reserved `recorded_reserved` bytes."""
    seg = 1 << 40
    events: List[Dict[str, Any]] = [{"action": "segment_alloc", "addr": seg, "size": 20 * MIB}]
    blocks = [(seg, 3 * MIB), (seg + 3 * MIB, 5 * MIB)]
    events += [{"action": "alloc", "addr": a, "size": n} for a, n in blocks]
    for a, n in blocks:
        events += [{"action": "free_requested", "addr": a, "size": n}, {"action": "free_completed", "addr": a, "size": n}]
    return {"format": "cuda-caching-allocator-trace", "alloc_conf": "", "at_start": {"allocated": 0, "reserved": 0},
            "max_allocated": 8 * MIB, "max_reserved": recorded_reserved, "events": events}
