"""What m2r2-chat runs: a ``ChatSetup`` (the model and adapters named, the decoding options, an expert budget)
and the chat session it makes; shared by the one-shot answer and the Textual app, which also rebuilds the decoder
when the method or tau changes live."""

from __future__ import annotations

from dataclasses import dataclass, replace

from m2r2_mlx.decoding.chat import ChatSession
from m2r2_mlx.decoding.methods import make_decoder
from m2r2_mlx.decoding.options import DecodingOptions
from m2r2_mlx.decoding.protocols import Decoder
from m2r2_mlx.moe.serve import ExpertBudget, serve_with_budget


@dataclass(frozen=True)
class ChatSetup:
    model: str  # resolved from the names given (hub.resolve_model_and_adapters)
    adapters: str | None = None  # an adapters folder
    options: DecodingOptions = DecodingOptions()
    system_prompt: str | None = None
    experts: ExpertBudget | None = None

    @property
    def method(self) -> str:
        return self.options.decode.method

    def with_method(self, method: str, tau: float | None = None) -> "ChatSetup":
        return replace(self, options=self.options.with_method(method, tau))


def decoder_for(setup: ChatSetup, lm) -> Decoder:
    """The decoder the setup names (also when the app switches method or tau)."""
    return make_decoder(lm, setup.options.decode, setup.adapters)


def make_session(setup: ChatSetup, lm) -> ChatSession:
    decoder = decoder_for(setup, lm)
    expert_cache = None
    # the budget after the decoder: the M2R2 predictor wraps the layers, which would rename the projections
    # LoRA adapters attach to
    if setup.experts is not None:
        e = setup.experts
        expert_cache = serve_with_budget(lm, e.budget, predictor=e.predictor, adapters=setup.adapters)
    return ChatSession(
        lm, system_prompt=setup.system_prompt, decoder=decoder, expert_cache=expert_cache, kv=setup.options.kv
    )
