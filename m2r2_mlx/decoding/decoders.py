"""Decoding modes by name, in one registry: each ``Mode`` builds a Decoder (protocols.py) from a loaded model, a
DecodeConfig and an adapters folder. The command line, the chat's live modes, the adapters check, the server and
the benchmarks all read ``MODES``, so a new mode is one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..core.adapters import load_adapters, new_m2r2
from ..core.arla import ARLARule
from ..core.config import M2R2Config
from ..core.draft_vocab import FILE, load_draft_vocab
from ..core.hub import packaged_adapters, resolve_adapters, resolve_model_and_adapters
from ..errors import M2R2Error
from .config import DRAFT_DEFAULTS, DRAFT_VOCAB, DRAFTERS, PLANNERS, DecodeConfig
from .costs import StepCosts
from .drafters import ForcedDrafter, LayerDrafter, PromptLookupDrafter
from .early_exit import EarlyExitDecoder, ExitPolicy, confidence
from .generate import PlainDecoder
from .planner import CostPlanner, VerifyAll
from .protocols import Decoder, Drafter
from .speculative import Speculator


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


def make_drafter(lm, config: DecodeConfig, adapters: str | Path | None = None) -> Drafter:
    """The drafter ``config.mode`` names: prompt lookup, the naive layer exit (layerskip: no adapters run; an
    adapters folder only lends its default gate and draft vocabulary) or the M2R2 fast stream at
    ``config.gate``. ``config.draft_vocab``: None = the default size where the adapters have a draft_vocab.json,
    0 = the full head."""
    mode, gate = config.mode, config.gate
    if mode == "lookup":
        return PromptLookupDrafter()
    if mode == "layerskip":
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

    draft_vocab = config.draft_vocab
    if draft_vocab is None:  # the default: use the trimmed head when the adapters ship one
        draft_vocab = DRAFT_VOCAB if folder is not None and (Path(folder) / FILE).is_file() else 0
    vocab = None
    if draft_vocab:
        if folder is None:
            raise M2R2Error("--draft-vocab needs an adapters folder with draft_vocab.json")
        vocab = load_draft_vocab(folder, draft_vocab)
    threshold = DRAFT_DEFAULTS["always"].threshold if config.threshold is None else config.threshold
    return LayerDrafter(
        m2r2,
        m2r2.config.gates.index(gate),
        threshold=threshold,
        vocab=vocab,
        adapters=mode == "speculative",
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


def build_plain(lm, config: DecodeConfig, adapters: Path | None) -> Decoder:
    if config.compile and any(k in lm.config for k in ("num_experts", "num_local_experts")):
        raise M2R2Error(
            "--compile serves dense models: an MoE's experts may be swapped under a memory budget "
            "while a compiled step would keep the ones it was traced with; drop --compile"
        )
    return PlainDecoder(lm, compiled=config.compile)


def build_early_exit(lm, config: DecodeConfig, adapters: Path | None) -> Decoder:
    m2r2 = load_m2r2(lm, adapters, "mode 'early-exit'")
    policy = ExitPolicy(tau=config.tau, scaled_tau=config.scaled_tau, rule=exit_rule(m2r2), exit_head=m2r2.exit_head)
    return EarlyExitDecoder(m2r2, lm.tokenizer, policy, lm.context_length)


def build_speculator(lm, config: DecodeConfig, adapters: Path | None) -> Decoder:
    """Speculative decoding in its three modes. ``speculative`` drafts with prompt lookup and the M2R2 fast
    stream (``drafter="hybrid"``) or the fast stream alone (``"fast"``) under the cost planner (the default:
    it drafts and verifies what its measured costs and acceptance rates say pays) or "always" (every proposal
    verified, as ``lookup`` and ``layerskip`` do). What the config leaves None comes from DRAFT_DEFAULTS."""
    mode = config.mode
    if config.drafter not in DRAFTERS:
        raise M2R2Error(f"unknown drafter {config.drafter!r}; choose one of: {', '.join(DRAFTERS)}")
    planner = config.planner or ("cost" if mode == "speculative" else "always")
    if planner not in PLANNERS:
        raise M2R2Error(f"unknown planner {planner!r}; choose one of: {', '.join(PLANNERS)}")
    defaults = DRAFT_DEFAULTS[planner]
    threshold = defaults.threshold if config.threshold is None else config.threshold
    max_draft = defaults.max_draft if config.max_draft is None else config.max_draft
    if not 0 <= threshold <= 1:  # also NaN
        raise M2R2Error(f"the draft threshold must be in [0, 1] (got {threshold})")
    if max_draft < 1:
        raise M2R2Error(f"at least 1 token must be drafted per step (got {max_draft})")
    # without adapters, speculative mode's best drafter here (prompt lookup, under the planner) still runs
    lookup_only = mode == "speculative" and config.drafter == "hybrid" and not (adapters or packaged_adapters(lm.name))
    drafters: list[Drafter] = [ForcedDrafter()]  # proposes only under a grammar (structured output)
    if mode == "lookup" or (mode == "speculative" and config.drafter == "hybrid"):
        drafters.append(PromptLookupDrafter())
    if mode != "lookup" and not lookup_only:
        drafters.append(make_drafter(lm, replace(config, threshold=threshold), adapters))
    if planner == "cost":
        model = next((d for d in drafters if not d.free), None)
        fraction = model.exit_layer / lm.num_layers if model else 0.0  # a draft step's cost before one is timed
        costs = StepCosts(draft_fraction=fraction)
        floor = DRAFT_DEFAULTS["always"].max_draft  # lookup's first tokens, as far as the lookup mode verifies them
        chosen = CostPlanner(drafters, costs, lookup_floor=floor)
    else:
        chosen = VerifyAll(drafters)
    engine = Speculator(
        lm.model,
        lm.tokenizer,
        drafters,
        chosen,
        max_draft=max_draft,
        name=mode,
        context_length=lm.context_length,
    )
    if lookup_only:
        engine.note = (
            f"speculative mode drafts with prompt lookup alone: {lm.name} has no M2R2 adapters for the fast stream "
            f"(pass --adapters DIR or a Hub repo id, or train them: m2r2-train --model {lm.name} -o DIR)"
        )
    return engine


@dataclass(frozen=True)
class Mode:
    name: str
    help: str  # one clause for --help and the server's docs
    needs_adapters: bool  # refused, before any download, for a model without M2R2 adapters
    build: Callable[..., Decoder]  # (lm, DecodeConfig, adapters folder or None) -> Decoder
    live: bool = False  # the chat's F2 cycles through these


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("plain", "plain decoding", False, build_plain, live=True),
        Mode(
            "speculative",
            "lossless self-speculative decoding: prompt lookup and the M2R2 fast stream draft where the engine's "
            "cost model expects it to pay (prompt lookup alone for a model without adapters)",
            False,
            build_speculator,
            live=True,
        ),
        Mode(
            "early-exit",
            "lossy dynamic early exit: a token leaves at the first gate whose exit score reaches --tau",
            True,
            build_early_exit,
            live=True,
        ),
        Mode(
            "layerskip",
            "lossless self-speculative decoding, drafts from the slow state's naive exit (no adapters)",
            False,
            build_speculator,
        ),
        Mode("lookup", "lossless prompt-lookup decoding (drafts copied from the context)", False, build_speculator),
    )
}
LIVE_MODES = tuple(name for name, m in MODES.items() if m.live)


def get_mode(name: str) -> Mode:
    if name not in MODES:
        raise M2R2Error(f"unknown mode {name!r}; choose one of: {', '.join(MODES)}")
    return MODES[name]


def make_decoder(lm, config: DecodeConfig | str = "plain", adapters: str | Path | None = None) -> Decoder:
    """The decoder ``config`` describes (a DecodeConfig, or just a mode's name) for ``lm``; modes that use
    adapters take ``adapters`` (a folder or Hub repo id; default: the packaged ones for the model)."""
    config = DecodeConfig(mode=config) if isinstance(config, str) else config
    return get_mode(config.mode).build(lm, config, adapters)


def resolve_for_mode(model: str | None, adapters: str | Path | None, mode: str) -> tuple[str, Path | None]:
    """The model and adapters folder a command will use in ``mode``, from names alone: a mode that needs adapters
    fails here, before any download, when the model has none."""
    get_mode(mode)
    model, folder = resolve_model_and_adapters(model, adapters)
    if folder is None and MODES[mode].needs_adapters:
        free = ", ".join(name for name, m in MODES.items() if not m.needs_adapters)
        raise M2R2Error(
            f"mode {mode!r} needs M2R2 adapters for {model!r} and none ship for it; pass --adapters with an adapters "
            f"folder or Hub repo, or train them: m2r2-train --model {model} -o DIR (modes without adapters: {free})"
        )
    return model, folder
