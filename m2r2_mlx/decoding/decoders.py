"""Decoding strategies by name, behind one call shape: ``decode(prompt, cache=, context_length=, **options)``."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable, Iterator

from ..core.adapters import load_adapters, new_m2r2
from ..core.arla import ARLARule
from ..core.config import M2R2Config
from ..core.draft_vocab import FILE, load_draft_vocab
from ..core.hub import packaged_adapters, resolve_adapters
from ..errors import M2R2Error
from .drafters import LayerDrafter, PromptLookupDrafter
from .early_exit import confidence, early_exit_generate
from .generate import TokenEvent, generate
from .speculative import Speculator

MODES = ("plain", "speculative", "early-exit", "layerskip", "lookup")
MODE_HELP = {
    "plain": "plain decoding",
    "early-exit": "lossy dynamic early exit: a token leaves at the first gate whose exit score reaches --tau",
    "speculative": "lossless self-speculative decoding: prompt lookup and the M2R2 fast stream draft where the "
    "engine's cost model expects it to pay",
    "layerskip": "lossless self-speculative decoding, drafts from the slow state's naive exit (no adapters)",
    "lookup": "lossless prompt-lookup decoding (drafts copied from the context)",
}
# Verifying every draft (policy "always": the lookup and layer-skip baselines, and the fast stream alone):
# short drafts cut at 0.4 confidence, chosen by measurement on SmolLM2-135M (docs/speculative_sweep.md). The
# cost-aware engine drafts further only where it pays, and weighs every candidate itself (no threshold).
DEFAULT_DRAFT, DEFAULT_THRESHOLD, DEFAULT_DRAFT_VOCAB = 3, 0.4, 4096
COST_DRAFT, COST_WIDTH = 8, 3
DRAFTERS = ("hybrid", "fast")

Decoder = Callable[..., Iterator[TokenEvent]]


def adapters_folder(lm, adapters: str | Path | None = None, mode: str = "this mode") -> Path:
    """The given adapters (a folder or a Hub repo id), else the packaged ones for the model; one clear line if
    there are none (commands check this before loading the model: hub.resolve_model_and_adapters)."""
    folder = resolve_adapters(adapters) if adapters else packaged_adapters(lm.name)
    if folder is None:
        raise M2R2Error(
            f"{mode} needs M2R2 adapters for {lm.name!r}; pass --adapters DIR or a Hub repo id "
            "(train them with m2r2-train)"
        )
    return folder


def load_m2r2(lm, adapters: str | Path | None = None, mode: str = "this mode"):
    return load_adapters(lm, adapters_folder(lm, adapters, mode))


def make_drafter(
    lm,
    mode: str,
    adapters=None,
    *,
    gate: int | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    draft_vocab: int | None = None,
    drop_unsure: bool = False,
):
    """``draft_vocab``: None = the default size where the adapters have a draft_vocab.json, 0 = the full head;
    ``drop_unsure``: drop the draft that fell below ``threshold`` instead of verifying it."""
    if mode == "lookup":
        return PromptLookupDrafter()
    if mode == "layerskip":  # no adapters run; an adapters folder only lends its default gate and draft vocabulary
        folder = Path(adapters) if adapters else packaged_adapters(lm.name)
        gate = gate or (M2R2Config.load(folder).gates[0] if folder else max(1, lm.num_layers // 5))
        if not 1 <= gate < lm.num_layers:
            raise M2R2Error(f"gate {gate} must be a layer count in 1..{lm.num_layers - 1}")
        m2r2 = new_m2r2(lm, gates=[gate])
    else:
        folder = adapters_folder(lm, adapters, f"mode {mode!r}")
        m2r2 = load_m2r2(lm, folder)
        gate = m2r2.config.gates[0] if gate is None else gate
        if gate not in m2r2.config.gates:
            raise M2R2Error(f"gate {gate} is not one of the adapters' gates {m2r2.config.gates}")

    if draft_vocab is None:  # the default: use the trimmed head when the adapters ship one
        draft_vocab = DEFAULT_DRAFT_VOCAB if folder is not None and (Path(folder) / FILE).is_file() else 0
    vocab = None
    if draft_vocab:
        if folder is None:
            raise M2R2Error("--draft-vocab needs an adapters folder with draft_vocab.json")
        vocab = load_draft_vocab(folder, draft_vocab)
    return LayerDrafter(
        m2r2,
        m2r2.config.gates.index(gate),
        threshold=threshold,
        vocab=vocab,
        adapters=mode == "speculative",
        drop_unsure=drop_unsure,
    )


def exit_rule(m2r2):
    """ARLA when the adapters carry it and it separated right from wrong exits at least as well as max-softmax
    confidence on the trainer's held-out tokens (ROC AUC summed over gates); else confidence."""
    if getattr(m2r2, "arla", None) is None:
        return confidence
    arla, conf = m2r2.config.metrics.exit_auc_sum("arla"), m2r2.config.metrics.exit_auc_sum("confidence")
    if arla is not None and conf is not None and arla < conf:
        return confidence
    return ARLARule(m2r2.arla)


def acceptance_priors(drafters) -> dict[str, float]:
    """Acceptance rates to start from, before the engine has measured any: the held-out agreement of a layer
    drafter's exit with the full model that the adapters' trainer recorded (naive exit for layer-skip)."""
    priors = {"lookup": 0.5}
    for d in drafters:
        if isinstance(d, LayerDrafter):
            rate = d.m2r2.config.metrics.agreement(d.exit_layer, adapters=d.adapters)
            priors[d.kind] = 0.3 if rate is None else rate
    return priors


def make_decoder(
    lm,
    mode: str = "plain",
    adapters: str | Path | None = None,
    *,
    gate: int | None = None,
    max_draft: int | None = None,
    threshold: float | None = None,
    draft_vocab: int | None = None,
    drop_unsure: bool = False,
    tau: float = 0.9,
    scaled_tau: bool = True,
    drafter: str = "hybrid",
    policy: str | None = None,
    width: int | None = None,
    compile: bool = False,
) -> Decoder:
    """A decoder for ``lm``; M2R2 modes load ``adapters`` (default: the packaged ones for the model).

    Speculative mode drafts with prompt lookup and the M2R2 fast stream (``drafter="hybrid"``) or the fast stream
    alone (``"fast"``), under ``policy``: "cost" (the default: the engine drafts and verifies what its measured
    costs and acceptance rates say pays) or "always" (every proposal verified, as the lookup and layer-skip modes
    do). ``gate``: the exit layer the fast stream drafts from (one of the adapters' gates; default the first);
    ``max_draft``: the most tokens drafted per step (default 8 under "cost", else 3); ``threshold``: stop a
    draft when its probability falls below it (default 0.4 under "always", else 0); ``width``: candidates at the
    first draft position (default 3 under "cost", else 1); ``draft_vocab``: score drafts over the model's N most
    frequent tokens only (None: the default where available, 0: all); ``tau``: early exit's threshold at the
    first gate, deeper gates asking more unless ``scaled_tau`` is False (early_exit.gate_thresholds); ``compile``:
    plain decoding through mx.compile'd steps (generate.CompiledSteps).
    """
    if mode == "plain":
        if compile and any(k in lm.config for k in ("num_experts", "num_local_experts")):
            raise M2R2Error(
                "--compile serves dense models: an MoE's experts may be swapped under a memory budget "
                "while a compiled step would keep the ones it was traced with; drop --compile"
            )
        return partial(generate, lm.model, lm.tokenizer, compiled=compile)
    if mode not in MODES:
        raise M2R2Error(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")
    if mode == "early-exit":
        m2r2 = load_m2r2(lm, adapters, f"mode {mode!r}")
        decode = partial(
            early_exit_generate,
            m2r2,
            lm.tokenizer,
            tau=tau,
            rule=exit_rule(m2r2),
            exit_head=m2r2.exit_head,
            scaled_tau=scaled_tau,
        )
        decode.exit_layers = sorted({*m2r2.config.gates, lm.num_layers})
        return decode
    if drafter not in DRAFTERS:
        raise M2R2Error(f"unknown drafter {drafter!r}; choose one of: {', '.join(DRAFTERS)}")
    policy = policy or ("cost" if mode == "speculative" else "always")
    cost = policy == "cost"
    threshold = (0.0 if cost else DEFAULT_THRESHOLD) if threshold is None else threshold
    if not 0 <= threshold <= 1:  # also NaN
        raise M2R2Error(f"the draft threshold must be in [0, 1] (got {threshold})")
    drafters = []
    if mode == "lookup" or (mode == "speculative" and drafter == "hybrid"):
        drafters.append(PromptLookupDrafter())
    if mode != "lookup":
        drafters.append(
            make_drafter(
                lm, mode, adapters, gate=gate, threshold=threshold, draft_vocab=draft_vocab, drop_unsure=drop_unsure
            )
        )
    engine = Speculator(
        lm.model,
        lm.tokenizer,
        drafters,
        policy=policy,
        max_draft=(COST_DRAFT if cost else DEFAULT_DRAFT) if max_draft is None else max_draft,
        width=(COST_WIDTH if cost else 1) if width is None else width,
        priors=acceptance_priors(drafters),
    )
    return engine
