"""The shapes of decoding's parts: a ``Decoder`` (what every mode builds and every app calls) and a ``Drafter``
(what proposes tokens to the speculative engine), with the ``DraftRequest`` a drafter reads for one step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from .config import GenerationConfig
    from .events import TokenEvent
    from .prompt_cache import PromptCache
    from .sampling import Sampling
    from .tree import DraftTree


@runtime_checkable
class Decoder(Protocol):
    """Decodes one answer: ``decoder(prompt, cache, generation)`` yields a TokenEvent per token. The cache (a
    chat's or a server's, reused across answers: only what it lacks is prefilled) may be None for a fresh one."""

    name: str  # the mode's name ("plain", "speculative", ...)
    exit_layers: Sequence[int]  # the layer counts a token may leave at, for legends (the deepest: the model's)
    needs_adapters: bool  # it cannot run without M2R2 adapters
    note: str  # one line for the app to show when the decoder is built ("" when there is nothing to say)

    def __call__(
        self, prompt: Sequence[int], cache: PromptCache | None = None, generation: GenerationConfig | None = None
    ) -> Iterator[TokenEvent]: ...


@dataclass
class DraftRequest:
    """What a drafter may read for one speculative step. The root of the tree is the last emitted token, not yet
    in the cache."""

    cache: PromptCache | None  # the verifier's cache (a layer drafter runs its layers over it; lookup reads none)
    context: Sequence[int]  # every token so far, ending with the root
    limit: int  # the most tokens a path may draft
    sampling: Sampling
    eos_ids: set[int]
    width: int = 1  # candidates at the first draft position
    go_on: Callable[[int, float], bool] | None = None  # after drafting node (with its probability): draft another?
    after: int = 0  # draft after this node of the tree (default the root)


@runtime_checkable
class Drafter(Protocol):
    """Adds proposals to a draft tree after ``request.after`` and leaves the cache as it found it."""

    kind: str  # "lookup", "fast" (the M2R2 fast stream) or "layerskip": acceptance is learnt per kind
    name: str  # for logs and the chat ("lookup", "m2r2@L6")
    exit_layer: int  # layers a drafted token used (0: none)
    keeps_states: bool  # it reads the verifier's final residual states (PromptCache.keep_states)
    prior: float  # the acceptance rate the engine starts from, before it has measured any

    def propose(self, tree: DraftTree, request: DraftRequest) -> int:
        """Add proposals; returns the model draft steps taken (0 for lookup)."""
        ...
