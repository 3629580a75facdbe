"""Aliases for Mac users (4-bit MLX conversions, full precision under explicit names), checked offline from names
alone; adapters trained on one variant of a model load on the other with one line saying so."""

import m2r2_mlx.models.registry as registry
from m2r2_mlx.core.adapters import load_adapters, new_m2r2, save_adapters
from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.models.registry import ALIASES, DOWNLOAD_SIZES, LoadedModel, alias_help, family, variant_note

import pytest

from m2r2_tui.chat import build_parser
from tests.tiny import tiny_model


@pytest.mark.parametrize(
    "alias, repo",
    [
        ("phi3", "mlx-community/Phi-3-mini-4k-instruct-4bit"),
        ("phi3-bf16", "microsoft/Phi-3-mini-4k-instruct"),
        ("olmoe", "mlx-community/OLMoE-1B-7B-0924-Instruct-4bit"),
        ("OLMoE-bf16", "allenai/OLMoE-1B-7B-0924-Instruct"),
    ],
)
def test_aliases_resolve_to_their_repos_without_downloading(alias, repo, monkeypatch, tmp_path):
    asked = []

    def snapshot(repo_id, allow_patterns):  # the Hub is never reached: the name alone decides
        asked.append(repo_id)
        return str(tmp_path)

    monkeypatch.setattr(registry, "snapshot_download", snapshot)
    assert registry.resolve_model_path(alias) == tmp_path
    assert asked == [repo]


def test_every_alias_has_a_download_size_and_the_chat_help_names_them():
    assert set(DOWNLOAD_SIZES) == set(ALIASES)
    text = " ".join(build_parser().format_help().split())
    for name in ALIASES:
        assert f"{name} ({DOWNLOAD_SIZES[name]})" in " ".join(alias_help().split())
    assert "phi3 (4-bit, 2.2 GB)" in text and "phi3-bf16 (bfloat16, 7.6 GB)" in text


def test_variants_of_one_model_are_told_apart_from_other_models():
    assert family("phi3") == family("phi3-bf16") == family("microsoft/Phi-3-mini-4k-instruct") == "phi3"
    assert family("smollm2") is None and family("owner/other") is None
    assert variant_note("phi3-bf16", "phi3") is not None
    assert variant_note("phi3", "mlx-community/Phi-3-mini-4k-instruct-4bit") is None  # the same weights
    assert variant_note("phi3", "olmoe") is None and variant_note("smollm2", "smollm2") is None


def _as(lm, name: str, **config) -> LoadedModel:
    return LoadedModel(name, lm.path, lm.model, lm.tokenizer, dict(lm.config, **config))


def test_adapters_on_the_other_variant_load_with_one_line(tmp_path, capsys):
    base = tiny_model("phi3")
    m2r2 = new_m2r2(_as(base, "phi3-bf16"), gates=[3], rank=4)
    save_adapters(m2r2, tmp_path / "adapters")
    # the 4-bit conversion's config.json may differ beyond its quantization (another converter's keys)
    loaded = load_adapters(_as(base, "phi3", converter_note="4-bit"), tmp_path / "adapters")
    assert loaded.config.gates == [3]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trained on phi3-bf16" in err[0] and "loaded on phi3" in err[0]

    load_adapters(_as(base, "phi3-bf16"), tmp_path / "adapters")  # the same variant: nothing to say
    assert capsys.readouterr().err == ""


def test_adapters_for_another_model_are_still_refused(tmp_path):
    base = tiny_model("phi3")
    save_adapters(new_m2r2(_as(base, "phi3-bf16"), gates=[3], rank=4), tmp_path / "adapters")
    with pytest.raises(M2R2Error, match="were made for base 'phi3-bf16'"):
        load_adapters(_as(base, "olmoe", hidden_act="gelu"), tmp_path / "adapters")
