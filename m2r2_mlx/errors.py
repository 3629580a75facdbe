"""User-facing errors: one line that names the problem and the fix."""

from __future__ import annotations

import sys
from typing import Callable


class M2R2Error(Exception):
    """An error whose message is meant for the user, printed without a traceback."""


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
