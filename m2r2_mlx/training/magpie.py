"""Chat requests the base model writes itself (Magpie: Xu et al. 2024, arXiv 2406.08464).

    python -m m2r2_mlx.training.magpie -n 400 -o build/data/magpie.jsonl

An instruction-tuned model given its chat template only up to the opening of a user turn
writes a user request: the kind of request its instruction tuning was made of. Those are
closer to what people ask a chat model than requests built from templates over package
corpora (m2r2_tools.corpora), and they cost no data beyond the model itself; the model then
answers them (self-distillation) like any other prompt file.

Requests that share a run of ``--overlap`` words with an evaluation question file
(``--decontaminate``, e.g. Spec-Bench's) are dropped, so evaluation never sees its own
questions in training. Deterministic for a given seed and model.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from tqdm.auto import tqdm

from ..atomic import atomic_write_text
from ..errors import M2R2Error, run_cli
from .data import generate_batch

SENTINEL = "\u241fM2R2-QUERY\u241f"  # a string no chat template produces, to find where the user's text goes


def pre_query_tokens(tokenizer) -> list[int]:
    """The chat template's tokens up to where a user's first message begins (system prompt included)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": SENTINEL}], tokenize=False, add_generation_prompt=False
    )
    if SENTINEL not in text:
        raise M2R2Error(
            "the model's chat template does not place the user's message verbatim; Magpie needs one that does"
        )
    return list(tokenizer.encode(text[: text.index(SENTINEL)], add_special_tokens=False))


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def normal_form(text: str) -> str:
    """What two requests that differ only in case, spacing or punctuation share."""
    return " ".join(words(text))


def ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


def evaluation_ngrams(path: Path, n: int) -> set[tuple[str, ...]]:
    """Every ``n``-word run in the turns of a Spec-Bench-style question file."""
    if not path.is_file():
        raise M2R2Error(f"question file {path} not found; check --decontaminate")
    out: set[tuple[str, ...]] = set()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                turns = json.loads(line)["turns"]
            except (ValueError, KeyError, TypeError):
                raise M2R2Error(
                    f"{path}:{number} is not a question with 'turns'; --decontaminate takes Spec-Bench's "
                    "question.jsonl format"
                ) from None
            for turn in turns:
                out |= ngrams(str(turn), n)
    return out


def drop_reason(request: str, seen: set[str], banned: set[tuple[str, ...]], overlap: int) -> str | None:
    """Why ``request`` is dropped, or None to keep it."""
    key = normal_form(request)
    if not 3 <= len(key.split()) <= 200:
        return "length"
    if key in seen:
        return "duplicate"
    if banned and ngrams(request, overlap) & banned:
        return "evaluation overlap"
    return None


def sample_requests(
    lm,
    n: int,
    *,
    temperature: float = 1.0,
    top_p: float = 0.95,
    max_tokens: int = 96,
    seed: int = 0,
    banned: set | None = None,
    overlap: int = 8,
    batch_size: int = 64,
    progress=None,
    generate=None,
) -> tuple[list[str], dict[str, int]]:
    """``n`` distinct user requests sampled from the pre-query template; returns them and the drop counts.
    ``generate(prompts, max_tokens)``, yielding (index, tokens, finish reason) as data.generate_batch does,
    samples instead of mlx-lm (the PyTorch trainer's, at its own temperature and top-p).

    Gives up with one clear line after ``20 * n`` samples, as a model that does not end its requests (a base
    model, or a template it was not tuned on) would otherwise be sampled forever."""
    tok = lm.tokenizer
    prefix = pre_query_tokens(tok)
    if generate is None:
        generate = mlx_sampling(lm, temperature, top_p, seed, batch_size)
    kept, seen, dropped = [], set(), {"unfinished": 0, "length": 0, "duplicate": 0, "evaluation overlap": 0}
    while len(kept) < n:
        if sum(dropped.values()) + len(kept) >= 20 * n:
            raise M2R2Error(
                f"only {len(kept)} of {n} requests kept after {20 * n} samples "
                f"({', '.join(f'{k} {v}' for k, v in dropped.items())}); raise --max-tokens, "
                "or use an instruction-tuned model"
            )
        for _, ids, reason in generate([prefix] * batch_size, max_tokens):
            if reason != "stop":  # ran out of tokens mid-request
                dropped["unfinished"] += 1
                continue
            request = tok.decode(ids[:-1]).strip()  # the stop token ends it
            why = drop_reason(request, seen, banned or set(), overlap)
            if why:
                dropped[why] += 1
            elif len(kept) < n:
                seen.add(normal_form(request))
                kept.append(request)
                if progress:
                    progress(1)
    return kept, dropped


def mlx_sampling(lm, temperature: float, top_p: float, seed: int, batch_size: int):
    """Sampling with mlx-lm for sample_requests, seeded."""
    # mlx here, not at the top: the PyTorch trainer imports this module's filters where mlx is not installed
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temperature, top_p)
    mx.random.seed(seed)
    return lambda prompts, max_tokens: generate_batch(lm, prompts, max_tokens, sampler=sampler, batch_size=batch_size)


def _main() -> int:
    ap = argparse.ArgumentParser(
        prog="python -m m2r2_mlx.training.magpie",
        description="Sample chat requests from the base model's own chat template (Magpie).",
    )
    ap.add_argument("-o", "--output", required=True, help="prompts jsonl to write (one {'category', 'turns'} per line)")
    ap.add_argument("-n", "--requests", type=int, default=400, help="distinct requests to keep (default 400)")
    ap.add_argument(
        "--model", default=None, help="base model: alias, repo id, folder or .gguf (default: embedded smollm2)"
    )
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--max-tokens", type=int, default=96, help="a request still open after this many tokens is dropped")
    ap.add_argument(
        "--decontaminate",
        metavar="QUESTIONS.jsonl",
        help="drop requests sharing --overlap consecutive words with these evaluation questions",
    )
    ap.add_argument("--overlap", type=int, default=8, help="words in a run that counts as overlap (default 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="replace an existing output file")
    args = ap.parse_args()
    if args.requests < 1:
        raise M2R2Error(f"--requests must be at least 1, got {args.requests}")
    out = Path(args.output)
    if out.exists() and not args.force:
        raise M2R2Error(f"{out} exists; pass --force to replace it")
    banned = evaluation_ngrams(Path(args.decontaminate), args.overlap) if args.decontaminate else set()

    from ..models.registry import load_model  # here: the filters above import without mlx-lm (m2r2_torch)

    lm = load_model(args.model)
    with tqdm(total=args.requests, desc="sampling requests", unit="request") as bar:
        requests, dropped = sample_requests(
            lm,
            args.requests,
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=args.max_tokens,
            seed=args.seed,
            banned=banned,
            overlap=args.overlap,
            progress=bar.update,
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(json.dumps({"category": "magpie", "turns": [r]}) + "\n" for r in requests))
    print(f"wrote {len(requests)} requests to {out}; dropped: " + ", ".join(f"{k} {v}" for k, v in dropped.items()))
    return 0


def main() -> None:
    sys.exit(run_cli("python -m m2r2_mlx.training.magpie", _main))


if __name__ == "__main__":
    main()
