"""m2r2-chat on an MoE model within an expert memory budget: same answer, expert stats shown."""

import asyncio

import mlx.core as mx
import pytest
from textual.widgets import Static

from m2r2_tui.app import ChatApp
from tests.test_tui import _ask, _setup
from tests.tiny import tiny_olmoe_folder

from .inprocess import run_main


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    """A tiny random OLMoE with the embedded model's real tokenizer: a real folder m2r2-chat loads."""
    return tiny_olmoe_folder(tmp_path_factory.mktemp("models") / "tiny-olmoe-chat")


def _chat(folder, *extra, home):
    return run_main(
        "m2r2_tui.chat",
        "--model",
        folder,
        "--prompt",
        "Hello there",
        "--max-tokens",
        "8",
        *extra,
        env={"M2R2_HOME": str(home)},
    )


@pytest.mark.slow
def test_budgeted_chat_answers_exactly_as_all_resident(moe_folder, tmp_path):
    full = _chat(moe_folder, home=tmp_path)
    budgeted = _chat(moe_folder, "--memory-budget", "50%", home=tmp_path)
    assert full.returncode == 0 and budgeted.returncode == 0, budgeted.stderr[-1500:]
    assert budgeted.stdout == full.stdout and budgeted.stdout.strip()
    assert "experts:" in budgeted.stderr and "hit" in budgeted.stderr
    assert (tmp_path / "experts").is_dir()  # exported once into m2r2's cache folder


@pytest.mark.slow
def test_memory_budget_on_a_dense_model_is_one_line(tmp_path):
    r = run_main("m2r2_tui.chat", "--prompt", "Hi", "--memory-budget", "25%")
    assert r.returncode != 0 and "mixture-of-experts" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_fast_predictor_with_lora_adapters_in_speculative_mode(moe_folder, tmp_path):
    """The predictor's layer taps must not break LoRA adapters the decoder loads (names inside layers)."""
    from m2r2_mlx.core.adapters import new_m2r2, save_adapters
    from m2r2_mlx.models.registry import load_model

    from mlx.utils import tree_map

    lm = load_model(str(moe_folder), tokenizer=False)
    m = new_m2r2(lm, gates=[2], rank=4, lora_targets=["q_proj", "v_proj"])
    mx.random.seed(3)
    m.update(tree_map(lambda p: 0.05 * mx.random.normal(p.shape), m.parameters()))
    save_adapters(m, tmp_path / "lora")
    full = _chat(moe_folder, home=tmp_path)
    spec = _chat(
        moe_folder,
        "--memory-budget",
        "50%",
        "--expert-predictor",
        "fast",
        "--adapters",
        str(tmp_path / "lora"),
        "--method",
        "speculative",
        home=tmp_path,
    )
    assert spec.returncode == 0, spec.stderr[-1500:]
    assert spec.stdout == full.stdout  # lossless speculative decoding on budgeted experts


def test_chat_panel_shows_expert_hit_rate_and_budget(moe_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("M2R2_HOME", str(tmp_path))

    async def run():
        app = ChatApp(_setup("--model", str(moe_folder), "--memory-budget", "25%", "--max-tokens", "6"))
        async with app.run_test(size=(120, 40)) as pilot:
            await _ask(pilot, app, "Hello there")
            stats = str(app.query_one("#stats", Static).render())
            assert "experts hit" in stats and "moved/token" in stats and "25%" in stats
            assert app.session.expert_cache.stats.tokens > 0

    asyncio.run(run())


def test_the_server_serves_an_moe_within_a_budget(moe_folder, tmp_path, monkeypatch):
    """m2r2-server --memory-budget: the model thread loads the model lazily and serves its experts from the disk."""
    from m2r2_mlx.moe import CachedSwitchGLU, moe_blocks

    from m2r2_server.cli import _load, build_parser

    monkeypatch.setenv("M2R2_HOME", str(tmp_path))
    args = build_parser().parse_args(["--model", str(moe_folder), "--memory-budget", "25%"])
    lm = _load(args.model, args.memory_budget, args.expert_predictor)
    blocks = moe_blocks(lm.model)
    assert blocks and all(isinstance(b.switch_mlp, CachedSwitchGLU) for _, b in blocks)
    cache = blocks[0][1].switch_mlp.cache
    try:
        assert cache.slots_per_layer[cache.layers[0]] * 4 == cache.num_experts(cache.layers[0])
        lm.model(mx.array([[3, 17, 42, 8]]))
        assert cache.loader.reads > 0 or cache.stats.hits > 0
    finally:
        cache.close()
