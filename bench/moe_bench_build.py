"""The benchmark MoE, built when `m2r2-bench --moe` finds it missing: the MoEfied SmolLM2, its lookahead maps and
its router-trained M2R2 adapters, from text the package ships; only what the requested rows need.

    python -m m2r2_bench.moe_bench_build [--adapters]        # build/smollm2-moe (and build/smollm2-moe-m2r2)

Three steps, each written atomically (a file or folder appears complete or not at all), each skipped when its
result is there, so an interrupted build resumes where it stopped and is never read as complete:

1. the model (m2r2_tools.moefy, 12 minutes here): SmolLM2's FFNs cut into 16 experts, top-4, learnt from Spec-Bench's
   question turns (bench/data/question.jsonl, shipped with m2r2-bench: 137k tokens of prose, code and maths), with
   the packaged SmolLM2 adapters re-keyed beside it;
2. the lookahead maps (m2r2_mlx/moe/lookahead.py, 11 minutes), for the ``lookahead`` row;
3. the adapters (14 minutes), for the fast-stream rows only: the re-keyed adapters trained further on the router
   target (m2r2_mlx/moe/router_target.py), so that their exits predict the routing of the layers above them. The
   folder records the held-out recall.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import m2r2_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx.core on Linux)
from m2r2_mlx.atomic import atomic_write_text
from m2r2_mlx.core.config import M2R2Config
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.models.registry import load_model
from m2r2_mlx.moe.lookahead import FILE as LOOKAHEAD_FILE
from m2r2_mlx.moe.lookahead import ensure_lookahead
from m2r2_mlx.moe.router_adapters import RouterAdaptersSpec, train_router_adapters
from m2r2_mlx.moe.router_target import RouterTargetConfig

from .questions import SPECBENCH

PROG = "python -m m2r2_bench.moe_bench_build"
DEFAULT_MODEL = Path("build/smollm2-moe")
COMMAND = f"{PROG} -o {DEFAULT_MODEL}"


@dataclass(frozen=True)
class BenchModelBuild:
    """What the build makes; the defaults are the benchmark model's (tests build a slice). ``lookahead`` and
    ``adapters``: whether the rows to run need the lookahead maps and the M2R2 adapters."""

    out: Path = DEFAULT_MODEL
    lookahead: bool = True
    adapters: bool = False
    layers: int | None = None  # MoEfy only the first N layers (a slice: new adapters, gates every layers // 2)
    experts: int = 16
    top_k: int = 4
    tokens: int = 16384  # corpus tokens the grouping and routers learn from
    heldout_tokens: int = 4096
    router_steps: int = 300
    adapter_tokens: int = 65536  # corpus tokens (held-out documents excluded) the adapters learn from
    adapter_steps: int = 60
    adapter_seq_len: int = 128

    @property
    def adapters_folder(self) -> Path:
        return self.out.with_name(self.out.name + "-m2r2")


def model_built(build: BenchModelBuild) -> bool:
    return (build.out / "moefy.json").is_file() and (build.out / "train.npy").is_file()


def lookahead_built(build: BenchModelBuild) -> bool:
    return (build.out / LOOKAHEAD_FILE).is_file()


def adapters_built(build: BenchModelBuild) -> bool:
    try:
        return "router_target" in M2R2Config.load(build.adapters_folder).extra
    except M2R2Error:
        return False


def is_built(build: BenchModelBuild) -> bool:
    """Whether every step the build asks for is done."""
    return (
        model_built(build)
        and (lookahead_built(build) or not build.lookahead)
        and (adapters_built(build) or not build.adapters)
    )


def shipped_text(folder: Path) -> Path:
    """Spec-Bench's question turns as paragraphs in one text file (written atomically into ``folder``)."""
    turns = [t for line in SPECBENCH.read_text().splitlines() if line.strip() for t in json.loads(line)["turns"]]
    return atomic_write_text(folder / "moe-text.txt", "\n\n".join(t.strip() for t in turns if t.strip()))


def build_model(build: BenchModelBuild, progress: bool = True) -> dict:
    """Whichever of the two steps is missing; returns what each took (seconds). Where it cannot build, one line
    says why and names the command that builds it once that is fixed."""
    try:
        return _build(build, progress)
    except M2R2Error as e:
        raise M2R2Error(f"the benchmark MoE {build.out} cannot be built here: {e}; then run {COMMAND}") from None


def _build(build: BenchModelBuild, progress: bool) -> dict:
    try:  # the build tools: installed with the package (m2r2_tools), needed only here
        from m2r2_tools.moefy import PACKAGED_ADAPTERS, MoefyConfig
        from m2r2_tools.moefy import build as moefy
    except ImportError as e:
        raise M2R2Error(
            f"the benchmark MoE cannot be built here ({e}); reinstall m2r2-mlx, then run {COMMAND}"
        ) from None
    took = {}
    text = shipped_text(build.out.parent)
    if not model_built(build):
        start = time.perf_counter()
        say(f"building the benchmark MoE in {build.out} (once; MoEfication, about 12 minutes)", progress)
        moefy(
            MoefyConfig(
                out=build.out,
                experts=build.experts,
                top_k=build.top_k,
                layers=build.layers,
                text=(str(text),),
                tokens=build.tokens,
                heldout_tokens=build.heldout_tokens,
                router_steps=build.router_steps,
                train_ids=build.adapter_tokens,
                adapters=PACKAGED_ADAPTERS if build.layers is None else None,
                adapters_out=build.adapters_folder,
                evaluate=False,  # a minute of the build; `python -m m2r2_tools.moefy` measures the quality
                force=True,
            )
        )
        took["model_s"] = time.perf_counter() - start
    if build.lookahead and not lookahead_built(build):
        start = time.perf_counter()
        say(f"the lookahead maps, into {build.out / LOOKAHEAD_FILE} (once; about 11 minutes)", progress)
        ensure_lookahead(load_model(str(build.out), tokenizer=False), build.out, progress=progress)
        took["lookahead_s"] = time.perf_counter() - start
    if build.adapters and not adapters_built(build):
        start = time.perf_counter()
        say(f"M2R2 adapters trained on its routing, into {build.adapters_folder} (once; about 14 minutes)", progress)
        lm = load_model(str(build.out))
        adapters = build.adapters_folder
        warm = adapters if (adapters / "m2r2_config.json").is_file() else None
        spec = RouterAdaptersSpec(
            out=adapters,
            ids=build.out / "train.npy",
            heldout=build.out / "heldout.npy",
            init=warm,
            every=max(1, len(lm.model.layers) // 2) if warm is None else 6,
            seq_len=build.adapter_seq_len,
            tokens=build.adapter_tokens,
            train=RouterTargetConfig(steps=build.adapter_steps),
            force=True,
        )
        record = train_router_adapters(lm, spec, progress=progress)
        took["adapters_s"] = time.perf_counter() - start
        say(
            f"held-out recall of the next interval's experts {record['before']['recall_next_interval']:.1%} -> "
            f"{record['after']['recall_next_interval']:.1%}",
            progress,
        )
    return took


def say(line: str, progress: bool) -> None:
    if progress:
        print(line, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("-o", "--out", type=Path, default=DEFAULT_MODEL, help="model folder (adapters: OUT-m2r2)")
    p.add_argument("--layers", type=int, default=None, help="MoEfy only the first N layers (a quick slice)")
    p.add_argument("--adapters", action="store_true", help="also train the M2R2 adapters (the fast-stream rows)")
    p.add_argument("--adapter-steps", type=int, default=BenchModelBuild.adapter_steps)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> None:
        build = BenchModelBuild(
            out=args.out, layers=args.layers, adapters=args.adapters, adapter_steps=args.adapter_steps
        )
        if is_built(build):
            print(f"{build.out} is built")
            return
        took = build_model(build)
        print(f"built {build.out} in {sum(took.values()) / 60:.1f} min")

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
