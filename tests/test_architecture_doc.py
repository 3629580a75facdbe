"""docs/architecture.md follows the code: every code name it puts in backticks imports, and every path it names
exists, so a rename that leaves the walk-through behind fails here; its glossary's names are the ones the code
uses, and the old synonyms are gone."""

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
    "m2r2_mlx.api",
    "m2r2_mlx.tracing",
    "m2r2_mlx.errors",
    "m2r2_mlx.core.config",
    "m2r2_profiler.instrument",
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
    "m2r2_mlx.decoding.methods",
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


def glossary() -> dict[str, str]:
    """term -> the row's "in the code" cell."""
    text = DOC.read_text().split("## Glossary", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    return {cells[0].strip(): cells[2] for cells in rows[1:]}


def test_the_glossary_names_the_codes_names():
    from m2r2_mlx.decoding.methods import DRAFTERS, METHODS, PLANNERS
    from m2r2_mlx.moe.predictors import PREDICTORS

    terms = glossary()
    assert {"method", "fast stream", "layerskip", "drafter", "planner", "event", "tracer"} <= set(terms)
    assert all(resolves(n) for cell in terms.values() for n in re.findall(r"`([^`]+)`", cell) if checked(n))
    described = DOC.read_text().split("\n| method |", 1)[1].split("|", 1)[0]
    listed = re.findall(r"`([\w-]+)`", described)
    assert listed == list(METHODS)
    assert (
        "fast" in DRAFTERS
        and "layerskip" in DRAFTERS
        and "fast" in PREDICTORS
        and set(PLANNERS) == {"cost", "verify-all"}
    )


def test_one_name_per_thing():
    """The fast stream is "fast" and the slow state's own exit "layerskip" wherever a name is chosen: methods,
    drafters, MoE predictors, the trainers' agreement metrics (old adapters' "m2r2"/"naive" are read as these)."""
    from m2r2_mlx.core.config import AdapterMetrics
    from m2r2_mlx.decoding.methods import DRAFTERS, METHODS
    from m2r2_mlx.moe.predictors import PREDICTORS

    for registry in (METHODS, DRAFTERS, PREDICTORS):
        assert not {"m2r2", "naive", "hybrid"} & set(registry)
    old = AdapterMetrics(heldout_agreement={"gates": [6], "m2r2": [0.4], "naive": [0.1], "scored": {"m2r2": [0.5]}})
    assert old.agreement(6) == 0.4 and old.agreement(6, adapters=False) == 0.1
    assert (
        set(old.heldout_agreement) == {"gates", "fast", "layerskip", "scored"}
        and "fast" in old.heldout_agreement["scored"]
    )
