"""A long-lived speculative engine across a session, beside a fresh engine per answer (docs/speculative.md cites it).

    python -m experiments.planner_session                      # novel answers, then answers that copy their prompt
    python -m experiments.planner_session --load-seconds 45    # with two busy loops during the first 45 s

One engine decodes the whole list, as a chat or a server keeps one; then each answer again with a fresh engine
(and plainly, for the speedup and to check every token). ``--load-seconds``: two busy processes compete for the
CPU from the start for that long, the transient slowdown a laptop sees (other apps, indexing, throttling). Per
answer: tokens per full-model step, decode speed over plain, the first token that came from an accepted draft.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

from m2r2_mlx.atomic import atomic_write_text
from m2r2_mlx.decoding.chat import ChatSession
from m2r2_mlx.decoding.config import GenerationConfig
from m2r2_mlx.decoding.methods import make_decoder
from m2r2_mlx.decoding.stats import AnswerStats
from m2r2_mlx.models.blas import blas_info
from m2r2_mlx.models.registry import load_model

from tqdm.auto import tqdm

PASSAGES = [
    "The committee met on Tuesday to review the budget. It approved the new library wing, postponed the road "
    "repairs until spring, and asked the treasurer for a report on the pension fund by the end of the month.",
    "To reset the router, hold the small button on the back for ten seconds until the lights blink twice. Wait "
    "two minutes, then connect to the network named HOME-5G with the password printed on the label.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in the chloroplasts "
    "of plant cells, where chlorophyll absorbs mostly blue and red light and reflects green.",
    "Our opening hours are Monday to Friday from nine to six, Saturday from ten to four, and closed on Sunday. "
    "Orders placed after three in the afternoon ship the next working day.",
]
NOVEL = [
    "Write a short story about a lighthouse keeper who finds a map.",
    "Invent a recipe for a soup made only from winter vegetables.",
    "Describe a city on Mars a hundred years from now.",
    "Write a letter from a cat to its owner about breakfast.",
    "Explain why the sky looks blue, as a pirate would.",
    "Give advice to a student starting their first job.",
    "Write a poem about a train crossing the desert at night.",
    "Describe an imaginary sport played on ice with three teams.",
]


def copying(passage: str) -> str:
    return f"Repeat the following text exactly, word for word:\n\n{passage}"


def busy(seconds: float) -> None:
    end = time.time() + seconds
    x = 0
    while time.time() < end:
        x += 1


def answer(lm, decode, prompt: str, generation: GenerationConfig) -> dict:
    stats, tokens, first = AnswerStats(), [], None
    for ev in ChatSession(lm, decoder=decode).send(prompt, generation):
        stats.add(ev)
        tokens.append(ev.token)
        first = ev.index if first is None and ev.drafted else first
    return {"tokens": tokens, "per_step": stats.accepted_per_step, "tok_s": stats.tokens_per_s, "first_draft": first}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.planner_session", description=__doc__.split("\n")[0])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--load-seconds", type=float, default=0.0, help="two busy processes for this long at the start")
    p.add_argument("--out", type=Path, default=Path("build/planner_session.md"))
    return p


def main() -> int:
    args = build_parser().parse_args()
    lm = load_model()
    generation = GenerationConfig(args.max_tokens)
    prompts = [("novel", p) for p in NOVEL] + [("copy", copying(p)) for p in PASSAGES]
    plain = make_decoder(lm, "plain")
    answer(lm, plain, "Say hello.", GenerationConfig(8))  # warm-up
    loads = [multiprocessing.Process(target=busy, args=(args.load_seconds,)) for _ in range(2)]
    for proc in loads if args.load_seconds else []:
        proc.start()
    session = make_decoder(lm, "speculative")  # one engine for the whole list
    long_lived = [answer(lm, session, p, generation) for _, p in tqdm(prompts, desc="one engine")]
    for proc in loads if args.load_seconds else []:
        proc.join()
    fresh, plains = [], []
    for _, p in tqdm(prompts, desc="fresh engines, plain"):
        fresh.append(answer(lm, make_decoder(lm, "speculative"), p, generation))
        plains.append(answer(lm, plain, p, generation))
    lines = [
        "| # | prompt | long-lived tokens/step | fresh tokens/step | long-lived / plain | fresh / plain "
        "| first drafted token (long-lived, fresh) | same as plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, ((kind, _), a, f, p) in enumerate(zip(prompts, long_lived, fresh, plains)):
        same = a["tokens"] == p["tokens"] == f["tokens"]
        lines.append(
            f"| {i + 1} | {kind} | {a['per_step']:.2f} | {f['per_step']:.2f} | {a['tok_s'] / p['tok_s']:.2f}x | "
            f"{f['tok_s'] / p['tok_s']:.2f}x | {a['first_draft']}, {f['first_draft']} | {same} |"
        )
    copies = [i for i, (kind, _) in enumerate(prompts) if kind == "copy"]
    ratio = statistics.mean(long_lived[i]["per_step"] / fresh[i]["per_step"] for i in copies)
    load = f"two busy processes for the first {args.load_seconds:g} s" if args.load_seconds else "no added load"
    text = (
        f"# A long-lived speculative engine beside fresh ones\n\n`python -m experiments.planner_session "
        f"{' '.join(sys.argv[1:])}`; {lm.name}, greedy, {args.max_tokens} tokens, {load}; "
        f"{blas_info().describe()}.\n\nOn the copying answers the long-lived engine reaches {100 * ratio:.0f}% of "
        f"fresh engines' tokens per step.\n\n" + "\n".join(lines) + "\n"
    )
    atomic_write_text(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
