"""m2r2-mlx: Mixture of Multi-Rate Residuals decoding on MLX.

    from m2r2_mlx import load, stream_generate          # mlx-lm's face (api.py): change the import, pick a method
    model, tokenizer = load("smollm2")                   # alias, repo id, folder or .gguf
    for response in stream_generate(model, tokenizer, "What is the capital of France?", method="speculative"):
        print(response.text, end="")

    import m2r2_mlx                                      # the engine's own: a chat that keeps its cache and engine
    lm = m2r2_mlx.load_model("smollm2")
    chat = m2r2_mlx.ChatSession(lm, decoder=m2r2_mlx.make_decoder(lm, "speculative"))
    for event in chat.send("What is the capital of France?", m2r2_mlx.GenerationConfig(max_tokens=64)):
        print(event.text, end="")
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    json_answer = m2r2_mlx.GenerationConfig(max_tokens=64, grammar=m2r2_mlx.json_schema_grammar(schema))

Layers, each importing only the ones before it: ``models`` (loading bases) → ``core`` (the M2R2 model:
fast stream, adapters, ARLA) → ``decoding`` (plain, speculative, early exit, chat sessions) → the apps
(``tui``, ``convert``, ``bench``, ``server``); ``training`` and ``moe`` build on ``core``.

Importing this package first preloads an optimised BLAS on Linux (models/blas.py); it must happen
before ``mlx.core`` is imported anywhere in the process, so the public names below load lazily.
"""

import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # mlx-lm's tokenizers need no PyTorch; hush that notice

from .models.blas import ensure_fast_blas  # noqa: E402  (after the environment, before anything imports mlx)

ensure_fast_blas()

__version__ = "0.2.0"

# name -> module: resolved on first use (PEP 562), so `import m2r2_mlx` stays cheap and mlx loads after the BLAS
_PUBLIC = {
    "load": "m2r2_mlx.api",
    "stream_generate": "m2r2_mlx.api",
    "generate": "m2r2_mlx.api",
    "make_sampler": "m2r2_mlx.api",
    "make_logits_processors": "m2r2_mlx.api",
    "GenerationResponse": "m2r2_mlx.api",
    "load_model": "m2r2_mlx.models.registry",
    "LoadedModel": "m2r2_mlx.models.registry",
    "load_adapters": "m2r2_mlx.core.adapters",
    "make_decoder": "m2r2_mlx.decoding.methods",
    "METHODS": "m2r2_mlx.decoding.methods",
    "GenerationConfig": "m2r2_mlx.decoding.config",
    "DecodeConfig": "m2r2_mlx.decoding.config",
    "Sampling": "m2r2_mlx.decoding.sampling",
    "Decoder": "m2r2_mlx.decoding.protocols",
    "TokenEvent": "m2r2_mlx.decoding.events",
    "ChatSession": "m2r2_mlx.decoding.chat",
    "AnswerStats": "m2r2_mlx.decoding.stats",
    "M2R2Error": "m2r2_mlx.errors",
    "json_schema_grammar": "m2r2_mlx.decoding.grammar",
}
__all__ = sorted(_PUBLIC) + ["__version__"]


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'm2r2_mlx' has no attribute {name!r}")
