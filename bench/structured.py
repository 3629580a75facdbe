"""m2r2-bench --structured: JSON extraction under a schema, every method against plain constrained decoding.

Each prompt (bench/data/extraction.jsonl: a pasted passage, fields to fill, a JSON schema) is answered by each
method under the schema's grammar, one long-lived decoder per method for the run (as a server keeps one), the
methods taking turns per prompt so that a busy machine slows them alike. Reported per category and overall:
decode tokens/s and the speedup over plain constrained decoding, over all answers and over the answers every
method finished (an answer cut at max_tokens inside a loop is cheap to draft and lifts the first figure), tokens
per full-model step, the answers that validate against their schema (jsonschema), those cut at max_tokens, and
whether lossless methods gave plain's tokens. The grammar's loop guard is on unless --no-loop-guard.

    m2r2-bench --structured                                  # plain, lookup, speculative, early-exit
    m2r2-bench --structured --order reverse --out build/structured-reverse
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import m2r2_mlx  # noqa: F401  (first: preloads OpenBLAS on Linux before mlx.core)
from m2r2_mlx.atomic import atomic_write_text
from m2r2_mlx.decoding.config import DecodeConfig, GenerationConfig
from m2r2_mlx.decoding.drafters import ForcedDrafter
from m2r2_mlx.decoding.grammar import json_schema_grammar
from m2r2_mlx.decoding.methods import METHODS as USER_METHODS
from m2r2_mlx.decoding.methods import make_decoder, speculative_engine
from m2r2_mlx.decoding.planner import VerifyAll
from m2r2_mlx.decoding.prompt_cache import PromptCache
from m2r2_mlx.decoding.sampling import Sampling
from m2r2_mlx.decoding.stats import AnswerStats
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.models.blas import blas_info
from m2r2_mlx.models.registry import load_model

import jsonschema
from tqdm.auto import tqdm

from .cli import method_list
from .methods import layerskip
from .questions import ORDERS, ordered

PROMPTS = Path(__file__).resolve().parent / "data" / "extraction.jsonl"
STRUCTURED_METHODS = {  # name -> decoder config; "plain" first: every speedup is over it
    "plain": DecodeConfig("plain"),
    "lookup": DecodeConfig("lookup"),
    "speculative": DecodeConfig("speculative"),
    "early-exit": DecodeConfig("early-exit"),
    "layerskip": DecodeConfig("plain"),  # bench.methods.layerskip
    "forced": None,  # the grammar's forced text alone, every proposal verified: what the forced drafter gives
}
DEFAULT_METHODS = "plain,lookup,speculative,early-exit"
LOSSLESS = ("plain", "lookup", "speculative", "layerskip", "forced")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="m2r2-bench --structured", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="base model (default: the embedded smollm2)")
    p.add_argument("--adapters", default=None, help="M2R2 adapters (default: the packaged ones)")
    p.add_argument("--prompts", type=Path, default=PROMPTS, help=f"extraction prompts (default: {PROMPTS.name})")
    p.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        type=method_list(STRUCTURED_METHODS),
        help=f"comma-separated, of: {', '.join(STRUCTURED_METHODS)} (default: {DEFAULT_METHODS})",
    )
    p.add_argument("--order", choices=ORDERS, default="given", help="the order prompts are asked in")
    p.add_argument("--seed", type=int, default=0, help="the shuffled order's seed")
    p.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="mlx-lm's repetition penalty over the last 20 tokens (1: off; 1.1 keeps a small model out of loops)",
    )
    p.add_argument(
        "--no-loop-guard",
        dest="loop_guard",
        action="store_false",
        help="let answers repeat array items and string pieces without limit (the grammar's loop guard off)",
    )
    p.add_argument("--out", type=Path, default=Path("build/structured"), help="results.md and answers.jsonl here")
    return p


def make_method(lm, name: str, adapters: str | None):
    if name == "forced":
        forced = ForcedDrafter()
        limit = USER_METHODS["speculative"].max_draft
        return speculative_engine(lm, [], VerifyAll([forced]), max_draft=limit, name="forced")
    if name == "layerskip":
        return layerskip(lm, STRUCTURED_METHODS[name], adapters)
    return make_decoder(lm, STRUCTURED_METHODS[name], adapters)


def read_prompts(path: Path, loop_guard: bool = True) -> list[dict]:
    if not path.is_file():
        raise M2R2Error(f"{path} not found; pass --prompts FILE (JSON lines with prompt and schema)")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                p = json.loads(line)
                prompts.append({**p, "grammar": json_schema_grammar(p["schema"], loop_guard)})
            except (ValueError, KeyError, M2R2Error) as e:
                raise M2R2Error(f"{path}:{n}: not an extraction prompt ({e}); each line needs prompt and schema")
    return prompts


def answer(lm, decode, prompt: dict, max_tokens: int, sampling: Sampling = Sampling()) -> dict:
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt["prompt"]}], add_generation_prompt=True)
    stats, tokens, times = AnswerStats(), [], []
    for ev in decode(ids, PromptCache(lm.model), GenerationConfig(max_tokens, sampling, grammar=prompt["grammar"])):
        times.append(time.perf_counter())
        tokens.append(ev.token)
        stats.add(ev)
    text = lm.tokenizer.decode([t for t in tokens if t not in lm.tokenizer.eos_token_ids])
    try:
        jsonschema.validate(json.loads(text), prompt["schema"])
        valid = True
    except (ValueError, jsonschema.ValidationError):
        valid = False
    return {
        "id": prompt["id"],
        "category": prompt.get("category", "all"),
        "tokens": tokens,
        "text": text,
        "valid": valid,
        "decode_time": times[-1] - times[0] if len(times) > 1 else 0.0,
        "tokens_per_step": stats.accepted_per_step,
        "cut": stats.finish_reason == "length",  # stopped at max_tokens, the JSON unfinished
    }


def summarise(records: dict[str, list[dict]], names: list[str]) -> str:
    """The table: per category and overall, each method's tokens/s and speedup over plain, over all answers and
    over those every method finished, tokens per step, valid answers, the answers cut at max_tokens, and
    (lossless methods) answers identical to plain's."""
    groups = sorted({r["category"] for r in records["plain"]}) + ["overall"]
    finished = {i for i in range(len(records["plain"])) if not any(records[n][i]["cut"] for n in names)}
    lines = [
        "| set | method | tokens/s | vs plain | finished: tokens/s | vs plain | tokens/step | valid | cut | "
        "same as plain |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for group in groups:
        keep = [i for i, r in enumerate(records["plain"]) if group in ("overall", r["category"])]
        done = [i for i in keep if i in finished]

        def rate(name: str, which: list[int]) -> float:
            rs = [records[name][i] for i in which]
            return sum(len(r["tokens"]) - 1 for r in rs) / max(sum(r["decode_time"] for r in rs), 1e-9)

        for name in names:
            rs = [records[name][i] for i in keep]
            same = (
                f"{sum(r['tokens'] == records['plain'][i]['tokens'] for r, i in zip(rs, keep))}/{len(rs)}"
                if name in LOSSLESS
                else "-"
            )
            over_done = (
                f"{rate(name, done):.1f} ({len(done)}) | {rate(name, done) / rate('plain', done):.2f}x"
                if done
                else "- | -"
            )
            lines.append(
                f"| {group} | {name} | {rate(name, keep):.1f} | {rate(name, keep) / rate('plain', keep):.2f}x | "
                f"{over_done} | {statistics.mean(r['tokens_per_step'] for r in rs):.2f} | "
                f"{sum(r['valid'] for r in rs)}/{len(rs)} | {sum(r['cut'] for r in rs)} | {same} |"
            )
    return "\n".join(lines)


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    names = names if "plain" in names else ["plain", *names]
    prompts = ordered(read_prompts(args.prompts, args.loop_guard), args.order, args.seed)[: args.limit]
    lm = load_model(args.model)
    decoders = {name: make_method(lm, name, args.adapters) for name in names}
    answer(lm, decoders["plain"], prompts[0], 8)  # first-time shapes are slow: not in any method's figures
    records: dict[str, list[dict]] = {name: [] for name in names}
    sampling = Sampling(repetition_penalty=args.repetition_penalty)
    for prompt in tqdm(prompts, desc="structured", unit="prompt"):
        for name in names:
            records[name].append(answer(lm, decoders[name], prompt, args.max_tokens, sampling))
    md = summarise(records, names)
    args.out.mkdir(parents=True, exist_ok=True)
    cmd = " ".join(["m2r2-bench", "--structured", *(argv if argv is not None else sys.argv[1:])])
    atomic_write_text(
        args.out / "results.md",
        f"# Structured output on {lm.name}\n\n`{cmd}`; {len(prompts)} prompts ({args.order} order), greedy "
        f"(repetition penalty {args.repetition_penalty}), {args.max_tokens} tokens at most, loop guard "
        f"{'on' if args.loop_guard else 'off'}, "
        f"one decoder per method for the run, {blas_info().name} BLAS; decode tokens/s (prefill excluded), "
        f'speedup over plain constrained decoding in the same run; "finished": over the answers no method cut at '
        f"max tokens (their number in brackets).\n\n{md}\n",
    )
    answers = [{"method": n, **{k: v for k, v in r.items() if k != "tokens"}} for n in names for r in records[n]]
    atomic_write_text(args.out / "answers.jsonl", "".join(json.dumps(a) + "\n" for a in answers))
    print(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("m2r2-bench --structured", lambda: _main(argv))
