"""docs/architecture.md follows the code: every code name it puts in backticks imports, and every path it names
exists, so a rename that leaves the walk-through behind fails here."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
# where a bare name may live (a dotted name starts with one of these modules' attributes)
MODULES = [
    "m2r2_mlx",
    "m2r2_mlx.decoding.speculative",
    "m2r2_mlx.decoding.planner",
    "m2r2_mlx.decoding.drafters",
    "m2r2_mlx.decoding.draft",
    "m2r2_mlx.decoding.protocols",
    "m2r2_mlx.decoding.costs",
    "m2r2_mlx.decoding.sampling",
    "m2r2_mlx.decoding.prompt_cache",
    "m2r2_mlx.decoding.events",
    "m2r2_mlx.decoding.stats",
    "m2r2_mlx.decoding.decoders",
    "m2r2_mlx.decoding.config",
    "m2r2_mlx.decoding.options",
    "m2r2_mlx.decoding.chat",
    "m2r2_mlx.decoding.stops",
    "m2r2_mlx.decoding.generate",
    "m2r2_mlx.decoding.early_exit",
    "m2r2_mlx.decoding.grammar",
    "m2r2_mlx.estimates",
    "m2r2_mlx.models.registry",
    "m2r2_mlx.core.fast_stream",
    "m2r2_tui.session",
    "m2r2_tui.chat",
    "m2r2_tui.app",
    "m2r2_tui.render",
    "m2r2_server.worker",
    "m2r2_server.protocol",
    "m2r2_bench.methods",
]
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def spans() -> list[str]:
    return re.findall(r"`([^`\n]+)`", DOC.read_text())


def _walk(obj, parts: list[str]) -> bool:
    try:
        for part in parts:
            obj = getattr(obj, part)
        return True
    except AttributeError:
        return False


def resolves(name: str) -> bool:
    """An attribute path from one of MODULES, from a module named by its last part (``stops.apply_stops``), or
    from a module named in full (``m2r2_tui.session.make_session``)."""
    parts = name.split(".")
    modules = [importlib.import_module(m) for m in MODULES]
    if any(_walk(m, parts) for m in modules):
        return True
    if any(_walk(m, parts[1:]) for m in modules if m.__name__.rsplit(".", 1)[-1] == parts[0]):
        return True
    for cut in range(len(parts), 0, -1):
        try:
            return _walk(importlib.import_module(".".join(parts[:cut])), parts[cut:])
        except ImportError:
            continue
    return False


def checked(span: str) -> bool:
    """Code names: types (a capital letter) and qualified names (a dot); bare lower-case words are fields and
    mode names, read in context."""
    return bool(IDENTIFIER.match(span)) and not span.endswith((".py", ".md")) and (span != span.lower() or "." in span)


def test_the_walkthrough_names_code_that_exists():
    names = [s for s in spans() if checked(s)]
    paths = re.findall(r"[\w/]+\.py\b", DOC.read_text())
    assert len(names) > 30 and len(paths) > 10  # the walk-through still names things
    missing = sorted({n for n in names if not resolves(n)})
    assert not missing, f"docs/architecture.md names code that does not exist: {missing}"
    where = [ROOT, ROOT / "m2r2_mlx", ROOT / "m2r2_mlx" / "decoding", ROOT / "tui", ROOT / "server", ROOT / "bench"]
    absent = sorted({p for p in paths if not any((w / p).exists() for w in where)})
    assert not absent, f"docs/architecture.md names paths that do not exist: {absent}"


@pytest.mark.parametrize("name", ["Speculator.__call__", "CostPlanner.plan", "Planner", "StepPlan", "Outcome"])
def test_the_speculative_step_is_described(name):
    assert f"`{name}`" in DOC.read_text()
