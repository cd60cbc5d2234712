"""The compile targets, `compile_for`'s contract and report, and the rule that a kernel
follows the platform its program is compiled for, not the host."""

import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

import jax_bridge as jb
from jax_bridge.aot import targets as targets_lib
from jax_bridge.aot.compile import parse_compiled_text
from tests.aot.helpers import needs_libtpu, spec
from tests.attention.helpers import assert_close, attention_tolerance
from tests.devices import TPU_COMPILES, cpu_only


@given(count=st.integers(1, 512), name=st.sampled_from(["tpu-v5e", "tpu-v5p", "tpu-v6e"]))
def test_tpu_topology_is_the_smallest_power_of_two_slice_that_holds_count(count, name):
    target = jb.TARGETS[name]
    topology = targets_lib._tpu_topology_name(target, count)
    version, shape = topology.split(":")
    sides = [int(s) for s in shape.split("x")]
    chips = math.prod(sides)
    assert version == target.tpu_version and len(sides) == target.torus_dims
    # Enough chips, and no smaller power of two (of at least one 4-chip host) would do.
    assert chips >= count and chips == max(4, 1 << math.ceil(math.log2(count)))
    assert all(s & (s - 1) == 0 for s in sides)
    assert max(sides) <= 2 * min(s for s in sides if s > 1)  # as even as the torus allows
    assert 1 not in sides[:-1]  # libtpu takes "2x2x1", not "1x2x2"


@given(count=st.integers(1, 256))
def test_gpu_topology_has_hosts_of_up_to_eight(count):
    slices, hosts, per_host = map(int, targets_lib._gpu_topology(count).split("x"))
    assert slices == 1 and 1 <= per_host <= 8 and hosts * per_host >= count
    assert (hosts - 1) * per_host < count  # no host more than needed


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=needs_libtpu if n.startswith("tpu") else ()) for n in jb.TARGETS]
)
def test_target_devices_and_mesh(name):
    target = jb.TARGETS[name]
    devices = jb.target_devices(name, 4)
    assert len(set(devices)) == 4
    platform = {"cuda": "gpu"}.get(target.platform, target.platform)
    assert {d.platform for d in devices} == {platform}
    if target.compute_capability is not None:
        assert devices[0].compute_capability == f"{target.compute_capability // 10}.0"
    mesh = jb.target_mesh(name, {"data": 2, "model": 2})
    assert mesh.shape == {"data": 2, "model": 2}
    assert set(mesh.devices.flat) == set(devices)


def test_bad_targets_and_meshes_are_refused_with_their_name():
    with pytest.raises(ValueError, match="target must be one of"):
        jb.compile_for(jnp.sin, spec((4,), jnp.float32), target="h200x")
    for count in (0, True):
        with pytest.raises(ValueError, match="count must be a positive int"):
            jb.target_devices("h100", count)
    with pytest.raises(ValueError, match="axis_sizes"):
        jb.target_mesh("h100", {"data": 0})
    cpu_mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    with pytest.raises(ValueError, match="compile_for: mesh holds devices that are not"):
        jb.compile_for(jnp.sin, spec((4,), jnp.float32), target="h100", mesh=cpu_mesh)
    # Another GPU's mesh: its devices would get sm_90 kernels.
    a100_mesh = jb.target_mesh("a100", {"data": 2})
    with pytest.raises(ValueError, match="compile_for: mesh holds devices that are not h100's"):
        jb.compile_for(jnp.sin, spec((4,), jnp.float32), target="h100", mesh=a100_mesh)
    with pytest.raises(TypeError, match=r"compile_for: mesh must be a jax\.sharding\.Mesh"):
        jb.compile_for(jnp.sin, spec((4,), jnp.float32), target="h100", mesh="data")
    with pytest.raises(ValueError, match="estimate_cycles is for TPU targets"):
        jb.compile_for(jnp.sin, spec((4,), jnp.float32), target="a100", estimate_cycles=True)
    # Refused before compiling: libtpu would abort the compiling process.
    with pytest.raises(ValueError, match="estimate_cycles is not available for 'tpu-v5e'"):
        jb.compile_for(jnp.sin, spec((4,), jnp.float32), target="tpu-v5e", estimate_cycles=True)
    with pytest.raises(TypeError, match="target must be a target name"):
        jb.compile_for(jnp.sin, spec((4,), jnp.float32), target=["h100"])


def test_report_counts_bytes_kernels_and_collectives():
    mesh = jb.target_mesh("h100", {"data": 4})
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    x = jax.ShapeDtypeStruct((4096, 256), jnp.float32, sharding=sharded)
    program = jb.compile_for(lambda x: jnp.sum(jnp.tanh(x) @ x.T), x, target="h100")
    report = program.report
    assert report.target == "h100" and report.devices == 4
    assert report.argument_bytes == 4096 * 256 * 4 // 4  # one shard per device
    assert (
        report.collectives.get("all-reduce", 0) >= 1 or report.collectives.get("all-gather", 0) >= 1
    )
    assert report.total_bytes >= report.argument_bytes
    assert report.kernels == ()  # no kernels of ours in plain XLA
    assert "HloModule" in program.as_text()


def test_an_already_jitted_function_keeps_its_donation():
    x = jax.ShapeDtypeStruct((1024, 256), jnp.float32)
    step = lambda x: jnp.tanh(x) * 2
    donated = jb.compile_for(jax.jit(step, donate_argnums=0), x, target="h100").report
    plain = jb.compile_for(step, x, target="h100").report
    assert donated.alias_bytes == 1024 * 256 * 4 and plain.alias_bytes == 0
    assert donated.total_bytes == plain.total_bytes - 1024 * 256 * 4
    with pytest.raises(ValueError, match="static_argnames"):
        jb.compile_for(jax.jit(step), x, target="h100", static_argnames=("y",))


def test_parse_compiled_text_reads_root_and_plain_instructions():
    text = "\n".join(
        [
            '  %a = f32[4] custom-call(f32[4] %x), custom_call_target="tpu_custom_call"',
            '  ROOT %b.2 = f32[4] custom-call(f32[4] %a), custom_call_target="tpu_custom_call"',
            '  %c = f32[4] custom-call(f32[4] %x), custom_call_target="Sharding"',
            "  %d = f32[4] all-reduce(f32[4] %x), replica_groups={}",
            "  %e = (f32[4], f32[4]) all-gather-start(f32[4] %x), dimensions={0}",
        ]
    )
    calls, kernels, collectives = parse_compiled_text(text)
    assert calls == {"Sharding": 1, "tpu_custom_call": 2}
    assert kernels == ("a", "b.2")
    assert collectives == {"all-gather": 1, "all-reduce": 1}


def _attention(implementation="auto"):
    def program(q, k, v, cu):
        return jb.varlen_attention(q, k, v, cu, cu, causal=True, implementation=implementation)

    return program


def _qkv(dtype=jnp.float32, tokens=256):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((tokens, 2, 128)), dtype) for _ in "qkv")
    return q, k, v, jnp.asarray([0, 100, tokens], jnp.int32)


@needs_libtpu
def test_pallas_follows_the_compile_target_not_the_host():
    """One function, default options: interpreted on this CPU (and right), Mosaic kernels
    when its arguments are on TPU devices, through plain jax.jit."""
    q, k, v, cu = _qkv()
    program = jax.jit(_attention("pallas"))
    expected = jb.attention_reference(q, k, v, cu, cu, causal=True)
    # Two float32 runs (the op, its reference), each within tol of the float64 oracle.
    assert_close(program(q, k, v, cu), expected, 2 * attention_tolerance(q, k), "out")

    device = jb.target_devices("tpu-v6e")[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in (q, k, v, cu)]
    compiled = program.trace(*args).lower().compile()
    calls, kernels, _ = parse_compiled_text(compiled.as_text())
    assert calls.get("tpu_custom_call", 0) == 1 and len(kernels) == 1


def test_auto_picks_the_target_kernels_under_compile_for():
    args = [spec((256, 2, 128), jnp.bfloat16)] * 3 + [spec((3,), jnp.int32)]
    gpu = jb.compile_for(_attention(), *args, target="h100").report
    assert gpu.custom_calls.get("triton_kernel_call", 0) == 2  # the tile schedule, the forward
    if TPU_COMPILES:
        tpu = jb.compile_for(_attention(), *args, target="tpu-v6e").report
        assert tpu.custom_calls.get("tpu_custom_call", 0) == 1
    # The same function still runs here, on the host's backend.
    q, k, v, cu = _qkv()
    expected = jb.attention_reference(q, k, v, cu, cu, causal=True)
    got = jax.jit(_attention())(q, k, v, cu)
    assert_close(got, expected, 2 * attention_tolerance(q, k), "out")  # as above


@cpu_only("on a GPU host a plain lowering is for its own device")
def test_triton_traced_on_this_host_refuses_a_plain_gpu_lowering_with_directions():
    device = jb.target_devices("h100")[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct((256, 2, 128), jnp.bfloat16, sharding=sharding)] * 3
    args.append(jax.ShapeDtypeStruct((3,), jnp.int32, sharding=sharding))
    with pytest.raises(RuntimeError, match="compile_for"):
        jax.jit(_attention("triton")).trace(*args).lower()
    # cuda_lowering names the compute capability: then a plain lowering works.
    with jb.cuda_lowering(90):
        lowered = jax.jit(_attention("triton")).trace(*args).lower()
    assert "triton_kernel_call" in lowered.as_text()


@needs_libtpu
def test_estimated_cycles_of_a_tpu_kernel():
    q = spec((2, 512, 128), jnp.bfloat16)
    from pallas_tpu import splash

    kernel = splash.make_splash_mha(splash.FullMask((512, 512)), interpret=None)
    report = jb.compile_for(kernel, q, q, q, target="tpu-v6e", estimate_cycles=True).report
    assert set(report.estimated_cycles) == set(report.kernels) and len(report.kernels) == 1
    assert all(c > 0 for c in report.estimated_cycles.values())


@pytest.mark.parametrize("name", ["h100", "a100"])
def test_plain_jit_over_a_gpu_mesh_compiles_the_triton_kernels(name):
    """Arguments on a mesh of compile-only GPUs name their kind at trace time: a plain
    jax.jit then traces the Triton kernels for that GPU's compute capability."""
    mesh = jb.target_mesh(name, {"data": 1})
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = [jax.ShapeDtypeStruct((256, 2, 128), jnp.bfloat16, sharding=sharding)] * 3
    args.append(jax.ShapeDtypeStruct((3,), jnp.int32, sharding=sharding))

    def loss(q, k, v, cu):
        return jnp.sum(_attention("triton")(q, k, v, cu).astype(jnp.float32))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower().compile()
    calls, kernels, _ = parse_compiled_text(compiled.as_text())
    assert calls.get("triton_kernel_call", 0) >= 3 and len(kernels) >= 3, calls
