"""MoE decoding with a memory-budgeted expert cache: on-demand LRU vs pre-gating vs M2R2 ahead-of-time loading.

    m2r2-bench --moe --profile macbook --regime-map 0.25,0.5,1,2,4,8

The default model, the MoEfied SmolLM2 with adapters trained on its routing, is built on first use when missing
(moe_bench_build.py: minutes, once, from text the package ships).

For each expert budget (a share of all experts held in memory) and each method, greedy
decoding of the same prompts, batch 1, in one run: tokens/s (decode only), speedup over
on-demand LRU at the same budget, hit rate, prediction precision/recall, loads, bytes moved
and stall time per token. Methods: all experts resident (no cache: the upper bound), on-demand
LRU (mixtral-offloading style), next-layer pre-gating on the slow state, M2R2 ahead-of-time
loading (the fast stream run ahead through each interval, or fused as a second row of the slow
pass), and a shuffled-prediction control. Every method's tokens are checked against the
all-resident model's. The link between "host" (the expert files, memory-mapped) and "HBM" (the
slot tensors) is throttled: --link-gbps/--latency-ms, or --profile (m2r2_mlx/moe/profiles.py),
which sets it so that one expert's transfer time over one layer's compute time (the all-resident
decode step measured here, shared over the layers) is a real device's. --regime-map reruns every
method across that ratio: where ahead-of-time loading pays and where it cannot.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import m2r2_mlx  # noqa: F401  (fast BLAS before mlx)
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.models.registry import load_model
from m2r2_mlx.moe import ExpertStore, Link
from m2r2_mlx.moe.cache import resolve_slots
from m2r2_mlx.moe.insitu import profile_here
from m2r2_mlx.moe.predictors import PREDICTORS
from m2r2_mlx.moe.profiles import PROFILES, DeviceProfile, get_profile, link_for
from m2r2_mlx.moe.serve import exported_store

import numpy as np
from tqdm.auto import tqdm

from .moe_bench_build import COMMAND, DEFAULT_MODEL, BenchModelBuild, build_model, is_built
from .moe_bench_report import write_report
from .moe_rows import BOUNDS, ORACLE_LOOKAHEAD, BenchRun, measure, measure_row

# every registered predictor that needs no recorded run; on-demand loading is the "lru" row
PREDICTED = tuple(name for name, e in PREDICTORS.items() if name != "none" and not e.needs_trace)
METHODS = ("resident", "lru", *PREDICTED, *BOUNDS)
LABELS = {
    "resident": "all resident",
    "lru": "on-demand LRU",
    **{name: PREDICTORS[name].label for name in PREDICTED},
    "belady": "bound: Belady eviction (true future), on demand",
    "oracle": f"bound: true routes {ORACLE_LOOKAHEAD} layers ahead + Belady",
}
CLOCKS = ("device", "wall")


@dataclass(frozen=True)
class MoEBenchConfig:
    """What one run measures; every value is checked on construction, before anything loads, in one line each."""

    model: str
    adapters: str  # M2R2 adapters for the model
    prompts: Path | None = None  # held-out token ids (.npy), prompts are windows of it (None: default_prompts)
    methods: tuple[str, ...] = METHODS
    budgets: tuple[float, ...] = (100.0, 50.0, 25.0)  # percent of all experts
    experts: Path | None = None  # the expert store (None: m2r2's cache, exported on first use)
    num_prompts: int = 6
    prompt_tokens: int = 48
    max_tokens: int = 48  # new tokens per prompt
    link_gbps: float = 0.5  # 0: unthrottled
    latency_ms: float = 0.05
    profile: DeviceProfile | None = None  # sets the link by its transfer/compute ratio
    profile_here: bool = False  # the cpu profile measured at the start of the run (insitu.py), after the build
    ratio: float | None = None  # as a profile, with this ratio
    regime_ratios: tuple[float, ...] = ()  # also run every method at these ratios, at regime_budget
    regime_budget: float = 25.0
    regime_prompts: int = 3
    policy: str = "lru"
    m2r2_intervals: int | None = None  # M2R2: run the fast stream ahead in the first N gate intervals only
    clocks: tuple[str, ...] = CLOCKS  # device: the profile's modelled clock (clock.py); wall: this machine's
    build: BenchModelBuild | None = None  # the benchmark model is missing: build it first (prompts come with it)

    def __post_init__(self):
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise M2R2Error(f"unknown MoE method(s) {', '.join(bad)}; choose from {', '.join(METHODS)}")
        if not self.clocks or any(c not in CLOCKS for c in self.clocks):
            raise M2R2Error(f"--clock takes {', '.join(CLOCKS)} or both, got {','.join(self.clocks) or 'nothing'}")
        if any(m in BOUNDS for m in self.methods) and not any(m not in ("resident", *BOUNDS) for m in self.methods):
            raise M2R2Error("the bound rows replay the routes a cached row records; add lru to --methods")
        if (self.profile is not None or self.profile_here) and self.ratio is not None:
            raise M2R2Error("--profile and --ratio both set the link; pass one")
        if self.ratio is not None and not self.ratio > 0 or any(not r > 0 for r in self.regime_ratios):
            raise M2R2Error("transfer/compute ratios (--ratio, --regime-map) must be positive")
        if self.num_prompts < 1 or self.max_tokens < 2 or self.prompt_tokens < 1 or self.regime_prompts < 1:
            raise M2R2Error(
                "--num-prompts, --regime-prompts and --prompt-tokens must be at least 1, --max-tokens at least 2"
            )
        if self.build is None and not self.prompt_file().is_file():
            raise M2R2Error(
                f"{self.prompt_file()} not found; build the benchmark model with {COMMAND}, or pass --prompts"
            )

    def prompt_file(self) -> Path:
        """The held-out ids: as given, else the model folder's (which a build writes: read it after the build)."""
        return self.prompts if self.prompts is not None else default_prompts(self.model)

    @property
    def link_ratio(self) -> float | None:
        """One expert's transfer time / one layer's compute time that sets the link (None: the link as given)."""
        return self.profile.ratio if self.profile is not None else self.ratio

    @property
    def device(self) -> DeviceProfile:
        """The profile the device clock models (the cpu profile where none is given)."""
        return self.profile or PROFILES["cpu"]


def default_prompts(model: str) -> Path:
    """The model folder's held-out ids (moefy writes them), else the tiny OLMoE's."""
    own = Path(model) / "heldout.npy"
    return own if own.is_file() else Path("build/olmoe-data/eval.npy")


def numbers(budgets: str, regime_map: str | None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """--budgets and --regime-map as numbers."""
    try:
        return tuple(float(b) for b in budgets.split(",")), (
            tuple(float(r) for r in regime_map.split(",")) if regime_map else ()
        )
    except ValueError:
        raise M2R2Error(
            f"--budgets and --regime-map take comma-separated numbers, got {budgets!r} and {regime_map!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="m2r2-bench --moe", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="an mlx-lm MoE model (alias, repo id or folder)")
    p.add_argument("--adapters", default=None, help="M2R2 adapters for that model (default: MODEL-m2r2)")
    p.add_argument(
        "--experts",
        type=Path,
        default=None,
        help="expert store folder (default: m2r2's cache, keyed by the model's weights; exported on first use)",
    )
    p.add_argument("--budgets", default="100,50,25", help="expert budgets, percent of all experts")
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated, of {', '.join(METHODS)} (resident always runs: it is the token reference)",
    )
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="held-out token ids (.npy): prompts are windows of it (default: the model folder's heldout.npy)",
    )
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=48, help="new tokens per prompt")
    p.add_argument("--link-gbps", type=float, default=0.5, help="throttled link bandwidth, GB/s (0: unthrottled)")
    p.add_argument("--latency-ms", type=float, default=0.05, help="throttled link latency per transfer")
    p.add_argument(
        "--profile",
        default=None,
        help=f"device profile, one of {', '.join(PROFILES)}: the link is set "
        "so that one expert's transfer / one layer's compute (measured here) is the device's; "
        "'here': the cpu profile measured inside a decode at the start of the run",
    )
    p.add_argument("--ratio", type=float, default=None, help="as --profile, with this transfer/compute ratio")
    p.add_argument(
        "--regime-map",
        default=None,
        metavar="RATIOS",
        help="also run every method at these transfer/compute ratios (comma-separated) at "
        "--regime-budget: moe_regime.md/.png",
    )
    p.add_argument("--regime-budget", type=float, default=25.0)
    p.add_argument("--regime-prompts", type=int, default=3, help="prompts per regime-map point")
    p.add_argument("--policy", default="lru", choices=["lru", "lfu"])
    p.add_argument(
        "--m2r2-intervals",
        type=int,
        default=None,
        help="M2R2: run the fast stream ahead in the first N gate intervals only (default: all)",
    )
    p.add_argument(
        "--clock",
        default="both",
        choices=["both", *CLOCKS],
        help="device: each row decoded on the profile's modelled device clock (deterministic); wall: on this "
        "machine's clock with the emulated link; both (default): each row twice, device first",
    )
    p.add_argument("--out", type=Path, default=Path("docs"), help="folder for moe_bench.md/.json/.png")
    return p


def with_vs_lru(
    rows: list[dict], key: str = "budget", compute_ms: float | None = None, expert_ms: dict | None = None
) -> list[dict]:
    """Speedup over LRU at the same budget (or ratio), on each clock; on LRU rows, the overlap ceiling: LRU's loads
    hidden behind compute in full, ``T_lru / max(compute, loads x one expert's transfer)``. With as many slots as
    experts per token every policy makes LRU's misses, so no predictor can pass it there."""
    for r in rows:
        lru = next((x for x in rows if x["method"] == "lru" and x[key] == r[key]), None)
        for speed, vs in (("tokens_per_s", "vs_lru"), ("device_tokens_per_s", "device_vs_lru")):
            ok = lru and r.get(speed) and lru.get(speed)
            r[vs] = r[speed] / lru[speed] if ok else None
        if r["method"] == "lru" and compute_ms and expert_ms and r.get("tokens_per_s"):
            t = expert_ms[r[key]] if key == "ratio" else expert_ms[None]
            r["overlap_ceiling"] = (1e3 / r["tokens_per_s"]) / max(compute_ms, r["loads_per_token"] * t)
    return rows


def open_store(config: MoEBenchConfig) -> tuple[ExpertStore, int]:
    """The model's expert store (exported on first use) and its number of layers."""
    lm = load_model(config.model, tokenizer=False)
    store = exported_store(lm, config.experts)
    for b in config.budgets + ((config.regime_budget,) if config.regime_ratios else ()):
        resolve_slots(b / 100, store)  # a budget below top-k fails now, in one line, before any run
    return store, len(lm.model.layers)


def run(config: MoEBenchConfig) -> dict:
    """Every method at every budget (and ratio of the regime map); the result moe_bench.json holds."""
    if config.build is not None and not is_built(config.build):
        build_model(config.build)
    if config.profile_here:
        print("measuring this machine's cpu profile inside a decode (about a minute)", file=sys.stderr)
        config = replace(config, profile=profile_here(Path(config.model)), profile_here=False)
    prompt_file = config.prompt_file()  # after the build, which writes the model folder's held-out ids
    if not prompt_file.is_file():
        raise M2R2Error(f"{prompt_file} not found; pass --prompts")
    ids = np.load(prompt_file)
    span = config.prompt_tokens
    if ids.size < config.num_prompts * span * 4:
        raise M2R2Error(f"{prompt_file} holds {ids.size} tokens, too few for {config.num_prompts} prompts of {span}")
    stride = ids.size // config.num_prompts
    prompts = [ids[i * stride : i * stride + span] for i in range(config.num_prompts)]
    store, num_layers = open_store(config)

    bench = BenchRun(config, store, prompts)
    plain = [m for m in config.methods if m not in ("resident", *BOUNDS)]
    cached = plain + [m for m in BOUNDS if m in config.methods]  # the bounds replay routes a plain row recorded
    runs = len(config.clocks) * (1 + len(config.budgets) * len(cached))
    bar = tqdm(total=runs * len(prompts) + len(config.regime_ratios) * len(plain), desc="moe bench", unit="run")
    # all experts resident: the tokens every other row is checked against, and this machine's compute
    resident = measure_row(bench, "resident", 100.0, None)
    bar.update(len(config.clocks) * len(prompts))
    # one layer's compute on this machine: the all-resident decode step shared over the layers
    layer_ms = 1e3 / (resident["tokens_per_s"] or resident["device_tokens_per_s"]) / num_layers
    ratio = config.link_ratio
    if config.profile is not None and ratio is None:  # the cpu profile: this machine, its link as stated
        link = Link(config.profile.link_gbps, config.profile.latency_ms)
    elif ratio is not None:
        link = link_for(ratio, store.expert_bytes(), layer_ms)
    else:
        link = Link(config.link_gbps or None, config.latency_ms if config.link_gbps else 0.0)
    rows = [resident]
    for b in config.budgets:
        for m in cached:
            bar.set_postfix_str(f"{m} {b:g}%")
            rows.append(measure_row(bench, m, b, fresh(link)))
            bar.update(len(config.clocks) * len(prompts))
    regime = []
    for r in config.regime_ratios:  # a transfer/compute ratio is the wall clock's emulation
        for m in plain:
            bar.set_postfix_str(f"ratio {r:g} {m}")
            link_r = link_for(r, store.expert_bytes(), layer_ms)
            few = BenchRun(config, store, prompts[: config.regime_prompts], bench.reference, bench.traces)
            row = measure(few, m, config.regime_budget, link_r, "wall")
            regime.append({**row, "ratio": r})
            bar.update()
    bar.close()
    compute_ms = 1e3 / resident["tokens_per_s"] if resident["tokens_per_s"] else None
    return {
        "model": str(config.model),
        "profile": config.profile.name if config.profile is not None else None,
        "device_profile": asdict(config.device) if "device" in config.clocks else None,
        "clocks": list(config.clocks),
        "ratio": ratio,
        "layer_ms": layer_ms,
        "link_gbps": link.gb_per_s,
        "latency_ms": link.latency_ms,
        "expert_bytes": store.expert_bytes(store.layers[0]),
        "prompts": len(prompts),
        "prompt_tokens": span,
        "max_tokens": config.max_tokens,
        "rows": with_vs_lru(
            rows, compute_ms=compute_ms, expert_ms={None: link.min_seconds(store.expert_bytes()) * 1e3}
        ),
        "regime_budget": config.regime_budget,
        "regime_prompts": min(config.regime_prompts, len(prompts)),
        "regime": with_vs_lru(
            regime, "ratio", compute_ms=compute_ms, expert_ms={r: r * layer_ms for r in config.regime_ratios}
        ),
    }


def fresh(link: Link) -> Link:
    """A new link with the same settings (its counters and channel are per run)."""
    return Link(link.gb_per_s, link.latency_ms)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    cmd = " ".join(["m2r2-bench --moe", *(argv if argv is not None else sys.argv[1:])])

    def body() -> int:
        budgets, ratios = numbers(args.budgets, args.regime_map)
        config = MoEBenchConfig(
            model=args.model,
            adapters=args.adapters or f"{str(args.model).rstrip('/')}-m2r2",
            prompts=args.prompts,
            methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
            budgets=budgets,
            experts=args.experts,
            num_prompts=args.num_prompts,
            prompt_tokens=args.prompt_tokens,
            max_tokens=args.max_tokens,
            link_gbps=args.link_gbps,
            latency_ms=args.latency_ms,
            profile=get_profile(args.profile) if args.profile not in (None, "here") else None,
            profile_here=args.profile == "here",
            ratio=args.ratio,
            regime_ratios=ratios,
            regime_budget=args.regime_budget,
            regime_prompts=args.regime_prompts,
            policy=args.policy,
            m2r2_intervals=args.m2r2_intervals,
            clocks=CLOCKS if args.clock == "both" else (args.clock,),
            build=BenchModelBuild() if Path(args.model) == DEFAULT_MODEL and not is_built(BenchModelBuild()) else None,
        )
        write_report(run(config), LABELS, args.out, cmd)
        return 0

    sys.exit(run_cli("m2r2-bench --moe", body))


if __name__ == "__main__":
    main()
