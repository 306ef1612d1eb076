"""The data order: which (source, start token) each row of each training batch reads.

Two orders, named by :attr:`marin.data.mixture.MixtureConfig.order` (a versioned field: the order
changes what a training step reads, so it changes the step's hash):

* ``"with_replacement"`` (the legacy order, kept so runs started with it resume with it): every row
  draws its source by share and its start uniformly over the source's training tokens.
* ``"without_replacement_v1"``: every training token of a source is an input position of exactly one
  window per epoch of that source, and the rows of step N are a pure function of (config, schedule, N).

How ``without_replacement_v1`` works (all closed form, nothing is replayed or stored):

1. **Rows per source per step.** Each step's ``B`` rows are split by share: source i gets
   ``floor(s_i B)`` rows plus at most one of the ``R = B - sum floor(s_i B)`` extra rows. The extras are
   dealt by systematic sampling: the sources' fractional parts tile a circle of circumference R, and
   step t's sample point moves by the golden ratio each step, so every source gets its fractional
   share of extras over time and exactly R are dealt each step. The rows of a source over the first t
   steps of a segment are a floor sum (:func:`floor_sum`, O(log) per source).
2. **Cursors in tokens.** A source's cursor is the count of its stream tokens consumed: the sum over
   the schedule's segments (constant batch, sequence length and mixture stage) of rows x seq_len,
   computed per segment once when the loader is built. A change of sequence length aligns the
   cursor up to the new length (skipping less than one window per interleaved block), so windows of
   every length stay aligned.
3. **Stream.** A source's stream is its training tokens, epoch after epoch. The stream is cut into
   blocks of ``block`` tokens (the least common multiple of the phase lengths, so an aligned window of
   any phase lies in one block); inside each epoch the whole blocks are visited in a keyed
   pseudo-random permutation (a Feistel network: random access, no table), and the partial blocks at
   an epoch's two ends are contiguous text across the source's end (which is a document end), so
   every window is contiguous text of its source.
4. **Mixing.** Large sources consume ``K`` (up to 16) blocks at once, window by window in turn, so one
   step's rows of a source come from ``K`` places of it; the rows of the batch are then shuffled, so
   every host's slice and every microbatch holds a mixture.

This module is pure (numpy only): the loader (:mod:`marin.data.loader`) reads the tokens, the
reports (:mod:`marin.data.mixture_report`, ``marin plan``) call :func:`coverage`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from marin.data.k40 import K40_DOMAINS, K40_TOTAL_TOKENS, split_source_name
from marin.runsteps import phase_start_step

WITH_REPLACEMENT = "with_replacement"
"""The legacy order: rows drawn independently (sources by share, starts uniform)."""
WITHOUT_REPLACEMENT_V1 = "without_replacement_v1"
"""Every token once per epoch of its source; closed form in the step."""
ORDERS: tuple[str, ...] = (WITH_REPLACEMENT, WITHOUT_REPLACEMENT_V1)
CURRENT_ORDER = WITHOUT_REPLACEMENT_V1
"""What the shipped experiments and the ``default_mixture`` builder use."""

MAX_INTERLEAVE = 16
"""Most blocks of one source consumed in turn (how many places one step's rows of a source come from)."""
BLOCKS_PER_LANE = 1024
"""A source interleaves ``K`` blocks only when it has at least ``1024 K`` of them: small sources keep
``K = 1`` (they give a step few rows anyway): a switch skips less than one window per interleaved
block, so at most a 1/512 of a source that interleaves."""
REPEAT_WARNING_EPOCHS = 4.0
"""Beyond about 4 epochs repeated data is worth much less than fresh data (data-constrained scaling)."""

_Q = 1 << 31  # denominator of the quantized shares
_P = int(round(_Q * 0.6180339887498949)) | 1  # golden-ratio step of the extras' sample point (odd: coprime)


class OrderError(ValueError):
    """A schedule the data order cannot serve (e.g. phase lengths that are not multiples of the shortest)."""


def check_order(order: str) -> None:
    """Raise OrderError unless ``order`` is a known data order."""
    if order not in ORDERS:
        raise OrderError(f"unknown data order {order!r}; known orders: {', '.join(ORDERS)}")


def block_length(seq_lens: Sequence[int]) -> int:
    """Block of the without-replacement order for these phase lengths: their least common multiple.

    Refuses (one line) lengths that are not all multiples of the shortest: then aligned windows of two
    phases could not both tile the blocks without skipping."""
    lens = sorted({int(n) for n in seq_lens})
    if not lens or lens[0] <= 0:
        raise OrderError(f"sequence lengths must be positive, got {list(seq_lens)}")
    bad = [n for n in lens if n % lens[0]]
    if bad:
        raise OrderError(f"seq_len_phases: {bad[0]} is not a multiple of the shortest phase length {lens[0]}; the "
                         f"{WITHOUT_REPLACEMENT_V1} data order needs every phase length to be a multiple of the "
                         f"shortest")
    return math.lcm(*lens)


@dataclasses.dataclass(frozen=True)
class DataPhase:
    """From ``start_step`` on, batches of ``batch_size`` rows of ``seq_len`` tokens."""

    start_step: int
    batch_size: int
    seq_len: int


def data_schedule(total_steps: int, tokens_per_step: int,
                  seq_len_phases: Sequence[tuple[float, int]]) -> tuple[DataPhase, ...]:
    """The batch shapes of a run: phases at fractions of ``total_steps`` (the trainer's rounding rule,
    :func:`marin.runsteps.phase_start_step`), ``batch_size = tokens_per_step // seq_len``."""
    out: list[DataPhase] = []
    for fraction, n in seq_len_phases:
        start = phase_start_step(float(fraction), total_steps)
        phase = DataPhase(start, int(tokens_per_step) // int(n), int(n))
        if out and out[-1].start_step == start:
            out[-1] = phase
        else:
            out.append(phase)
    return tuple(out)


# --------------------------------------------------------------------------------------------------
# Pure integer math


def floor_sum(n: np.ndarray | int, m: int, a: int, b: np.ndarray) -> np.ndarray:
    """``sum_{t=0}^{n-1} floor((a t + b) / m)`` elementwise over ``b`` (and ``n``), exactly, in O(log m).

    The Euclid-like reduction (as in competitive-programming libraries): vectorized over int64 arrays;
    exact while ``a * n + b`` stays below 2**63 (``n`` below 2**31 steps here)."""
    n = np.asarray(n, dtype=np.int64)
    b = np.asarray(b, dtype=np.int64)
    shape = np.broadcast_shapes(n.shape, b.shape)
    b = np.broadcast_to(b, shape).copy()
    n = np.broadcast_to(n, shape).copy()
    m_ = np.full(b.shape, m, dtype=np.int64)
    a_ = np.full(b.shape, a, dtype=np.int64)
    ans = np.zeros(b.shape, dtype=np.int64)
    active = n > 0
    while active.any():
        q = a_ // m_
        ans += np.where(active, (n * (n - 1) // 2) * q, 0)
        a_ = np.where(active, a_ % m_, a_)
        q = b // m_
        ans += np.where(active, n * q, 0)
        b = np.where(active, b % m_, b)
        y = a_ * n + b
        active &= y >= m_
        n_next, b_next = y // np.maximum(m_, 1), y % np.maximum(m_, 1)
        n = np.where(active, n_next, n)
        b = np.where(active, b_next, b)
        m_, a_ = np.where(active, a_, m_), np.where(active, m_, a_)
    return ans


@dataclasses.dataclass(frozen=True)
class Allocation:
    """Rows per step of each source at one batch size and one set of shares (see the module doc)."""

    base: np.ndarray
    """``floor(s_i B)`` per source."""
    edges: np.ndarray
    """Cumulative fractional parts in units of 1/_Q, length sources + 1 (``edges[-1] = R * _Q``)."""

    @staticmethod
    def of(shares: np.ndarray, batch_size: int) -> Allocation:
        """Quantize ``shares * batch_size`` to units of 1/2**31 rows (summing exactly to the batch)."""
        s = np.asarray(shares, dtype=np.float64)
        s = s / s.sum()
        ideal = s * batch_size * _Q
        x = np.floor(ideal).astype(np.int64)
        short = int(batch_size) * _Q - int(x.sum())
        if short > 0:  # largest remainders first, among sources with a positive share
            order = np.argsort(-(ideal - x) - (s > 0), kind="stable")
            x[order[:short]] += 1
        base = x // _Q
        edges = np.concatenate([[0], np.cumsum(x % _Q)]).astype(np.int64)
        return Allocation(base=base, edges=edges)

    def rows_at(self, t: int | np.ndarray) -> np.ndarray:
        """Rows of each source at step ``t`` of the segment: ``base`` or ``base + 1``; they sum to the batch.
        ``t`` an array of steps: one row of the result per step."""
        t = np.asarray(t, dtype=np.int64)[..., None]
        e = (self.edges + t * _P) // _Q  # t * _P < 2**63 for any t below 2**31
        return self.base + np.diff(e, axis=-1)

    def rows_before(self, t: int | np.ndarray) -> np.ndarray:
        """Rows of each source over steps ``0 .. t-1`` of the segment (closed form, no loop over steps);
        ``t`` an array of steps: one row of the result per step."""
        t = np.asarray(t, dtype=np.int64)[..., None]
        fs = floor_sum(t, _Q, _P, np.broadcast_to(self.edges, t.shape[:-1] + self.edges.shape))
        return self.base * t + np.diff(fs, axis=-1)


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_ROUND_CONSTANTS = tuple(np.uint64(0x9E3779B97F4A7C15 * (r + 1) & 0xFFFFFFFFFFFFFFFF) for r in range(4))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijective scramble of uint64 values (wrapping arithmetic)."""
    return _mix_in_place(np.array(x, dtype=np.uint64))


def _mix_in_place(x: np.ndarray) -> np.ndarray:
    """:func:`_mix` overwriting ``x`` (no temporaries: the permutation's inner loop)."""
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


def permute(j: np.ndarray, m: np.ndarray, key: np.ndarray) -> np.ndarray:
    """A keyed pseudo-random permutation of ``[0, m)`` applied to ``j`` (elementwise ``m`` and ``key``).

    A 4-round balanced Feistel network on the smallest even bit width covering ``m``, with cycle
    walking (apply again while out of range: at most a few rounds on average, since the domain is
    under 4m): a bijection with random access, so an epoch of any size needs no permutation table.
    Each walk works on the values still out of range only."""
    j = np.asarray(j, dtype=np.uint64)
    m = np.asarray(m, dtype=np.int64)
    key = np.asarray(key, dtype=np.uint64)
    bits = np.ceil(np.log2(np.maximum(m, 2).astype(np.float64))).astype(np.int64)
    bits = np.where((np.int64(1) << bits) < m, bits + 1, bits)  # guard log2 round-off
    out = j.copy()
    idx = np.flatnonzero(m > 1)
    x = out[idx]
    half = ((bits[idx] + 1) // 2).astype(np.uint64)
    mask = (np.uint64(1) << half) - np.uint64(1)
    k, mu = key[idx], m[idx].astype(np.uint64)
    while idx.size:
        left, right = x >> half, x & mask
        for c in _ROUND_CONSTANTS:
            f = right ^ k
            f ^= c
            _mix_in_place(f)
            f &= mask
            left ^= f
            left, right = right, left
        left <<= half
        left |= right
        x = left
        out[idx] = x
        still = x >= mu
        if not still.any():
            break
        idx, x, half, mask, k, mu = idx[still], x[still], half[still], mask[still], k[still], mu[still]
    return out.astype(np.int64)


def _epoch_keys(seed: int, source: np.ndarray, epoch: np.ndarray) -> np.ndarray:
    """The permutation key of each (source, epoch): computed once per pair present when there are
    fewer pairs than values (the rows of a batch share a few), else value by value."""
    base = _mix(np.asarray([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0]
    if source.size > 64:
        e0 = int(epoch.min())
        n_src, n_ep = int(source.max()) + 1, int(epoch.max()) - e0 + 1
        if n_src * n_ep < source.size:
            s_grid = np.repeat(np.arange(n_src, dtype=np.int64), n_ep)
            e_grid = np.tile(np.arange(e0, e0 + n_ep, dtype=np.int64), n_src)
            return _epoch_keys(seed, s_grid, e_grid)[source * n_ep + (epoch - e0)]
    k = _mix(source.astype(np.uint64) * np.uint64(0xD6E8FEB86659FD93) ^ base)
    return _mix(k ^ (epoch.astype(np.uint64) * np.uint64(0xA0761D6478BD642F)))


def stream_to_ring(stream: np.ndarray, train_tokens: np.ndarray, block: int, seed: int,
                   source: np.ndarray) -> np.ndarray:
    """Source token (on the ring of its training tokens) at each stream position.

    Epoch ``e`` of a source of ``T`` tokens is stream ``[eT, (e+1)T)``. Blocks are aligned on the stream
    (multiples of ``block``); the epoch's head (up to its first block boundary) and tail (after its last
    whole block) keep their places, the whole blocks between them are permuted. The tail of epoch e-1
    and the head of epoch e share one block: the source's last and first tokens, contiguous across the
    source's end. So every aligned block maps to contiguous text of the ring."""
    s = np.asarray(stream, dtype=np.int64)
    t = np.asarray(train_tokens, dtype=np.int64)
    e = s // t
    p = s - e * t
    head = (-(e * t)) % block
    m = np.maximum((t - head) // block, 0)
    j = (p - head) // block
    full = (p >= head) & (j < m)
    if full.all():  # nearly always: every position in a whole block of its epoch
        keys = _epoch_keys(seed, np.asarray(source, dtype=np.int64), e)
        return head + permute(j, m, keys) * block + (p - head) % block
    ring = p.copy()
    if full.any():
        source = np.asarray(source, dtype=np.int64)
        jj = permute(j[full], m[full], _epoch_keys(seed, source[full], e[full]))
        ring[full] = head[full] + jj * block + (p[full] - head[full]) % block
    return ring


def interleave(train_tokens: np.ndarray, block: int) -> np.ndarray:
    """Blocks each source consumes in turn (see :data:`MAX_INTERLEAVE`, :data:`BLOCKS_PER_LANE`)."""
    blocks = np.asarray(train_tokens, dtype=np.int64) // block
    return np.clip(blocks // BLOCKS_PER_LANE, 1, MAX_INTERLEAVE).astype(np.int64)


def consumption_to_stream(x: np.ndarray, seq_len: int, block: int, k: np.ndarray, run_start: np.ndarray,
                          run_offset: np.ndarray) -> np.ndarray:
    """Stream position of the window at consumption cursor ``x`` (per row).

    Consumption walks groups of ``k`` blocks: window w of a group goes to block ``w mod k`` at offset
    ``(w div k) * seq_len``. In the group where the current run of this sequence length began
    (``run_start``), every block starts at the run's common offset ``run_offset`` (what the alignment at
    the switch left)."""
    g = k * block
    g0 = (x // g) * g
    same = g0 == (run_start // g) * g
    off0 = np.where(same, run_offset, 0)
    w = (x - g0 - k * off0) // seq_len
    return g0 + (w % k) * block + off0 + (w // k) * seq_len


def realign(c: np.ndarray, prev_len: int, new_len: int, block: int, k: np.ndarray, run_start: np.ndarray,
            run_offset: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cursor and common block offset after a switch from windows of ``prev_len`` to ``new_len``: the
    group in progress resumes at the smallest offset, aligned to ``new_len``, past what every one of its
    blocks has consumed (skipping less than one new window per block), or at the next group."""
    g = k * block
    g0 = (c // g) * g
    u = c - g0
    same = g0 == (run_start // g) * g
    off0 = np.where(same, run_offset, 0)
    w = (u - k * off0) // prev_len
    done = off0 + -(-w // k) * prev_len  # the furthest any block of the group has got
    off = -(-done // new_len) * new_len
    nxt = off >= block
    new_c = np.where(u == 0, c, np.where(nxt, g0 + g, g0 + k * off))
    new_off = np.where((u == 0) | nxt, 0, off)
    return new_c, new_off


# --------------------------------------------------------------------------------------------------
# The order over a run's segments


@dataclasses.dataclass(frozen=True)
class Segment:
    """Steps ``[start, end)`` with one batch shape and one set of shares (``end`` None: open)."""

    start: int
    end: int | None
    batch_size: int
    seq_len: int
    alloc: Allocation
    cursor: np.ndarray
    """Each source's consumption cursor (stream tokens) at ``start``, after any alignment."""
    run_start: np.ndarray
    run_offset: np.ndarray


class WithoutReplacementOrder:
    """``without_replacement_v1`` for one mixture over one schedule (see the module doc).

    Built once per loader in O(segments x sources); :meth:`plan` is O(sources + rows) at any step."""

    def __init__(self, train_tokens: np.ndarray, phases: Sequence[DataPhase], stage_starts: Sequence[int],
                 stage_probs: Sequence[np.ndarray], seed: int):
        if not phases or phases[0].start_step != 0:
            raise OrderError("a data schedule must start at step 0")
        self.train_tokens = np.asarray(train_tokens, dtype=np.int64)
        self.seed = int(seed)
        self.block = block_length([p.seq_len for p in phases])
        self.k = interleave(self.train_tokens, self.block)
        self.phases = tuple(phases)
        bounds = sorted({p.start_step for p in phases} | {int(s) for s in stage_starts if s > 0} | {0})
        segments: list[Segment] = []
        n = self.train_tokens.size
        c = np.zeros(n, dtype=np.int64)
        run_start, run_offset = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        prev_len = None
        for i, start in enumerate(bounds):
            end = bounds[i + 1] if i + 1 < len(bounds) else None
            phase = [p for p in phases if p.start_step <= start][-1]
            probs = stage_probs[int(np.searchsorted(np.asarray(stage_starts, dtype=np.int64), start, side="right"))]
            if prev_len is not None and phase.seq_len != prev_len:
                c, run_offset = realign(c, prev_len, phase.seq_len, self.block, self.k, run_start, run_offset)
                run_start = c.copy()
            alloc = Allocation.of(probs, phase.batch_size)
            segments.append(Segment(start, end, phase.batch_size, phase.seq_len, alloc, c, run_start, run_offset))
            if end is not None:
                c = c + phase.seq_len * alloc.rows_before(end - start)
            prev_len = phase.seq_len
        self.segments = segments
        self._starts = [s.start for s in segments]

    def segment(self, step: int) -> Segment:
        return self.segments[int(np.searchsorted(self._starts, step, side="right")) - 1]

    def cursor(self, step: int) -> np.ndarray:
        """Stream tokens each source has consumed before ``step`` (windows read plus alignment skips)."""
        seg = self.segment(step)
        return seg.cursor + seg.seq_len * seg.alloc.rows_before(step - seg.start)

    def consumed(self, step: int) -> np.ndarray:
        """Training tokens each source has given as input positions before ``step`` (no skips)."""
        out = np.zeros(self.train_tokens.size, dtype=np.int64)
        for seg in self.segments:
            if seg.start >= step:
                break
            stop = step if seg.end is None else min(step, seg.end)
            out += seg.seq_len * seg.alloc.rows_before(stop - seg.start)
        return out

    def windows(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, Segment]:
        """``(source, stream position, ring start, segment)`` of each row of ``step``, in source order
        (the stream position says which epoch of its source a window belongs to: ``stream // tokens``)."""
        src, stream, starts, seg = self.windows_of_steps(step, 1)
        return src[0], stream[0], starts[0], seg

    def windows_of_steps(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, Segment]:
        """:meth:`windows` of steps ``first .. first+count-1``, which must lie in one segment (see
        :meth:`steps_in_segment`), as ``[count, batch_size]`` arrays: one vectorized pass, so the fixed
        cost of the closed forms is paid once for all of them (what a small batch is dominated by)."""
        seg = self.segment(first)
        if count < 1 or (seg.end is not None and first + count > seg.end):
            raise ValueError(f"steps {first}..{first + count - 1} are not inside one segment of the schedule")
        t = np.arange(first - seg.start, first - seg.start + count, dtype=np.int64)
        rows = seg.alloc.rows_at(t)  # [count, sources]
        before = seg.alloc.rows_before(t[0]) + np.cumsum(rows, axis=0) - rows  # = rows_before(t), one floor sum
        c = seg.cursor + seg.seq_len * before
        n = rows.shape[1]
        flat = rows.ravel()
        group = np.repeat(np.arange(flat.size, dtype=np.int64), flat)  # (step, source) of every row
        src = group % n
        first_row = np.cumsum(flat) - flat
        j = np.arange(group.size, dtype=np.int64) - first_row[group]
        x = c.ravel()[group] + j * seg.seq_len
        stream = consumption_to_stream(x, seg.seq_len, self.block, self.k[src], seg.run_start[src],
                                       seg.run_offset[src])
        starts = stream_to_ring(stream, self.train_tokens[src], self.block, self.seed, src)
        shape = (count, seg.batch_size)
        return src.reshape(shape), stream.reshape(shape), starts.reshape(shape), seg

    def steps_in_segment(self, step: int) -> int:
        """How many steps from ``step`` on share its segment (batch shape and shares): a large number
        for the open last segment."""
        seg = self.segment(step)
        return (1 << 30) if seg.end is None else seg.end - step

    def plan(self, step: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """``(source, ring start, batch_size, seq_len)`` of each row of ``step``, rows in source order
        (the caller shuffles them)."""
        src, _, starts, seg = self.windows(step)
        return src, starts, seg.batch_size, seg.seq_len


# --------------------------------------------------------------------------------------------------
# Coverage: what a run will see of each source


def coverage(train_tokens: Mapping[str, float], drawn: Mapping[str, float], order: str = CURRENT_ORDER
             ) -> list[dict]:
    """Per source: epochs over the run, the share of its training tokens the run sees at least once,
    the share it sees more than once, and whether it repeats more than :data:`REPEAT_WARNING_EPOCHS`.

    ``drawn``: training tokens the run reads from each source. Without replacement a source read for
    E epochs has every token seen ``floor(E)`` or ``ceil(E)`` times: seen ``min(E, 1)``, repeated
    ``min(max(E - 1, 0), 1)``. With replacement (independent windows) a token is seen a Poisson(E)
    number of times: seen ``1 - e^-E``, repeated ``1 - e^-E (1 + E)``."""
    check_order(order)
    out = []
    for name, n in train_tokens.items():
        d = float(drawn.get(name, 0.0))
        e = d / n if n > 0 else 0.0
        if order == WITH_REPLACEMENT:
            seen, repeated = 1.0 - math.exp(-e), 1.0 - math.exp(-e) * (1.0 + e)
        else:
            seen, repeated = min(e, 1.0), min(max(e - 1.0, 0.0), 1.0)
        out.append({"source": name, "train_tokens": float(n), "drawn_tokens": d, "epochs": e, "seen": seen,
                    "repeated": repeated, "max_visits": math.ceil(e) if order != WITH_REPLACEMENT else None,
                    "warning": e > REPEAT_WARNING_EPOCHS})
    return out


def domain_coverage(rows: Sequence[dict], order: str = CURRENT_ORDER) -> list[dict]:
    """:func:`coverage` summed per domain (``domain/bucket`` sources grouped by domain): token-weighted."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(split_source_name(r["source"])[0], []).append(r)
    out = []
    for d, rs in by.items():
        n = sum(r["train_tokens"] for r in rs)
        drawn = sum(r["drawn_tokens"] for r in rs)
        seen = sum(r["seen"] * r["train_tokens"] for r in rs) / n if n else 0.0
        rep = sum(r["repeated"] * r["train_tokens"] for r in rs) / n if n else 0.0
        e = drawn / n if n else 0.0
        out.append({"domain": d, "train_tokens": n, "drawn_tokens": drawn, "epochs": e, "seen": seen,
                    "repeated": rep, "max_epochs": max(r["epochs"] for r in rs),
                    "warning": any(r["warning"] for r in rs),
                    # the domain's mean can sit under the limit while one of its sources is far past it
                    "warned_sources": [{"source": r["source"], "epochs": r["epochs"]} for r in rs if r["warning"]]})
    return out


def k40_coverage(run_tokens: float, domain_weights: Mapping[str, float] | None = None,
                 order: str = CURRENT_ORDER) -> list[dict]:
    """Per-domain :func:`domain_coverage` of a run reading ``run_tokens`` of Harrier K40 (23.11T tokens at
    its domain shares) with ``domain_weights`` (None: the corpus's own shares, as the hero's mixture):
    what ``marin plan`` prints before any token store exists (bucket sizes are not published)."""
    sizes = {d.name: d.share * K40_TOTAL_TOKENS for d in K40_DOMAINS}
    weights = dict(domain_weights) if domain_weights is not None else {d.name: d.share for d in K40_DOMAINS}
    total_w = sum(weights.values())
    drawn = {d: run_tokens * weights.get(d, 0.0) / total_w for d in sizes}
    return domain_coverage(coverage(sizes, drawn, order), order)


def _t(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.{2 if unit == 'T' and n < 1e14 else 1}f}{unit}"
    return f"{n:.0f}"


def format_coverage(rows: Sequence[dict], order: str, what: str, per_domain: int | None = 8) -> str:
    """The "data coverage" block of ``marin plan`` and the mixture report's summary: totals, the
    ``per_domain`` domains read most (all when None), and a warning line per source repeated more
    than :data:`REPEAT_WARNING_EPOCHS` epochs."""
    n = sum(r["train_tokens"] for r in rows)
    drawn = sum(r["drawn_tokens"] for r in rows)
    seen = sum(r["seen"] * r["train_tokens"] for r in rows) / n if n else 0.0
    rep = sum(r["repeated"] * r["train_tokens"] for r in rows) / n if n else 0.0
    max_e = max((r.get("max_epochs", r["epochs"]) for r in rows), default=0.0)  # a domain's most-read source
    lines = [f"data coverage ({what}, order {order}):",
             f"  reads {_t(drawn)} of {_t(n)} training tokens ({drawn / n if n else 0:.2f} epochs): "
             f"{seen:.1%} of the tokens seen, {rep:.1%} seen more than once"]
    if order != WITH_REPLACEMENT and max_e <= 1.0:
        lines[-1] += ", every token at most once"
    if order != WITH_REPLACEMENT and n:
        legacy = [(1 - math.exp(-r["epochs"]), 1 - math.exp(-r["epochs"]) * (1 + r["epochs"])) for r in rows]
        lines.append(f"  (the legacy {WITH_REPLACEMENT} order would see "
                     f"{sum(a * r['train_tokens'] for (a, _), r in zip(legacy, rows)) / n:.1%}, "
                     f"{sum(b * r['train_tokens'] for (_, b), r in zip(legacy, rows)) / n:.1%} more than once)")
    key = "domain" if rows and "domain" in rows[0] else "source"
    shown = sorted(rows, key=lambda r: -r["epochs"])
    for r in shown if per_domain is None else shown[:per_domain]:
        lines.append(f"  {r[key]:<16} {r['epochs']:6.2f} epochs  seen {r['seen']:6.1%}  repeated {r['repeated']:6.1%}"
                     f"  ({_t(r['drawn_tokens'])} of {_t(r['train_tokens'])})")
    if per_domain is not None and len(shown) > per_domain:
        lines.append(f"  ... {len(shown) - per_domain} more, the least read at {shown[-1]['epochs']:.2f} epochs")
    lines += [f"  warning: {w}" for w in repeat_warnings(rows)]
    return "\n".join(lines)


def repeat_warnings(rows: Sequence[dict]) -> list[str]:
    """One line per source read more than :data:`REPEAT_WARNING_EPOCHS` epochs, naming that source and
    its epochs (a domain row names the sources that fired it, with the domain's mean beside them: the
    mean alone can sit under the limit)."""
    out = []
    limit = f"more than {REPEAT_WARNING_EPOCHS:g}: repeated data is worth much less beyond that"
    for r in rows:
        if not r["warning"]:
            continue
        if "domain" not in r:
            out.append(f"{r['source']} is read {r['epochs']:.1f} epochs ({limit})")
            continue
        fired = r.get("warned_sources") or [{"source": r["domain"], "epochs": r["max_epochs"]}]  # an older record
        for w in fired:
            mean = "" if w["source"] == r["domain"] else f"; its domain {r['domain']} {r['epochs']:.1f} on average"
            out.append(f"{w['source']} is read {w['epochs']:.1f} epochs ({limit}{mean})")
    return out
