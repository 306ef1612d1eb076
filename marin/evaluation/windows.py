"""Which tokens an evaluated sequence contributes, how long ones are windowed, how windows are packed.

A *sequence* here is ``s = [EOS] + tokens`` of one document (or one multiple-choice request): the
end-of-document token stands in for "a new document starts", exactly the context the first token of
every document has in training, where documents are packed after the previous one's EOS. Targets are
``s[1:]``; target ``j`` is predicted from ``s[:j]`` (or the part of it inside its window). Only
targets at ``j >= score_from`` count (1 for a document: every text token; past the context for a
multiple-choice continuation).

Sequences longer than the model's window are split into windows of at most ``seq_len`` inputs that
start every ``stride`` tokens; each target is scored once, in the first window that reaches it, so
with ``stride < seq_len`` every target after the first window has at least ``seq_len - stride``
tokens of context. ``stride == seq_len`` gives disjoint windows (cheapest; the first token of each
window then has no context beyond the window start).

Windows are packed into rows of ``seq_len`` (best fit, longest first) with one segment id per
window, so attention never crosses from one window into another; position encodings are relative
(RoPE), so a window's scores do not depend on where in a row it lands (up to float rounding).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


def sequence_windows(
    length: int, seq_len: int, stride: int | None = None, score_from: int = 1
) -> list[tuple[int, int, int]]:
    """Windows of a sequence of ``length`` tokens: ``(begin, end, first_scored)`` triples.

    The window's inputs are ``s[begin:end]`` and its targets ``s[begin + 1:end + 1]``; it scores
    targets ``first_scored .. end``. Every target ``j >= score_from`` is scored exactly once.
    """
    stride = seq_len if stride is None else stride
    if seq_len <= 0 or not 0 < stride <= seq_len:
        raise ValueError(f"need seq_len > 0 and 0 < stride <= seq_len, got seq_len={seq_len}, stride={stride}")
    if score_from < 1:
        raise ValueError(f"score_from must be >= 1 (s[0] has no context), got {score_from}")
    last = length - 1  # index of the last target
    out: list[tuple[int, int, int]] = []
    done = score_from - 1  # targets up to here are scored already (or not scored at all)
    begin = 0
    while done < last:
        end = min(begin + seq_len, last)
        if end > done:
            out.append((begin, end, done + 1))
            done = end
        begin += stride
    return out


@dataclass(frozen=True)
class PackedRows:
    """Windows packed into rows of ``seq_len``; the arrays are [rows, seq_len].

    ``sequence`` is the index of the evaluated sequence a scored target belongs to, -1 elsewhere
    (padding, context-only positions), so per-sequence sums are one ``np.bincount``.
    """

    inputs: np.ndarray  # int32
    targets: np.ndarray  # int32
    segment_ids: np.ndarray  # int32: 1.. per window in a row, 0 for padding
    sequence: np.ndarray  # int64

    @property
    def num_rows(self) -> int:
        return int(self.inputs.shape[0])

    def padded_to(self, multiple: int) -> PackedRows:
        """Rows appended (all padding) so the row count is a multiple of ``multiple`` (at least one)."""
        n = max(self.num_rows, 1)
        extra = -n % multiple + (n - self.num_rows)
        if not extra:
            return self
        def z(a: np.ndarray, v: int) -> np.ndarray:
            return np.concatenate([a, np.full((extra, a.shape[1]), v, a.dtype)])

        return PackedRows(z(self.inputs, 0), z(self.targets, 0), z(self.segment_ids, 0), z(self.sequence, -1))


def pack_windows(sequences: list[np.ndarray], seq_len: int, stride: int | None = None,
                 score_from: list[int] | None = None) -> PackedRows:
    """Window every sequence and pack the windows into rows (best fit decreasing).

    ``sequences`` are full sequences ``s`` (leading EOS included). Deterministic: the same inputs give
    the same rows, so two evaluations of the same checkpoint run the same batches.
    """
    wins: list[tuple[int, int, int, int]] = []  # (sequence, begin, end, first_scored)
    for i, s in enumerate(sequences):
        sf = 1 if score_from is None else score_from[i]
        wins.extend((i, b, e, f) for b, e, f in sequence_windows(len(s), seq_len, stride, sf))
    order = sorted(range(len(wins)), key=lambda k: (-(wins[k][2] - wins[k][1]), k))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (free space, row) of rows that are not full
    for k in order:
        n = wins[k][2] - wins[k][1]
        j = bisect.bisect_left(free, (n, -1))
        if j == len(free):
            rows.append([k])
            if seq_len - n > 0:
                bisect.insort(free, (seq_len - n, len(rows) - 1))
        else:
            space, r = free.pop(j)
            rows[r].append(k)
            if space - n > 0:
                bisect.insort(free, (space - n, r))
    shape = (len(rows), seq_len)
    inputs = np.zeros(shape, np.int32)
    targets = np.zeros(shape, np.int32)
    segments = np.zeros(shape, np.int32)
    sequence = np.full(shape, -1, np.int64)
    for r, ks in enumerate(rows):
        pos = 0
        for seg, k in enumerate(ks, start=1):
            i, b, e, f = wins[k]
            s = sequences[i]
            n = e - b
            inputs[r, pos:pos + n] = s[b:e]
            targets[r, pos:pos + n] = s[b + 1:e + 1]
            segments[r, pos:pos + n] = seg
            sequence[r, pos + (f - b - 1):pos + n] = i  # target index j sits at row position pos + j - b - 1
            pos += n
    return PackedRows(inputs, targets, segments, sequence)
