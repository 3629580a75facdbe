"""Device-to-host reads (m2r2_mlx/host.py): plain decoding reads one per token; the speculative engine reads at most
one per draft-and-verify step (its planned fast-stream drafts stay on the device until the verification reads them
with its own result) and, in a plain stretch, one per token as plain decoding does. Every read in the decoding loops
goes through the counter."""

from __future__ import annotations

import ast
from pathlib import Path

from m2r2_mlx import host
from m2r2_mlx.decoding.config import GenerationConfig
from m2r2_mlx.decoding.methods import make_decoder
from m2r2_mlx.tracing import Tracer

ROOT = Path(__file__).resolve().parents[1]
COPY = "Repeat exactly: The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog."


class Steps(Tracer):
    """The counter's value after each step's outcome, and each step's kind."""

    def __init__(self):
        self.steps: list[tuple[bool, int, int]] = []  # (plain, draft steps, reads so far)

    def on_verify(self, outcome) -> None:
        self.steps.append((outcome.plain, outcome.draft_steps, host.reads()))


def prompt(lm, text: str) -> list[int]:
    return lm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def test_plain_decoding_reads_one_per_token(lm, france_prompt):
    before = host.reads()
    events = list(make_decoder(lm, "plain")(france_prompt, None, GenerationConfig(24)))
    assert host.reads() - before == len(events)


def test_speculative_reads_at_most_one_per_step_and_one_per_plain_token(lm):
    steps, verified = Steps(), 0
    engine = make_decoder(lm, "speculative", tracer=steps)
    for text in (COPY, "Write two sentences about the weather in a city of your choice."):
        steps.steps.clear()
        before = host.reads()
        events = list(engine(prompt(lm, text), None, GenerationConfig(48)))
        reads = [r for *_, r in steps.steps]
        per_step = [b - a for a, b in zip([before + 1, *reads], reads)]  # the first token's read comes first
        kinds = [(plain, drafted) for plain, drafted, _ in steps.steps]
        assert all(n <= 1 for n in per_step), list(zip(kinds, per_step))
        assert all(n == 1 for (plain, _), n in zip(kinds, per_step) if plain)
        assert host.reads() - before <= len(events)  # never more reads than plain decoding of the same tokens
        verified += sum(not plain for plain, _ in kinds)
    assert verified  # the copy was verified in steps of several tokens


def test_every_read_in_the_decoding_loops_is_counted():
    """No .item() or .tolist() on an array in the decoding package and the exit rule: they read through host.read
    (numpy's tolist, on the host already, is no device read; an event's log-probabilities are read when its reader
    asks for them, events.py)."""
    found = []
    paths = [p for p in (ROOT / "m2r2_mlx/decoding").glob("*.py") if p.name != "events.py"]
    for path in [*paths, ROOT / "m2r2_mlx/core/arla.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("item", "tolist")
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    allowed = {
        "ctx[starts[-1] + n:starts[-1] + n + limit].tolist()",
        "context[:-1][-s.history_size:].tolist()",
    }
    assert [f for f in found if f.split(" ", 1)[1] not in allowed] == []
