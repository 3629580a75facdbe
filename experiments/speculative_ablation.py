"""The speculative engine with one adaptive piece switched off at a time, every variant in one run beside the full
engine, prompt lookup alone, the fast stream alone and plain decoding (docs/speculative.md, "Ablation").

    python -m experiments.speculative_ablation --questions bench/data/question.jsonl --limit 2 --out out/abl-sb
    python -m experiments.speculative_ablation --questions bench/data/heldout.jsonl --out out/abl-heldout
    python -m experiments.speculative_ablation --questions ... --methods plain,speculative,lookup,fast  # no variants

One engine per variant for the whole run (as a chat or a server keeps one); all variants answer a question before
the next question, so drift on the shared machine hits every variant alike. Writes records.json (every turn's
tokens, times and acceptance) and results.md (speedup over plain per category, tokens per step, and what a step
costs in plain steps). The ablation that chose the engine's pieces ran on the engine before issue 39 (commit
0e6c820, where this script also switched off the pieces since removed: staleness, shadow chains, probes, context
buckets, floors, new-answer scaling; shadow scoring came back in its present form for the session check); draft
trees and the acceptance signal were switched off here until they were removed (commit df1caa2); so were the costs
timed at build (calibration), cost aging and the fast stream's optimistic rate, until the timing fix showed that none
of them paid.

Each variant is the built engine with one piece replaced (the product has no switches for them):
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
from m2r2_mlx.decoding.config import DecodeConfig, GenerationConfig
from m2r2_mlx.decoding.drafters import ForcedDrafter
from m2r2_mlx.decoding.methods import DRAFTERS, METHODS, PLANNERS, cost_planner, speculative_engine
from m2r2_mlx.decoding.planner import CostPlanner, Selection
from m2r2_mlx.errors import run_cli
from m2r2_mlx.models.blas import blas_info
from m2r2_mlx.models.registry import load_model

import numpy as np
from tqdm.auto import tqdm

from m2r2_bench.methods import MethodSettings, make_method, run_turns
from m2r2_bench.questions import ordered, select_questions
from m2r2_bench.report import decode_rate, summarise


class GreedySelection(CostPlanner):
    """Selection without best-prefix: positions join only while each one raises tokens per second."""

    def select(self, draft):
        pi = self.reach(draft)
        tokens, seconds, n = 1.0, self.costs.verify_cost(1), 1
        while n < len(draft):
            t, s = tokens + pi[n], seconds + self.costs.extra(n)
            if t / s <= tokens / seconds:
                break
            tokens, seconds, n = t, s, n + 1
        return self.at_least_floor(draft, Selection(n, tokens, seconds, pi))  # only the rule above the floor differs


class NoShadow(CostPlanner):
    def score_unverified(self, proposals, token):
        pass


PIECES = {
    "cost-model": "every proposal of both drafters verified (the planner always)",
    "best-prefix": "above the floor, positions join only while each one alone raises tokens per second (in the "
    "runs committed up to ho-given-sampled-pieces-lean it skipped the floor too)",
    "shadow": "plain stretches teach nothing: the proposals they did not verify are not scored",
    "floor": "lookup's first continuation priced like every other node (before issue 39's held-out run)",
}
VARIANTS = {"lookup-priced": "the cost planner with prompt lookup alone (no fast stream)"}
__doc__ += "".join(f"\n- ``no-{p}``: {what}" for p, what in PIECES.items())


def make_variant(lm, name: str, settings: MethodSettings):
    """The speculative method's engine built from its drafters with one piece of its planner replaced."""
    if name not in VARIANTS and not name.startswith("no-"):
        return make_method(lm, name, settings)
    method, config = METHODS["speculative"], DecodeConfig(gate=settings.gate)
    drafters = [DRAFTERS["lookup"](lm, config, settings.adapters, method.threshold)]
    if name not in VARIANTS:  # lookup-priced: the cost planner with prompt lookup alone
        drafters.append(DRAFTERS["fast"](lm, config, settings.adapters, method.threshold))
    chain = [ForcedDrafter(), *drafters]
    pieces = [] if name in VARIANTS else name[3:].split("+")  # "no-floor+shadow": both off
    unknown = [p for p in pieces if p not in PIECES]
    if unknown:
        raise ValueError(f"unknown piece {unknown[0]!r}; choose from {', '.join(PIECES)}")
    if "cost-model" in pieces:
        planner = PLANNERS["verify-all"](lm, chain)
    else:
        classes = {"best-prefix": GreedySelection, "shadow": NoShadow}
        bases = tuple(classes[p] for p in pieces if p in classes) or (CostPlanner,)
        floor = 0 if "floor" in pieces else None
        planner = cost_planner(lm, chain, type("Variant", bases, {}), lookup_floor=floor)
    return speculative_engine(lm, drafters, planner, max_draft=method.max_draft, name=name)


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


def seconds_per_step(records: list[dict]) -> float:
    turns = [t for r in records for t in r["turns"]]
    return sum(t["decode_time"] for t in turns) / max(sum(len(t["accept_lengths"]) for t in turns), 1)


def rate(records: list[dict], picks) -> float:
    return decode_rate([t for i in picks for t in records[i]["turns"]])


def against(records: dict, a: str, b: str, rounds: int = 2000, seed: int = 0) -> str:
    """``a``'s decode speed over ``b``'s, with a 95% interval from resampling the questions (each question's
    answers by both stay paired: they ran side by side)."""
    n = len(records[a])
    rng = np.random.default_rng(seed)
    draws = [rate(records[a], p) / rate(records[b], p) for p in rng.integers(0, n, size=(rounds, n))]
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return f"{rate(records[a], range(n)) / rate(records[b], range(n)):.3f} [{lo:.3f}, {hi:.3f}]"


def report(records, names, categories) -> str:
    """Speedup over plain per category and overall; tokens per step; what a step costs in plain steps; the
    speedup against the full engine's, and against prompt lookup's with a 95% interval; answers identical to
    plain's."""
    s = summarise(records, names, categories)
    groups = [*categories, "overall"]
    versus = "lookup" in names
    head = "| variant | " + " | ".join(groups) + " | tokens/step | plain steps/step | vs full |"
    head += " vs lookup (95%) | same |" if versus else " same |"
    lines = [head, "|" + "---|" * (len(groups) + 5 + versus)]
    full = s.get(("overall", "speculative"), {}).get("speedup")
    plain = seconds_per_step(records["plain"])
    for m in names:
        cells = [f"{s[g, m]['speedup']:.2f}x" if (g, m) in s else "-" for g in groups]
        o = s["overall", m]
        rel = f"{o['speedup'] / full:.3f}" if full else "-"
        cost = seconds_per_step(records[m]) / plain
        row = f"| {m} | " + " | ".join(cells) + f" | {o['accepted']:.2f} | {cost:.2f} | {rel} |"
        row += f" {against(records, m, 'lookup')} |" if versus else ""
        lines.append(row + f" {o['same']} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.speculative_ablation", description=__doc__.split("\n")[0])
    p.add_argument("--questions", type=Path, default=Path("bench/data/question.jsonl"))
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
        default=",".join(["plain", "speculative", "lookup", "fast", *(f"no-{p}" for p in PIECES)]),
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--pause-file", type=Path, default=None, help="wait between answers while this file exists")
    p.add_argument("--report", action="store_true", help="print the tables of the run in --out again, and stop")
    return p


def _main() -> int:
    args = build_parser().parse_args()
    if args.report:  # the tables again, from a run's records
        records = json.loads((args.out / "records.json").read_text())
        names = list(records)
        categories = list(dict.fromkeys(r["category"] for r in records[names[0]]))
        print(report(records, names, categories))
        return 0
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
