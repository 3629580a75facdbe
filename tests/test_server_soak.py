"""A bounded soak of m2r2-server (slow; loopback; it stops by itself): 100 requests of mixed methods, chat and
text, streamed and not, greedy and sampled, with cancels and a few bad requests, from two clients at once. No 5xx;
every greedy answer equals the same request on a fresh server (plain decoding's answer for a lossless method);
resident memory after the first 50 requests grows by less than 10% over the rest. M2R2_SOAK_REQUESTS sets the
count (docs/server.md's figures: 300); M2R2_SOAK_CURVE=FILE writes the memory curve (JSON)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
import time
from pathlib import Path

from m2r2_mlx.decoding.methods import METHODS

import mlx.core as mx
import pytest

from .server_util import post, raw_request, read_events, reset, running

REQUESTS = int(os.environ.get("M2R2_SOAK_REQUESTS", "100"))
WARMUP = 50  # requests before the memory baseline: every mode's decoder built, the caches at their working size
EVERY = 25  # the memory curve's step, in requests
DEADLINE_S = 40 * 60  # the whole soak, however slow the machine: it never runs unbounded
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Give me a word that rhymes with cat.",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
]
MODES = ["plain", "speculative", "early-exit", "lookup"]


def rss_mb() -> float:
    """This process's resident memory (the server runs in it), in MB."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    except OSError:  # macOS: no /proc
        return int(subprocess.check_output(["ps", "-o", "rss=", "-p", str(os.getpid())])) / 1e3


def plan(i: int) -> dict:
    """Request ``i`` of the soak: what it asks and how (the same on every run)."""
    rng = random.Random(i)
    kind = rng.choice(["chat", "text"])
    q = rng.choice(QUESTIONS)
    body = {"messages": [{"role": "user", "content": q}]} if kind == "chat" else {"prompt": f"Q: {q}\nA:"}
    body.update(mode=rng.choice(MODES), max_tokens=rng.choice([8, 16]))
    greedy = rng.random() < 0.7
    if not greedy:
        body.update(temperature=0.8, seed=i)
    stream = rng.random() < 0.5
    cancel = stream and rng.random() < 0.25
    bad = i % 25 == 13  # a refused request now and then: the server's 4xx path in the mix
    if bad:
        body["temperature"] = "hot"
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    return {"path": path, "body": body, "stream": stream, "cancel": cancel, "greedy": greedy and not bad, "bad": bad}


def _text(kind_path: str, obj: dict) -> str:
    choice = obj["choices"][0]
    return choice["message"]["content"] if kind_path.endswith("chat/completions") else choice["text"]


def _streamed(srv, p: dict) -> tuple[int, str]:
    status, data, _ = post(srv, p["path"], {**p["body"], "stream": True}, timeout=120, raw_text=True)
    if status != 200:
        return status, ""
    pieces = []
    for line in data.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            delta = obj["choices"][0]
            pieces.append((delta.get("delta") or {}).get("content") or delta.get("text") or "")
    return status, "".join(pieces)


def run_one(srv, p: dict) -> tuple[int, str | None]:
    """(status, answer text or None) of one planned request; a cancel hangs up after two events."""
    if p["cancel"]:
        sock = raw_request(srv, p["path"], {**p["body"], "stream": True})
        head = read_events(sock, 2)[0]
        reset(sock)
        return int(head.split()[1]), None
    if p["stream"]:
        return _streamed(srv, p)
    status, obj, _ = post(srv, p["path"], p["body"], timeout=120)
    return status, (_text(p["path"], obj) if status == 200 else None)


@pytest.mark.slow
def test_soak_mixed_requests_no_5xx_same_greedy_answers_bounded_memory(lm):
    plans = [plan(i) for i in range(REQUESTS)]
    answers: dict[int, str] = {}
    statuses: dict[int, int] = {}
    curve: list[dict] = []
    lock, next_i, done = threading.Lock(), iter(range(REQUESTS)), [0]
    end = time.monotonic() + DEADLINE_S
    tic = time.perf_counter()

    def sample(count: int) -> None:
        curve.append(
            {
                "requests": count,
                "rss_mb": round(rss_mb(), 1),
                "mlx_active_mb": round(mx.get_active_memory() / 1e6, 1),
                "mlx_cache_mb": round(mx.get_cache_memory() / 1e6, 1),
                "seconds": round(time.perf_counter() - tic, 1),
            }
        )

    def client(srv) -> None:
        while time.monotonic() < end:
            with lock:
                i = next(next_i, None)
            if i is None:
                return
            status, text = run_one(srv, plans[i])
            with lock:
                statuses[i] = status
                if text is not None and plans[i]["greedy"]:
                    answers[i] = text
                done[0] += 1
                if done[0] % EVERY == 0:
                    sample(done[0])

    with running(lm, "--max-tokens", "16", timeout_s=30) as srv:
        sample(0)
        threads = [threading.Thread(target=client, args=(srv,)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(statuses) == REQUESTS, f"the soak ran past {DEADLINE_S} s: {len(statuses)} of {REQUESTS} requests"
    assert not [s for s in statuses.values() if s >= 500], statuses
    assert all((s == 400) == plans[i]["bad"] and s in (200, 400) for i, s in statuses.items()), statuses

    fresh: dict[str, str] = {}  # the same greedy requests on a fresh server, each once; plain's for lossless methods
    with running(lm, "--max-tokens", "16") as srv:
        for i, text in sorted(answers.items()):
            body = dict(plans[i]["body"])
            body["mode"] = "plain" if METHODS[body["mode"]].lossless else body["mode"]
            key = json.dumps([plans[i]["path"], body], sort_keys=True)
            if key not in fresh:
                status, obj, _ = post(srv, plans[i]["path"], body, timeout=120)
                fresh[key] = _text(plans[i]["path"], obj)
            assert text == fresh[key], (i, plans[i], text, fresh[key])

    out = os.environ.get("M2R2_SOAK_CURVE")
    if out:
        Path(out).write_text(json.dumps({"curve": curve, "greedy_checked": len(answers), "fresh": len(fresh)}))
    print("\nsoak memory curve:", *curve, sep="\n  ")
    base = next(c["rss_mb"] for c in curve if c["requests"] >= min(WARMUP, REQUESTS))
    last = curve[-1]["rss_mb"]
    assert last < 1.10 * base, f"resident memory grew from {base} MB to {last} MB after request {WARMUP}"
