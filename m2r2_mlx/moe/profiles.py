"""Device profiles: the machines the MoE bench's device clock models, as roofline figures and a link.

On the device clock (clock.py, metering.py) each op of the real decode is charged the profile's roofline time (bytes
over achieved memory bandwidth or FLOPs over peak, the larger, plus a launch cost), each host round trip ``sync_us``,
each expert read ``latency_ms`` plus its bytes (as the device stores them, ``weight_bytes`` a weight) over
``link_gbps``. Deterministic: the same command gives the same figures. The wall clock needs no profile: it is this
machine, reading experts from its own disk.

Figures and sources (docs/moe.md has the same table):

- macbook: Apple M3 Pro, 150 GB/s unified memory (Apple's specification), of which decode kernels reach about 60%
  (MLX's 4-bit matrix-vector kernels on M-series GPUs: our estimate from published mlx-lm decode speeds of dense
  models, tokens/s x weight bytes); GPU about 7 TFLOP/s (18-core, half precision; Apple quotes about 7.4 for
  single precision); 5 us a kernel (Metal command encoding within one command buffer) and 100 us a host round trip
  (command-buffer commit and wait); experts read from the internal SSD at 4 GB/s effective with 0.1 ms a read.
  Weights in 4 bits with group-64 scales and biases (0.5625 bytes a weight), KV cache in float16.
- pcie-gpu: RTX 4090, 1,008 GB/s (NVIDIA's specification), 70% reached by decode kernels; 165 TFLOP/s (half
  precision tensor cores with half accumulate: 330 sparse / 2); 4 us a kernel launch; 20 us a host round trip
  (stream synchronize plus a small device-to-host copy); PCIe 4.0 x16 from pinned memory at 25 GB/s effective
  with 10 us a transfer. Weights and KV cache in bfloat16.
- here: this machine (2 cores, MLX's CPU backend with OpenBLAS, float32) and its disk, measured inside a real decode
  of the bench's MoE model by ``python -m m2r2_mlx.moe.insitu build/smollm2-moe`` (insitu.py: each op timed where
  the model calls it): the bandwidth and fixed cost of its matrix-vector products, the share of it gathered expert
  matmuls reach, the fixed costs of attention, rotary embedding and norms, the launches the meter charges for the
  kernels it does not time, and the host's work for one expert load; its link is the disk under direct reads
  (reader.probe_disk). ``m2r2-bench --moe --clock device --profile here`` measures them again at the start of the
  run: the check that the device clock's model reads this machine's wall clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import M2R2Error
from .clock import DeviceClock
from .metering import Metering


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    what: str
    memory_gbps: float  # the device's memory bandwidth (GB/s)
    bandwidth_share: float  # of it, what decode kernels reach
    tflops: float  # peak, at the model's precision
    launch_us: float  # per kernel
    sync_us: float  # per host round trip
    link_gbps: float  # the expert link's effective bandwidth (GB/s)
    latency_ms: float  # per transfer on the link
    weight_bytes: float | None  # bytes a weight on the device (None: as held here)
    kv_bytes: float | None  # bytes a KV-cache element on the device (None: as held here)
    # the wall clock's emulation: one OLMoE-1B-7B expert's bytes and one layer's active weights (None: the link as is)
    expert_weights: float | None = None
    layer_weights: float | None = None
    hidden: int | None = None  # the deployed model's hidden size (the device clock prices a stand-in at its width)
    fixed_us: tuple[tuple[str, float], ...] = ()  # a fixed cost by op kind, where it is not launch_us
    shares: tuple[tuple[str, float], ...] = ()  # of the reached bandwidth, by op kind, where it is not all of it

    @property
    def expert_ms(self) -> float:
        """One OLMoE expert's transfer on this device."""
        return self.latency_ms + self.expert_weights * self.weight_bytes / self.link_gbps / 1e6

    @property
    def layer_ms(self) -> float:
        """One OLMoE layer's decode compute on this device (its active weights at the reached bandwidth)."""
        return self.layer_weights * self.weight_bytes / (self.memory_gbps * self.bandwidth_share) / 1e6

    @property
    def ratio(self) -> float | None:
        """One expert's transfer time / one layer's compute time (None: the cpu profile, whose link is stated)."""
        if self.expert_weights is None:
            return None
        return self.expert_ms / self.layer_ms

    def clock(self) -> DeviceClock:
        """A fresh device clock with this profile's figures."""
        return DeviceClock(
            bandwidth=self.memory_gbps * self.bandwidth_share * 1e9,
            flops=self.tflops * 1e12,
            launch=self.launch_us * 1e-6,
            sync=self.sync_us * 1e-6,
            link_bandwidth=self.link_gbps * 1e9,
            link_latency=self.latency_ms * 1e-3,
            fixed={kind: us * 1e-6 for kind, us in self.fixed_us},
            shares=dict(self.shares),
        )

    def device_scale(self, expert_weights: int | None, expert_bytes: int) -> float:
        """The device's bytes per byte held here, for a model whose experts hold ``expert_weights`` weights (None:
        packed) in ``expert_bytes``: an expert moves as the deployed model's (``self.expert_weights`` at
        ``weight_bytes``) where the profile names one, else at the device's bytes a weight, else as held."""
        if self.weight_bytes is None or expert_weights is None:
            return 1.0
        return (self.expert_weights or expert_weights) * self.weight_bytes / expert_bytes

    def metering(self, expert_weights: int | None, hidden: int) -> Metering:
        """How the clock prices a model with experts of ``expert_weights`` weights and ``hidden`` dimensions: at the
        deployed model's scale where the profile names one (a stand-in's routes, the deployment's sizes)."""
        if self.expert_weights is None or expert_weights is None:
            return Metering(weight_bytes=self.weight_bytes, kv_bytes=self.kv_bytes)
        return Metering(
            weight_bytes=self.weight_bytes,
            kv_bytes=self.kv_bytes,
            weight_scale=self.expert_weights / expert_weights,
            width_scale=self.hidden / hidden,
        )


# OLMoE-1B-7B (16 layers; 64 experts of 3 x 2048 x 1024 weights, top-8; attention 4 x 2048^2 per layer):
# one expert 6.29M weights, one layer's active weights 16.8M (attention) + 8 x 6.29M (experts) = 67.1M.
_EXPERT_W, _LAYER_W = 6.291e6, 67.1e6
PROFILES = {
    "macbook": DeviceProfile(
        "macbook",
        "an Apple laptop (M3 Pro, 150 GB/s), the model in 4 bits (MLX, group 64), experts read from its SSD",
        memory_gbps=150.0,
        bandwidth_share=0.6,
        tflops=7.0,
        launch_us=5.0,
        sync_us=100.0,
        link_gbps=4.0,
        latency_ms=0.1,
        weight_bytes=0.5625,
        kv_bytes=2,
        expert_weights=_EXPERT_W,
        layer_weights=_LAYER_W,
        hidden=2048,
    ),
    "pcie-gpu": DeviceProfile(
        "pcie-gpu",
        "a discrete GPU (RTX 4090, 1,008 GB/s), the model in bfloat16, fed over PCIe 4.0 x16 from pinned host memory",
        memory_gbps=1008.0,
        bandwidth_share=0.7,
        tflops=165.0,
        launch_us=4.0,
        sync_us=20.0,
        link_gbps=25.0,
        latency_ms=0.01,
        weight_bytes=2,
        kv_bytes=2,
        expert_weights=_EXPERT_W,
        layer_weights=_LAYER_W,
        hidden=2048,
    ),
    # measured here by `python -m m2r2_mlx.moe.insitu build/smollm2-moe`
    "here": DeviceProfile(
        "here",
        "this machine: 2 x86 cores, MLX's CPU backend, float32, experts read from its disk (direct reads)",
        memory_gbps=8.1,
        bandwidth_share=1.0,
        tflops=0.044,
        launch_us=8.1,
        sync_us=163.0,
        link_gbps=1.1,
        latency_ms=0.03,
        weight_bytes=None,
        kv_bytes=None,
        fixed_us=(("matmul", 5.4), ("attention", 97.5), ("rope", 150.0), ("norm", 51.0), ("load", 514.0)),
        shares=(("gather", 0.52),),
    ),
}


def get_profile(name: str) -> DeviceProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise M2R2Error(f"unknown device profile {name!r}; choose one of: {', '.join(PROFILES)}") from None
