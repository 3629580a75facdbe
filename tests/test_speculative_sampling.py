"""Speculative sampling draws from the base model's own distribution (rejection sampling).

A tiny 12-token model makes the exact distribution of the first three answer tokens
computable (1,728 outcomes). Speculative sampling with M2R2 drafts (q != p; also with a
confidence threshold that ends the chain), with prompt-lookup drafts, and with hybrid drafts
(lookup's copy, then the fast stream's samples after it, chosen by the cost planner or not)
must match it within the sampling noise of N draws, also under top-k, min-p, a logit bias and the repetition,
presence and frequency penalties (whose target depends on each row's history); a verifier that skips the rejection
step must not (the test can fail).
"""

import m2r2_mlx.decoding.speculative as speculative
from m2r2_mlx.core.adapters import new_m2r2
from m2r2_mlx.decoding.config import GenerationConfig
from m2r2_mlx.decoding.costs import StepCosts
from m2r2_mlx.decoding.draft import Verified
from m2r2_mlx.decoding.drafters import LayerDrafter, PromptLookupDrafter
from m2r2_mlx.decoding.planner import CostPlanner, VerifyAll
from m2r2_mlx.decoding.sampling import Sampling, sample_from, sampling_probs
from m2r2_mlx.decoding.speculative import Speculator, SpeculatorSettings

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from .tiny import EosAs, speculative_generate, tiny_model

V, N = 12, 2000
PROMPT = [3, 5, 7, 3, 5]


@pytest.fixture(scope="module")
def setup(lm):
    base = tiny_model("llama", seed=11, vocab_size=V, num_hidden_layers=2)
    emb = base.model.model.embed_tokens
    emb.weight = emb.weight * 1.5  # peakier distributions: more mass where the test can see it
    m2r2 = new_m2r2(base, gates=[1])
    mx.random.seed(12)
    m2r2.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.3, m2r2.parameters()))
    mx.eval(base.model.parameters(), m2r2.parameters())
    return base.model, m2r2, EosAs(lm.tokenizer, eos=10**6)


def exact_joint(model, s: Sampling) -> np.ndarray:
    """P(t1, t2, t3) for the answer's first three tokens, by enumeration (row by row when the target reads the
    history: a penalty)."""
    pairs = np.array([(a, b) for a in range(V) for b in range(V)])
    ids = np.concatenate([np.tile(PROMPT, (len(pairs), 1)), pairs], axis=1)
    logits = s.biased(model(mx.array(ids)))
    n = len(PROMPT)

    def probs(rows: mx.array, upto: int) -> np.ndarray:  # (len(pairs), V): the target after ids[:, :upto]
        if not s.reads_history:
            return np.array(sampling_probs(rows, s))
        return np.stack([np.array(sampling_probs(rows[i], s, ids[i, :upto].tolist())) for i in range(len(ids))])

    p1 = probs(logits[:1, n - 1], n)[0]
    p2 = probs(logits[:, n], n + 1).reshape(V, V, V)[:, 0, :]  # rows t1 (t2 column unused)
    p3 = probs(logits[:, n + 1], n + 2).reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def sampled_joint(model, tok, decoder, s: Sampling) -> np.ndarray:
    counts = np.zeros((V, V, V))
    mx.random.seed(2024)
    generation = GenerationConfig(4, s)
    for _ in range(N):
        toks = [e.token for e in decoder(PROMPT, None, generation)]
        counts[tuple(toks[:3])] += 1
    return counts / N


def both(m2r2, prior: float | None = None) -> list:
    return [PromptLookupDrafter(prior=prior or 0.5), LayerDrafter(m2r2, 0, prior=prior)]


def cost_planned(model, tok, drafters) -> Speculator:
    return Speculator(model, tok, drafters, CostPlanner(drafters, StepCosts(draft_fraction=0.2)), SpeculatorSettings(2))


def chain(model, tok, drafter):
    return lambda prompt, cache, generation: speculative_generate(model, tok, prompt, drafter, generation, max_draft=2)


def tv_bound(p: np.ndarray, trials: int = 2000) -> float:
    """A quarter above the largest total-variation distance that ``trials`` sets of N exact draws from p reach. A
    closed form (the mean of |X/N - p| summed over cells) misjudges the tail where a few cells hold most of the
    mass; there an exact sampler failed it about once in 30 runs."""
    draws = np.random.default_rng(1).multinomial(N, p.ravel(), size=trials) / N
    return 1.25 * 0.5 * np.abs(draws - p.ravel()).sum(axis=1).max()


def accept_every_draft(logits, draft, s, history=(), constraint=None, logprobs=False):  # no rejection step
    context = list(history) + draft.tokens
    return Verified(len(draft) - 1, sample_from(sampling_probs(s.biased(logits[-1]), s, context)))


CONFIGS = [
    Sampling(1.0, 1.0),
    Sampling(0.8, 0.9),
    Sampling(
        1.0,
        top_k=6,
        min_p=0.03,
        repetition_penalty=1.5,
        repetition_context_size=4,
        presence_penalty=0.7,
        presence_context_size=3,
        frequency_penalty=0.4,
        frequency_context_size=5,
        logit_bias={2: 1.5, 7: -2.0},
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("s", CONFIGS, ids=["temp1", "temp0.8-top_p0.9", "top_k-min_p-penalties-bias"])
def test_speculative_sampling_matches_the_base_distribution(setup, s, monkeypatch):
    model, m2r2, tok = setup
    p = exact_joint(model, s)
    bound = tv_bound(p)
    calibration = np.random.default_rng(0).multinomial(N, p.ravel()).reshape(p.shape) / N
    assert 0.5 * np.abs(calibration - p).sum() < bound  # exact draws pass the bound

    decoders = {
        "chain m2r2": chain(model, tok, LayerDrafter(m2r2, 0)),
        "chain m2r2 threshold": chain(model, tok, LayerDrafter(m2r2, 0, threshold=0.3)),
        "chain lookup": chain(model, tok, PromptLookupDrafter()),
        "hybrid lookup+fast": Speculator(model, tok, both(m2r2), VerifyAll(both(m2r2)), SpeculatorSettings(2)),
        "hybrid lookup+m2r2 cost planner": cost_planned(model, tok, both(m2r2, prior=0.9)),
    }
    if s != CONFIGS[0]:  # the sampler's options shape p and q alike: the hybrid engines (both drafters) carry them
        decoders = {k: v for k, v in decoders.items() if k.startswith("hybrid")}
    for name, decoder in decoders.items():
        got = sampled_joint(model, tok, decoder, s)
        tv = 0.5 * np.abs(got - p).sum()
        print(f"{name}: TV {tv:.3f}, bound {bound:.3f}")
        assert tv < bound, f"{name}: TV {tv:.3f} >= {bound:.3f}"

    monkeypatch.setattr(speculative, "verify", accept_every_draft)
    broken = sampled_joint(model, tok, decoders[next(iter(decoders))], s)
    print(f"no-rejection control: TV {0.5 * np.abs(broken - p).sum():.3f}")
    assert 0.5 * np.abs(broken - p).sum() > bound  # the test has the power to catch a wrong verifier
