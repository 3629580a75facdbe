"""The peers, wrapped as Decoders (m2r2_mlx.decoding.protocols) so every method is timed the same way.

- ``mlx-lm``: mlx-lm's own ``stream_generate`` (what an mlx-lm user runs today);
- ``mlx-lm-spec``: the same with a second, smaller draft model (mlx-lm's speculative decoding).

mlx-lm keeps its own cache per call: the session's cache is left alone, so each turn prefills the whole prompt.
"""

from __future__ import annotations

import time
from typing import Iterator, Sequence

from m2r2_mlx.decoding.config import GenerationConfig
from m2r2_mlx.decoding.events import EventStream, SpecStep, TokenEvent

import mlx.core as mx
from mlx_lm import stream_generate


class MlxLmDecoder:
    needs_adapters = False
    note = ""

    def __init__(self, lm, draft_model=None, num_draft_tokens: int = 3):
        self.lm, self.draft_model, self.num_draft_tokens = lm, draft_model, num_draft_tokens
        self.name = "mlx-lm" if draft_model is None else "mlx-lm-spec"
        self.exit_layers = [lm.num_layers]

    def __call__(
        self, prompt: Sequence[int], cache=None, generation: GenerationConfig | None = None
    ) -> Iterator[TokenEvent]:
        generation = generation or GenerationConfig()
        if generation.seed is not None:
            mx.random.seed(generation.seed)
        mx.reset_peak_memory()
        extra = {}
        if self.draft_model is not None:
            extra = {"draft_model": self.draft_model, "num_draft_tokens": self.num_draft_tokens}
        tokenizer, n = self.lm.tokenizer, generation.max_tokens
        events = EventStream(tokenizer, self.lm.num_layers, len(prompt), len(prompt), n, time.perf_counter())
        sampler = generation.sampling.sampler()
        for r in stream_generate(self.lm.model, tokenizer, list(prompt), max_tokens=n, sampler=sampler, **extra):
            drafted = bool(getattr(r, "from_draft", False))
            spec = SpecStep("draft model", self.lm.num_layers, "") if drafted else None
            ev = events.event(r.token, spec=spec)
            yield ev
            if ev.finish_reason:
                return
