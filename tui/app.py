"""The Textual chat screen: conversation on the left, live decode statistics on the right.

All MLX work (loading, decoding) runs on one background thread, so the interface
never freezes and MLX always sees the same thread; tokens reach the screen
through ``call_from_thread``.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Callable, Iterator

from m2r2_mlx.decoding.methods import LIVE_METHODS, METHODS
from m2r2_mlx.decoding.stats import AnswerStats
from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.models.blas import blas_info
from m2r2_mlx.models.registry import load_model
from m2r2_mlx.moe.serve import budget_line

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Footer, Header, Label, Markdown, Sparkline, Static

from .composer import Composer
from .render import legend, token_text
from .session import ChatSetup, decoder_for, make_session

HELP = (
    "Enter sends, Ctrl+J new line · F2 next method · F3/F4 tau -/+ · F5 Markdown/exit colours · "
    f"/method {'|'.join(LIVE_METHODS)} · /tau X · /regen  answer again · "
    "/reset  new conversation · /save FILE (/save! FILE overwrites) · /load FILE · /copy  copy last answer · /quit"
)


class MLXThread:
    """One long-lived thread that runs every MLX job in order."""

    def __init__(self) -> None:
        self.jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="mlx", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                job()
            except Exception:  # its own handler failed (the app closing): the thread lives on for the next job
                pass

    def submit(self, job: Callable[[], None]) -> None:
        self.jobs.put(job)

    def stop(self) -> None:
        self.jobs.put(None)


class ChatApp(App):
    TITLE = "m2r2-chat"
    CSS = """
    #main { height: 1fr; }
    #log { width: 1fr; padding: 0 1; }
    #side { width: 38; border-left: solid $primary; padding: 0 1; }
    .user { color: $text-muted; margin-top: 1; }
    .assistant { margin-bottom: 1; }
    /* a finished answer shows as Markdown; F5 shows its tokens coloured by exit depth instead */
    .reply-colours { display: none; }
    .reply-md { margin: 0 0 1 0; padding: 0; background: $background; }
    Screen.colours .reply-colours { display: block; }
    Screen.colours .reply-md { display: none; }
    .notice { color: $warning; }
    #spark { height: 3; }
    #legend { height: 1; padding: 0 1; }
    """
    BINDINGS = [
        Binding("escape", "cancel", "Cancel answer"),
        Binding("ctrl+r", "regen", "Regenerate"),
        Binding("ctrl+y", "copy", "Copy answer"),
        Binding("ctrl+l", "reset", "New chat"),
        Binding("f2", "next_method", "Method"),
        Binding("f3", "tau(-0.05)", "tau-"),
        Binding("f4", "tau(0.05)", "tau+"),
        Binding("f5", "toggle_colours", "Markdown/colours"),
        Binding("ctrl+q", "quit", "Quit"),
    ]

    def __init__(self, setup: ChatSetup, lm=None) -> None:
        super().__init__()
        self.setup = setup
        self.lm = lm
        self.session = None
        self.streaming = False
        self.cancel_event = threading.Event()
        self.mlx = MLXThread()

    # ---- layout -------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            yield VerticalScroll(id="log")
            with Vertical(id="side"):
                yield Static("", id="stats")
                yield Label("exit depth, last 64 tokens")
                yield Sparkline([], id="spark")
                yield Static("", id="hist")
        yield Static("", id="legend")
        yield Composer(placeholder="loading the model…", id="input", disabled=True)
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = f"{self.setup.model} · {self.setup.method}"
        self.mlx.submit(self._job_load)

    def on_unmount(self) -> None:
        self.cancel_event.set()
        cache = getattr(self.session, "expert_cache", None)
        if cache is not None:  # stop the expert loader on the MLX thread, after any answer still running
            self.mlx.submit(cache.close)
        self.mlx.stop()

    def _job_load(self) -> None:
        try:
            lm = self.lm or load_model(self.setup.model, lazy=self.setup.experts is not None)
            self.session = make_session(self.setup, lm)
        except M2R2Error as e:
            self.call_from_thread(self._post, f"error: {e}", "notice")
            return
        except Exception as e:  # a bug: said in one line rather than a screen that waits forever
            self.call_from_thread(self._post, f"error: could not load the model ({type(e).__name__}: {e})", "notice")
            return
        self.lm = lm
        self.call_from_thread(self._model_ready)

    def _model_ready(self) -> None:
        self._show_method()
        self._update_stats(AnswerStats())
        self._post(f"ready · {blas_info().describe()} · {HELP}", "notice")
        self._post(self._method_line(), "notice")
        if self.session.decode.note:
            self._post(f"note: {self.session.decode.note}", "notice")
        self._unlock_input()

    def _show_method(self) -> None:
        tau = f" · tau {self.setup.options.decode.tau:.2f}" if self.setup.method == "early-exit" else ""
        self.sub_title = f"{self.lm.path.name} · {self.lm.num_layers} layers · {self.setup.method}{tau}"
        depths = self.session.decode.exit_layers
        self.query_one("#legend", Static).update(legend(depths, self.lm.num_layers))

    def _method_text(self) -> str:
        method = self.setup.method
        return method + (f" (tau {self.setup.options.decode.tau:.2f})" if method == "early-exit" else "")

    def _method_line(self) -> str:
        """What the method in use does, and what its knob trades."""
        return f"method {self._method_text()}: {METHODS[self.setup.method].pick_when}"

    # ---- live method switching: the conversation and its cache carry over ----------------------
    def switch_method(self, method: str, tau: float | None = None) -> None:
        if self.session is None:
            return
        if self.streaming:
            self.notify("wait for the answer to finish (Esc cancels it)")
            return
        if method not in LIVE_METHODS:
            why = "is not switched to live; restart with --method " + method if method in METHODS else "is unknown"
            self._post(f"error: method {method!r} {why}; live: {', '.join(LIVE_METHODS)}", "notice")
            return
        tau = None if tau is None else min(max(tau, 0.0), 1.01)
        self.mlx.submit(lambda: self._job_switch(method, tau))

    def _job_switch(self, method: str, tau: float | None) -> None:
        """Runs on the MLX thread: a new decoder for the same session (history and cache kept)."""
        try:  # a KV cache shaped by --max-kv-size/--kv-bits serves plain only: with_method refuses the others
            setup = self.setup.with_method(method, tau)
            decoder = decoder_for(setup, self.lm)
        except M2R2Error as e:
            self.call_from_thread(self._post, f"error: {e}", "notice")
            return
        self.session.decode = decoder  # here, before the next job on this thread
        self.call_from_thread(self._method_switched, setup)

    def _method_switched(self, setup: ChatSetup) -> None:
        self.setup = setup
        self._show_method()
        self.notify(f"method: {self._method_text()}")
        self._post(self._method_line(), "notice")
        if self.session.decode.note:
            self._post(f"note: {self.session.decode.note}", "notice")

    def action_next_method(self) -> None:
        method = self.setup.method
        i = LIVE_METHODS.index(method) if method in LIVE_METHODS else -1
        self.switch_method(LIVE_METHODS[(i + 1) % len(LIVE_METHODS)])

    def action_tau(self, delta: float) -> None:
        self.switch_method("early-exit", round(self.setup.options.decode.tau + delta, 2))

    # ---- helpers ------------------------------------------------------------------------
    def _post(self, text: str | Text, classes: str = "") -> Static:
        widget = Static(text, classes=classes)
        log = self.query_one("#log", VerticalScroll)
        log.mount(widget)
        log.scroll_end(animate=False)
        return widget

    def _unlock_input(self) -> None:
        box = self.query_one("#input", Composer)
        box.disabled = False
        box.placeholder = "message, or /help (Enter sends, Ctrl+J new line)"
        box.focus()

    def _expert_lines(self) -> str:
        cache = getattr(self.session, "expert_cache", None)
        if cache is None:
            return ""
        st = cache.stats
        return (
            f"\nexperts hit    {100 * st.hit_rate:7.0f}%\n"
            f"moved/token   {st.bytes_per_token / 1e6:6.2f} MB\n"
            f"{budget_line(cache, 16)}"
        )

    def _update_stats(self, s: AnswerStats) -> None:
        accepted = s.accepted_per_step
        self.query_one("#stats", Static).update(
            f"method   {self.setup.method:>14s}\n"
            f"tokens/s       {s.tokens_per_s:8.1f}\n"
            f"tokens         {s.tokens:8d}\n"
            f"accepted/step  {accepted:8.2f}\n"
            + (
                f"drafting {('off' if s.plan == 'plain' else s.plan)[:20]:>20s}\ndrafts   {s.drafts_line()[:20]:>20s}\n"
                if s.plan
                else ""
            )
            + f"layers skipped {100 * s.layers_skipped:7.0f}%\n"
            f"peak memory    {s.peak_memory_gb:6.2f} GB\n"
            f"prefill        {s.prefill_tokens:>4d}/{s.prompt_tokens:<4d}\n"
            f"BLAS           {blas_info().name:>8s}" + self._expert_lines()
        )
        self.query_one("#spark", Sparkline).data = s.exit_layers[
            -64:
        ]  # empty before the first answer: a blank line, not full bars
        hist = s.exit_histogram()
        top = max(hist.values(), default=1)
        self.query_one("#hist", Static).update(
            "\n".join(f"L{d:<3d}{'█' * max(1, round(20 * n / top))} {n}" for d, n in hist.items())
        )

    # ---- answering ----------------------------------------------------------------------
    def on_composer_submitted(self, event: Composer.Submitted) -> None:
        text = event.value.strip()
        if not text or self.streaming or self.session is None:
            return  # what was typed stays in the box until it can be sent
        event.composer.value = ""
        if text.startswith("/"):
            self._run_command(text)
            return
        self._post(Text(f"you › {text}"), "user")
        self._start_answer(lambda: self.session.send(text, self.setup.options.generation))

    def _start_answer(self, make_stream: Callable[[], Iterator]) -> None:
        self.streaming = True
        self.cancel_event.clear()
        box = self.query_one("#input", Composer)
        box.disabled = True
        box.placeholder = "answering… (Esc cancels)"
        widget = self._post(Text(""), "assistant")
        self.mlx.submit(lambda: self._job_stream(make_stream, widget))

    def _job_stream(self, make_stream: Callable[[], Iterator], widget: Static) -> None:
        """Runs on the MLX thread."""
        stats, text, note = AnswerStats(), Text(), None
        try:
            stream = make_stream()
            try:
                for ev in stream:
                    stats.add(ev)
                    source = ev.spec.source if ev.spec else None
                    text.append_text(token_text(ev.text, ev.exit_layer, ev.num_layers, ev.drafted, source))
                    self.call_from_thread(self._stream_progress, widget, text.copy(), stats)
                    if self.cancel_event.is_set():
                        note = "cancelled"
                        break
            finally:
                stream.close()  # the session records the partial answer; the cache stays consistent
        except M2R2Error as e:
            note = f"error: {e}"
        except Exception as e:  # a bug: the chat says so in one line and takes the next message
            note = f"error: the answer failed ({type(e).__name__}: {e})"
        self.call_from_thread(self._stream_finished, widget, stats, note)

    def _stream_progress(self, widget: Static, text: Text, stats: AnswerStats) -> None:
        widget.update(text)
        self._update_stats(stats)
        self.query_one("#log", VerticalScroll).scroll_end(animate=False)

    def _stream_finished(self, widget: Static, stats: AnswerStats, note: str | None) -> None:
        self.streaming = False
        if stats.tokens:
            self._show_markdown(widget, self.session.last_answer)
        else:  # refused before a token (a prompt over the context): no answer to show, not the previous one
            widget.remove()
        if note:
            self._post(note, "notice")
        self._update_stats(stats)
        self._unlock_input()

    def _show_markdown(self, widget: Static, answer: str) -> None:
        """A finished answer as Markdown, beside its exit-colour rendering (shown instead with F5)."""
        widget.add_class("reply-colours")
        self.query_one("#log", VerticalScroll).mount(Markdown(answer, classes="reply-md"), after=widget)

    def action_toggle_colours(self) -> None:
        self.screen.toggle_class("colours")

    # ---- actions and slash commands ------------------------------------------------------
    def action_cancel(self) -> None:
        if self.streaming:
            self.cancel_event.set()

    def action_regen(self) -> None:
        if self.session is None or self.streaming:
            return
        try:
            stream = self.session.regenerate(self.setup.options.generation)
        except M2R2Error as e:
            self._post(f"error: {e}", "notice")
            return
        self._post("(regenerating)", "notice")
        self._start_answer(lambda: stream)

    def action_copy(self) -> None:
        if self.session and self.session.last_answer:
            self.copy_to_clipboard(self.session.last_answer)
            self.notify("last answer copied")

    def action_reset(self) -> None:
        if self.session is None or self.streaming:
            return
        self.session.reset()
        self.query_one("#log", VerticalScroll).remove_children()
        self._update_stats(AnswerStats())
        self._post("new conversation", "notice")

    def _run_command(self, line: str) -> None:
        cmd, _, arg = line.partition(" ")
        arg = arg.strip()
        try:
            if cmd == "/regen":
                self.action_regen()
            elif cmd == "/reset":
                self.action_reset()
            elif cmd == "/copy":
                self.action_copy()
            elif cmd in ("/save", "/save!"):
                if not arg:
                    raise M2R2Error("usage: /save FILE")
                path = self.session.save(arg, overwrite=cmd == "/save!")
                self._post(f"saved {len(self.session.messages)} messages to {path}", "notice")
            elif cmd == "/load":
                if not arg:
                    raise M2R2Error("usage: /load FILE")
                self.session.load(arg)
                self.query_one("#log", VerticalScroll).remove_children()
                for m in self.session.messages:
                    if m["role"] == "user":
                        self._post(Text("you › " + m["content"]), "user")
                    elif m["role"] == "assistant":
                        self._show_markdown(self._post(Text(m["content"]), "assistant"), m["content"])
                self._post(f"loaded {Path(arg).name}", "notice")
            elif cmd in ("/method", "/mode"):
                self.switch_method(arg)
            elif cmd == "/tau":
                try:
                    tau = float(arg)
                except ValueError:
                    raise M2R2Error("usage: /tau X, a number in [0, 1] (above 1 never exits)") from None
                self.switch_method("early-exit", tau)
            elif cmd in ("/quit", "/exit"):
                self.exit()
            elif cmd == "/help":
                self._post(HELP, "notice")
            else:
                raise M2R2Error(f"unknown command {cmd}; {HELP}")
        except M2R2Error as e:
            self._post(f"error: {e}", "notice")
