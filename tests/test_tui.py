"""The Textual chat, driven with Pilot on the real default model."""

import asyncio

import pytest
from textual.widgets import Markdown, Static

from m2r2_tui.app import ChatApp
from m2r2_tui.chat import build_parser, chat_setup
from m2r2_tui.composer import Composer


def _setup(*argv):
    """What m2r2-chat runs for these flags."""
    return chat_setup(vars(build_parser().parse_args(["--max-tokens", "40", *argv])))


async def _wait(pilot, cond, timeout=120.0):
    for _ in range(int(timeout / 0.1)):
        if cond():
            return
        await pilot.pause(0.1)
    raise AssertionError("timed out waiting for the app")


def _answers(app):
    return [w for w in app.query(".assistant").results(Static)]


async def _ask(pilot, app, text):
    box = app.query_one("#input", Composer)
    await _wait(pilot, lambda: not box.disabled)
    before = len(app.session.messages)
    box.value = text
    await pilot.press("enter")
    # the answer is in the history once the stream has closed
    await _wait(pilot, lambda: len(app.session.messages) == before + 2 and not app.streaming)
    await pilot.pause(0.1)


def test_chat_answers_and_shows_stats(lm):
    async def run():
        app = ChatApp(_setup(), lm=lm)
        async with app.run_test(size=(120, 36)) as pilot:
            await _ask(pilot, app, "What is the capital of France?")
            answer = str(_answers(app)[-1].render())
            assert "Paris" in answer
            stats = str(app.query_one("#stats", Static).render())
            assert "tokens/s" in stats and "prefill" in stats
            assert "L30" in str(app.query_one("#hist", Static).render())
            assert app.session.messages[-1]["content"] in answer
            # second turn reuses the cache
            await _ask(pilot, app, "And of Germany?")
            assert "Berlin" in str(_answers(app)[-1].render())
            # /reset clears history and screen
            await _ask_command(pilot, app, "/reset")
            assert app.session.messages == [] and not _answers(app)

    asyncio.run(run())


async def _ask_command(pilot, app, text):
    box = app.query_one("#input", Composer)
    box.value = text
    await pilot.press("enter")
    await pilot.pause(0.2)


def test_escape_cancels_and_input_unlocks(lm):
    async def run():
        app = ChatApp(_setup("--max-tokens", "400"), lm=lm)
        async with app.run_test(size=(120, 36)) as pilot:
            box = app.query_one("#input", Composer)
            await _wait(pilot, lambda: not box.disabled)
            box.value = "Write a very long story about a dragon."
            await pilot.press("enter")
            await _wait(pilot, lambda: len(app.session.cache) > 60)  # prompt and some answer
            assert app.streaming and box.disabled  # input locked while streaming
            await pilot.press("escape")
            await _wait(pilot, lambda: not app.streaming)
            assert not box.disabled
            assert any("cancelled" in str(w.render()) for w in app.query(".notice").results(Static))
            partial = app.session.messages[-1]["content"]
            assert 0 < len(lm.tokenizer.encode(partial)) < 400

    asyncio.run(run())


def test_save_and_load_commands(lm, tmp_path):
    async def run():
        app = ChatApp(_setup(), lm=lm)
        async with app.run_test(size=(120, 36)) as pilot:
            await _ask(pilot, app, "What is the capital of France?")
            target = tmp_path / "c.json"
            await _ask_command(pilot, app, f"/save {target}")
            assert target.is_file()
            await _ask_command(pilot, app, f"/save {target}")  # refuses to overwrite
            assert any("already exists" in str(w.render()) for w in app.query(".notice").results(Static))
            await _ask_command(pilot, app, "/reset")
            await _ask_command(pilot, app, f"/load {target}")
            assert [m["role"] for m in app.session.messages] == ["user", "assistant"]
            assert "Paris" in str(_answers(app)[-1].render())

    asyncio.run(run())


@pytest.mark.slow
def test_modes_switch_live_and_keep_the_conversation(lm):
    async def run():
        app = ChatApp(_setup("--max-tokens", "24", "--method", "plain"), lm=lm)
        async with app.run_test(size=(120, 36)) as pilot:
            await _ask(pilot, app, "What is the capital of France?")
            plain_answer = app.session.last_answer
            await pilot.press("f2")  # plain -> speculative
            await _wait(pilot, lambda: "speculative" in app.sub_title)
            await _ask(pilot, app, "And of Germany?")
            assert "Berlin" in app.session.last_answer
            prefill = str(app.query_one("#stats", Static).render()).split("prefill")[1].split()[0]
            done, total = map(int, prefill.split("/"))
            assert done < total  # the new mode's turn reused the cache the plain turn left
            await pilot.press("f2")  # speculative -> early exit
            await _wait(pilot, lambda: "early-exit" in app.sub_title and "tau 0.90" in app.sub_title)
            await pilot.press("f3")  # tau down
            await _wait(pilot, lambda: "tau 0.85" in app.sub_title)
            await _ask_command(pilot, app, "/tau 1.01")  # never exits: plain decoding's answer
            await _wait(pilot, lambda: "tau 1.01" in app.sub_title)
            await _ask_command(pilot, app, "/regen")
            await _wait(pilot, lambda: not app.streaming and app.session.messages[-1]["role"] == "assistant", 300)
            await pilot.pause(0.3)
            assert "L30" in str(app.query_one("#hist", Static).render())
            assert "early-exit" in str(app.query_one("#stats", Static).render())
            await _ask_command(pilot, app, "/method warp")
            assert any("'warp' is unknown" in str(w.render()) for w in app.query(".notice").results(Static))
            assert [m["role"] for m in app.session.messages] == ["user", "assistant"] * 2
            assert plain_answer == app.session.messages[1]["content"]

    asyncio.run(run())


def test_multiline_message_and_markdown_answer(lm):
    async def run():
        app = ChatApp(_setup("--max-tokens", "24"), lm=lm)
        async with app.run_test(size=(120, 36)) as pilot:
            box = app.query_one("#input", Composer)
            await _wait(pilot, lambda: not box.disabled)
            box.value = "Name two fruits,"
            await pilot.press("ctrl+j", *"one per line.")  # Ctrl+J: a new line, not a send
            assert box.text == "Name two fruits,\none per line." and app.session.messages == []
            await pilot.press("enter")
            await _wait(pilot, lambda: len(app.session.messages) == 2 and not app.streaming)
            await pilot.pause(0.2)
            assert app.session.messages[0]["content"] == "Name two fruits,\none per line." and box.text == ""
            (md,) = app.query(".reply-md").results(Markdown)
            assert md.source == app.session.last_answer and md.display
            coloured = _answers(app)[-1]
            assert not coloured.display  # the exit-colour rendering waits behind F5
            await pilot.press("f5")
            assert coloured.display and not md.display
            await pilot.press("f5")
            assert md.display and not coloured.display

    asyncio.run(run())
