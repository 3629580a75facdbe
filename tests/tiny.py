"""Tiny randomly initialised mlx-lm decoders of several architectures, built from a config."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

from m2r2_mlx.decoding.draft import Draft
from m2r2_mlx.decoding.protocols import DraftRequest
from m2r2_mlx.decoding.sampling import Sampling
from m2r2_mlx.models.registry import LoadedModel, resolve_model_path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map

COMMON = dict(
    hidden_size=64,
    num_hidden_layers=6,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=101,
    rope_theta=10000.0,
    max_position_embeddings=256,
)

CONFIGS = {
    "llama": dict(COMMON, model_type="llama", tie_word_embeddings=True),
    "phi3": dict(COMMON, model_type="phi3", tie_word_embeddings=False),
    "qwen2": dict(COMMON, model_type="qwen2", tie_word_embeddings=False),
    "olmoe": dict(COMMON, model_type="olmoe", num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False),
    "mixtral": dict(
        COMMON, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False
    ),
}


def tiny_model(arch: str = "llama", seed: int = 0, **overrides) -> LoadedModel:
    config = dict(CONFIGS[arch], **overrides)
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return LoadedModel(f"tiny-{arch}", Path("."), model, None, config)


def randomize(m2r2, scale: float = 0.05, seed: int = 1) -> None:
    """Every trainable weight drawn at random (adapters that compute something), reproducibly."""
    mx.random.seed(seed)
    m2r2.update(tree_map(lambda p: mx.random.normal(p.shape) * scale, m2r2.parameters()))
    mx.eval(m2r2.parameters())


def random_ids(T: int = 9, B: int = 2, seed: int = 3, vocab: int = 101) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, vocab, size=(B, T)))


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 3-19 token ids from a real tokenizer's range."""
    rng = np.random.default_rng(seed)
    return [rng.integers(20, 5000, size=int(rng.integers(3, 20))).tolist() for _ in range(n)]


class EosAs:
    """A real tokenizer with a chosen end-of-sequence id (to make drafts cross EOS, or never end)."""

    def __init__(self, tokenizer, eos: int):
        self._tok, self.eos_token_ids = tokenizer, {eos}

    def __getattr__(self, name):
        return getattr(self._tok, name)


def tiny_olmoe_folder(folder: Path) -> Path:
    """A tiny random 4-layer OLMoE with the embedded model's real tokenizer, written to ``folder`` as a model folder
    the CLIs load."""

    folder.mkdir()
    smol = resolve_model_path(None)
    for f in smol.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name.endswith(".jinja"):
            shutil.copy(f, folder / f.name)
    vocab = json.loads((smol / "config.json").read_text())["vocab_size"]
    lm = tiny_model("olmoe", vocab_size=vocab, num_hidden_layers=4)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(lm.model.parameters())))
    (folder / "config.json").write_text(json.dumps(lm.config))
    return folder


def draft_chain(drafter, cache, token: int, limit: int, s=None, eos_ids=()) -> tuple[list[int], mx.array | None]:
    """A drafter's chain after ``token`` (the verifier's cache before it), and the laws its drafts were sampled
    from (None for deterministic drafts)."""
    draft = Draft.root(token)
    context = [*cache.tokens, token] if drafter.free else []
    drafter.propose(draft, DraftRequest(cache, context, limit, s or Sampling(), set(eos_ids)))
    laws = draft.laws[1:]
    return draft.tokens[1:], (mx.stack(laws) if laws and laws[0] is not None else None)


def speculative_generate(model, tokenizer, prompt, drafter, generation=None, *, max_draft: int, cache=None):
    """Speculative decoding with one drafter whose every draft is verified (planner.VerifyAll)."""
    from m2r2_mlx.decoding.planner import VerifyAll
    from m2r2_mlx.decoding.speculative import Speculator, SpeculatorSettings

    engine = Speculator(model, tokenizer, [drafter], VerifyAll([drafter]), SpeculatorSettings(max_draft))
    return engine(prompt, cache, generation)


def early_exit_generate(m2r2, tokenizer, prompt, generation=None, *, policy, cache=None, walker=None, planner=None):
    """Early exit over ``m2r2`` with ``policy`` (and a study's ``walker``, a ``planner``), as a function."""
    from m2r2_mlx.decoding.early_exit import EarlyExit, EarlyExitDecoder

    decoder = EarlyExitDecoder(m2r2, tokenizer, policy, walker=walker or EarlyExit, planner=planner)
    return decoder(prompt, cache, generation)
