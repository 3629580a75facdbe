"""SVG snapshots of the chat's main screens, on the real default model (pytest-textual-snapshot).

What varies between machines and runs is pinned, nothing else: the decode clock (a fake
perf_counter inside the decoding engine only: the events' timings and the clock the adaptive methods learn
their costs from), the BLAS line, the peak-memory reading and the input's blinking cursor (held solid).
Tokens, the answer as Markdown, their exit-depth colours (F5), the legend, the panel layout and the histogram
are real.
Update after an intended UI change with: pytest tests/test_tui_snapshots.py --snapshot-update
"""

from types import SimpleNamespace

import m2r2_mlx.decoding.events as events_module
import m2r2_mlx.tracing as tracing_module
from m2r2_mlx.models.blas import BlasInfo

import mlx.core as mx
import pytest

import m2r2_tui.app as app_module
from m2r2_tui.app import ChatApp
from m2r2_tui.chat import build_parser, chat_setup
from m2r2_tui.composer import Composer

from .test_tui import _ask

SIZE = (110, 30)


@pytest.fixture
def steady(monkeypatch):
    ticks = iter(range(10**9))
    clock = SimpleNamespace(perf_counter=lambda: next(ticks) * 0.05)
    monkeypatch.setattr(events_module, "time", clock)
    monkeypatch.setattr(tracing_module, "time", clock)
    monkeypatch.setattr(app_module, "blas_info", lambda: BlasInfo("openblas", None, ""))
    monkeypatch.setattr(mx, "get_peak_memory", lambda: 600_000_000)


def _app(lm, *argv):
    return ChatApp(chat_setup(vars(build_parser().parse_args(["--max-tokens", "12", *argv]))), lm=lm)


def _steady_cursor(pilot):
    """The input's cursor blinks on a timer: a snapshot could catch it either way. Keep it solid."""
    pilot.app.query_one("#input", Composer).cursor_blink = False


def test_snapshot_default_answer(lm, steady, snap_compare):
    async def ask(pilot):
        _steady_cursor(pilot)
        await _ask(pilot, pilot.app, "What is the capital of France?")

    assert snap_compare(_app(lm), terminal_size=SIZE, run_before=ask)


def test_snapshot_early_exit_colours(lm, steady, snap_compare):
    async def ask(pilot):
        _steady_cursor(pilot)
        await _ask(pilot, pilot.app, "Name three colors.")
        await pilot.press("f5")  # the answer's tokens in their exit-depth colours rather than as Markdown

    assert snap_compare(_app(lm, "--method", "early-exit", "--tau", "0.6"), terminal_size=SIZE, run_before=ask)
