"""m2r2-bench: the Spec-Bench protocol on this machine, every method side by side in one run.

    m2r2-bench --categories mt_bench --limit 2 --max-tokens 128          # MT-Bench, 2 questions per category
    m2r2-bench --methods plain,m2r2,lookup --categories translation,rag   # a subset of methods and categories
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
import json
import math
import statistics
import sys
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import m2r2_mlx  # (first: preloads OpenBLAS before mlx.core on Linux)
from m2r2_mlx.atomic import atomic_save_figure, atomic_write_text
from m2r2_mlx.decoding.chat import ChatSession
from m2r2_mlx.decoding.decoders import COST_DRAFT, DEFAULT_DRAFT, DEFAULT_DRAFT_VOCAB, DEFAULT_THRESHOLD, make_decoder
from m2r2_mlx.decoding.stats import AnswerStats
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.models.blas import blas_info
from m2r2_mlx.models.registry import load_model

import mlx.core as mx
import numpy as np
from tqdm.auto import tqdm

from .peers import mlx_lm_decoder

SPECBENCH = Path(__file__).resolve().parent / "data" / "question.jsonl"  # Spec-Bench's 480 (data/README.md)
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
CATEGORIES = MT_BENCH + ("translation", "summarization", "qa", "math_reasoning", "rag")
METHODS = ("plain", "plain-compiled", "mlx-lm", "m2r2", "m2r2-fast", "layerskip", "lookup", "mlx-lm-spec")
LABELS = {
    "plain": "plain (ours)",
    "plain-compiled": "plain, --compile",
    "mlx-lm": "mlx-lm stream_generate",
    "m2r2": "M2R2 speculative (hybrid, cost)",
    "m2r2-fast": "M2R2 fast stream alone",
    "layerskip": "naive layer-skip",
    "lookup": "prompt lookup",
    "mlx-lm-spec": "mlx-lm 2-model speculative",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="m2r2-bench",
        description=__doc__.split("\n")[0],
        epilog="m2r2-bench --moe [...] runs the MoE expert-cache benchmark instead (see m2r2-bench --moe --help)",
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
        help="Spec-Bench question.jsonl (default: the copy that ships with m2r2-bench)",
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
        default="plain,mlx-lm,m2r2,m2r2-fast,lookup",
        help=f"comma-separated, from: {', '.join(METHODS)} (mlx-lm-spec is added by --draft-model)",
    )
    p.add_argument("-m", "--max-tokens", type=int, default=256, help="most new tokens per turn (default 256)")
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
        help=f"most drafted tokens per step (default: m2r2 {COST_DRAFT}, chosen per step by its cost model; the "
        f"others {DEFAULT_DRAFT})",
    )
    p.add_argument(
        "--threshold",
        "--draft-p-min",
        type=float,
        default=None,
        help=f"m2r2-fast and layerskip: stop drafting below this draft confidence (default {DEFAULT_THRESHOLD})",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help=f"M2R2 draft head over the N most frequent tokens (default {DEFAULT_DRAFT_VOCAB} where available; 0 = "
        "full)",
    )
    p.add_argument("--draft-model", default=None, help="a small model for mlx-lm's two-model speculative decoding")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("m2r2-bench-results"),
        help="folder for JSONL, table and plot (default: ./m2r2-bench-results)",
    )
    return p


def select_questions(path: Path, categories: str, limit: int | None) -> list[dict]:
    if not path.is_file():
        raise M2R2Error(f"Spec-Bench questions not found at {path}; pass --questions path/to/question.jsonl")
    wanted = {"all": CATEGORIES, "mt_bench": MT_BENCH}.get(categories) or tuple(
        c.strip() for c in categories.split(",")
    )
    unknown = [c for c in wanted if c not in CATEGORIES]
    if unknown:
        raise M2R2Error(f"unknown categories {unknown}; choose from {', '.join(CATEGORIES)}, mt_bench or all")
    if limit is not None and limit < 1:
        raise M2R2Error(f"at least 1 question per category is needed (got {limit}); raise --limit or --per-category")
    taken: Counter = Counter()
    out = []
    for line in path.read_text().splitlines():
        q = json.loads(line)
        if q["category"] in wanted and (limit is None or taken[q["category"]] < limit):
            taken[q["category"]] += 1
            out.append(q)
    return out


def method_names(args) -> list[str]:
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.draft_model and "mlx-lm-spec" not in names:
        names.append("mlx-lm-spec")
    bad = [m for m in names if m not in METHODS]
    if bad:
        raise M2R2Error(f"unknown methods {bad}; choose from {', '.join(METHODS)}")
    if "mlx-lm-spec" in names and not args.draft_model:
        raise M2R2Error("mlx-lm-spec needs --draft-model (a small model sharing the tokenizer)")
    return names if "plain" in names else ["plain", *names]  # every speedup is over plain decoding in the same run


def make_methods(args, lm, names: list[str]) -> dict:
    methods = {}
    for name in names:
        if name == "mlx-lm":
            methods[name] = mlx_lm_decoder(lm)
        elif name == "mlx-lm-spec":
            methods[name] = mlx_lm_decoder(lm, load_model(args.draft_model).model, args.draft or DEFAULT_DRAFT)
        elif name == "plain-compiled":
            methods[name] = make_decoder(lm, "plain", compile=True)
        elif name == "m2r2":  # what --mode speculative does by default: hybrid drafting under the cost model
            methods[name] = make_decoder(
                lm, "speculative", args.adapters, gate=args.gate, max_draft=args.draft, draft_vocab=args.draft_vocab
            )
        else:  # every proposal verified: the fast stream alone, naive layer skip, prompt lookup
            mode = {"m2r2-fast": "speculative"}.get(name, name)
            methods[name] = make_decoder(
                lm,
                mode,
                args.adapters,
                drafter="fast",
                policy="always",
                gate=args.gate,
                max_draft=args.draft or DEFAULT_DRAFT,
                threshold=0.0 if mode == "lookup" else DEFAULT_THRESHOLD if args.threshold is None else args.threshold,
                draft_vocab=args.draft_vocab if mode != "lookup" else 0,
            )
    return methods


def run_turns(lm, decode, turns: list[str], max_tokens: int, **sampling) -> list[dict]:
    """One question as a chat; per turn: tokens, text, decode rate, acceptance lengths, peak memory.
    ``sampling``: temperature, top_p, seed (default greedy)."""
    session = ChatSession(lm, decoder=decode)
    out = []
    for text in turns:
        mx.reset_peak_memory()
        stats, times, tokens = AnswerStats(), [], []
        t0 = time.perf_counter()
        for ev in session.send(text, max_tokens=max_tokens, **sampling):
            times.append(time.perf_counter())
            tokens.append(ev.token)
            stats.add(ev)
        decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
        out.append(
            {
                "tokens": tokens,
                "text": session.last_answer,
                "new_tokens": len(tokens),
                "wall_time": time.perf_counter() - t0,
                "decode_time": decode_s,
                "accept_lengths": stats.accept_lengths,
                "drafted_by": dict(stats.drafted_by),
                "exit_layers": stats.exit_layers,
                "peak_memory_gb": mx.get_peak_memory() / 1e9,
            }
        )
    return out


def groups(categories: list[str]) -> list[str]:
    """The table's rows: each category, then MT-Bench's 8 together (where the run has them and more), then all."""
    mt = [c for c in categories if c in MT_BENCH]
    return categories + (["mt_bench"] if mt and len(mt) < len(categories) else []) + ["overall"]


def in_group(group: str, category: str) -> bool:
    return group in ("overall", category) or (group == "mt_bench" and category in MT_BENCH)


def summarise(records: dict, methods: list[str], categories: list[str]) -> dict:
    """Per (category or group, method): decode tokens/s (summed tokens over summed time), speedup, acceptance,
    memory."""
    summary = {}
    for cat in groups(categories):
        for m in methods:
            answers = [r for r in records[m] if in_group(cat, r["category"])]
            turns = [t for r in answers for t in r["turns"]]
            if not turns:
                continue
            toks = sum(max(t["new_tokens"] - 1, 0) for t in turns)
            secs = sum(t["decode_time"] for t in turns)
            acc = [a for t in turns for a in t["accept_lengths"]]
            compared = [r["same_as_plain"] for r in answers if r["same_as_plain"] is not None]
            n = len(answers)
            summary[cat, m] = {
                "tok_s": toks / secs if secs else 0.0,
                "accepted": statistics.mean(acc) if acc else 1.0,
                "hist": Counter(acc),
                "peak_gb": max(t["peak_memory_gb"] for t in turns),
                "same": f"{sum(compared)}/{n}" if compared else "- (sampled)",
                "tokens": toks,
                "drafted_by": sum((Counter(t.get("drafted_by", {})) for t in turns), Counter()),
            }
        plain = summary.get((cat, "plain"), {}).get("tok_s", 0.0)
        for m in methods:
            if (cat, m) in summary:
                summary[cat, m]["speedup"] = summary[cat, m]["tok_s"] / plain if plain else 0.0
    return summary


def histogram_text(hist: Counter) -> str:
    total = sum(hist.values()) or 1
    return " ".join(f"{k}:{100 * v / total:.0f}%" for k, v in sorted(hist.items()))


def drafts_text(by: Counter) -> str:
    return ", ".join(f"{source} {n}" for source, n in by.most_common()) or "-"


def table(summary: dict, methods: list[str], categories: list[str]) -> str:
    lines = [
        "| category | method | tokens/s | speedup | tokens/step | acceptance lengths | drafts accepted | peak GB "
        "| same as plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for cat in groups(categories):
        for m in methods:
            s = summary.get((cat, m))
            if s:
                lines.append(
                    f"| {cat} | {LABELS[m]} | {s['tok_s']:.1f} | {s['speedup']:.2f}x | {s['accepted']:.2f} | "
                    f"{histogram_text(s['hist'])} | {drafts_text(s['drafted_by'])} | {s['peak_gb']:.2f} | {s['same']} |"
                )
    return "\n".join(lines)


def plot(summary: dict, methods: list[str], categories: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = groups(categories)
    colors = {m: f"C{i}" for i, m in enumerate(methods)}  # one colour per method in both panels
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 4.5), gridspec_kw={"width_ratios": [2.2, 1]})
    w = 0.8 / len(methods)
    x = np.arange(len(cats))
    for i, m in enumerate(methods):
        ax.bar(
            x + (i - (len(methods) - 1) / 2) * w,
            [summary.get((c, m), {}).get("speedup", 0) for c in cats],
            w,
            label=LABELS[m],
            color=colors[m],
        )
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(x, cats, rotation=30, ha="right")
    ax.set_ylabel("decode speedup over plain (same run)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    for m in methods:
        hist = summary[("overall", m)]["hist"]
        if m == "plain" or not hist:
            continue
        ks = sorted(hist)
        total = sum(hist.values())
        ax2.plot(ks, [100 * hist[k] / total for k in ks], marker="o", label=LABELS[m], color=colors[m])
    ax2.set_xlabel("tokens per full-model step")
    ax2.set_ylabel("% of steps")
    ax2.set_title("acceptance lengths (all categories)", fontsize=10)
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    atomic_save_figure(fig, out)


def _main() -> int:
    args = build_parser().parse_args()
    if args.max_tokens < 2 or args.turns < 1 or (args.draft is not None and args.draft < 1):
        raise M2R2Error("--max-tokens must be at least 2, --turns and --draft at least 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0) or not 0 < args.top_p <= 1:
        raise M2R2Error(
            f"--temperature must be 0 (greedy) or positive and --top-p in (0, 1] (got {args.temperature}, {args.top_p})"
        )
    greedy = args.temperature == 0
    sampling = {} if greedy else {"temperature": args.temperature, "top_p": args.top_p}
    questions = select_questions(args.questions, args.categories, args.limit)
    if not questions:
        raise M2R2Error("no questions selected; check --categories and --limit")
    names = method_names(args)
    lm = load_model(args.model)
    methods = make_methods(args, lm, names)
    names = list(methods)
    print(
        f"{lm.name}: {len(questions)} questions, methods {', '.join(names)}; {blas_info().describe()}", file=sys.stderr
    )

    for decode in methods.values():  # warm-up: compile paths and fill allocator pools for every method
        run_turns(lm, decode, ["Say hello."], 8)
    records: dict[str, list] = defaultdict(list)
    bar = tqdm(total=len(questions) * len(names), desc="m2r2-bench", unit="answer")
    for q in questions:
        ref = None
        for name, decode in methods.items():
            bar.set_postfix_str(f"q{q['question_id']} {name}")
            # sampled: each method draws its own tokens (losslessness is tested in tests/, not comparable here)
            seed = {} if greedy else {"seed": args.seed + q["question_id"]}
            turns = run_turns(lm, decode, q["turns"][: args.turns], args.max_tokens, **sampling, **seed)
            tokens = [t["tokens"] for t in turns]
            ref = tokens if name == "plain" else ref
            records[name].append(
                {
                    "question_id": q["question_id"],
                    "category": q["category"],
                    "turns": turns,
                    "same_as_plain": tokens == ref if greedy else None,
                }
            )
            bar.update()
    bar.close()

    categories = [c for c in CATEGORIES if any(q["category"] == c for q in questions)]
    summary = summarise(records, names, categories)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:  # Spec-Bench's answer format, one file per method
        lines = [
            json.dumps(
                {
                    "question_id": r["question_id"],
                    "category": r["category"],
                    "answer_id": uuid.uuid4().hex,
                    "model_id": f"{lm.name}-{name}",
                    "tstamp": time.time(),
                    "choices": [
                        {
                            "index": 0,
                            "turns": [t["text"] for t in r["turns"]],
                            "new_tokens": [t["new_tokens"] for t in r["turns"]],
                            "wall_time": [round(t["wall_time"], 4) for t in r["turns"]],
                            "decode_time": [round(t["decode_time"], 4) for t in r["turns"]],
                            "accept_lengths": [t["accept_lengths"] for t in r["turns"]],
                        }
                    ],
                }
            )
            for r in records[name]
        ]
        atomic_write_text(args.out / f"{name}.jsonl", "\n".join(lines) + "\n")
    md = table(summary, names, categories)
    cmd = " ".join(["m2r2-bench", *sys.argv[1:]])
    atomic_write_text(
        args.out / "results.md",
        f"# Spec-Bench on {lm.name}\n\n`{cmd}`; {len(questions)} questions, "
        f"{'greedy' if greedy else f'sampled (temperature {args.temperature}, top-p {args.top_p})'}, batch 1, "
        f"float32, {blas_info().name} BLAS; decode tokens/s (prefill excluded), "
        f"speedup over plain decoding in the same run.\n\n{md}\n\n![speedup per category](results.png)\n",
    )
    plot(summary, names, categories, args.out / "results.png")
    print(md)
    return 0


def main() -> None:
    if "--moe" in sys.argv[1:]:  # the MoE expert-cache benchmark: its own options (bench/moe_bench.py)
        from m2r2_bench import moe_bench

        return moe_bench.main([a for a in sys.argv[1:] if a != "--moe"])
    sys.exit(run_cli("m2r2-bench", _main))


if __name__ == "__main__":
    main()
