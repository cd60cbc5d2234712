"""Where tuning sits in the import DAG: at module level it imports only lower layers
(core, launch) and the kernels' configs; the ops only inside the functions that tune
them; and nothing below it (core, host, launch, the ops, moe) imports it."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULE_LEVEL_ALLOWED = (
    "jax_bridge.core",
    "jax_bridge.launch",
    "jax_bridge.tuning",
    "triton_kernels",
)


def _names(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if isinstance(node, ast.ImportFrom) and node.module:
        return {node.module}
    return set()


def _module_level_imports(path: pathlib.Path) -> set[str]:
    """Imports executed when the module is imported: top-level statements, including
    those under top-level `if`/`try` blocks, never those inside functions or classes."""
    names, pending = set(), list(ast.parse(path.read_text()).body)
    while pending:
        node = pending.pop()
        names |= _names(node)
        if isinstance(node, ast.If | ast.Try):
            pending += node.body + node.orelse + getattr(node, "finalbody", [])
    return names


def _first_party(names: set[str]) -> set[str]:
    return {n for n in names if n.split(".")[0] in ("jax_bridge", "triton_kernels", "pallas_tpu")}


def test_tuning_imports_only_lower_layers_at_module_level():
    for path in sorted((ROOT / "jax_bridge" / "tuning").glob("*.py")):
        for name in _first_party(_module_level_imports(path)):
            assert name.startswith(MODULE_LEVEL_ALLOWED), f"{path.name} imports {name}"


def test_nothing_below_tuning_imports_it():
    for package in ("core", "host", "launch", "attention", "grouped_matmul", "moe"):
        for path in sorted((ROOT / "jax_bridge" / package).rglob("*.py")):
            imported = set().union(*map(_names, ast.walk(ast.parse(path.read_text()))))
            assert not [n for n in imported if n.startswith("jax_bridge.tuning")], path
