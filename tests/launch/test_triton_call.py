"""The Triton launcher: CPU interpreter path, cuda lowering, static kernel report."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl

from examples.softmax import softmax_block_cols, softmax_rows_kernel
from jax_bridge import lower_for_cuda, static_kernel_report, triton_call
from jax_bridge.launch.target import cuda_lowering, interpreting
from tests.jaxprs import all_eqns
from tests.test_eager_cache import compiled_programs


def softmax(x: jax.Array) -> jax.Array:
    rows, cols = x.shape
    return triton_call(
        x,
        cols,
        kernel=softmax_rows_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(rows,),
        BLOCK_COLS=softmax_block_cols(cols),
    )


def numpy_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize(
    "dtype, tol", [(jnp.float32, 1e-6), (jnp.float16, 2e-3), (jnp.bfloat16, 1e-2)]
)
@pytest.mark.parametrize("shape", [(1, 1), (7, 37), (3, 128)])
def test_softmax_on_cpu_matches_numpy(dtype, tol, shape):
    x = jax.random.normal(jax.random.key(shape[1]), shape, jnp.float32) * 3
    x = x.astype(dtype)
    out = jax.jit(softmax)(x)
    assert out.dtype == dtype
    np.testing.assert_allclose(
        np.asarray(out, np.float64), numpy_softmax(np.asarray(x, np.float32)), atol=tol, rtol=tol
    )


# A GPU computes -inf - -inf silently; so does the interpreter (numpy would warn).
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_softmax_of_all_masked_row_is_zero_not_nan():
    x = jax.random.normal(jax.random.key(1), (3, 20))
    x = x.at[1].set(-jnp.inf)
    out = np.asarray(softmax(x))
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[1], 0.0)


@triton.jit
def _scale_add_kernel(x_ptr, y_ptr, alpha, n, out_ptr, total_ptr, BLOCK: tl.constexpr):
    """out = alpha * x + y on the first n elements; total accumulates sum(out)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    x = tl.load(x_ptr + offsets, mask=inside).to(tl.float32)
    y = tl.load(y_ptr + offsets, mask=inside).to(tl.float32)
    out = alpha * x + y
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=inside)
    tl.atomic_add(total_ptr, tl.sum(tl.where(inside, out, 0.0), axis=0))


def scale_add(x, y, alpha, *, aliased: bool):
    n = x.shape[0]
    return triton_call(
        x,
        y,
        alpha,
        n,
        kernel=_scale_add_kernel,
        out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((1,), jnp.float32)),
        grid=lambda meta: (triton.cdiv(n, meta["BLOCK"]),),
        zeroed_outputs=(1,),
        input_output_aliases={1: 0} if aliased else None,
        BLOCK=16,
    )


def test_scalars_grid_function_zeroed_outputs_under_jit_and_vmap():
    x = jax.random.normal(jax.random.key(2), (50,))
    y = jax.random.normal(jax.random.key(3), (50,))
    out, total = jax.jit(lambda x, y: scale_add(x, y, 0.75, aliased=False))(x, y)
    np.testing.assert_allclose(out, 0.75 * x + y, rtol=1e-6)
    np.testing.assert_allclose(total[0], np.sum(0.75 * np.asarray(x) + np.asarray(y)), rtol=1e-5)
    batched = jax.vmap(lambda x, y: scale_add(x, y, -1.5, aliased=False)[0])(
        jnp.stack([x, y]), jnp.stack([y, x])
    )
    np.testing.assert_allclose(batched, np.stack([-1.5 * x + y, -1.5 * y + x]), rtol=1e-6)


def test_eager_launches_share_a_program_unless_their_scalars_differ():
    """Eagerly, an equal launch (new values, a new grid lambda) reuses the compiled
    callback program; a different baked-in scalar must not (it would give 0.5 * x + y)."""
    rng = np.random.default_rng(5)
    x, y, x2, y2 = (jnp.asarray(rng.standard_normal(50), jnp.float32) for _ in range(4))
    scale_add(x, y, 0.5, aliased=False)
    with compiled_programs() as compiled:
        out, total = scale_add(x2, y2, 0.5, aliased=False)
    assert compiled == []
    np.testing.assert_allclose(out, 0.5 * x2 + y2, rtol=1e-6)
    np.testing.assert_allclose(total[0], np.sum(0.5 * np.asarray(x2) + np.asarray(y2)), rtol=1e-5)
    with compiled_programs() as compiled:
        out, _ = scale_add(x2, y2, 2.0, aliased=False)
    assert len(compiled) == 1
    np.testing.assert_allclose(out, 2.0 * x2 + y2, rtol=1e-6)


@triton.jit
def _write_prefix_kernel(x_ptr, n, out_ptr, BLOCK: tl.constexpr):
    """Writes only out[:n] = 2 * x[:n]; the rest of out is left as it started."""
    offsets = tl.arange(0, BLOCK)
    inside = offsets < n
    tl.store(out_ptr + offsets, 2 * tl.load(x_ptr + offsets, mask=inside), mask=inside)


def test_equal_gpu_launches_bind_equal_parameters():
    """Eagerly on a GPU, JAX runs a launch's primitive by a program cached on its
    parameters: equal launches (a new grid lambda each, as `scale_add` makes) must bind
    equal, hashable ones, or every eager call compiles anew; a different baked-in scalar
    must not. Traced here for sm_90 (no GPU needed to bind)."""
    x = jnp.asarray(np.random.default_rng(6).standard_normal(50), jnp.float32)

    def launch_params(alpha):
        with cuda_lowering(90):
            jaxpr = jax.make_jaxpr(lambda x: scale_add(x, x, alpha, aliased=False))(x)
        (eqn,) = [e for e in all_eqns(jaxpr.jaxpr) if e.primitive.name == "triton_kernel_call"]
        return eqn.params

    first, again, other = launch_params(0.5), launch_params(0.5), launch_params(2.0)
    assert first == again and hash(tuple(first.items())) == hash(tuple(again.items()))
    assert first["grid"] == (4, 1, 1) or tuple(first["grid"]) == (4,), first["grid"]
    assert first != other


def test_unwritten_outputs_are_poisoned_and_aliases_start_as_their_input():
    """Outputs start as NaN on the interpreter path (the poisoned call runs it on a GPU
    host too: there a kernel's outputs start as whatever the buffer held); an aliased
    output starts as its input on either path."""
    x = jax.random.normal(jax.random.key(4), (32,))
    call = lambda *aliases: triton_call(
        x,
        10,
        kernel=_write_prefix_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(1,),
        input_output_aliases=dict(aliases),
        BLOCK=32,
    )
    with interpreting():
        poisoned = np.asarray(call())
    np.testing.assert_allclose(poisoned[:10], 2 * x[:10])
    assert np.isnan(poisoned[10:]).all()
    aliased = np.asarray(call((0, 0)))
    np.testing.assert_allclose(aliased[:10], 2 * x[:10])
    np.testing.assert_array_equal(aliased[10:], x[10:])


def test_empty_grid_launches_nothing():
    x = jnp.zeros((0, 8), jnp.float32)
    assert softmax(x).shape == (0, 8)


def _softmax_on_grid(x: jax.Array, grid: tuple[int, ...]) -> jax.Array:
    return triton_call(
        x, x.shape[1], kernel=softmax_rows_kernel, out_shape=x, grid=grid, name="wide_softmax",
        BLOCK_COLS=softmax_block_cols(x.shape[1]),
    )  # fmt: skip


@pytest.mark.parametrize("grid", [(1, 65536), (1, 1, 70000), (2**31, 1)], ids=str)
def test_a_grid_past_cudas_limits_is_refused_at_trace_time_for_the_gpu(grid):
    """CUDA launches at most 2**31 - 1 programs on x and 65535 on y and z; past that the
    device refuses the launch at run time (the interpreter takes any grid)."""
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    with cuda_lowering(90), pytest.raises(ValueError, match=r"wide_softmax: launch grid .* past"):
        jax.eval_shape(functools.partial(_softmax_on_grid, grid=grid), x)
    with cuda_lowering(90):  # the limits themselves are launchable
        jax.eval_shape(functools.partial(_softmax_on_grid, grid=(2**31 - 1, 65535, 65535)), x)


def test_alias_of_a_scalar_is_rejected():
    with pytest.raises(TypeError, match="input_output_aliases"):
        triton_call(
            jnp.ones(4),
            3,
            kernel=_write_prefix_kernel,
            out_shape=jax.ShapeDtypeStruct((4,), jnp.float32),
            grid=(1,),
            input_output_aliases={1: 0},
            BLOCK=4,
        )


@pytest.mark.parametrize("compute_capability", [80, 90])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_softmax_lowers_and_compiles_for_cuda(compute_capability, dtype):
    text = lower_for_cuda(
        softmax,
        jax.ShapeDtypeStruct((64, 1000), dtype),
        compute_capability=compute_capability,
    )
    assert "triton_kernel_call" in text


def test_vmap_on_the_gpu_path_loops_over_the_batch():
    # jax_triton's call has no batching rule: the launcher's own rule launches once per
    # batch element, inside a loop of the lowered program (checked without a GPU).
    text = lower_for_cuda(
        jax.vmap(softmax), jax.ShapeDtypeStruct((3, 8, 100), jnp.float32), compute_capability=90
    )
    assert text.count("triton_kernel_call") == 1
    assert "stablehlo.while" in text


def test_vmap_of_an_op_with_mixed_batched_arguments_lowers_for_cuda():
    from jax_bridge import varlen_attention

    cu = jnp.array([0, 5, 12], jnp.int32)

    def attention(q, k, v):  # q batched, k and v shared
        return varlen_attention(q, k, v, cu, cu, causal=True, implementation="triton")

    batched = jax.vmap(attention, in_axes=(0, None, None))
    q = jax.ShapeDtypeStruct((2, 12, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((12, 2, 64), jnp.bfloat16)
    text = lower_for_cuda(batched, q, kv, kv, compute_capability=90)
    assert "triton_kernel_call" in text and "stablehlo.while" in text


def test_cpu_path_and_cuda_lowering_do_not_share_a_trace():
    """Interpreting a kernel leaves Triton's language intact for the GPU compiler, and a
    function jitted for the CPU is traced anew when lowered for cuda (and back)."""
    x = jax.random.normal(jax.random.key(5), (4, 30))
    jitted = jax.jit(softmax)
    np.testing.assert_allclose(jitted(x), numpy_softmax(np.asarray(x)), atol=1e-6)
    assert "triton_kernel_call" in lower_for_cuda(softmax, jax.ShapeDtypeStruct(x.shape, x.dtype))
    np.testing.assert_allclose(jitted(2 * x), numpy_softmax(2 * np.asarray(x)), atol=1e-6)


@jax.custom_vjp
def differentiable_softmax(x):
    return softmax(x)


def _softmax_fwd(x):
    y = softmax(x)
    return y, y


def _softmax_bwd(y, dy):
    return (y * (dy - jnp.sum(dy * y, axis=-1, keepdims=True)),)


differentiable_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def test_gradient_through_custom_vjp_on_cpu():
    x = jax.random.normal(jax.random.key(6), (5, 24))
    w = jax.random.normal(jax.random.key(7), (5, 24))
    loss = lambda f: lambda x: jnp.sum(w * f(x) ** 2)
    grad = jax.jit(jax.grad(loss(differentiable_softmax)))(x)
    np.testing.assert_allclose(grad, jax.grad(loss(jax.nn.softmax))(x), atol=1e-6)


@triton.jit
def _tile_matmul_kernel(a_ptr, b_ptr, c_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm, rn, rk = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    a = tl.load(a_ptr + rm[:, None] * BK + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * BN + rn[None, :])
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], tl.dot(a, b).to(c_ptr.dtype.element_ty))


def test_static_report_of_softmax_is_sane():
    for cc in (80, 90):
        report = static_kernel_report(
            softmax_rows_kernel,
            {"x_ptr": "*bf16", "num_cols": "i32", "out_ptr": "*bf16"},
            {"BLOCK_COLS": 1024},
            compute_capability=cc,
            num_warps=4,
        )
        assert 0 < report.registers <= 255
        assert not report.spills
        assert not report.uses_mma and not report.uses_wgmma
        assert report.sass_opcodes.get("EXIT", 0) >= 1


def test_static_report_sees_tensor_cores():
    signature = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16"}
    tiles = {"BM": 128, "BN": 128, "BK": 64}
    ampere = static_kernel_report(_tile_matmul_kernel, signature, tiles, compute_capability=80)
    hopper = static_kernel_report(_tile_matmul_kernel, signature, tiles, compute_capability=90)
    assert ampere.uses_mma and not ampere.uses_wgmma
    assert hopper.uses_mma and hopper.uses_wgmma
    assert hopper.shared_memory_bytes > 0


def test_report_rejects_an_incomplete_signature():
    with pytest.raises(ValueError, match="num_cols"):
        static_kernel_report(
            softmax_rows_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32"}, {"BLOCK_COLS": 16}
        )
