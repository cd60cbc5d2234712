"""Import rules: the layers form a DAG and the CPU-only path never needs jax_triton.

Static rules (read from each module's import statements):
  jax_bridge.core     imports nothing else of the package;
  jax_bridge.host     imports only core;
  jax_bridge.launch   imports only core and triton_kernels.config (Triton's spellings, a
                      leaf that imports nothing of the package); jax_triton lazily:
                      checked at run time below;
  an op package       imports core, host, launch, triton_kernels, pallas_tpu and its own
                      modules, never another op's; only its api.py imports its backends;
  jax_bridge.moe      (layers built on ops) imports core and the grouped matmul op;
  triton_kernels      never imports jax; pallas_tpu never imports jax_bridge.
  inside jax_bridge   the module import graph has no cycle (every import counts: inside a
                      function, under TYPE_CHECKING); a backend takes its options type
                      from the op's options.py, never from the api.py that imports it.
"""

import ast
import importlib.metadata
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPS = ("attention", "block_sparse", "grouped_matmul")
BACKENDS = ("xla", "triton", "pallas")
ALLOWED = {
    "core": {"jax_bridge.core"},
    "host": {"jax_bridge.core", "jax_bridge.host"},
    "launch": {"jax_bridge.core", "jax_bridge.launch", "triton_kernels.config"},
}


def _run(code: str, cwd: pathlib.Path = ROOT) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={"JAX_PLATFORMS": "cpu", "PATH": ""},
        cwd=cwd,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Every module an import statement in `path` names (`from a import b` gives a and a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _first_party(names: set[str]) -> set[str]:
    return {n for n in names if n.split(".")[0] in ("jax_bridge", "triton_kernels", "pallas_tpu")}


def _within(name: str, prefixes: set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _modules(package: str) -> list[pathlib.Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_lower_layers_import_only_what_they_may(layer):
    for path in _modules(f"jax_bridge/{layer}"):
        for name in _first_party(_imported_modules(path)):
            assert _within(name, ALLOWED[layer]), f"{path.relative_to(ROOT)} imports {name}"


def test_the_launch_layers_one_kernel_module_is_a_leaf():
    """The launch may spell Triton's types through triton_kernels.config only while that
    module imports nothing of the package (no kernel, no config of an op)."""
    assert not _first_party(_imported_modules(ROOT / "triton_kernels" / "config.py"))


@pytest.mark.parametrize("op", OPS)
def test_op_packages_import_lower_layers_own_modules_and_kernels(op):
    allowed = {f"jax_bridge.{p}" for p in ("core", "host", "launch", op)}
    allowed |= {"triton_kernels", "pallas_tpu"}
    for path in _modules(f"jax_bridge/{op}"):
        for name in _first_party(_imported_modules(path)):
            where = f"{path.relative_to(ROOT)} imports {name}"
            assert _within(name, allowed), where
            parts = name.split(".")
            if parts[:2] == ["jax_bridge", op] and parts[2:3] and parts[2] in BACKENDS:
                assert path.name == "api.py", f"only api.py may import a backend: {where}"


def test_moe_builds_on_the_grouped_matmul_op_only():
    allowed = {"jax_bridge.core", "jax_bridge.grouped_matmul", "jax_bridge.moe"}
    for path in _modules("jax_bridge/moe"):
        for name in _first_party(_imported_modules(path)):
            assert _within(name, allowed), f"{path.relative_to(ROOT)} imports {name}"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(package: str) -> dict[str, set[str]]:
    """{module: the modules of `package` it imports}, from every import statement.

    `from a.b import c` names a.b, and a.b.c when that is a module. The packages above a
    named module (whose __init__ runs first) are left out: jax_bridge/__init__.py imports
    the whole public API, so counting them would make every module a cycle.
    """
    paths = {_module_name(path): path for path in _modules(package)}
    graph = {}
    for name, path in paths.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:  # relative: from this module's package, up one per extra dot
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    module = ".".join([*anchor, *([module] if module else [])])
                targets.add(module)
                targets.update(f"{module}.{alias.name}" for alias in node.names)
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as [a, b, ..., a], or None: a depth-first search."""
    state: dict[str, str] = {}  # "open" while on the current path, then "done"
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_a_cycle_and_only_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"a2"}, "a2": {"a"}}) == ["a", "a2", "a"]


def test_jax_bridge_has_no_import_cycle():
    graph = _import_graph("jax_bridge")
    # The graph holds every kind of import: of a submodule by name, inside a function,
    # under TYPE_CHECKING.
    assert "jax_bridge.attention.xla" in graph["jax_bridge.attention.api"]
    assert "jax_bridge.aot.cycles" in graph["jax_bridge.aot.compile"]
    assert "jax_bridge.launch.report" in graph["jax_bridge.tuning.autotune"]
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_op_has_one_backend_table_in_its_api():
    for op in OPS:
        source = (ROOT / "jax_bridge" / op / "api.py").read_text()
        assert source.count("BackendTable(") == 1, op


def test_public_names_are_reexported_from_jax_bridge():
    out = _run(
        """
        import jax_bridge
        missing = [n for n in jax_bridge.__all__ if not hasattr(jax_bridge, n)]
        print(missing, len(jax_bridge.__all__))
        """
    )
    missing, count = out.rsplit(" ", 1)
    assert missing == "[]" and int(count) >= 40


def test_triton_kernels_imports_no_jax():
    out = _run(
        """
        import sys, pkgutil, importlib, triton_kernels
        for m in pkgutil.walk_packages(triton_kernels.__path__, "triton_kernels."):
            importlib.import_module(m.name)
        print(sorted(n for n in sys.modules if n == "jax" or n.startswith(("jax.", "jax_"))))
        """
    )
    assert out.strip() == "[]"


def test_pallas_tpu_imports_no_jax_bridge():
    out = _run(
        """
        import sys, pkgutil, importlib, pallas_tpu
        for m in pkgutil.walk_packages(pallas_tpu.__path__, "pallas_tpu."):
            importlib.import_module(m.name)
        print("jax_bridge" in sys.modules)
        """
    )
    assert out.strip() == "False"


def test_jax_bridge_imports_without_jax_triton():
    out = _run(
        """
        import sys, pkgutil, importlib, jax_bridge
        names = [m.name for m in pkgutil.walk_packages(jax_bridge.__path__, "jax_bridge.")]
        for name in names:
            importlib.import_module(name)
        print("jax_triton" in sys.modules, len(names))
        """
    )
    loaded, count = out.split()
    assert loaded == "False" and int(count) >= 30


LIBRARY_PACKAGES = ("jax_bridge", "pallas_tpu", "triton_kernels")


def test_only_the_library_packages_are_installed(tmp_path):
    # The check is about the installed distribution; a machine that runs the suite from a
    # checkout on its path (a GPU image with its own packages) has none to check. The
    # project's venv and CI install it (`make test`), so there its absence fails.
    try:
        dist = importlib.metadata.distribution("ragged-kernels")
    except importlib.metadata.PackageNotFoundError:
        if os.environ.get("CI"):
            raise
        pytest.skip("the ragged-kernels distribution is not installed in this environment")
    assert sorted(dist.read_text("top_level.txt").split()) == list(LIBRARY_PACKAGES)
    # Outside the checkout only installed packages import: bench and examples must not.
    out = _run(
        f"""
        import importlib.util as u
        print([u.find_spec(n) is not None for n in {(*LIBRARY_PACKAGES, "bench", "examples")}])
        """,
        cwd=tmp_path,
    )
    assert out.strip() == "[True, True, True, False, False]"
