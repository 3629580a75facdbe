"""The code's shape: ruff's checks (line length, imports, pyflakes) pass, and imports point one way along the
layers (models -> core -> decoding -> apps), so a folder can be read knowing only the ones below it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# what each part of the package may import from the others (besides errors and atomic, which every part uses)
ALLOWED = {
    "models": set(),
    "core": {"models"},
    "decoding": {"models", "core"},
    "training": {"models", "core", "decoding"},
    "moe": {"models", "core", "decoding", "training"},
}


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the m2r2_mlx modules a file imports (relative imports resolved)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                out.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m.startswith("m2r2_mlx.")}


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_imports_point_down_the_layers(part):
    wrong = []
    for path in sorted((ROOT / "m2r2_mlx" / part).rglob("*.py")):
        for module in imported_modules(path):
            other = module.split(".")[1]
            if other in ALLOWED and other != part and other not in ALLOWED[part]:
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_the_chat_app_and_its_command_line_do_not_import_each_other():
    app_imports = [n for n in ast.walk(ast.parse((ROOT / "tui/app.py").read_text())) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in app_imports if (n.level == 1 and n.module == "chat") or n.module == "m2r2_tui.chat"]


def test_ruff_passes():
    """Lines of at most 120 characters, imports at the top and sorted (m2r2_mlx before mlx: it preloads the BLAS),
    no unused names (pyproject.toml's [tool.ruff])."""
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-1000:]
