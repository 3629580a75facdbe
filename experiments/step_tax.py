"""What a speculative step costs beside the lookup method's step of the same shape, in one run.

    python -m experiments.step_tax --questions bench/data/heldout.jsonl --out build/step_tax

The speculative engine and the lookup method decode the same questions, alternating answer by answer; each step's
seconds are recorded with its shape (a plain step, or a verification of n positions that drafted only lookup's copy,
or one the fast stream drafted in) through the engines' tracer hooks. A step that drafts only lookup's copy should
cost what lookup's step of the same width costs: no hidden states kept, no fast-stream work, no extra host reads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import m2r2_mlx  # noqa: F401  (first: preloads OpenBLAS)
from m2r2_mlx.decoding.chat import ChatSession
from m2r2_mlx.decoding.config import GenerationConfig
from m2r2_mlx.decoding.methods import make_decoder
from m2r2_mlx.errors import run_cli
from m2r2_mlx.models.registry import load_model
from m2r2_mlx.tracing import Tracer

from tqdm.auto import tqdm

from experiments import write_results
from m2r2_bench.questions import ORDERS, ordered, select_questions


class StepLog(Tracer):
    """Each timed step's shape and seconds (drafting included)."""

    def __init__(self):
        self.steps: dict[str, list[float]] = defaultdict(list)

    def on_verify(self, outcome) -> None:
        if outcome.seconds is None:
            return
        if outcome.plain:
            shape = "plain step"
        else:
            kinds = set(outcome.draft.sources[1:])
            shape = f"verify {len(outcome.draft)}" + (" with fast drafts" if "fast" in kinds else "")
        self.steps[shape].append(outcome.seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", type=Path, default=Path("bench/data/heldout.jsonl"))
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--order", choices=ORDERS, default="given")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    lm = load_model()
    logs = {name: StepLog() for name in ("lookup", "speculative")}
    decoders = {name: make_decoder(lm, name, tracer=log) for name, log in logs.items()}
    questions = ordered(select_questions(args.questions, "all", args.limit), args.order)
    for q in tqdm(questions, desc="step tax", unit="question"):
        for name, decoder in decoders.items():
            session = ChatSession(lm, decoder=decoder)
            for text in q["turns"]:
                for _ in session.send(text, GenerationConfig(args.max_tokens)):
                    pass
    shapes = sorted(set(logs["lookup"].steps) | set(logs["speculative"].steps), key=lambda s: (len(s), s))
    lines = [
        f"`python -m experiments.step_tax {' '.join(sys.argv[1:])}`: median seconds per step, by shape, in one run.",
        "",
        "| step | lookup: steps, ms | speculative: steps, ms | speculative / lookup |",
        "|---|---|---|---|",
    ]
    for shape in shapes:
        cells, medians = [], {}
        for name in ("lookup", "speculative"):
            times = logs[name].steps.get(shape, [])
            medians[name] = statistics.median(times) if times else None
            cells.append(f"{len(times)}, {1e3 * medians[name]:.1f}" if times else "-")
        ratio = medians["speculative"] / medians["lookup"] if all(medians.values()) else None
        lines.append(f"| {shape} | {cells[0]} | {cells[1]} | {f'{ratio:.3f}' if ratio else '-'} |")
    text = "\n".join(lines) + "\n"
    write_results(text, args.out)


if __name__ == "__main__":
    sys.exit(run_cli("step_tax", main))
