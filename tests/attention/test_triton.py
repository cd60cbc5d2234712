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

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_bridge import (
    AttentionConfigs,
    AttentionKernelConfig,
    attention_reference,
    flash_attention,
    varlen_attention,
)
from jax_bridge.attention import schedule
from jax_bridge.attention import triton as attention_triton
from jax_bridge.attention.api import AttentionOptions
from jax_bridge.attention.spec import AttentionSpec
from jax_bridge.core.precision import DEFAULT_PRECISION, triton_input_precision
from jax_bridge.launch.lowering import lower_for_cuda
from jax_bridge.launch.target import COMPUTE_CAPABILITIES, interpreting
from jax_bridge.launch.triton_call import float32_or_placeholder, triton_call
from tests.attention import test_robustness as robustness
from tests.attention.helpers import (
    assert_close,
    attention_tolerance,
    make_inputs,
    oracle_value_and_grads,
    value_and_grads,
)
from tests.attention.test_conformance import CASES, check_case
from tests.devices import needs_tensor_descriptors, skip_unless_host_descriptors_launch
from tests.launches import record_launches
from triton_kernels.block_sparse.config import block_sparse_config
from triton_kernels.flash_attention.config import (
    _HEAVY_LIGHT,
    HEAD_MAJOR_DKDV_TILE,
    HEAD_MAJOR_DQ_ATOMIC_TILE,
    KINDS,
    ONE_STAGE_TWO_CTA_TILE,
    OVERLAPPED_DKDV_TILE,
    OVERLAPPED_FORWARD_TILE,
    TWO_CTA_BACKWARD_TILE,
    WARP_SPECIALIZED_DKDV_TILE,
    AttentionFeatures,
    block_d,
    default_attention_config,
)
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


FEATURE_SETS = [
    AttentionFeatures(),
    AttentionFeatures(causal=True, sinks=True),
    AttentionFeatures(window_left=True, window_right=True),
    AttentionFeatures(causal=True, soft_cap=True, alibi=True, window_left=True),
]


@pytest.mark.parametrize("features", FEATURE_SETS, ids=lambda f: f.describe())
@pytest.mark.parametrize("compute_capability", COMPUTE_CAPABILITIES)
def test_heavy_calls_get_larger_tiles_only_where_listed(compute_capability, features):
    """The light tables only ever enlarge tiles, and only for calls without the
    register-heavy options (or where `_HEAVY_LIGHT` lists the call's); heavy calls keep
    the tiles proven not to spill with all on."""
    heavy = AttentionFeatures(causal=True, soft_cap=True, alibi=True, window_left=True)
    for kind in KINDS:
        for head_dim in (64, 128, 256):
            config = default_attention_config(
                head_dim, "bfloat16", compute_capability, kind, features=features
            )
            base = default_attention_config(
                head_dim, "bfloat16", compute_capability, kind, features=heavy
            )
            assert config.block_m * config.block_n >= base.block_m * base.block_n
            listed = (compute_capability, kind, max(64, head_dim), False) in _HEAVY_LIGHT.get(
                features.heavy_options, ()
            )
            if features.register_heavy and not listed:
                assert config == base


def test_hopper_dkdv_takes_tma_only_where_it_is_spill_free_and_launchable():
    """dK/dV at d=128 on sm_90 loads through TMA at 64x128 for light calls bounded on the
    right, one program a tile, where descriptors can be launched; every other call keeps
    its tile by pointers (that tile is spill-free by pointers only under some Tritons)."""
    causal = AttentionFeatures(causal=True)
    tma = default_attention_config(128, "bfloat16", 90, "backward_dkdv", features=causal,
                                   descriptors=True)  # fmt: skip
    assert (tma.block_m, tma.block_n, tma.tma) == (64, 128, True)
    window = AttentionFeatures(window_right=True)
    assert default_attention_config(128, "float16", 90, "backward_dkdv", features=window,
                                    descriptors=True) == tma  # fmt: skip
    no_tma = [
        dict(descriptors=False),
        dict(features=AttentionFeatures()),  # no right bound: spills
        dict(persistent=True),
        dict(features=AttentionFeatures(causal=True, soft_cap=True)),  # register-heavy
        dict(head_dim=96),  # not a power of two
        dict(head_dim=64),
        dict(compute_capability=100),
        dict(compute_capability=80),
        dict(kind="forward"),
        dict(kind="backward_dq"),
        dict(dtype_name="float32"),
    ]
    for change in no_tma:
        args = dict(head_dim=128, dtype_name="bfloat16", compute_capability=90,
                    kind="backward_dkdv", features=causal, descriptors=True) | change  # fmt: skip
        assert not default_attention_config(**args).tma, change
    assert not default_attention_config(
        128, "bfloat16", None, "backward_dkdv", descriptors=True
    ).tma


@pytest.mark.parametrize("options", [*_HEAVY_LIGHT, ("alibi", "soft_cap", "window_left")])
def test_heavy_calls_take_the_light_tiles_listed_for_them(options):
    """A call whose register-heavy options are `options` takes the light call's tile
    exactly where `_HEAVY_LIGHT[options]` lists it, else the tile of all of them on."""
    listed = _HEAVY_LIGHT.get(options, frozenset())
    everything = AttentionFeatures(causal=True, soft_cap=True, alibi=True, window_left=True)
    for causal, compute_capability, kind, head_dim, persistent in itertools.product(
        (True, False), (80, 90), KINDS, (64, 128, 256), (False, True)
    ):
        features = AttentionFeatures(causal=causal, **dict.fromkeys(options, True))
        assert features.heavy_options == options
        args = (head_dim, "bfloat16", compute_capability, kind)
        config = default_attention_config(*args, features=features, persistent=persistent)
        plain = dataclasses.replace(features, soft_cap=False, alibi=False, window_left=False)
        light = default_attention_config(*args, features=plain, persistent=persistent)
        heavy = default_attention_config(*args, features=everything, persistent=persistent)
        key = (compute_capability, kind, head_dim, persistent)
        assert config == (light if key in listed else heavy), (options, key, causal)


def test_persistent_launches_take_the_light_tiles_where_they_fit():
    """A persistent walk (past 64 sequences) takes the light calls' dQ and dK/dV tiles, as
    a program a tile does, but not the TMA one (the static report: spill-free under
    Triton 3.6 and 3.9), and the forward's 128x128 where `_PERSISTENT_LIGHT_FORWARD` lists
    it: not at d=128 on sm_80, where the walk's registers make it spill."""
    causal = AttentionFeatures(causal=True)
    for compute_capability, head_dim, kind in [
        (90, 128, "backward_dq"), (90, 64, "backward_dq"), (80, 64, "backward_dq"),
        (90, 64, "backward_dkdv"), (90, 128, "forward"), (90, 64, "forward"),
        (80, 64, "forward"),
    ]:  # fmt: skip
        args = (head_dim, "bfloat16", compute_capability, kind)
        walk = default_attention_config(*args, features=causal, persistent=True)
        assert walk == default_attention_config(*args, features=causal), args
    walk = default_attention_config(128, "bfloat16", 80, "forward", features=causal,
                                    persistent=True)  # fmt: skip
    assert (walk.block_m, walk.block_n) == (128, 32)
    assert default_attention_config(128, "bfloat16", 80, "forward", features=causal).block_n == 64
    tma_tile = default_attention_config(128, "bfloat16", 90, "backward_dkdv", features=causal,
                                        descriptors=True)  # fmt: skip
    walk = default_attention_config(128, "bfloat16", 90, "backward_dkdv", features=causal,
                                    persistent=True, descriptors=True)  # fmt: skip
    assert tma_tile.tma and not walk.tma
    heavy = AttentionFeatures(causal=True, soft_cap=True, alibi=True)
    assert default_attention_config(128, "bfloat16", 90, "backward_dq", features=heavy,
                                    persistent=True).block_n == 32  # fmt: skip
    assert default_attention_config(128, "bfloat16", 90, "forward", features=heavy,
                                    persistent=True).block_n == 64  # fmt: skip


def test_small_shared_memory_gpus_take_their_light_tiles():
    """sm_86, sm_89 and sm_120 (99 KiB of shared memory a block, mma.sync) step twice the
    keys or queries for light calls where the static report found it spill-free in its
    loops (`_SMALL_SHARED_MEMORY_LIGHT`), at 3 stages (two buffers on mma.sync GPUs): dQ
    at d=64 128x64, the forward 128x128 at d=64 and 128x64 at d=128; the persistent
    forward at d=128 and sm_120's forward at d=128 keep the base tile, and so do
    register-heavy calls. dK/dV at d=64 and dQ at d=128 take 3 stages for every call and
    launch, as do the persistent heavy forward at d=64 and dQ at d=128 on every Ampere-
    class GPU (they took 2 and 1). dK/dV at d=128 takes 64x64 on every Ampere-class GPU,
    for every call (the base table's; 32x64 at 8 warps repeated part of its products),
    at 3 stages where they fit (not in 99 KiB). At d=256 the 99 KiB GPUs take tiles of 32
    query rows at 3 stages; sm_80 keeps 2 (two CTAs an SM) and steps dQ 32 rows at 4 warps."""
    causal = AttentionFeatures(causal=True)
    heavy = AttentionFeatures(causal=True, soft_cap=True)

    def tile(compute_capability, head_dim, kind, features=causal, **kw):
        config = default_attention_config(head_dim, "bfloat16", compute_capability, kind,
                                          features=features, **kw)  # fmt: skip
        return config.block_m, config.block_n, config.num_warps, config.num_stages

    for compute_capability in (86, 89, 120, 121):
        for persistent in (False, True):
            walk = dict(persistent=persistent)
            assert tile(compute_capability, 64, "backward_dq", **walk) == (128, 64, 8, 3)
            assert tile(compute_capability, 64, "forward", **walk) == (128, 128, 8, 3)
            assert tile(compute_capability, 64, "backward_dq", heavy, **walk) == (128, 32, 8, 3)
            assert tile(compute_capability, 64, "forward", heavy, **walk) == (128, 64, 8, 3)
            for features in (causal, heavy):
                dkdv = tile(compute_capability, 64, "backward_dkdv", features, **walk)
                assert dkdv == (32, 128, 8, 3)
                dq = tile(compute_capability, 128, "backward_dq", features, **walk)
                assert dq == (128, 32, 8, 3)
        assert tile(compute_capability, 128, "forward", persistent=True) == (128, 32, 8, 3)
        # d=256: 32 query rows a tile at 3 stages (one CTA an SM whatever the tile)
        for features in (causal, heavy):
            walk = dict(features=features, persistent=features is heavy)
            assert tile(compute_capability, 256, "forward", **walk) == (32, 32, 4, 3)
            assert tile(compute_capability, 256, "backward_dkdv", **walk) == (32, 16, 4, 3)
            assert tile(compute_capability, 256, "backward_dq", **walk) == (32, 32, 4, 3)
    assert tile(86, 128, "forward") == tile(89, 128, "forward") == (128, 64, 8, 3)
    assert tile(120, 128, "forward") == (128, 32, 8, 3)
    every_option = AttentionFeatures(causal=True, soft_cap=True, alibi=True, window_left=True)
    for compute_capability in (80, 87):  # sm_80 gives a soft cap alone its light tiles
        walk = dict(features=every_option, persistent=True)
        assert tile(compute_capability, 64, "forward", **walk) == (128, 64, 8, 3)
        assert tile(compute_capability, 128, "backward_dq", **walk) == (128, 32, 8, 3)
        # d=256: two CTAs an SM keep 2 stages; dQ's 32 rows at 4 warps compute each product once
        assert tile(compute_capability, 256, "forward") == (64, 32, 4, 2)
        assert tile(compute_capability, 256, "backward_dkdv") == (32, 32, 4, 2)
        assert tile(compute_capability, 256, "backward_dq") == (32, 32, 4, 2)
    for compute_capability in (80, 86, 87, 89, 120):
        stages = 3 if compute_capability in (80, 87) else 2
        for features, persistent, dq_atomic in itertools.product(
            (causal, heavy), (False, True), (False, True)
        ):
            dkdv = tile(compute_capability, 128, "backward_dkdv", features,
                        persistent=persistent, dq_atomic=dq_atomic)  # fmt: skip
            assert dkdv == (64, 64, 8, stages), (compute_capability, features, persistent)
    assert tile(100, 128, "backward_dkdv") == (16, 64, 8, 2)  # sm_100 keeps its own


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
        (dict(block_m=16, block_n=16, tma=1), TypeError, "AttentionKernelConfig.tma"),
        (
            dict(block_m=16, block_n=16, tma=True, warp_specialize=1),
            TypeError,
            "AttentionKernelConfig.warp_specialize must be a bool",
        ),
        (
            dict(block_m=16, block_n=16, warp_specialize=True),
            ValueError,
            r"warp_specialize needs tma=True.*got tma=False",
        ),
        (
            dict(block_m=16, block_n=16, num_warps=8, tma=True, warp_specialize=True),
            ValueError,
            r"warp_specialize needs .*num_warps=4.*num_warps=8",
        ),
        (
            dict(block_m=16, block_n=16, overlap_softmax=1),
            TypeError,
            "AttentionKernelConfig.overlap_softmax must be a bool",
        ),
        (
            dict(block_m=16, block_n=16, tma=True, warp_specialize=True, overlap_softmax=True),
            ValueError,
            "overlap_softmax and warp_specialize exclude each other",
        ),
        (
            dict(block_m=16, block_n=16, host_descriptors=True),
            ValueError,
            r"host_descriptors=True needs tma=True.*got tma=False",
        ),
        (
            dict(block_m=16, block_n=16, tma=True, warp_specialize=True, host_descriptors=True),
            ValueError,
            r"host_descriptors=True .*excludes warp_specialize=True",
        ),
        (
            dict(block_m=16, block_n=16, head_major=1),
            TypeError,
            "AttentionKernelConfig.head_major must be a bool",
        ),
        (
            dict(block_m=16, block_n=16, tma=True, warp_specialize=True, head_major=True),
            ValueError,
            "head_major and warp_specialize exclude each other",
        ),
    ],
    ids=[
        "not_pow2",
        "too_small",
        "block_n",
        "warps",
        "stages",
        "float",
        "removed_field",
        "tma",
        "ws_bool",
        "ws_no_tma",
        "ws_8_warps",
        "overlap_bool",
        "overlap_and_ws",
        "host_no_tma",
        "host_and_ws",
        "head_major_bool",
        "head_major_and_ws",
    ],
)
def test_kernel_config_validation(kwargs, error, message):
    with pytest.raises(error, match=message):
        AttentionKernelConfig(**kwargs)


def test_configs_validation_names_the_kernel():
    with pytest.raises(TypeError, match=r"AttentionConfigs\.backward_dq"):
        AttentionConfigs(backward_dq=(16, 16))
    configs = AttentionConfigs(forward=AttentionKernelConfig(32, 16))
    assert configs.backward_dkdv is None and configs.backward_dq is None


_SPECIALIZED = AttentionKernelConfig(64, 128, tma=True, warp_specialize=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(backward_dq=_SPECIALIZED), r"warp_specialize=True is for the forward.*backward_dq"),
        (
            dict(backward_dq=AttentionKernelConfig(16, 16, overlap_softmax=True)),
            r"overlap_softmax=True is for the forward.*backward_dq",
        ),
        (
            dict(backward_dkdv=_SPECIALIZED, dq_atomic=True),
            r"warp_specialize=True in the backward_dkdv .*excludes dq_atomic=True",
        ),
        (
            dict(backward_dkdv=_SPECIALIZED.replace(block_m=128)),
            r"warp_specialize=True in the backward_dkdv .*needs block_m <= 64.*got block_m=128",
        ),
        (
            dict(forward=AttentionKernelConfig(16, 16, head_major=True)),
            r"head_major=True is for the backward_dkdv kernel's config only.*forward",
        ),
        (
            dict(backward_dq=AttentionKernelConfig(16, 16, head_major=True)),
            r"head_major=True is for the backward_dkdv kernel's config only.*backward_dq",
        ),
    ],
    ids=[
        "ws-dq", "overlap-dq", "ws-dkdv-dq-atomic", "ws-dkdv-128-queries", "head-major-forward",
        "head-major-dq",
    ],
)  # fmt: skip
def test_configs_refuse_options_their_kernels_cannot_run(kwargs, message):
    """Where the configs are built, not when a gradient is first traced; each of those
    options on the kernel that can run it is taken."""
    with pytest.raises(ValueError, match=rf"^AttentionConfigs: {message}"):
        AttentionConfigs(**kwargs)
    AttentionConfigs(forward=_SPECIALIZED, backward_dkdv=_SPECIALIZED.replace(block_m=32))
    AttentionConfigs(backward_dkdv=AttentionKernelConfig(16, 16, overlap_softmax=True))
    AttentionConfigs(backward_dkdv=AttentionKernelConfig(16, 16, head_major=True), dq_atomic=True)


def test_a_forward_call_refuses_a_tma_config_its_head_dim_cannot_take():
    """Checked at the call, for every kernel's config: a forward-only call with a dK/dV
    config the gradient could not run fails there, naming the kernel."""
    inputs = make_inputs(5, [(20, 20)], 2, 1, 48)
    q, k, v, cu_q, cu_k = (inputs[n] for n in ("q", "k", "v", "cu_q", "cu_k"))
    config = AttentionConfigs(backward_dkdv=AttentionKernelConfig(16, 16, tma=True))
    with pytest.raises(ValueError, match=r"config tma=True \(backward_dkdv\).*power of two.*48"):
        varlen_attention(q, k, v, cu_q, cu_k, implementation="triton", config=config)
    # XLA ignores the config.
    varlen_attention(q, k, v, cu_q, cu_k, implementation="xla", config=config)


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
        AttentionConfigs(
            forward=AttentionKernelConfig(block_m=16, block_n=16, tma=True),
            backward_dkdv=AttentionKernelConfig(block_m=16, block_n=32, tma=True),
            backward_dq=AttentionKernelConfig(block_m=32, block_n=16, tma=True),
        ),
        AttentionConfigs(
            forward=AttentionKernelConfig(16, 16, tma=True, warp_specialize=True),
            backward_dkdv=AttentionKernelConfig(16, 32, tma=True, warp_specialize=True),
        ),
        AttentionConfigs(
            forward=AttentionKernelConfig(16, 16, tma=True, host_descriptors=True),
            backward_dkdv=AttentionKernelConfig(32, 16, tma=True, host_descriptors=True),
            backward_dq=AttentionKernelConfig(32, 16, tma=True, host_descriptors=True),
        ),
    ],
    ids=["one_for_all", "per_kernel", "tma", "tma-warp-specialized", "tma-host"],
)
def test_config_overrides_give_the_same_numbers(config):
    """Other tilings (unequal, larger than a sequence) and tensor-descriptor loads (whose
    rows past a sequence read 0; dK/dV's span the GQA group's heads) give the reference's
    numbers and the default configuration's, forward and backward; so do the
    warp-specialized forward's one loop over every key tile and dK/dV's over every query
    tile of the GQA group's heads, masked, with the stationary tile by descriptor and
    surplus programs that return nothing but run an empty loop; so do all three kernels
    through descriptors the launch encodes over the whole arrays they stream
    (`host_descriptors`: K and V, dK/dV's Q and dO)."""
    if isinstance(config, AttentionConfigs) and config.forward.host_descriptors:
        skip_unless_host_descriptors_launch()
    options = dict(causal=True, sliding_window=(13, None), return_lse=True)
    _check_config_against_oracle_and_default(config, LENGTHS, options)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_one_stage_tiles_over_several_key_tiles(tma):
    """The tuning grid's and the A/B rows' forward and dQ at one stage
    (`ONE_STAGE_TWO_CTA_TILE`, 64 x 128), by pointers and by descriptors, over documents
    of several query and key tiles each (unmasked tiles, the diagonal, a partial last
    tile, rescaling across key tiles): the reference's numbers."""
    one_stage = AttentionKernelConfig(*ONE_STAGE_TWO_CTA_TILE, tma=tma)
    config = AttentionConfigs(forward=one_stage, backward_dq=one_stage)
    lengths = [(200, 200), (0, 5), (100, 170)]
    options = dict(causal=True, return_lse=True)
    _check_config_against_oracle_and_default(config, lengths, options, against_default=False)


def _check_config_against_oracle_and_default(config, lengths, options, against_default=True):
    """varlen_attention's out, lse and gradients at `config` against the float64 oracle,
    and (`against_default`) the default configuration's (2 heads of 32, one kv head,
    sinks)."""
    inputs = make_inputs(40, lengths, 2, 1, 32)
    q, k, v, cu_q, cu_k, sinks = (inputs[n] for n in ("q", "k", "v", "cu_q", "cu_k", "sinks"))

    def run(config):
        def fn(q, k, v, s):
            return varlen_attention(
                q, k, v, cu_q, cu_k, sinks=s, config=config, implementation="triton", **options
            )

        return value_and_grads(fn, q, k, v, sinks, inputs["d_out"], inputs["d_lse"])

    def reference(q, k, v, s):
        return attention_reference(q, k, v, cu_q, cu_k, sinks=s, **options)

    configured = run(config)
    expected = oracle_value_and_grads(reference, q, k, v, sinks, inputs["d_out"], inputs["d_lse"])
    tol = attention_tolerance(q, k, cu_q=cu_q, cu_k=cu_k, sinks=sinks)
    names = ("out", "lse", "dq", "dk", "dv", "d_sinks")
    flat = lambda r: (r[0], r[1], *r[2])
    for name, got, ref in zip(names, flat(configured), flat(expected), strict=True):
        assert_close(got, ref, tol, name)
    if against_default:
        for name, got, same in zip(names, flat(configured), flat(run(None)), strict=True):
            # Two float32 runs, each within tol of the oracle.
            assert_close(got, same, 2 * tol, f"{name} vs the default config")


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize(
    "options",
    [dict(causal=True), dict(causal=False, logits_soft_cap=7.0, dq_atomic=True), dict(alibi=True)],
    ids=["causal", "soft-cap-dq-atomic", "alibi"],
)
def test_overlapped_softmax_gives_the_default_numbers(options, tma):
    """`overlap_softmax` (the forward: each unmasked key tile's QK^T a tile ahead of its
    softmax; dK/dV: dP ahead of P's exp2s, with dQ by atomics too) over documents whose
    unmasked key tiles number zero, one (the forward loop's first and last tiles only)
    and many, GQA, sinks: the oracle's numbers and the same tiles' without the overlap,
    forward and backward."""
    lengths = [(83, 83), (1, 1), (0, 0), (21, 40), (16, 16), (50, 71)]
    inputs = make_inputs(44, lengths, 4, 2, 32)
    q, k, v, cu_q, cu_k, sinks = (inputs[n] for n in ("q", "k", "v", "cu_q", "cu_k", "sinks"))
    alibi, dq_atomic = options.pop("alibi", False), options.pop("dq_atomic", False)
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32) if alibi else None
    options |= dict(return_lse=True, alibi_slopes=slopes)

    def run(config):
        configs = AttentionConfigs(forward=config, backward_dkdv=config, dq_atomic=dq_atomic)

        def fn(q, k, v, s):
            return varlen_attention(q, k, v, cu_q, cu_k, sinks=s, implementation="triton",
                                    config=configs, **options)  # fmt: skip

        return value_and_grads(fn, q, k, v, sinks, inputs["d_out"], inputs["d_lse"])

    def reference(q, k, v, s):
        return attention_reference(q, k, v, cu_q, cu_k, sinks=s, **options)

    plain = AttentionKernelConfig(16, 16, tma=tma)
    overlapped, same = run(plain.replace(overlap_softmax=True)), run(plain)
    expected = oracle_value_and_grads(reference, q, k, v, sinks, inputs["d_out"], inputs["d_lse"])
    tol = attention_tolerance(q, k, cu_q=cu_q, cu_k=cu_k, sinks=sinks)
    flat = lambda r: (r[0], r[1], *r[2])
    names = ("out", "lse", "dq", "dk", "dv", "d_sinks")
    for name, got, other, ref in zip(names, flat(overlapped), flat(same), flat(expected),
                                     strict=True):  # fmt: skip
        assert_close(got, ref, tol, name)
        assert_close(got, other, 2 * tol, f"{name} vs the loop without the overlap")


@pytest.mark.parametrize(
    "options",
    [
        dict(causal=True, sliding_window=(37, None), return_lse=True),
        dict(causal=False, sliding_window=(9, 23), return_lse=True),
    ],
    ids=["causal-left-window", "two-sided-window"],
)
def test_warp_specialized_dkdv_gives_the_float64_gradients(options):
    """dK/dV warp-specialized: one loop over every query tile of the GQA group's heads,
    each masked, with K and V by descriptors; a group of 3 heads (the (head, tile) steps
    carried, not masked out of the step), documents of 0, 1 and many tokens, surplus
    programs that run an empty loop. The oracle's gradients, and the same tile's without
    warp specialization."""
    lengths = [(83, 83), (1, 1), (0, 0), (21, 40), (50, 71)]
    inputs = make_inputs(45, lengths, 3, 1, 32)
    q, k, v, cu_q, cu_k = (inputs[n] for n in ("q", "k", "v", "cu_q", "cu_k"))

    def run(dkdv):
        config = AttentionConfigs(backward_dkdv=dkdv)

        def fn(q, k, v, s):
            return varlen_attention(q, k, v, cu_q, cu_k, implementation="triton",
                                    config=config, **options)  # fmt: skip

        return value_and_grads(fn, q, k, v, None, inputs["d_out"])

    def reference(q, k, v, s):
        return attention_reference(q, k, v, cu_q, cu_k, **options)

    plain = AttentionKernelConfig(16, 32, tma=True)
    specialized, same = run(plain.replace(warp_specialize=True)), run(plain)
    expected = oracle_value_and_grads(reference, q, k, v, None, inputs["d_out"])
    tol = attention_tolerance(q, k, cu_q=cu_q, cu_k=cu_k)
    for name, got, other, ref in zip(("dq", "dk", "dv"), specialized[2], same[2], expected[2],
                                     strict=True):  # fmt: skip
        assert_close(got, ref, tol, name)
        assert_close(got, other, 2 * tol, f"{name} vs the loop unspecialized")


def _assert_float64_numbers(inputs, causal: bool, config) -> None:
    """varlen_attention at `config` on `inputs` (`make_inputs`): output, lse and every
    gradient against the float64 oracle."""
    q, k, v, cu_q, cu_k = (inputs[n] for n in ("q", "k", "v", "cu_q", "cu_k"))

    def fn(q, k, v, s):
        return varlen_attention(q, k, v, cu_q, cu_k, causal=causal, return_lse=True,
                                implementation="triton", config=config)  # fmt: skip

    def reference(q, k, v, s):
        return attention_reference(q, k, v, cu_q, cu_k, causal=causal, return_lse=True)

    got = value_and_grads(fn, q, k, v, None, inputs["d_out"])
    expected = oracle_value_and_grads(reference, q, k, v, None, inputs["d_out"])
    tol = attention_tolerance(q, k, cu_q=cu_q, cu_k=cu_k)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (*got[:2], *got[2]),
                          (*expected[:2], *expected[2]), strict=True):  # fmt: skip
        assert_close(a, b, tol, name)


def _assert_device_float64_numbers(dtype, causal: bool, config=None, group: int = 4) -> None:
    """`_assert_float64_numbers` at d=128, 2 kv heads of `group` query heads, `dtype`, on
    unequal, empty and one-token documents and ones longer than a tile."""
    lengths = [(300, 300), (1, 1), (0, 0), (517, 517), (64, 64)]
    inputs = make_inputs(42, lengths, 2 * group, 2, 128, dtype=dtype)
    _assert_float64_numbers(inputs, causal, config)


@needs_tensor_descriptors
@pytest.mark.parametrize("group", [4, 3])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_default_tma_dkdv_gives_the_float64_gradients_on_a_hopper_gpu(dtype, group):
    """The default that only such a device takes (dK/dV at 64x128 with Q and dO through
    TMA; d=128, causal, GQA groups of 4, and of 3, which the walk carries as a (tile,
    head) pair), against the float64 oracle."""
    _assert_device_float64_numbers(dtype, causal=True, group=group)


@pytest.mark.parametrize("host", [False, True], ids=["program-descriptors", "host"])
def test_tma_dkdv_over_a_group_that_is_not_a_power_of_two(host):
    """dK/dV through descriptors (each program's, or the launch's) when its walk over
    (query tile, head) pairs carries the pair, 3 query heads a kv head: the float64
    oracle's numbers, on documents shorter and longer than a tile, empty and of one
    token."""
    if host:
        skip_unless_host_descriptors_launch()
    inputs = make_inputs(43, [(37, 37), (1, 1), (0, 0), (20, 20)], 6, 2, 32)
    dkdv = AttentionKernelConfig(16, 16, tma=True, host_descriptors=host)
    _assert_float64_numbers(inputs, True, AttentionConfigs(backward_dkdv=dkdv))


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "not-causal"])
def test_overlapped_softmax_at_the_ab_rows_tiles_gives_the_float64_numbers(causal):
    """The A/B rows' forward and dK/dV with their softmax overlapped, at their tiles (d=128,
    bf16, GQA groups of 4; compiled on a GPU, where the overlap is in the SASS), against
    the float64 oracle."""
    forward = AttentionKernelConfig(*OVERLAPPED_FORWARD_TILE, overlap_softmax=True)
    dkdv = AttentionKernelConfig(*OVERLAPPED_DKDV_TILE, overlap_softmax=True)
    config = AttentionConfigs(forward=forward, backward_dkdv=dkdv)
    _assert_device_float64_numbers(jnp.bfloat16, causal, config)


@pytest.mark.slow
def test_two_cta_backward_at_its_tile_gives_the_float64_gradients():
    """The A/B row's backward at `TWO_CTA_BACKWARD_TILE` with `tma` (dK/dV and dQ at
    64x64, 4 warps; d=128, bf16, causal, GQA groups of 4; in the interpreter here, on a
    Hopper GPU by gpu_check.sh's test step), against the float64 oracle."""
    tile = AttentionKernelConfig(*TWO_CTA_BACKWARD_TILE, tma=True)
    config = AttentionConfigs(backward_dkdv=tile, backward_dq=tile)
    _assert_device_float64_numbers(jnp.bfloat16, True, config)


# --- head-major dK/dV (AttentionKernelConfig.head_major) --------------------------------


def test_hopper_dkdv_is_head_major_past_head_dim_128():
    """On sm_90 dK/dV at head dims 129-256 accumulates dK^T and dV^T (its two warpgroups
    compute each product once, spill-free with every option: the static report), whatever
    the call's options and launch; with dQ by atomics at a tile of its own. Nowhere else:
    not at d <= 128, on mma.sync GPUs, Blackwell, float32, the forward or dQ. The
    block-sparse dK/dV takes it too."""
    default = AttentionKernelConfig(*HEAD_MAJOR_DKDV_TILE, head_major=True)
    atomic = AttentionKernelConfig(*HEAD_MAJOR_DQ_ATOMIC_TILE, head_major=True)
    for head_dim, dtype_name, features, persistent, descriptors in itertools.product(
        (136, 192, 256), ("bfloat16", "float16"), FEATURE_SETS, (False, True), (False, True)
    ):
        args = (head_dim, dtype_name, 90, "backward_dkdv")
        launch = dict(features=features, persistent=persistent, descriptors=descriptors)
        assert default_attention_config(*args, **launch) == default, (args, launch)
        assert default_attention_config(*args, **launch, dq_atomic=True) == atomic
    for change in [
        dict(head_dim=128), dict(dtype_name="float32"), dict(compute_capability=80),
        dict(compute_capability=86), dict(compute_capability=100),
        dict(compute_capability=120), dict(kind="forward"), dict(kind="backward_dq"),
    ]:  # fmt: skip
        args = dict(head_dim=256, dtype_name="bfloat16", compute_capability=90,
                    kind="backward_dkdv") | change  # fmt: skip
        assert not default_attention_config(**args).head_major, change
        assert not default_attention_config(**args, dq_atomic=True).head_major, change
    for soft_cap, alibi in itertools.product((False, True), (False, True)):
        config = block_sparse_config(256, "bfloat16", 90, "backward_dkdv", soft_cap=soft_cap,
                                     alibi=alibi)  # fmt: skip
        assert config == default
    assert not block_sparse_config(256, "bfloat16", 80, "backward_dkdv").head_major


@pytest.mark.parametrize(
    "options",
    [
        dict(causal=True, tma=True),
        dict(causal=False, logits_soft_cap=7.0, sliding_window=(19, 31), dq_atomic=True),
        dict(causal=True, alibi=True, overlap_softmax=True),
        dict(causal=True, sliding_window=(24, None), dq_atomic=True, tma=True),
    ],
    ids=["causal-tma", "soft-cap-window-dq-atomic", "alibi-overlap", "left-window-atomic-tma"],
)
def test_head_major_dkdv_gives_the_float64_gradients(options):
    """dK/dV head-major (dK^T = Q^T dS, dV^T = dO^T P; its tile's scores and masks as the
    forward's) over documents with as many keys as queries and more, empty and of one
    token, GQA groups of 2, a head_dim padded to its tile (40 of 64): the float64 oracle's
    numbers, and the key-major kernel's at the same tile, with dQ by atomics too."""
    lengths = [(83, 83), (1, 1), (0, 0), (21, 40), (33, 70), (16, 16)]
    inputs = make_inputs(46, lengths, 4, 2, 40)
    q, k, v, cu_q, cu_k = (inputs[n] for n in ("q", "k", "v", "cu_q", "cu_k"))
    dq_atomic, tma = options.pop("dq_atomic", False), options.pop("tma", False)
    overlap, alibi = options.pop("overlap_softmax", False), options.pop("alibi", False)
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32) if alibi else None
    options |= dict(return_lse=True, alibi_slopes=slopes)
    if tma:
        inputs = make_inputs(46, lengths, 4, 2, 64)  # descriptors: a power-of-two head dim
        q, k, v = (inputs[n] for n in "qkv")

    def run(head_major):
        dkdv = AttentionKernelConfig(16, 32, tma=tma, overlap_softmax=overlap,
                                     head_major=head_major)  # fmt: skip
        configs = AttentionConfigs(backward_dkdv=dkdv, dq_atomic=dq_atomic)

        def fn(q, k, v, s):
            return varlen_attention(q, k, v, cu_q, cu_k, implementation="triton",
                                    config=configs, **options)  # fmt: skip

        return value_and_grads(fn, q, k, v, None, inputs["d_out"], inputs["d_lse"])

    def reference(q, k, v, s):
        return attention_reference(q, k, v, cu_q, cu_k, **options)

    head_major, key_major = run(True), run(False)
    expected = oracle_value_and_grads(reference, q, k, v, None, inputs["d_out"], inputs["d_lse"])
    tol = attention_tolerance(q, k, cu_q=cu_q, cu_k=cu_k)
    flat = lambda r: (r[0], r[1], *r[2])
    for name, got, other, ref in zip(("out", "lse", "dq", "dk", "dv"), flat(head_major),
                                     flat(key_major), flat(expected), strict=True):  # fmt: skip
        assert_close(got, ref, tol, name)
        assert_close(got, other, 2 * tol, f"{name} vs the key-major kernel")


@pytest.mark.slow
@pytest.mark.parametrize("dq_atomic", [False, True], ids=["dq-kernel", "dq-atomic"])
def test_head_major_dkdv_at_its_hopper_tiles_gives_the_float64_gradients(dq_atomic):
    """Hopper's d=256 dK/dV defaults (`HEAD_MAJOR_DKDV_TILE`, and with dQ by atomics
    `HEAD_MAJOR_DQ_ATOMIC_TILE`; bf16, causal, GQA groups of 4; in the interpreter here,
    on a Hopper GPU by its defaults), against the float64 oracle."""
    tile = HEAD_MAJOR_DQ_ATOMIC_TILE if dq_atomic else HEAD_MAJOR_DKDV_TILE
    dkdv = AttentionKernelConfig(*tile, head_major=True)
    lengths = [(150, 150), (1, 1), (0, 0), (97, 97)]
    inputs = make_inputs(47, lengths, 8, 2, 256, dtype=jnp.bfloat16)
    _assert_float64_numbers(inputs, True, AttentionConfigs(backward_dkdv=dkdv, dq_atomic=dq_atomic))


# --- dQ accumulated by the dK/dV kernel (AttentionConfigs.dq_atomic) ----------------------

DQ_ATOMIC = AttentionConfigs(dq_atomic=True)


@pytest.mark.parametrize(
    "name",
    [
        "causal",
        "everything",
        "gqa3_causal_window_alibi_sinks",
        "gqa4_d80_window_sinks",
        "bf16_d48_all_options",
        "rows_past_the_last_sequence_sinks",
        "sink_of_minus_infinity",
        "q_longer_then_shorter",
    ],
)
def test_dq_atomic_matches_the_reference(name):
    """dQ by atomic adds from the dK/dV kernel, on the conformance cases (every window
    side, soft cap, ALiBi, sinks with an lse cotangent, GQA groups of 3 and 4, padded head
    dims, 16 bits, rows past the sequences, queries longer and shorter than keys): forward
    and gradients against the oracle, exact zeros where nothing is attended."""
    check_case("triton", CASES[name], seed=100 + list(CASES).index(name), config=DQ_ATOMIC)


# dQ-atomic with its dK/dV tile through tensor descriptors: on Hopper each step's dQ share
# is one bulk tensor reduction (interpreted: element-wise adds inside the descriptor).
DQ_BY_REDUCTION = AttentionConfigs(
    backward_dkdv=AttentionKernelConfig(16, 16, tma=True), dq_atomic=True
)


@pytest.mark.parametrize(
    "name",
    [
        "everything",
        "gqa3_causal_window_alibi_sinks",
        "bf16_causal_window_sinks",
        "rows_past_the_last_sequence_sinks",
        "q_longer_then_shorter",
    ],
)
def test_dq_atomic_by_tma_reduction_matches_the_reference(name):
    """dQ added through a descriptor over each sequence's rows of the GQA group's heads,
    a head wide: the conformance cases with every window side, soft cap, ALiBi and sinks,
    a group of 3, 16 bits, rows past the sequences (which its adds must not reach) and
    queries longer and shorter than keys, against the oracle."""
    check_case("triton", CASES[name], seed=200 + list(CASES).index(name), config=DQ_BY_REDUCTION)


# A NaN query row's scores are all NaN: the interpreter's row max (numpy's nanmax) warns.
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.parametrize("where", sorted(robustness.POISON_ROWS))
@pytest.mark.parametrize(
    "array, value, causal",
    [("v", np.nan, False), ("v", np.inf, True), ("k", np.inf, False), ("q", np.nan, True),
     ("d_out", np.inf, False)],
)  # fmt: skip
def test_host_descriptors_keep_a_poisoned_document_to_itself(where, array, value, causal):
    """Every kernel through descriptors over the whole arrays it streams
    (`host_descriptors`: the forward's and dQ's K and V, dK/dV's Q and dO): a masked tile
    reads past its sequence (the length-1 document's tile reads the next document's rows,
    the last document's the padding's), and must zero those rows itself, so a non-finite
    row of any of them reaches no other document's output or gradients. Clean, they give
    the same tiles' numbers by pointers (GQA: each query head's kv head's columns of the
    descriptors, each kv head's group of query heads)."""
    skip_unless_host_descriptors_launch()
    q, k, v, sinks, weights = robustness._inputs()
    host = AttentionKernelConfig(16, 16, tma=True, host_descriptors=True)
    options = dict(causal=causal, config=AttentionConfigs.for_every_kernel(host))
    clean_out, clean_grads = robustness._value_and_grads(
        "triton", q, k, v, sinks, weights, **options
    )
    assert q.shape[1] > k.shape[1] > 1, "GQA with several kv heads"
    by_pointers = AttentionConfigs.for_every_kernel(AttentionKernelConfig(16, 16))
    pointer_out, pointer_grads = robustness._value_and_grads(
        "triton", q, k, v, sinks, weights, causal=causal, config=by_pointers
    )
    tol = robustness._tolerance(q, k, sinks)
    for name, got, want in zip(("out", "dq", "dk", "dv", "d_sinks"), (clean_out, *clean_grads),
                               (pointer_out, *pointer_grads), strict=True):  # fmt: skip
        # Two float32 runs, each within tol of the oracle; d_sinks sums every row.
        rows = slice(None) if name == "d_sinks" else slice(71)
        want = robustness._f64(want)[rows]
        assert_close(np.asarray(got)[rows], want, 2 * tol, f"{name} by pointers")
    arrays = {"q": q, "k": k, "v": v, "d_out": weights}
    arrays[array] = arrays[array].at[jnp.asarray(robustness.POISON_ROWS[where])].set(value)
    out, grads = robustness._value_and_grads(
        "triton", *(arrays[name] for name in "qkv"), sinks, arrays["d_out"], **options
    )
    clean = robustness.CLEAN_ROWS
    np.testing.assert_array_equal(np.asarray(out)[clean], np.asarray(clean_out)[clean])
    for name, got, want in zip("qkv", grads[:3], clean_grads[:3], strict=True):
        np.testing.assert_array_equal(np.asarray(got)[clean], np.asarray(want)[clean], f"d{name}")
    reference = attention_reference(q, k, v, robustness._cu(), robustness._cu(), sinks=sinks,
                                    causal=causal)  # fmt: skip
    assert_close(np.asarray(clean_out)[:71], robustness._f64(reference)[:71], tol, "out")


# Queries shorter and longer than their keys, and a length-1 sequence.
_UNEQUAL_LENGTHS = ((5, 21), (20, 7), (1, 1), (18, 30), (9, 9))
# (len_q, len_k) and shift of each sequence: shifts of both signs (ring attention's pieces).
_SHIFTED = (((20, 17), (9, 30), (3, 9), (19, 12)), (-3, 25, 3, 0))
# (AttentionSpec.create's keywords, (len_q, len_k) a sequence, shifts or None, (q heads,
# kv heads), dq_atomic): each window side, GQA groups of 3 and 2, and dQ added by the
# dK/dV kernel.
_POISONED_QUERY_CASES = {
    "causal-gqa3": (dict(causal=True), _UNEQUAL_LENGTHS, None, (3, 1), False),
    "window-both-shifted": (dict(sliding_window=(4, 1)), *_SHIFTED, (4, 2), False),
    "causal-window-left-shifted": (dict(causal=True, sliding_window=(5, None)),
                                   ((20, 33), (7, 5), (1, 1), (12, 12), (35, 40)),
                                   (-5, 9, 0, 3, 17), (4, 2), False),
    "window-right": (dict(sliding_window=(None, 3)), ((17, 17), (3, 20), (18, 5), (9, 9)), None,
                     (3, 1), False),
    "dq-atomic-causal": (dict(causal=True), _UNEQUAL_LENGTHS, None, (4, 2), True),
    "dq-atomic-window-shifted": (dict(sliding_window=(4, 1)), *_SHIFTED, (3, 1), True),
}  # fmt: skip


# A NaN query row's scores are all NaN: the interpreter's row max (numpy's nanmax) warns.
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.parametrize("poison", ["q-nan", "d_out-inf"])
@pytest.mark.parametrize("name", sorted(_POISONED_QUERY_CASES))
def test_host_descriptors_keep_poisoned_queries_to_their_document(name, poison):
    """dK/dV through the launch's descriptors over all of q and dO: NaN in one document's
    queries, or Inf in its output's cotangent (`poison`; each document in turn, then the
    padding), changes no other document's dq, dk or dv, whichever masked range (the
    diagonal band, a window's edges, the sequence's end) reads past it; clean, the
    gradients are the same tiles' by pointers. The backends are driven directly, as ring
    attention calls them, to pass shifts."""
    skip_unless_host_descriptors_launch()
    keywords, lengths, shifts, heads, dq_atomic = _POISONED_QUERY_CASES[name]
    inputs = make_inputs(3, lengths, *heads, 16, pad=(6, 0))
    q, k, v, d_out = (inputs[n] for n in ("q", "k", "v", "d_out"))
    cu_q, cu_k = jnp.asarray(inputs["cu_q"]), jnp.asarray(inputs["cu_k"])
    shift = None if shifts is None else jnp.asarray(shifts, jnp.int32)
    spec = AttentionSpec.create(16, **keywords)

    def gradients(dkdv: AttentionKernelConfig, q, d_out) -> list[np.ndarray]:
        config = AttentionConfigs(backward_dkdv=dkdv, dq_atomic=dq_atomic)
        options = AttentionOptions(implementation="triton", precision=DEFAULT_PRECISION,
                                   config=config, spec=spec)  # fmt: skip
        out, lse = attention_triton.forward(q, k, v, cu_q, cu_k, None, None, options, shift=shift)
        grads = attention_triton.backward(q, k, v, out, lse, d_out, None, cu_q, cu_k, None, None,
                                          options, shift=shift)  # fmt: skip
        return [np.asarray(g) for g in grads[:3]]

    host = AttentionKernelConfig(16, 16, tma=True, host_descriptors=True)
    clean = gradients(host, q, d_out)
    tol = attention_tolerance(q, k, cu_q=inputs["cu_q"], cu_k=inputs["cu_k"])
    by_pointers = gradients(AttentionKernelConfig(16, 16), q, d_out)
    for label, got, want in zip(("dq", "dk", "dv"), clean, by_pointers, strict=True):
        # Two float32 runs, each within tol of the oracle.
        assert_close(got, want.astype(np.float64), 2 * tol, f"{label} by pointers")
    cq, ck = inputs["cu_q"], inputs["cu_k"]
    owners = [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(lengths))
              if cq[b + 1] > cq[b]]  # fmt: skip
    owners.append((cq[-1], q.shape[0], 0, 0))  # the padding: rows of no sequence, no keys
    for q_lo, q_hi, k_lo, k_hi in owners:
        rows = jnp.arange(q_lo, q_hi)
        others = np.r_[0:q_lo, q_hi : q.shape[0]], np.r_[0:k_lo, k_hi : k.shape[0]]
        if poison == "q-nan":
            poisoned = gradients(host, q.at[rows].set(jnp.nan), d_out)
        else:
            poisoned = gradients(host, q, d_out.at[rows].set(jnp.inf))
        where = f"rows [{q_lo}, {q_hi}) poisoned ({poison})"
        keeps = (others[0], others[1], others[1])
        for label, got, want, keep in zip(("dq", "dk", "dv"), poisoned, clean, keeps, strict=True):
            if label == "dq" and dq_atomic:  # on a GPU its adds land in any order
                assert_close(got[keep], want[keep].astype(np.float64), tol, f"dq, {where}")
            else:
                np.testing.assert_array_equal(got[keep], want[keep], f"{label}, {where}")


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")  # as above
@pytest.mark.parametrize(
    "array, value, causal, config",
    [
        ("v", np.inf, True, DQ_ATOMIC),
        ("k", np.inf, False, DQ_ATOMIC),
        ("q", np.nan, True, DQ_ATOMIC),
        ("v", np.inf, True, DQ_BY_REDUCTION),
    ],
    ids=["v-inf-causal", "k-inf", "q-nan-causal", "v-inf-causal-tma-reduction"],
)
def test_dq_atomic_keeps_a_poisoned_document_to_itself(array, value, causal, config):
    """A non-finite value in one document's V or K makes its own dS non-finite; the atomic
    adds of its key tiles are masked to its own query rows (or, by reduction, bounded by
    its descriptor), so every other document's gradients (and padding's zeros) stay those
    of the clean inputs."""
    q, k, v, sinks, weights = robustness._inputs()
    options = dict(causal=causal, config=config)
    _, clean_grads = robustness._value_and_grads("triton", q, k, v, sinks, weights, **options)
    arrays = {"q": q, "k": k, "v": v}
    arrays[array] = arrays[array].at[jnp.asarray(robustness.POISON_ROWS["document"])].set(value)
    _, grads = robustness._value_and_grads(
        "triton", arrays["q"], arrays["k"], arrays["v"], sinks, weights, **options
    )
    clean, tol = robustness.CLEAN_ROWS, robustness._tolerance(q, k, sinks)
    # Within tol, not equal: on a GPU the atomic adds of a row land in any order.
    for name, got, want in zip("qkv", grads[:3], clean_grads[:3], strict=False):
        assert_close(got[clean], robustness._f64(want[clean]), tol, f"d{name} clean rows")
    np.testing.assert_array_equal(grads[0][71:], 0.0)  # padding rows


@pytest.mark.parametrize(
    "dtype, score", [(jnp.float32, -100.0), (jnp.float16, -14.0)], ids=["fp32", "fp16"]
)
@pytest.mark.parametrize(
    "options", [{}, {"sliding_window": (2, None)}, {"causal": True}], ids=["full", "left", "causal"]
)
def test_dq_atomic_with_very_negative_scores(dtype, score, options):
    """Every score near `score` (lse below -88 in float32; dS in 16 bits overflows past
    -10) and key tiles past len_k: the zero keys of a tile's rows past len_k must not
    reach dQ (their P = exp2(-lse) is inf, and inf * 0 is NaN)."""
    rng = np.random.default_rng(3)
    lengths = [(4, 5), (7, 21), (0, 3), (19, 19)]
    d = 16
    unit = np.ones(d) / np.sqrt(d) * np.sqrt(-score * np.sqrt(d))
    cu_q, cu_k = (np.cumsum([0, *side]).astype(np.int32) for side in zip(*lengths, strict=True))
    q = unit + 0.1 * rng.standard_normal((int(cu_q[-1]), 1, d))
    k = -unit + rng.standard_normal((int(cu_k[-1]), 1, d))  # dQ = scale * sum dS k: not all one k
    v = rng.standard_normal((int(cu_k[-1]), 1, d))
    d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))

    def ours(q, k, v, s):
        return varlen_attention(
            q, k, v, cu_q, cu_k, config=DQ_ATOMIC, implementation="triton", return_lse=True,
            **options,
        )  # fmt: skip

    def reference(q, k, v, s):
        return attention_reference(q, k, v, cu_q, cu_k, return_lse=True, **options)

    got = value_and_grads(ours, q, k, v, None, d_out, None)
    want = oracle_value_and_grads(reference, q, k, v, None, d_out, None)
    tol = attention_tolerance(q, k, cu_q=cu_q, cu_k=cu_k)
    for name, g, w in zip(("dq", "dk", "dv"), got[2], want[2], strict=True):
        assert_close(g, w, tol, name)


def test_dq_atomic_under_vmap_and_jit():
    """Batched (one launch per element, each with its own zeroed dQ) and jitted, dQ by
    atomics gives each element's own gradient."""
    q, k, v, _, _ = robustness._inputs(7)
    cu = jnp.asarray(robustness._cu())

    def loss(q):
        out = varlen_attention(
            q, k, v, cu, cu, causal=True, config=DQ_ATOMIC, implementation="triton"
        )
        return jnp.sum(out**2)

    batch = jnp.stack([q, q[::-1] * 0.5])
    grads = jax.jit(jax.vmap(jax.grad(loss)))(batch)
    for i in range(2):
        single = robustness._f64(jax.grad(loss)(batch[i]))
        assert_close(grads[i], single, robustness._tolerance(batch[i], k), f"dq batch {i}")


def test_dq_atomic_takes_the_base_tile_by_pointers():
    """With dQ's product and atomic adds in it, dK/dV keeps the base tables' tile where
    light calls would take the larger ones (the TMA tile on sm_90: it spills with them),
    but where its own tables say otherwise (64 query rows: sm_80 at d=64 without the
    register-heavy options, sm_80 at d=128; sm_90 at d=256 head-major at 16x64); the
    other kernels keep theirs."""
    causal = AttentionFeatures(causal=True)

    def config(head_dim, kind, dq_atomic, capability=90, features=causal):
        return default_attention_config(
            head_dim, "bfloat16", capability, kind, features=features, descriptors=True,
            dq_atomic=dq_atomic,
        )  # fmt: skip

    assert config(128, "backward_dkdv", False).tma
    assert config(128, "backward_dkdv", True) == AttentionKernelConfig(32, 128, 8, 2)
    assert config(64, "backward_dkdv", True) == AttentionKernelConfig(32, 128, 8, 3)
    head_major = AttentionKernelConfig(16, 64, 8, 2, head_major=True)
    assert config(256, "backward_dkdv", True) == head_major
    capped = AttentionFeatures(causal=True, soft_cap=True)
    assert config(256, "backward_dkdv", True, features=capped) == head_major
    assert config(128, "backward_dkdv", True, capability=80) == AttentionKernelConfig(64, 64, 8, 3)
    assert config(64, "backward_dkdv", True, capability=80) == AttentionKernelConfig(64, 64, 4, 3)
    assert config(64, "backward_dkdv", True, capability=80, features=capped) == (
        AttentionKernelConfig(32, 128, 8, 3)
    )
    for kind in ("forward", "backward_dq"):
        assert config(128, kind, True) == config(128, kind, False)
    with pytest.raises(TypeError, match="dq_atomic must be a bool"):
        AttentionConfigs(dq_atomic=1)


# --- NaN poisoning ------------------------------------------------------------------------


def test_rows_a_launch_does_not_reach_stay_nan():
    """The forward kernel launched on the first query tile only (grid (1, heads)):
    that tile's rows hold the reference's output, every other row is still NaN (outputs
    start as NaN on the interpreter, which this test runs on a GPU host too)."""
    inputs = make_inputs(41, [(40, 30)], 2, 1, 32)
    q, k, v, cu_q, cu_k = (inputs[n] for n in ("q", "k", "v", "cu_q", "cu_k"))
    spec = AttentionSpec.create(32, sliding_window=(None, 12))
    options = AttentionOptions(
        implementation="triton", precision=DEFAULT_PRECISION, config=None, spec=spec
    )
    block = 16
    features = attention_triton._features(spec, None, None)
    # In packed order (without a right bound's heaviest-first): row 0 is the first tile.
    lists = schedule.tile_schedule(cu_q, cu_k, 40, 30, block, None, AttentionFeatures())
    tiles = lists.query_tiles
    scalars = attention_triton._spec_arguments(spec)
    with interpreting():
        out, lse = _first_tile_only(q, k, v, lists, tiles, scalars, block, features, options)
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.isnan(out[block:]).all() and np.isnan(lse[:, block:]).all()
    ref_out, ref_lse = attention_reference(
        q, k, v, cu_q, cu_k, sliding_window=(None, 12), return_lse=True
    )
    tol = attention_tolerance(q, k, cu_q=cu_q, cu_k=cu_k)
    assert_close(out[:block], np.asarray(ref_out)[:block], tol, "first tile")
    assert_close(lse[:, :block], np.asarray(ref_lse)[:, :block], tol, "first tile lse")


def _first_tile_only(q, k, v, lists, tiles, scalars, block, features, options):
    return triton_call(
        q,
        k,
        v,
        lists.cu_q,
        lists.cu_k,
        tiles,
        float32_or_placeholder(None),
        float32_or_placeholder(None),
        40,
        tiles.shape[0],
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
        INPUT_PRECISION=triton_input_precision(options.precision, q.dtype),
        RAW_SCORE_MAX=True,
        PERSISTENT=False,
        **features.kernel_flags(),
    )


# --- the raw-score max ---------------------------------------------------


@pytest.mark.parametrize("softmax_scale", [-2.0, 3.0])
@pytest.mark.parametrize("causal", [False, True])
def test_large_scores_and_a_negative_scale(softmax_scale, causal):
    """Scores spanning hundreds of units: the forward's max taken on raw q.k (positive
    scale) or on the scaled scores (negative scale) must bound every score of its row,
    or exp2 overflows to inf/NaN. Output, lse and gradients against the reference."""
    inputs = make_inputs(57, [(37, 37), (20, 45)], 2, 1, 32)
    q, k, v, cu_q, cu_k = (inputs[n] for n in ("q", "k", "v", "cu_q", "cu_k"))
    q = q * 20.0  # |q.k| in the hundreds: scaled scores far beyond exp2's float32 range
    options = dict(causal=causal, softmax_scale=softmax_scale)

    def run(fn):
        return value_and_grads(fn, q, k, v, None, inputs["d_out"], inputs["d_lse"])

    got = run(
        lambda q, k, v, s: varlen_attention(
            q, k, v, cu_q, cu_k, implementation="triton", return_lse=True, **options
        )
    )
    want = oracle_value_and_grads(
        lambda q, k, v, s: attention_reference(q, k, v, cu_q, cu_k, return_lse=True, **options),
        q,
        k,
        v,
        None,
        inputs["d_out"],
        inputs["d_lse"],
    )
    # S ~ 3 * 20 * max|q.k| ~ 1e3 here: the tolerance grows with it (~6e-4, not 3e-5).
    tol = attention_tolerance(q, k, cu_q=cu_q, cu_k=cu_k, softmax_scale=softmax_scale)
    names = ("out", "lse", "dq", "dk", "dv")
    pairs = zip(names, (got[0], got[1], *got[2]), (want[0], want[1], *want[2]), strict=True)
    for name, g, w in pairs:
        assert np.isfinite(np.asarray(g)).all(), name
        assert_close(g, w, tol, name)


@pytest.mark.parametrize(
    "spare, tma, dq_atomic",
    [(0, False, False), (3, False, False), (0, True, False), (0, True, True), (0, "host", False),
     (0, "host", True)],
    ids=["spare0", "spare3", "spare0-tma", "spare0-tma-dq-atomic", "spare0-tma-host",
         "spare0-tma-host-dq-atomic"],
)  # fmt: skip
def test_persistent_programs_walk_the_tile_list(monkeypatch, spare, tma, dq_atomic):
    """More tile rows than programs (many short sequences, few spare programs): the
    kernels launch persistent programs, each walking its share of the tile list (with
    `tma`, building each tile's descriptors over its own sequence, or taking the launch's
    over the whole arrays; with `dq_atomic`, dK/dV adding each sequence's dQ shares in its
    own rows, through a descriptor it builds over them even beside the launch's);
    forward and gradients still match the reference."""
    if tma == "host":
        skip_unless_host_descriptors_launch()
    monkeypatch.setattr(schedule, "_SPARE_PROGRAMS", spare)
    lengths = [(n, n + 2) for n in (1, 5, 3, 17, 0, 2, 9, 4, 6, 1, 8, 3)]
    inputs = make_inputs(71, lengths, 2, 1, 32)
    q, k, v, cu_q, cu_k = (inputs[n] for n in ("q", "k", "v", "cu_q", "cu_k"))
    cu = jnp.asarray(cu_q)
    lists = schedule.tile_schedule(cu, cu, q.shape[0], q.shape[0], 16, None, AttentionFeatures())
    chunks = lists.query_tiles
    real_tiles = int((np.asarray(chunks)[:, 0] >= 0).sum())
    assert lists.persistent and schedule.persistent(cu.shape[0] + 3)
    assert schedule.programs(chunks.shape[0], q.shape[0], 16, True) <= real_tiles - 5
    options = dict(causal=True, return_lse=True)

    def run(fn):
        return value_and_grads(fn, q, k, v, None, inputs["d_out"], inputs["d_lse"])

    tile = AttentionKernelConfig(16, 16, tma=True, host_descriptors=tma == "host") if tma else None
    config = AttentionConfigs(tile, tile, tile, dq_atomic=dq_atomic)
    got = run(
        lambda q, k, v, s: varlen_attention(
            q, k, v, cu_q, cu_k, implementation="triton", config=config, **options
        )
    )
    want = oracle_value_and_grads(
        lambda q, k, v, s: attention_reference(q, k, v, cu_q, cu_k, **options),
        q,
        k,
        v,
        None,
        inputs["d_out"],
        inputs["d_lse"],
    )
    tol = attention_tolerance(q, k, cu_q=cu_q, cu_k=cu_k)
    names = ("out", "lse", "dq", "dk", "dv")
    pairs = zip(names, (got[0], got[1], *got[2]), (want[0], want[1], *want[2]), strict=True)
    for name, g, w in pairs:
        assert_close(g, w, tol, name)


@pytest.mark.parametrize(
    "constexpr, config, forward, dkdv",
    [
        ("WARP_SPECIALIZE", AttentionKernelConfig(16, 16, tma=True, warp_specialize=True),
         True, False),
        ("OVERLAP_SOFTMAX", AttentionKernelConfig(16, 16, overlap_softmax=True), True, True),
        ("HEAD_MAJOR", AttentionKernelConfig(16, 16, head_major=True), False, True),
    ],
    ids=["warp_specialize", "overlap_softmax", "head_major"],
)  # fmt: skip
def test_kernel_options_reach_only_the_kernels_that_take_them(
    monkeypatch, constexpr, config, forward, dkdv
):
    """One config for every kernel gives warp specialization to the forward alone, the
    softmax overlap to the forward and dK/dV, `head_major` to dK/dV alone (the gradient
    runs, its other kernels without it; the other kernels' own configs with them are
    refused where they are built, `test_configs_refuse_options_their_kernels_cannot_run`)."""
    inputs = make_inputs(43, [(20, 20)], 2, 1, 32)
    q, k, v, cu_q, cu_k = (inputs[n] for n in ("q", "k", "v", "cu_q", "cu_k"))

    def loss(q, config):
        out = varlen_attention(q, k, v, cu_q, cu_k, causal=True, implementation="triton",
                               config=config)  # fmt: skip
        return out.astype(jnp.float32).sum()

    launches = record_launches(monkeypatch, attention_triton)
    jax.grad(loss)(q, config)
    specialized = {
        launch.kernel.__name__: launch.constexprs.get(constexpr, False)
        for launch in launches
        if launch.kernel.__name__ != "attention_schedule_kernel"
    }
    assert specialized == {
        "attention_forward_kernel": forward,
        "attention_backward_dq_kernel": False,
        "attention_backward_dkdv_kernel": dkdv,
    }


def test_flash_attention_passes_its_config_to_the_kernels(monkeypatch):
    """The padded op's `config=` reaches every kernel of its gradient, as the packed op's."""
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 24, 2, 32)), jnp.float32) for _ in "qkv")
    config = AttentionKernelConfig(block_m=16, block_n=32, num_warps=2)
    launches = record_launches(monkeypatch, attention_triton)
    loss = lambda q: flash_attention(q, k, v, causal=True, config=config,
                                     implementation="triton").sum()  # fmt: skip
    jax.grad(loss)(q)
    kernels = [x for x in launches if x.kernel.__name__ != "attention_schedule_kernel"]
    assert {x.kernel.__name__ for x in kernels} == {
        "attention_forward_kernel", "attention_backward_dq_kernel",
        "attention_backward_dkdv_kernel",
    }  # fmt: skip
    for launch in kernels:
        blocks = (launch.constexprs["BLOCK_M"], launch.constexprs["BLOCK_N"], launch.num_warps)
        assert blocks == (16, 32, 2), launch.kernel.__name__


@needs_tensor_descriptors
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "not-causal"])
def test_warp_specialized_forward_gives_the_float64_numbers_on_a_hopper_gpu(causal):
    """The A/B row's warp-specialized forward (12 warps: a producer warpgroup, two
    consumers of 64 rows; 128x128 tiles) against the float64 oracle; the gradients too
    (the backward reads its output and lse)."""
    forward = AttentionKernelConfig(128, 128, 4, 2, tma=True, warp_specialize=True)
    config = AttentionConfigs(forward=forward)
    _assert_device_float64_numbers(jnp.bfloat16, causal, config)


@needs_tensor_descriptors
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "not-causal"])
def test_warp_specialized_dkdv_gives_the_float64_numbers_on_a_hopper_gpu(causal):
    """The A/B row's warp-specialized dK/dV (12 warps: a producer warpgroup, two
    consumers of 64 keys; 64-query steps) against the float64 oracle."""
    dkdv = AttentionKernelConfig(*WARP_SPECIALIZED_DKDV_TILE, tma=True, warp_specialize=True)
    _assert_device_float64_numbers(jnp.bfloat16, causal, AttentionConfigs(backward_dkdv=dkdv))


def test_tma_needs_a_power_of_two_head_dim_and_a_hopper_gpu():
    inputs = make_inputs(5, [(20, 20)], 2, 1, 48)
    q, k, v, cu_q, cu_k = (inputs[n] for n in ("q", "k", "v", "cu_q", "cu_k"))
    config = AttentionConfigs(forward=AttentionKernelConfig(16, 16, tma=True))
    with pytest.raises(ValueError, match=r"varlen_attention: config tma=True.*power of two.*48"):
        varlen_attention(q, k, v, cu_q, cu_k, implementation="triton", config=config)
    q, k, v = (x[..., :32] for x in (q, k, v))
    with pytest.raises(ValueError, match=r"varlen_attention: config tma=True.*9\.0.*8\.0"):
        lower_for_cuda(
            lambda q, k, v: varlen_attention(
                q, k, v, cu_q, cu_k, implementation="triton", config=config
            ),
            q, k, v, compute_capability=80,
        )  # fmt: skip
