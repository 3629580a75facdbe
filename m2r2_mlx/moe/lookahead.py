"""Lookahead adapters: a lead that costs what pre-gating costs, on the main model's own residual.

Pre-gating feeds layer l's router input to layer l+1's router: one router matmul a layer, one layer of lead, which
is too little where one expert's transfer takes two or more layers' compute. A lookahead adapter is a linear map
per target layer t, from the router inputs of the ``depth`` MoE layers ending ``lead`` layers before it to t's
router logits:

    logits_t ~ [x_(t - lead), ..., x_(t - lead - depth + 1)] @ A_t + b_t     (depth D x E: ``depth`` routers' cost)

fitted in closed form (ridge regression, towards t's own router on the nearest source, which is pre-gating at that
distance) on the all-resident model's routing over training text. Targets in the first layers are predicted from
the last layers of the previous token (the next token's router logits: the loads cross the token boundary), so
every layer has a whole ``lead`` of layers to load in. The defaults (2 layers of lead, 3 source layers, a weak
ridge, 65,536 training tokens) are the most precise linear predictor at a lead the link can use (docs/moe_bench.md
compares them, and a classifier). The predictor (``LookaheadAdapterPredictor``, registry name
``lookahead``) runs one map a layer and prefetches through the planner.

    python -m m2r2_mlx.moe lookahead MODEL [--ids train.npy --heldout heldout.npy]   # MODEL/lookahead.safetensors
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import safetensors.numpy
from tqdm.auto import tqdm

from ..atomic import atomic_write_bytes, atomic_write_text
from ..errors import M2R2Error
from .baselines import ListeningPredictor
from .blocks import moe_blocks, top_k, top_scored
from .cache import ExpertCache
from .router_target import RouterRecorder

FILE = "lookahead.safetensors"


@dataclass(frozen=True)
class LookaheadFit:
    """How lookahead adapters are fitted (the defaults: see the module docstring)."""

    lead: int = 2  # MoE layers between the nearest source and the target
    depth: int = 3  # source layers each map reads
    ridge: float = 0.01  # pull towards the target's own router, relative to the inputs' energy
    tokens: int = 65536  # most training tokens read
    seq_len: int = 128
    batch: int = 8  # rows of seq_len routed at once


DEFAULT_FIT = LookaheadFit()


def _key(layer: int) -> str:
    return f"layer{layer}"


class LookaheadAdapters(nn.Module):
    """One linear map per MoE layer t: the router inputs of ``depth`` MoE layers, the nearest ``lead`` layers
    earlier, side by side -> t's router logits."""

    def __init__(
        self, layers: list[int], dims: int, experts: int, lead: int = DEFAULT_FIT.lead, depth: int = DEFAULT_FIT.depth
    ):
        super().__init__()
        if lead < 1 or depth < 1 or lead + depth - 1 > len(layers):
            raise M2R2Error(  # a source may lie in the previous token, not further back
                f"a lookahead lead ({lead}) and depth ({depth}) must be at least 1, and their reach "
                f"(lead + depth - 1) at most {len(layers)} MoE layers"
            )
        self.layers, self.lead, self.depth = list(layers), lead, depth
        # keys are not digits: MLX reads those as list indices
        self.maps = {_key(t): nn.Linear(dims * depth, experts) for t in layers}

    def sources(self, target_ordinal: int) -> list[tuple[int, int]]:
        """(source ordinal, token offset) of each input of target ``target_ordinal``, nearest first (offset -1: the
        previous token)."""
        n = len(self.layers)
        return [
            (j % n, -1 if j < 0 else 0)
            for j in range(target_ordinal - self.lead, target_ordinal - self.lead - self.depth, -1)
        ]

    def __call__(self, target: int, x: mx.array) -> mx.array:
        return self.maps[_key(target)](x)

    def save(self, folder: Path, record: dict) -> Path:
        path = Path(folder) / FILE
        tensors = {f"{t}.{k}": np.array(v, copy=True) for t, m in self.maps.items() for k, v in m.parameters().items()}
        meta = {"layers": json.dumps(self.layers), "lead": str(self.lead), "depth": str(self.depth)}
        atomic_write_bytes(path, safetensors.numpy.save(tensors, metadata=meta))
        atomic_write_text(path.with_suffix(".json"), json.dumps(record, indent=1))
        return path

    @classmethod
    def load(cls, folder: Path) -> "LookaheadAdapters":
        path = Path(folder) / FILE
        if not path.is_file():
            raise M2R2Error(f"no lookahead adapters in {folder}; fit them with python -m m2r2_mlx.moe lookahead MODEL")
        try:
            weights, meta = mx.load(str(path), return_metadata=True)
            layers, lead, depth = json.loads(meta["layers"]), int(meta["lead"]), int(meta.get("depth", 1))
            first = weights[f"{_key(layers[0])}.weight"]
            out = cls(layers, first.shape[1] // depth, first.shape[0], lead, depth)
            out.load_weights([(f"maps.{k}", v) for k, v in weights.items()])
            mx.eval(out.parameters())  # read now: MLX loads lazily, and the file may change later
        except (KeyError, ValueError, RuntimeError) as e:
            raise M2R2Error(f"{path} is damaged or not lookahead adapters ({e}); train them again") from None
        return out


def record_routes(model, blocks: dict[int, nn.Module], ids: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Each MoE layer's router (input, logits) over a batch of rows: (B, T, D) and (B, T, E), float32 numpy."""
    recorders = {l: RouterRecorder(b.gate) for l, b in blocks.items()}
    for l, b in blocks.items():
        b.gate, recorders[l].on = recorders[l], True
    try:
        model(mx.array(ids))
    finally:
        for l, b in blocks.items():
            b.gate = recorders[l].gate
    out = {}
    for l, r in recorders.items():
        x, z = r.seen[0]
        shape = (*ids.shape, -1)  # some blocks flatten the tokens before their router
        out[l] = (np.array(x.astype(mx.float32)).reshape(shape), np.array(z.astype(mx.float32)).reshape(shape))
    return out


def _pairs(adapters: LookaheadAdapters, routed, ordinal_of: list[int], t: int):
    """(inputs, target logits) for target layer ``t``: its source layers' router inputs side by side, each read one
    token earlier where the source is the previous token's (the rows' first tokens are then dropped)."""
    sources = adapters.sources(ordinal_of.index(t))
    z = routed[t][1]
    start = 1 if any(offset for _, offset in sources) else 0
    xs = [routed[ordinal_of[j]][0][:, start + offset : z.shape[1] + offset] for j, offset in sources]
    x = np.concatenate(xs, -1)
    return x.reshape(-1, x.shape[-1]), z[:, start:].reshape(-1, z.shape[-1])


def ridge_towards(xtx: np.ndarray, xtz: np.ndarray, prior: np.ndarray, strength: float) -> np.ndarray:
    """Ridge regression's weights from the sums X'X and X'Z, pulled towards ``prior`` with a strength relative to
    the inputs' energy (their mean squared norm per dimension)."""
    scale = strength * np.trace(xtx) / len(xtx)
    return np.linalg.solve(xtx + scale * np.eye(len(xtx)), xtz + scale * prior)


def train_lookahead(
    lm, ids: np.ndarray, heldout: np.ndarray, fit: LookaheadFit = DEFAULT_FIT, progress: bool = True
) -> tuple[LookaheadAdapters, dict]:
    """Fit lookahead adapters on the first ``fit.tokens`` of ``ids`` (token ids) by ridge regression towards each
    target's own router; the record holds held-out top-k recall beside pre-gating's at the same lead and at one
    layer."""
    blocks = dict(moe_blocks(lm.model))
    if not blocks or any(not isinstance(b.gate, nn.Linear) or top_k(b) is None for b in blocks.values()):
        raise M2R2Error("lookahead adapters need a mixture-of-experts model with linear top-k routers")
    vocab = int(lm.config["vocab_size"])
    for name, part in (("training", ids), ("held-out", heldout)):
        if part.size and not 0 <= int(part.min()) <= int(part.max()) < vocab:  # MLX's gather reads past the table
            raise M2R2Error(
                f"{name} token ids run outside the model's vocabulary of {vocab}; tokenize with its tokenizer"
            )
    layers = sorted(blocks)
    gate0 = blocks[layers[0]].gate.weight
    adapters = LookaheadAdapters(layers, gate0.shape[1], gate0.shape[0], fit.lead, fit.depth)
    ids, seq_len = ids.reshape(-1)[: fit.tokens], fit.seq_len
    rows = ids[: ids.size // seq_len * seq_len].astype(np.int32).reshape(-1, seq_len)
    d = gate0.shape[1] * fit.depth
    xtx = {t: np.zeros((d + 1, d + 1)) for t in layers}
    xtz = {t: np.zeros((d + 1, gate0.shape[0])) for t in layers}
    for b in tqdm(range(0, len(rows), fit.batch), desc="lookahead adapters", unit="batch", disable=not progress):
        routed = record_routes(lm.model, blocks, rows[b : b + fit.batch])
        for t in layers:
            x, z = _pairs(adapters, routed, layers, t)
            x = np.concatenate([x, np.ones((len(x), 1), x.dtype)], 1)  # float32 products, float64 sums
            xtx[t] += x.T @ x
            xtz[t] += x.T @ z
    for t in layers:
        g = blocks[t].gate
        router = np.array(g.weight.astype(mx.float32)).T  # on the nearest source; the others start at zero
        prior = np.concatenate([router, np.zeros((d + 1 - len(router), router.shape[1]))], 0)
        w = ridge_towards(xtx[t], xtz[t], prior, fit.ridge)
        adapters.maps[_key(t)].weight = mx.array(np.ascontiguousarray(w[:-1].T, dtype=np.float32))
        adapters.maps[_key(t)].bias = mx.array(w[-1].astype(np.float32))
    record = {
        "lead": fit.lead,
        "depth": fit.depth,
        "ridge": fit.ridge,
        "train_tokens": int(rows.size),
        **evaluate(lm, adapters, heldout, seq_len),
    }
    return adapters, record


def evaluate(lm, adapters: LookaheadAdapters, heldout: np.ndarray, seq_len: int = 128) -> dict:
    """Held-out top-k recall: the adapters at their lead (the mean, and per target layer), the target's router at
    the same lead (pre-gating that far ahead) and at one layer (pre-gating)."""
    blocks = dict(moe_blocks(lm.model))
    layers = sorted(blocks)
    rows = heldout.reshape(-1)[: heldout.size // seq_len * seq_len].astype(np.int32).reshape(-1, seq_len)[:8]
    routed = record_routes(lm.model, blocks, rows)
    recall = {"adapters": [], "router_same_lead": [], "pregating_next_layer": []}
    for i, t in enumerate(layers):
        k = top_k(blocks[t])
        x, z = _pairs(adapters, routed, layers, t)
        dims = x.shape[-1] // adapters.depth
        true = np.argsort(-z, -1)[:, :k]
        picks = {
            "adapters": np.array(adapters(t, mx.array(x))),
            "router_same_lead": np.array(blocks[t].gate(mx.array(x[:, :dims]))),
        }
        if i > 0:
            prev = routed[layers[i - 1]][0].reshape(-1, dims)
            picks["pregating_next_layer"] = np.array(blocks[t].gate(mx.array(prev)))
            true_here = np.argsort(-routed[t][1].reshape(-1, z.shape[-1]), -1)[:, :k]
        for name, logits in picks.items():
            ref = true_here if name == "pregating_next_layer" else true
            pick = np.argsort(-logits, -1)[:, :k]
            recall[name].append(np.mean([len(set(p) & set(r)) / k for p, r in zip(pick, ref)]))
    out = {f"recall_{k}": float(np.mean(v)) for k, v in recall.items()}
    return {**out, "recall_adapters_by_layer": [round(float(r), 4) for r in recall["adapters"]]}


class LookaheadAdapterPredictor(ListeningPredictor):
    """At each MoE layer of a decode step, the lookahead adapter of the layer ``lead`` ahead (into the next token's
    first layers from the last ones): its experts go to the planner (a ``Predictor``)."""

    def __init__(self, adapters: LookaheadAdapters):
        super().__init__()
        self.adapters = adapters
        # the latest router input seen at each MoE ordinal: this token's below the layer computing now, the previous
        # token's from it on, which is what every source of the next target reads
        self._inputs: dict[int, mx.array] = {}

    def attach(self, cache: ExpertCache) -> "LookaheadAdapterPredictor":
        if cache.layers != self.adapters.layers:
            raise M2R2Error(
                f"these lookahead adapters were fitted to MoE layers {self.adapters.layers}, the model has "
                f"{cache.layers}; fit them to this model"
            )
        return super().attach(cache)

    def own_modules(self) -> list:
        return [self.adapters]

    def on_layer(self, layer: int, x: mx.array) -> None:
        cache = self.cache
        ordinal = cache.ordinal(layer)
        self._inputs[ordinal] = x[-1:]
        if x.shape[0] != 1:
            return  # a prompt's pass loads on demand; its last token is the first decode step's previous one
        n, j = len(cache.layers), ordinal + self.adapters.lead
        step, target = cache.step + j // n, cache.layers[j % n]
        sources = [self._inputs.get(o) for o, _ in self.adapters.sources(j % n)]
        if any(s is None for s in sources) or (cache.planner is not None and not cache.planner.wants(target)):
            return
        x = sources[0] if len(sources) == 1 else mx.concatenate(sources, axis=-1)
        probs = mx.softmax(self.adapters(target, x).astype(mx.float32), axis=-1)
        experts, scores = top_scored(np.array(probs)[0], cache.top_k(target))
        cache.prefetch(target, experts, step=step, scores=scores)


def ensure_lookahead(lm, folder: Path, progress: bool = True) -> LookaheadAdapters:
    """The model folder's lookahead adapters, fitted first (minutes) on its train.npy where missing. Adapters fitted
    with another lead or depth than the defaults are refused, not replaced: the bench's row is named for these."""
    folder = Path(folder)
    if not (folder / FILE).is_file():
        train, held = folder / "train.npy", folder / "heldout.npy"
        if not train.is_file() or not held.is_file():
            raise M2R2Error(f"{folder} has no lookahead adapters and no train.npy/heldout.npy to fit them on")
        adapters, record = train_lookahead(lm, np.load(train), np.load(held), progress=progress)
        adapters.save(folder, record)
    adapters = LookaheadAdapters.load(folder)
    if (adapters.lead, adapters.depth) != (DEFAULT_FIT.lead, DEFAULT_FIT.depth):
        raise M2R2Error(
            f"{folder / FILE} holds lookahead adapters of lead {adapters.lead} and depth {adapters.depth}, not "
            f"{DEFAULT_FIT.lead} and {DEFAULT_FIT.depth}; refit them: python -m m2r2_mlx.moe lookahead {folder}"
        )
    return adapters
