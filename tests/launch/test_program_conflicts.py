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
(d) atomic adds (or maxima) from every program pass (and sum correctly); a plain read or
    store of an atomically updated element from another program is reported, and so are
    atomics whose result depends on the order (exchange, compare-and-swap, two different
    operations, `scope="cta"`) and atomic loads of what others update; within one
    program, atomics and plain accesses of the same bytes need a barrier between, and one
    store's lanes must not put two values in one element;
(e) a store into an input, or a load past the end of every buffer, is reported, before
    it runs (a load far past every buffer would crash the process, a store past an
    output's end overwrite the host memory beside it);
(f) through `triton_call`, an aliased input is the output's buffer, as on a GPU: a program
    reading the input where another stores the output is reported;
(g) `set_checking` switches it for the process, and a checked launch leaves the
    interpreter as it found it, a failing one too;
(h) property: for any programs' read / store / atomic add / atomic max byte sets, a
    launch is reported iff two programs race on some byte (a brute-force loop over pairs
    is the oracle), and the pair reported is such a pair.
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
    tl.debug_barrier()  # the conflicts below are between programs, not within one
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


@triton.jit
def _lanes_to_halves(out_ptr, BLOCK: tl.constexpr, SAME: tl.constexpr):
    """One store whose lanes 2k and 2k + 1 both write out[k]: the lane's index, or
    (SAME) one value for both."""
    lanes = tl.arange(0, BLOCK)
    values = (lanes // 2 if SAME else lanes).to(tl.float32)
    tl.store(out_ptr + lanes // 2, values)


@pytest.mark.parametrize("same", [True, False])
def test_one_store_putting_two_values_in_an_element_is_reported(same):
    out = np.zeros(4, np.float32)
    if same:
        run_interpreted(_lanes_to_halves, (1,), [], [out], dict(BLOCK=8, SAME=True))
        np.testing.assert_array_equal(out, np.arange(4))
        return
    with pytest.raises(ProgramConflictError, match=r"stores two values to out_ptr\[0\].* in one"):
        run_interpreted(_lanes_to_halves, (1,), [], [out], dict(BLOCK=8, SAME=False))


@triton.jit
def _order_dependent_atomics(out_ptr, OP: tl.constexpr):
    """Every program applies OP to out[0]: each result but a commuting sum or max depends
    on the programs' order (or, scope="cta", is atomic within one program only)."""
    p = tl.program_id(0)
    if OP == "xchg":
        tl.atomic_xchg(out_ptr, p + 1)
    elif OP == "cas":
        tl.atomic_cas(out_ptr, 0, p + 1)
    elif OP == "cta add":
        tl.atomic_add(out_ptr, 1, scope="cta")
    elif OP == "add or max":
        if p == 0:
            tl.atomic_max(out_ptr, 5)
        else:
            tl.atomic_add(out_ptr, 1)
    elif OP == "max":
        tl.atomic_max(out_ptr, p)


@pytest.mark.parametrize(
    "op, message",
    [("xchg", "store to"), ("cas", "store to"), ("cta add", "store to"),
     ("add or max", r"atomically update \(ADD / MAX\)"), ("max", None)],
)  # fmt: skip
def test_atomics_whose_result_depends_on_the_order_are_reported(op, message):
    out = np.zeros(1, np.int32)
    if message is None:
        run_interpreted(_order_dependent_atomics, (3,), [], [out], dict(OP=op))
        assert out[0] == 2
        return
    with pytest.raises(ProgramConflictError, match=rf"programs .* {message} out_ptr\[0\]"):
        run_interpreted(_order_dependent_atomics, (3,), [], [out], dict(OP=op))
    run_interpreted(_order_dependent_atomics, (1,), [], [np.zeros(1, np.int32)], dict(OP=op))


@triton.jit
def _atomic_then_access(x_ptr, hist_ptr, out_ptr, BLOCK: tl.constexpr, ORDER: tl.constexpr):
    """A histogram of x by atomic adds, then (ORDER "load") its bins read, or (ORDER
    "store") the bins stored first and then added to; a barrier between where BARRIER."""
    lanes = tl.arange(0, BLOCK)
    bins = tl.load(x_ptr + lanes)
    if ORDER == "store first":
        tl.store(hist_ptr + lanes % 4, lanes % 4)
    if ORDER == "store first, barrier":
        tl.store(hist_ptr + lanes % 4, lanes % 4)
        tl.debug_barrier()
    tl.atomic_add(hist_ptr + bins, 1)
    if ORDER == "barrier, load":
        tl.debug_barrier()
    if ORDER != "store first" and ORDER != "store first, barrier":
        tl.store(out_ptr + lanes, tl.load(hist_ptr + lanes % 4))


@pytest.mark.parametrize(
    "order, reported",
    [("load", "reads hist_ptr"), ("barrier, load", None), ("store first", "atomically updates"),
     ("store first, barrier", None)],
)  # fmt: skip
def test_one_programs_atomics_and_plain_accesses_need_a_barrier_between(order, reported):
    x = np.random.default_rng(7).integers(0, 4, 8).astype(np.int32)
    outputs = [np.zeros(4, np.int32), np.zeros(8, np.int32)]
    run = lambda: run_interpreted(_atomic_then_access, (1,), [x], outputs,
                                  dict(BLOCK=8, ORDER=order))  # fmt: skip
    if reported is None:
        run()
        counts = np.bincount(x, minlength=4)
        expected = counts + (np.arange(4) if "store" in order else 0)
        np.testing.assert_array_equal(outputs[0], expected)
        return
    with pytest.raises(ProgramConflictError, match=rf"{reported}.* no barrier between"):
        run()


@pytest.mark.skipif(not hasattr(tl, "atomic_load"), reason="tl.atomic_load: Triton >= 3.7")
def test_atomic_loads_are_reads():
    """An atomic load reads: of an input it is fine, of what another program adds it is a
    conflict (its value depends on the order)."""

    @triton.jit
    def kernel(x_ptr, count_ptr, out_ptr, OF_COUNT: tl.constexpr):
        p = tl.program_id(0)
        if OF_COUNT:
            if p == 0:
                tl.atomic_add(count_ptr, 1)
            else:
                tl.store(out_ptr + p, tl.atomic_load(count_ptr))
        else:
            tl.store(out_ptr + p, tl.atomic_load(x_ptr))

    args = [np.full(1, 3, np.int32)]
    out = [np.zeros(1, np.int32), np.zeros(2, np.int32)]
    run_interpreted(kernel, (2,), args, out, dict(OF_COUNT=False))
    np.testing.assert_array_equal(out[1], [3, 3])
    with pytest.raises(ProgramConflictError, match=r"read / atomically update count_ptr\[0\]"):
        run_interpreted(kernel, (2,), args, out, dict(OF_COUNT=True))


@triton.jit
def _store_a_block(x_ptr, out_ptr, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    """out[:BLOCK] = x[OFFSET : OFFSET + BLOCK] (OFFSET may lie far past x)."""
    lanes = tl.arange(0, BLOCK)
    tl.store(out_ptr + lanes, tl.load(x_ptr + (tl.full([BLOCK], OFFSET, tl.int64) + lanes)))


def test_a_stray_access_is_refused_before_it_runs():
    """A load far past every buffer (which would crash the process) and a store past an
    output's end (which would overwrite the host memory beside it) raise before they run."""
    x = np.ones(4, np.float32)
    with pytest.raises(ProgramConflictError, match="reads address"):
        run_interpreted(_store_a_block, (1,), [x], [np.zeros(1, np.float32)],
                        dict(OFFSET=1 << 40, BLOCK=1))  # fmt: skip
    host = np.zeros(16, np.float32)
    out, beside = host[:4], host[4:]
    with pytest.raises(ProgramConflictError, match=r"stores to address .* outside every output"):
        run_interpreted(_store_a_block, (1,), [np.ones(8, np.float32)], [out],
                        dict(OFFSET=0, BLOCK=8))  # fmt: skip
    np.testing.assert_array_equal(beside, 0)


_KINDS = ("read", "store", "atomic ADD", "atomic MAX")
_RACING = {
    ("store", "store"), ("read", "store"), ("atomic ADD", "atomic MAX"),
    *((plain, atomic) for plain in ("read", "store") for atomic in _KINDS[2:]),
}  # fmt: skip


@given(
    st.lists(
        st.tuples(*(st.sets(st.integers(0, 7), max_size=4) for _ in _KINDS)),
        min_size=1,
        max_size=4,
    )
)
def test_the_verdict_is_that_of_every_pair_of_programs(accesses):
    """Invariant: a launch is reported iff some byte is touched by two programs p != q
    as (store, store), (store, atomic), (read, store / atomic) or by two different
    atomic operations, in either order; the reported pair is such a pair. `accesses[p]`:
    program p's (read, store, atomic add, atomic max) bytes of an 8-byte buffer, logged
    in several pieces as a kernel would."""
    buffer = np.zeros(8, np.uint8)
    log = program_conflicts._AccessLog("kernel", [program_conflicts.Buffer("out_ptr", buffer)])
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
        program_conflicts._Checker(log).check()
    except ProgramConflictError as error:
        assert expected, str(error)
        found = re.search(r"programs \((\d+), 0, 0\) and \((\d+), 0, 0\) .* out_ptr\[(\d+)\]",
                          str(error))  # fmt: skip
        p, q, byte = map(int, found.groups())
        assert racing(p, q, byte), str(error)
    else:
        assert not expected
