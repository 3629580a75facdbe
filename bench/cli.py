"""What m2r2-bench's benchmarks share on their command lines."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable


def method_list(known: Iterable[str]) -> Callable[[str], str]:
    """An argparse type for ``--methods a,b,c`` drawn from ``known``: a name the benchmark does not have (a renamed
    method) fails while parsing, in argparse's one line, before any model loads. The value stays the text given."""
    choices = tuple(known)

    def methods(text: str) -> str:
        bad = [m.strip() for m in text.split(",") if m.strip() and m.strip() not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown methods {bad}; choose from {', '.join(choices)}")
        return text

    return methods
