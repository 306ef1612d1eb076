"""The stateless mixture loader: batch ``step`` of a :class:`~marin.data.mixture.MixtureConfig` is a
pure function of (config, schedule, step); see :mod:`marin.data.mixture` for the semantics of sources,
weights, stages and the validation split, and :mod:`marin.data.order` for the data orders.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence

import numpy as np

from marin.data import native
from marin.data.k40 import split_source_name
from marin.data.mixture import (
    MixtureConfig,
    MixtureError,
    MixtureStage,
    source_probabilities,
    validation_documents,
)
from marin.data.order import (
    WITH_REPLACEMENT,
    WITHOUT_REPLACEMENT_V1,
    DataPhase,
    WithoutReplacementOrder,
    check_order,
)
from marin.data.segments import segment_ids_from_eos
from marin.data.store import SourceReader, TokenizerMismatchError, TokenStore, read_ranges


def ring_pieces(start: int, length: int, ring: int) -> list[tuple[int, int]]:
    """[start, start+length) on a ring of size ``ring`` as plain ranges (wrapping as often as needed)."""
    out = []
    pos, left = start % ring, length
    while left > 0:
        take = min(left, ring - pos)
        out.append((pos, pos + take))
        left -= take
        pos = 0
    return out


def _batch_rng(seed: int, step: int) -> np.random.Generator:
    """Counter-based RNG keyed by (seed, step): batch ``step`` needs no state from batches before it."""
    key = np.array([seed & 0xFFFFFFFFFFFFFFFF, step & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
    return np.random.Generator(np.random.Philox(key=key))


_RNG_CACHE = threading.local()


def _rewound_batch_rng(seed: int, step: int) -> np.random.Generator:
    """The generator :func:`_batch_rng` would return, for immediate use by the calling thread.

    ``Philox(key=...)`` first seeds itself from OS entropy (a ``SeedSequence``) and only then takes the
    key, ~8 us per batch. Instead one Philox per thread is rewound to the state a fresh one has (counter
    0, given key, empty buffers), which yields the identical stream for ~1.5 us. The generator is reset
    by the next call on the same thread, so callers must consume it before calling again.
    """
    key = np.array([seed & 0xFFFFFFFFFFFFFFFF, step & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
    gen = getattr(_RNG_CACHE, "gen", None)
    if gen is None:
        gen = _RNG_CACHE.gen = np.random.Generator(np.random.Philox(key=key))
        return gen
    gen.bit_generator.state = {"bit_generator": "Philox",
                               "state": {"counter": np.zeros(4, dtype=np.uint64), "key": key},
                               "buffer": np.zeros(4, dtype=np.uint64), "buffer_pos": 4,
                               "has_uint32": 0, "uinteger": 0}
    return gen


PLAN_CHUNK_ROWS = 16384
"""Rows of consecutive steps the without-replacement order plans at once (see ``MixtureLoader._order_rows``)."""


class _ShardMaps(dict):
    """Global shard index -> plain ndarray view of its memory map, mapped on first use.

    A dict subclass so the per-row lookup in the fill loop is one C-level ``dict[int]``; ``__missing__``
    runs only the first time a shard is touched (mapping is lazy, so a large store costs nothing until read).
    """

    def __init__(self, readers: list[SourceReader], shard_source: list[int], shard_index: list[int]):
        super().__init__()
        self._readers, self._shard_source, self._shard_index = readers, shard_source, shard_index
        # Address of each mapped shard's first token (0: not mapped yet), for the native kernel. Entries
        # are never replaced or removed, so an address stays valid while the loader lives; the lock keeps
        # two threads from mapping one shard twice (the kernel may be reading the first map).
        self.addr = np.zeros(len(shard_source) + 1, dtype=np.uint64)
        self._lock = threading.Lock()

    def __missing__(self, g: int) -> np.ndarray:
        with self._lock:
            m = dict.get(self, g)
            if m is None:
                m = self[g] = self._readers[self._shard_source[g]].shard_tokens(self._shard_index[g])
                if m.size:
                    self.addr[g] = m.ctypes.data
        return m


# --------------------------------------------------------------------------------------------------
# Loader


class MixtureLoader:
    """Training and validation batches from a :class:`MixtureConfig` (see module docstring).

    ``total_steps`` (the run's horizon) places stages given as fractions of the run; without it such
    a config still builds (validation batches and shares by stage need no horizon), but asking which
    stage a step is in raises a clear error.

    ``schedule`` (:class:`~marin.data.order.DataPhase` s, or ``(start_step, batch_size, seq_len)``
    tuples; :func:`marin.data.order.data_schedule` builds it from a run's phases) is the batch shape
    of every step: the without-replacement order counts each source's tokens over it, so every step
    must then be asked for with its scheduled shape. Without one, every step is taken to have the
    shape it is asked for (a constant-shape run; each shape gets its own order).
    """

    def __init__(self, config: MixtureConfig, total_steps: int | None = None,
                 schedule: Sequence[DataPhase | tuple[int, int, int]] | None = None):
        self.tokens_read = 0  # training tokens this loader has read from its stores (per host)
        check_order(getattr(config, "order", WITH_REPLACEMENT))
        self.order: str = getattr(config, "order", WITH_REPLACEMENT)
        if isinstance(config.stores, str):
            raise MixtureError(
                f"MixtureConfig.stores must be a tuple of store paths, got the string {config.stores!r}; "
                f"write stores=({config.stores!r},)"
            )
        if not config.stores:
            raise MixtureError("MixtureConfig.stores is empty; give at least one token store path")
        self.config = config
        self.stores = [TokenStore.open(p) for p in config.stores]
        first = self.stores[0]
        for s in self.stores[1:]:
            if s.tokenizer_identity != first.tokenizer_identity:
                raise TokenizerMismatchError(
                    f"token stores disagree on the tokenizer: {first.path} has {first.tokenizer_identity[:16]}, "
                    f"{s.path} has {s.tokenizer_identity[:16]}; a mixture needs one tokenizer"
                )
        if config.tokenizer is not None:
            for s in self.stores:
                s.check_tokenizer(config.tokenizer)
        self.vocab_size: int = first.vocab_size
        self.eos_id: int = first.eos_id
        self.tokenizer_identity: str = first.tokenizer_identity

        readers: dict[str, SourceReader] = {}
        for s in self.stores:
            for name in s.source_names:
                if name in readers:
                    raise MixtureError(f"source {name!r} appears in both {readers[name].store} and {s.path}")
                readers[name] = s.source(name)
        self.source_names: list[str] = sorted(readers)
        self.readers: list[SourceReader] = [readers[n] for n in self.source_names]
        self.train_tokens = np.zeros(len(self.readers), dtype=np.int64)
        self.total_tokens = np.zeros(len(self.readers), dtype=np.int64)
        self.validation_docs = np.zeros(len(self.readers), dtype=np.int64)
        for i, r in enumerate(self.readers):
            nv = validation_documents(r.num_documents, config.validation_fraction,
                                      config.validation_min_documents, config.validation_max_documents)
            self.validation_docs[i] = nv
            self.train_tokens[i] = r.token_offset_of_document(r.num_documents - nv) if r.num_documents else 0
            self.total_tokens[i] = r.num_tokens

        self.total_steps = total_steps
        resolvable = total_steps is not None or all(st.start_fraction is None for st in config.stages)
        if resolvable:
            starts = sorted(st.resolved_start(total_steps) for st in config.stages)
            if len(set(starts)) != len(starts) or any(s < 0 for s in starts):
                raise MixtureError(f"stages: start steps must be distinct and >= 0, got {starts}")
            self._stages = sorted(config.stages, key=lambda st: st.resolved_start(total_steps))
            self._stage_starts: list[int] | None = [st.resolved_start(total_steps) for st in self._stages]
        else:  # fractions without a horizon: order is known, steps are not
            self._stages = sorted(config.stages, key=lambda st: (st.start_fraction is None, st.start_fraction or 0.0,
                                                                  st.start_step or 0))
            self._stage_starts = None
        # One table of all shards of all sources, so a whole batch is located with one searchsorted.
        sizes = np.array([r.num_tokens for r in self.readers], dtype=np.int64)
        self._source_base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self._source_local = np.array([r.is_local for r in self.readers], dtype=bool)
        self._shard_base = np.array([self._source_base[i] + r.token_starts[k] for i, r in enumerate(self.readers)
                                     for k in range(len(r.shards))] + [int(sizes.sum())], dtype=np.int64)
        self._shard_len = np.array([sh.num_tokens for r in self.readers for sh in r.shards] + [0], dtype=np.int64)
        self._shard_source = [i for i, r in enumerate(self.readers) for _ in r.shards]
        self._shard_index = [k for r in self.readers for k in range(len(r.shards))]
        self._source_first_shard = np.concatenate([[0], np.cumsum([len(r.shards) for r in self.readers])]).tolist()
        self._shard_maps = _ShardMaps(self.readers, self._shard_source, self._shard_index)
        # Global end of each shard's training tokens: a window starting in shard g is one slice of it iff
        # it ends by this limit (it neither crosses into the next shard nor wraps around its source).
        train_end = self._source_base + self.train_tokens
        self._shard_limit = np.array([min(int(self._shard_base[g] + self._shard_len[g]), int(train_end[i]))
                                      for g, i in enumerate(self._shard_source)] + [0], dtype=np.int64)
        self._shard_base_list: list[int] = self._shard_base.tolist()
        self._all_local = bool(self._source_local.all())
        # Validate every stage now, so a bad later stage fails at construction, not mid-run.
        self._probs = [self._compute_probs(None)] + [self._compute_probs(st) for st in self._stages]
        self._cdfs = [np.cumsum(p) for p in self._probs]
        self._has_zero_prob = [bool(np.any(p == 0)) for p in self._probs]
        self.schedule: tuple[DataPhase, ...] | None = None if schedule is None else tuple(
            p if isinstance(p, DataPhase) else DataPhase(*map(int, p)) for p in schedule)
        self._orders: dict[tuple[int, int] | None, WithoutReplacementOrder] = {}
        self._plan_chunk: tuple | None = None  # (order, first step, src, starts, batch_size, seq_len)
        if self.order == WITHOUT_REPLACEMENT_V1 and self.schedule is not None:
            self._orders[None] = self._make_order(self.schedule)  # refuses a bad schedule now, not mid-run

    # -- weights -----------------------------------------------------------------------------------
    def _compute_probs(self, stage: MixtureStage | None) -> np.ndarray:
        c = self.config
        dw = c.domain_weights if stage is None or stage.domain_weights is None else stage.domain_weights
        qw = c.quality_weights if stage is None or stage.quality_weights is None else stage.quality_weights
        return source_probabilities(self.source_names, list(self.train_tokens), dw, qw, c.domain_quality_weights)

    def _stage_index(self, step: int) -> int:
        if self._stage_starts is None:
            self._stages[0].resolved_start(None)  # raises: which stage a step is in needs the horizon
        return bisect.bisect_right(self._stage_starts, step)  # = searchsorted(side="right"), without numpy overhead

    def stage_starts(self) -> list[int]:
        """First step of each stage, the top-level weights' stage (step 0) first."""
        if self._stage_starts is None:
            raise MixtureError("the mixture has stages at fractions of the run: give total_steps (the run's steps)")
        return [0] + list(self._stage_starts)

    def effective_shares(self, step: int = 0) -> dict[str, float]:
        """Expected share of training tokens per source (``domain/bucket``) at ``step``; sums to 1."""
        p = self._probs[self._stage_index(step)]
        return {n: float(x) for n, x in zip(self.source_names, p) if x > 0}

    def effective_domain_shares(self, step: int = 0) -> dict[str, float]:
        """Expected share of training tokens per domain at ``step``."""
        out: dict[str, float] = {}
        for n, x in self.effective_shares(step).items():
            d = split_source_name(n)[0]
            out[d] = out.get(d, 0.0) + x
        return out

    def describe(self, total_tokens: int | None = None, step: int = 0) -> list[dict]:
        """Per source: tokens, held-out tokens, share, and (given a token budget) expected epochs."""
        p = self._probs[self._stage_index(step)]
        rows = []
        for i, n in enumerate(self.source_names):
            row = {"source": n, "train_tokens": int(self.train_tokens[i]),
                   "validation_tokens": int(self.total_tokens[i] - self.train_tokens[i]),
                   "validation_documents": int(self.validation_docs[i]), "share": float(p[i])}
            if total_tokens is not None and self.train_tokens[i] > 0:
                row["epochs"] = float(p[i] * total_tokens / self.train_tokens[i])
            rows.append(row)
        return rows

    # -- training batches --------------------------------------------------------------------------
    def _make_order(self, phases: Sequence[DataPhase]) -> WithoutReplacementOrder:
        if self._stage_starts is None:
            self._stages[0].resolved_start(None)  # raises: placing the stages needs the horizon
        return WithoutReplacementOrder(self.train_tokens, phases, self._stage_starts, self._probs, self.config.seed)

    def data_order(self, batch_size: int | None = None, seq_len: int | None = None) -> WithoutReplacementOrder:
        """The without-replacement order this loader serves: over its schedule, or (without one) over a
        run of constant ``(batch_size, seq_len)``."""
        if self.order != WITHOUT_REPLACEMENT_V1:
            raise MixtureError(f"the mixture's data order is {self.order!r}, which has no cursors")
        if self.schedule is not None:
            return self._orders[None]
        if batch_size is None or seq_len is None:
            raise ValueError("a loader without a schedule needs the batch shape (batch_size, seq_len)")
        key = (int(batch_size), int(seq_len))
        order = self._orders.get(key)
        if order is None:
            order = self._orders[key] = self._make_order((DataPhase(0, *key),))
        return order

    def tokens_consumed(self, step: int, batch_size: int | None = None, seq_len: int | None = None
                        ) -> dict[str, int]:
        """Training tokens each source has given to batches ``0 .. step-1`` (input positions), in closed
        form: the per-source cursors of the without-replacement order."""
        n = self.data_order(batch_size, seq_len).consumed(step)
        return {name: int(x) for name, x in zip(self.source_names, n)}

    def plan(self, step: int, batch_size: int, seq_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(source index, start token) of each row of batch ``step``: the only thing that decides a batch.

        Without replacement (:mod:`marin.data.order`) the rows follow each source's cursor and are
        shuffled within the batch by a generator keyed by (seed, step); ``seq_len`` is then required
        (windows are counted in tokens). The legacy order draws every row independently."""
        if step < 0 or batch_size <= 0:
            raise ValueError(f"need step >= 0 and batch_size > 0, got step={step}, batch_size={batch_size}")
        if self.order == WITHOUT_REPLACEMENT_V1:
            if seq_len is None:
                raise ValueError("the without_replacement_v1 order needs seq_len: plan(step, batch_size, seq_len)")
            src, starts, b, n = self._order_rows(self.data_order(batch_size, seq_len), step)
            if (b, n) != (batch_size, seq_len):
                raise ValueError(f"step {step} is scheduled as {b} rows of {n} tokens, but was asked for "
                                 f"{batch_size} rows of {seq_len}; the data order counts tokens over the schedule")
            perm = _rewound_batch_rng(self.config.seed, step).permutation(b)
            return src[perm], starts[perm]
        rng = _rewound_batch_rng(self.config.seed, step)  # same stream as _batch_rng(seed, step)
        stage = self._stage_index(step)
        cdf = self._cdfs[stage]
        src = np.searchsorted(cdf, rng.random(batch_size), side="right")
        np.minimum(src, len(cdf) - 1, out=src)
        # Guard against float round-off choosing a zero-probability source at the very end of the cdf
        # (skipped when the stage has none: then the loop below could never run).
        if self._has_zero_prob[stage]:
            probs = self._probs[stage]
            while np.any(probs[src] == 0):
                bad = probs[src] == 0
                src[bad] = src[bad] - 1
        starts = np.floor(rng.random(batch_size) * self.train_tokens[src]).astype(np.int64)
        return src.astype(np.int64, copy=False), starts

    def _order_rows(self, order: WithoutReplacementOrder, step: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """``order.plan(step)``, from a chunk of consecutive steps computed in one vectorized pass: the
        closed forms cost about a millisecond per call whatever the batch, which would dominate a small
        batch. A step right after the last chunk starts a chunk of up to :data:`PLAN_CHUNK_ROWS` rows
        (a run reads its steps in order); any other step is planned alone (a resume, a random probe).
        A cache of a pure function: the rows are the same either way."""
        chunk = self._plan_chunk  # one reference: another thread may replace it meanwhile
        if chunk is not None and chunk[0] is order and chunk[1] <= step < chunk[1] + chunk[2].shape[0]:
            i = step - chunk[1]
            return chunk[2][i], chunk[3][i], chunk[4], chunk[5]
        sequential = chunk is not None and chunk[0] is order and step == chunk[1] + chunk[2].shape[0]
        count = 1
        if sequential:
            b = order.segment(step).batch_size
            count = max(1, min(order.steps_in_segment(step), PLAN_CHUNK_ROWS // b))
        src, _, starts, seg = order.windows_of_steps(step, count)
        self._plan_chunk = (order, step, src, starts, seg.batch_size, seg.seq_len)
        return src[0], starts[0], seg.batch_size, seg.seq_len

    def _locate(self, src: np.ndarray, starts: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Global shard ``g`` and offset ``lo`` in it of every row's first token, and ``fast``: whether the
        whole ``n``-token window lies in that shard without wrapping (then it is one slice)."""
        g_pos = self._source_base[src] + starts
        g = np.searchsorted(self._shard_base, g_pos, side="right")
        g -= 1
        lo = g_pos - self._shard_base[g]
        # = (starts + n <= train_tokens[src]) & (lo + n <= shard_len[g]): g is a shard of source src
        fast = g_pos + n <= self._shard_limit[g]
        return g, lo, fast

    def _fill_native(self, kernel: native.NativeKernel, buf: np.ndarray, src: np.ndarray, starts: np.ndarray,
                     n: int) -> None:
        """All-local stores with the native kernel: tokens into ``buf[:4 * rows * n]`` and segment ids into
        the rest, in one pass. Every single-slice window is passed as an address (its shard's mapped base
        + 4 * offset, for the whole batch at once); the few rows that wrap around their source or cross a
        shard are passed as (address, length) pieces, the same ranges the numpy path concatenates.
        The memory maps stay referenced by ``self._shard_maps``, so every address stays valid."""
        rows = src.size
        g, lo, fast = self._locate(src, starts, n)
        maps = self._shard_maps
        addr = maps.addr[g]
        if not addr.all():  # shards touched for the first time: map them (records their addresses)
            for gg in set(g[addr == 0].tolist()):
                maps[gg]
            addr = maps.addr[g]
        row_ptr = np.left_shift(lo.view(np.uint64), np.uint64(2))
        row_ptr += addr
        n_extra, extra = 0, None
        if not fast.all():
            slow = np.flatnonzero(~fast)
            row_ptr[slow] = 0
            pieces = []
            for i, st in zip(src[slow].tolist(), starts[slow].tolist()):
                self._window_addresses(i, st, n, pieces)
            extra = np.array(pieces, dtype=np.uint64)
            n_extra = len(pieces) // 2
        base = buf.ctypes.data
        kernel.fill_rows_at(rows, n, row_ptr.ctypes.data, n_extra, None if extra is None else extra.ctypes.data,
                            base, base + 4 * rows * n, self.eos_id)

    def _window_addresses(self, i: int, start: int, n: int, out: list[int]) -> None:
        """Append (address, length) of every piece of local source ``i``'s ``n``-token training window at
        ``start`` to ``out``, flat: the ranges of :meth:`_local_window_pieces`, with plain ints (~2
        us per row instead of ~4-5 for the slices)."""
        base, maps, shard_base = int(self._source_base[i]), self._shard_maps, self._shard_base_list
        for a, b in ring_pieces(start, n, int(self.train_tokens[i])):
            pos, end = base + a, base + b
            while pos < end:
                g = bisect.bisect_right(shard_base, pos) - 1
                take = min(end, shard_base[g + 1]) - pos
                if not maps.addr[g]:
                    maps[g]
                out += (int(maps.addr[g]) + 4 * (pos - shard_base[g]), take)
                pos += take

    def _fill(self, out: np.ndarray, src: np.ndarray, starts: np.ndarray) -> None:
        """Fill every row. Windows inside one local shard (nearly all, for real sizes) are one slice
        each, located for the whole batch with a single searchsorted over all shards of all sources.

        Local stores: every window (and the few pieces of windows that wrap around their source or
        cross a shard boundary, a few percent of rows) is a slice of a memory map, and one
        ``np.concatenate(..., out=)`` copies them all into the flat output: that saves ~0.3 us per row
        over ``out[r] = window`` and keeps the rare rows off the general :func:`read_ranges` path
        (~20 us each). Stores with remote sources take the general path for their other rows.
        """
        n = out.shape[1]
        g, lo, fast = self._locate(src, starts, n)
        maps = self._shard_maps
        if self._all_local and out.flags.c_contiguous:
            if fast.all():
                windows = [maps[gg][a:a + n] for gg, a in zip(g.tolist(), lo.tolist())]
            else:
                windows = []
                rows = zip(g.tolist(), lo.tolist(), fast.tolist(), src.tolist(), starts.tolist())
                for gg, a, one_slice, i, st in rows:
                    if one_slice:
                        windows.append(maps[gg][a:a + n])
                    else:
                        windows.extend(self._local_window_pieces(i, st, n))
            np.concatenate(windows, out=out.reshape(-1))
            return
        if not self._all_local:
            fast &= self._source_local[src]
        for r, gg, a in zip(np.flatnonzero(fast).tolist(), g[fast].tolist(), lo[fast].tolist()):
            out[r] = maps[gg][a:a + n]
        slow = np.flatnonzero(~fast)
        if slow.size:
            # General path (wrapping windows, windows across shards, remote stores): every piece of
            # every such row in one read_ranges call, so remote pieces are fetched concurrently.
            pieces = [(r, ring_pieces(int(starts[r]), n, int(self.train_tokens[src[r]]))) for r in slow.tolist()]
            arrays = read_ranges([(self.readers[src[r]], a, b) for r, ps in pieces for a, b in ps])
            i = 0
            for r, ps in pieces:
                out[r] = np.concatenate(arrays[i:i + len(ps)]) if len(ps) > 1 else arrays[i]
                i += len(ps)

    def _local_window_pieces(self, i: int, start: int, n: int) -> list[np.ndarray]:
        """Slices of memory maps that make up the ``n``-token training window of local source ``i``
        at ``start``, wrapping around the source's training tokens and crossing shards as needed."""
        reader, first = self.readers[i], self._source_first_shard[i]
        return [self._shard_maps[first + k][lo:hi]
                for a, b in ring_pieces(start, n, int(self.train_tokens[i])) for k, lo, hi in reader._pieces(a, b)]

    def batch(self, step: int, batch_size: int, seq_len: int, rows: slice | None = None) -> dict[str, np.ndarray]:
        """Batch ``step``: 'tokens' and 'segment_ids', int32 [batch_size, seq_len + 1].

        A pure function of (config, schedule, step); inputs are tokens[:, :-1], targets
        tokens[:, 1:]. ``rows``: only those rows of the global batch (a host builds the rows its own
        devices hold and reads only their documents: the cluster reads each batch once, not once per
        host); the result is exactly ``batch(step, batch_size, seq_len)[rows]``. The plan (which source
        and start each row draws) is made for the whole batch, so every host agrees on it.
        """
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        src, starts = self.plan(step, batch_size, seq_len)
        if rows is not None:
            src, starts = src[rows], starts[rows]
            batch_size = src.size
        shape = (batch_size, seq_len + 1)
        n_tok = batch_size * (seq_len + 1)
        self.tokens_read += n_tok
        kernel = native.kernel()
        if kernel is not None and self._all_local:
            # Native kernel (marin/data/native.py): windows copied and segment ids written in one pass,
            # into one allocation (tokens, then segment ids). Bit-identical to the numpy path below.
            buf = np.empty(8 * n_tok, dtype=np.uint8)
            self._fill_native(kernel, buf, src, starts, seq_len + 1)
            return {"tokens": buf[:4 * n_tok].view(np.int32).reshape(shape),
                    "segment_ids": buf[4 * n_tok:].view(np.int32).reshape(shape)}
        # One allocation for the tokens and the EOS mask of the segment-id scan (4 + 1 bytes per token);
        # the segment ids are the one fresh array np.repeat returns. Few, steady allocations matter:
        # with glibc, ~1 MB arrays freed every step otherwise make malloc hand memory back to the OS and
        # page-fault it in again each batch (measured 3-10x slower).
        buf = np.empty(5 * n_tok, dtype=np.uint8)
        tokens = buf[:4 * n_tok].view(np.int32).reshape(shape)
        self._fill(tokens.view(np.uint32), src, starts)  # ids < 2**31: uint32 bytes are the int32 values
        if kernel is not None:  # stores with remote sources: the kernel still writes the segment ids
            return {"tokens": tokens, "segment_ids": kernel.segment_ids(tokens, self.eos_id)}
        eos_mask = buf[4 * n_tok:].view(bool).reshape(shape)
        return {"tokens": tokens, "segment_ids": segment_ids_from_eos(tokens, self.eos_id, scratch=eos_mask)}

    # -- validation --------------------------------------------------------------------------------
    def _validation_sources(self, domain: str) -> list[int]:
        if domain in self.source_names:
            idx = [self.source_names.index(domain)]
        else:
            idx = [i for i, n in enumerate(self.source_names) if split_source_name(n)[0] == domain]
            if not idx:
                domains = sorted({split_source_name(n)[0] for n in self.source_names})
                raise KeyError(f"unknown domain or source {domain!r}; domains: {domains}")
        idx = [i for i in idx if self.total_tokens[i] > self.train_tokens[i]]
        if not idx:
            raise MixtureError(
                f"{domain!r} has no validation documents (validation_fraction={self.config.validation_fraction})"
            )
        return idx

    def validation_tokens(self, domain: str) -> int:
        """Held-out tokens of a domain (all its buckets) or of one ``domain/bucket`` source."""
        return int(sum(self.total_tokens[i] - self.train_tokens[i] for i in self._validation_sources(domain)))

    def num_validation_batches(self, domain: str, batch_size: int, seq_len: int) -> int:
        """Batches needed to cover the domain's held-out tokens once (the last one wraps around)."""
        windows = max(1, math.ceil(self.validation_tokens(domain) / (seq_len + 1)))
        return math.ceil(windows / batch_size)

    def validation_batch(self, domain: str, index: int, batch_size: int, seq_len: int) -> dict[str, np.ndarray]:
        """Held-out batch ``index`` of a domain (or ``domain/bucket``): consecutive windows of its
        validation documents (buckets in name order), wrapping to the start after the end. Never
        overlaps training data; deterministic; independent of the seed and the weights."""
        idx = self._validation_sources(domain)
        lens = [int(self.total_tokens[i] - self.train_tokens[i]) for i in idx]
        bounds = np.concatenate([[0], np.cumsum(lens)])
        total = int(bounds[-1])
        n = seq_len + 1
        tokens = np.empty((batch_size, n), dtype=np.int32)
        for r in range(batch_size):
            parts = []
            for a, b in ring_pieces((index * batch_size + r) * n, n, total):
                # map the virtual range [a, b) onto the sources' validation regions
                j = int(np.searchsorted(bounds, a, side="right")) - 1
                while a < b:
                    take = min(b, int(bounds[j + 1])) - a
                    lo = int(self.train_tokens[idx[j]]) + a - int(bounds[j])
                    parts.append(self.readers[idx[j]].read(lo, lo + take))
                    a += take
                    j += 1
            tokens[r] = np.concatenate(parts).view(np.int32)
        return {"tokens": tokens, "segment_ids": segment_ids_from_eos(tokens, self.eos_id)}
