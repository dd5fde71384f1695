"""``tensorplace-bench``: the numbers behind docs/benchmarks.md and docs/results.md, reproducible
from a shell.

    tensorplace-bench demo                       # plan() and run() on a real model, measured
    tensorplace-bench accuracy                   # predicted vs measured, several plans, real model
    tensorplace-bench profile --model resnet18 -o r18.profile.json   # on the GPU machine
    tensorplace-bench plan r18.profile.json --budget 6GiB -o r18.plan.json   # anywhere
    tensorplace-bench maxbatch --model resnet18 --memory 300MiB   # largest batch per method, measured
    tensorplace-bench maxbatch --builtin vgg16 --memory 11GiB     # the same, predicted on a builtin profile
    tensorplace-bench compare --builtin resnet50   # methods side by side on a builtin profile (predicted)
    tensorplace-bench compare --model resnet18     # ... on a real model, profiled here first
    tensorplace-bench convergence --builtin inception_v3 --png conv.png
    tensorplace-bench timeline --profile r18.profile.json --png timeline.png
    tensorplace-bench peers --model gpt          # against torch's checkpointing and save_on_cpu, measured
    tensorplace-bench allocator TRACE...         # caching-allocator simulation of recorded traces
    tensorplace-bench models                     # the model zoo

Real models (``--model``): the package's examples (gpt, tinygpt, inception), any torchvision
classification model by name, or your own as ``package.module:factory``; inputs are synthetic.
compare, convergence, timeline and maxbatch also take ``--builtin NAME`` (a builtin modelled
profile) or ``--profile FILE`` (a saved one). Every subcommand takes ``--json PATH`` and writes
the figures it prints there (with the command line, the device and the versions; ``--json -``
writes them to stdout and everything else to stderr). Measured figures are labelled with the
device. Every subcommand that builds a model and measures it takes ``--device`` (cpu, cuda,
cuda:N; default cuda when torch sees a GPU): the model, its inputs and labels are made there, and
the JSON says where its tensors were (``torch_device``, ``tensors_on``). Torch's own log lines
(the profiler's) are kept off stdout and stderr (``KINETO_LOG_LEVEL``, unless set).

Adding a subcommand: write a module with ``add_cli(subparsers)`` that adds its parser and sets
``fn`` (``p.set_defaults(fn=...)``), a function taking the parsed arguments and returning the exit
code, which puts its figures into ``args.out`` (``args.out["rows"] = [...]``); then add one line
``your_module.add_cli,`` to ``COMMANDS`` below (``func`` works as well as ``fn``). Shared helpers (model zoo, measuring, tables,
progress bars, argument types) are in ``tensorplace.bench.common``. ``--json`` is added to
every subcommand by ``main``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any, Callable, List, Optional, Sequence

from .. import allocator
from ..methods import bench as methods_bench
from . import accuracy, budgets, compare, convergence, demo, maxbatch, peers, plan, profile, timeline, zoo
from .common import (HOST_MALLOC_ENV, HOST_MALLOC_MODES, STDOUT, Output, default_host_malloc, dump_json, host_malloc,
                     resolve_device, versions, where)

# One line per subcommand: its module's add_cli(subparsers).
COMMANDS: List[Callable[[Any], None]] = [
    demo.add_cli,
    accuracy.add_cli,
    profile.add_cli,
    plan.add_cli,
    maxbatch.add_cli,
    peers.add_cli,
    budgets.add_cli,
    allocator.add_cli,
    methods_bench.add_cli,
    compare.add_cli,
    convergence.add_cli,
    timeline.add_cli,
    zoo.add_cli,
]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tensorplace-bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for add_cli in COMMANDS:
        add_cli(sub)
    for p in sub.choices.values():
        if not any("--json" in act.option_strings for act in p._actions):
            p.add_argument("--json", metavar="PATH",
                           help="write the figures this command prints to PATH as JSON ('-': to stdout, "
                                "and what it prints to stderr)")
            p.set_defaults(_bench_json=True)  # commands with their own --json write it themselves
        p.add_argument("--host-malloc", choices=HOST_MALLOC_MODES, default=default_host_malloc(),
                       help="keep: the C heap keeps freed memory, as a GPU's caching allocator does, so that "
                            "CPU steps do not pay page faults that depend on allocation order (default, or "
                            f"${HOST_MALLOC_ENV}); default: glibc's own trimming")
        p.add_argument("--torch-threads", type=int, default=None, metavar="N",
                       help="torch's intra-op threads for the whole command (default: torch's own); 1 with "
                            "tiny models makes a CPU step host work, the regime of a fast GPU (docs/gpu.md)")
    return ap


def quiet_torch_logs() -> None:
    """Keep torch's own C++ log lines off the bench's stdout and stderr: the profiler library
    (kineto) writes ``USDT: ... profiler_start`` / ``profiler_stop`` at every profiled step and,
    on a machine without a GPU driver, ``ERROR: ... gpuGetDeviceCount failed with code 35``.
    ``KINETO_LOG_LEVEL`` is read once, when the profiler is first used: set here (unless the
    environment sets it) before anything profiles; 6 is above its highest level."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def main(argv: Optional[Sequence[str]] = None) -> int:
    quiet_torch_logs()
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parser().parse_args(argv)
    path = a.json if getattr(a, "_bench_json", False) else None
    heap = host_malloc(a.host_malloc)
    threads = None  # torch's threads before --torch-threads, given back at the end (main() called in a process)
    if a.torch_threads is not None:
        if a.torch_threads < 1:
            raise SystemExit(f"--torch-threads must be at least 1, got {a.torch_threads}")
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(a.torch_threads)
    measures = hasattr(a, "device")  # the subcommands that build a model and measure it (--device)
    if measures:
        a.device = resolve_device(a.device)
    header = {"command": a.cmd, "argv": argv, "device": where(a.device if measures else None),
              **({"torch_device": str(a.device)} if measures else {}),
              "versions": versions(), "host_malloc": heap} if path else {}
    a.out = Output(path, header)
    stdout = sys.stdout
    rc = 1
    try:
        # --json -: stdout carries the JSON alone
        with contextlib.redirect_stdout(sys.stderr) if path == STDOUT else contextlib.nullcontext():
            rc = int((getattr(a, "fn", None) or a.func)(a))
    finally:
        a.out.flush(exit_code=rc)
        if path == STDOUT:
            dump_json(a.out.payload(exit_code=rc), stdout)
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
    return rc


if __name__ == "__main__":
    sys.exit(main())
