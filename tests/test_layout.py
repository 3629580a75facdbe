"""The code's shape: ruff's checks and formatter pass, imports point one way along the layers (models -> core ->
decoding -> apps), so a folder can be read knowing only the ones below it; files and signatures stay small; the
command line's Namespace stops at each CLI's main(); modes and MoE predictors are registered in one place each."""

from __future__ import annotations

import ast
import re
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


def test_ruff_format_is_applied():
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", str(ROOT)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-1000:]


# first-party code: the engine, the PyTorch side, the apps, the build tools (what the wheel installs), the studies
# and the tests
APP_DIRS = ("m2r2_mlx", "m2r2_torch", "tui", "server", "convert", "bench", "profiler", "tools")
SOURCE_DIRS = (*APP_DIRS, "experiments", "tests")


def sources(dirs=SOURCE_DIRS) -> list[Path]:
    return sorted(p for d in dirs if (ROOT / d).is_dir() for p in (ROOT / d).rglob("*.py"))


def test_no_source_file_is_over_400_lines():
    long = [f"{p.relative_to(ROOT)}: {n}" for p in sources() if (n := len(p.read_text().splitlines())) > 400]
    assert not long, "split by responsibility:\n" + "\n".join(long)


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    a = fn.args
    return [p for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_function_takes_more_than_8_parameters():
    """Settings travel as frozen configs (GenerationConfig, DecodeConfig, TrainConfig...), not keyword lists."""
    wide = [
        f"{p.relative_to(ROOT)}:{fn.lineno} {fn.name} ({len(_parameters(fn))})"
        for p in sources()
        for fn in _functions(p)
        if len(_parameters(fn)) > 8
    ]
    assert not wide, "\n".join(wide)


def _is_cli_module(path: Path) -> bool:
    """A command's module (build_parser() and main()), or a cli.py of parser builders its commands share."""
    names = {fn.name for fn in _functions(path)}
    return ("main" in names and "build_parser" in names) or path.name == "cli.py"


def test_library_modules_parse_no_command_line():
    """argparse lives in the CLI modules (a build_parser() and a main(), run as a console script or with -m)."""
    wrong = []
    for path in sources(APP_DIRS):
        tree = ast.parse(path.read_text())
        imports = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imports |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        if "argparse" in imports and not _is_cli_module(path):
            wrong.append(str(path.relative_to(ROOT)))
    assert not wrong, "library modules importing argparse:\n" + "\n".join(wrong)


def _takes_a_namespace(p: ast.arg) -> bool:
    """Annotated as a Namespace, or an unannotated ``args`` (a model's ``args: ModelArgs`` is mlx-lm's habit)."""
    note = ast.unparse(p.annotation) if p.annotation is not None else ""
    return note.endswith("Namespace") or (p.arg == "args" and not note)


def test_the_namespace_stops_at_main():
    """Only main() sees the parsed command line; what it calls takes configs and values."""
    wrong = [
        f"{p.relative_to(ROOT)}:{fn.lineno} {fn.name}"
        for p in sources(APP_DIRS + ("experiments",))
        for fn in _functions(p)
        if fn.name not in ("main", "_main") and any(_takes_a_namespace(a) for a in _parameters(fn))
    ]
    assert not wrong, "functions taking the argparse Namespace:\n" + "\n".join(wrong)


# each registry: the module that holds it, the class its entries are, and the name of the registry itself
REGISTRIES = {
    "Mode": ("m2r2_mlx/decoding/decoders.py", "MODES"),
    "PredictorEntry": ("m2r2_mlx/moe/predictors.py", "PREDICTORS"),
}


@pytest.mark.parametrize("entry", sorted(REGISTRIES))
def test_registries_are_filled_in_one_place(entry):
    """A decoding mode (or an MoE predictor) is one entry in its registry: none is made, and no registry of the
    same name is kept, anywhere else."""
    home, registry = REGISTRIES[entry]
    wrong = []
    for path in sources(APP_DIRS + ("experiments",)):
        if path.relative_to(ROOT).as_posix() == home:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == entry:
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} makes a {entry}")
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == registry for t in targets):
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} keeps its own {registry}")
    assert not wrong, "\n".join(wrong)


def test_every_package_is_installed_under_the_projects_name():
    """pyproject lists packages one by one (the apps' folders install under m2r2_* names): a new subpackage must
    be listed too, or the wheel would leave it out."""
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is Python 3.11+; the project supports 3.10)
    packages = re.search(r"^packages = \[(.*?)\]", text, re.M | re.S).group(1)
    listed = set(re.findall(r'"([\w.]+)"', packages))
    mapped = re.search(r"^\[tool\.setuptools\.package-dir\]\n(.*?)(?:\n\n|\Z)", text, re.M | re.S).group(1)
    folders = {folder: name for name, folder in re.findall(r'^(\w+) = "(\w+)"', mapped, re.M)}
    missing = []
    for init in sorted(ROOT.glob("*/**/__init__.py")):
        parts = init.parent.relative_to(ROOT).parts
        if parts[0] in ("tests", "experiments") or ".venv" in parts or "build" in parts:
            continue
        name = ".".join((folders.get(parts[0], parts[0]), *parts[1:]))
        if name not in listed:
            missing.append(name)
    assert all(name.startswith("m2r2_") for name in listed) and not missing, missing
