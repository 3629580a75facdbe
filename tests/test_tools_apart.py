"""The runtime package stands apart from the build tools and from PyTorch: m2r2_mlx never imports m2r2_tools, and
imports torch only inside a function (the trainers' shared configuration runs where mlx is not installed, and
m2r2_mlx where PyTorch is not)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(tree: ast.AST, top_level_only: bool) -> set[str]:
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out


def test_the_runtime_package_imports_neither_the_tools_nor_torch_at_module_level():
    wrong = []
    for path in sorted((ROOT / "m2r2_mlx").rglob("*.py")):
        tree = ast.parse(path.read_text())
        if "m2r2_tools" in _imports(tree, top_level_only=False):
            wrong.append(f"{path.relative_to(ROOT)} imports m2r2_tools")
        if "torch" in _imports(tree, top_level_only=True):
            wrong.append(f"{path.relative_to(ROOT)} imports torch at module level")
    assert not wrong, "\n".join(wrong)
