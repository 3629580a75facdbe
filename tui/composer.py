"""The chat's message box: a multi-line TextArea where Enter sends and Ctrl+J (or Shift+Enter, where the terminal
reports it) starts a new line, as chat apps do."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = ("ctrl+j", "shift+enter")


class Composer(TextArea):
    DEFAULT_CSS = """
    Composer { height: auto; max-height: 8; min-height: 3; }
    """

    @dataclass
    class Submitted(Message):
        composer: "Composer"
        value: str

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)

    @property
    def value(self) -> str:
        return self.text

    @value.setter
    def value(self, text: str) -> None:
        self.text = text
        self.move_cursor(self.document.end)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
        elif event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
        else:
            await super()._on_key(event)
