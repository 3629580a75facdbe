"""mlx-lm's face: a script written for ``mlx_lm.load`` / ``stream_generate`` / ``generate`` runs on m2r2 by changing
its import, and picks a decoding method with one more argument.

    from m2r2_mlx import load, stream_generate
    model, tokenizer = load("smollm2")                    # an alias, repo id, folder or .gguf, as m2r2-chat takes
    for response in stream_generate(model, tokenizer, prompt, max_tokens=256, method="speculative"):
        print(response.text, end="", flush=True)

Each response has mlx-lm's ``GenerationResponse`` fields, and ``m2r2``: the TokenEvent behind it (a speculative
step's drafter and plan, early exit's depth). A decoder is built once per model and method and kept, as a chat
keeps one, so what the speculative engine learns carries over from call to call. Samplers and logits processors
must be readable for lossless speculation (a draft is accepted by the law the target draws from): build them with
this module's ``make_sampler`` and ``make_logits_processors``, which take mlx-lm's arguments.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Sequence

import mlx.core as mx
from mlx_lm.generate import wired_limit

from .decoding.config import DecodeConfig, GenerationConfig, KVConfig
from .decoding.events import TokenEvent
from .decoding.methods import make_decoder
from .decoding.prompt_cache import PromptCache
from .decoding.protocols import Decoder
from .decoding.sampling import Sampling
from .errors import M2R2Error
from .models.registry import LoadedModel, load_model

_LOADED: dict[int, LoadedModel] = {}  # id(model) -> what load() made of it, while the model lives
_DECODERS: dict[tuple, Decoder] = {}  # (id(model), method, adapters) -> its decoder, while the model lives


@dataclass
class GenerationResponse:
    """mlx-lm's GenerationResponse, field for field, and ``m2r2``: the TokenEvent it was made from."""

    text: str
    token: int
    logprobs: mx.array
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    m2r2: TokenEvent | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Sampler:
    """mlx-lm's sampler for ``sampling``, which speculative decoding can read (make_sampler)."""

    sampling: Sampling

    def __call__(self, logprobs: mx.array) -> mx.array:
        return self.sampling.sampler()(logprobs)


PROCESSOR_FIELDS = (  # the Sampling fields make_logits_processors sets
    "repetition_penalty",
    "repetition_context_size",
    "presence_penalty",
    "presence_context_size",
    "frequency_penalty",
    "frequency_context_size",
    "logit_bias",
)


@dataclass(frozen=True)
class LogitsProcessors:
    """mlx-lm's logit bias and penalties (make_logits_processors), readable by speculative decoding: a Sampling
    that sets only those fields."""

    sampling: Sampling

    def __iter__(self):
        bias = self.sampling.biased
        return iter(
            ([lambda tokens, logits: bias(logits)] if self.sampling.logit_bias else []) + self.sampling.processors()
        )


def make_sampler(
    temp: float = 0.0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    top_k: int = 0,
    xtc_probability: float = 0.0,
    **unsupported,
) -> Sampler:
    """mlx_lm.sample_utils.make_sampler's arguments (top_p 0 or 1: off); XTC is not supported."""
    if xtc_probability or min_tokens_to_keep != 1 or unsupported:
        raise M2R2Error("make_sampler: XTC and min_tokens_to_keep are not supported; leave them at their defaults")
    return Sampler(Sampling(temperature=temp, top_p=top_p if 0 < top_p < 1 else 1.0, min_p=min_p, top_k=top_k))


def make_logits_processors(
    logit_bias: dict | None = None,
    repetition_penalty: float | None = None,
    repetition_context_size: int | None = Sampling.repetition_context_size,
    presence_penalty: float | None = None,
    presence_context_size: int | None = Sampling.presence_context_size,
    frequency_penalty: float | None = None,
    frequency_context_size: int | None = Sampling.frequency_context_size,
) -> LogitsProcessors:
    """mlx_lm.sample_utils.make_logits_processors's arguments (None: off; sizes None: Sampling's defaults)."""
    d = Sampling()
    return LogitsProcessors(
        Sampling(
            repetition_penalty=repetition_penalty or 1.0,
            repetition_context_size=repetition_context_size or d.repetition_context_size,
            presence_penalty=presence_penalty or 0.0,
            presence_context_size=presence_context_size or d.presence_context_size,
            frequency_penalty=frequency_penalty or 0.0,
            frequency_context_size=frequency_context_size or d.frequency_context_size,
            logit_bias=logit_bias or (),
        )
    )


def _remember(lm: LoadedModel) -> LoadedModel:
    key = id(lm.model)
    _LOADED[key] = lm
    weakref.finalize(lm.model, _forget, key)
    return lm


def _forget(key: int) -> None:
    _LOADED.pop(key, None)
    for k in [k for k in _DECODERS if k[0] == key]:
        del _DECODERS[k]


def load(path_or_hf_repo: str | None = None, lazy: bool = False) -> tuple:
    """``(model, tokenizer)`` as mlx_lm.load returns them, for a name m2r2-chat takes (alias, Hub repo id, folder or
    .gguf; None: the embedded model)."""
    lm = _remember(load_model(path_or_hf_repo, lazy=lazy))
    return lm.model, lm.tokenizer


def _loaded(model, tokenizer) -> LoadedModel:
    """What load() made of ``model``; a model loaded elsewhere (mlx_lm.load) is served without packaged adapters."""
    lm = _LOADED.get(id(model))
    if lm is None or lm.tokenizer is not tokenizer:
        config = dict(vars(getattr(model, "args", object())))
        lm = _remember(LoadedModel(f"{type(model).__module__} model", Path("."), model, tokenizer, config))
    return lm


def _sampling(sampler, logits_processors) -> Sampling:
    if sampler is not None and not isinstance(sampler, Sampler):
        raise M2R2Error(
            "stream_generate needs a sampler it can read (speculative decoding accepts drafts by the law the target "
            "draws from): build it with m2r2_mlx.make_sampler, which takes mlx_lm's make_sampler arguments"
        )
    if logits_processors and not isinstance(logits_processors, LogitsProcessors):
        raise M2R2Error(
            "stream_generate needs logits processors it can read: build them with m2r2_mlx.make_logits_processors"
        )
    s = sampler.sampling if sampler is not None else Sampling()
    if logits_processors:
        p = logits_processors.sampling
        s = replace(s, **{f: getattr(p, f) for f in PROCESSOR_FIELDS})
    return s


def _tokens(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, mx.array):
        return prompt.reshape(-1).tolist()
    if isinstance(prompt, str):  # as mlx-lm: special tokens unless the text starts with the BOS token
        bos = getattr(tokenizer, "bos_token", None)
        return tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    return list(prompt)


OPTIONS = ("sampler", "logits_processors", "max_kv_size", "kv_bits", "prompt_cache")  # mlx-lm's that m2r2 takes


def stream_generate(
    model,
    tokenizer,
    prompt: str | mx.array | Sequence[int],
    max_tokens: int = GenerationConfig.max_tokens,
    *,
    method: str | None = None,
    adapters: str | Path | None = None,
    **options,
) -> Iterator[GenerationResponse]:
    """mlx_lm.stream_generate with a decoding ``method`` (a name in methods.METHODS; default: the library's) and
    M2R2 ``adapters`` (default: the packaged ones for the model). ``options``, as mlx-lm names them: ``sampler``
    and ``logits_processors`` (this module's make_sampler and make_logits_processors), ``max_kv_size``,
    ``kv_bits``, and ``prompt_cache``: a PromptCache to reuse across calls (m2r2_mlx.decoding.prompt_cache)."""
    unsupported = sorted(set(options) - set(OPTIONS))
    if unsupported:
        raise M2R2Error(f"stream_generate does not take {', '.join(unsupported)} (it takes {', '.join(OPTIONS)})")
    sampler, logits_processors = options.get("sampler"), options.get("logits_processors")
    max_kv_size, kv_bits, prompt_cache = options.get("max_kv_size"), options.get("kv_bits"), options.get("prompt_cache")
    lm = _loaded(model, tokenizer)
    tokens = _tokens(tokenizer, prompt)
    if max_tokens == -1:  # mlx-lm's "no limit": the context's
        max_tokens = lm.context_length - len(tokens)
    kv = KVConfig(max_kv_size, kv_bits)
    config = DecodeConfig() if method is None else DecodeConfig(method)
    if kv.shaped and config.method != "plain":
        raise M2R2Error(f"max_kv_size and kv_bits work with method 'plain' only (got {config.method!r})")
    generation = GenerationConfig(max_tokens, _sampling(sampler, logits_processors), logprobs=0)
    key = (id(model), config.method, str(adapters))
    if key not in _DECODERS:
        _DECODERS[key] = make_decoder(lm, config, adapters)
    cache = prompt_cache if prompt_cache is not None else PromptCache(model, max_kv_size, kv_bits)
    with wired_limit(model):
        tic, n = time.perf_counter(), 0
        for ev in _DECODERS[key](tokens, cache, generation):
            n += 1
            if n == 1:
                prompt_tps, tic = len(tokens) / max(ev.timing.prompt_time_s, 1e-9), time.perf_counter()
            yield GenerationResponse(
                text=ev.text,
                token=ev.token,
                logprobs=ev.logprobs.row,
                from_draft=ev.drafted,
                prompt_tokens=len(tokens),
                prompt_tps=prompt_tps,
                generation_tokens=n,
                generation_tps=n / max(time.perf_counter() - tic, 1e-9),
                peak_memory=ev.timing.peak_memory_gb,
                finish_reason=ev.finish_reason,
                m2r2=ev,
            )


def generate(model, tokenizer, prompt: str | Sequence[int], verbose: bool = False, **kwargs) -> str:
    """mlx_lm.generate: the whole answer's text (``verbose``: printed as it comes, then the rates)."""
    if verbose:
        print("=" * 10)
    text, response = "", None
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose and response is not None:
        print()
        print("=" * 10)
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text
