"""m2r2-bench --tools: tool calls on requests whose right call is known, through the server's own path (its prompt,
its grammar, its parser), every method against plain constrained decoding.

Each request of bench/data/tool_calls.json (weather, arithmetic, unit conversion, calendar, search; five tools
offered each time) is answered under tool_choice "required" (the grammar holds the answer to calls) and "auto"
(text, or calls). Reported: the answers that call a tool, the calls valid under their tool's schema (all of them,
by construction), the right tool and the right arguments (a string names words the value holds, a number is
equal, an expression evaluates to it); and per method the decode tokens/s over the "required" answers, the
speedup over plain constrained decoding, tokens per full-model step, and whether lossless methods gave plain's
tokens. Methods take turns per request, one decoder each for the run.

    m2r2-bench --tools                                                  # the embedded model: tools in the prompt
    m2r2-bench --tools --chat-template tests/data/hermes_tools.jinja   # the same weights under a tool template
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import m2r2_mlx  # noqa: F401  (first: preloads OpenBLAS on Linux before mlx.core)
from m2r2_mlx.atomic import atomic_write_text
from m2r2_mlx.core.hub import packaged_adapters
from m2r2_mlx.decoding.config import DecodeConfig, GenerationConfig
from m2r2_mlx.decoding.methods import METHODS, make_decoder
from m2r2_mlx.decoding.options import DecodingOptions
from m2r2_mlx.decoding.prompt_cache import PromptCache
from m2r2_mlx.decoding.stats import AnswerStats
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.models.blas import blas_info
from m2r2_mlx.models.registry import canonical_name, load_model, resolve_model_path

import jsonschema
from tqdm.auto import tqdm

from m2r2_server.cli import build_parser as server_parser
from m2r2_server.protocol import parse_request
from m2r2_server.tools import ToolCallSplitter, ToolFormat

from .cli import method_list

CASES = Path(__file__).resolve().parent / "data" / "tool_calls.json"
DEFAULT_METHODS = "plain,speculative,lookup"
LOSSLESS = ("plain", "speculative", "lookup", "fast")
CHOICES = ("required", "auto")
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="m2r2-bench --tools", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="base model (default: the embedded smollm2)")
    p.add_argument("--adapters", default=None, help="M2R2 adapters (default: the packaged ones for the model)")
    p.add_argument(
        "--chat-template",
        type=Path,
        default=None,
        help="a Jinja chat template that replaces the model's (e.g. one with tool calling)",
    )
    p.add_argument("--cases", type=Path, default=CASES, help=f"tools and requests (default: {CASES.name})")
    p.add_argument(
        "--methods",
        type=method_list(METHODS),
        default=DEFAULT_METHODS,
        help=f"comma-separated, of: {', '.join(METHODS)} (default: %(default)s)",
    )
    p.add_argument("--limit", type=int, default=None, help="the first N requests only")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--out", type=Path, default=Path("build/tools"), help="results.md and answers.jsonl here")
    return p


def read_cases(path: Path) -> tuple[list[dict], list[dict]]:
    if not path.is_file():
        raise M2R2Error(f"{path} not found; pass --cases FILE (JSON with 'tools' and 'cases')")
    try:
        data = json.loads(path.read_text())
        tools, cases = data["tools"], data["cases"]
        if not all({"id", "ask", "tool", "arguments"} <= set(c) for c in cases):
            raise ValueError("each case needs id, ask, tool and arguments")
    except (ValueError, KeyError, TypeError) as e:
        raise M2R2Error(f"{path} is not a tool-call evaluation ({e}); it needs 'tools' and 'cases'") from None
    return tools, cases


def with_template(name: str | None, template: Path, folder: Path):
    """The model ``name`` loaded under the chat template ``template``: its files linked into ``folder``."""
    if not template.is_file():
        raise M2R2Error(f"chat template {template} not found; check --chat-template")
    source = resolve_model_path(name)
    for file in MODEL_FILES:
        if (source / file).is_file():
            (folder / file).symlink_to(source / file)
    (folder / "chat_template.jinja").write_text(template.read_text())
    return replace(load_model(str(folder)), name=f"{canonical_name(name)} + {template.name}")


_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
}


def evaluate(expression: str) -> float | None:
    """An arithmetic expression's value (numbers, + - * / ** ^ and parentheses); None for anything else."""

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("too large")
            return _OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("not arithmetic")

    text = expression.replace("^", "**").replace("×", "*").replace(" x ", " * ").replace("÷", "/")
    try:
        return value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return None


def matches(value, expected) -> bool:
    """A call's argument against what the case expects: words the string holds (or equals, for words under three
    letters), an equal number, {"equals": n}: an expression worth n, a list: any of them."""
    if isinstance(expected, list):
        return any(matches(value, e) for e in expected)
    if isinstance(expected, dict):
        got = evaluate(value) if isinstance(value, str) else value
        return isinstance(got, (int, float)) and abs(got - expected["equals"]) < 1e-6
    if isinstance(expected, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == expected
    text = str(value).strip().lower()
    return text == expected or (len(expected) >= 3 and expected in text)


def judge(case: dict, calls: list[dict], tools: list[dict]) -> dict:
    """What an answer's calls are worth: valid under their tool's schema, the right tool, the right arguments."""
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    valid = bool(calls)
    for call in calls:
        try:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
        except (KeyError, ValueError, jsonschema.ValidationError):
            valid = False
    first = calls[0]["function"] if calls else None
    right_tool = first is not None and first["name"] == case["tool"]
    arguments = json.loads(first["arguments"]) if right_tool else {}
    right_arguments = right_tool and all(
        k in arguments and matches(arguments[k], v) for k, v in case["arguments"].items()
    )
    return {"called": bool(calls), "valid": valid, "right_tool": right_tool, "right_arguments": right_arguments}


def answer(lm, fmt: ToolFormat, decode, tools: list[dict], case: dict, choice: str, max_tokens: int) -> dict:
    """One request through the server's path: its messages and grammar (parse_request), the template, the
    decoding, and the split of the answer into content and calls."""
    body = {
        "messages": [{"role": "user", "content": case["ask"]}],
        "tools": tools,
        "tool_choice": choice,
        "max_tokens": max_tokens,
    }
    req = parse_request("chat", body, DecodingOptions.from_values(vars(server_parser().parse_args([]))), fmt)
    ids = lm.tokenizer.apply_chat_template(req.messages, tools=req.tools, add_generation_prompt=True)
    stats, tokens, times = AnswerStats(), [], []
    generation = GenerationConfig(max_tokens, grammar=req.options.generation.grammar)
    for ev in decode(ids, PromptCache(lm.model), generation):
        times.append(time.perf_counter())
        tokens.append(ev.token)
        stats.add(ev)
    text = lm.tokenizer.decode([t for t in tokens if t not in lm.tokenizer.eos_token_ids])
    splitter = ToolCallSplitter(fmt)
    content = splitter.feed(text)
    rest, calls = splitter.finish(tools, streaming=False)
    return {
        "id": case["id"],
        "category": case.get("category", "all"),
        "choice": choice,
        "tokens": tokens,
        "content": (content + rest).strip(),
        "calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls],
        **judge(case, calls, tools),
        "cut": stats.finish_reason == "length",
        "decode_time": times[-1] - times[0] if len(times) > 1 else 0.0,
        "tokens_per_step": stats.accepted_per_step,
    }


def quality_table(records: list[dict]) -> str:
    lines = [
        "| tool_choice | set | answers | called a tool | valid calls | right tool | right arguments | cut |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for choice in CHOICES:
        rs = [r for r in records if r["choice"] == choice]
        if not rs:
            continue
        for group in sorted({r["category"] for r in rs}) + ["all"]:
            g = [r for r in rs if group in ("all", r["category"])]
            called = [r for r in g if r["called"]]
            lines.append(
                f"| {choice} | {group} | {len(g)} | {len(called)} | {sum(r['valid'] for r in called)}/{len(called)} "
                f"| {sum(r['right_tool'] for r in g)} | {sum(r['right_arguments'] for r in g)} | "
                f"{sum(r['cut'] for r in g)} |"
            )
    return "\n".join(lines)


def speed_table(records: dict[str, list[dict]], names: list[str]) -> str:
    """tokens/s over the "required" answers of each method, against plain's."""

    def rate(name: str) -> float:
        rs = [r for r in records[name] if r["choice"] == "required"]
        return sum(len(r["tokens"]) - 1 for r in rs) / max(sum(r["decode_time"] for r in rs), 1e-9)

    lines = ["| method | tokens/s | vs plain | tokens/step | same as plain |", "|---|---|---|---|---|"]
    plain = {(r["id"], r["choice"]): r["tokens"] for r in records["plain"]}
    for name in names:
        rs = [r for r in records[name] if r["choice"] == "required"]
        same = f"{sum(r['tokens'] == plain[r['id'], r['choice']] for r in rs)}/{len(rs)}" if name in LOSSLESS else "-"
        lines.append(
            f"| {name} | {rate(name):.1f} | {rate(name) / rate('plain'):.2f}x | "
            f"{statistics.mean(r['tokens_per_step'] for r in rs):.2f} | {same} |"
        )
    return "\n".join(lines)


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    names = names if "plain" in names else ["plain", *names]
    tools, cases = read_cases(args.cases)
    cases = cases[: args.limit]
    adapters = args.adapters or packaged_adapters(canonical_name(args.model))
    with tempfile.TemporaryDirectory() as tmp:
        lm = with_template(args.model, args.chat_template, Path(tmp)) if args.chat_template else load_model(args.model)
        fmt = ToolFormat.of(lm.tokenizer)
        decoders = {name: make_decoder(lm, DecodeConfig(name), adapters) for name in names}
        answer(lm, fmt, decoders["plain"], tools, cases[0], "required", 8)  # first-time shapes: not in any figure
        records: dict[str, list[dict]] = {name: [] for name in names}
        for case in tqdm(cases, desc="tool calls", unit="request"):
            for choice in CHOICES:
                for name in names if choice == "required" else ["plain"]:
                    records[name].append(answer(lm, fmt, decoders[name], tools, case, choice, args.max_tokens))
    how = "described in a system message" if fmt.prompted else f"the template's ({fmt.start}...{fmt.end})"
    md = f"{quality_table(records['plain'])}\n\n{speed_table(records, names)}"
    cmd = " ".join(["m2r2-bench", "--tools", *(argv if argv is not None else sys.argv[1:])])
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(
        args.out / "results.md",
        f"# Tool calls on {lm.name}\n\n`{cmd}`; {len(cases)} requests, {len(tools)} tools offered each time, "
        f"tools {how}; greedy, {args.max_tokens} tokens at most, one decoder per method for the run, "
        f"{blas_info().name} BLAS. Quality from plain decoding (the lossless methods give its tokens); speed "
        f"over the tool_choice=required answers: decode tokens/s (prefill excluded), speedup over plain "
        f"constrained decoding in the same run.\n\n{md}\n",
    )
    answers = [{"method": n, **{k: v for k, v in r.items() if k != "tokens"}} for n in names for r in records[n]]
    atomic_write_text(args.out / "answers.jsonl", "".join(json.dumps(a) + "\n" for a in answers))
    print(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("m2r2-bench --tools", lambda: _main(argv))
