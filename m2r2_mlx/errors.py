"""User-facing errors: one line that names the problem and the fix."""

from __future__ import annotations

import math
import sys
from typing import Callable


class M2R2Error(Exception):
    """An error whose message is meant for the user, printed without a traceback."""


class ConfigError(M2R2Error):
    """A config field out of range: ``field`` names it, ``rule`` says what it must be."""

    def __init__(self, field: str, rule: str, value):
        super().__init__(f"{field} {rule} (got {value})")
        self.field, self.rule, self.value = field, rule, value


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check(obj, checks: dict[str, tuple[bool, str]]) -> None:
    """Raise ConfigError for the first field whose check fails: ``{field: (ok, rule)}``."""
    for name, (ok, rule) in checks.items():
        if not ok:
            raise ConfigError(name, rule, getattr(obj, name))


def run_cli(prog: str, main: Callable[[], int | None]) -> int:
    """Run a CLI body; turn M2R2Error (and Ctrl-C) into one clean line and an exit code."""
    try:
        return main() or 0
    except M2R2Error as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
