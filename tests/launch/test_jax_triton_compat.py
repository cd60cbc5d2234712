"""The jax_triton 0.3 / 0.4 shim: real cuda lowering through the installed jax_triton, and
the 0.4 branch against a stand-in module with 0.4's `triton_call` signature."""

import re
import sys
import types
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl

from jax_bridge.launch import jax_triton_compat as compat


@triton.jit
def axpy_kernel(x_ptr, scale, init_ptr, out_ptr, sq_ptr, count_ptr, BLOCK: tl.constexpr):
    # out starts as init (aliased), sq is a plain output, count starts at zero.
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, x * scale + tl.load(out_ptr + offs))
    tl.store(sq_ptr + offs, x * x)
    tl.atomic_add(count_ptr, 1)


N = 8
OUT_SHAPES = (
    jax.ShapeDtypeStruct((N,), jnp.float32),  # out: aliased to argument 2 (init)
    jax.ShapeDtypeStruct((N,), jnp.float32),  # sq: plain
    jax.ShapeDtypeStruct((1,), jnp.int32),  # count: zeroed
)


def axpy(x, init, *, aliases=None, zeroed=(2,)):
    return compat.call_jax_triton(
        x,
        2.0,
        init,
        kernel=axpy_kernel,
        out_shapes=OUT_SHAPES,
        grid=(1,),
        num_warps=4,
        num_stages=2,
        compute_capability=90,
        input_output_aliases={2: 0} if aliases is None else aliases,
        zeroed_outputs=zeroed,
        name="axpy",
        BLOCK=N,
    )


def lower_for_cuda(f, *args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def backend_config(text: str) -> bytes:
    """The decompressed kernel-call proto of the single `triton_kernel_call` in `text`."""
    (escaped,) = re.findall(r'backend_config = "((?:[^"\\]|\\.)*)"', text)
    # One pass: MLIR writes a byte as itself, as `\\XX` (hex) or as `\\` + the character;
    # decoding escapes in two passes would re-read bytes the first pass produced.
    raw = re.sub(
        rb"\\(?:([0-9A-Fa-f]{2})|(.))",
        lambda m: bytes([int(m[1], 16)]) if m[1] else m[2],
        escaped.encode("latin-1"),
        flags=re.DOTALL,
    )
    return zlib.decompress(raw)


def test_version_is_detected_from_the_installed_distribution():
    from importlib.metadata import version

    major, minor = (int(p) for p in version("jax-triton").split(".")[:2])
    assert compat.jax_triton_api_version() == (major, minor)
    assert compat.jax_triton_api_version() >= (0, 3)


def test_version_is_none_without_jax_triton(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    compat.jax_triton_api_version.cache_clear()
    monkeypatch.setattr(metadata, "version", missing)
    try:
        assert compat.jax_triton_api_version() is None
        with pytest.raises(ImportError, match="needs jax-triton"):
            axpy(jnp.ones(N), jnp.ones(N))
    finally:
        compat.jax_triton_api_version.cache_clear()


def kernel_call(text: str) -> tuple[list[str], dict[int, int], list[int]]:
    """The kernel call's operands, its {output: operand} aliases, and which of its outputs
    each result of `main` is."""
    (call,) = re.findall(r"= stablehlo\.custom_call @(triton_kernel_call\w*)\(([^)]*)\)", text)
    assert call[0] in ("triton_kernel_call", "triton_kernel_call_ffi")  # 0.3, 0.4
    aliases = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", text)
    (returned,) = re.findall(r"return (.*) :", text)
    results = [int(r.split("#")[1]) for r in returned.split(", ")]
    return call[1].split(", "), {int(o): int(i) for o, i in aliases}, results


def test_lowers_for_cuda_with_alias_through_installed_jax_triton():
    x = jnp.ones(N, jnp.float32)
    operands, aliases, results = kernel_call(lower_for_cuda(axpy, x, x))
    # result 0 (out) is an aliased output of the call whose operand is init (%arg1).
    assert operands[aliases[results[0]]] == "%arg1"
    assert results[1] not in aliases  # sq is a plain output


def test_zeroed_outputs_reach_the_kernel_call():
    x = jnp.ones(N, jnp.float32)
    text = lower_for_cuda(axpy, x, x)
    if compat.jax_triton_api_version() < (0, 4):
        # 0.3 zeroes the buffer in the kernel call (its compressed backend config).
        not_zeroed = lower_for_cuda(lambda a, b: axpy(a, b, zeroed=()), x, x)
        assert backend_config(text) != backend_config(not_zeroed)
    else:
        # 0.4 gets a Ref of zeros: an aliased operand broadcast from the constant 0.
        operands, aliases, results = kernel_call(text)
        zeros = operands[aliases[results[2]]]
        (constant,) = re.findall(rf"{zeros} = stablehlo.broadcast_in_dim (%\w+)", text)
        assert re.search(rf"{constant} = stablehlo.constant dense<0> ", text)


@pytest.mark.parametrize(
    "aliases, zeroed, match",
    [
        ({1: 0}, (2,), "argument 1 is not an array"),
        ({2: 3}, (), "no output 3"),
        ({0: 0, 2: 0}, (), "same output"),
        ({2: 0}, (3,), "there are 3 outputs"),
        ({2: 0}, (0,), r"outputs \[0\] are both aliased and zeroed"),
    ],
)
def test_rejects_bad_aliases_and_zeroed_outputs(aliases, zeroed, match):
    x = jnp.ones(N, jnp.float32)
    with pytest.raises(ValueError, match=match):
        axpy(x, x, aliases=aliases, zeroed=zeroed)


def fake_jax_triton_04(calls: list) -> types.ModuleType:
    """A jax_triton 0.4 stand-in: binds operands the way 0.4 does and runs axpy_kernel."""

    def triton_call(
        *args, kernel, out_type=None, grid, name="", num_warps=None, num_stages=None,
        num_ctas=None, compute_capability=None, backend_options=None,
        input_output_aliases=None, zeroed_outputs=(), debug=False, serialized_metadata=b"",
        cost_estimate=None, has_side_effect=False, **kwargs,
    ):  # fmt: skip
        calls.append(dict(args=args, out_type=out_type, kwargs=kwargs, grid=grid, name=name))
        assert "out_shape" not in kwargs and out_type is not None
        assert not input_output_aliases and not zeroed_outputs  # deprecated in 0.4
        names = [p.name for p in kernel.params if not p.is_constexpr]
        bound = dict(zip(names, args, strict=False))
        operands = {n: v for n, v in kwargs.items() if n in names}
        assert not bound.keys() & operands.keys()
        bound |= operands
        missing = [n for n in names if n not in bound]  # filled from out_type, in order
        assert len(missing) == len(out_type)
        assert isinstance(bound["scale"], float) and not isinstance(bound["scale"], np.generic)
        x, scale = bound["x_ptr"], bound["scale"]
        results = {"sq_ptr": x * x}
        for n in ("out_ptr", "count_ptr"):
            if n in bound:
                assert isinstance(bound[n], jax.Ref)
        bound["out_ptr"][...] = x * scale + bound["out_ptr"][...]
        bound["count_ptr"][...] = bound["count_ptr"][...] + 1
        return tuple(results[n] for n in missing)

    module = types.ModuleType("jax_triton")
    module.triton_call = triton_call
    return module


def _use_fake_04(monkeypatch: pytest.MonkeyPatch, calls: list) -> None:
    monkeypatch.setattr(compat, "jax_triton_api_version", lambda: (0, 4))
    monkeypatch.setitem(sys.modules, "jax_triton", fake_jax_triton_04(calls))
    monkeypatch.setattr(compat, "pass_kernel_needs", lambda: None)  # no triton_lib to wrap


def test_04_branch_maps_aliases_and_zeroing_onto_refs(monkeypatch):
    calls = []
    _use_fake_04(monkeypatch, calls)
    x = jnp.arange(N, dtype=jnp.float32)
    init = jnp.full(N, 10.0, jnp.float32)
    out, sq, count = compat.call_jax_triton(
        x,
        np.float32(2.0),
        init,
        kernel=axpy_kernel,
        out_shapes=OUT_SHAPES,
        grid=(1,),
        num_warps=4,
        num_stages=2,
        compute_capability=90,
        input_output_aliases={2: 0},
        zeroed_outputs=(2,),
        name="axpy",
        BLOCK=N,
    )
    np.testing.assert_array_equal(out, 2 * np.arange(N) + 10)
    np.testing.assert_array_equal(sq, np.arange(N) ** 2)
    np.testing.assert_array_equal(count, [1])  # started at zero
    np.testing.assert_array_equal(init, 10.0)  # the input itself is not mutated
    (call,) = calls
    assert call["out_type"] == (OUT_SHAPES[1],)
    assert set(call["kwargs"]) == {"out_ptr", "count_ptr", "BLOCK"}
    assert call["kwargs"]["BLOCK"] == N and call["name"] == "axpy"
    assert len(call["args"]) == 3 and call["args"][2] is init


def test_04_branch_checks_the_kernel_parameter_count(monkeypatch):
    _use_fake_04(monkeypatch, [])
    x = jnp.ones(N, jnp.float32)
    with pytest.raises(ValueError, match="takes 6 non-constexpr parameters"):
        compat.call_jax_triton(
            x, 2.0, x, kernel=axpy_kernel, out_shapes=OUT_SHAPES[:2], grid=(1,), num_warps=4,
            num_stages=2, compute_capability=90, input_output_aliases={}, zeroed_outputs=(),
            name="axpy", BLOCK=N,
        )  # fmt: skip


def test_importing_the_shim_does_not_import_jax_triton():
    import subprocess

    code = "import jax_bridge.launch.jax_triton_compat, sys; print('jax_triton' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
