"""Each method decoded on the real model with its steps priced on a device's cost table (experiments/cost_tables.py):
the speculative engine's planner learns from that device's costs, so its choices, and every method's modelled speed,
are the device's. One engine per method for the whole run, as a chat keeps one.

    python -m experiments.planner_costs --questions bench/data/heldout.jsonl --out build/planner_costs
    python -m experiments.planner_costs --questions bench/data/heldout.jsonl --tables h200 --methods plain,always

Methods: plain, lookup, fast, speculative (the engine), and ``always`` (lookup and the fast stream, every proposal
verified: a planner that always drafts). Greedy; every lossless method's answers equal plain's, checked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import m2r2_mlx  # noqa: F401  (first: preloads OpenBLAS)
from m2r2_mlx.decoding.chat import ChatSession
from m2r2_mlx.decoding.config import DecodeConfig, GenerationConfig
from m2r2_mlx.decoding.drafters import ForcedDrafter
from m2r2_mlx.decoding.methods import DRAFTERS, METHODS, PLANNERS, make_decoder, speculative_engine
from m2r2_mlx.decoding.prompt_cache import PromptCache
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.models.registry import load_model

from tqdm.auto import tqdm

from experiments import write_results
from experiments.cost_tables import TABLES, CostTable, ModelledClock, priced
from m2r2_bench.questions import ORDERS, ordered, select_questions

NAMES = ("plain", "lookup", "fast", "speculative", "always")


def build(lm, name: str, clock: ModelledClock):
    """The method ``name`` with every step priced by ``clock`` (its tracer and, for the engine, its clock)."""
    if name != "always":  # the planner's timings come from the clock (the tracer's now)
        return make_decoder(lm, DecodeConfig(name), tracer=clock)
    method = METHODS["speculative"]
    drafters = [DRAFTERS[n](lm, DecodeConfig(), None, method.threshold) for n in ("lookup", "fast")]
    planner = PLANNERS["verify-all"](lm, [ForcedDrafter(), *drafters])
    return speculative_engine(lm, drafters, planner, max_draft=METHODS["lookup"].max_draft, name="always", tracer=clock)


ADAPTIVE = ("speculative",)  # methods whose choices depend on the costs: run once per table


def decode(lm, questions: list[dict], name: str, table: CostTable, max_tokens: int) -> list[dict]:
    """One engine for the whole run; per turn: the category, the tokens and the work priced (ModelledClock.log)."""
    clock = ModelledClock(table)
    decoder, out = build(lm, name, clock), []
    for q in tqdm(questions, desc=f"{name} on {table.name} costs", unit="question", leave=False):
        session = ChatSession(lm, decoder=decoder)
        session.cache = PromptCache(lm.model, tracer=clock)  # its forwards priced too
        for text in q["turns"]:
            clock.start_answer()
            tokens = [e.token for e in session.send(text, GenerationConfig(max_tokens))]
            out.append({"category": q["category"], "tokens": tokens, "log": clock.log})
    return out


def run(lm, questions: list[dict], names: list[str], tables: list[CostTable], max_tokens: int) -> dict:
    """Per table and method: modelled decode seconds and tokens, overall and by category, and whether every answer
    equals plain's. Methods whose choices do not depend on the costs run once and are priced on every table."""
    fixed = {n: decode(lm, questions, n, tables[0], max_tokens) for n in names if n not in ADAPTIVE}
    results = {}
    for table in tables:
        runs = {**fixed, **{n: decode(lm, questions, n, table, max_tokens) for n in names if n in ADAPTIVE}}
        result = {}
        for name in names:
            r = {"seconds": 0.0, "tokens": 0, "by": {}, "same": True}
            for turn, ref in zip(runs[name], runs[names[0]]):
                seconds, tokens = priced(turn["log"], table), len(turn["tokens"]) - 1
                by = r["by"].setdefault(turn["category"], [0.0, 0])
                r["seconds"], r["tokens"], by[0], by[1] = (
                    r["seconds"] + seconds,
                    r["tokens"] + tokens,
                    by[0] + seconds,
                    by[1] + tokens,
                )
                r["same"] &= turn["tokens"] == ref["tokens"]
            result[name] = r
        results[table.name] = result
    return results


def speedups(result: dict, category: str | None = None) -> dict[str, float]:
    """Each method's modelled speed over plain's (overall, or in ``category``)."""

    def rate(r):
        seconds, tokens = (r["seconds"], r["tokens"]) if category is None else r["by"][category]
        return tokens / seconds

    return {name: rate(r) / rate(result["plain"]) for name, r in result.items()}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments.planner_costs", description=__doc__.split("\n")[0])
    ap.add_argument("--questions", type=Path, default=Path("bench/data/heldout.jsonl"))
    ap.add_argument("--categories", default="all")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--order", choices=ORDERS, default="given")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--tables", default=",".join(TABLES))
    ap.add_argument("--methods", default=",".join(NAMES))
    ap.add_argument("--out", type=Path, default=None, help="results.md here")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    names = args.methods.split(",")
    if names[0] != "plain" or any(n not in NAMES for n in names):
        raise M2R2Error(f"--methods: plain first, then any of {', '.join(NAMES)}")
    lm = load_model()
    questions = ordered(select_questions(args.questions, args.categories, args.limit), args.order)
    lines = [f"`python -m experiments.planner_costs {' '.join(sys.argv[1:])}`", ""]
    tables = [TABLES[t] for t in args.tables.split(",")]
    results = run(lm, questions, names, tables, args.max_tokens)
    for table in tables:
        result = results[table.name]
        cats = sorted(result["plain"]["by"])
        lines += [f"## {table.name}: modelled speed over plain", "", f"Costs: {table.source}.", ""]
        lines += ["| | " + " | ".join(names[1:]) + " |", "|---" * len(names) + "|"]
        for cat in [None, *cats]:
            s = speedups(result, cat)
            lines.append(f"| {cat or 'overall'} | " + " | ".join(f"{s[n]:.3f}x" for n in names[1:]) + " |")
        same = [n for n in names if result[n]["same"]]
        lines += ["", f"Answers equal to plain's: {', '.join(same)}.", ""]
        print("\n".join(lines[-len(cats) - 8 :]), file=sys.stderr)
    text = "\n".join(lines) + "\n"
    write_results(text, args.out)


if __name__ == "__main__":
    sys.exit(run_cli("planner_costs", main))
