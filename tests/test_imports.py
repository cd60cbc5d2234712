"""Import rules: the layers form a DAG and the CPU-only path never needs jax_triton."""

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={"JAX_PLATFORMS": "cpu", "PATH": ""},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_triton_kernels_imports_no_jax():
    out = _run(
        """
        import sys, pkgutil, importlib, triton_kernels
        for m in pkgutil.iter_modules(triton_kernels.__path__):
            importlib.import_module(f"triton_kernels.{m.name}")
        print(sorted(n for n in sys.modules if n == "jax" or n.startswith(("jax.", "jax_"))))
        """
    )
    assert out.strip() == "[]"


def test_pallas_tpu_imports_no_jax_bridge():
    out = _run(
        """
        import sys, pkgutil, importlib, pallas_tpu
        for m in pkgutil.iter_modules(pallas_tpu.__path__):
            importlib.import_module(f"pallas_tpu.{m.name}")
        print("jax_bridge" in sys.modules)
        """
    )
    assert out.strip() == "False"


def test_jax_bridge_imports_without_jax_triton():
    out = _run(
        """
        import sys, pkgutil, importlib, jax_bridge
        for m in pkgutil.iter_modules(jax_bridge.__path__):
            importlib.import_module(f"jax_bridge.{m.name}")
        print("jax_triton" in sys.modules)
        """
    )
    assert out.strip() == "False"
