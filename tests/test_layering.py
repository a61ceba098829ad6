"""Layers import downward only: entrypoints > engine > runner > graphs >
attention/models/layers/loader/distributed/multimodal > mem.
Every `import ostinato.X` / `from ostinato.X ...` in the package, TYPE_CHECKING blocks included, is checked."""

import ast
from pathlib import Path

import ostinato

LEVEL = {"entrypoints": 5, "engine": 4, "runner": 3, "graphs": 2, "attention": 1, "models": 1, "layers": 1,
         "loader": 1, "distributed": 1, "multimodal": 1, "megakernel": 1, "mem": 0}


def _imported_packages(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return [n.split(".")[1] for n in names if n.startswith("ostinato.") and n.count(".") >= 1]


def test_no_module_imports_an_upper_layer():
    root = Path(ostinato.__file__).parent
    bad, checked = [], 0
    for path in root.rglob("*.py"):
        layer = path.relative_to(root).parts[0]
        if layer not in LEVEL:  # the package root and shared leaf modules (config, sampling_params, outputs)
            continue
        checked += 1
        for pkg in _imported_packages(path):
            if LEVEL.get(pkg, -1) > LEVEL[layer]:
                bad.append(f"{path.relative_to(root)} imports ostinato.{pkg}")
    assert checked > 30
    assert not bad, bad
