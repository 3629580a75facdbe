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
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from ..atomic import atomic_write_text
from ..errors import M2R2Error, run_cli
from .data import generate_batch

PROG = "python -m m2r2_mlx.training.magpie"
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


@dataclass(frozen=True)
class MagpieConfig:
    """How requests are sampled and which are kept."""

    temperature: float = 1.0
    top_p: float = 0.95
    max_tokens: int = 96  # a request still open after this many tokens is dropped
    seed: int = 0
    overlap: int = 8  # words in a run shared with an evaluation question that drops a request
    batch_size: int = 64  # requests sampled per pass


def sample_requests(
    lm, n: int, config: MagpieConfig = MagpieConfig(), banned: set | None = None, progress=None, generate=None
) -> tuple[list[str], dict[str, int]]:
    """``n`` distinct user requests sampled from the pre-query template; returns them and the drop counts.
    ``banned``: evaluation_ngrams of the questions to keep out. ``generate(prompts, max_tokens)``, yielding (index,
    tokens, finish reason) as data.generate_batch does, samples instead of mlx-lm (the PyTorch trainer's, at its own
    temperature and top-p).

    Gives up with one clear line after ``20 * n`` samples, as a model that does not end its requests (a base
    model, or a template it was not tuned on) would otherwise be sampled forever."""
    tok = lm.tokenizer
    prefix = pre_query_tokens(tok)
    if generate is None:
        generate = mlx_sampling(lm, config)
    kept, seen, dropped = [], set(), {"unfinished": 0, "length": 0, "duplicate": 0, "evaluation overlap": 0}
    while len(kept) < n:
        if sum(dropped.values()) + len(kept) >= 20 * n:
            raise M2R2Error(
                f"only {len(kept)} of {n} requests kept after {20 * n} samples "
                f"({', '.join(f'{k} {v}' for k, v in dropped.items())}); raise --max-tokens, "
                "or use an instruction-tuned model"
            )
        for _, ids, reason in generate([prefix] * config.batch_size, config.max_tokens):
            if reason != "stop":  # ran out of tokens mid-request
                dropped["unfinished"] += 1
                continue
            request = tok.decode(ids[:-1]).strip()  # the stop token ends it
            why = drop_reason(request, seen, banned or set(), config.overlap)
            if why:
                dropped[why] += 1
            elif len(kept) < n:
                seen.add(normal_form(request))
                kept.append(request)
                if progress:
                    progress(1)
    return kept, dropped


def mlx_sampling(lm, config: MagpieConfig):
    """Sampling with mlx-lm for sample_requests, seeded."""
    # mlx here, not at the top: the PyTorch trainer imports this module's filters where mlx is not installed
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(config.temperature, config.top_p)
    mx.random.seed(config.seed)
    return lambda prompts, max_tokens: generate_batch(
        lm, prompts, max_tokens, sampler=sampler, batch_size=config.batch_size
    )


def add_magpie_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of MagpieConfig and of the output, shared with the PyTorch sampler (python -m m2r2_torch.magpie)."""
    d = MagpieConfig()
    p.add_argument("-o", "--output", required=True, help="prompts jsonl to write (one {'category', 'turns'} per line)")
    p.add_argument("-n", "--requests", type=int, default=400, help="distinct requests to keep (default 400)")
    p.add_argument(
        "--model", default=None, help="base model: alias, repo id, folder or .gguf (default: embedded smollm2)"
    )
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument(
        "--max-tokens", type=int, default=d.max_tokens, help="a request still open after this many tokens is dropped"
    )
    p.add_argument(
        "--decontaminate",
        metavar="QUESTIONS.jsonl",
        help="drop requests sharing --overlap consecutive words with these evaluation questions",
    )
    p.add_argument(
        "--overlap", type=int, default=d.overlap, help=f"words in a run that counts as overlap (default {d.overlap})"
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--force", action="store_true", help="replace an existing output file")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Sample chat requests from the base model's own chat template (Magpie)."
    )
    add_magpie_arguments(p)
    return p


def banned_ngrams(decontaminate: str | None, overlap: int) -> set[tuple[str, ...]]:
    return evaluation_ngrams(Path(decontaminate), overlap) if decontaminate else set()


def write_requests(out: Path, requests: list[str], dropped: dict[str, int]) -> None:
    """The requests as a prompts file (data.read_prompts reads it), and a line saying what was dropped."""
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(json.dumps({"category": "magpie", "turns": [r]}) + "\n" for r in requests))
    print(f"wrote {len(requests)} requests to {out}; dropped: " + ", ".join(f"{k} {v}" for k, v in dropped.items()))


def _main() -> int:
    args = build_parser().parse_args()
    if args.requests < 1:
        raise M2R2Error(f"--requests must be at least 1, got {args.requests}")
    out = Path(args.output)
    if out.exists() and not args.force:
        raise M2R2Error(f"{out} exists; pass --force to replace it")
    config = MagpieConfig(args.temperature, args.top_p, args.max_tokens, args.seed, args.overlap)
    banned = banned_ngrams(args.decontaminate, config.overlap)

    from ..models.registry import load_model  # here: the filters above import without mlx-lm (m2r2_torch)

    lm = load_model(args.model)
    with tqdm(total=args.requests, desc="sampling requests", unit="request") as bar:
        requests, dropped = sample_requests(lm, args.requests, config, banned=banned, progress=bar.update)
    write_requests(out, requests, dropped)
    return 0


def main() -> None:
    sys.exit(run_cli(PROG, _main))


if __name__ == "__main__":
    main()
