"""The speculative engine with one adaptive piece switched off at a time, every variant in one run beside the full
engine, prompt lookup alone, the fast stream alone and plain decoding (issue 39; docs/speculative.md "Ablation").

    python -m experiments.speculative_ablation --questions bench/data/question.jsonl --limit 2 --out out/abl-sb
    python -m experiments.speculative_ablation --questions bench/data/heldout.jsonl --out out/abl-heldout

One engine per variant for the whole run (as a chat or a server keeps one); all variants answer a question before
the next question, so drift on the shared machine hits every variant alike. Writes records.json (every turn's
tokens, times and acceptance) and results.md (speedup over plain per category, and tokens per step).

Each variant is the engine of this commit with one piece removed by replacing it on the built engine (the product
has no switches for them):
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import m2r2_mlx  # noqa: F401  (first: preloads OpenBLAS)
from m2r2_mlx.atomic import atomic_write_text
from m2r2_mlx.decoding import costs as costs_module
from m2r2_mlx.decoding.config import DecodeConfig, GenerationConfig
from m2r2_mlx.decoding.decoders import make_decoder
from m2r2_mlx.decoding.policy import Acceptance
from m2r2_mlx.errors import run_cli
from m2r2_mlx.models.blas import blas_info
from m2r2_mlx.models.registry import load_model

from tqdm.auto import tqdm

from m2r2_bench.methods import MethodSettings, make_method, run_turns
from m2r2_bench.questions import ordered, select_questions
from m2r2_bench.report import summarise


class OneBucket(costs_module.StepCosts):
    bucket = property(lambda self: 0)


class NoFloor(costs_module.StepCosts):
    def extra(self, n: int) -> float:
        return self.plain_seconds() * max(self.ratio(n + 1) - self.ratio(n), 0.0)


class NoSignal(Acceptance):
    def rate(self, kind, depth, signal=None):
        return super().rate(kind, depth, None)

    def optimistic(self, kind, depth, signal=None):
        return super().optimistic(kind, depth, None)

    def observe(self, kind, depth, signal, accepted):
        super().observe(kind, depth, None, accepted)


class NoOptimism(Acceptance):
    def optimistic(self, kind, depth, signal=None):
        return self.rate(kind, depth, signal)


def _greedy_select(planner):
    """Selection without best-prefix: nodes join in order of pi only while each one raises tokens per second."""

    def select(tree):
        pi = planner.reach(tree)
        order = sorted(range(1, len(tree)), key=lambda i: (-pi[i], tree.depths[i]))[: planner.max_nodes]
        tokens, seconds = 1.0, planner.costs.verify_cost(1)
        kept = [0]
        for n, node in enumerate(order, start=1):
            t, s = tokens + pi[node], seconds + planner.costs.extra(n)
            if t / s <= tokens / seconds:
                break
            tokens, seconds = t, s
            kept.append(node)
        return sorted(kept), tokens, seconds

    return select


def _no_stale(costs):
    observe = costs.observe_verify

    def observe_verify(n, seconds):
        observe(n, seconds)
        costs.stale = False

    return observe_verify


def _remove(engine, piece: str) -> None:
    if piece == "calibration":  # no profile at all: the costs start from a guess and learn online
        engine.calibration = None
        engine.costs.prior = None
        engine._calibrate = lambda cache, y: None
    elif piece == "aging":  # samples never age out; the plain step is not re-timed for age
        engine.costs.max_age = 10**9
    elif piece == "staleness":  # a ratio out of bounds does not send the engine to re-time the plain step
        engine.costs.observe_verify = _no_stale(engine.costs)
    elif piece == "shadow":
        engine._shadow = lambda shadow, context, limit: None
    elif piece == "probes":
        engine.explore.share = 0.0
    elif piece == "best-prefix":
        engine.planner.select = _greedy_select(engine.planner)
    elif piece == "context-buckets":
        engine.costs.__class__ = OneBucket
    elif piece == "floors":
        engine.costs.__class__ = NoFloor
    elif piece == "signal":
        engine.acceptance.__class__ = NoSignal
    elif piece == "optimism":
        engine.acceptance.__class__ = NoOptimism
    elif piece == "new-answer":  # what earlier answers taught keeps its full weight
        engine.acceptance.new_text = lambda keep=0.25: None
    else:
        raise ValueError(piece)


PIECES = (
    "trees",
    "cost-model",
    "calibration",
    "aging",
    "staleness",
    "shadow",
    "probes",
    "best-prefix",
    "context-buckets",
    "floors",
    "signal",
    "optimism",
    "new-answer",
)
__doc__ += "".join(f"\n- ``no-{p}``" for p in PIECES)


def make_variant(lm, name: str, settings: MethodSettings):
    if not name.startswith("no-"):
        return make_method(lm, name, settings)
    piece = name[3:]
    config = DecodeConfig("speculative", gate=settings.gate)
    if piece == "trees":
        config = replace(config, tree_width=1)
    elif piece == "cost-model":  # every proposal of both drafters verified, the fixed settings of "always"
        config = replace(config, policy="always")
    engine = make_decoder(lm, config, settings.adapters)
    if piece not in ("trees", "cost-model"):
        _remove(engine, piece)
    return engine


def wait_while_paused(pause: Path | None) -> None:
    """Between answers: while ``pause`` exists, wait (and say so in ``pause``.paused), so that another heavy job
    on this machine can run without slowing a measured answer."""
    if pause is None or not pause.exists():
        return
    marker = pause.with_suffix(".paused")
    marker.touch()
    while pause.exists():
        time.sleep(1)
    marker.unlink(missing_ok=True)


def run(lm, questions, names, settings, generation, seed, pause: Path | None = None):
    engines = {name: make_variant(lm, name, settings) for name in names}
    for decode in engines.values():
        run_turns(lm, decode, ["Say hello."], GenerationConfig(8))
    records = defaultdict(list)
    bar = tqdm(total=len(questions) * len(names), desc="ablation", unit="answer")
    for q in questions:
        ref = None
        for name in names:
            wait_while_paused(pause)
            bar.set_postfix_str(f"q{q['question_id']} {name}")
            gen = generation if generation.sampling.greedy else replace(generation, seed=seed + q["question_id"])
            turns = run_turns(lm, engines[name], q["turns"], gen)
            tokens = [t["tokens"] for t in turns]
            ref = tokens if name == "plain" else ref
            records[name].append(
                {
                    "question_id": q["question_id"],
                    "category": q["category"],
                    "turns": turns,
                    "same_as_plain": tokens == ref if generation.sampling.greedy else None,
                }
            )
            bar.update()
    bar.close()
    return records


def report(records, names, categories) -> str:
    s = summarise(records, names, categories)
    groups = [*categories, "overall"]
    head = "| variant | " + " | ".join(groups) + " | tokens/step | vs full | same |"
    lines = [head, "|" + "---|" * (len(groups) + 4)]
    full = s.get(("overall", "m2r2"), {}).get("speedup")
    for m in names:
        cells = [f"{s[g, m]['speedup']:.2f}x" if (g, m) in s else "-" for g in groups]
        o = s["overall", m]
        rel = f"{o['speedup'] / full:.3f}" if full else "-"
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {o['accepted']:.2f} | {rel} | {o['same']} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.speculative_ablation", description=__doc__.split("\n")[0])
    p.add_argument("--questions", type=Path, required=True)
    p.add_argument("--categories", default="all")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--order", default="given")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--adapters", default=None)
    p.add_argument(
        "--methods",
        default=",".join(["plain", "m2r2", "lookup", "m2r2-fast", *(f"no-{p}" for p in PIECES)]),
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--pause-file", type=Path, default=None, help="wait between answers while this file exists")
    return p


def _main() -> int:
    args = build_parser().parse_args()
    questions = ordered(select_questions(args.questions, args.categories, args.limit), args.order, args.seed)
    questions = [dict(q, turns=q["turns"][: args.turns]) for q in questions]
    names = [m.strip() for m in args.methods.split(",")]
    generation = GenerationConfig.create(args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    lm = load_model()
    print(f"{len(questions)} questions, {len(names)} variants; {blas_info().describe()}", file=sys.stderr)
    records = run(lm, questions, names, MethodSettings(args.adapters), generation, args.seed, args.pause_file)
    categories = list(dict.fromkeys(q["category"] for q in questions))
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "records.json", json.dumps(records))
    cmd = " ".join(["python -m experiments.speculative_ablation", *sys.argv[1:]])
    md = report(records, names, categories)
    atomic_write_text(args.out / "results.md", f"`{cmd}`\n\n{md}\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("experiments.speculative_ablation", _main))
