"""m2r2-bench: the Spec-Bench protocol on this machine, every method side by side in one run.

    m2r2-bench --categories mt_bench --limit 2 --max-tokens 128          # MT-Bench, 2 questions per category
    m2r2-bench --methods plain,speculative,lookup --categories translation,rag   # a subset of methods and categories
    m2r2-bench --draft-model path/to/small-mlx-model                      # adds mlx-lm two-model speculation

Greedy, batch 1, after a warm-up of every method. Each question's turns run as a chat
(the second turn sees the first answer); all methods run on a question before the next
question, so drift on a shared machine hits every method alike. Decode rate = tokens
after the first over the wall time from the first token to the last (prefill excluded,
the same clock for every method). Per category: tokens/s, speedup over plain decoding,
mean tokens per full-model step, the acceptance-length histogram, peak memory, and
whether each lossless method's answer equals plain greedy's. Writes Spec-Bench-style
JSONL per method, a markdown table and a PNG into --out.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import m2r2_mlx  # (first: preloads OpenBLAS before mlx.core on Linux)
from m2r2_mlx.atomic import atomic_write_text
from m2r2_mlx.decoding.config import DRAFT_VOCAB, DecodeConfig, GenerationConfig
from m2r2_mlx.decoding.options import BY_DEST, named
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.models.blas import blas_info
from m2r2_mlx.models.registry import load_model

from tqdm.auto import tqdm

from .cli import method_list
from .methods import BENCH_METHODS, LOSSLESS, MethodSettings, make_method, make_methods, method_names, run_turns
from .questions import CATEGORIES, ORDERS, SPECBENCH, file_categories, ordered, select_questions
from .report import answers_table, plot, summarise, table, write_answers


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="m2r2-bench",
        description=__doc__.split("\n")[0],
        epilog="m2r2-bench --moe [...] runs the MoE expert-cache benchmark instead (see m2r2-bench --moe --help); "
        "m2r2-bench --structured [...] JSON extraction under schemas (m2r2-bench --structured --help)",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {m2r2_mlx.__version__}")
    p.add_argument("--model", default=None, help="base model (default: the embedded smollm2)")
    p.add_argument(
        "--adapters",
        "--adapter-path",
        default=None,
        help="M2R2 adapters: a folder or a Hub repo id (default: the packaged ones)",
    )
    p.add_argument(
        "--questions",
        type=Path,
        default=SPECBENCH,
        help="questions in Spec-Bench's format (default: Spec-Bench's, shipped with m2r2-bench; "
        "bench/data/heldout.jsonl is a second set, never tuned on)",
    )
    p.add_argument(
        "--categories",
        default="all",
        help=f"comma-separated categories, 'mt_bench' (its 8) or 'all' (default); known: {', '.join(CATEGORIES)}",
    )
    p.add_argument("--limit", type=int, default=None, help="questions per category (default: all)")
    p.add_argument("--turns", type=int, default=2, help="most turns per question (default 2: all of Spec-Bench's)")
    p.add_argument(
        "--methods",
        default="plain,mlx-lm,speculative,fast,lookup",
        type=method_list(BENCH_METHODS),
        help=f"comma-separated, from: {', '.join(BENCH_METHODS)} (mlx-lm-spec is added by --draft-model)",
    )
    p.add_argument(
        "-m",
        "--max-tokens",
        type=int,
        default=GenerationConfig.max_tokens,
        help=f"most new tokens per turn (default {GenerationConfig.max_tokens})",
    )
    p.add_argument(
        "--temperature",
        "--temp",
        type=float,
        default=0.0,
        help="sample at this temperature (default 0: greedy, every answer compared with plain's)",
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature)")
    p.add_argument(
        "--seed", type=int, default=0, help="sampling seed, the same for every method's answer to a question"
    )
    p.add_argument("--gate", type=int, default=None, help="draft exit layer for m2r2/layerskip (default: first gate)")
    p.add_argument(
        "--draft",
        "--num-draft-tokens",
        type=int,
        default=None,
        help=BY_DEST["draft"].help_text,
    )
    p.add_argument(
        "--threshold",
        "--draft-p-min",
        type=float,
        default=None,
        help=BY_DEST["threshold"].help_text + "; layerskip takes fast's",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help=f"M2R2 draft head over the N most frequent tokens (default {DRAFT_VOCAB} where available; 0 = full)",
    )
    p.add_argument("--tau", type=float, default=DecodeConfig.tau, help="early-exit: " + BY_DEST["tau"].help_text)
    p.add_argument("--draft-model", default=None, help="a small model for mlx-lm's two-model speculative decoding")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("m2r2-bench-results"),
        help="folder for JSONL, table and plot (default: ./m2r2-bench-results)",
    )
    p.add_argument(
        "--order",
        choices=ORDERS,
        default="given",
        help="the order questions are asked in: given (the file's), reverse, or shuffled with --seed (default: given)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="a new decoder for every question, so nothing an engine learns carries from one answer to the next "
        "(default: one per method for the whole run, as a chat or a server keeps one)",
    )
    return p


@dataclass(frozen=True)
class RunPlan:
    generation: GenerationConfig
    turns: int = 2
    seed: int = 0
    fresh: bool = False  # a new decoder per question: nothing learnt carries from one answer to the next

    @property
    def greedy(self) -> bool:
        return self.generation.sampling.greedy


def run(lm, questions: list[dict], names: list[str], settings: MethodSettings, plan: RunPlan) -> dict:
    """Every question through every method, all methods on a question before the next question (drift on a
    shared machine hits every method alike). Returns each method's records, in the order asked."""
    methods = make_methods(lm, names, settings)
    for decode in methods.values():  # warm-up: compile paths and fill allocator pools for every method
        run_turns(lm, decode, ["Say hello."], GenerationConfig(8))
    records: dict[str, list] = defaultdict(list)
    bar = tqdm(total=len(questions) * len(names), desc="m2r2-bench", unit="answer")
    for q in questions:
        ref = None
        for name in names:
            bar.set_postfix_str(f"q{q['question_id']} {name}")
            decode = make_method(lm, name, settings) if plan.fresh else methods[name]
            # sampled: each method draws its own tokens (losslessness is tested in tests/, not comparable here)
            generation = plan.generation if plan.greedy else replace(plan.generation, seed=plan.seed + q["question_id"])
            turns = run_turns(lm, decode, q["turns"][: plan.turns], generation)
            tokens = [t["tokens"] for t in turns]
            ref = tokens if name == "plain" else ref
            records[name].append(
                {
                    "question_id": q["question_id"],
                    "category": q["category"],
                    "turns": turns,
                    "same_as_plain": tokens == ref if plan.greedy and name in LOSSLESS else None,
                }
            )
            bar.update()
    bar.close()
    return records


def _main() -> int:
    args = build_parser().parse_args()
    if args.turns < 1:
        raise M2R2Error(f"--turns must be at least 1 (got {args.turns})")
    with named():  # the configs check the ranges, and name the flag
        generation = GenerationConfig.create(args.max_tokens, temperature=args.temperature, top_p=args.top_p)
        DecodeConfig(
            gate=args.gate, max_draft=args.draft, threshold=args.threshold, draft_vocab=args.draft_vocab, tau=args.tau
        )
    plan = RunPlan(generation, args.turns, args.seed, args.fresh)
    questions = ordered(select_questions(args.questions, args.categories, args.limit), args.order, args.seed)
    if not questions:
        raise M2R2Error("no questions selected; check --categories and --limit")
    names = method_names(args.methods, args.draft_model)
    settings = MethodSettings(
        args.adapters, args.gate, args.draft, args.threshold, args.draft_vocab, args.draft_model, args.tau
    )
    lm = load_model(args.model)
    order = f"order {args.order}" + (f" (seed {args.seed})" if args.order == "shuffled" else "")
    engines = "a fresh decoder per question" if args.fresh else "one decoder per method for the whole run"
    print(
        f"{lm.name}: {len(questions)} questions ({order}), methods {', '.join(names)}, {engines}; "
        f"{blas_info().describe()}",
        file=sys.stderr,
    )
    records = run(lm, questions, names, settings, plan)

    categories = list(file_categories(questions))
    summary = summarise(records, names, categories)
    args.out.mkdir(parents=True, exist_ok=True)
    write_answers(records, names, lm.name, args.out)
    md = table(summary, names, categories)
    cmd = " ".join(["m2r2-bench", *sys.argv[1:]])
    sampling = "greedy" if plan.greedy else f"sampled (temperature {args.temperature}, top-p {args.top_p})"
    atomic_write_text(
        args.out / "results.md",
        f"# Spec-Bench on {lm.name}\n\n`{cmd}`; {len(questions)} questions ({order}; {engines}), {sampling}, "
        f"batch 1, float32, {blas_info().name} BLAS; decode tokens/s (prefill excluded), speedup over plain "
        f"decoding in the same run.\n\n{md}\n\n![speedup per category](results.png)\n\n"
        f"## Per answer (in the order asked)\n\n{answers_table(records, names)}\n",
    )
    plot(summary, names, categories, args.out / "results.png")
    print(md)
    return 0


# the benchmarks m2r2-bench runs instead of Spec-Bench, each with its own options: the flag, and its module
BENCHMARKS = {
    "--moe": "moe_bench",  # the MoE expert-cache benchmark
    "--tools": "tools_eval",  # tool calls with a known right call
    "--structured": "structured",  # JSON extraction under schemas
}


def _benchmark(argv: list[str]):
    """The benchmark module a flag picks (None: Spec-Bench, this module) and the arguments it reads."""
    for flag, name in BENCHMARKS.items():
        if flag in argv:
            return importlib.import_module(f"m2r2_bench.{name}"), [a for a in argv if a != flag]
    return None, argv


def parser_for(argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser that reads ``argv`` (Spec-Bench's, or the benchmark a flag picks) and the arguments it reads."""
    module, argv = _benchmark(argv)
    return (module.build_parser() if module else build_parser()), argv


def main() -> None:
    module, argv = _benchmark(sys.argv[1:])
    if module is not None:
        sys.exit(module.main(argv))
    sys.exit(run_cli("m2r2-bench", _main))


if __name__ == "__main__":
    main()
