"""Round 8's tries beside the lookahead row (docs/moe_bench.md, round 8), on the short planner-gap run (macbook
device clock, two held-out prompts x 23 tokens; the same figures on every run):

    python -m experiments.moe_lookahead_tries [--budgets 25,50] [--out docs/moe_lookahead_tries]

Rows, each against on-demand LRU: the lookahead row as the bench runs it; its planner reading the hit rate
pessimistically (the mean less one standard deviation; before round 8 only the load decision read it so, here also
the check of whether a layer is worth predicting) and with no planner at all (every prediction loaded); the true
routes given for the first three MoE layers (the maps' weakest); next-token hints for eviction (a second map per
layer, lead 30: this token's router input to the next token's routes there); and maps fitted on the model's own
greedy continuations of training text instead of the text (16,384 tokens each, both fitted here: about 10 minutes).
Writes results.md under --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from m2r2_mlx.atomic import atomic_write_text
from m2r2_mlx.models.registry import load_model
from m2r2_mlx.moe import Oracle
from m2r2_mlx.moe.lookahead import LookaheadAdapterPredictor, LookaheadAdapters, LookaheadFit, train_lookahead

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from tqdm.auto import tqdm

from experiments.moe_planner_gap import MODEL, _no_planner, measure_changed, short_run

FIRST = 3  # MoE layers given their true routes
TOKENS = 16384


def continuations(lm, text: np.ndarray, rows: int, prompt: int = 48, length: int = 128, batch: int = 64):
    """``rows`` rows of ``length`` tokens: ``prompt`` tokens of ``text`` each, then the model's greedy
    continuation."""
    stride, out = text.size // rows, []
    for b in tqdm(range(0, rows, batch), desc="continuations", unit="batch"):
        ids = np.stack([text[i * stride : i * stride + prompt] for i in range(b, min(b + batch, rows))])
        cache = make_prompt_cache(lm.model)
        tok = mx.argmax(lm.model(mx.array(ids.astype(np.int32)), cache=cache)[:, -1], -1)
        made = [tok]
        for _ in range(length - prompt - 1):
            tok = mx.argmax(lm.model(tok[:, None], cache=cache)[:, -1], -1)
            made.append(tok)
        out.append(np.concatenate([ids, np.stack([np.array(t) for t in made], 1)], 1))
    return np.concatenate(out).reshape(-1)


def fitted(lm, folder: Path, ids: np.ndarray, fit: LookaheadFit) -> LookaheadAdapters:
    if not (folder / "lookahead.safetensors").is_file():
        adapters, record = train_lookahead(lm, ids, np.load(f"{MODEL}/heldout.npy"), fit)
        folder.mkdir(parents=True, exist_ok=True)
        adapters.save(folder, record)
    return LookaheadAdapters.load(folder)


def _pessimistic(model, cache, predictor, run):
    cache.planner.hits.mean = cache.planner.hits.pessimistic  # select() and wants() read it
    return model, cache, predictor


class _FirstLayersOracle(Oracle):
    def routes(self, step, layer):
        return super().routes(step, layer) if self.cache.ordinal(layer) < FIRST else []


class _LaterLayersLookahead(LookaheadAdapterPredictor):
    def on_layer(self, layer, x):
        ordinal = self.cache.ordinal(layer)
        if (ordinal + self.adapters.lead) % len(self.cache.layers) < FIRST:
            self._inputs[ordinal] = x[-1:]  # still a source of later targets
            return
        super().on_layer(layer, x)


def _first_layers_true(model, cache, predictor, run):
    predictor.detach()
    _LaterLayersLookahead(predictor.adapters).attach(cache)
    _FirstLayersOracle(run.traces[0], lookahead=2).attach(cache)
    return model, cache, predictor


def _also(adapters):
    def change(model, cache, predictor, run):
        LookaheadAdapterPredictor(adapters).attach(cache)
        return model, cache, predictor

    return change


def _instead(adapters):
    def change(model, cache, predictor, run):
        predictor.detach()
        return model, cache, LookaheadAdapterPredictor(adapters).attach(cache)

    return change


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="25,50")
    parser.add_argument("--out", type=Path, default=Path("docs/moe_lookahead_tries"))
    args = parser.parse_args()
    lm = load_model(MODEL, tokenizer=False)
    text = np.load(f"{MODEL}/train.npy").reshape(-1)
    work = Path("build/lookahead-tries")
    own = work / "continuations.npy"
    if not own.is_file():
        work.mkdir(parents=True, exist_ok=True)
        np.save(own, continuations(lm, text, TOKENS // 128))
    small = LookaheadFit(tokens=TOKENS)
    rows = [
        ("lookahead row (as the bench runs it)", None),
        ("its planner reading hit rates pessimistically", _pessimistic),
        ("no planner (every prediction loaded)", _no_planner),
        (f"true routes for the first {FIRST} layers", _first_layers_true),
        ("next-token hints for eviction", _also(fitted(lm, work / "next", text, LookaheadFit(30, 1, tokens=TOKENS)))),
        ("maps fitted on 16,384 tokens of text", _instead(fitted(lm, work / "text", text, small))),
        ("maps fitted on 16,384 tokens of own continuations", _instead(fitted(lm, work / "own", np.load(own), small))),
    ]
    run, lines = (
        short_run(),
        ["| budget | row | vs LRU | hit rate | loads/token | precision |", "|---|---|---|---|---|---|"],
    )
    for budget in (float(b) for b in args.budgets.split(",")):
        lru = measure_changed(run, "lru", budget)
        for label, change in rows:
            r = measure_changed(run, "lookahead", budget, change)
            lines.append(
                f"| {budget:g}% | {label} | {r['tokens_per_s'] / lru['tokens_per_s']:.3f}x | {r['hit_rate']:.1%} "
                f"| {r['loads_per_token']:.1f} | {r['precision']:.1%} |"
            )
            print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    command = f"python -m experiments.moe_lookahead_tries --budgets {args.budgets} --out {args.out}"
    atomic_write_text(args.out / "results.md", f"`{command}`\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
