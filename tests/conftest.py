"""Session set-up for the test suite."""

import os

# The bench commands the tests run in this process leave its C heap as glibc has it
# (tensorplace.bench.common.host_malloc; tests/test_host_malloc.py checks "keep" in a child).
os.environ["TENSORPLACE_HOST_MALLOC"] = "default"


def _draw_from_the_tests_alone() -> None:
    """Hypothesis (6.131 on) mixes literals it finds in the source of the package's loaded modules
    into what it draws, so the derandomized examples changed with any edit of python/tensorplace or
    cuda_exec and with which modules a run happened to import (tests/test_milp.py's segment
    statistic failed when run beside test_segments.py, which imports more of the package, and
    passed in the whole suite). Without them the examples follow from the tests alone."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # an older Hypothesis: it draws no local constants
        return
    if hasattr(providers, "_get_local_constants") and hasattr(providers, "Constants"):
        providers._get_local_constants = lambda *args, **kwargs: providers.Constants()


_draw_from_the_tests_alone()


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _torch_threads_as_the_session_has_them():
    """Every test starts on the session's torch threads: one that leaves a command's thread count
    behind (benches/executor_overhead.py's main() set one thread, and the rest of the suite ran on
    it, about half as fast on two cores) cannot change the tests after it."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
