"""MoE decoding with a memory-budgeted expert cache, experts read from the disk: on-demand LRU against predictors.

    m2r2-bench --moe                                  # this machine, real reads: resident, LRU, predictors, bounds
    m2r2-bench --moe --profile macbook                # the same rows on the device clock of an Apple laptop

The default model, the MoEfied SmolLM2 (with the lookahead maps; M2R2 adapters only for the fast-stream rows), is
built on first use when missing (moe_bench_build.py: about 23 minutes, once, from text the package ships).

For each expert budget (a share of all experts held in memory) and each method, greedy decoding of the same prompts,
batch 1: tokens/s (decode only), speedup over on-demand LRU at the same budget, hit rate, MB read from the disk a
token and the reads' achieved GB/s, beside the disk's own GB/s from a direct-read probe run first. Every row's
tokens are checked against the all-resident model's. One clock per run: the wall clock (``--profile here``, the
default) is this machine reading experts from its disk, around the page cache (``--io direct``); a device profile
(``--profile macbook``, ``pcie-gpu``) runs every row on that device's modelled clock (deterministic).
``--profile here --clock device`` measures this machine's profile at the start and models it: the check of the
device clock against the wall clock.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import m2r2_mlx  # noqa: F401  (fast BLAS before mlx)
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.models.registry import load_model
from m2r2_mlx.moe import ExpertStore
from m2r2_mlx.moe.cache import resolve_slots
from m2r2_mlx.moe.insitu import profile_here
from m2r2_mlx.moe.profiles import PROFILES, DeviceProfile, get_profile
from m2r2_mlx.moe.reader import IO_MODES, probe_disk
from m2r2_mlx.moe.serve import exported_store

import numpy as np
from tqdm.auto import tqdm

from .cli import method_list
from .moe_bench_build import COMMAND, DEFAULT_MODEL, BenchModelBuild, build_model, is_built
from .moe_bench_report import write_report
from .moe_rows import BOUNDS, ORACLE_LOOKAHEAD, ROWS, BenchRun, measure

PREDICTED = tuple(name for name in ROWS if name != "none")  # on-demand loading is the "lru" row
MOE_METHODS = ("resident", "lru", *PREDICTED, *BOUNDS)
DEFAULT_METHODS = ("resident", "lru", "pregating-planned", "lookahead", "belady", "oracle")
LABELS = {
    "resident": "all resident",
    "lru": "on-demand LRU",
    **{name: ROWS[name].label for name in PREDICTED},
    "belady": "bound: Belady eviction (true future), on demand",
    "oracle": f"bound: true routes {ORACLE_LOOKAHEAD} layers ahead + Belady",
}
CLOCKS = ("wall", "device")


@dataclass(frozen=True)
class MoEBenchConfig:
    """What one run measures; every value is checked on construction, before anything loads, in one line each."""

    model: str
    adapters: str  # M2R2 adapters for the model (the fast-stream rows)
    prompts: Path | None = None  # held-out token ids (.npy), prompts are windows of it (None: default_prompts)
    methods: tuple[str, ...] = DEFAULT_METHODS
    budgets: tuple[float, ...] = (25.0, 50.0)  # percent of all experts
    experts: Path | None = None  # the expert store (None: m2r2's cache, exported on first use)
    num_prompts: int = 4
    prompt_tokens: int = 48
    max_tokens: int = 48  # new tokens per prompt
    profile: str = "here"  # the device the rows run on: this machine (the wall clock) or a device profile
    clock: str | None = None  # wall or device (None: wall for this machine, device for a device profile)
    io: str = "direct"  # how the wall clock reads experts: around the page cache, or through it ("cached")
    policy: str = "lru"
    build: BenchModelBuild | None = None  # the benchmark model is missing: build it first (prompts come with it)

    def __post_init__(self):
        bad = [m for m in self.methods if m not in MOE_METHODS]
        if bad:
            raise M2R2Error(f"unknown MoE method(s) {', '.join(bad)}; choose from {', '.join(MOE_METHODS)}")
        if self.profile != "here":
            get_profile(self.profile)  # an unknown profile is one line
        if self.clock is not None and self.clock not in CLOCKS:
            raise M2R2Error(f"--clock takes wall or device, got {self.clock}")
        if self.clock_kind == "wall" and self.profile != "here":
            raise M2R2Error(
                f"the wall clock measures this machine; --profile {self.profile} runs on the device clock "
                "(leave out --clock, or pass --profile here)"
            )
        if self.io not in IO_MODES:
            raise M2R2Error(f"--io takes {' or '.join(IO_MODES)}, got {self.io}")
        if any(m in BOUNDS for m in self.methods) and not any(m not in ("resident", *BOUNDS) for m in self.methods):
            raise M2R2Error("the bound rows replay the routes a cached row records; add lru to --methods")
        if self.num_prompts < 1 or self.max_tokens < 2 or self.prompt_tokens < 1:
            raise M2R2Error("--num-prompts and --prompt-tokens must be at least 1, --max-tokens at least 2")
        if not self.budgets or any(not 0 < b <= 100 for b in self.budgets):
            raise M2R2Error("--budgets are percentages of the experts, above 0 and at most 100")
        if self.build is None and not self.prompt_file().is_file():
            raise M2R2Error(
                f"{self.prompt_file()} not found; build the benchmark model with {COMMAND}, or pass --prompts"
            )

    @property
    def clock_kind(self) -> str:
        return self.clock or ("wall" if self.profile == "here" else "device")

    def prompt_file(self) -> Path:
        """The held-out ids: as given, else the model folder's (which a build writes: read it after the build)."""
        return self.prompts if self.prompts is not None else default_prompts(self.model)


def default_prompts(model: str) -> Path:
    """The model folder's held-out ids (moefy writes them), else the tiny OLMoE's."""
    own = Path(model) / "heldout.npy"
    return own if own.is_file() else Path("build/olmoe-data/eval.npy")


def numbers(budgets: str) -> tuple[float, ...]:
    """--budgets as numbers."""
    try:
        return tuple(float(b) for b in budgets.split(","))
    except ValueError:
        raise M2R2Error(f"--budgets takes comma-separated numbers, got {budgets!r}") from None


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
    p.add_argument("--budgets", default="25,50", help="expert budgets, percent of all experts (default 25,50)")
    p.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        type=method_list(MOE_METHODS),
        help=f"comma-separated, of {', '.join(MOE_METHODS)} (default: {','.join(DEFAULT_METHODS)}; resident always "
        "runs: it is the token reference)",
    )
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="held-out token ids (.npy): prompts are windows of it (default: the model folder's heldout.npy)",
    )
    p.add_argument("--num-prompts", type=int, default=MoEBenchConfig.num_prompts)
    p.add_argument("--prompt-tokens", type=int, default=MoEBenchConfig.prompt_tokens)
    p.add_argument("--max-tokens", type=int, default=MoEBenchConfig.max_tokens, help="new tokens per prompt")
    p.add_argument(
        "--profile",
        default="here",
        help=f"here (this machine, the default) or a device profile: {', '.join(p for p in PROFILES if p != 'here')}",
    )
    p.add_argument(
        "--clock",
        default=None,
        choices=CLOCKS,
        help="wall: this machine's clock, experts read from its disk (the default for --profile here); device: the "
        "profile's modelled clock (deterministic; the default for a device profile)",
    )
    p.add_argument(
        "--io",
        default="direct",
        choices=IO_MODES,
        help="wall clock: read experts around the page cache (direct, the default) or through it (cached: not a "
        "disk measurement)",
    )
    p.add_argument("--policy", default="lru", choices=["lru", "lfu"])
    p.add_argument(
        "--out",
        type=Path,
        default=Path("m2r2-bench-results/moe"),
        help="folder for results.md, rows.jsonl and moe_bench.png (default m2r2-bench-results/moe)",
    )
    return p


def build_for(methods: tuple[str, ...], out: Path = DEFAULT_MODEL) -> BenchModelBuild:
    """The benchmark model's build, making only what ``methods`` need (the maps, the adapters)."""
    return BenchModelBuild(
        out=out,
        lookahead=any(m in ROWS and ROWS[m].needs_lookahead for m in methods),
        adapters=any(m in ROWS and ROWS[m].needs_adapters for m in methods),
    )


def with_vs_lru(rows: list[dict]) -> list[dict]:
    """Speedup over LRU at the same budget."""
    for r in rows:
        lru = next((x for x in rows if x["method"] == "lru" and x["budget"] == r["budget"]), None)
        r["vs_lru"] = r["tokens_per_s"] / lru["tokens_per_s"] if lru else None
    return rows


def open_store(config: MoEBenchConfig) -> ExpertStore:
    """The model's expert store (exported on first use)."""
    store = exported_store(load_model(config.model, tokenizer=False), config.experts)
    for b in config.budgets:
        resolve_slots(b / 100, store)  # a budget below top-k fails now, in one line, before any run
    return store


def run(config: MoEBenchConfig) -> dict:
    """Every method at every budget; the result rows.jsonl and results.md hold."""
    if config.build is not None and not is_built(config.build):
        build_model(config.build)
    prompt_file = config.prompt_file()  # after the build, which writes the model folder's held-out ids
    if not prompt_file.is_file():
        raise M2R2Error(f"{prompt_file} not found; pass --prompts")
    ids = np.load(prompt_file)
    span = config.prompt_tokens
    if ids.size < config.num_prompts * span * 4:
        raise M2R2Error(f"{prompt_file} holds {ids.size} tokens, too few for {config.num_prompts} prompts of {span}")
    stride = ids.size // config.num_prompts
    prompts = [ids[i * stride : i * stride + span] for i in range(config.num_prompts)]
    store = open_store(config)
    disk = probe_disk(store)
    print(
        f"disk: {disk.gbps:.2f} GB/s in 4 MB direct reads, one expert ({store.expert_bytes() / 1e6:.2f} MB) "
        f"in {disk.expert_ms:.2f} ms",
        file=sys.stderr,
    )
    device: DeviceProfile | None = None
    if config.clock_kind == "device":
        if config.profile == "here":
            print("measuring this machine's profile inside a decode (about two minutes)", file=sys.stderr)
            device = profile_here(Path(config.model))
        else:
            device = get_profile(config.profile)
    bench = BenchRun(config, store, prompts, device)
    plain = [m for m in config.methods if m not in ("resident", *BOUNDS)]
    cached = plain + [m for m in BOUNDS if m in config.methods]  # the bounds replay routes a plain row recorded
    bar = tqdm(total=(1 + len(config.budgets) * len(cached)) * len(prompts), desc="moe bench", unit="prompt")
    rows = [measure(bench, "resident", 100.0)]  # the tokens every other row is checked against
    bar.update(len(prompts))
    for b in config.budgets:
        for m in cached:
            bar.set_postfix_str(f"{m} {b:g}%")
            rows.append(measure(bench, m, b))
            bar.update(len(prompts))
    bar.close()
    store.close()
    return {
        "model": str(config.model),
        "clock": config.clock_kind,
        "profile": config.profile,
        "device_profile": asdict(device) if device is not None else None,
        "io": config.io,
        "disk": asdict(disk),
        "expert_bytes": store.expert_bytes(),
        "prompts": len(prompts),
        "prompt_tokens": span,
        "max_tokens": config.max_tokens,
        "rows": with_vs_lru(rows),
    }


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    cmd = " ".join(["m2r2-bench --moe", *(argv if argv is not None else sys.argv[1:])])

    def body() -> int:
        methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
        build = None
        if Path(args.model) == DEFAULT_MODEL:
            needs = build_for(methods)
            build = None if is_built(needs) else needs
        config = MoEBenchConfig(
            model=args.model,
            adapters=args.adapters or f"{str(args.model).rstrip('/')}-m2r2",
            prompts=args.prompts,
            methods=methods,
            budgets=numbers(args.budgets),
            experts=args.experts,
            num_prompts=args.num_prompts,
            prompt_tokens=args.prompt_tokens,
            max_tokens=args.max_tokens,
            profile=args.profile,
            clock=args.clock,
            io=args.io,
            policy=args.policy,
            build=build,
        )
        write_report(run(config), LABELS, args.out, cmd)
        return 0

    sys.exit(run_cli("m2r2-bench --moe", body))


if __name__ == "__main__":
    main()
