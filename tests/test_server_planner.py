"""m2r2-server keeps one speculative engine for every request and client: requests that copy their prompt keep
drafting however many requests that do not came before them, on either connection (issue 31)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from m2r2_mlx.core.hub import packaged_adapters
from m2r2_mlx.decoding.options import DecodingOptions

import pytest

from m2r2_server.cli import build_parser
from m2r2_server.handler import Server
from m2r2_server.worker import ModelWorker

from .test_planner_session import COPYING, NOVEL

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(lm):
    flags = ["--method", "speculative", "--max-tokens", "40"]
    defaults = DecodingOptions.from_values(vars(build_parser().parse_args(flags)))
    worker = ModelWorker(lambda: lm, packaged_adapters("smollm2"), defaults, max_queue=16)
    worker.start()
    srv = Server(("127.0.0.1", 0), worker, defaults, lm.name)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()
    worker.stop()


@pytest.mark.slow
def test_copying_requests_keep_drafting_across_requests_and_clients(server):
    clients = [
        openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="none", max_retries=0)
        for _ in range(2)
    ]
    copying = [*COPYING, *COPYING, *COPYING][:6]
    requests = [prompt for pair in zip(NOVEL[:6], copying) for prompt in pair]  # novel, copying, novel, ...

    def ask(i: int):
        r = clients[i % 2].chat.completions.create(model="smollm2", messages=[{"role": "user", "content": requests[i]}])
        return requests[i], r.usage.model_extra["tokens_per_step"]

    with ThreadPoolExecutor(2) as pool:  # the two clients' requests interleave in the server's queue
        answers = list(pool.map(ask, range(len(requests))))
    per_step = [steps for prompt, steps in answers if prompt in COPYING]
    # fresh engines reach 4.9-7.3 on these, and one that stopped drafting makes 1.0. One that follows new writing
    # turns its copies back on as the copies it scores in plain steps pay: within a few tokens on a quiet machine
    # (3.3-5.6 here), within 13-19 where a busy one makes each verification dearer (1.6-2.2 with another process
    # spinning on one of the two cores; CI once had 1.8)
    assert len(per_step) == 6 and min(per_step) >= 1.5 and sorted(per_step)[3] >= 4.0, per_step
