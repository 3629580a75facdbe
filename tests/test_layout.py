"""The code's shape: ruff's checks and formatter pass, imports point one way along the layers (models -> core ->
decoding -> apps), so a folder can be read knowing only the ones below it; files and signatures stay small; the
command line's Namespace stops at each CLI's main(); methods and MoE predictors are registered in one place each;
classes stay small; nothing reaches into another module or class to replace what it holds."""

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


# each registry: the module that holds it, the class its entries are, and the name of the registry itself; the
# bench keeps its baselines and controls (which users never pick) in one module of its own, under another name
REGISTRIES = {
    "Method": ("m2r2_mlx/decoding/methods.py", "METHODS"),
    "PredictorEntry": ("m2r2_mlx/moe/predictors.py", "PREDICTORS"),
}
BASELINES = {"PredictorEntry": "bench/moe_controls.py"}


@pytest.mark.parametrize("entry", sorted(REGISTRIES))
def test_registries_are_filled_in_one_place(entry):
    """A decoding method (or an MoE predictor) is one entry in its registry: none is made, and no registry of the
    same name is kept, anywhere else."""
    home, registry = REGISTRIES[entry]
    wrong = []
    for path in sources(APP_DIRS + ("experiments",)):
        if path.relative_to(ROOT).as_posix() == home:
            continue
        baselines = path.relative_to(ROOT).as_posix() == BASELINES.get(entry)
        for node in ast.walk(ast.parse(path.read_text())):
            made = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == entry
            if made and not baselines:
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


def _class_attributes(cls: ast.ClassDef) -> set[str]:
    """What a class's instances hold: its annotated fields and every ``self.x`` a method of its own assigns."""
    names = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for fn in (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for t in targets:
                for leaf in ast.walk(t) if t is not None else ():
                    if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                        if isinstance(leaf.ctx, ast.Store):
                            names.add(leaf.attr)
    return names


def _is_settings(cls: ast.ClassDef) -> bool:
    """A frozen dataclass, or a dataclass named ...Config: a record of settings (as mlx-lm's ModelArgs), whose
    fields are choices rather than state its methods keep."""
    for d in cls.decorator_list:
        if isinstance(d, ast.Call) and ast.unparse(d.func) == "dataclass":
            frozen = any(k.arg == "frozen" and ast.unparse(k.value) == "True" for k in d.keywords)
            return frozen or cls.name.endswith("Config")
        if ast.unparse(d) == "dataclass":
            return cls.name.endswith("Config")
    return False


def test_no_class_in_the_engine_holds_more_than_15_attributes():
    """A class with more state than that does several jobs: split it by concern (settings records excepted)."""
    big = []
    for path in sources(("m2r2_mlx",)):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not _is_settings(node) and len(found := _class_attributes(node)) > 15:
                big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({len(found)}: {sorted(found)})")
    assert not big, "\n".join(big)


def _imported_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _patches(tree: ast.Module) -> list[tuple[int, str]]:
    """Assignments that replace what another module or a class holds: ``module.name = ...`` or ``Class.method =
    ...`` on an imported name, any ``x.__class__ = ...``, and setattr on anything but ``self``."""
    imported, found = _imported_names(tree), []
    for node in ast.walk(tree):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        )
        for t in targets:
            for leaf in ast.walk(t):
                if not (isinstance(leaf, ast.Attribute) and isinstance(leaf.ctx, ast.Store)):
                    continue
                if leaf.attr == "__class__":
                    found.append((node.lineno, "assigns __class__"))
                root = leaf.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in imported:
                    found.append((node.lineno, f"assigns {ast.unparse(leaf)}"))
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("setattr", "object.__setattr__", "type.__setattr__") and node.args:
                first = node.args[0]
                if not (isinstance(first, ast.Name) and first.id == "self") or "__class__" in ast.unparse(node):
                    found.append((node.lineno, f"calls {ast.unparse(node)}"))
    return found


def test_nothing_outside_tests_patches_another_module_or_class():
    """Tools watch the engine through hooks (m2r2_mlx/tracing.py) and swap modules with ``update_modules``
    (or torch's ``set_submodule``); none replaces a module's function, a class's method or an object's class."""
    wrong = [
        f"{path.relative_to(ROOT)}:{line} {what}"
        for path in sources(APP_DIRS + ("experiments", "scripts"))
        for line, what in _patches(ast.parse(path.read_text()))
    ]
    assert not wrong, "\n".join(wrong)


def test_the_patch_finder_finds_patches():
    found = _patches(
        ast.parse(
            "import mlx.nn as nn\nfrom m2r2_mlx.decoding import speculative\nnn.Linear.__call__ = f\n"
            "speculative.NextToken = g\nplanner.__class__ = C\nsetattr(owner, 'rope', h)\nself.x = 1\n"
        )
    )
    assert [line for line, _ in found] == [3, 4, 5, 6]
