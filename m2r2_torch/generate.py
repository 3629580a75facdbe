"""Batched generation with transformers, for self-distillation and Magpie requests on a GPU.

``generate_batch`` yields what m2r2_mlx.training.data.generate_batch yields, (prompt index, tokens, finish
reason) per prompt, so the shared self_distill and magpie.sample_requests run on it unchanged. Prompts are
sorted by length and left-padded in batches (transformers derives positions from the attention mask); each
answer keeps the exact token ids generated, ending with the stop token when it stopped by itself.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Iterator

import torch


def generate_batch(
    lm,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    batch_size: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> Iterator[tuple[int, list[int], str]]:
    """Greedy answers (``temperature`` 0) or samples at ``temperature`` / ``top_p``, ``batch_size`` prompts a pass;
    on CUDA under bf16 autocast."""
    from transformers import GenerationConfig

    model, tok = lm.model, lm.tokenizer
    device = next(model.parameters()).device
    eos, pad = sorted(tok.eos_token_ids), tok.pad_id
    sample = temperature > 0
    config = GenerationConfig(
        max_new_tokens=max_tokens,
        do_sample=sample,
        eos_token_id=eos,
        pad_token_id=pad,
        **({"temperature": temperature, "top_p": top_p, "top_k": 0} if sample else {}),
    )
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    generator_seed = seed
    order = sorted(range(len(prompts)), key=lambda k: len(prompts[k]))
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width = max(len(prompts[k]) for k in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, k in enumerate(chunk):
            ids[r, width - len(prompts[k]) :] = torch.tensor(prompts[k])
            mask[r, width - len(prompts[k]) :] = 1
        if sample:
            torch.manual_seed(generator_seed)  # each pass seeded: a rerun samples the same requests
            generator_seed += 1
        with torch.no_grad(), autocast:
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
        for r, k in enumerate(chunk):
            tokens = out[r, width:].tolist()
            stop = next((n for n, t in enumerate(tokens) if t in tok.eos_token_ids), None)
            yield (k, tokens[: stop + 1], "stop") if stop is not None else (k, tokens, "length")
