"""m2r2-chat: chat with a model in the terminal, or print one answer with --prompt.

m2r2-chat                                   # Textual chat on the embedded SmolLM2-135M
m2r2-chat --model phi3                      # a hub model by alias (downloaded once: 4-bit, 2.2 GB)
m2r2-chat --prompt "What is the capital of France?"   # one answer, no UI
echo "What is the capital of France?" | m2r2-chat -p -  # the prompt from stdin
m2r2-chat --adapters owner/repo --mode speculative  # Hub adapters; their base model is the model
m2r2-chat --json-schema person.json -p "..."  # every answer JSON valid under the schema
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import m2r2_mlx  # (first: preloads OpenBLAS on Linux before mlx.core)
from m2r2_mlx.decoding.grammar import json_schema_grammar
from m2r2_mlx.decoding.methods import resolve_for_method
from m2r2_mlx.decoding.options import DecodingOptions, add_model_options, add_options
from m2r2_mlx.decoding.stats import AnswerStats
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.models.blas import blas_info
from m2r2_mlx.models.registry import load_model, resolve_model_path
from m2r2_mlx.moe.predictors import PREDICTORS

from .app import ChatApp
from .session import ChatSetup, ExpertBudget, make_session

CHAT_PREDICTORS = list(PREDICTORS)  # every registered one (the measurement controls live in the bench)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="m2r2-chat", description="Chat with an MLX model; every token is coloured by its exit depth."
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {m2r2_mlx.__version__}")
    add_model_options(p, {n: PREDICTORS[n].help for n in CHAT_PREDICTORS})
    add_options(p)
    p.add_argument("-p", "--prompt", help="print the answer to this prompt and exit (no terminal UI); - reads stdin")
    p.add_argument("--system-prompt", default=None, help="system prompt (default: the model's own)")
    p.add_argument(
        "--json-schema",
        type=Path,
        default=None,
        metavar="FILE",
        help="every answer is JSON valid under this JSON schema (structured output, in every method)",
    )
    return p


def chat_setup(values: dict) -> ChatSetup:
    """From the command line's values: options in range, then the model and adapters decided from their names (a
    method that needs adapters the model has none of fails here, before any download)."""
    options = DecodingOptions.from_values(values)
    if values.get("json_schema") is not None:
        options = replace(
            options, generation=replace(options.generation, grammar=schema_grammar(values["json_schema"]))
        )
    model, folder = resolve_for_method(values["model"], values["adapters"], options.decode.method)
    experts = None
    if values["memory_budget"] is not None:
        experts = ExpertBudget(values["memory_budget"], values["expert_predictor"])
    return ChatSetup(model, None if folder is None else str(folder), options, values["system_prompt"], experts)


def schema_grammar(path: Path) -> str:
    if not path.is_file():
        raise M2R2Error(f"--json-schema: {path} not found; pass a file holding a JSON schema")
    try:
        return json_schema_grammar(path.read_text())
    except M2R2Error as e:
        raise M2R2Error(f"--json-schema {path}: {e}") from None
    except UnicodeDecodeError:
        raise M2R2Error(f"--json-schema {path}: not a text file; pass a file holding a JSON schema") from None


def one_shot(setup: ChatSetup, prompt: str) -> int:
    lm = load_model(setup.model, lazy=setup.experts is not None)  # within a budget: experts never all read
    session = make_session(setup, lm)
    if session.decode.note:
        print(f"note: {session.decode.note}", file=sys.stderr)
    stats = AnswerStats()
    for ev in session.send(prompt, setup.options.generation):
        stats.add(ev)
        sys.stdout.write(ev.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    experts = ""
    if session.expert_cache is not None:
        c = session.expert_cache.stats
        experts = f" | experts: {c.hit_rate:.0%} hit, {c.bytes_per_token / 1e6:.2f} MB/token moved"
        session.expert_cache.close()  # stop the expert loader thread
    print(f"[{lm.name} | {setup.method} | {stats.summary()}{experts} | {blas_info().name} BLAS]", file=sys.stderr)
    return 0


def _main() -> int:
    args = build_parser().parse_args()
    setup = chat_setup(vars(args))
    if args.prompt is not None:
        return one_shot(setup, sys.stdin.read() if args.prompt == "-" else args.prompt)
    resolve_model_path(setup.model)  # bad names fail here with one line; a first import shows progress
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise M2R2Error('no terminal to draw the chat in; pass --prompt "..." for a one-shot answer')
    ChatApp(setup).run()
    return 0


def main() -> None:
    sys.exit(run_cli("m2r2-chat", _main))


if __name__ == "__main__":
    main()
