"""m2r2-server against the openai client and raw HTTP, on the real embedded model: streaming and not, every
mode's stats, a burst of concurrent requests, bad requests, and a client that leaves mid-stream."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from m2r2_mlx.core.config import M2R2Config
from m2r2_mlx.core.hub import packaged_adapters
from m2r2_mlx.decoding.options import DecodingOptions

import pytest

from m2r2_server.cli import build_parser
from m2r2_server.handler import Server
from m2r2_server.worker import ModelWorker

openai = pytest.importorskip("openai")

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Give me a word that rhymes with cat.",
    "What color is the sky?",
    "Name a large animal.",
]


@pytest.fixture(scope="module")
def server(lm):
    """The server in this process, on a free port, serving the session's model."""
    defaults = DecodingOptions.from_values(vars(build_parser().parse_args(["--max-tokens", "24"])))
    worker = ModelWorker(lambda: lm, packaged_adapters("smollm2"), defaults, max_queue=16)
    worker.start()
    srv = Server(("127.0.0.1", 0), worker, defaults, lm.name)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    worker.stop()


def _client(srv):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.server_address[1]}/v1", api_key="none", max_retries=0)


def _ask(client, question, **extra):
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": question}], extra_body=extra or None
    )
    return r.choices[0].message.content


def _post(srv, path, body, raw: bytes | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=300)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read() or b"null")


@pytest.mark.slow
def test_models_and_a_plain_answer_with_usage(server):
    client = _client(server)
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": QUESTIONS[0]}],
        max_tokens=20,
        extra_body={"method": "plain"},
    )
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    u = r.usage
    assert u.prompt_tokens > 10 and 0 < u.completion_tokens <= 20
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.method == "plain" and u.tokens_per_step == 1.0 and u.drafts_accepted == 0 and u.layers_skipped == 0
    assert u.exit_layers == {"30": u.completion_tokens}


@pytest.mark.slow
def test_every_mode_per_request_and_lossless_ones_agree(server):
    client = _client(server)
    question = "Explain in two sentences why the sky is blue."
    plain = _ask(client, question, max_tokens=40)
    for mode in ("speculative", "fast", "lookup"):
        r = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": question}],
            max_tokens=40,
            extra_body={"method": mode, "draft": 3},
        )
        assert r.choices[0].message.content == plain, mode
        assert r.usage.method == mode
        assert r.usage.completion_tokens == 40 and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": question}],
        max_tokens=40,
        extra_body={"method": "early-exit", "tau": 0.3},
    )
    # whether a gate is checked at all follows the costs this long-lived engine has measured (early exit never
    # costs), so the layers skipped may be none; where tokens exit, they exit at gates
    assert r.usage.method == "early-exit" and sum(r.usage.exit_layers.values()) == r.usage.completion_tokens
    assert r.usage.layers_skipped >= 0 and set(map(int, r.usage.exit_layers)) <= {
        *M2R2Config.load(packaged_adapters("smollm2")).gates,
        30,
    }


@pytest.mark.slow
def test_text_completion_with_stop_string(server):
    client = _client(server)
    full = client.completions.create(model="smollm2", prompt="One, two, three, four,", max_tokens=12)
    cut = client.completions.create(model="smollm2", prompt="One, two, three, four,", max_tokens=12, stop=[","])
    assert "," in full.choices[0].text
    assert cut.choices[0].text == full.choices[0].text.split(",")[0] and cut.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_streamed_text_equals_the_whole_answer(server):
    client = _client(server)
    whole = _ask(client, QUESTIONS[1], max_tokens=30)
    stream = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": QUESTIONS[1]}],
        max_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"method": "speculative"},
    )
    pieces, usage, finish = [], None, None
    for c in stream:
        if c.usage:
            usage = c.usage
        for choice in c.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole and len(pieces) > 3 and finish in ("stop", "length")
    assert usage.method == "speculative" and usage.completion_tokens > 3


@pytest.mark.slow
def test_concurrent_burst_all_answered_as_sequentially(server):
    client = _client(server)
    sequential = [_ask(client, q, max_tokens=16) for q in QUESTIONS]
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        burst = list(pool.map(lambda q: _ask(client, q, max_tokens=16), QUESTIONS))
    assert burst == sequential and all(burst)


COOK = "Give me three tips for learning to cook."  # greedy decoding loops on it: "1. **10111111..."


@pytest.mark.slow
def test_sampler_fields_pass_through(server):
    client = _client(server)
    greedy = _ask(client, COOK, max_tokens=40)
    assert "1111111111" in greedy
    penalised = _ask(client, COOK, max_tokens=40, repeat_penalty=1.1)  # llama.cpp's name
    assert "1111111111" not in penalised and penalised == _ask(client, COOK, max_tokens=40, repetition_penalty=1.1)
    # a context of one token penalises only the token just emitted: another answer
    assert _ask(client, COOK, max_tokens=40, repeat_penalty=1.1, repeat_last_n=1) != penalised
    # sampling at temperature 1 that keeps only the most likely token is greedy decoding
    assert _ask(client, QUESTIONS[1], max_tokens=16, temperature=1.0, top_k=1, seed=3) == _ask(
        client, QUESTIONS[1], max_tokens=16
    )
    assert _ask(client, QUESTIONS[1], max_tokens=16, temperature=1.0, min_p=1.0, seed=3) == _ask(
        client, QUESTIONS[1], max_tokens=16
    )


@pytest.mark.slow
def test_speculative_with_penalties_and_a_logit_bias_is_lossless(server, lm):
    """OpenAI's presence and frequency penalties and logit bias, sent by OpenAI's own client, change the answer
    (no loop of ones), and the speculative method gives plain decoding's answer under them and under a repetition
    penalty."""
    client = _client(server)

    def ask(method: str, **fields) -> str:
        r = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": COOK}],
            max_tokens=60,
            extra_body={"method": method, **fields.pop("extra", {})},
            **fields,
        )
        return r.choices[0].message.content

    (one,) = lm.tokenizer.encode("1")
    openai = dict(presence_penalty=0.8, frequency_penalty=0.4, logit_bias={str(one): -5})
    plain = ask("plain", **openai)
    assert "1111" not in plain and plain != ask("plain")
    assert ask("speculative", **openai) == plain
    plain = ask("plain", extra={"repetition_penalty": 1.1})
    assert ask("speculative", extra={"repetition_penalty": 1.1}) == plain


BAD = [
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "method": "warp"}, 400, "method"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": [1, 2]}, 400, "stop"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "method": "speculative", "gate": 7},
        400,
        None,
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_k": -1}, 400, "top_k"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "min_p": 2}, 400, "min_p"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "repeat_penalty": 0},
        400,
        "repeat_penalty",
    ),
    ("/v1/completions", {"prompt": "hi", "logit_bias": [1, 2]}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"cat": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"900000": 1}}, 400, "logit_bias"),  # beyond the vocabulary
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1, "05": 2}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": "high"}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_context_size": 0}, 400, "frequency_context_size"),
    ("/v1/completions", {"prompt": 12}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "word " * 9000}, 400, None),  # over the model's context
    ("/v1/embeddings", {"input": "hi"}, 404, None),
]


@pytest.mark.slow
@pytest.mark.parametrize("path, body, status, param", BAD)
def test_bad_requests_get_a_json_error_and_the_server_goes_on(server, path, body, status, param):
    code, reply = _post(server, path, body)
    assert code == status
    assert set(reply["error"]) >= {"message", "type", "param"} and reply["error"]["message"]
    assert reply["error"]["param"] == param
    assert _post(server, "/v1/completions", {"prompt": "Paris is in", "max_tokens": 2})[0] == 200


def test_malformed_json_is_a_400(server):
    code, reply = _post(server, "/v1/chat/completions", None, raw=b"{not json")
    assert code == 400 and "not valid JSON" in reply["error"]["message"]


@pytest.mark.slow
def test_client_leaving_mid_stream_cancels_and_the_next_answer_is_right(server):
    client = _client(server)
    reference = _ask(client, QUESTIONS[0], max_tokens=20)
    body = {
        "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
        "max_tokens": 400,
        "stream": True,
        "method": "speculative",
    }
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=300)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    reader = sock.makefile("rb")
    assert b" 200 " in reader.readline()
    events = 0
    while events < 3:  # the headers, a few events, then hang up
        events += reader.readline().startswith(b"data: ")
    reader.close()
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    cache = server.worker.session.cache
    for _ in range(600):  # the model thread notices between two tokens and stops
        time.sleep(0.1)
        if server.worker.jobs.empty() and len(cache) and _idle(server):
            break
    assert len(cache) < 60 + 400  # far from the 400 tokens asked for: decoding stopped
    assert _ask(client, QUESTIONS[0], max_tokens=20) == reference


def _idle(srv) -> bool:
    """True when no answer has grown the cache for a while."""
    before = len(srv.worker.session.cache)
    time.sleep(1.0)
    return len(srv.worker.session.cache) == before


EXE = shutil.which("m2r2-server")
REPEAT = "Repeat this sentence exactly three times: The quick brown fox jumps over the lazy dog."


@pytest.mark.slow
@pytest.mark.skipif(EXE is None, reason="package not installed (pip install -e .)")
def test_newcomer_starts_the_server_and_streams_speculative_answer_with_stats():
    proc = subprocess.Popen(
        [EXE, "--port", "0", "--method", "speculative", "--max-tokens", "48"], stderr=subprocess.PIPE, text=True
    )
    try:
        line = proc.stderr.readline()
        assert "on http://127.0.0.1:" in line, line
        url = line.strip().rsplit(" ", 1)[-1]
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        stream = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": REPEAT}],
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        for c in stream:
            text += "".join(ch.delta.content or "" for ch in c.choices)
            usage = c.usage or usage
        assert "quick brown fox" in text
        assert usage.method == "speculative" and usage.completion_tokens > 5
        assert usage.drafts_accepted > 0 and usage.tokens_per_step > 1.0  # the repeated sentence is drafted
        assert sum(usage.exit_layers.values()) == usage.completion_tokens
        plain = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": REPEAT}], extra_body={"method": "plain"}
        )
        assert plain.choices[0].message.content == text  # lossless
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.skipif(EXE is None, reason="package not installed (pip install -e .)")
def test_server_mode_without_adapters_fails_before_any_download(tmp_path):
    r = subprocess.run(
        [EXE, "--model", "phi3", "--method", "early-exit"],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs M2R2 adapters for 'phi3'" in lines[0] and "--adapters" in lines[0]
    assert not (tmp_path / "hf").exists()  # nothing was fetched
