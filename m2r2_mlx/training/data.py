"""Training data: plain text files and self-distilled chat answers, as fixed-length token rows.

Its formats (prompt files, answer logs, packed rows and loss masks) are shared with the PyTorch trainer
(m2r2_torch), which runs where mlx may not be installed: this module imports mlx-lm only inside
``generate_batch``, the one function that generates with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

from ..atomic import atomic_save_npy
from ..errors import M2R2Error
from .config import TrainConfig

DATA_CACHE = "data.npy"  # token rows, self-distilled answers included: generated once per output folder
# beside it, data.mask.npy (mask_path): the positions that predict an answer or text token
DISTILL_LOG = "distilled.jsonl"  # answers as they finish, for resuming an interrupted self-distillation


def read_text_files(paths: Sequence[str | Path]) -> list[str]:
    texts = []
    for p in paths:
        p = Path(p)
        if not p.is_file():
            raise M2R2Error(f"text file {p} not found; check --text")
        texts.append(p.read_text(encoding="utf-8", errors="replace"))
    return texts


def read_prompts(path: str | Path) -> list[list[str]]:
    """A jsonl of conversations, one per line: {"prompt": "..."} or {"turns": ["...", ...]} (user turns)."""
    path = Path(path)
    if not path.is_file():
        raise M2R2Error(f"prompts file {path} not found; check --prompts")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            turns = [obj["prompt"]] if "prompt" in obj else list(obj["turns"])
            if not turns or not all(isinstance(t, str) for t in turns):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise M2R2Error(f"{path}:{n} is not a JSON object with 'prompt' or a non-empty list of 'turns'") from None
        out.append(turns)
    return out


def pack_rows(token_lists: list[list[int]], seq_len: int) -> np.ndarray:
    """Concatenate token lists and cut them into rows of ``seq_len`` (the tail is dropped)."""
    flat = np.fromiter((t for toks in token_lists for t in toks), dtype=np.int32)
    return _cut_rows(flat, seq_len)


def pack_loss_mask(token_lists: list[list[int]], scored_from: list[int], seq_len: int) -> np.ndarray:
    """Which positions of ``pack_rows(token_lists, seq_len)`` the loss should score: position t of a
    sequence predicts its token t+1, and is scored when that token is in the same sequence at index
    ``scored_from`` or later (a transcript's answer: its prompt length; plain text: 0, every next token).
    A sequence's last position predicts the next sequence's first token, a seam of the packing: never scored."""
    if len(scored_from) != len(token_lists):
        raise ValueError("one scored_from per token list")
    flat = np.zeros(sum(map(len, token_lists)), dtype=bool)
    at = 0
    for toks, s in zip(token_lists, scored_from):
        flat[at + max(s - 1, 0) : at + len(toks) - 1] = True
        at += len(toks)
    return _cut_rows(flat, seq_len)


def _cut_rows(flat: np.ndarray, seq_len: int) -> np.ndarray:
    n = len(flat) // seq_len
    if n == 0:
        raise M2R2Error(f"only {len(flat)} tokens of training data; need at least one row of {seq_len}")
    return flat[: n * seq_len].reshape(n, seq_len)


def mask_path(rows_path: str | Path) -> Path:
    """Where the loss mask of a rows file lives: data.npy -> data.mask.npy."""
    rows_path = Path(rows_path)
    return rows_path.with_name(rows_path.name.removesuffix(".npy") + ".mask.npy")


@dataclass
class Transcript:
    tokens: list[int]  # the templated conversation up to the last answer, then that answer's exact token ids
    prompt_len: int  # tokens before the last answer


class DistillLog:
    """Finished answers appended to a jsonl file as they come, so an interrupted run resumes
    where it stopped (a torn last line is ignored)."""

    def __init__(self, path: Path | None):
        self.path, self.done = path, {}
        if path and path.is_file():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                    self.done[(rec["i"], rec["turn"])] = rec["answer"]
                except (ValueError, KeyError, TypeError):
                    continue

    def add(self, i: int, turn: int, answer: list[int]) -> None:
        self.done[(i, turn)] = answer
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps({"i": i, "turn": turn, "answer": answer}) + "\n")


def generate_batch(
    lm, prompts: list[list[int]], max_tokens: int, *, sampler=None, batch_size: int = 96
) -> Iterator[tuple[int, list[int], str]]:
    """Generate from every prompt at once with continuous batching (mlx-lm's BatchGenerator); yields
    (prompt index, tokens, finish reason) as each sequence finishes. The tokens end with the stop token
    when the reason is "stop"; ``sampler`` None is greedy. Closing the iterator early stops generation."""
    if not prompts:
        return
    # here, not at the top: the data formats above must import without mlx (the PyTorch trainer's machines)
    from mlx_lm.generate import BatchGenerator

    eos = lm.tokenizer.eos_token_ids
    gen = BatchGenerator(
        lm.model,
        stop_tokens=[[t] for t in eos],
        sampler=sampler,
        completion_batch_size=batch_size,
        prefill_batch_size=16,
    )
    try:
        uids = gen.insert(prompts, [max_tokens] * len(prompts))
        index = {uid: k for k, uid in enumerate(uids)}
        tokens: dict[int, list[int]] = {uid: [] for uid in uids}
        while responses := gen.next_generated():
            for r in responses:
                tokens[r.uid].append(r.token)
                if r.finish_reason is not None:
                    yield index[r.uid], tokens.pop(r.uid), r.finish_reason
    finally:
        gen.close()


def self_distill(
    lm,
    conversations: list[list[str]],
    max_tokens: int,
    log_path: Path | None = None,
    batch_size: int = 96,
    progress=None,
    generate=None,
) -> list[Transcript]:
    """The base model's own greedy answers to every user turn, as chat transcripts.

    Turn t of a conversation is answered with the earlier turns and answers in its
    context, templated as the chat app templates its history. Each transcript ends with
    the last answer's exact generated token ids (plus end-of-sequence when it stopped by
    itself). Generation batches continuously (mlx-lm's BatchGenerator); ``log_path``
    keeps finished answers so that a rerun skips them. ``generate(prompts, max_tokens)``, yielding
    (prompt index, tokens, finish reason) as generate_batch does, replaces mlx-lm's generation (the
    PyTorch trainer's); ``lm.tokenizer`` gives eos_token_ids, apply_chat_template (token ids) and decode.
    """
    tok = lm.tokenizer
    log = DistillLog(log_path)
    eos = set(tok.eos_token_ids)
    transcripts: list[Transcript | None] = [None] * len(conversations)
    if generate is None:
        generate = lambda prompts, n: generate_batch(lm, prompts, n, batch_size=batch_size)

    def messages(i: int, upto: int) -> list[dict]:
        msgs = []
        for t in range(upto + 1):
            msgs.append({"role": "user", "content": conversations[i][t]})
            if t < upto:
                answer = [x for x in log.done[(i, t)] if x not in eos]
                msgs.append({"role": "assistant", "content": tok.decode(answer).strip()})
        return msgs

    for turn in range(max(len(c) for c in conversations)):
        todo = [i for i, c in enumerate(conversations) if len(c) > turn]
        prompts = {i: tok.apply_chat_template(messages(i, turn), add_generation_prompt=True) for i in todo}
        pending = [i for i in todo if (i, turn) not in log.done]
        if progress:
            progress(len(todo) - len(pending))
        for k, answer, _ in generate([prompts[i] for i in pending], max_tokens):
            log.add(pending[k], turn, answer)  # a stop token is kept: the transcript ends with it
            if progress:
                progress(1)
        for i in todo:
            if len(conversations[i]) == turn + 1:
                transcripts[i] = Transcript(list(prompts[i]) + list(log.done[(i, turn)]), len(prompts[i]))
    return transcripts


def load_rows(config: TrainConfig, lm, out: Path, generate=None) -> tuple[np.ndarray, np.ndarray | None]:
    """Token rows from text files and self-distilled answers (cached in OUTPUT/data.npy, or given by --data),
    and their loss mask (pack_loss_mask; cached beside them), None where there is none. From ``config``: data,
    text, prompts, answer_tokens, seq_len and seed; ``generate``: as for self_distill."""
    if config.data:
        path = Path(config.data)
        if not path.is_file():
            raise M2R2Error(f"--data {path} not found; pass the data.npy of an earlier m2r2-train output folder")
        try:
            rows = np.load(path)
        except ValueError:
            raise M2R2Error(f"--data {path} is not a .npy array of token rows; pass an earlier data.npy") from None
        if rows.ndim != 2 or rows.shape[1] != config.seq_len or not np.issubdtype(rows.dtype, np.integer):
            raise M2R2Error(
                f"--data {path} holds {rows.dtype} rows of shape {rows.shape}, not token ids (N, {config.seq_len}); "
                "match --seq-len"
            )
        return rows, _load_mask(mask_path(path), rows.shape)
    cache = out / DATA_CACHE
    if cache.is_file() and (mask_path(cache).is_file() or not (config.text or config.prompts)):
        rows = np.load(cache)
        return rows, _load_mask(mask_path(cache), rows.shape)
    seqs = [lm.tokenizer.encode(t, add_special_tokens=False) for t in read_text_files(config.text)]
    scored_from = [0] * len(seqs)  # plain text: every next token
    if config.prompts:
        conversations = read_prompts(config.prompts)
        if conversations:
            with tqdm(total=sum(map(len, conversations)), desc="self-distilling answers", unit="answer") as bar:
                # answers are logged as they finish: an interrupted run resumes here without losing them
                transcripts = self_distill(
                    lm,
                    conversations,
                    config.answer_tokens,
                    log_path=out / DISTILL_LOG,
                    progress=bar.update,
                    generate=generate,
                )
            seqs += [t.tokens for t in transcripts]
            # the last answer only: the loss skips prompt and template
            scored_from += [t.prompt_len for t in transcripts]
    if not seqs:
        raise M2R2Error("no training data: pass --text FILE... and/or --prompts FILE.jsonl (with prompts in it)")
    rows, mask = pack_rows(seqs, config.seq_len), pack_loss_mask(seqs, scored_from, config.seq_len)
    order = np.random.default_rng(config.seed).permutation(len(rows))
    rows, mask = rows[order], mask[order]
    if cache.is_file():  # rows packed before masks were kept: add their mask, never replace them
        if not np.array_equal(np.load(cache), rows):
            raise M2R2Error(
                f"{cache} holds other rows than --text/--prompts give; use another -o, or --force to rebuild"
            )
    else:
        atomic_save_npy(cache, rows)
    atomic_save_npy(mask_path(cache), mask)
    return rows, mask


def _load_mask(path: Path, shape: tuple) -> np.ndarray | None:
    if not path.is_file():
        return None
    mask = np.load(path)
    if mask.shape != shape or mask.dtype != bool:
        raise M2R2Error(f"{path} is not a boolean loss mask of shape {shape}; rebuild the rows with --stage data")
    return mask


@dataclass(frozen=True)
class RowSplit:
    """Held-out rows (the first ones) and training rows, each with its loss mask (None without one)."""

    train: np.ndarray
    heldout: np.ndarray
    train_mask: np.ndarray | None
    heldout_mask: np.ndarray | None


def split_rows(config: TrainConfig, rows: np.ndarray, mask: np.ndarray | None, out: Path) -> RowSplit:
    """The first eval_rows rows (at most a tenth, at least one) held out, the rest to train on; checks that the
    loss has its mask (loss_on "answers") and the training rows fill a batch."""
    if config.loss_on == "answers" and mask is None:
        where = mask_path(config.data or out / DATA_CACHE)
        raise M2R2Error(
            f"--loss-on answers needs the rows' loss mask {where}; rebuild the rows with --stage data, which writes it"
        )
    n = min(config.eval_rows, max(1, len(rows) // 10))
    split = RowSplit(rows[n:], rows[:n], None if mask is None else mask[n:], None if mask is None else mask[:n])
    if len(split.train) < config.batch_size:
        raise M2R2Error(
            f"{len(split.train)} training rows of {config.seq_len} tokens is fewer than one batch; add data"
        )
    return split
