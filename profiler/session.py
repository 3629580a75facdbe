"""One profile: load the model, probe the machine, decode the answer unmeasured and then measured, and gather
the figures the report, the trace and the plot are made of."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from m2r2_mlx.core.config import M2R2Config
from m2r2_mlx.decoding.methods import make_decoder
from m2r2_mlx.decoding.prompt_cache import PromptCache
from m2r2_mlx.models.base_model import BaseParts
from m2r2_mlx.models.registry import load_model
from m2r2_mlx.moe.blocks import moe_blocks
from m2r2_mlx.moe.serve import serve_with_budget
from m2r2_mlx.tracing import NO_TRACE

from . import experts as expert_work
from .config import ProfileConfig
from .instrument import ProfileTracer, instrument
from .metal import metal_capture
from .probe import Machine, probe_machine
from .roofline import Roofline, roofline
from .spans import Recorder
from .steps import Run, Step, decode, decode_measured
from .table import Row, SizeStat, component_rows, draft_steps, groups_of, verification_sizes

WARMUP_TOKENS = 8  # first-time shapes and allocations, before either timed decode


@dataclass
class Breakdown:
    """One m2r2-profile run: a decoder's steps timed by component, beside the machine's limits."""

    model: str
    label: str  # the mode, and the expert budget where there is one
    num_layers: int
    groups: list[tuple[int, int]]  # layer groups of the table (the exit intervals)
    prompt_tokens: int
    machine: Machine
    unmeasured: Run
    measured: Run
    steps: list[Step]
    rows: list[Row]
    sizes: list[SizeStat]  # full-model forwards by positions
    draft: tuple[int, float]  # fast-stream draft steps, seconds drafting
    roofline: Roofline
    experts: dict = field(default_factory=dict)  # per-token expert work: {"unmeasured": ..., "measured": ...}
    recorder: Recorder = field(default_factory=Recorder)

    @property
    def same_tokens(self) -> bool:
        return self.unmeasured.tokens == self.measured.tokens

    @property
    def decode_steps(self) -> list[Step]:
        return [s for s in self.steps if self.recorder.spans[s.span].kind == "step"]

    @property
    def steps_s(self) -> float:
        """The decode steps' time: what the component rows add up to."""
        return sum(self.recorder.spans[s.span].seconds for s in self.decode_steps)

    @property
    def wall_s(self) -> float:
        """The measured decode's wall time, from the first step's start to the last one's end."""
        spans = [self.recorder.spans[s.span] for s in self.decode_steps]
        return spans[-1].end - spans[0].start if spans else 0.0

    @property
    def coverage(self) -> float:
        """The steps' share of the measured wall time (the rest is the measuring loop's own)."""
        return self.steps_s / self.wall_s if self.wall_s else 0.0

    @property
    def step_ms(self) -> float:
        return 1e3 * self.steps_s / max(len(self.decode_steps), 1)

    @property
    def tokens_per_step(self) -> float:
        return sum(len(s.events) for s in self.decode_steps) / max(len(self.decode_steps), 1)


def _gates(adapters: str | None) -> list[int] | None:
    return M2R2Config.load(Path(adapters)).gates if adapters else None


def _label(config: ProfileConfig) -> str:
    method = config.options.decode.method
    return f"{method} @ {config.experts.budget} experts" if config.experts else method


def run_profile(config: ProfileConfig) -> Breakdown:
    lm = load_model(config.model, lazy=config.experts is not None)  # within a budget, experts are never all read
    parts = BaseParts(lm.model)
    print(f"probing this machine ({parts.inner.norm.weight.dtype}): streaming copy and matrix product", file=sys.stderr)
    machine = probe_machine(parts.inner.norm.weight.dtype)

    tracer = ProfileTracer()  # the measured runs' hooks: each hands it its recorder

    def build(traced: bool = False):
        return make_decoder(lm, config.options.decode, config.adapters, tracer if traced else NO_TRACE)

    decoder = build()
    cache = None
    if config.experts is not None:  # after the decoder, as m2r2-chat does (tui/session.py)
        e = config.experts
        cache = serve_with_budget(lm, e.budget, predictor=e.predictor, adapters=config.adapters, tracer=tracer)
    try:
        return _profile(config, lm, machine, build, cache, decoder, tracer)
    finally:
        if cache is not None:
            cache.close()


def _profile(config: ProfileConfig, lm, machine: Machine, build, experts, decoder, tracer: ProfileTracer) -> Breakdown:
    generation, kv = config.options.generation, config.options.kv
    prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": config.prompt}], add_generation_prompt=True)

    def new_cache(traced: bool = False) -> PromptCache:
        return PromptCache(lm.model, kv.max_kv_size, kv.kv_bits, tracer if traced else NO_TRACE)

    decode(
        decoder,
        prompt,
        replace(generation, max_tokens=min(WARMUP_TOKENS, generation.max_tokens)),
        new_cache(),
        "warm-up",
    )
    work: dict = {}
    unmeasured = measured = None
    for _ in range(config.repeats):  # alternating, so drift on a shared machine hits both alike; the fastest kept
        start = expert_work.begin(experts) if experts is not None else None
        with metal_capture(config.metal_capture if unmeasured is None else None):
            run = decode(build(), prompt, generation, new_cache(), "unmeasured")
        if unmeasured is None or run.tokens_per_s > unmeasured.tokens_per_s:
            unmeasured = run
            if experts is not None:
                work["unmeasured"] = expert_work.work(experts, start).per_token()
        start = expert_work.begin(experts) if experts is not None else None
        rec, cache, decoder = Recorder(), new_cache(traced=True), build(traced=True)
        tracer.use(rec)
        with instrument(tracer, lm.model, decoder):
            run, found = decode_measured(decoder, prompt, generation, cache, rec)
        if measured is None or run.tokens_per_s > measured.tokens_per_s:
            measured, steps, recorder = run, found, rec
            if experts is not None:
                work["measured"] = expert_work.work(experts, start).per_token()
    groups = groups_of(lm.num_layers, _gates(config.adapters))
    sizes = verification_sizes(recorder, steps)
    return Breakdown(
        model=lm.name,
        label=_label(config),
        num_layers=lm.num_layers,
        groups=groups,
        prompt_tokens=len(prompt),
        machine=machine,
        unmeasured=unmeasured,
        measured=measured,
        steps=steps,
        rows=component_rows(recorder, steps, groups, bool(moe_blocks(lm.model))),
        sizes=sizes,
        draft=draft_steps(recorder, steps),
        roofline=roofline(recorder, steps, sizes, unmeasured, machine),
        experts=work,
        recorder=recorder,
    )
