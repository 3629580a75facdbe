"""m2r2-server for tests: in this process (a thread) or as a real subprocess, and raw HTTP against it."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass, fields
from pathlib import Path

from m2r2_mlx.core.hub import packaged_adapters
from m2r2_mlx.decoding.options import DecodingOptions
from m2r2_mlx.models.registry import LoadedModel

from m2r2_server.cli import build_parser
from m2r2_server.handler import Server
from m2r2_server.worker import ModelWorker

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ShortContext(LoadedModel):
    """The model with a shorter context (its config, and so the adapters' base hash, unchanged)."""

    short: int = 0

    @property
    def context_length(self) -> int:
        return self.short


@contextlib.contextmanager
def running(lm, *flags: str, api_key: str | None = None, context: int | None = None, timeout_s: float | None = None):
    """A server in this process on a free port; ``context``: the model's context shortened to that many tokens."""
    if context is not None:
        lm = ShortContext(**{f.name: getattr(lm, f.name) for f in fields(LoadedModel)}, short=context)
    args = build_parser().parse_args(list(flags))
    defaults = DecodingOptions.from_values(vars(args))
    worker = ModelWorker(lambda: lm, packaged_adapters("smollm2"), defaults, max_queue=16)
    worker.start()
    srv = Server(("127.0.0.1", 0), worker, defaults, lm.name, api_key, args.loop_guard)
    if timeout_s is not None:
        srv.timeout_s = timeout_s
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        worker.stop()


def port(srv) -> int:
    return srv.server_address[1] if hasattr(srv, "server_address") else srv


def post(
    srv,
    path: str,
    body=None,
    raw: bytes | None = None,
    headers: dict | None = None,
    timeout: float = 300,
    raw_text: bool = False,
):
    """(status, parsed JSON body or None, headers) of one POST; ``raw_text``: the body's bytes, unparsed."""
    conn = http.client.HTTPConnection("127.0.0.1", port(srv), timeout=timeout)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    text = r.read()
    conn.close()
    if raw_text:
        return r.status, text, dict(r.getheaders())
    return r.status, (json.loads(text) if text else None), dict(r.getheaders())


def get(srv, path: str, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port(srv), timeout=60)
    conn.request("GET", path, headers=headers or {})
    r = conn.getresponse()
    text = r.read()
    conn.close()
    return r.status, (json.loads(text) if text else None), dict(r.getheaders())


def raw_request(srv, path: str, body: dict) -> socket.socket:
    """A socket that has sent ``body`` as a POST, its response unread."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port(srv)), timeout=300)
    sock.sendall(
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (path.encode(), len(data), data)
    )
    return sock


def reset(sock: socket.socket) -> None:
    """Hang up abruptly (RST, as a killed client does): the server's next write fails."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def read_events(sock: socket.socket, count: int) -> list[bytes]:
    """The status line, then the first ``count`` server-sent events of a streamed answer."""
    reader = sock.makefile("rb")
    lines = [reader.readline()]
    while sum(line.startswith(b"data: ") for line in lines) < count:
        line = reader.readline()
        if not line:
            break
        lines.append(line)
    return lines


def is_error_body(body) -> bool:
    """OpenAI's error object: {"error": {"message": str, "type": str, "param": str|None, "code": str|None}}."""
    if not (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict)):
        return False
    e = body["error"]
    return (
        set(e) == {"message", "type", "param", "code"}
        and isinstance(e["message"], str)
        and bool(e["message"])
        and isinstance(e["type"], str)
        and (e["param"] is None or isinstance(e["param"], str))
        and (e["code"] is None or isinstance(e["code"], str))
    )


def start_subprocess(*flags: str, env: dict | None = None) -> tuple[subprocess.Popen, list[str]]:
    """`python -m m2r2_server.cli FLAGS` on a free port; returns it once it serves, with the stderr lines so far."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "m2r2_server.cli", "--port", "0", *flags],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    lines = []
    while True:
        line = proc.stderr.readline()
        if not line:
            proc.wait(timeout=60)
            raise RuntimeError("m2r2-server exited before serving:\n" + "".join(lines))
        lines.append(line)
        if " on http://" in line:
            return proc, lines


def server_port(lines: list[str]) -> int:
    return int(lines[-1].strip().rsplit(":", 1)[-1].split("/")[0])


def tool_model(folder: Path) -> LoadedModel:
    """The embedded model under a tool-calling chat template (tests/data/hermes_tools.jinja, in the manner of
    Qwen2.5's), loaded from ``folder``: its weights and tokenizer linked, the template its own."""
    from m2r2_mlx.models.registry import load_model, resolve_model_path

    source = resolve_model_path("smollm2")
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).symlink_to(source / name)
    (folder / "chat_template.jinja").write_text((ROOT / "tests" / "data" / "hermes_tools.jinja").read_text())
    return load_model(str(folder))
