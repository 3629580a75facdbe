"""m2r2-chat --prompt: one answer for scripts and CI (the installed command once, its main() in this process after)."""

import shutil
import subprocess

import pytest

from .inprocess import run_main

EXE = shutil.which("m2r2-chat")


@pytest.mark.slow
@pytest.mark.skipif(EXE is None, reason="package not installed (pip install -e .)")
def test_one_shot_answer_and_summary():
    r = subprocess.run(
        [EXE, "--prompt", "What is the capital of France?", "--max-tokens", "30"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    summary = r.stderr.strip().splitlines()[-1]
    assert "exit depth [" in summary and "L30x" in summary and "tok/s" in summary and "BLAS" in summary


def test_no_terminal_without_prompt_is_one_line():
    r = run_main("m2r2_tui.chat")  # standard input is not a terminal
    assert r.returncode == 2 and "--prompt" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_draft_and_verify_methods_answer_like_plain():
    q = ["--prompt", "Repeat this sentence: The primary colors are red, yellow and blue.", "--max-tokens", "40"]
    plain = run_main("m2r2_tui.chat", *q, "--method", "plain")
    for mode, extra, exit_mark in [
        ("fast", ["--gate", "24", "--draft", "3"], "L24x"),
        ("speculative", [], None),  # the default: lookup and the fast stream, where they pay
        ("lookup", [], "L0x"),
    ]:
        spec = run_main("m2r2_tui.chat", *q, "--method", mode, *extra)
        assert plain.returncode == spec.returncode == 0, spec.stderr
        assert spec.stdout == plain.stdout, mode  # lossless
        assert exit_mark is None or exit_mark in spec.stderr.splitlines()[-1], mode  # tokens from accepted drafts


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--gate", "7"], "not one of the adapters' gates"),
        (["--threshold", "2"], "--threshold must be in [0, 1]"),
        (["--draft-vocab", "-1"], "--draft-vocab must be 0"),
        (["--draft", "0"], "--draft must be at least 1"),
        (["--threshold", "nan"], "--threshold must be in [0, 1]"),
        (["--tau", "2"], "--tau must be in [0, 1]"),
        (["--adapters", "/no/such/dir"], "not found"),
    ],
)
def test_speculative_mode_bad_input(extra, message):
    r = run_main("m2r2_tui.chat", "--prompt", "hi", "--method", "speculative", *extra)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_json_schema_answer_validates_and_a_bad_schema_is_one_line(tmp_path):
    import json

    import jsonschema

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    q = ["--prompt", "Paris is the capital of France. Give the city and its country.", "--max-tokens", "40"]
    for mode in ("plain", "speculative"):
        r = run_main("m2r2_tui.chat", *q, "--json-schema", tmp_path / "schema.json", "--method", mode)
        assert r.returncode == 0, r.stderr
        jsonschema.validate(json.loads(r.stdout), schema)
    (tmp_path / "bad.json").write_text('{"type": "nonsense"}')
    for path, message in [(tmp_path / "bad.json", "nonsense"), (tmp_path / "none.json", "not found")]:
        r = run_main("m2r2_tui.chat", *q, "--json-schema", path)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
