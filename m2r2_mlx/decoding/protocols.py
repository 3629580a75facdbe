"""The shapes of decoding's parts: a ``Decoder`` (what every mode builds and every app calls); for the speculative
engine, a ``Drafter`` (proposes tokens, reading a ``DraftRequest``) and a ``Planner`` (decides each step what is
drafted and verified: a ``StepPlan``, and learns from each step's ``Outcome``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from .config import GenerationConfig
    from .events import TokenEvent
    from .grammar import Constraint
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
    """What a drafter may read for one speculative step (the tree's root: the last token, not yet in the cache)."""

    cache: PromptCache | None  # the verifier's cache (a layer drafter runs its layers over it; lookup reads none)
    context: Sequence[int]  # every token so far, ending with the root
    limit: int  # the most tokens a path may draft
    sampling: Sampling
    eos_ids: set[int]
    width: int = 1  # candidates at the first draft position
    # after drafting a node, whether to draft another: go_on(tree, node) (None: the drafter's own threshold)
    go_on: Callable[[DraftTree, int], bool] | None = None
    after: int = 0  # draft after this node of the tree (default the root); ``context`` ends with its token
    constraint: Constraint | None = None  # the answer's grammar (structured output)


@runtime_checkable
class Drafter(Protocol):
    """Adds proposals to a draft tree after ``request.after`` and leaves the cache as it found it."""

    kind: str  # "lookup", "grammar", "fast" (the M2R2 fast stream) or "layerskip": acceptance is learnt per kind
    name: str  # for logs and the chat ("lookup", "fast@L6")
    free: bool  # proposing costs no model compute (prompt lookup): it proposes every step, before the plan
    exit_layer: int  # layers a drafted token used (0: none)
    keeps_states: bool  # it reads the verifier's final residual states (PromptCache.keep_states)
    prior: float  # the acceptance rate the engine starts from, before it has measured any

    def propose(self, tree: DraftTree, request: DraftRequest) -> int:
        """Add proposals; returns the model draft steps taken (0 for lookup)."""
        ...


@dataclass(frozen=True)
class StepPlan:
    """One step's decision: the free drafters' nodes to verify (root first; the root alone and no ``draft``: a plain
    step), and where the model drafter drafts (None: it does not)."""

    keep: Sequence[int]
    draft: DraftRequest | None = None

    @property
    def plain(self) -> bool:
        return len(self.keep) == 1 and self.draft is None


@dataclass(frozen=True)
class Outcome:
    """What one step did: the tree verified (for a plain step: the free drafters' proposals, none verified), the
    path accepted, the full model's token after it, and the step's seconds (drafting's share apart)."""

    tree: DraftTree
    path: Sequence[int]
    token: int
    seconds: float | None  # None: not timed (a plain stretch's first step waited for its own forward)
    draft_seconds: float = 0.0
    draft_steps: int = 0
    plain: bool = False  # a pipelined plain step (a verification step is not, even of the root alone)


@runtime_checkable
class Planner(Protocol):
    """Everything adaptive in speculative decoding: ``plan`` sees the free drafters' proposals for a step and
    decides what is verified and how the model drafter drafts; ``observe`` learns from each step, plain ones too."""

    def plan(self, tree: DraftTree, request: DraftRequest) -> StepPlan: ...

    def observe(self, outcome: Outcome) -> None: ...
