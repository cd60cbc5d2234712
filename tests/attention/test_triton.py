"""What is specific to the Triton attention backend (`jax_bridge.attention.triton`).

* Launch configurations: `AttentionKernelConfig` / `AttentionConfigs` validation (the
  messages name `ClassName.field`), and `default_attention_config` for every kernel kind x
  compute capability x head dim x dtype.
* `config=` through the public op (one `AttentionKernelConfig`, or an `AttentionConfigs`
  with per-kernel and None fields) gives the reference's numbers (to 1e-5) and the default
  configuration's.
* NaN poisoning: a forward launched on only some of its query tiles leaves the other rows
  NaN, so the conformance suite's finiteness checks prove that every element was written.

Numerics of the backend as a whole are in `test_conformance.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_bridge import (
    AttentionConfigs,
    AttentionKernelConfig,
    attention_reference,
    varlen_attention,
)
from jax_bridge.attention import triton as attention_triton
from jax_bridge.attention.api import AttentionOptions
from jax_bridge.attention.spec import AttentionSpec
from jax_bridge.core.precision import DEFAULT_PRECISION
from jax_bridge.launch.target import COMPUTE_CAPABILITIES
from jax_bridge.launch.triton_call import triton_call
from tests.attention.helpers import assert_close, make_inputs, value_and_grads
from triton_kernels.flash_attention.config import KINDS, block_d, default_attention_config
from triton_kernels.flash_attention.forward import attention_forward_kernel

# --- the configuration (pure Python) -----------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("compute_capability", [None, *COMPUTE_CAPABILITIES])
def test_default_configs_are_valid(kind, compute_capability):
    for head_dim in (16, 32, 40, 64, 80, 96, 128, 192, 256):
        for dtype_name in ("float16", "bfloat16", "float32"):
            config = default_attention_config(head_dim, dtype_name, compute_capability, kind)
            assert isinstance(config, AttentionKernelConfig)
            # Re-validated: every default passes the KernelConfig rules.
            assert config.replace() == config
            if compute_capability is None:  # small interpreter tiles
                assert (config.block_m, config.block_n) == (16, 16)
            elif dtype_name == "float32":  # exact products on CUDA cores: small tiles
                assert config.block_m * config.block_n <= 32 * 32


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(block_m=24, block_n=16), ValueError, "AttentionKernelConfig.block_m"),
        (dict(block_m=8, block_n=16), ValueError, "AttentionKernelConfig.block_m"),
        (dict(block_m=16, block_n=48), ValueError, "AttentionKernelConfig.block_n"),
        (dict(block_m=16, block_n=16, num_warps=3), ValueError, "AttentionKernelConfig.num_warps"),
        (
            dict(block_m=16, block_n=16, num_stages=0),
            ValueError,
            "AttentionKernelConfig.num_stages",
        ),
        (dict(block_m=16.0, block_n=16), TypeError, "AttentionKernelConfig.block_m"),
        (dict(block_m=16, block_n=16, fp32_dot_precision="ieee"), TypeError, "fp32_dot"),
    ],
    ids=["not_pow2", "too_small", "block_n", "warps", "stages", "float", "removed_field"],
)
def test_kernel_config_validation(kwargs, error, message):
    with pytest.raises(error, match=message):
        AttentionKernelConfig(**kwargs)


def test_configs_validation_names_the_kernel():
    with pytest.raises(TypeError, match=r"AttentionConfigs\.backward_dq"):
        AttentionConfigs(backward_dq=(16, 16))
    configs = AttentionConfigs(forward=AttentionKernelConfig(32, 16))
    assert configs.backward_dkdv is None and configs.backward_dq is None


@pytest.mark.parametrize(
    "args",
    [(64, "float64", 90, "forward"), (512, "float16", 90, "forward"), (64, "float16", 90, "bwd")],
    ids=["dtype", "head_dim", "kind"],
)
def test_default_config_rejects(args):
    with pytest.raises(ValueError):
        default_attention_config(*args)


# --- config= through the public op -------------------------------------------------------

LENGTHS = [(40, 29), (0, 3), (7, 7), (20, 33)]


@pytest.mark.parametrize(
    "config",
    [
        AttentionKernelConfig(block_m=32, block_n=16),
        AttentionConfigs(
            forward=AttentionKernelConfig(block_m=16, block_n=64),
            backward_dkdv=AttentionKernelConfig(block_m=32, block_n=16, num_warps=8),
            backward_dq=None,  # the default
        ),
    ],
    ids=["one_for_all", "per_kernel"],
)
def test_config_overrides_give_the_same_numbers(config):
    """Other tilings (unequal, larger than a sequence) give the reference's numbers and
    the default configuration's, forward and backward."""
    inputs = make_inputs(40, LENGTHS, 2, 1, 32)
    q, k, v, cu_q, cu_k, sinks = (inputs[n] for n in ("q", "k", "v", "cu_q", "cu_k", "sinks"))
    options = dict(causal=True, sliding_window=(13, None), return_lse=True)

    def run(config):
        def fn(q, k, v, s):
            return varlen_attention(
                q, k, v, cu_q, cu_k, sinks=s, config=config, implementation="triton", **options
            )

        return value_and_grads(fn, q, k, v, sinks, inputs["d_out"], inputs["d_lse"])

    def reference(q, k, v, s):
        return attention_reference(q, k, v, cu_q, cu_k, sinks=s, **options)

    configured, default = run(config), run(None)
    expected = value_and_grads(reference, q, k, v, sinks, inputs["d_out"], inputs["d_lse"])
    names = ("out", "lse", "dq", "dk", "dv", "d_sinks")
    flat = lambda r: (r[0], r[1], *r[2])
    for name, got, same, ref in zip(
        names, flat(configured), flat(default), flat(expected), strict=True
    ):
        assert_close(got, ref, 1e-5, name)
        assert_close(got, same, 1e-5, f"{name} vs the default config")


# --- NaN poisoning ------------------------------------------------------------------------


def test_rows_a_launch_does_not_reach_stay_nan():
    """The forward kernel launched on the first query tile only (grid (1, heads)):
    that tile's rows hold the reference's output, every other row is still NaN."""
    inputs = make_inputs(41, [(40, 30)], 2, 1, 32)
    q, k, v, cu_q, cu_k = (inputs[n] for n in ("q", "k", "v", "cu_q", "cu_k"))
    spec = AttentionSpec.create(32, sliding_window=(None, 12))
    options = AttentionOptions(
        implementation="triton", precision=DEFAULT_PRECISION, config=None, spec=spec
    )
    block = 16
    cu_q_all, cu_k_all = attention_triton._with_tail_sequences(cu_q, cu_k, 40, 30)
    tiles = attention_triton._chunk_indices(cu_q_all, 40, block)
    scalars, flags = attention_triton._spec_arguments(spec)
    out, lse = triton_call(
        q,
        k,
        v,
        cu_q_all,
        cu_k_all,
        tiles,
        attention_triton._per_head(None),
        attention_triton._per_head(None),
        40,
        *scalars,
        kernel=attention_forward_kernel,
        out_shape=(
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((2, 40), jnp.float32),
        ),
        grid=(1, 2),
        NUM_Q_HEADS=2,
        NUM_KV_HEADS=1,
        HEAD_DIM=32,
        BLOCK_M=block,
        BLOCK_N=block,
        BLOCK_D=block_d(32),
        HAS_SINKS=False,
        HAS_ALIBI=False,
        INPUT_PRECISION=attention_triton._input_precision(options, q.dtype),
        **flags,
    )
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.isnan(out[block:]).all() and np.isnan(lse[:, block:]).all()
    ref_out, ref_lse = attention_reference(
        q, k, v, cu_q, cu_k, sliding_window=(None, 12), return_lse=True
    )
    assert_close(out[:block], np.asarray(ref_out)[:block], 1e-5, "first tile")
    assert_close(lse[:, :block], np.asarray(ref_lse)[:, :block], 1e-5, "first tile lse")
