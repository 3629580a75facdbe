"""m2r2-server: an OpenAI-compatible HTTP server for M2R2 decoding, in the manner of mlx_lm.server.

    m2r2-server                                         # the embedded SmolLM2-135M on http://127.0.0.1:8080/v1
    m2r2-server --method lookup --port 8000             # prompt lookup unless a request asks otherwise
    m2r2-server --adapters owner/repo                   # Hub adapters; their base model is the model
    M2R2_API_KEY=secret m2r2-server --host 0.0.0.0      # on the network: clients send Authorization: Bearer secret

Endpoints: POST /v1/chat/completions, POST /v1/completions (both with "stream": true for server-sent events),
GET /v1/models, GET /health. A request picks its decoding with extra fields ("method", "tau", "draft", ...);
the flags below are the defaults. Details: docs/server.md.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import sys
from functools import partial

import m2r2_mlx  # (first: preloads OpenBLAS on Linux before mlx.core)
from m2r2_mlx.decoding.methods import METHODS, resolve_for_method
from m2r2_mlx.decoding.options import DecodingOptions, add_model_options, add_options
from m2r2_mlx.errors import M2R2Error, run_cli
from m2r2_mlx.models.blas import blas_info
from m2r2_mlx.models.registry import load_model, resolve_model_path
from m2r2_mlx.moe.cache import parse_budget
from m2r2_mlx.moe.predictors import PREDICTORS
from m2r2_mlx.moe.serve import serve_with_budget

from .handler import Server
from .worker import ModelWorker

# the expert predictors a server runs: those that leave the decoder's layers as they are (the fast-stream ones wrap
# them, which the adapters a request's method loads would not find)
LAYER_PRESERVING_PREDICTORS = [n for n, e in PREDICTORS.items() if not e.needs_adapters]

log = logging.getLogger("m2r2-server")
KEY_ENV = "M2R2_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="m2r2-server",
        description="Serve a model over OpenAI's HTTP API with M2R2 "
        "decoding (early exit, lossless speculative decoding), every method per request.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {m2r2_mlx.__version__}")
    add_model_options(p, {n: PREDICTORS[n].help for n in LAYER_PRESERVING_PREDICTORS})
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${KEY_ENV}, else none; "
        f"the variable keeps the key out of the process list)",
    )
    p.add_argument("--port", type=int, default=8080, help="port (default: 8080; 0 picks a free one)")
    p.add_argument(
        "--max-queue",
        type=int,
        default=16,
        help="requests that may wait for the model; more are answered 503 (default: 16)",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="what the server logs to stderr (default: INFO: one line per request)",
    )
    p.add_argument(
        "--no-loop-guard",
        dest="loop_guard",
        action="store_false",
        help="let structured answers repeat array items and string pieces without limit (a request's "
        '"loop_guard": true still asks for the guard)',
    )
    add_options(p)
    return p


def _load(model: str, budget: str | None, predictor: str):
    """The model (on the model thread), its experts within ``budget`` where one is given."""
    lm = load_model(model, lazy=budget is not None)  # within a budget, the experts are never all read
    if budget is not None:
        serve_with_budget(lm, budget, predictor=predictor)
    return lm


def is_loopback(host: str) -> bool:
    """True when every address ``host`` names is this machine's own (127.0.0.0/8, ::1): no one else can connect."""
    try:
        infos = socket.getaddrinfo(host or None, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)
    except (OSError, ValueError):
        return False


def _main() -> int:
    args = build_parser().parse_args()
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    defaults = DecodingOptions.from_values(vars(args))  # what a request gets for the fields it leaves out
    if args.max_queue < 1:
        raise M2R2Error(f"--max-queue must be at least 1 (got {args.max_queue})")
    if not 0 <= args.port <= 65535:
        raise M2R2Error(f"--port must be in 0..65535 (got {args.port})")
    api_key = args.api_key if args.api_key is not None else os.environ.get(KEY_ENV)
    if api_key is not None and not api_key.strip():
        raise M2R2Error(f"the API key is empty; pass --api-key KEY (or set {KEY_ENV}) with a key, or neither")
    if not api_key and not is_loopback(args.host):
        print(
            f"m2r2-server: warning: listening on {args.host} without an API key: anyone who can reach this port can "
            f"use the model; set {KEY_ENV} (or pass --api-key KEY) to require one",
            file=sys.stderr,
            flush=True,
        )
    # names first: a method without adapters, or a bad name, fails before any download
    model, adapters = resolve_for_method(args.model, args.adapters, args.method)
    resolve_model_path(model)  # downloads or imports once, with progress, before the model thread starts
    if args.memory_budget is not None:
        parse_budget(args.memory_budget)  # one line for a bad budget, before anything loads
    worker = ModelWorker(
        partial(_load, model, args.memory_budget, args.expert_predictor), adapters, defaults, args.max_queue
    )
    lm = worker.start()
    try:
        server = Server((args.host, args.port), worker, defaults, lm.name, api_key, args.loop_guard)
    except OSError as e:
        raise M2R2Error(f"cannot listen on {args.host}:{args.port} ({e.strerror}); choose another --port") from None
    host, port = server.server_address[:2]
    free = " and ".join(", ".join(n for n, m in METHODS.items() if not m.needs_adapters).rsplit(", ", 1))
    methods = "all methods" if adapters else f"{free} (no adapters for this model)"
    key = "; API key required" if api_key else ""
    print(
        f"m2r2-server: {lm.name} ({lm.num_layers} layers, {methods}; default {args.method}; {blas_info().name} BLAS"
        f"{key}) on http://{host}:{port}/v1",
        file=sys.stderr,
        flush=True,
    )
    try:
        server.serve_forever()
    finally:
        server.server_close()
        worker.stop()
    return 0


def main() -> None:
    sys.exit(run_cli("m2r2-server", _main))


if __name__ == "__main__":
    main()
