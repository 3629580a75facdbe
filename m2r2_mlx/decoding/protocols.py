"""The shapes of decoding's parts: a ``Decoder`` (what every mode builds and every app calls); for the speculative
engine, a ``Drafter`` (proposes tokens, reading a ``DraftRequest``) and a ``Planner`` (decides each step what is
drafted and verified: a ``StepPlan``, and learns from each step's ``Outcome``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Protocol, Sequence, runtime_checkable

from ..tracing import NO_TRACE, Tracer

if TYPE_CHECKING:
    from .config import GenerationConfig
    from .draft import Draft
    from .events import TokenEvent
    from .grammar import Constraint
    from .prompt_cache import PromptCache
    from .sampling import Sampling


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
    """What a drafter may read for one speculative step. Each drafter extends the draft at its end."""

    cache: PromptCache | None  # the verifier's cache (a layer drafter runs its layers over it; lookup reads none)
    context: Sequence[int]  # every token so far, ending with the draft's root
    limit: int  # the most drafted tokens the draft may hold
    sampling: Sampling
    eos_ids: set[int]
    # the planner chose how many to draft (``limit``): draft them all, reading no token until the verification
    # reads them; False: the drafter stops on its own (its threshold, the end of sequence)
    planned: bool = False
    constraint: Constraint | None = None  # the answer's grammar (structured output)
    tracer: Tracer = NO_TRACE  # the engine's hooks (a drafter runs its draft head through them)

    def room(self, draft: Draft) -> int:
        """How many more tokens ``draft`` may take."""
        return self.limit - (len(draft) - 1)

    def context_of(self, draft: Draft) -> Sequence[int]:
        """Every token up to the end of ``draft`` (the context itself, uncopied, where the draft is its root)."""
        return self.context if len(draft) == 1 else [*self.context, *draft.tokens[1:]]


@runtime_checkable
class Drafter(Protocol):
    """Extends a draft at its end and leaves the cache as it found it."""

    kind: str  # "lookup", "grammar", "fast" (the M2R2 fast stream) or "layerskip": acceptance is learnt per kind
    name: str  # for logs and the chat ("lookup", "fast@L6")
    free: bool  # proposing costs no model compute (prompt lookup): it proposes every step, before the plan
    exit_layer: int  # layers a drafted token used (0: none)
    keeps_states: bool  # it reads the verifier's final residual states (PromptCache.keep_states)
    prior: float  # the acceptance rate the engine starts from, before it has measured any

    def propose(self, draft: Draft, request: DraftRequest) -> int:
        """Add drafts; returns the model draft steps taken (0 for lookup)."""
        ...


@dataclass(frozen=True)
class StepPlan:
    """One step's decision: how many of the free drafters' positions to verify (the root counts: 1 and no
    ``draft`` is a plain step), and how the model drafter drafts after them (None: it does not)."""

    keep: int
    draft: DraftRequest | None = None

    @property
    def plain(self) -> bool:
        return self.keep == 1 and self.draft is None


@dataclass(frozen=True)
class Outcome:
    """What one step did: the draft verified (for a plain step: the free drafters' proposals, none verified), the
    drafts accepted, the full model's token after them, and the step's seconds (drafting's share apart)."""

    draft: Draft
    accepted: int
    token: int
    seconds: float | None  # None: not timed (a plain stretch's first step waited for its own forward)
    draft_seconds: float = 0.0
    draft_steps: int = 0
    plain: bool = False  # a pipelined plain step (a verification step is not, even of the root alone)


@runtime_checkable
class Planner(Protocol):
    """Everything adaptive in speculative decoding: ``plan`` sees the free drafters' proposals for a step and
    decides what is verified and how the model drafter drafts; ``observe`` learns from each step, plain ones too."""

    def plan(self, draft: Draft, request: DraftRequest) -> StepPlan: ...

    def observe(self, outcome: Outcome) -> None: ...
