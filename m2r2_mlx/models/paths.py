"""Where m2r2 keeps what it builds, importable without mlx-lm (m2r2-cache starts in a fraction of a second)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """Where m2r2 keeps imported models: $M2R2_HOME, else $XDG_CACHE_HOME/m2r2-mlx."""
    if os.environ.get("M2R2_HOME"):
        return Path(os.environ["M2R2_HOME"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "m2r2-mlx"
