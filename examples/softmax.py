"""Row-wise fused softmax: the smallest real kernel, used to prove the launch paths."""

import triton
import triton.language as tl


@triton.jit
def softmax_rows_kernel(
    x_ptr,
    num_cols,
    out_ptr,
    BLOCK_COLS: tl.constexpr,
):
    """out[r, :] = softmax(x[r, :]); one program per row; x, out: [num_rows, num_cols].

    Requires BLOCK_COLS >= num_cols (one block holds the whole row). Accumulates in float32
    whatever the storage type, and a row of all -inf gives zeros, not NaN.
    """
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_COLS)
    in_row = cols < num_cols
    offsets = row.to(tl.int64) * num_cols + cols
    x = tl.load(x_ptr + offsets, mask=in_row, other=-float("inf")).to(tl.float32)
    row_max = tl.max(x, axis=0)
    # A row of all -inf keeps its max at -inf; shifting by 0 then gives exp(-inf) = 0.
    shift = tl.where(row_max == -float("inf"), 0.0, row_max)
    e = tl.exp(x - shift)
    total = tl.sum(e, axis=0)
    inv = tl.where(total > 0, 1.0 / total, 0.0)
    tl.store(out_ptr + offsets, (e * inv).to(out_ptr.dtype.element_ty), mask=in_row)


def softmax_block_cols(num_cols: int) -> int:
    """The block width for a row of `num_cols` (next power of two, at least 16)."""
    return max(16, triton.next_power_of_2(num_cols))
