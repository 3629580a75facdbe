"""The model thread: every MLX call of the server runs here, one request at a time, in arrival order.

Requests share one prompt cache, as a chat's turns do (ChatSession): each prefills only what the cache lacks
(the longest common prefix is reused, a divergent tail trimmed). A job whose client has gone is skipped, or its
decoding closed between two tokens; closing the decode generator leaves the cache consistent, as the chat's
cancel does. Decoders are built per request from its options and kept for the next requests that ask the same.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from m2r2_mlx.decoding.chat import ChatSession
from m2r2_mlx.decoding.config import DecodeConfig
from m2r2_mlx.decoding.events import TokenEvent, check_context
from m2r2_mlx.decoding.grammar import ll_tokenizer
from m2r2_mlx.decoding.methods import METHODS, make_decoder
from m2r2_mlx.decoding.options import DecodingOptions
from m2r2_mlx.decoding.protocols import Decoder
from m2r2_mlx.decoding.stats import AnswerStats
from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.models.registry import LoadedModel

from jinja2 import TemplateError

from .protocol import Request, RequestError

log = logging.getLogger("m2r2-server")
KEEP_DECODERS = 4  # decoders kept built (each holds its adapters' weights): the modes a server is asked for


@dataclass
class Piece:
    text: str
    logprobs: list[dict] | None = None  # its tokens' entries in OpenAI's shape (a request that asked for them)


@dataclass
class Done:
    finish_reason: str
    stats: AnswerStats
    method: str


@dataclass
class Failed:
    error: RequestError


class TokenBytes:
    """Log-probability entries in OpenAI's shape: each token's text and exact bytes (a token may hold part of a
    character)."""

    def __init__(self, tokenizer, vocab_size: int | None):
        self.tokenizer = ll_tokenizer(tokenizer, vocab_size)  # the one a grammar uses: built once

    def _token(self, token: int, logprob: float) -> dict:
        raw = self.tokenizer.decode_bytes([token])
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    def entry(self, ev: TokenEvent, method: str) -> dict:
        """``layer``: the layers whose distribution the log-probabilities are (the exit layer in early exit)."""
        return {
            **self._token(ev.token, ev.logprob),
            "top_logprobs": [self._token(t, lp) for t, lp in ev.top_logprobs],
            "layer": ev.exit_layer if method == "early-exit" else ev.num_layers,
        }


class Job:
    """One request on its way through the model thread; the HTTP thread reads ``items`` (Piece..., then Done or
    Failed) and sets ``cancelled`` when its client goes away."""

    def __init__(self, request: Request):
        self.request = request
        self.items: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.finished = False
        self._lock = threading.Lock()

    def cancel(self) -> bool:
        """The HTTP side's word that the client has gone. True when the model thread had already finished the
        job: then only the HTTP side can log the hang-up (else the model thread logs it, once)."""
        with self._lock:
            self.cancelled.set()
            return self.finished

    def finish(self, item: "Done | Failed") -> bool:
        """The model thread's last item for the job; False (nothing queued) when its client has gone."""
        with self._lock:
            if self.cancelled.is_set():
                return False
            self.finished = True
            self.items.put(item)
            return True


class ModelWorker:
    def __init__(
        self, load: Callable[[], LoadedModel], adapters: Path | None, defaults: DecodingOptions, max_queue: int = 16
    ):
        self.load, self.adapters, self.defaults = load, adapters, defaults
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.lm: LoadedModel | None = None
        self.session: ChatSession | None = None
        self.decoders: OrderedDict[DecodeConfig, Decoder] = OrderedDict()
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="mlx", daemon=True)

    # ---- life cycle -----------------------------------------------------------------------------------
    def start(self) -> LoadedModel:
        """Load the model on the model thread; raise what loading raised (a bad name, a damaged folder)."""
        self.thread.start()
        self.ready.wait()
        if self.load_error is not None:
            raise self.load_error
        return self.lm

    def stop(self) -> None:
        """Refuse the requests still queued (a 503 each), then end the thread after the answer in progress; with a
        full queue a plain put would wait for every queued answer to be decoded."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._fail(job, RequestError("the server is shutting down", status=503, kind="server_error"))
        try:
            self.jobs.put(None, timeout=5)
        except queue.Full:  # requests queued meanwhile: the thread is a daemon and ends with the process
            pass
        self.thread.join(timeout=30)

    def _run(self) -> None:
        try:
            self.lm = self.load()
            # its prompt cache (with the server's KV options) and chat template serve every request
            self.session = ChatSession(self.lm, kv=self.defaults.kv)
            self.decoder(self.defaults.decode)  # the default method's adapters load now, not on the first request
        except BaseException as e:  # reported by start(), on the caller's thread
            self.load_error = e
            self.ready.set()
            return
        self.ready.set()
        while (job := self.jobs.get()) is not None:
            if job.cancelled.is_set():
                log.info("request %s skipped: its client hung up while it waited", job.request.id)
                continue
            try:
                self._serve(job)
            except RequestError as e:
                self._fail(job, e)
            except M2R2Error as e:
                self._fail(job, RequestError(str(e)))
            except Exception as e:  # a bug: the request fails with a 500, the server goes on
                log.error("request %s failed:\n%s", job.request.id, traceback.format_exc())
                self._fail(
                    job, RequestError(f"internal error ({type(e).__name__}: {e})", status=500, kind="server_error")
                )

    @staticmethod
    def _fail(job: Job, error: RequestError) -> None:
        if not job.finish(Failed(error)):
            log.info("request %s failed after its client hung up (%s)", job.request.id, error.message)

    # ---- requests ---------------------------------------------------------------------------------------
    def submit(self, request: Request) -> Job:
        """Queue a request; 503 when ``max_queue`` requests already wait."""
        method = request.options.decode.method
        if METHODS[method].needs_adapters and self.adapters is None:
            free = ", ".join(name for name, m in METHODS.items() if not m.needs_adapters)
            raise RequestError(
                f"method {method!r} needs M2R2 adapters and this server has none for its model; start m2r2-server "
                f"with --adapters DIR or a Hub repo id (methods without adapters: {free})",
                "method",
            )
        job = Job(request)
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise RequestError(
                f"the server is busy ({self.jobs.maxsize} requests waiting); retry later",
                status=503,
                kind="server_error",
            ) from None
        return job

    def decoder(self, config: DecodeConfig) -> Decoder:
        """The decoder ``config`` names, built once and kept (the last KEEP_DECODERS)."""
        key = config
        if key not in self.decoders:
            self.decoders[key] = make_decoder(self.lm, config, self.adapters)
            if self.decoders[key].note:
                log.info("note: %s", self.decoders[key].note)
            while len(self.decoders) > KEEP_DECODERS:
                self.decoders.popitem(last=False)
        self.decoders.move_to_end(key)
        return self.decoders[key]

    def check_ids(self, ids, field: str) -> None:
        """A 400 where ``ids`` (token ids the request sent in ``field``) go beyond the model's vocabulary."""
        vocab = int(self.lm.config.get("vocab_size") or 0)
        if vocab and ids and max(ids) >= vocab:
            raise RequestError(f"'{field}' holds token ids beyond the vocabulary ({vocab} tokens)", field)

    def prompt_tokens(self, req: Request) -> list[int]:
        if req.kind == "chat":
            self.session.messages = req.messages
            try:
                return self.session.prompt_tokens(tools=req.tools)
            except TemplateError as e:  # a template that refuses a conversation (roles out of order...)
                raise RequestError(f"the model's chat template cannot render these messages: {e}", "messages")
        self.session.messages = []  # a completion has no history: the list would grow by one answer per request
        if isinstance(req.prompt, list):
            self.check_ids(req.prompt, "prompt")
            return list(req.prompt)
        return list(self.lm.tokenizer.encode(req.prompt))

    def _serve(self, job: Job) -> None:
        req = job.request
        prompt = self.prompt_tokens(req)
        self.check_ids([i for i, _ in req.options.generation.sampling.logit_bias], "logit_bias")
        check_context(len(prompt), self.lm.context_length)
        decode = self.decoder(req.options.decode)
        stats, finish = AnswerStats(), None
        stream = self.session.answer(prompt, req.options.generation, decode)
        token_bytes = TokenBytes(self.lm.tokenizer, self.lm.config.get("vocab_size")) if req.logprobs else None
        try:
            for ev in stream:
                stats.add(ev)
                if token_bytes is not None and ev.logprob is not None and not ev.eos:  # as OpenAI: no end token
                    job.items.put(Piece(ev.text, [token_bytes.entry(ev, decode.name)]))
                elif ev.text:
                    job.items.put(Piece(ev.text))
                finish = ev.finish_reason
                if finish or job.cancelled.is_set():
                    break
        finally:
            stream.close()  # also when cancelled: the cache keeps only what was computed, and knows it
        method = req.options.decode.method
        if not job.finish(Done(finish or "length", stats, method)):
            log.info("request %s cancelled after %d tokens: its client hung up", req.id, stats.tokens)
            return
        log.info("request %s: %s, %s", req.id, method, stats.summary())
