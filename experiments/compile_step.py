"""What a decode step spends outside matrix products, and what mx.compile takes off it (issue 25).

Three greedy decoding loops on the embedded model, timed side by side over the same prompts (rounds, medians):

- ``eager``: the plain decoding loop (decoding/generate.py: mlx-lm's growing KV cache, the graph built anew each
  step while the previous step computes);
- ``static``: the same loop over a preallocated cache written at an array offset (``generate.SlotKV``), not compiled:
  what the preallocation alone costs (attention over the whole capacity, masked);
- ``compiled``: that step as one ``mx.compile``d function: one trace serves every position up to the capacity.

Every loop's tokens must equal the eager loop's. Also timed: one 8-token forward (a verification), eager and
compiled. Writes a markdown table (``--out``).

    python -m experiments.compile_step --tokens 48 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import m2r2_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx.core on Linux)
from m2r2_mlx.atomic import atomic_write_text
from m2r2_mlx.decoding.compiled import SlotKV
from m2r2_mlx.decoding.prompt_cache import PromptCache
from m2r2_mlx.models.base_model import BaseParts
from m2r2_mlx.models.blas import blas_info
from m2r2_mlx.models.registry import load_model

import mlx.core as mx
from tqdm.auto import tqdm

PROMPTS = [
    "Give me three tips for learning to cook.",
    "Explain how a bicycle stays upright.",
    "Write a short poem about the sea.",
    "What is the difference between a list and a tuple in Python?",
]


def static_step(parts: BaseParts, capacity: int, n: int):
    """step(tokens (n,), offset, keys, values) -> (logits (n, vocab), keys, values)."""

    def step(tokens, offset, keys, values):
        caches = [SlotKV(k, v, offset) for k, v in zip(keys, values)]
        h = parts.embed(tokens[None])
        mask = mx.arange(capacity)[None, :] <= (offset + mx.arange(n))[:, None]
        h = parts.run_layers(h, 0, parts.num_layers, mask, caches)
        return parts.head(h)[0], [c.keys for c in caches], [c.values for c in caches]

    return step


def to_static(cache: PromptCache, capacity: int) -> tuple[list, list]:
    keys, values = [], []
    for layer in cache.layers:
        t = layer.offset
        k = mx.zeros((*layer.keys.shape[:2], capacity, layer.keys.shape[3]), layer.keys.dtype)
        v = mx.zeros((*layer.values.shape[:2], capacity, layer.values.shape[3]), layer.values.dtype)
        k[..., :t, :] = layer.keys[..., :t, :]
        v[..., :t, :] = layer.values[..., :t, :]
        keys.append(k)
        values.append(v)
    mx.eval(keys, values)
    return keys, values


def eager_loop(model, prompt: list[int], n: int) -> tuple[list[int], float]:
    cache = PromptCache(model)
    y = mx.argmax(cache.forward(prompt)[-1])
    mx.eval(y)
    out, tic = [], time.perf_counter()
    for _ in range(n):
        nxt = mx.argmax(cache.forward(y[None])[-1])
        mx.async_eval(nxt)
        out.append(y.item())
        y = nxt
    return out, time.perf_counter() - tic


def static_loop(model, step, capacity: int, prompt: list[int], n: int) -> tuple[list[int], float]:
    cache = PromptCache(model)
    y = mx.argmax(cache.forward(prompt)[-1])
    keys, values = to_static(cache, capacity)
    offset = mx.array(len(prompt), dtype=mx.int32)
    mx.eval(y, offset)
    out, tic = [], time.perf_counter()
    for _ in range(n):
        logits, keys, values = step(y[None], offset, keys, values)
        offset = offset + 1
        nxt = mx.argmax(logits[-1])
        mx.async_eval(nxt, keys, values, offset)
        out.append(y.item())
        y = nxt
    return out, time.perf_counter() - tic


def verify_times(model, parts, capacity: int, prompt: list[int], rounds: int) -> dict[str, float]:
    """Seconds of one 8-token forward at the end of the prompt: eager and compiled (medians)."""
    cache = PromptCache(model)
    mx.eval(cache.forward(prompt))
    keys, values = to_static(cache, capacity)
    compiled = mx.compile(static_step(parts, capacity, 8))
    offset = mx.array(len(prompt), dtype=mx.int32)
    tokens = mx.array([42] * 8)
    times = {"eager": [], "compiled": []}
    for _ in range(rounds):
        tic = time.perf_counter()
        mx.eval(cache.forward(tokens))
        times["eager"].append(time.perf_counter() - tic)
        cache.trim(8)
        tic = time.perf_counter()
        mx.eval(compiled(tokens, offset, keys, values))
        times["compiled"].append(time.perf_counter() - tic)
    return {k: statistics.median(v[2:]) for k, v in times.items()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.compile_step", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=64, help="tokens decoded per prompt and loop")
    p.add_argument("--rounds", type=int, default=3, help="rounds over the prompts")
    p.add_argument("--out", type=Path, default=Path("m2r2-bench-results/compile_step.md"))
    return p


def main() -> int:
    args = build_parser().parse_args()

    lm = load_model()
    parts = BaseParts(lm.model)
    prompts = [
        lm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in PROMPTS
    ]
    capacity = 256 * ((max(map(len, prompts)) + args.tokens + 255) // 256)
    step = static_step(parts, capacity, 1)
    loops = {
        "eager": lambda q: eager_loop(lm.model, q, args.tokens),
        "static": lambda q: static_loop(lm.model, step, capacity, q, args.tokens),
    }
    compiled = mx.compile(step)
    loops["compiled"] = lambda q: static_loop(lm.model, compiled, capacity, q, args.tokens)
    for loop in loops.values():  # warm-up: traces, the C++ kernels compile builds, allocator pools
        loop(prompts[0])
    per_token = {name: [] for name in loops}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for q in prompts:
            ref = None
            for name, loop in loops.items():
                tokens, seconds = loop(q)
                ref = tokens if ref is None else ref
                if tokens != ref:
                    print(f"{name}: tokens differ from the eager loop's", file=sys.stderr)
                    return 1
                per_token[name].append(seconds / args.tokens)
    eager = statistics.median(per_token["eager"])
    verify = verify_times(lm.model, parts, capacity, prompts[0], 21)
    lines = [
        "# A decode step's overhead, and mx.compile",
        "",
        f"`python -m experiments.compile_step --tokens {args.tokens} --rounds {args.rounds}`; {lm.name}, greedy, "
        f"{len(prompts)} prompts x {args.rounds} rounds, cache capacity {capacity}; {blas_info().describe()}. "
        "Medians of per-token time; every loop's tokens equal the eager loop's.",
        "",
        "| loop | ms per token | vs eager |",
        "|---|---|---|",
        *(
            f"| {name} | {1e3 * statistics.median(t):.1f} | {eager / statistics.median(t):.2f}x |"
            for name, t in per_token.items()
        ),
        "",
        "| one 8-token forward (verification) | ms |",
        "|---|---|",
        *(f"| {name} | {1e3 * t:.1f} |" for name, t in verify.items()),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    atomic_write_text(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
