"""Mixtures of token-store sources, and a stateless loader that packs them into training batches.

Semantics (also in docs/data.md):

* A **source** is one (domain, bucket) stream in a token store, named ``"domain/bucket"``. A store
  made from non-K40 data has sources named by directory; a name without ``/`` is a domain with a single
  bucket.
* **Validation split**: the last documents of every source (``validation_fraction`` of them, clamped
  to [validation_min_documents, validation_max_documents] and always leaving one for training) are
  held out. Training windows are drawn only from the tokens before them, so no held-out document can
  appear in a training batch.
* **Weights**: ``domain_weights`` are token shares per domain (normalized; None means proportional to
  each domain's training tokens). Inside a domain, stage 1 samples *uniformly over tokens* (so a
  bucket's share is its share of the domain's tokens); stage 2 multiplies each bucket's tokens by its
  quality weight (``quality_weights``, optionally overridden per domain). The resulting per-source
  probabilities are the *effective token shares*, reported by :meth:`MixtureLoader.effective_shares`.
  ``stages`` switch weights at given fractions of the run (e.g. uniform first, quality-weighted from
  30%) or at absolute steps, without re-tokenizing anything. A fraction moves with the run's length,
  so every rung of a scaling ladder sees the same schedule shape as the run it predicts.
* **Batches**: row r of batch ``step`` is a window of ``seq_len + 1`` consecutive tokens from one
  source, the source drawn with its effective share and the start drawn uniformly over that source's
  training tokens (treated as a ring, so every token is equally likely at every position). Documents
  end in EOS, so windows are packed documents; ``segment_ids`` count EOS tokens before each position.
  Every draw comes from a counter-based RNG keyed by (seed, step): batch ``step`` is a pure function of
  (config, step, batch_size, seq_len). Resuming at step N needs no replay, and changing ``seq_len``
  with ``batch_size = tokens_per_step // seq_len`` keeps tokens per step constant.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from marin.data import native
from marin.data.k40 import split_source_name
from marin.data.store import SourceReader, TokenizerMismatchError, TokenStore, read_ranges


class MixtureError(ValueError):
    """A mixture config that cannot be sampled (bad weights, unknown names, empty sources)."""


@dataclass(frozen=True)
class MixtureStage:
    """From ``start_fraction`` of the run's steps (or the absolute ``start_step``) on, use these weights
    (None: keep the config's top-level ones). Give exactly one of the two starts.

    Prefer ``start_fraction``: an absolute step means the same point only for one run length (the
    hero's 117,042 is 30% of its run and beyond the end of every ladder rung). A fraction starts at
    ``ceil(fraction x total_steps)``, the same rule as the sequence-length phases.
    """

    start_step: int | None = None
    domain_weights: dict[str, float] | None = None
    quality_weights: dict[str, float] | None = None
    start_fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.start_step is None) == (self.start_fraction is None):
            raise MixtureError(f"MixtureStage needs exactly one of start_step and start_fraction, got "
                               f"start_step={self.start_step}, start_fraction={self.start_fraction}")
        if self.start_fraction is not None and not 0.0 <= self.start_fraction <= 1.0:
            raise MixtureError(f"MixtureStage.start_fraction must be in [0, 1], got {self.start_fraction}")

    def resolved_start(self, total_steps: int | None) -> int:
        """The first step of this stage in a run of ``total_steps`` steps."""
        if self.start_fraction is None:
            return int(self.start_step)
        if total_steps is None:
            raise MixtureError(f"a mixture stage starts at {self.start_fraction:.0%} of the run, but the run's "
                               f"total_steps was not given to the mixture loader")
        from marin.training.schedule import phase_start_step

        return phase_start_step(self.start_fraction, total_steps)


@dataclass(frozen=True)
class MixtureConfig:
    """A training mixture over one or more token stores (tokenize step outputs)."""

    stores: tuple[str, ...]
    domain_weights: dict[str, float] | None = None
    """Domain -> relative token share. None: proportional to each domain's training tokens."""
    quality_weights: dict[str, float] | None = None
    """Bucket -> multiplier on the bucket's tokens within every domain. None: stage 1, uniform."""
    domain_quality_weights: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per-domain overrides of ``quality_weights``."""
    stages: tuple[MixtureStage, ...] = ()
    seed: int = 0
    validation_fraction: float = 0.01
    validation_min_documents: int = 1
    validation_max_documents: int = 1000
    tokenizer: str | None = None
    """Expected tokenizer (path or identity hex); every store must have been written with it."""


# --------------------------------------------------------------------------------------------------
# Pure math


def validation_documents(n_docs: int, fraction: float, min_docs: int, max_docs: int) -> int:
    """How many trailing documents of a source are held out for validation."""
    if n_docs <= 1 or fraction <= 0:
        return 0
    n = max(min_docs, math.ceil(fraction * n_docs))
    return int(min(n, max_docs, n_docs - 1))


def _check_weights(what: str, weights: Mapping[str, float], known: list[str], known_what: str) -> None:
    unknown = sorted(set(weights) - set(known))
    if unknown:
        raise MixtureError(f"{what}: unknown {known_what}(s) {unknown}; the token stores hold {known_what}s {known}")
    for k, w in weights.items():
        if not isinstance(w, (int, float)) or not math.isfinite(w):
            raise MixtureError(f"{what}: weight for {k!r} is {w!r}; weights must be finite numbers")
        if w < 0:
            raise MixtureError(f"{what}: weight for {k!r} is negative ({w}); weights must be >= 0")
    if weights and not any(w > 0 for w in weights.values()):
        raise MixtureError(f"{what}: all weights are zero; at least one must be positive")


def source_probabilities(
    sources: list[str],
    train_tokens: list[int],
    domain_weights: Mapping[str, float] | None,
    quality_weights: Mapping[str, float] | None,
    domain_quality_weights: Mapping[str, Mapping[str, float]] | None = None,
) -> np.ndarray:
    """Effective token share of each source (sums to 1). Pure; raises MixtureError on bad weights.

    share(domain d, bucket b) = w_d / sum(w) * n_db * q_db / sum_b'(n_db' * q_db'),
    with n the source's training tokens and q the bucket's quality weight (1 when not given).
    A domain or bucket missing from a given weight dict gets weight 0.
    """
    domains = [split_source_name(s)[0] for s in sources]
    buckets = [split_source_name(s)[1] for s in sources]
    known_domains = sorted(set(domains))
    known_buckets = sorted(set(buckets))
    n = np.asarray(train_tokens, dtype=np.float64)
    dom_tokens = {d: sum(n[i] for i in range(len(sources)) if domains[i] == d) for d in known_domains}
    if domain_weights is None:
        dw = dict(dom_tokens)
    else:
        _check_weights("domain_weights", domain_weights, known_domains, "domain")
        dw = {d: float(domain_weights.get(d, 0.0)) for d in known_domains}
    if quality_weights is not None:
        _check_weights("quality_weights", quality_weights, known_buckets, "bucket")
    for d, qw in (domain_quality_weights or {}).items():
        if d not in known_domains:
            raise MixtureError(
                f"domain_quality_weights: unknown domain {d!r}; the token stores hold domains {known_domains}"
            )
        _check_weights(
            f"domain_quality_weights[{d!r}]",
            qw,
            sorted({b for i, b in enumerate(buckets) if domains[i] == d}),
            "bucket",
        )
    total_w = sum(dw.values())
    if total_w <= 0:
        raise MixtureError("the mixture has no training tokens: every source is empty")
    probs = np.zeros(len(sources))
    for d in known_domains:
        if dw[d] <= 0:
            continue
        if dom_tokens[d] <= 0:
            raise MixtureError(f"domain {d!r} has weight {dw[d]} but no training tokens")
        qw = (domain_quality_weights or {}).get(d, quality_weights)
        idx = [i for i in range(len(sources)) if domains[i] == d]
        mass = np.array([n[i] * (1.0 if qw is None else float(qw.get(buckets[i], 0.0))) for i in idx])
        if mass.sum() <= 0:
            raise MixtureError(
                f"domain {d!r} has weight {dw[d]} but its quality weights give every bucket with tokens zero weight"
            )
        probs[idx] = dw[d] / total_w * mass / mass.sum()
    return probs / probs.sum()


def segment_ids_from_eos(tokens: np.ndarray, eos_id: int, out: np.ndarray | None = None) -> np.ndarray:
    """Document index within each row: 0 at the row start, +1 after every EOS. Pure, vectorized.

    Equivalent to ``cumsum(tokens == eos) - (tokens == eos)`` per row, but built with one
    ``np.repeat`` over the runs between EOS tokens of the flattened batch (a cumsum costs ~1 ns per
    token, which would dominate the loader), then rebased so every row starts at 0.
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")
    b_rows, n = tokens.shape
    q = np.flatnonzero(tokens.reshape(-1) == eos_id)
    q += 1  # a new document starts after each EOS (a start at the very end is an empty run)
    lengths = np.diff(q, prepend=0, append=b_rows * n)
    running = np.repeat(np.arange(q.size + 1, dtype=np.int32), lengths).reshape(b_rows, n)
    if out is None:
        out = np.empty((b_rows, n), dtype=np.int32)
    np.subtract(running, running[:, :1], out=out)
    return out


def _segment_ids_packed(tokens: np.ndarray, eos_id: int, scratch: np.ndarray | None = None) -> np.ndarray:
    """Fast path of :func:`segment_ids_from_eos` (same result, a new array) for the training loader.

    The reference builds document runs over the flat batch and then rebases every row with a
    subtraction: a second full pass over the output. Here every row's last position is *also*
    treated as a run end, so each run lies inside one row and its value (EOS tokens before it in its
    row) is known per run; one ``np.repeat`` then writes the final ids and nothing touches them again.
    Forcing that boundary is harmless: a document break after a row's last token affects no position
    of that row, and the next row restarts at 0 anyway. What remains is the EOS scan (``==`` into
    ``scratch`` when given, then ``flatnonzero``) and the repeat's single write of the output; on
    fresh batches both are dominated by a branch mispredict per EOS (~10-15 ns each, ~3,500 EOS per
    64 x 4,097 batch), which no vectorized numpy formulation tried avoids (cumsum and SWAR-style
    prefix counts are slower, see docs/data.md). When the native kernel is available
    (:mod:`marin.data.native`), :meth:`MixtureLoader.batch` instead writes the ids while copying the
    windows, in one branch-free C pass; this function is the fallback.
    """
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
    """

    def __init__(self, config: MixtureConfig, total_steps: int | None = None):
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
    def plan(self, step: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(source index, start token) of each row of batch ``step``: the only randomness in a batch."""
        if step < 0 or batch_size <= 0:
            raise ValueError(f"need step >= 0 and batch_size > 0, got step={step}, batch_size={batch_size}")
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

    def batch(self, step: int, batch_size: int, seq_len: int) -> dict[str, np.ndarray]:
        """Batch ``step``: 'tokens' and 'segment_ids', int32 [batch_size, seq_len + 1].

        A pure function of (config, step, batch_size, seq_len); inputs are tokens[:, :-1], targets
        tokens[:, 1:].
        """
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        src, starts = self.plan(step, batch_size)
        shape = (batch_size, seq_len + 1)
        n_tok = batch_size * (seq_len + 1)
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
        return {"tokens": tokens, "segment_ids": _segment_ids_packed(tokens, self.eos_id, scratch=eos_mask)}

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


# --------------------------------------------------------------------------------------------------
# Report step


@dataclass(frozen=True)
class MixtureReportConfig:
    """Write what a mixture will actually sample (``mixture_report.json``) before anyone trains on it."""

    mixture: MixtureConfig
    output_path: str
    total_tokens: int | None = None
    """Planned training tokens; with it the report shows expected epochs per source."""
    total_steps: int | None = None
    """The run's steps; needed when stages start at fractions of the run."""


def mixture_report(config: MixtureReportConfig) -> None:
    """Executor step: effective shares per source and domain for every stage, held-out sizes, epochs."""
    import json

    import fsspec

    loader = MixtureLoader(config.mixture, total_steps=config.total_steps)
    if loader._stage_starts is None:
        raise MixtureError("the mixture has stages at fractions of the run: give the report total_steps")
    stage_steps = [0] + list(loader._stage_starts)
    fractions = [0.0] + [st.start_fraction for st in loader._stages]
    report = {
        "stores": list(config.mixture.stores),
        "tokenizer_identity": loader.tokenizer_identity,
        "vocab_size": loader.vocab_size,
        "total_steps": config.total_steps,
        "stages": [
            {"start_step": s, "start_fraction": f, "domain_shares": loader.effective_domain_shares(s),
             "sources": loader.describe(config.total_tokens, s)}
            for s, f in zip(stage_steps, fractions)
        ],
    }
    with fsspec.open(f"{config.output_path.rstrip('/')}/mixture_report.json", "w") as f:
        json.dump(report, f, indent=1)
