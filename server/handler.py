"""The HTTP side: one thread per connection (ThreadingHTTPServer, as mlx_lm.server), routes, JSON and
server-sent events. Handlers only parse, queue and write; the model thread (worker.py) does the decoding."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import queue
import select
import socket
import sys
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from m2r2_mlx.decoding.options import DecodingOptions

from .protocol import (
    RequestError,
    chunk,
    completion,
    error_body,
    logprobs_object,
    parse_request,
    usage,
    usage_chunk,
)
from .tools import CallDeltas, ToolCallSplitter, ToolFormat
from .worker import Failed, Job, ModelWorker, Piece

log = logging.getLogger("m2r2-server")
ROUTES = {
    "/v1/chat/completions": "chat",
    "/chat/completions": "chat",
    "/v1/completions": "text",
    "/completions": "text",
}
MAX_BODY = 16 << 20  # bytes: a request larger than this is refused before it is read
POLL_S = 0.25  # how often a waiting handler checks that its client is still there
TIMEOUT_S = 120.0  # a client silent this long mid-request (or idle between requests) is disconnected
OPEN_PATHS = ("/health",)  # answered without the API key: a load balancer's probe
HANGUPS = (ConnectionError, TimeoutError)  # BrokenPipe, ConnectionReset, ConnectionAborted; a stalled client


class ClientGone(Exception):
    pass


class Handler(BaseHTTPRequestHandler):
    server: "Server"
    server_version = "m2r2-server"

    def setup(self):
        self.timeout = self.server.timeout_s  # applied to the socket by StreamRequestHandler.setup
        super().setup()

    def handle(self):
        """http.server's loop, where a client that hangs up (or stalls) costs one log line, not a traceback, also
        when it happens in http.server's own writes."""
        try:
            super().handle()
        except HANGUPS as e:
            self.close_connection = True
            log.info("%s hung up (%s)", self.address_string(), type(e).__name__)

    def log_message(self, format, *args):  # noqa: A002  (BaseHTTPRequestHandler's signature)
        log.info("%s %s", self.address_string(), format % args)

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (a malformed request line, headers too large...) in OpenAI's error shape."""
        self.close_connection = True
        if self.request_version == "HTTP/0.9":  # what http.server assumes of a garbled request line: no headers
            self.request_version = "HTTP/1.0"
        short = message or self.responses.get(code, ("error",))[0]
        kind = "server_error" if code >= 500 else "invalid_request_error"
        self._json(code, error_body(short, kind), {"Connection": "close"})

    # ---- writing ------------------------------------------------------------------------------------
    def _headers(self, status: int, content_type: str, length: int | None = None, extra: dict | None = None):
        self.answering = True
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Access-Control-Allow-Origin", "*")
        if length is not None:
            self.send_header("Content-Length", str(length))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()

    def _json(self, status: int, obj: dict, extra: dict | None = None) -> None:
        data = json.dumps(obj).encode()
        self._headers(status, "application/json", len(data), extra)
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, e: RequestError, close: bool = False) -> None:
        """``close``: the body was left unread, so the connection cannot carry another request."""
        extra = {"Retry-After": "1"} if e.status == 503 else {}
        if e.status == 401:
            extra["WWW-Authenticate"] = "Bearer"
        if close:
            self.close_connection = True
            extra["Connection"] = "close"
        self._json(e.status, error_body(e.message, e.kind, e.param, e.code), extra)

    def _authorized(self) -> bool:
        """No key set, or ``Authorization: Bearer KEY`` with the server's key (compared in constant time)."""
        key = self.server.api_key
        if not key:
            return True
        scheme, _, token = (self.headers.get("Authorization") or "").strip().partition(" ")
        given = hashlib.sha256(token.strip().encode("utf-8", "replace")).digest()
        return scheme.lower() == "bearer" and hmac.compare_digest(given, hashlib.sha256(key.encode()).digest())

    def _refuse_unauthorized(self, path: str) -> bool:
        """Answer 401 (and return True) when ``path`` needs the API key and the request lacks it."""
        if path in OPEN_PATHS or self._authorized():
            return False
        given = "Authorization" in self.headers
        self._error(
            RequestError(
                ("Incorrect API key provided" if given else "You didn't provide an API key")
                + "; send it as the header 'Authorization: Bearer KEY' (the key m2r2-server was started with)",
                status=401,
                code="invalid_api_key",
            ),
            close=self.command == "POST",  # its body is not read
        )
        return True

    def _event(self, obj: dict | str) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj)
        try:
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()
        except OSError:  # BrokenPipe, ConnectionReset: the client has gone
            raise ClientGone from None

    def _client_gone(self) -> bool:
        """True when the client has closed its end (a readable socket with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and not self.connection.recv(1, socket.MSG_PEEK)
        except OSError:
            return True

    def _next(self, job: Job):
        """The job's next item; cancels the job if the client goes away while it waits."""
        while True:
            try:
                return job.items.get(timeout=POLL_S)
            except queue.Empty:
                if self._client_gone():
                    raise ClientGone from None

    # ---- routes -------------------------------------------------------------------------------------
    def do_OPTIONS(self):
        self.send_response(204)
        self.send_header("Access-Control-Allow-Origin", "*")
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "*")
        self.end_headers()

    def do_GET(self):
        path = self.path.split("?")[0].rstrip("/")
        if self._refuse_unauthorized(path):
            return
        if path in ("/v1/models", "/models"):
            self._json(200, {"object": "list", "data": [self.server.model_card()]})
        elif path == "/health":
            self._json(200, {"status": "ok"})
        else:
            self._error(RequestError(f"no such endpoint: GET {path}", status=404))

    def _method_not_allowed(self):
        self._error(RequestError(f"method {self.command} is not allowed here; use GET or POST", status=405), True)

    do_PUT = do_DELETE = do_PATCH = do_HEAD = _method_not_allowed

    def do_POST(self):
        path = self.path.split("?")[0].rstrip("/")
        if self._refuse_unauthorized(path):
            return
        try:
            if path not in ROUTES:
                raise RequestError(
                    f"no such endpoint: POST {path} (try /v1/chat/completions or /v1/completions)", status=404
                )
            body = self._body()
            request = parse_request(
                ROUTES[path], body, self.server.defaults, self.server.tool_format, self.server.loop_guard
            )
            job = self.server.worker.submit(request)
        except RequestError as e:
            self._error(e, close=e.unread)
            return
        except Exception as e:  # a bug in parsing: a 500 in OpenAI's shape, logged, and the server goes on
            log.error("parsing a request to %s failed:\n%s", path, traceback.format_exc())
            self._error(RequestError(f"internal error ({type(e).__name__}: {e})", status=500, kind="server_error"))
            return
        self.answering = False  # set once the response's headers are out
        try:
            first = self._next(job)
            if isinstance(first, Failed):
                self._error(first.error)
            elif request.stream:
                self._stream(job, first)
            else:
                self._complete(job, first)
        except (ClientGone, *HANGUPS) as e:
            self.close_connection = True
            if job.cancel():  # decoding had finished: the model thread has nothing to say about it
                why = "" if isinstance(e, ClientGone) else f" ({type(e).__name__})"
                log.info(
                    "request %s: %s hung up before its answer was written%s", request.id, self.address_string(), why
                )
        except Exception as e:  # a bug in writing the answer: logged; a 500 if nothing was written yet
            log.error("answering request %s failed:\n%s", request.id, traceback.format_exc())
            self.close_connection = True
            job.cancel()
            if not self.answering:
                self._error(RequestError(f"internal error ({type(e).__name__}: {e})", status=500, kind="server_error"))

    def _body(self):
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise RequestError("the Content-Length header is not a number", unread=True) from None
        if length <= 0:
            status = 411 if length == 0 else 400
            raise RequestError("the request has no body; send a JSON object", status=status, unread=True)
        if length > MAX_BODY:
            raise RequestError(f"the request body is over {MAX_BODY >> 20} MB", status=413, unread=True)
        try:
            raw = self.rfile.read(length)
        except TimeoutError:
            raise RequestError(
                f"the request body did not arrive within {self.server.timeout_s:.0f} s", status=408, unread=True
            ) from None
        if len(raw) < length:  # the client closed its end early, or stalled past the timeout
            raise RequestError(f"the request body stopped after {len(raw)} of {length} bytes", unread=True)
        try:
            return json.loads(raw)
        except RecursionError:
            raise RequestError("the request body is nested too deeply; send a flat JSON object") from None
        except ValueError as e:
            raise RequestError(f"the request body is not valid JSON ({e})") from None

    def _complete(self, job: Job, item) -> None:
        pieces, entries = [], []
        while isinstance(item, Piece):
            pieces.append(item.text)
            entries.extend(item.logprobs or ())
            item = self._next(job)
        if isinstance(item, Failed):
            self._error(item.error)
            return
        req, text, calls, finish = job.request, "".join(pieces), None, item.finish_reason
        if req.tools:
            text, calls = self._tool_calls(req, text)
            finish = "tool_calls" if calls and finish == "stop" else finish
        use = usage(item.stats, item.method)
        logprobs = logprobs_object(req, entries)
        self._json(200, completion(req, self.server.model_name, text, finish, use, logprobs, calls or None))

    def _tool_calls(self, req, text: str) -> tuple[str, list[dict]]:
        """The answer's content and its tool calls."""
        splitter = ToolCallSplitter(self.server.tool_format)
        content = splitter.feed(text)
        rest, calls = splitter.finish(req.tools, streaming=False)
        content += rest
        return ("" if calls and not content.strip() else content), calls

    def _stream(self, job: Job, item) -> None:
        """Server-sent events: content as it comes; tool calls as OpenAI streams them (a call's id and name once
        written, then its arguments piece by piece) where the grammar holds them to JSON, else in one chunk at
        the end."""
        req, model = job.request, self.server.model_name
        splitter = ToolCallSplitter(self.server.tool_format) if req.tools else None
        deltas = CallDeltas() if splitter is not None and self.server.tool_format.is_json else None
        offset = 0  # where the next piece's text starts (the legacy logprobs' text_offset)
        self._headers(200, "text/event-stream", extra={"Cache-Control": "no-cache"})
        while isinstance(item, Piece):
            text = item.text if splitter is None else splitter.feed(item.text)
            logprobs = logprobs_object(req, item.logprobs or [], offset)
            if text or logprobs:
                self._event(chunk(req, model, text, logprobs=logprobs))
            if deltas is not None and (calls := deltas.feed(splitter.take())):
                self._event(chunk(req, model, None, tool_calls=calls))
            offset += len(text)
            item = self._next(job)
        if isinstance(item, Failed):  # after the headers: an error event, as OpenAI's stream sends one
            self._event(error_body(item.error.message, item.error.kind, item.error.param))
            self._event("[DONE]")
            return
        finish, rest, calls = item.finish_reason, "", []
        if deltas is not None:  # the calls went out as they came (one cut by max_tokens ends with "length")
            rest, called = splitter.close(), deltas.calls > 0
        elif splitter is not None:
            rest, calls = splitter.finish(req.tools, streaming=True)
            called = bool(calls)
        if rest:
            self._event(chunk(req, model, rest))
        if calls:
            self._event(chunk(req, model, None, tool_calls=calls))
        if splitter is not None and called and finish == "stop":
            finish = "tool_calls"
        self._event(chunk(req, model, None, finish))
        if req.include_usage:
            self._event(usage_chunk(req, model, usage(item.stats, item.method)))
        self._event("[DONE]")


class Server(ThreadingHTTPServer):
    """ThreadingHTTPServer with the model worker, the server's default decoding options, its API key (None: the
    /v1 routes are open) and whether structured answers are kept out of loops unless a request says otherwise."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        worker: ModelWorker,
        defaults: DecodingOptions,
        model_name: str,
        api_key: str | None = None,
        loop_guard: bool = True,
    ):
        self.worker, self.defaults, self.model_name, self.api_key = worker, defaults, model_name, api_key or None
        self.loop_guard = loop_guard  # the default of a request's "loop_guard"
        self.timeout_s = TIMEOUT_S
        self.tool_format = ToolFormat.of(worker.lm.tokenizer if worker.lm is not None else None)
        host = address[0]
        self.address_family = socket.getaddrinfo(host, address[1], type=socket.SOCK_STREAM)[0][0]
        super().__init__(address, Handler)

    def handle_error(self, request, client_address):
        """socketserver prints a traceback to stderr; a client that hung up is one log line, anything else is
        logged with its traceback."""
        error = sys.exc_info()[1]
        who = ":".join(str(part) for part in client_address[:2]) if isinstance(client_address, tuple) else "?"
        if isinstance(error, HANGUPS):
            log.info("%s hung up (%s)", who, type(error).__name__)
        else:
            log.error("serving %s failed:\n%s", who, traceback.format_exc())

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "m2r2-mlx"}
