"""The program-conflict check of interpreted launches (`jax_bridge.launch.program_conflicts`)
finds exactly the accesses whose result depends on the order of a launch's programs.

Oracle: each kernel's conflicts are stated by construction (which programs store, read or
atomically update which elements), for every program count and offset hypothesis draws:
(a) programs storing to disjoint elements, including neighbouring bytes of one word and
    lanes that another program touches only with masked-off lanes, pass;
(b) two programs storing to one element are reported with that element, its buffer and
    both programs; one program storing to it twice is not, with a barrier between (and is
    without one: its threads are not ordered either);
(c) a program reading an element another program stores to is reported; reading its own
    is not, after a barrier;
(d) atomic adds from every program pass (and sum correctly); a plain read or store of an
    atomically updated element from another program is reported;
(e) a store into an input, or a load past the end of every buffer, is reported;
(f) through `triton_call`, an aliased input is the output's buffer, as on a GPU: a program
    reading the input where another stores the output is reported;
(g) `set_checking` switches it for the process, and a checked launch leaves the
    interpreter as it found it, a failing one too;
(h) property: for any programs' read / store / atomic byte sets, a launch is reported iff
    two programs race on some byte (a brute-force loop over pairs is the oracle), and
    the pair reported is such a pair.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl
from hypothesis import given
from hypothesis import strategies as st
from triton.runtime import interpreter as triton_interpreter

from jax_bridge import triton_call
from jax_bridge.launch import program_conflicts
from jax_bridge.launch.interpreter import run_interpreted
from jax_bridge.launch.program_conflicts import ProgramConflictError
from jax_bridge.launch.target import interpreting


@pytest.fixture(autouse=True)
def _checked_on_the_interpreter():
    with interpreting(), program_conflicts.program_conflicts_checked():
        yield


@triton.jit
def _store_blocks(x_ptr, out_ptr, STRIDE: tl.constexpr, BLOCK: tl.constexpr):
    """Program p stores x[p*STRIDE : p*STRIDE + BLOCK] + p to the same elements of out."""
    p = tl.program_id(0)
    offsets = p * STRIDE + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets) + p)


def _blocks(programs: int, stride: int, block: int, dtype=np.float32) -> tuple[list, list]:
    size = (programs - 1) * stride + block
    x = np.random.default_rng(programs).standard_normal(size).astype(dtype)
    return [x], [np.zeros(size, dtype)]


@given(programs=st.integers(1, 6), block=st.sampled_from([1, 2, 8]))
def test_disjoint_stores_pass_and_store_every_block(programs, block):
    args, outputs = _blocks(programs, block, block)
    run_interpreted(_store_blocks, (programs,), args, outputs, dict(STRIDE=block, BLOCK=block))
    expected = args[0] + np.repeat(np.arange(programs), block).astype(np.float32)
    np.testing.assert_array_equal(outputs[0], expected)


@pytest.mark.parametrize("dtype", [np.int8, jnp.bfloat16])
def test_neighbouring_bytes_of_one_word_are_not_shared(dtype):
    # One-element blocks: programs 0..3 store the four bytes (or two halves) of a word.
    args, outputs = _blocks(4, 1, 1, np.dtype(dtype))
    run_interpreted(_store_blocks, (4,), args, outputs, dict(STRIDE=1, BLOCK=1))


@given(programs=st.integers(2, 6), overlap=st.integers(1, 4))
def test_overlapping_stores_are_reported_with_element_and_programs(programs, overlap):
    block = 8
    args, outputs = _blocks(programs, block - overlap, block)
    with pytest.raises(ProgramConflictError) as error:
        run_interpreted(
            _store_blocks, (programs,), args, outputs, dict(STRIDE=block - overlap, BLOCK=block)
        )
    # The lowest shared element: program 0's last `overlap` ones, program 1's first.
    first = block - overlap
    assert f"out_ptr[{first}]" in str(error.value)
    assert "programs (0, 0, 0) and (1, 0, 0) store to" in str(error.value)
    assert "_store_blocks" in str(error.value)


@triton.jit
def _store_twice(out_ptr, BLOCK: tl.constexpr, BARRIER: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, offsets.to(tl.float32))
    if BARRIER:
        tl.debug_barrier()
    tl.store(out_ptr + offsets, offsets.to(tl.float32) * 2)


def test_one_program_storing_twice_needs_a_barrier_between():
    out = np.zeros(24, np.float32)
    run_interpreted(_store_twice, (3,), [], [out], dict(BLOCK=8, BARRIER=True))
    np.testing.assert_array_equal(out, np.arange(24, dtype=np.float32) * 2)
    with pytest.raises(ProgramConflictError, match=r"program \(0, 0, 0\) stores to out_ptr\[0\]"):
        run_interpreted(_store_twice, (3,), [], [out], dict(BLOCK=8, BARRIER=False))


@triton.jit
def _masked_overlap(out_ptr, BLOCK: tl.constexpr):
    """Program p's lanes cover [p * (BLOCK - 1) - 1, ...), its first lane masked off: that
    lane points at program p - 1's last element, which no other program touches."""
    p = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    offsets = p * (BLOCK - 1) - 1 + lanes
    keep = lanes >= 1
    tl.load(out_ptr + offsets, mask=keep)
    tl.store(out_ptr + offsets, p.to(tl.float32), mask=keep)


def test_masked_off_lanes_touch_nothing():
    out = np.zeros(32, np.float32)
    run_interpreted(_masked_overlap, (4,), [], [out], dict(BLOCK=8))


@triton.jit
def _read_neighbour(
    out_ptr, BLOCK: tl.constexpr, NEIGHBOUR: tl.constexpr, BARRIER: tl.constexpr = True
):
    """Program p stores its block, then (after a barrier) reads block p + NEIGHBOUR
    (wrapping)."""
    p = tl.program_id(0)
    n = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    tl.store(out_ptr + p * BLOCK + lanes, p.to(tl.float32) + lanes)
    if BARRIER:
        tl.debug_barrier()
    seen = tl.load(out_ptr + ((p + NEIGHBOUR) % n) * BLOCK + lanes)
    tl.store(out_ptr + p * BLOCK + lanes, seen + 1)


@pytest.mark.parametrize("neighbour, conflict", [(0, False), (1, True)])
def test_reading_what_another_program_stores_is_reported(neighbour, conflict):
    out = np.zeros(32, np.float32)
    constexprs = dict(BLOCK=8, NEIGHBOUR=neighbour)
    if not conflict:
        run_interpreted(_read_neighbour, (4,), [], [out], constexprs)
        with pytest.raises(ProgramConflictError, match="with no barrier between"):
            run_interpreted(_read_neighbour, (4,), [], [out], {**constexprs, "BARRIER": False})
        return
    with pytest.raises(ProgramConflictError, match=r"read / store to out_ptr\[0\]"):
        run_interpreted(_read_neighbour, (4,), [], [out], constexprs)


@triton.jit
def _add_to_total(x_ptr, total_ptr, BLOCK: tl.constexpr, ALSO: tl.constexpr):
    """Every program adds its block's sum to total[0]; ALSO = 1: program 0 then reads
    total[0], 2: program 0 stores to it."""
    p = tl.program_id(0)
    tl.atomic_add(total_ptr, tl.sum(tl.load(x_ptr + p * BLOCK + tl.arange(0, BLOCK))))
    if ALSO == 1:
        if p == 0:
            tl.store(total_ptr + 1, tl.load(total_ptr))
    if ALSO == 2:
        if p == 0:
            tl.store(total_ptr, 0.0)


@pytest.mark.parametrize("also, message", [(0, None), (1, "read / atomically update"),
                                           (2, "store to / atomically update")])  # fmt: skip
def test_atomics_from_every_program_pass_alone(also, message):
    x = np.random.default_rng(3).standard_normal(4 * 8).astype(np.float32)
    total = np.zeros(2, np.float32)
    constexprs = dict(BLOCK=8, ALSO=also)
    if message is None:
        run_interpreted(_add_to_total, (4,), [x], [total], constexprs)
        np.testing.assert_allclose(total[0], x.astype(np.float64).sum(), rtol=1e-5)
        return
    with pytest.raises(ProgramConflictError, match=rf"{message} total_ptr\[0\]"):
        run_interpreted(_add_to_total, (4,), [x], [total], constexprs)


@triton.jit
def _store_into_input(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets) * 2)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets))


def test_a_store_into_an_input_is_reported():
    x = np.arange(16, dtype=np.float32)
    with pytest.raises(ProgramConflictError, match="outside every output buffer"):
        run_interpreted(_store_into_input, (2,), [x], [np.zeros(16, np.float32)], dict(BLOCK=8))


def test_a_load_past_an_inputs_end_is_reported():
    # The input is the first 12 elements of a longer array: elements 12..15 exist on the
    # host, but a kernel reading them reads past its buffer.
    host = np.random.default_rng(11).standard_normal(16).astype(np.float32)
    args, outputs = [host[:12]], [np.zeros(16, np.float32)]
    with pytest.raises(ProgramConflictError, match=r"program \(1, 0, 0\) reads address"):
        run_interpreted(_store_blocks, (2,), args, outputs, dict(STRIDE=8, BLOCK=8))


@triton.jit
def _shift_in_place(x_ptr, out_ptr, BLOCK: tl.constexpr):
    """out = x shifted by one block (program p stores block p from input block p - 1)."""
    p = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    source = tl.maximum(p - 1, 0) * BLOCK + lanes
    tl.store(out_ptr + p * BLOCK + lanes, tl.load(x_ptr + source))


def test_an_aliased_input_is_the_output_buffer():
    x = jnp.asarray(np.random.default_rng(5).standard_normal(32), jnp.float32)
    out_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)

    def call(aliases):
        return triton_call(
            x, kernel=_shift_in_place, out_shape=out_shape, grid=(4,),
            input_output_aliases=aliases, BLOCK=8,
        )  # fmt: skip

    np.testing.assert_array_equal(call(None)[8:], x[:-8])  # two buffers: no conflict
    with pytest.raises(Exception, match=r"read / store to out_ptr\[0\]"):
        call({0: 0})


def test_the_switch_and_the_interpreter_left_as_found():
    builder = triton_interpreter.InterpreterBuilder
    names = ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas",
             "create_barrier")  # fmt: skip
    before = {name: vars(builder)[name] for name in names}
    out = np.zeros(8, np.float32)
    with pytest.raises(ProgramConflictError):
        run_interpreted(_store_blocks, (2,), [np.ones(8, np.float32)], [out],
                        dict(STRIDE=0, BLOCK=8))  # fmt: skip
    assert {name: vars(builder)[name] for name in names} == before
    with program_conflicts.program_conflicts_checked():
        pass
    previous = program_conflicts.set_checking(False)
    try:
        assert not program_conflicts.checking()
        run_interpreted(_store_blocks, (2,), [np.ones(8, np.float32)], [out],
                        dict(STRIDE=0, BLOCK=8))  # fmt: skip
    finally:
        program_conflicts.set_checking(previous)
    assert program_conflicts.checking()


_KINDS = ("read", "store", "atomic")
_RACING = {("store", "store"), ("store", "atomic"), ("read", "store"), ("read", "atomic")}


@given(
    st.lists(
        st.tuples(*(st.sets(st.integers(0, 7), max_size=4) for _ in _KINDS)),
        min_size=1,
        max_size=4,
    )
)
def test_the_verdict_is_that_of_every_pair_of_programs(accesses):
    """Invariant: a launch is reported iff some byte is touched by two programs p != q
    as (store, store), (store, atomic) or (read, store / atomic) in either order; the
    reported pair is such a pair. `accesses[p]`: program p's (read, store, atomic) bytes
    of an 8-byte buffer, logged in several pieces as a kernel would."""
    buffer = np.zeros(8, np.uint8)
    log = program_conflicts._AccessLog([program_conflicts.Buffer("out_ptr", buffer)])
    for p, sets in enumerate(accesses):
        for kind, offsets in zip(_KINDS, sets, strict=True):
            for piece in (sorted(offsets)[::2], sorted(offsets)[1::2], sorted(offsets)):
                addresses = np.asarray(piece, np.uint64) + np.uint64(buffer.ctypes.data)
                log.record(kind, (p, 0, 0), addresses)
                log.barrier()  # within a program, any order (the test above)

    def touches(p, kind, byte):
        return byte in accesses[p][_KINDS.index(kind)]

    def racing(p, q, byte):
        pairs = [*_RACING, *((b, a) for a, b in _RACING)]
        return p != q and any(touches(p, a, byte) and touches(q, b, byte) for a, b in pairs)

    programs = range(len(accesses))
    expected = any(racing(p, q, b) for p in programs for q in programs for b in range(8))
    try:
        program_conflicts._Checker("kernel", log).check()
    except ProgramConflictError as error:
        assert expected, str(error)
        found = re.search(r"programs \((\d+), 0, 0\) and \((\d+), 0, 0\) .* out_ptr\[(\d+)\]",
                          str(error))  # fmt: skip
        p, q, byte = map(int, found.groups())
        assert racing(p, q, byte), str(error)
    else:
        assert not expected
