"""Segment (document) ids of packed token rows: which document each position belongs to.

Per row, ``seg[i]`` is the number of EOS tokens strictly before position ``i`` in the row, so an EOS
token belongs to the document it ends and every row starts at 0. Attention and evaluation use the ids
to keep documents apart. This is the numpy implementation; the training loader's native kernel
(:mod:`marin.data.native`) writes the same ids while it copies the windows, and falls back to this.
"""

from __future__ import annotations

import numpy as np


def segment_ids_from_eos(tokens: np.ndarray, eos_id: int, scratch: np.ndarray | None = None) -> np.ndarray:
    """Document index within each row of ``tokens`` [rows, length] (int32, a new array).

    Every row's last position is treated as a run end as well as every EOS, so each run lies inside
    one row and its value (EOS tokens before it in its row) is known per run; one ``np.repeat`` then
    writes the final ids. Forcing that boundary is harmless: a document break after a row's last token
    affects no position of that row, and the next row restarts at 0 anyway. What remains is the EOS
    scan (``==`` into ``scratch`` when given, a bool array of the tokens' shape, then ``flatnonzero``)
    and the repeat's single write of the output; on fresh batches both are dominated by a branch
    mispredict per EOS, which no vectorized numpy formulation tried avoids (cumsum and SWAR-style
    prefix counts are slower; see docs/performance.md).
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")
    b_rows, n = tokens.shape
    if b_rows == 0 or n == 0:
        return np.zeros((b_rows, n), dtype=np.int32)
    ends = np.equal(tokens, eos_id, out=scratch)
    ends[:, -1] = True
    q = np.flatnonzero(ends)  # run i covers (q[i-1], q[i]]; q[-1] is the last position of the batch
    lengths = np.empty(q.size, dtype=np.intp)
    lengths[0] = q[0] + 1
    np.subtract(q[1:], q[:-1], out=lengths[1:])
    row_last = np.searchsorted(q, np.arange(n - 1, b_rows * n, n))  # index of each row's final run
    first_run = np.empty(b_rows, dtype=np.int32)
    first_run[0] = 0
    np.add(row_last[:-1], 1, out=first_run[1:])
    values = np.arange(q.size, dtype=np.int32)  # value of run i: EOS tokens before it in its row
    values -= np.repeat(first_run, row_last - first_run + 1)
    return np.repeat(values, lengths).reshape(b_rows, n)
