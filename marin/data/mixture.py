"""Mixtures of token-store sources: their configuration and the weights that decide what is sampled.

The loader that packs them into batches is :mod:`marin.data.loader`; the report step that writes the
effective shares is :mod:`marin.data.mixture_report`.

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
  probabilities are the *effective token shares*, reported by ``MixtureLoader.effective_shares``.
  ``stages`` switch weights at given fractions of the run (e.g. uniform first, quality-weighted from
  30%) or at absolute steps, without re-tokenizing anything. A fraction moves with the run's length,
  so every rung of a scaling ladder sees the same schedule shape as the run it predicts.
* **Batches**: row r of batch ``step`` is a window of ``seq_len + 1`` consecutive tokens from one
  source. Documents end in EOS, so windows are packed documents; ``segment_ids`` count EOS tokens
  before each position. Which source and start each row reads is the config's ``order``
  (:mod:`marin.data.order`): ``"without_replacement_v1"`` gives each source a whole number of rows per
  step by its share and walks each source's tokens once per epoch, in token units across
  sequence-length phases and stages; the legacy ``"with_replacement"`` draws every row independently
  (source by share, start uniform over the source's training tokens, a ring) from a counter-based RNG
  keyed by (seed, step). Either way batch ``step`` is a pure function of (config, schedule, step):
  resuming at step N needs no replay.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from marin.data.k40 import split_source_name
from marin.data.order import CURRENT_ORDER, WITH_REPLACEMENT
from marin.execution.fieldcheck import check_fields, check_number
from marin.execution.versioning import added_later, input_field
from marin.runsteps import phase_start_step


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
        try:
            check_fields(self, "MixtureStage.", {"start_step": ">= 0", "start_fraction": "[0, 1]"})
        except ValueError as e:
            raise MixtureError(str(e)) from None
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
        return phase_start_step(self.start_fraction, total_steps)


@dataclass(frozen=True)
class MixtureConfig:
    """A training mixture over one or more token stores (tokenize step outputs)."""

    stores: tuple[str, ...] = input_field()
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
    order: str = added_later(default=CURRENT_ORDER, before=WITH_REPLACEMENT)
    """Which data order the batches follow (:mod:`marin.data.order`): ``"without_replacement_v1"`` (every
    training token once per epoch of its source; the default) or the legacy ``"with_replacement"``.
    Versioned: it changes what a training step reads. A run recorded before the field existed read the
    legacy order: its record reads back as it, and keeps its hash (the legacy order is left out of the
    hash); a new config reads the current order under a hash of its own."""

    def __post_init__(self) -> None:
        try:
            check_fields(self, "mixture.", {"seed": ">= 0", "validation_fraction": "[0, 1]",
                                            "validation_min_documents": ">= 0", "validation_max_documents": ">= 0"})
            for what, weights in (("domain_weights", self.domain_weights), ("quality_weights", self.quality_weights),
                                  *((f"domain_quality_weights[{d!r}]", w)
                                    for d, w in (self.domain_quality_weights or {}).items())):
                for name, w in (weights or {}).items():  # the names are checked against the stores when sampled
                    check_number(f"mixture.{what}[{name!r}]", w, float, ">= 0")
        except ValueError as e:
            raise MixtureError(str(e)) from None


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
