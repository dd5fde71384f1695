"""Measured over predicted peak of every zoo model's plans on the simulated GPU (issue 18).

    python benches/sim_device_peaks.py [NAME ...]

For every model of ``tensorplace.zoo`` (or those named) at batch 4:
``tensorplace.bench.budgets.check_model`` with the CUDA backend on the simulated device
(``cuda_exec.sim_device``: tensors on this CPU, the device's streams and clock simulated), PSO at
three budgets and the all-swap and all-recompute plans, as tests/test_sim_device.py runs them.
One line per model: per row its budget fraction (or method) and measured peak over predicted.
"""

from __future__ import annotations

import sys

from cuda_exec.sim_device import SimDevice, sim_backend
from tensorplace import zoo
from tensorplace.bench.budgets import check_model


def main(names: list) -> None:
    for name in names or zoo.names():
        model, inputs, loss_fn = zoo.build(name, batch=4)
        backend = sim_backend(SimDevice(d2h_bandwidth=1e9, h2d_bandwidth=1e9))
        try:
            rows = check_model(model, inputs, loss_fn, backend=backend, search={"particles": 20, "iterations": 10},
                               fixed=("swap-all", "recompute-all"))
        finally:
            backend.close()
        cells = []
        for r in rows:
            what = r.get("fraction") if r.get("fraction") is not None else r.get("method")
            cells.append(f"{what}: refused" if "refused" in r else
                         f"{what}: {r['measured_peak_bytes'] / r['predicted_peak_bytes']:.3f}")
        print(f"{name}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
