"""Replay prompt lookup's proposals on recorded greedy answers, under a device's costs, with the engine's own
planner: what each lookup policy costs and gains, without running the model.

Greedy decoding is deterministic, so where each lookup proposal would be accepted is known from plain decoding's
answers alone: a proposal of k tokens at position t is accepted as far as it matches the answer after t. The
replay walks each answer as the engine would (propose, plan, verify or decode plainly, observe), prices each step
on a cost table (experiments/cost_tables.py) and feeds the planner the modelled seconds. Policies: ``plain``,
``lookup`` (every proposal verified, up to 3 tokens: the lookup method), ``engine`` (the speculative method's
planner with prompt lookup alone).

    python -m experiments.lookup_replay --questions bench/data/question.jsonl --limit 2 --record build/replay/sb
    python -m experiments.lookup_replay --questions bench/data/heldout.jsonl --record build/replay/ho

The answers are recorded once per question set (plain decoding, chats of every turn) into --record.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import m2r2_mlx  # noqa: F401  (first: preloads OpenBLAS)
from m2r2_mlx.atomic import atomic_write_text
from m2r2_mlx.decoding.chat import ChatSession
from m2r2_mlx.decoding.config import GenerationConfig
from m2r2_mlx.decoding.draft import Draft
from m2r2_mlx.decoding.drafters import ForcedDrafter, PromptLookupDrafter
from m2r2_mlx.decoding.methods import METHODS, PLANNERS, cost_planner
from m2r2_mlx.decoding.planner import CostPlanner
from m2r2_mlx.decoding.protocols import DraftRequest, Outcome
from m2r2_mlx.decoding.sampling import Sampling
from m2r2_mlx.errors import run_cli
from m2r2_mlx.models.registry import load_model

from tqdm.auto import tqdm

from experiments.cost_tables import TABLES, CostTable
from m2r2_bench.questions import ORDERS, ordered, select_questions


def record(questions: list[dict], max_tokens: int) -> list[dict]:
    """Each question's turns decoded plainly as a chat: per turn, the tokens before the answer and the answer."""
    lm = load_model()
    out = []
    for q in tqdm(questions, desc="plain answers", unit="question"):
        session, turns = ChatSession(lm), []
        for text in q["turns"]:
            session.messages.append({"role": "user", "content": text})
            prompt = session.prompt_tokens()
            answer = [e.token for e in session.answer(prompt, GenerationConfig(max_tokens))]
            turns.append({"prompt": prompt, "answer": answer})
        out.append({"question_id": q["question_id"], "category": q["category"], "turns": turns})
    return out


@dataclass
class Replay:
    """What one policy's replay of one answer cost: modelled decode seconds, tokens emitted, full-model steps."""

    seconds: float = 0.0
    tokens: int = 0
    steps: int = 0

    def add(self, other: "Replay") -> None:
        self.seconds, self.tokens, self.steps = (
            self.seconds + other.seconds,
            self.tokens + other.tokens,
            self.steps + other.steps,
        )


def accepted(proposal: list[int], future: list[int]) -> int:
    n = 0
    while n < len(proposal) and n < len(future) and proposal[n] == future[n]:
        n += 1
    return n


class FlatKeys(CostPlanner):
    """Lookup's rates by position alone (before they read how the copy was found)."""

    @staticmethod
    def keys(kind, position, match=None):
        return CostPlanner.keys(kind, position)


class FixedFloor(CostPlanner):
    """The floor whether or not it pays (before it was gated)."""

    def floor(self, draft, copies=None):
        return super().floor(draft, copies=True if copies is None else copies)


class FlatFixed(FlatKeys, FixedFloor):
    """Both: the engine before this change."""


# policy -> (planner kind, lookup floor): the engine's planner and its variants
ENGINES = {
    "engine": (CostPlanner, None),
    "engine-fixed-floor": (FixedFloor, None),
    "engine-no-floor": (CostPlanner, 0),
    "engine-flat": (FlatKeys, None),
    "engine-flat-fixed": (FlatFixed, None),
    "engine-flat-no-floor": (FlatKeys, 0),
}
POLICIES = ("plain", "lookup", *ENGINES)


class Walker:
    """One long-lived policy (a planner that learns across answers, as a chat's engine does)."""

    def __init__(self, policy: str, table: CostTable, eos: set[int]):
        self.policy, self.table, self.eos = policy, table, eos
        self.lookup = PromptLookupDrafter()
        drafters = [ForcedDrafter(), self.lookup]
        if policy in ENGINES:
            kind, floor = ENGINES[policy]
            self.planner = cost_planner(_NoModel(), drafters, kind, lookup_floor=floor)
        else:
            self.planner = PLANNERS["verify-all"](None, drafters)
        self.limit = METHODS["speculative" if policy in ENGINES else "lookup"].max_draft

    def answer(self, prompt: list[int], answer: list[int]) -> Replay:
        """The answer after its first token (the prefill's), step by step."""
        out, t, stretch = Replay(), 1, False  # t: tokens of the answer emitted
        while t < len(answer):
            context = prompt + answer[:t]
            request = DraftRequest(None, context, min(self.limit, len(answer) - t - 1), Sampling(), self.eos)
            draft = Draft.root(context[-1])
            self.lookup.propose(draft, request)
            plan = self.planner.plan(draft, request) if self.policy != "plain" else None
            if plan is None or plan.plain:
                seconds = self.table.forward_s(1)
                self.planner.observe(Outcome(draft, 0, answer[t], None if not stretch else seconds, plain=True))
                stretch = True
                out.add(Replay(seconds, 1, 1))
                t += 1
                continue
            stretch = False
            kept = draft.keep(plan.keep)
            n = accepted(kept.tokens[1:], answer[t:])
            seconds = self.table.forward_s(len(kept))
            token = answer[t + n] if t + n < len(answer) else answer[-1]
            self.planner.observe(Outcome(kept, n, token, seconds))
            out.add(Replay(seconds, n + 1, 1))
            t += n + 1
        return out


class _NoModel:
    """What cost_planner reads of a model: its layer count (lookup alone drafts with no layers)."""

    num_layers = 1


def replay(answers: list[dict], policy: str, table: CostTable, eos: set[int]) -> dict[str, Replay]:
    """Per category (and "all"), one walker over every answer in order."""
    walker, out = Walker(policy, table, eos), {}
    for q in answers:
        for turn in q["turns"]:
            r = walker.answer(turn["prompt"], turn["answer"])
            for key in (q["category"], "all"):
                out.setdefault(key, Replay()).add(r)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments.lookup_replay", description=__doc__.split("\n")[0])
    ap.add_argument("--questions", type=Path, required=True)
    ap.add_argument("--categories", default="all")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--order", choices=ORDERS, default="given")
    ap.add_argument("--record", type=Path, required=True, help="folder for the recorded answers (made once)")
    ap.add_argument("--tables", default=",".join(TABLES))
    return ap


def main() -> None:
    args = build_parser().parse_args()
    path = args.record / "answers.json"
    if not path.is_file():
        questions = select_questions(args.questions, args.categories, args.limit)
        args.record.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(record(questions, args.max_tokens)))
    answers = json.loads(path.read_text())
    answers = ordered(answers, args.order)
    eos = set(load_model().tokenizer.eos_token_ids)
    lines = [f"# Lookup replay: {args.questions.name}, order {args.order}", ""]
    for name in args.tables.split(","):
        table = TABLES[name]
        runs = {p: replay(answers, p, table, eos) for p in POLICIES}
        shown = POLICIES[1:]
        lines += [f"## {name}: speed over plain (tokens per step)", "", "| category | " + " | ".join(shown) + " |"]
        lines.append("|---" * (len(shown) + 1) + "|")
        for c in runs["plain"]:
            plain = runs["plain"][c].tokens / runs["plain"][c].seconds
            cells = [
                f"{runs[p][c].tokens / runs[p][c].seconds / plain:.3f}x ({runs[p][c].tokens / runs[p][c].steps:.2f})"
                for p in shown
            ]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        lines.append("")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(run_cli("lookup_replay", main))
