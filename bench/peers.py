"""The peers, wrapped as decoders with our call shape so every method is timed the same way.

- ``mlx-lm``: mlx-lm's own ``stream_generate`` (what an mlx-lm user runs today);
- ``mlx-lm-spec``: the same with a second, smaller draft model (mlx-lm's speculative decoding).
"""

from __future__ import annotations

import time

from m2r2_mlx.decoding.generate import EventStream

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler


def mlx_lm_decoder(lm, draft_model=None, num_draft_tokens: int = 3):
    def decode(prompt, *, cache=None, context_length=None, max_tokens=256, temperature=0.0, top_p=1.0, seed=None):
        if seed is not None:
            mx.random.seed(seed)
        mx.reset_peak_memory()
        extra = {"draft_model": draft_model, "num_draft_tokens": num_draft_tokens} if draft_model is not None else {}
        events = EventStream(lm.tokenizer, lm.num_layers, len(prompt), len(prompt), max_tokens, time.perf_counter())
        for r in stream_generate(
            lm.model,
            lm.tokenizer,
            list(prompt),
            max_tokens=max_tokens,
            sampler=make_sampler(temp=temperature, top_p=top_p),
            **extra,
        ):
            ev = events.event(r.token, drafted=bool(getattr(r, "from_draft", False)))
            yield ev
            if ev.finish_reason:
                return

    return decode
