"""The HTTP side: one thread per connection (ThreadingHTTPServer, as mlx_lm.server), routes, JSON and
server-sent events. Handlers only parse, queue and write; the model thread (worker.py) does the decoding."""

from __future__ import annotations

import json
import logging
import queue
import select
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from m2r2_mlx.decoding.options import DecodingOptions

from .protocol import RequestError, chunk, completion, error_body, parse_request, usage, usage_chunk
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


class ClientGone(Exception):
    pass


class Handler(BaseHTTPRequestHandler):
    server: "Server"
    server_version = "m2r2-server"

    def log_message(self, format, *args):  # noqa: A002  (BaseHTTPRequestHandler's signature)
        log.info("%s %s", self.address_string(), format % args)

    # ---- writing ------------------------------------------------------------------------------------
    def _headers(self, status: int, content_type: str, length: int | None = None, extra: dict | None = None):
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
        self.wfile.write(data)

    def _error(self, e: RequestError) -> None:
        extra = {"Retry-After": "1"} if e.status == 503 else None
        self._json(e.status, error_body(e.message, e.kind, e.param), extra)

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
        if path in ("/v1/models", "/models"):
            self._json(200, {"object": "list", "data": [self.server.model_card()]})
        elif path == "/health":
            self._json(200, {"status": "ok"})
        else:
            self._error(RequestError(f"no such endpoint: GET {path}", status=404))

    def do_POST(self):
        path = self.path.split("?")[0].rstrip("/")
        try:
            if path not in ROUTES:
                raise RequestError(
                    f"no such endpoint: POST {path} (try /v1/chat/completions or /v1/completions)", status=404
                )
            request = parse_request(ROUTES[path], self._body(), self.server.defaults)
            job = self.server.worker.submit(request)
        except RequestError as e:
            self._error(e)
            return
        try:
            first = self._next(job)
            if isinstance(first, Failed):
                self._error(first.error)
            elif request.stream:
                self._stream(job, first)
            else:
                self._complete(job, first)
        except ClientGone:
            job.cancelled.set()

    def _body(self):
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise RequestError("the Content-Length header is not a number") from None
        if length <= 0:
            raise RequestError("the request has no body; send a JSON object", status=411 if length == 0 else 400)
        if length > MAX_BODY:
            raise RequestError(f"the request body is over {MAX_BODY >> 20} MB", status=413)
        raw = self.rfile.read(length)
        try:
            return json.loads(raw)
        except ValueError as e:
            raise RequestError(f"the request body is not valid JSON ({e})") from None

    def _complete(self, job: Job, item) -> None:
        pieces = []
        while isinstance(item, Piece):
            pieces.append(item.text)
            item = self._next(job)
        if isinstance(item, Failed):
            self._error(item.error)
            return
        req = job.request
        self._json(
            200,
            completion(req, self.server.model_name, "".join(pieces), item.finish_reason, usage(item.stats, item.mode)),
        )

    def _stream(self, job: Job, item) -> None:
        req, model = job.request, self.server.model_name
        self._headers(200, "text/event-stream", extra={"Cache-Control": "no-cache"})
        while isinstance(item, Piece):
            self._event(chunk(req, model, item.text))
            item = self._next(job)
        if isinstance(item, Failed):  # after the headers: an error event, as OpenAI's stream sends one
            self._event(error_body(item.error.message, item.error.kind, item.error.param))
        else:
            self._event(chunk(req, model, None, item.finish_reason))
            if req.include_usage:
                self._event(usage_chunk(req, model, usage(item.stats, item.mode)))
        self._event("[DONE]")


class Server(ThreadingHTTPServer):
    """ThreadingHTTPServer with the model worker and the server's default decoding options."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], worker: ModelWorker, defaults: DecodingOptions, model_name: str):
        self.worker, self.defaults, self.model_name = worker, defaults, model_name
        host = address[0]
        self.address_family = socket.getaddrinfo(host, address[1], type=socket.SOCK_STREAM)[0][0]
        super().__init__(address, Handler)

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "m2r2-mlx"}
