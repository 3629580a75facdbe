"""This machine's limits, measured at start through MLX on the device the model runs on.

- Memory bandwidth: a streaming copy. An array is updated in place (``x = x + 0``, its buffer donated to the
  result) so that each pass reads and writes every byte and no fresh memory is touched: on MLX's CPU backend a
  fresh output costs a page fault per 4 KB (it keeps no buffer cache), which would time the kernel's page zeroing
  rather than the memory. Counted as STREAM counts a copy, reads plus writes.
- Compute: a square matrix product in the model's activation dtype (2 n^3 FLOPs).
Each figure is the best of several passes after a warm-up pass, as STREAM reports: the limit is what the machine
can do, and a shared machine's other work only ever makes a pass slower.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

PROBE_MB = 256  # beyond any cache: a MacBook's system-level cache is tens of MB, this CPU's L3 a few
MATMUL_N = 2048


@dataclass(frozen=True)
class Machine:
    device: str
    bandwidth_gbs: float  # streaming copy, reads + writes, GB/s (1e9 bytes)
    gflops: float  # matrix product, GFLOP/s
    dtype: str  # the product's dtype

    def to_json(self) -> dict:
        return {"device": self.device, "bandwidth_gbs": self.bandwidth_gbs, "gflops": self.gflops, "dtype": self.dtype}


def _best_seconds(step, passes: int) -> float:
    step()  # warm-up: first touches, first-time kernels
    times = []
    for _ in range(passes):
        tic = time.perf_counter()
        step()
        times.append(time.perf_counter() - tic)
    return min(times)


def stream_bandwidth(mb: int = PROBE_MB, passes: int = 7) -> float:
    """GB/s of an in-place streaming copy of ``mb`` MiB through MLX on the default device."""
    box = [mx.full((mb * 2**20 // 4,), 1.0, dtype=mx.float32)]
    mx.eval(box[0])

    def step():
        x = box.pop()
        x = x + 0  # the only reference to the old buffer is this graph: MLX writes the result into it
        mx.eval(x)
        box.append(x)

    seconds = _best_seconds(step, passes)
    return 2 * box[0].nbytes / seconds / 1e9


def matmul_gflops(dtype=mx.float32, n: int = MATMUL_N, passes: int = 3) -> float:
    a = mx.random.normal((n, n)).astype(dtype)
    b = mx.random.normal((n, n)).astype(dtype)
    mx.eval(a, b)
    seconds = _best_seconds(lambda: mx.eval(a @ b), passes)
    return 2 * n**3 / seconds / 1e9


def device_name() -> str:
    """ "gpu" (Metal) or "cpu" (MLX's CPU backend)."""
    return mx.default_device().type.name


def probe_machine(dtype=mx.float32) -> Machine:
    return Machine(device_name(), stream_bandwidth(), matmul_gflops(dtype), str(dtype).split(".")[-1])
