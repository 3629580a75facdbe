"""Training data: plain text files and self-distilled chat answers, as fixed-length token rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .errors import M2R2Error


def read_text_files(paths: list[str | Path]) -> list[str]:
    texts = []
    for p in paths:
        p = Path(p)
        if not p.is_file():
            raise M2R2Error(f"text file {p} not found; check --text")
        texts.append(p.read_text(encoding="utf-8", errors="replace"))
    return texts


def read_prompts(path: str | Path) -> list[str]:
    """A jsonl of prompts: each line {"prompt": "..."} or {"turns": ["...", ...]} (first turn used)."""
    path = Path(path)
    if not path.is_file():
        raise M2R2Error(f"prompts file {path} not found; check --prompts")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            out.append(obj["prompt"] if "prompt" in obj else obj["turns"][0])
        except (ValueError, KeyError, IndexError, TypeError):
            raise M2R2Error(f"{path}:{n} is not a JSON object with 'prompt' or 'turns'") from None
    return out


def pack_rows(token_lists: list[list[int]], seq_len: int) -> np.ndarray:
    """Concatenate token lists and cut them into rows of ``seq_len`` (the tail is dropped)."""
    flat = np.fromiter((t for toks in token_lists for t in toks), dtype=np.int32)
    n = len(flat) // seq_len
    if n == 0:
        raise M2R2Error(f"only {len(flat)} tokens of training data; need at least one row of {seq_len}")
    return flat[: n * seq_len].reshape(n, seq_len)


def self_distill(lm, prompts: list[str], max_tokens: int, batch_size: int = 16, progress=None) -> list[list[int]]:
    """The base model's own greedy answers, as full chat transcripts (prompt + answer tokens)."""
    from mlx_lm import batch_generate

    tok = lm.tokenizer
    encoded = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]
    out = []
    for i in range(0, len(encoded), batch_size):
        chunk = encoded[i : i + batch_size]
        res = batch_generate(lm.model, tok, chunk, max_tokens=max_tokens, verbose=False)
        for prompt_ids, text in zip(chunk, res.texts):
            out.append(list(prompt_ids) + tok.encode(text, add_special_tokens=False) + [tok.eos_token_id])
        if progress:
            progress(len(chunk))
    return out
