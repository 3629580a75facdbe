"""Training data: prompt files, multi-turn self-distillation on the real model, resuming an interrupted run."""

import json

from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.training.data import DistillLog, mask_path, pack_loss_mask, pack_rows, read_prompts, self_distill

import numpy as np
import pytest


def test_read_prompts_takes_prompts_and_turns_and_names_bad_lines(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text(
        json.dumps({"prompt": "Hi"}) + "\n\n" + json.dumps({"turns": ["A?", "B?"], "category": "qa"}) + "\n"
    )
    assert read_prompts(good) == [["Hi"], ["A?", "B?"]]
    for bad in ('{"turns": []}', '{"turns": [1]}', '{"text": "x"}', "not json"):
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps({"prompt": "ok"}) + "\n" + bad + "\n")
        with pytest.raises(M2R2Error, match=r"bad.jsonl:2 "):
            read_prompts(path)


def test_loss_mask_scores_the_positions_that_predict_answers_and_text():
    text = [10, 11, 12, 13, 14]
    chat = [1, 2, 3, 20, 21, 22]  # a three-token prompt, then a three-token answer
    rows = pack_rows([text, chat], 4)
    mask = pack_loss_mask([text, chat], [0, 3], 4)
    assert rows.tolist() == [[10, 11, 12, 13], [14, 1, 2, 3]]  # the tail (20, 21, 22) is dropped, from the mask too
    # text: every position but its last (which would predict the chat's first token); chat: positions 2-4,
    # whose next tokens are the answer's 20, 21, 22; its last position is a seam too
    assert mask.tolist() == [[True, True, True, True], [False, False, False, True]]
    full = pack_loss_mask([text, chat], [0, 3], 1).ravel()
    assert np.flatnonzero(full).tolist() == [0, 1, 2, 3, 7, 8, 9]
    assert mask_path("build/d/data.npy").as_posix() == "build/d/data.mask.npy"


def test_distill_log_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "log.jsonl"
    log = DistillLog(path)
    log.add(0, 0, [1, 2, 3])
    log.add(1, 0, [4])
    with path.open("a") as f:
        f.write('{"i": 2, "turn": 0, "ans')  # the process died mid-write
    assert DistillLog(path).done == {(0, 0): [1, 2, 3], (1, 0): [4]}


@pytest.mark.slow
def test_multi_turn_self_distillation_and_resume(lm, tmp_path):
    tok = lm.tokenizer
    conversations = [["Name a colour."], ["Name a fruit.", "Why is it good for you?"]]
    log = tmp_path / "distilled.jsonl"
    first = self_distill(lm, conversations, 12, log_path=log)
    lines = log.read_text().splitlines()
    assert len(lines) == 3  # one answer per user turn

    one, two = first
    # a transcript is the templated conversation, then the last answer's own token ids
    assert one.tokens[: one.prompt_len] == tok.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], add_generation_prompt=True
    )
    assert 1 <= len(one.tokens) - one.prompt_len <= 12
    first_answer = json.loads(lines[[json.loads(l)["i"] for l in lines].index(1)])["answer"]
    history = tok.decode(two.tokens[: two.prompt_len])
    assert tok.decode([t for t in first_answer if t not in tok.eos_token_ids]).strip() in history
    assert history.count("Why is it good for you?") == 1 and history.endswith("assistant\n")

    # rerun: everything comes from the log, nothing is generated again
    again = self_distill(lm, conversations, 12, log_path=log)
    assert [t.tokens for t in again] == [t.tokens for t in first]
    assert log.read_text().splitlines() == lines


@pytest.mark.slow
def test_distillation_under_the_cpu_kernels_gives_the_same_answers(lm):
    """Batched prompts of different lengths (padding masks) through the training kernels: same greedy tokens."""
    from m2r2_mlx.training.cpu_kernels import fast_kernels

    conversations = [["Name a colour."], ["Write one sentence about the sea and the wind."], ["What is 7 times 8?"]]
    exact = self_distill(lm, conversations, 10)
    with fast_kernels(lm.model) as on:
        fast = self_distill(lm, conversations, 10)
    assert on and [t.tokens for t in fast] == [t.tokens for t in exact]
