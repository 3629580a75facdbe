"""A console script's ``main()`` run in this process, as a user's run would see it (its arguments, environment and
standard input; its exit code and both streams), without a new interpreter's imports (2-3 s a run). A subprocess
stays where the command itself is what is tested (tests/test_versions.py runs each once) or where a library reads
the environment at import (huggingface_hub's HF_HUB_OFFLINE)."""

from __future__ import annotations

import importlib
import io
import os
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from unittest import mock


@dataclass(frozen=True)
class Ran:
    returncode: int
    stdout: str
    stderr: str


def run_main(module: str, *args, env: dict[str, str] | None = None, stdin: str = "") -> Ran:
    """``python -m module *args`` in this process; an exception other than SystemExit propagates (a traceback)."""
    main = importlib.import_module(module).main
    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch.object(sys, "argv", [module, *map(str, args)]),
        mock.patch.dict(os.environ, env or {}),
        mock.patch.object(sys, "stdin", io.StringIO(stdin)),
        redirect_stdout(out),
        redirect_stderr(err),
    ):
        try:
            code = main()
        except SystemExit as stop:
            code = stop.code
    if not isinstance(code, int):  # sys.exit("message") prints it and exits 1
        err.write("" if code is None else f"{code}\n")
        code = 0 if code is None else 1
    return Ran(code, out.getvalue(), err.getvalue())
