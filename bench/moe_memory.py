"""Peak memory of an MoE served within an expert budget, against the same model loaded whole.

    python -m m2r2_bench.moe_memory                      # the test MoE, budget 25%, 16 decoded tokens
    python -m m2r2_bench.moe_memory --budget 10% --out m2r2-bench-results/moe_memory.md

The test MoE is an OLMoE of random weights (mlx-lm's olmoe, 8 layers x 32 experts of 384 units, top-4; the
embedded model's tokenizer), written once into --work. Each row runs in a fresh process, which samples its anonymous
resident memory (RssAnon in /proc/self/status, every 5 ms: what the process itself holds; file pages mapped from the
weights or the expert store are page cache the kernel can drop, and are left out) from just after its imports to
the end, and reports the peak above that start, with MLX's own peak allocation while decoding (generate resets it
after loading). Rows:
- whole: loaded eagerly, every expert resident (what the model costs without a budget);
- budget, eager load: loaded whole first and offloaded afterwards (how --memory-budget worked before);
- budget, lazy load: what --memory-budget does now: weights read when used, experts straight to the store, read
  back with direct reads (the page cache out of the way) into the loader's buffers.
"Expected" is the dense part plus the budget's share of the experts plus the read buffers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import m2r2_mlx  # noqa: F401  (first: preloads OpenBLAS on Linux before mlx.core)
from m2r2_mlx.atomic import atomic_folder, atomic_write_text
from m2r2_mlx.decoding.config import GenerationConfig
from m2r2_mlx.decoding.generate import generate
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.models.registry import load_model, resolve_model_path
from m2r2_mlx.moe.cache import parse_budget
from m2r2_mlx.moe.serve import serve_with_budget

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import olmoe
from safetensors import safe_open

CONFIG = dict(
    model_type="olmoe",
    hidden_size=384,
    intermediate_size=384,
    num_hidden_layers=8,
    num_attention_heads=6,
    num_key_value_heads=6,
    num_experts=32,
    num_experts_per_tok=4,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    norm_topk_prob=False,
)
EXPLAINED = """- whole: loaded eagerly, every expert resident; budget, eager load: loaded whole, then offloaded (how
  --memory-budget worked before); budget, lazy load: what it does now (weights read when used, each layer's experts
  written to the store and released before the next is read).
- Anonymous memory is what the process itself holds (RssAnon); file pages mapped from the weights are page cache
  the kernel can drop, and experts are read around the page cache (direct reads). Expected = the dense part + the
  budget's share of the experts + the read buffers (one per slot of a layer and one per reader thread); what the
  lazy load holds above it is one layer's experts while exporting, activations and allocator slack.
- MLX's peak is read while decoding only (generate resets it after loading)."""
LOADINGS = ("whole", "eager+budget", "lazy+budget")
LABELS = {"whole": "whole", "eager+budget": "budget, eager load", "lazy+budget": "budget, lazy load"}


class RSSPeak:
    """The process's anonymous resident memory, sampled on a thread; ``peak`` the most seen."""

    def __init__(self, every_s: float = 0.005):
        self.start = self.peak = self.now()
        self.every_s, self.done = every_s, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

    def _run(self) -> None:
        while not self.done.wait(self.every_s):
            self.peak = max(self.peak, self.now())

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, self.now())
        return self.peak - self.start


def make_model(folder: Path) -> Path:
    """The test MoE: random weights (seed 0), the embedded model's tokenizer."""
    if (folder / "config.json").is_file():
        return folder
    smol = resolve_model_path(None)
    config = dict(CONFIG, vocab_size=json.loads((smol / "config.json").read_text())["vocab_size"])
    mx.random.seed(0)
    model = olmoe.Model(olmoe.ModelArgs.from_dict(config))
    with atomic_folder(folder) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())))
        (tmp / "config.json").write_text(json.dumps(config))
        for f in smol.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")) or f.name.endswith(".jinja"):
                shutil.copy(f, tmp / f.name)
    return folder


def sizes(folder: Path) -> dict:
    """Bytes of the experts and of everything else, from the weight file's header (nothing loaded)."""
    experts = dense = 0
    with safe_open(str(folder / "model.safetensors"), "np") as f:
        for name in f.keys():
            t = f.get_slice(name)
            n = 4
            for d in t.get_shape():
                n *= d
            if ".switch_mlp." in name:
                experts += n
            else:
                dense += n
    return {"experts": experts, "dense": dense}


def child(mode: str, folder: str, budget: str, tokens: int) -> dict:
    """One measurement, in this (fresh) process."""
    out, rss = {"mode": mode}, RSSPeak()
    lm = load_model(folder, lazy=mode == "lazy+budget")
    if mode == "whole":
        mx.eval(lm.model.parameters())
    cache = serve_with_budget(lm, budget) if mode.endswith("budget") else None
    prompt = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about the sea."}], add_generation_prompt=True
    )
    out["tokens"] = [ev.token for ev in generate(lm.model, lm.tokenizer, prompt, GenerationConfig(tokens))]
    if cache is not None:
        out["hit_rate"] = cache.stats.hit_rate
        out["buffers"] = cache.loader.buffer_bytes
        out["direct"] = cache.loader.direct
        cache.close()
    out["rss_peak"] = rss.stop()
    out["mlx_peak"] = mx.get_peak_memory()
    return out


def measure(mode: str, folder: Path, budget: str, tokens: int, home: Path) -> dict:
    env = dict(os.environ, M2R2_HOME=str(home))
    shutil.rmtree(home / "experts", ignore_errors=True)  # every budget row exports afresh: the export is measured
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "m2r2_bench.moe_memory",
            "--child",
            mode,
            "--model",
            str(folder),
            "--budget",
            budget,
            "-m",
            str(tokens),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    if r.returncode != 0:
        raise M2R2Error(f"the {mode} run failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def table(rows: list[dict], size: dict, share: float) -> str:
    mb = 1e6
    buffers = max((r.get("buffers", 0) for r in rows), default=0)
    expected = size["dense"] + share * size["experts"] + buffers
    direct = all(r.get("direct", True) for r in rows)
    lines = [
        f"test MoE: dense part {size['dense'] / mb:.0f} MB, experts {size['experts'] / mb:.0f} MB; budget "
        f"{share:.0%} of the experts = {share * size['experts'] / mb:.0f} MB; read buffers {buffers / mb:.1f} MB; "
        f"expected with the budget (dense + budget + buffers) {expected / mb:.0f} MB; experts read "
        f"{'around the page cache (direct reads)' if direct else 'through the page cache (direct reads refused)'}",
        "",
        "| run | peak anonymous memory above the start (MB) | / expected | MLX peak decoding (MB) | / expected | "
        "hit rate | same tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    whole = next((r for r in rows if r["mode"] == "whole"), None)
    for r in rows:
        same = "" if whole is None else ("yes" if r["tokens"] == whole["tokens"] else "NO")
        hit = f"{r['hit_rate']:.0%}" if "hit_rate" in r else ""
        lines.append(
            f"| {LABELS[r['mode']]} | {r['rss_peak'] / mb:.0f} | {r['rss_peak'] / expected:.2f} | "
            f"{r['mlx_peak'] / mb:.0f} | {r['mlx_peak'] / expected:.2f} | {hit} | {same} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m m2r2_bench.moe_memory",
        description="Peak memory of the test MoE within an expert budget (lazy load) against the model loaded whole.",
    )
    p.add_argument("--budget", default="25%", help="expert memory budget (default 25%%)")
    p.add_argument("-m", "--max-tokens", type=int, default=16, help="tokens decoded per run (default 16)")
    p.add_argument(
        "--work",
        type=Path,
        default=Path("build/moe-memory"),
        help="where the test MoE and its expert stores go (default build/moe-memory)",
    )
    p.add_argument("--out", type=Path, default=None, help="also write the table to this Markdown file")
    p.add_argument("--force", action="store_true", help="overwrite --out")
    p.add_argument("--child", choices=LOADINGS, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    return p


def _main() -> int:
    args = build_parser().parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.budget, args.max_tokens)))
        return 0
    kind, share = parse_budget(args.budget)
    if kind != "fraction":
        raise M2R2Error(f"--budget here is a share of the experts, e.g. 25% (got {args.budget})")
    if args.out and args.out.exists() and not args.force:
        raise M2R2Error(f"{args.out} already exists; pass --force to overwrite it")
    folder = make_model(args.work / "test-moe")
    rows = []
    for mode in LOADINGS:
        t0 = time.perf_counter()
        rows.append(measure(mode, folder, args.budget, args.max_tokens, args.work / "home"))
        print(f"{LABELS[mode]}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    text = table(rows, sizes(folder), share)
    print(text)
    if args.out:
        atomic_write_text(
            args.out,
            f"# MoE memory within a budget\n\n`python -m m2r2_bench.moe_memory --budget "
            f"{args.budget}` (each row a fresh process)\n\n{text}\n\n{EXPLAINED}\n",
        )
    return 0


def main() -> None:
    sys.exit(run_cli("moe_memory", _main))


if __name__ == "__main__":
    main()
