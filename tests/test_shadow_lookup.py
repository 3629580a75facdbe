"""Prompt lookup's acceptance keeps following the text while the engine decodes plainly: its chain is checked
against the tokens plain decoding emits (policy.ShadowChain), so drafting resumes on a span being copied even with
no probe budget and a prior that says lookup never pays."""

from __future__ import annotations

from m2r2_mlx.decoding.config import GenerationConfig
from m2r2_mlx.decoding.drafters import PromptLookupDrafter
from m2r2_mlx.decoding.drafting import SpecSettings
from m2r2_mlx.decoding.generate import generate
from m2r2_mlx.decoding.policy import ShadowChain
from m2r2_mlx.decoding.speculative import Speculator

PASSAGE = (
    "To reset the router, hold the small button on the back for ten seconds until the lights blink twice. Wait "
    "two minutes, then connect to the network named HOME-5G with the password printed on the label."
)


def test_a_chain_resolves_one_emitted_token_at_a_time_and_closes_at_its_first_miss():
    chain = ShadowChain()
    chain.open([5, 6, 7], 3.0)
    assert chain.resolve(5) == (1, 3.0, True) and chain.active
    assert chain.resolve(9) == (2, 3.0, False) and not chain.active  # a miss: the rest is never tested
    chain.open([5, 6], 1.0)
    assert [chain.resolve(t) for t in (5, 6)] == [(1, 1.0, True), (2, 1.0, True)] and not chain.active


def test_lookup_is_learnt_in_a_plain_stretch_without_probes(lm):
    """Lookup alone, prior 0 (a verdict that it never pays, as many failed answers would leave), no exploration:
    the shadow chains alone bring drafting back on a copied passage; the output stays plain greedy's."""
    engine = Speculator(lm.model, lm.tokenizer, [PromptLookupDrafter()], SpecSettings("cost", explore=0.0))
    engine.acceptance.priors = {"lookup": 0.0}
    messages = [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"}]
    prompt = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    generation = GenerationConfig(48)
    plain = [e.token for e in generate(lm.model, lm.tokenizer, prompt, generation)]
    events = list(engine(prompt, None, generation))
    assert [e.token for e in events] == plain
    first = next((e.index for e in events if e.drafted), None)
    assert first is not None and first <= 16, first  # a few tokens of the copy are enough to see it pays
    accepted, proposed = engine.acceptance.counts[("lookup", 1, -1)]
    assert proposed > 0 and accepted / proposed > 0.5
