"""The here profile (this machine), measured inside a real decode: each metered op timed where the model calls it,
and the disk read by ``reader.probe_disk``.

A kernel timed alone, many times over, runs faster than the same kernel inside a decode: there its weights are
cold, Python runs between ops, and the fastest of several runs is the machine at its best rather than as a decode
finds it. So the here profile's figures come from the decode the device clock models: ``time_decodes`` decodes
greedily with every op that ``metering`` charges evaluated on its own and timed (less an evaluation's own
overhead), beside the same decode as it runs and through a full expert cache, a step of each in turn so that all
three meet the same moments of a noisy machine; ``fit_cpu`` turns the ops' median times into the profile's terms:

- matrix-vector products (kind ``matmul``: projections and the head, 44 KB to 113 MB here): a least-squares line
  through their median times, time = fixed + bytes / bandwidth, gives the memory bandwidth and their fixed cost;
- gathered expert matmuls: their bandwidth share, at the matmul's fixed cost;
- attention, rotary embedding and norms: a fixed cost each beyond their bytes;
- the kernels the meter does not charge one by one (residual adds, activations, cache writes, the router's
  softmax and top-k): a small kernel's launch inside an evaluated chain, each;
- an op timed alone costs more than inside the running graph: the timed ops give their costs relative to each
  other, scaled so that with those launches they sum to the running decode's median step;
- a host round trip (``sync``, charged once a MoE layer): the cached decode's step beyond the plain one, a layer;
- one expert load (kind ``load``): an LRU decode at a quarter of the experts, its experts read from the disk,
  beside the full cache's, their difference a load beyond the read's own time and the slot copy (the conversion,
  the slot write, the reader threads' bookkeeping, and what a load costs the compute around it);
- the link: the disk's throughput with large direct reads and the fixed cost of an expert's read
  (``reader.probe_disk``);
- the FLOP rate (a 1024^3 matmul), timed alone: decode at batch 1 hardly touches it.

``python -m m2r2_mlx.moe.insitu MODEL`` prints the figures in the profile's terms (profiles.py holds them).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import m2r2_mlx  # noqa: F401  (the fast BLAS, as every run here)

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..errors import M2R2Error, run_cli
from ..models.registry import load_model
from .metering import Metering, metered
from .offload import offload_experts
from .profiles import PROFILES, DeviceProfile
from .reader import probe_disk
from .serve import exported_store

PROG = "python -m m2r2_mlx.moe.insitu"
FIXED_KINDS = ("attention", "rope", "norm")  # op kinds priced by a fixed cost beyond their bytes


class _OpLog:
    """Stands in for a clock under ``metered``: records what each op would be charged (kind, bytes)."""

    def __init__(self):
        self.ops: list[tuple[str, float]] = []

    def op(self, nbytes: float, flops: float = 0.0, kind: str = "") -> None:
        self.ops.append((kind, nbytes))


class _Stepper:
    """One greedy decode, advanced a step at a time (decodes timed side by side share the machine's moments)."""

    def __init__(self, model, prompt: np.ndarray):
        self.model, self.cache = model, make_prompt_cache(model)
        self.tok = self._next(mx.array(prompt[None].astype(np.int32)))

    def _next(self, ids: mx.array) -> int:
        return int(mx.argmax(self.model(ids, cache=self.cache)[0, -1]).item())

    def step(self) -> float:
        start = time.perf_counter()
        self.tok = self._next(mx.array([[self.tok]]))
        return time.perf_counter() - start


class _OpTimer:
    """Wraps each metered call (``metered(..., around=timer)``): its inputs evaluated first, then the op alone,
    timed to its evaluated output, less an evaluation's own overhead (``overhead``, timed on a trivial op). An
    attention module's call holds other metered ops (its projections, rotary embeddings): the attention kernel's
    time is the call's less theirs."""

    def __init__(self, log: _OpLog):
        self.log, self.samples = log, []
        self._nested = 0.0  # seconds timed by the metered calls inside the one running now
        x = mx.zeros((1, 8))
        self.overhead = statistics.median(_seconds(lambda: mx.eval(x + 1.0)) for _ in range(101))

    def __call__(self, f, kind: str):
        def call(*args, **kwargs):
            mx.eval([a for a in args if isinstance(a, mx.array)])
            first, outer = len(self.log.ops), self._nested
            self._nested = 0.0
            start = time.perf_counter()
            out = f(*args, **kwargs)
            mx.eval(out)
            elapsed = max(time.perf_counter() - start - self.overhead, 0.0)
            own = max(elapsed - self._nested, 0.0)
            self._nested = outer + elapsed
            charged = [op for op in self.log.ops[first:] if kind != "attention" or op[0] == "attention"]
            if charged:
                self.samples.append((charged[0][0], charged[0][1], own))
            return out

        return call


def _seconds(f) -> float:
    start = time.perf_counter()
    f()
    return time.perf_counter() - start


def time_decodes(model, via_cache, prompt: np.ndarray, steps: int = 24, warmup: int = 4):
    """Three greedy decodes of ``prompt`` advanced side by side: ``model`` as it runs (lazily), ``model`` with every
    metered op timed alone, and ``via_cache`` (the same model with its experts served by a full ExpertCache).
    Returns (samples as (kind, bytes, seconds), the plain steps' seconds, the cached steps' seconds, ops charged a
    step)."""
    log = _OpLog()
    timer = _OpTimer(log)
    plain, timed, cached = _Stepper(model, prompt), _Stepper(model, prompt), _Stepper(via_cache, prompt)
    plain_s, cached_s = [], []
    for i in range(warmup + steps):
        if i == warmup:
            timer.samples.clear()
            log.ops.clear()
        with metered(log, Metering(), model, around=timer):
            timed.step()
        plain_s.append(plain.step())
        cached_s.append(cached.step())
    return timer.samples, plain_s[warmup:], cached_s[warmup:], len(log.ops) / steps


def fit_cpu(samples, step_seconds: list[float], ops_per_step: float, launch: float) -> dict[str, float]:
    """The profile's compute terms from ``time_decodes``'s samples (see the module docstring). An op evaluated
    alone costs more than inside the running graph, so the samples give the ops' costs relative to each other and
    the running decode's median step gives their sum (less the untimed kernels' launches, ``launch`` each)."""
    steps = len(step_seconds)
    untimed_ops = ops_per_step - len(samples) / steps
    timed_per_step = sum(t for _, _, t in samples) / steps
    scale = (statistics.median(step_seconds) - untimed_ops * launch) / timed_per_step
    by_kind: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for kind, nbytes, seconds in samples:
        by_kind[kind][nbytes].append(seconds * scale)
    matmul = by_kind["matmul"]
    if len(matmul) < 2:
        raise M2R2Error("the decode charged fewer than two matmul shapes; a bandwidth needs two")
    sizes = sorted(matmul)
    slope, fixed = np.polyfit(sizes, [statistics.median(matmul[b]) for b in sizes], 1)
    bandwidth = 1 / slope

    def median_beyond_bytes(kind: str) -> float:
        return statistics.median(t - b / bandwidth for b, ts in by_kind[kind].items() for t in ts)

    gather = [(b, t - fixed) for b, ts in by_kind["gather"].items() for t in ts]
    share = statistics.median(b / bandwidth / max(t, 1e-9) for b, t in gather) if gather else 1.0
    return {
        "memory_gbps": bandwidth / 1e9,
        "matmul_us": 1e6 * max(fixed, 0.0),  # a line's intercept below zero is noise
        "gather_share": min(share, 1.0),
        **{f"{k}_us": 1e6 * median_beyond_bytes(k) for k in FIXED_KINDS if by_kind[k]},
        "launch_us": 1e6 * launch,
        "alone_vs_running": 1 / scale,
    }


def launch_seconds() -> float:
    """One small kernel inside an evaluated chain (the fixed cost of evaluating cancels between two lengths)."""
    x = mx.zeros((1, 576))

    def chain(n: int) -> None:
        y = x
        for _ in range(n):
            y = y * 1.0001 + 0.5
        mx.eval(y)

    long, short = (statistics.median(_seconds(lambda: chain(n)) for _ in range(7)) for n in (400, 200))
    return max(long - short, 0.0) / 400


def load_seconds(model, cache, full, prompt: np.ndarray, bandwidth: float, steps: int = 48) -> float:
    """One expert load's host work beyond its read and the slot copy: ``model`` (through ``cache``, an ExpertCache
    reading from the disk at a quarter of its experts) decoded beside ``full`` (through a full one), a step of each
    in turn; their difference, a load, less a read's measured time and the copy."""
    nbytes = cache.store.expert_bytes()
    a, b = _Stepper(model, prompt), _Stepper(full, prompt)
    for _ in range(4):  # fill the slots
        a.step(), b.step()
    cache.reset()
    difference = sum(a.step() - b.step() for _ in range(steps))
    loads = cache.stats.misses
    if not loads:
        raise M2R2Error("the LRU decode made no loads; the model has too few experts for a quarter's budget")
    return difference / loads - cache.loader.read_seconds(nbytes) - 2 * nbytes / bandwidth


def flop_rate() -> float:
    """TFLOP/s of a 1024^3 matmul (the median of nine): decode at batch 1 hardly reaches it."""
    a, b = mx.random.normal((1024, 1024)), mx.random.normal((1024, 1024))
    mx.eval(a, b)
    return 2 * 1024**3 / statistics.median(_seconds(lambda: mx.eval(a @ b)) for _ in range(9)) / 1e12


def measure_here(folder: Path, steps: int = 24) -> dict[str, float]:
    """This machine's figures for the here profile, from decoding the model in ``folder`` on the first tokens of its
    train.npy (the bench's prompts are its held-out ones): all experts resident, timed op by op and as it runs,
    beside the same model through a full ExpertCache (its host work per MoE layer: routes read back, loads
    decided), then LRU at a quarter of the experts (a load's host work); the disk by ``probe_disk``."""
    train = folder / "train.npy"
    if not train.is_file():
        raise M2R2Error(f"{train} not found; pass a built MoE model folder (m2r2-bench --moe builds one)")
    prompt = np.load(train)[:48]
    lm = load_model(str(folder), tokenizer=False)
    model, via_cache = lm.model, load_model(str(folder), tokenizer=False).model
    store = exported_store(lm)
    full = offload_experts(via_cache, store, 1.0)
    samples, plain_s, cached_s, ops_per_step = time_decodes(model, via_cache, prompt, steps)
    figures = fit_cpu(samples, plain_s, ops_per_step, launch_seconds())
    host_per_layer = statistics.median(c - p for c, p in zip(cached_s, plain_s)) / len(full.layers)
    full.close()
    disk = probe_disk(store)
    with offload_experts(model, store, 0.25) as lru:
        load = load_seconds(model, lru, via_cache, prompt, figures["memory_gbps"] * 1e9)
    return {
        **figures,
        "sync_us": 1e6 * max(host_per_layer, 0.0),
        "load_us": 1e6 * max(load, 0.0),
        "tflops": flop_rate(),
        "disk_gbps": disk.gbps,
        "read_latency_ms": disk.latency_ms,
    }


def profile_here(folder: Path) -> DeviceProfile:
    """The here profile with this machine's figures measured now (``measure_here``)."""
    f = measure_here(folder)
    kinds = [k for k in FIXED_KINDS if f"{k}_us" in f]  # a model without rotary embeddings times none
    fixed = {"matmul": f["matmul_us"], "load": f["load_us"], **{k: f[f"{k}_us"] for k in kinds}}
    return replace(
        PROFILES["here"],
        what="this machine and its disk, measured at the start of the run (m2r2_mlx/moe/insitu.py)",
        memory_gbps=f["memory_gbps"],
        tflops=f["tflops"],
        launch_us=f["launch_us"],
        sync_us=f["sync_us"],
        fixed_us=tuple(fixed.items()),
        shares=(("gather", f["gather_share"]),),
        link_gbps=f["disk_gbps"],
        latency_ms=f["read_latency_ms"],
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="This machine's device profile, measured inside a decode.")
    p.add_argument("model", type=Path, help="a built MoE model folder (e.g. build/smollm2-moe)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> None:
        figures = measure_here(args.model)
        print(" ".join(f"{k}={v:.3g}" for k, v in figures.items()))

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
