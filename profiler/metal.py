"""Xcode's view of the same decode: MLX's Metal capture around it (macOS; config.check_metal_capture)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import mlx.core as mx


@contextmanager
def metal_capture(path: Path | None) -> Iterator[None]:
    if path is None:
        yield
        return
    mx.metal.start_capture(str(path))
    try:
        yield
    finally:
        mx.metal.stop_capture()
