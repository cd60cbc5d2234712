"""Triton's interpreter does bfloat16 arithmetic the way a GPU does (on the CPU path of
`jax_bridge.triton_call`).

Oracles: ml_dtypes' float32 -> bfloat16 rounding (round to nearest, ties to even, as the
GPU's `cvt.rn.bf16.f32`), float32/float64 numpy products of the bfloat16 values, and
float64 numpy attention / grouped matmul for the statistical check:

(a) a kernel's `x.to(tl.bfloat16)` rounds to nearest even, bit for bit, halfway cases
    included (the interpreter alone truncates);
(b) `tl.dot` of bfloat16 tiles is the float32 product of their values (the interpreter
    alone multiplies the raw uint16 bit patterns);
(c) no bias: among the inexact bfloat16 outputs of the Triton attention and grouped
    matmul, the fraction smaller in magnitude than the float64 result is near one half
    (truncation made it ~0.78 for attention and ~1 for grouped matmul);
(d) a scalar loaded in the kernel bounds a `range` loop (Triton 3.6 converted it with
    `int()` of a shape-[1] array, which numpy 2.5 refuses);
(e) a launch patches `triton.language` for the interpreter once, not again at every
    device-function call (a quarter of an attention kernel's interpreted time), with the
    same results, and leaves Triton's patching function as it found it;
(f) `tl.dot` of float32 tiles is as accurate as on the GPU at each `input_precision`:
    "ieee" exact, "tf32" the product of the operands' TF32 truncations (~1e-3 off),
    "tf32x3" within float32 accuracy (the interpreter alone multiplies exactly at all
    three), non-finite operands kept;
(g) a tensor descriptor's `atomic_add` (Hopper's bulk tensor reduction, which Triton's
    interpreter lacks) adds every program's block, overlapping ones too, inside the
    descriptor's shape only, and the interpreter is left as it was.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import triton
import triton.language as tl
from triton.runtime import interpreter as triton_interpreter

from jax_bridge import grouped_matmul, triton_call, varlen_attention
from jax_bridge.launch.interpreter import run_interpreted, tf32_truncated
from jax_bridge.launch.target import interpreting


@pytest.fixture(autouse=True)
def _on_the_interpreter():
    """These tests are of the interpreter: on a GPU host too (`JAX_PLATFORMS=cuda`)."""
    with interpreting():
        yield


@triton.jit
def _to_bfloat16_kernel(x_ptr, out_ptr, SIZE: tl.constexpr):
    offsets = tl.arange(0, SIZE)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets).to(tl.bfloat16))


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    rows, inner, cols = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + rows[:, None] * K + inner[None, :])
    b = tl.load(b_ptr + inner[:, None] * N + cols[None, :])
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], tl.dot(a, b))


@triton.jit
def _float32_dot_kernel(
    a_ptr, b_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    rows, inner, cols = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + rows[:, None] * K + inner[None, :])
    b = tl.load(b_ptr + inner[:, None] * N + cols[None, :])
    product = tl.dot(a, b, input_precision=PRECISION)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], product)


@triton.jit
def _count_rows_kernel(bounds_ptr, out_ptr, BLOCK: tl.constexpr):
    # Runtime loop bounds read from memory, as the varlen kernels walk a sequence's rows.
    start = tl.load(bounds_ptr)
    end = tl.load(bounds_ptr + 1)
    count = tl.zeros([BLOCK], tl.int32)
    for row in range(start, end, BLOCK):
        count += (row + tl.arange(0, BLOCK) < end).to(tl.int32)
    tl.store(out_ptr + tl.arange(0, BLOCK), count)


@triton.jit
def _plus_one(x):
    return x + 1


@triton.jit
def _nested_calls_kernel(x_ptr, out_ptr, CALLS: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets)
    for _ in range(CALLS):
        x = _plus_one(x)
    tl.store(out_ptr + offsets, x)


def test_a_launch_patches_the_language_once(monkeypatch):
    patched = []
    original = triton_interpreter._patch_lang

    def counting(fn):
        patched.append(fn)
        return original(fn)

    monkeypatch.setattr(triton_interpreter, "_patch_lang", counting)
    x = np.random.default_rng(0).integers(-100, 100, 16).astype(np.int32)
    got = triton_call(
        jnp.asarray(x),
        kernel=_nested_calls_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, jnp.int32),
        grid=(2,),
        CALLS=5,
        BLOCK=8,
    )
    np.testing.assert_array_equal(np.asarray(got), x + 5)
    assert len(patched) == 1, len(patched)  # Triton alone: 1 + 2 programs x 5 calls
    assert triton_interpreter._patch_lang is counting


def test_loaded_scalars_bound_a_loop():
    # numpy 2.5 refuses int() of a shape-[1] array (older numpy warns), and the
    # interpreter holds every scalar that way: as errors, the warnings show the
    # conversion on any numpy.
    bounds = jnp.asarray([3, 26], jnp.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        got = triton_call(
            bounds,
            kernel=_count_rows_kernel,
            out_shape=jax.ShapeDtypeStruct((8,), jnp.int32),
            grid=(1,),
            BLOCK=8,
        )
        got = np.asarray(got)  # the launch has run before the filter is undone
    # Rows 3..25 in steps of 8: lane i counts the rows 3 + i + 8j below 26.
    expected = [sum(1 for r in range(3 + i, 26, 8)) for i in range(8)]
    np.testing.assert_array_equal(got, expected)


def _to_bfloat16(x: np.ndarray) -> np.ndarray:
    return np.asarray(
        triton_call(
            jnp.asarray(x),
            kernel=_to_bfloat16_kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, jnp.bfloat16),
            grid=(1,),
            SIZE=x.size,
        )
    )


def _bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint16)


def test_float32_to_bfloat16_rounds_to_nearest_even():
    rng = np.random.default_rng(0)
    random = rng.standard_normal(768).astype(np.float32) * np.float32(1e3)
    # Exactly halfway between two bfloat16 values: low 16 bits 0x8000, with an even and an
    # odd upper half (ties go to the even one: down for the first, up for the second).
    upper = rng.integers(0x0080, 0x7F00, 512, dtype=np.uint32) << 16
    halfway = np.concatenate([upper & ~np.uint32(1 << 16), upper | np.uint32(1 << 16)])
    halfway = (halfway | np.uint32(0x8000)).view(np.float32)
    halfway[::2] *= -1
    # Just below and just above halfway, and values that need no rounding.
    near = np.concatenate(
        [(halfway.view(np.uint32).astype(np.int64) + d).astype(np.uint32) for d in (-1, 1)]
    ).view(np.float32)
    exact = (rng.standard_normal(256).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(
        np.float32
    )
    x = np.concatenate([random, halfway, near, exact]).astype(np.float32)
    assert x.size == 4096  # the kernel's block: a power of two
    got = _to_bfloat16(x)
    expected = x.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(_bits(got), _bits(expected))
    # The halfway cases really were ties, and both directions occurred.
    ties = (x.view(np.uint32) & 0xFFFF) == 0x8000
    assert ties.sum() >= 512
    rounded_up = np.abs(got[ties].astype(np.float64)) > np.abs(x[ties].astype(np.float64))
    assert 0 < rounded_up.sum() < ties.sum()


def test_bfloat16_dot_multiplies_the_values():
    rng = np.random.default_rng(1)
    m, k, n = 16, 32, 16
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16)

    def dot(a, b):
        return np.asarray(
            triton_call(
                jnp.asarray(a),
                jnp.asarray(b),
                kernel=_dot_kernel,
                out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
                grid=(1,),
                M=m,
                K=k,
                N=n,
            )
        )

    expected = np.matmul(a.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(dot(a, b), expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())
    # Multiples of 1/8 in [-4, 4): every product and sum is exact in float32.
    a = (rng.integers(-32, 32, (m, k)) / 8).astype(ml_dtypes.bfloat16)
    b = (rng.integers(-32, 32, (k, n)) / 8).astype(ml_dtypes.bfloat16)
    expected = np.matmul(a.astype(np.float64), b.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(dot(a, b), expected)


def test_float32_dot_is_as_accurate_as_the_gpu_at_each_input_precision():
    rng = np.random.default_rng(5)
    m, k, n = 16, 64, 16
    a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    a[0, 0], a[1, 0], b[0, 2] = np.inf, np.nan, -np.inf

    def dot(precision):
        out = triton_call(
            jnp.asarray(a), jnp.asarray(b), kernel=_float32_dot_kernel,
            out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32), grid=(1,),
            M=m, K=k, N=n, PRECISION=precision,
        )  # fmt: skip
        return np.asarray(out, np.float64)

    with np.errstate(invalid="ignore"):
        exact = np.matmul(a, b, dtype=np.float64)
        truncated = np.matmul(tf32_truncated(a), tf32_truncated(b), dtype=np.float64)
    finite = np.isfinite(exact)
    # float32 accumulation of k products: a bound on rounding, as a float64 oracle sees it
    largest = [np.abs(x[np.isfinite(x)]).max() for x in (a, b)]
    bound = 4 * k * np.finfo(np.float32).eps * largest[0] * largest[1]
    errors, results = {}, {}
    for precision in ("ieee", "tf32", "tf32x3"):
        got = results[precision] = dot(precision)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(exact), precision)
        infinite = np.isinf(exact)
        np.testing.assert_array_equal(got[infinite], exact[infinite], precision)
        errors[precision] = np.abs(got[finite] - exact[finite]).max()
        if precision == "tf32":
            np.testing.assert_allclose(got[finite], truncated[finite], rtol=0, atol=bound)
    assert errors["ieee"] <= bound and errors["tf32x3"] <= bound, errors
    assert errors["tf32"] > 30 * bound, errors  # TF32's 10-bit mantissas: ~2**-11 each
    # Three passes drop the small x small product: not the exact float32 result either.
    assert (results["tf32x3"] != results["ieee"])[finite].any()


def _fraction_smaller(got, exact: np.ndarray) -> tuple[float, int]:
    """Among elements of `got` that differ from `exact`, the fraction smaller in magnitude."""
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    inexact = got != exact
    return float(np.mean(np.abs(got[inexact]) < np.abs(exact[inexact]))), int(inexact.sum())


def _attention_float64(q, k, v):
    """One sequence, full attention, float64 numpy: [T, H, D] -> [T, H, D]."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


@pytest.mark.parametrize("op", ["varlen_attention", "grouped_matmul"])
def test_bfloat16_results_are_not_biased_towards_zero(op):
    rng = np.random.default_rng(2)
    bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(jnp.bfloat16)
    if op == "varlen_attention":
        q, k, v = bf16(64, 2, 32), bf16(64, 2, 32), bf16(64, 2, 32)
        cu = jnp.asarray([0, 64], jnp.int32)
        got = varlen_attention(q, k, v, cu, cu, implementation="triton")
        exact = _attention_float64(q, k, v)
    else:
        lhs, rhs = bf16(64, 32), bf16(2, 32, 32)
        sizes = jnp.asarray([30, 34], jnp.int32)
        got = grouped_matmul(
            lhs,
            rhs,
            sizes,
            preferred_element_type=jnp.bfloat16,
            tiling=(16, 16, 16),
            implementation="triton",
        )
        lhs64 = np.asarray(lhs.astype(jnp.float32), np.float64)
        rhs64 = np.asarray(rhs.astype(jnp.float32), np.float64)
        exact = np.concatenate([lhs64[:30] @ rhs64[0], lhs64[30:] @ rhs64[1]])
    assert got.dtype == jnp.bfloat16
    fraction, count = _fraction_smaller(got, exact)
    assert count > 1000, count
    print(f"{op}: {fraction:.3f} of {count} inexact outputs are smaller than float64's")
    assert 0.35 <= fraction <= 0.65, fraction


@triton.jit
def _add_through_a_descriptor(x_ptr, rows, out_ptr, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
    # Over the first `rows` rows and WIDTH columns of out ([more rows, 2 * WIDTH]); program
    # p adds its block of x at row p * BLOCK / 2: neighbours overlap by half a block.
    out = tl.make_tensor_descriptor(
        out_ptr, shape=[rows, WIDTH], strides=[2 * WIDTH, 1], block_shape=[BLOCK, WIDTH]
    )
    p = tl.program_id(0)
    tile = tl.arange(0, BLOCK)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
    out.atomic_add([p * (BLOCK // 2), 0], tl.load(x_ptr + p * BLOCK * WIDTH + tile))


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_descriptor_atomic_add_adds_inside_the_descriptor_only(dtype):
    rng = np.random.default_rng(7)
    block, width, rows, programs = 8, 16, 21, 5  # the last block reaches past `rows`
    x = (rng.standard_normal((programs, block, width)) * 100).astype(dtype)
    out = (rng.standard_normal((32, 2 * width)) * 100).astype(dtype)
    expected = out.copy()
    for p in range(programs):
        for r in range(block):
            if p * block // 2 + r < rows:
                expected[p * block // 2 + r, :width] += x[p, r]
    builder = triton_interpreter.InterpreterBuilder
    before = vars(builder).get("create_descriptor_reduce")
    run_interpreted(
        _add_through_a_descriptor, (programs,), [x, rows], [out], dict(BLOCK=block, WIDTH=width)
    )
    # Bit for bit: the interpreter runs the programs in order, as the loop adds.
    np.testing.assert_array_equal(out, expected)
    assert vars(builder).get("create_descriptor_reduce") is before
