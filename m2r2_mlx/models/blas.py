"""Give MLX's Linux CPU backend an optimised BLAS.

The Linux ``mlx[cpu]`` wheel links a reference BLAS (float32 matmul ~6 GFLOP/s).
Its ``cblas_sgemm`` is an undefined symbol of ``libmlx.so`` resolved at load
time, so a library loaded *earlier* with ``RTLD_GLOBAL`` wins the lookup: we
dlopen OpenBLAS before ``mlx.core`` is first imported. Loading it afterwards
does nothing, so this module must run first (``m2r2_mlx/__init__`` does it).
macOS uses Accelerate through MLX's Metal/CPU build and is left untouched.

Set ``M2R2_BLAS=reference`` to keep the wheel's BLAS (for A/B benchmarks), or
``M2R2_BLAS=/path/to/libopenblas.so`` to pick a library yourself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
from dataclasses import dataclass

# Debian/Ubuntu ship the pthread OpenBLAS here (package libopenblas0-pthread).
_SYSTEM_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
]


@dataclass(frozen=True)
class BlasInfo:
    name: str  # "openblas", "reference" or "accelerate"
    path: str | None
    note: str

    def describe(self) -> str:
        where = f" ({self.path})" if self.path else ""
        return f"BLAS: {self.name}{where}{': ' + self.note if self.note else ''}"


_INFO: BlasInfo | None = None


def _candidates() -> list[str]:
    found = [p for p in _SYSTEM_CANDIDATES if os.path.exists(p)]
    lib = ctypes.util.find_library("openblas")
    if lib:
        found.append(lib)
    # PyPI's cmeel-openblas exports unprefixed cblas_* symbols (scipy-openblas32
    # prefixes them with scipy_, so it cannot stand in for MLX's BLAS).
    for base in sys.path:
        found += sorted(glob.glob(os.path.join(base, "cmeel.prefix", "lib", "libopenblas.so.0")))
    return found


def ensure_fast_blas() -> BlasInfo:
    """Preload OpenBLAS with global symbols if we can; idempotent."""
    global _INFO
    if _INFO is not None:
        return _INFO
    if sys.platform == "darwin":
        _INFO = BlasInfo("accelerate", None, "macOS, untouched")
        return _INFO
    choice = os.environ.get("M2R2_BLAS", "").strip()
    if choice.lower() in ("reference", "off", "0"):
        _INFO = BlasInfo("reference", None, "M2R2_BLAS=reference")
        return _INFO
    if "mlx.core" in sys.modules:
        _INFO = BlasInfo("reference", None, "mlx.core was imported before m2r2_mlx; import m2r2_mlx first for OpenBLAS")
        return _INFO
    errors = []
    for path in [choice] if choice else _candidates():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:  # e.g. cmeel's copy without libgfortran5 installed
            errors.append(f"{path}: {e}")
            continue
        _INFO = BlasInfo("openblas", path, "")
        return _INFO
    hint = "install Debian/Ubuntu's libopenblas0-pthread for ~2x faster float32 decoding"
    _INFO = BlasInfo("reference", None, "; ".join(errors) or hint)
    return _INFO


def blas_info() -> BlasInfo:
    return ensure_fast_blas()
