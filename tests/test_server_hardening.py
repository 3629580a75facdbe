"""m2r2-server against a hostile or careless client: any malformed body is a 400, however deep or large; a hang-up is
one log line, never a traceback; --api-key (or M2R2_API_KEY) guards every route but /health; a non-loopback host
without a key warns; max_tokens past the context is clamped and says "length"."""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest

from m2r2_server.cli import is_loopback

from .inprocess import run_main
from .server_util import (
    get,
    is_error_body,
    post,
    raw_request,
    read_events,
    reset,
    running,
    server_port,
    start_subprocess,
)

openai = pytest.importorskip("openai")

HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
STORY = "Write a very long story about a dragon who learns to bake bread."


@pytest.fixture(scope="module")
def server(lm):
    with running(lm, "--max-tokens", "8", timeout_s=5) as srv:
        yield srv


DEEP = [
    ("100,000 brackets", b"[" * 100_000),
    ("100,000 objects", b'{"a":' * 100_000),
    ("deep inside messages", b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"),
    (
        "deep within the parser",
        b'{"messages": [{"role": "user", "content": "hi"}], "stop": ' + b"[" * 900 + b"]" * 900 + b"}",
    ),
    ("valid and deep", b"[" * 900 + b"]" * 900),
    ("15 MB of garbage", b"{" + b"x" * (15 << 20)),
    ("15 MB of a string", b'{"messages": "' + b"a" * (15 << 20) + b'"}'),
    ("invalid UTF-8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    ("a lone surrogate", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("NaN temperature", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
    ("infinite temperature", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}'),
    ("negative seed", b'{"messages": [{"role": "user", "content": "hi"}], "seed": -1}'),
]


@pytest.mark.parametrize("what, raw", DEEP, ids=[d[0] for d in DEEP])
def test_any_malformed_body_is_a_400_and_the_server_goes_on(server, what, raw):
    status, body, _ = post(server, "/v1/chat/completions", raw=raw)
    assert status == 400 and is_error_body(body), (status, body)
    assert len(body["error"]["message"]) <= 500
    assert post(server, "/v1/chat/completions", HI)[0] == 200


def test_deep_nesting_says_so(server):
    _, body, _ = post(server, "/v1/chat/completions", raw=b"[" * 100_000)
    assert "nested too deeply" in body["error"]["message"]


def test_http_servers_own_refusals_and_other_methods_are_openai_errors(server):
    sock = socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=30)
    sock.sendall(b"NONSENSE\r\n\r\n")
    reply = sock.makefile("rb").read()
    sock.close()
    head, _, data = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 400") and is_error_body(json.loads(data))
    for method in ("PUT", "DELETE", "PATCH"):
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
        conn.request(method, "/v1/chat/completions", body=b"{}")
        r = conn.getresponse()
        assert r.status == 405 and is_error_body(json.loads(r.read()))
        conn.close()


@pytest.mark.slow
def test_a_body_that_stalls_is_a_408_after_the_timeout(server):
    sock = socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=30)
    sock.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"messages"')
    tic = time.perf_counter()
    reply = sock.makefile("rb").read()  # the server's socket timeout (5 s here) ends the wait
    sock.close()
    head, _, data = reply.partition(b"\r\n\r\n")
    assert b" 408 " in head.split(b"\r\n")[0] and is_error_body(json.loads(data))
    assert 4 < time.perf_counter() - tic < 30
    assert post(server, "/v1/chat/completions", HI)[0] == 200


def _hangup_lines(caplog, since: int) -> list[str]:
    return [r.getMessage() for r in caplog.records[since:] if "hung up" in r.getMessage()]


@pytest.mark.slow
def test_each_hang_up_is_one_log_line_without_a_traceback(server, caplog, capfd):
    caplog.set_level(logging.INFO, logger="m2r2-server")
    # 1. mid-stream: the model thread stops between two tokens and says so once
    start = len(caplog.records)
    sock = raw_request(
        server,
        "/v1/chat/completions",
        {**HI, "messages": [{"role": "user", "content": STORY}], "max_tokens": 400, "stream": True},
    )
    assert b" 200 " in read_events(sock, 3)[0]
    reset(sock)
    _wait_for(lambda: _hangup_lines(caplog, start))
    time.sleep(1)
    lines = _hangup_lines(caplog, start)
    assert len(lines) == 1 and "cancelled after" in lines[0], lines
    # 2. before the answer is written: the client leaves at once, its request waits or runs, then is dropped
    start = len(caplog.records)
    reset(raw_request(server, "/v1/chat/completions", {**HI, "max_tokens": 30}))
    _wait_for(lambda: _hangup_lines(caplog, start))
    time.sleep(1.5)
    assert len(_hangup_lines(caplog, start)) == 1
    # 3. in http.server's own paths: a request line, then a reset before its answer
    for data in (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", b"NONSENSE\r\n\r\n"):
        start = len(caplog.records)
        sock = socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=30)
        sock.sendall(data)
        reset(sock)
        time.sleep(0.5)
        assert len(_hangup_lines(caplog, start)) <= 1
    assert post(server, "/v1/chat/completions", HI)[0] == 200
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipeError" not in err
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


def _wait_for(condition, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.1)


def test_an_api_key_guards_every_route_but_health(lm):
    with running(lm, "--max-tokens", "2", api_key="sekret") as srv:
        for path in ("/v1/models", "/models"):
            status, body, headers = get(srv, path)
            assert status == 401 and is_error_body(body) and body["error"]["code"] == "invalid_api_key"
            assert headers["WWW-Authenticate"] == "Bearer"
        assert get(srv, "/v1/models", {"Authorization": "Bearer wrong"})[0] == 401
        assert get(srv, "/v1/models", {"Authorization": "Basic sekret"})[0] == 401
        assert get(srv, "/v1/models", {"Authorization": "Bearer sekret"})[0] == 200
        assert get(srv, "/health")[0] == 200
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
            status, body, headers = post(srv, path, HI)
            assert status == 401 and is_error_body(body) and headers["Connection"] == "close"
        assert "didn't provide an API key" in post(srv, "/v1/chat/completions", HI)[1]["error"]["message"]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.server_address[1]}/v1", api_key="sekret")
        r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.content
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=client.base_url, api_key="nope", max_retries=0).models.list()


def test_loopback_hosts():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("::")


@pytest.mark.slow
def test_an_empty_key_is_refused_in_one_line():
    r = run_main("m2r2_server.cli", "--api-key", " ")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "m2r2-server: error: the API key is empty; pass --api-key KEY (or set M2R2_API_KEY) with a key, or neither"
    ]


@pytest.mark.slow
def test_a_network_host_without_a_key_warns_once_and_the_variable_sets_one():
    proc, lines = start_subprocess("--host", "0.0.0.0", "--max-tokens", "2")
    try:
        warnings = [line for line in lines if "warning" in line]
        assert len(warnings) == 1 and "without an API key" in warnings[0] and "M2R2_API_KEY" in warnings[0]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    proc, lines = start_subprocess("--host", "0.0.0.0", "--max-tokens", "2", env={"M2R2_API_KEY": "sekret"})
    try:
        assert not [line for line in lines if "warning" in line] and "API key required" in lines[-1]
        srv = server_port(lines)
        assert post(srv, "/v1/chat/completions", HI)[0] == 401
        assert post(srv, "/v1/chat/completions", HI, headers={"Authorization": "Bearer sekret"})[0] == 200
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["plain", "speculative", "early-exit", "lookup"])
@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_past_the_context_is_clamped_and_says_length(lm, mode, stream):
    messages = [{"role": "user", "content": STORY}]
    prompt = len(lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    with running(lm, context=prompt + 12) as srv:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.server_address[1]}/v1", api_key="x", max_retries=0)
        kw = dict(model="smollm2", messages=messages, max_tokens=100_000, extra_body={"method": mode})
        if stream:
            chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            usage = chunks[-1].usage
            assert finish == ["length"]
        else:
            r = client.chat.completions.create(**kw)
            assert r.choices[0].finish_reason == "length"
            usage = r.usage
        assert usage.completion_tokens == 12 and usage.prompt_tokens == prompt
