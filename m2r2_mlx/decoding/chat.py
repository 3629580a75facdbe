"""A multi-turn conversation over one model, reusing the KV cache across turns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Sequence

from mlx_lm.generate import wired_limit

from ..atomic import atomic_write_text
from ..errors import M2R2Error
from ..models.registry import LoadedModel
from .config import GenerationConfig, KVConfig
from .events import TokenEvent, check_context
from .generate import PlainDecoder
from .prompt_cache import PromptCache
from .protocols import Decoder
from .stops import apply_stops


class ChatSession:
    """Chat history + prompt cache: each turn prefills only what the cache lacks."""

    def __init__(
        self,
        lm: LoadedModel,
        system_prompt: str | None = None,
        decoder: Decoder | None = None,
        expert_cache=None,
        kv: KVConfig | None = None,
    ):
        self.lm = lm
        self.expert_cache = expert_cache  # MoE models served within a memory budget (m2r2_mlx.moe)
        self.decode: Decoder = decoder or PlainDecoder(lm)
        self.system_prompt = system_prompt
        kv = kv or KVConfig()
        self.cache = PromptCache(lm.model, kv.max_kv_size, kv.kv_bits)
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self.cache.reset()

    def prompt_tokens(self, tools: list[dict] | None = None) -> list[int]:
        """The conversation as the model's chat template renders it (with ``tools``, OpenAI-style function specs,
        for a template that supports them)."""
        tok = self.lm.tokenizer
        if getattr(tok, "chat_template", None):
            extra = {"tools": tools} if tools else {}
            ids = tok.apply_chat_template(self.messages, add_generation_prompt=True, **extra)
        else:  # base models without a template: plain concatenation
            ids = tok.encode("\n".join(m["content"] for m in self.messages) + "\n")
        return list(ids)

    def send(self, text: str, generation: GenerationConfig | None = None) -> Iterator[TokenEvent]:
        """Add a user turn and stream the answer; the (partial) answer joins the history."""
        if not text.strip():
            raise M2R2Error("the message is empty; type something to send")
        self.messages.append({"role": "user", "content": text})
        prompt = self.prompt_tokens()
        try:  # checked here, not in the lazy generator, so a refused turn leaves no trace
            check_context(len(prompt), self.lm.context_length)
        except M2R2Error:
            self.messages.pop()
            raise
        return self.answer(prompt, generation)

    def regenerate(self, generation: GenerationConfig | None = None) -> Iterator[TokenEvent]:
        """Drop the last answer and answer the last user turn again."""
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if not self.messages or self.messages[-1]["role"] != "user":
            raise M2R2Error("there is no user message to regenerate an answer for")
        return self.answer(self.prompt_tokens(), generation)

    def answer(
        self, prompt: Sequence[int], generation: GenerationConfig | None = None, decoder: Decoder | None = None
    ) -> Iterator[TokenEvent]:
        """Stream the answer to ``prompt`` (token ids) over the session's cache, with ``decoder`` (default the
        session's), cut at the generation's stop strings; the (partial) answer joins the history."""
        generation = generation or GenerationConfig()
        pieces: list[str] = []
        stream = (decoder or self.decode)(prompt, self.cache, generation)
        try:
            with wired_limit(self.lm.model):  # as mlx-lm decodes: weights wired on Metal (a no-op elsewhere)
                for event in apply_stops(stream, generation.stop):
                    pieces.append(event.text)
                    yield event
        finally:  # also on cancel (generator closed): the history keeps what was shown
            stream.close()
            self.messages.append({"role": "assistant", "content": "".join(pieces)})

    @property
    def last_answer(self) -> str:
        for m in reversed(self.messages):
            if m["role"] == "assistant":
                return m["content"]
        return ""

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        path = Path(path).expanduser()
        if path.exists() and not overwrite:
            raise M2R2Error(f"{path} already exists; choose another name or overwrite it explicitly")
        data = {"model": self.lm.name, "messages": self.messages}
        try:
            return atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False))
        except OSError as e:  # a folder, no permission, a full disk
            raise M2R2Error(f"cannot write {path}: {e.strerror or e}; choose another path") from None

    def load(self, path: str | Path) -> None:
        path = Path(path).expanduser()
        try:
            data = json.loads(path.read_text())
            messages = data["messages"]
            ok = all(
                isinstance(m, dict)
                and m.get("role") in ("system", "user", "assistant")
                and isinstance(m.get("content"), str)
                for m in messages
            )
        except FileNotFoundError:
            raise M2R2Error(f"conversation file {path} not found") from None
        except OSError as e:  # a folder, no permission
            raise M2R2Error(f"cannot read {path}: {e.strerror or e}") from None
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise M2R2Error(
                f"{path} is not a saved conversation (expected JSON with a 'messages' list of role/content)"
            )
        self.messages = messages
        # The cache keeps whatever prefix the loaded history shares with it.
