"""Decoding methods by name, in one table: ``METHODS``. The command lines, the chat, the server, the benchmarks and
the Python API all read it, so a new method is one row here.

A speculative method is a pair of a drafter list and a planner (``SpeculativeRecipe``), built by
``speculative_engine``; experiments pass their own drafters and planners to that builder directly. The drafters
and planners themselves are one registry each (``DRAFTERS``, ``PLANNERS``).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from ..core.adapters import load_adapters, new_m2r2
from ..core.arla import ARLARule
from ..core.config import ADAPTERS_FILE, M2R2Config
from ..core.draft_vocab import FILE, load_draft_vocab
from ..core.hub import packaged_adapters, resolve_adapters, resolve_model_and_adapters
from ..errors import M2R2Error
from ..tracing import NO_TRACE, Tracer
from .config import DRAFT_VOCAB, DecodeConfig
from .costs import StepCosts
from .drafters import ForcedDrafter, LayerDrafter, PromptLookupDrafter
from .early_exit import EarlyExitDecoder, ExitPolicy, confidence
from .exit_planner import GatePlanner
from .generate import PlainDecoder
from .planner import CostPlanner, VerifyAll
from .protocols import Decoder, Drafter, Planner
from .speculative import Speculator, SpeculatorSettings


def adapters_folder(lm, adapters: str | Path | None = None, method: str = "this method") -> Path:
    """The given adapters (a folder or a Hub repo id), else the packaged ones for the model; one clear line if
    there are none (commands check this before loading the model: resolve_for_method)."""
    folder = resolve_adapters(adapters) if adapters else packaged_adapters(lm.name)
    if folder is None:
        raise M2R2Error(
            f"{method} needs M2R2 adapters for {lm.name!r}; pass --adapters DIR or a Hub repo id "
            "(train them with m2r2-train)"
        )
    return folder


_LOADED: OrderedDict[tuple, tuple[weakref.ref, object]] = OrderedDict()  # the last KEEP_LOADED adapters loaded
KEEP_LOADED = 4


def load_m2r2(lm, adapters: str | Path | None = None, method: str = "this method"):
    """The adapters for ``lm``, loaded once per model and folder while their weights file is unchanged: a chat or
    a server builds a decoder for each method and tau it is asked for, and each would otherwise read and hash
    the same files again. Decoders share the M2R2Model: decoding only reads its weights."""
    folder = adapters_folder(lm, adapters, method)
    weights = Path(folder) / ADAPTERS_FILE
    key = (id(lm.model), str(Path(folder).resolve()), weights.stat().st_mtime_ns if weights.is_file() else None)
    held = _LOADED.get(key)
    if held is not None and held[0]() is lm.model:  # the same model object, not another at a reused id
        _LOADED.move_to_end(key)
        return held[1]
    m2r2 = load_adapters(lm, folder)
    _LOADED[key] = (weakref.ref(lm.model), m2r2)
    while len(_LOADED) > KEEP_LOADED:
        _LOADED.popitem(last=False)
    return m2r2


# ---- drafters and planners, one registry each -----------------------------------------------------------------
def _draft_vocab(config: DecodeConfig, folder: Path | None):
    size = config.draft_vocab
    if size is None:  # the default: the trimmed head where the adapters ship one
        size = DRAFT_VOCAB if folder is not None and (Path(folder) / FILE).is_file() else 0
    if not size:
        return None
    if folder is None:
        raise M2R2Error("--draft-vocab needs an adapters folder with draft_vocab.json")
    return load_draft_vocab(folder, size)


def fast_drafter(lm, config: DecodeConfig, adapters: str | Path | None, threshold: float) -> Drafter:
    """The M2R2 fast stream at ``config.gate`` (default: the adapters' first gate)."""
    folder = adapters_folder(lm, adapters, "the fast stream")
    m2r2 = load_m2r2(lm, folder)
    gate = m2r2.config.gates[0] if config.gate is None else config.gate
    if gate not in m2r2.config.gates:
        raise M2R2Error(f"gate {gate} is not one of the adapters' gates {m2r2.config.gates}")
    vocab = _draft_vocab(config, folder)
    return LayerDrafter(m2r2, m2r2.config.gates.index(gate), threshold=threshold, vocab=vocab, adapters=True)


def layerskip_drafter(lm, config: DecodeConfig, adapters: str | Path | None, threshold: float) -> Drafter:
    """The slow state's own exit at ``config.gate`` (no adapters run; an adapters folder only lends its first gate
    and draft vocabulary): the naive self-speculative baseline."""
    folder = resolve_adapters(adapters) if adapters else packaged_adapters(lm.name)
    gate = config.gate or (M2R2Config.load(folder).gates[0] if folder else max(1, lm.num_layers // 5))
    if not 1 <= gate < lm.num_layers:
        raise M2R2Error(f"gate {gate} must be a layer count in 1..{lm.num_layers - 1}")
    vocab = _draft_vocab(config, folder)
    return LayerDrafter(new_m2r2(lm, gates=[gate]), 0, threshold=threshold, vocab=vocab, adapters=False)


DRAFTERS: dict[str, Callable[..., Drafter]] = {
    "lookup": lambda lm, config, adapters, threshold: PromptLookupDrafter(),
    "fast": fast_drafter,
    "layerskip": layerskip_drafter,
}


def cost_planner(
    lm, drafters: Sequence[Drafter], kind: type[CostPlanner] = CostPlanner, lookup_floor: int | None = None
) -> CostPlanner:
    """Drafts and verifies what the costs and acceptance rates measured while decoding say pays (``kind``: a
    CostPlanner subclass, and ``lookup_floor``, for studies)."""
    model = next((d for d in drafters if not d.free), None)
    fraction = model.exit_layer / lm.num_layers if model else 0.0  # a draft step's cost before one is timed
    floor = METHODS["lookup"].max_draft if lookup_floor is None else lookup_floor
    return kind(list(drafters), StepCosts(draft_fraction=fraction), lookup_floor=floor)


PLANNERS: dict[str, Callable[..., Planner]] = {
    "cost": cost_planner,
    "verify-all": lambda lm, drafters: VerifyAll(list(drafters)),
}


def speculative_engine(
    lm,
    drafters: Sequence[Drafter],
    planner: Planner,
    *,
    max_draft: int,
    name: str,
    note: str = "",
    tracer: Tracer = NO_TRACE,
) -> Speculator:
    """Draft-and-verify decoding with ``drafters`` (the grammar's forced text is always drafted first) under
    ``planner``."""
    settings = SpeculatorSettings(max_draft, name, lm.context_length, note)
    return Speculator(lm.model, lm.tokenizer, [ForcedDrafter(), *drafters], planner, settings, tracer)


@dataclass(frozen=True)
class SpeculativeRecipe:
    """A speculative method: its drafters (DRAFTERS' names, in chain order) and its planner (a PLANNERS name)."""

    drafters: tuple[str, ...]
    planner: str

    def __call__(self, lm, config: DecodeConfig, adapters: Path | None, tracer: Tracer = NO_TRACE) -> Decoder:
        method = METHODS[config.method]
        threshold = method.threshold if config.threshold is None else config.threshold
        max_draft = method.max_draft if config.max_draft is None else config.max_draft
        names, note = list(self.drafters), ""
        if "fast" in names and len(names) > 1 and not (adapters or packaged_adapters(lm.name)):
            names.remove("fast")  # the method's best drafters for a model without adapters still run
            note = (
                f"{config.method} drafts with {' and '.join(names)} alone: {lm.name} has no M2R2 adapters for the "
                f"fast stream (pass --adapters DIR or a Hub repo id, or train them: "
                f"m2r2-train --model {lm.name} -o DIR)"
            )
        drafters = [DRAFTERS[n](lm, config, adapters, threshold) for n in names]
        planner = PLANNERS[self.planner](lm, [ForcedDrafter(), *drafters])
        return speculative_engine(
            lm, drafters, planner, max_draft=max_draft, name=config.method, note=note, tracer=tracer
        )


# ---- plain and early exit ---------------------------------------------------------------------------------------
def exit_rule(m2r2):
    """ARLA when the adapters carry it and it separated right from wrong exits at least as well as max-softmax
    confidence on the trainer's held-out tokens (ROC AUC summed over gates); else confidence."""
    if getattr(m2r2, "arla", None) is None:
        return confidence
    arla, conf = m2r2.config.metrics.exit_auc_sum("arla"), m2r2.config.metrics.exit_auc_sum("confidence")
    if arla is not None and conf is not None and arla < conf:
        return confidence
    return ARLARule(m2r2.arla)


def build_plain(lm, config: DecodeConfig, adapters: Path | None, tracer: Tracer = NO_TRACE) -> Decoder:
    if config.compile and any(k in lm.config for k in ("num_experts", "num_local_experts")):
        raise M2R2Error(
            "--compile serves dense models: an MoE's experts may be swapped under a memory budget "
            "while a compiled step would keep the ones it was traced with; drop --compile"
        )
    return PlainDecoder(lm, compiled=config.compile, tracer=tracer)


def build_early_exit(lm, config: DecodeConfig, adapters: Path | None, tracer: Tracer = NO_TRACE) -> Decoder:
    m2r2 = load_m2r2(lm, adapters, "method 'early-exit'")
    policy = ExitPolicy(tau=config.tau, rule=exit_rule(m2r2), exit_head=m2r2.exit_head)
    planner = GatePlanner(m2r2.config.gates, lm.num_layers)
    return EarlyExitDecoder(m2r2, lm.tokenizer, policy, lm.context_length, tracer=tracer, planner=planner)


# ---- the table ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Method:
    name: str
    pick_when: str  # one sentence: when to pick it, with the measured reason (--help, the README, the server)
    build: Callable[..., Decoder]  # (lm, DecodeConfig, adapters folder or None, tracer) -> Decoder
    needs_adapters: bool = False  # refused, before any download, for a model without M2R2 adapters
    lossless: bool = True  # greedy output identical to plain decoding's
    max_draft: int | None = None  # speculative methods: most tokens drafted per step
    threshold: float | None = None  # speculative methods: a model draft stops below this confidence
    live: bool = False  # the chat's F2 cycles through these


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "plain",
            "the reference: one full forward per token",
            build_plain,
            live=True,
        ),
        Method(
            "speculative",
            "the default: prompt lookup and the M2R2 fast stream draft only where the measured costs say it pays, "
            "so it decodes plainly on new text and about as fast as lookup where text repeats",
            SpeculativeRecipe(("lookup", "fast"), "cost"),
            max_draft=8,
            threshold=0.0,
            live=True,
        ),
        Method(
            "lookup",
            "prompt lookup alone: copies what followed the last words earlier in the conversation, every copy "
            "verified; a baseline for speculative",
            SpeculativeRecipe(("lookup",), "verify-all"),
            max_draft=3,
            threshold=0.0,
        ),
        Method(
            "fast",
            "the M2R2 fast stream alone, every draft verified: a baseline for speculative (it pays where drafts "
            "cost little beside a verification)",
            SpeculativeRecipe(("fast",), "verify-all"),
            needs_adapters=True,
            max_draft=3,
            threshold=0.4,
        ),
        Method(
            "early-exit",
            "lossy: a token leaves at the first gate confident enough (--tau: higher agrees more with plain, "
            "lower skips more layers)",
            build_early_exit,
            needs_adapters=True,
            lossless=False,
            live=True,
        ),
    )
}
LIVE_METHODS = tuple(name for name, m in METHODS.items() if m.live)


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise M2R2Error(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}")
    return METHODS[name]


def make_decoder(
    lm, config: DecodeConfig | str | None = None, adapters: str | Path | None = None, tracer: Tracer = NO_TRACE
) -> Decoder:
    """The decoder ``config`` describes (a DecodeConfig, or just a method's name; None: the default) for ``lm``;
    methods that use adapters take ``adapters`` (a folder or Hub repo id; default: the packaged ones for the
    model). ``tracer``: the hooks a tool watches the decode through, and the clock adaptive methods learn their
    costs from (tracing.py)."""
    config = DecodeConfig(method=config) if isinstance(config, str) else config or DecodeConfig()
    return get_method(config.method).build(lm, config, adapters, tracer)


def resolve_for_method(model: str | None, adapters: str | Path | None, method: str) -> tuple[str, Path | None]:
    """The model and adapters folder a command will use for ``method``, from names alone: a method that needs
    adapters fails here, before any download, when the model has none."""
    get_method(method)
    model, folder = resolve_model_and_adapters(model, adapters)
    if folder is None and METHODS[method].needs_adapters:
        free = ", ".join(name for name, m in METHODS.items() if not m.needs_adapters)
        raise M2R2Error(
            f"method {method!r} needs M2R2 adapters for {model!r} and none ship for it; pass --adapters with an "
            f"adapters folder or Hub repo, or train them: m2r2-train --model {model} -o DIR (methods without "
            f"adapters: {free})"
        )
    return model, folder
