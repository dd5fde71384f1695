"""Is there a CUDA GPU that both cuda-python and torch can use?

`cuda_available()` is True only when cuda-python imports, its runtime's `cudaGetDeviceCount`
succeeds with at least one device, and `torch.cuda.is_available()` agrees. `cuda_status()` says why
not in one line (for pytest skip reasons and error messages). On the developers' machines
`cudaGetDeviceCount` fails with error 35, `cudaErrorInsufficientDriver` (no driver installed): that
is reported as "no GPU", never raised.

The probe runs once per process (GPUs do not come and go); `refresh=True` runs it again.
"""

from __future__ import annotations

from typing import Optional, Tuple

__all__ = ["cuda_available", "cuda_status", "runtime_module"]

_probe_result: Optional[Tuple[bool, str]] = None


def runtime_module():
    """cuda-python's runtime bindings (`cuda.bindings.runtime`, or `cuda.cudart` in cuda-python
    11 / early 12). Raises ImportError when cuda-python is not installed."""
    try:
        from cuda.bindings import runtime as rt  # cuda-python >= 12.6
    except ImportError:
        from cuda import cudart as rt  # older cuda-python
    return rt


def error_name(rt, err) -> str:
    """`cudaErrorInsufficientDriver` for error 35, and so on (never raises)."""
    try:
        status, name = rt.cudaGetErrorName(err)
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        if name:
            return str(name)
    except Exception:  # noqa: BLE001 - a name lookup must not hide the real error
        pass
    return getattr(err, "name", None) or f"cudaError {int(err)}"


def error_string(rt, err) -> str:
    try:
        status, text = rt.cudaGetErrorString(err)
        if isinstance(text, bytes):
            text = text.decode(errors="replace")
        return str(text)
    except Exception:  # noqa: BLE001
        return ""


def _probe() -> Tuple[bool, str]:
    try:
        rt = runtime_module()
    except Exception as exc:  # ImportError, or a broken install raising anything else
        return False, f"no GPU: cuda-python is not usable ({type(exc).__name__}: {exc})"
    try:
        err, count = rt.cudaGetDeviceCount()
    except Exception as exc:  # noqa: BLE001
        return False, f"no GPU: cudaGetDeviceCount raised {type(exc).__name__}: {exc}"
    if err != rt.cudaError_t.cudaSuccess:
        name = error_name(rt, err)
        text = error_string(rt, err)
        detail = f" ({text})" if text else ""
        return False, f"no GPU: cudaGetDeviceCount failed with {name} (error {int(err)}){detail}"
    if not count:
        return False, "no GPU: cudaGetDeviceCount reports 0 devices"
    try:
        import torch

        torch_ok = bool(torch.cuda.is_available())
        torch_info = f"torch {torch.__version__}, built for CUDA {torch.version.cuda}"
    except Exception as exc:  # noqa: BLE001
        return False, f"no GPU: torch.cuda is not usable ({type(exc).__name__}: {exc})"
    if not torch_ok:
        return False, (
            f"no GPU: cuda-python sees {count} device(s) but torch.cuda.is_available() is False "
            f"({torch_info})"
        )
    try:
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    except Exception:  # noqa: BLE001
        names = "?"
    return True, f"CUDA available: {count} device(s) [{names}], {torch_info}"


def cuda_status(refresh: bool = False) -> str:
    """One line: "CUDA available: ..." or "no GPU: <reason>"."""
    global _probe_result
    if _probe_result is None or refresh:
        _probe_result = _probe()
    return _probe_result[1]


def cuda_available(refresh: bool = False) -> bool:
    """True when cuda-python and torch can both use at least one CUDA device."""
    global _probe_result
    if _probe_result is None or refresh:
        _probe_result = _probe()
    return _probe_result[0]
