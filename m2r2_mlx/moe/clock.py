"""Time for the expert cache: the wall clock, or a modelled device's (a discrete-event clock).

Every time-dependent decision of the cache, its loader, the prefetch planner and the governor (is a prefetch in
time, does the predictor pay for its work) reads ``cache.clock``. One clock per question: ``WallClock`` is this
machine's time, with experts read from its disk (loader.DiskLoader); ``DeviceClock`` is one decode on a profiled
device (profiles.py), modelled as two resources:

- a **compute stream**: the model's ops in program order, each taking its roofline time (the bytes it reads over
  the device's achieved memory bandwidth, or its FLOPs over the device's peak, whichever is larger) plus a launch
  cost; a host round trip (the router's choice read back to decide loads) costs ``sync``;
- a **link channel**: reads queue on it (loader.DeviceLoader), each taking the link's latency plus bytes over its
  bandwidth.

An op that needs an expert still on the link waits for it (a stall). Ops are charged by ``metering.metered`` as the
real model calls them, so the trace (routes, predictions, cache decisions, prefetches) is the real decode's and the
tokens are the model's own; only time is modelled. Nothing in it reads the wall clock: the same command gives the
same figures on every run.
"""

from __future__ import annotations

import time
from typing import Protocol

from ..errors import M2R2Error


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since an arbitrary origin, on the clock's own timeline."""
        ...

    def sync(self) -> None:
        """A host round trip (the router's choice read back): charged on a device, already paid on this machine."""
        ...


class WallClock:
    """This machine's time."""

    modelled = False

    def now(self) -> float:
        return time.perf_counter()

    def sync(self) -> None:
        pass


class DeviceClock:
    """A compute stream and one link channel on a profiled device; see the module docstring.

    ``bandwidth`` (bytes/s achieved by the device's kernels), ``flops`` (FLOP/s peak), ``launch`` and ``sync``
    (seconds), ``link_bandwidth`` (bytes/s) and ``link_latency`` (seconds). ``fixed`` (seconds) and ``shares`` (of
    ``bandwidth``) by op kind ("matmul", "gather", "attention", "rope", "norm", ...) override the launch cost and the
    bandwidth where a device's kernels of that kind differ (a CPU's rope, its gathered matmuls)."""

    modelled = True

    def __init__(
        self,
        *,
        bandwidth: float,
        flops: float,
        launch: float,
        sync: float,
        link_bandwidth: float,
        link_latency: float,
        fixed: dict[str, float] | None = None,
        shares: dict[str, float] | None = None,
    ):
        if not (bandwidth > 0 and flops > 0 and link_bandwidth > 0) or min(launch, sync, link_latency) < 0:
            raise M2R2Error("a device clock needs positive bandwidths and FLOP rate, and non-negative costs")
        self.bandwidth, self.flops, self.launch, self.sync_s = bandwidth, flops, launch, sync
        self.link_bandwidth, self.link_latency = link_bandwidth, link_latency
        self.fixed, self.shares = dict(fixed or {}), dict(shares or {})
        self.compute_t = 0.0  # the compute stream has run up to here
        self.link_free = 0.0  # the link channel is busy until here
        self.link_busy = 0.0  # seconds the channel has carried transfers
        self.ops = 0
        self.stalled = 0.0  # seconds the compute stream waited on the link

    def now(self) -> float:
        return self.compute_t

    def op_seconds(self, nbytes: float, flops: float, kind: str = "") -> float:
        """One op's duration: its fixed cost + the larger of its memory time and its compute time."""
        bandwidth = self.bandwidth * self.shares.get(kind, 1.0)
        return self.fixed.get(kind, self.launch) + max(nbytes / bandwidth, flops / self.flops)

    def op(self, nbytes: float, flops: float = 0.0, kind: str = "") -> None:
        """Run one op of ``kind`` on the compute stream."""
        self.compute_t += self.op_seconds(nbytes, flops, kind)
        self.ops += 1

    def sync(self) -> None:
        """A host round trip: the stream drains and the host reads a result back before issuing more work."""
        self.compute_t += self.sync_s

    def transfer_seconds(self, nbytes: float) -> float:
        return self.link_latency + nbytes / self.link_bandwidth

    def transfer(self, nbytes: float, issued: float | None = None) -> float:
        """Queue a transfer issued at ``issued`` (default now) on the channel; returns when it arrives."""
        start = max(self.compute_t if issued is None else issued, self.link_free)
        self.link_free = start + self.transfer_seconds(nbytes)
        self.link_busy += self.link_free - start
        return self.link_free

    def wait(self, until: float) -> float:
        """The compute stream waits until ``until`` (an arrival); returns the stall."""
        stall = max(until - self.compute_t, 0.0)
        self.compute_t += stall
        self.stalled += stall
        return stall
