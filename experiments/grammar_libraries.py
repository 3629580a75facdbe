"""Choosing the structured-output library: llguidance, outlines-core and xgrammar on the same schemas and tokenizer.

For each library: how many schemas it compiles (the 20 extraction schemas of bench/data/extraction.jsonl and a
set of harder JSON Schema features), the seconds a schema takes to compile for SmolLM2's 49,152-token vocabulary,
and the microseconds per token to compute the next-token mask while following a valid answer (the plain answers
of bench/results/structured/answers.jsonl, so each library walks the same tokens).
Writes bench/results/grammar-libraries/results.md.

    pip install outlines-core xgrammar apache-tvm-ffi   # the two libraries m2r2 does not depend on
    python -m experiments.grammar_libraries
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import m2r2_mlx  # noqa: F401  (first: preloads OpenBLAS on Linux)
from m2r2_mlx.atomic import atomic_write_text
from m2r2_mlx.decoding.grammar import JSON_FORMAT, ll_tokenizer
from m2r2_mlx.models.registry import load_model

import llguidance

ROOT = Path(__file__).resolve().parents[1]
HARD = {  # features beyond flat objects
    "$ref and $defs": {
        "type": "object",
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}},
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
    },
    "anyOf": {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}},
    "pattern": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
    "format date-time": {"type": "object", "properties": {"at": {"type": "string", "format": "date-time"}}},
    "minItems/maxItems": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}},
    },
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "recursive": {
        "type": "object",
        "$defs": {
            "node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}
        },
        "properties": {"root": {"$ref": "#/$defs/node"}},
    },
    "minimum/maximum": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 12}}},
}


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int):
        self.tok = ll_tokenizer(tokenizer, vocab)

    def compile(self, schema: dict):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT)
        if llguidance.LLMatcher.validate_grammar(grammar, self.tok):
            raise ValueError("not supported")
        return grammar

    def walk(self, compiled, tokens: list[int]) -> list[float]:
        m, times = llguidance.LLMatcher(self.tok, compiled), []
        for t in tokens:
            t0 = time.perf_counter()
            m.compute_bitmask()
            times.append(time.perf_counter() - t0)
            if not m.consume_token(t):
                raise ValueError("refused a valid answer's token")
        return times


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab: int):
        import outlines_core

        self.oc = outlines_core
        tok, eos = ll_tokenizer(tokenizer, vocab), sorted(tokenizer.eos_token_ids)[0]
        words: dict[bytes, list[int]] = {}
        for i in range(len(tokenizer._tokenizer)):
            if i != eos and not tok.is_special_token(i):
                words.setdefault(tok.decode_bytes([i]), []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, words)

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), r"[ ]?")
        return self.oc.Index(regex, self.vocab)

    def walk(self, index, tokens: list[int]) -> list[float]:
        guide, times = self.oc.Guide(index), []
        for t in tokens:
            t0 = time.perf_counter()
            allowed = guide.get_tokens()
            times.append(time.perf_counter() - t0)
            if t not in allowed:
                raise ValueError("refused a valid answer's token")
            guide.advance(t)
        return times


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int):
        import xgrammar

        self.xg = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer._tokenizer, vocab_size=vocab)
        self.compiler, self.vocab = xgrammar.GrammarCompiler(info), vocab

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))

    def walk(self, compiled, tokens: list[int]) -> list[float]:
        matcher, times = self.xg.GrammarMatcher(compiled), []
        bitmask = self.xg.allocate_token_bitmask(1, self.vocab)
        for t in tokens:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - t0)
            if not matcher.accept_token(t):
                raise ValueError("refused a valid answer's token")
        return times


def main() -> None:
    lm = load_model()
    vocab = int(lm.config["vocab_size"])
    prompts = [json.loads(line) for line in (ROOT / "bench/data/extraction.jsonl").read_text().splitlines()]
    answers = {}
    for line in (ROOT / "bench/results/structured/answers.jsonl").read_text().splitlines():
        a = json.loads(line)
        if a["method"] == "plain" and a["valid"]:
            answers[a["id"]] = a["text"]
    rows = []
    for cls in (LLGuidance, OutlinesCore, XGrammar):
        try:
            lib = cls(lm.tokenizer, vocab)
        except ImportError as e:
            rows.append(f"| {cls.name} | not installed ({e.name}) | | | |")
            continue
        compiled_ok, compile_s, mask_us, refused = 0, [], [], 0
        for p in prompts:
            try:
                t0 = time.perf_counter()
                compiled = lib.compile(p["schema"])
                compile_s.append(time.perf_counter() - t0)
                compiled_ok += 1
            except Exception:
                continue
            if p["id"] in answers:
                tokens = lm.tokenizer.encode(answers[p["id"]], add_special_tokens=False)
                try:
                    mask_us += [t * 1e6 for t in lib.walk(compiled, tokens)]
                except ValueError:
                    refused += 1
        hard_ok = []
        for feature, schema in HARD.items():
            try:
                lib.compile(schema)
                hard_ok.append(feature)
            except Exception:
                pass
        missing = ", ".join(f for f in HARD if f not in hard_ok) or "none"
        rows.append(
            f"| {lib.name} | {compiled_ok}/{len(prompts)} | {statistics.median(compile_s) * 1e3:.0f} ms "
            f"(max {max(compile_s) * 1e3:.0f}) | {statistics.median(mask_us):.0f} us (p90 "
            f"{statistics.quantiles(mask_us, n=10)[-1]:.0f}); {refused} answers refused | "
            f"{len(hard_ok)}/{len(HARD)} (missing: {missing}) |"
        )
        print(rows[-1], flush=True)
    table = "\n".join(
        [
            "| library | extraction schemas compiled | compile, median | mask per token, median | harder features |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    atomic_write_text(
        ROOT / "bench/results/grammar-libraries/results.md",
        "# Choosing the structured-output library\n\n`python -m experiments.grammar_libraries` on this machine "
        "(2-core x86, SmolLM2-135M's tokenizer, 49,152 tokens): each library compiles the 20 extraction schemas "
        "and follows the plain answers to them token by token, computing the next-token mask at each; then the "
        "harder JSON Schema features. Compile time is what a request with a new schema waits before its first "
        "token; mask time is added to every token.\n\n" + table + "\n",
    )


if __name__ == "__main__":
    main()
