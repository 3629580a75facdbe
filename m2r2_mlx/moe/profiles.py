"""Device profiles: an emulated link whose cost, relative to this machine's compute, is a real deployment's.

What decides whether loading experts ahead of time pays is one ratio: the time to move one
expert over the link divided by the time to compute one layer. A profile states that ratio
for a real deployment (numbers and sources in docs/moe.md); ``link_for`` measures nothing
itself but turns the ratio and this machine's measured layer time into a throttled ``Link``
with the same ratio, so a CPU emulates an Apple laptop streaming experts from its SSD, or a
discrete GPU fed over PCIe.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import M2R2Error
from .link import Link


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    what: str
    expert_mb: float  # one expert's bytes on the real device (MB)
    link_gbps: float  # the real link's effective bandwidth (GB/s)
    latency_ms: float  # per transfer on the real link
    layer_ms: float  # one layer's decode compute on the real device (batch 1)

    @property
    def expert_ms(self) -> float:
        return self.latency_ms + self.expert_mb / self.link_gbps

    @property
    def ratio(self) -> float:
        """One expert's transfer time / one layer's compute time."""
        return self.expert_ms / self.layer_ms


# OLMoE-1B-7B (16 layers; 64 experts of 3 x 2048 x 1024 weights, top-8; attention 4 x 2048^2 per layer):
# one expert 6.29M weights, one layer's active weights 16.8M (attention) + 8 x 6.29M (experts) = 67.1M.
_EXPERT_W, _LAYER_W = 6.291e6, 67.1e6
PROFILES = {
    "macbook": DeviceProfile(
        "macbook",
        "OLMoE-1B-7B at 4-bit (MLX, group 64) on an Apple laptop (M3 Pro, 150 GB/s), experts read from its SSD",
        expert_mb=_EXPERT_W * 0.5625 / 1e6,
        link_gbps=4.0,
        latency_ms=0.1,
        layer_ms=_LAYER_W * 0.5625 / 150e9 / 0.6 * 1e3,
    ),
    "pcie-gpu": DeviceProfile(
        "pcie-gpu",
        "OLMoE-1B-7B in bfloat16 on a discrete GPU (RTX 4090, 1,008 GB/s) fed over PCIe 4.0 x16 from "
        "pinned host memory",
        expert_mb=_EXPERT_W * 2 / 1e6,
        link_gbps=25.0,
        latency_ms=0.01,
        layer_ms=_LAYER_W * 2 / 1008e9 / 0.7 * 1e3,
    ),
}


def get_profile(name: str) -> DeviceProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise M2R2Error(f"unknown device profile {name!r}; choose one of: {', '.join(PROFILES)}") from None


def link_for(ratio: float, expert_bytes: int, layer_ms: float, latency_share: float = 0.1) -> Link:
    """A link on which one expert of ``expert_bytes`` takes ``ratio`` x ``layer_ms`` (this machine's layer time);
    ``latency_share`` of it is per-transfer latency, the rest bandwidth."""
    if not ratio > 0 or not layer_ms > 0:
        raise M2R2Error(f"a link needs a positive transfer/compute ratio and layer time (got {ratio}, {layer_ms} ms)")
    expert_ms = ratio * layer_ms
    wire_s = expert_ms * (1 - latency_share) / 1e3
    return Link(expert_bytes / wire_s / 1e9, expert_ms * latency_share)
