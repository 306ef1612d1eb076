"""Hashed n-gram TF-IDF features: what the domain embedding and the quality classifier read.

A document becomes a sparse vector of hashed n-gram counts (scikit-learn's ``HashingVectorizer``:
stateless, so any worker makes the same features without a shared vocabulary), then TF-IDF with
sublinear term frequency and unit L2 norm, the weighting scikit-learn's ``TfidfTransformer`` applies.
A step fits the inverse document frequencies on its sample with ``TfidfTransformer`` and saves them
as an array; :func:`tfidf` applies them with the same arithmetic, so a worker reproduces the fit's
features from arrays alone (no pickled estimator: a pickle is tied to one scikit-learn version and
runs code when loaded).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np

ANALYZERS = ("word", "char_wb")


@dataclass(frozen=True)
class HashedNgrams:
    """Which n-grams are hashed into how many features.

    analyzer: "word" (runs of word characters, as scikit-learn's default token pattern) or
        "char_wb" (character n-grams inside word boundaries, fastText's subwords).
    """

    n_features: int = 1 << 18
    """Hash buckets: collisions are rare once this is well above the distinct n-grams of a sample."""
    analyzer: str = "word"
    ngram_min: int = 1
    ngram_max: int = 2
    lowercase: bool = True

    def validate(self) -> str | None:
        """Why these settings cannot work, or None."""
        if self.analyzer not in ANALYZERS:
            return f"analyzer must be one of {ANALYZERS}, got {self.analyzer!r}"
        if not 1 <= self.ngram_min <= self.ngram_max:
            return f"ngram sizes must satisfy 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}"
        if self.n_features < 2:
            return f"n_features must be at least 2, got {self.n_features}"
        return None

    def vectorizer(self) -> Any:
        """The scikit-learn ``HashingVectorizer`` that makes raw counts (no sign flipping, no norm:
        TF-IDF comes after)."""
        from sklearn.feature_extraction.text import HashingVectorizer  # scikit-learn: the curate extra

        return HashingVectorizer(n_features=self.n_features, analyzer=self.analyzer, lowercase=self.lowercase,
                                 ngram_range=(self.ngram_min, self.ngram_max), alternate_sign=False, norm=None,
                                 dtype=np.float64)

    def counts(self, texts: Sequence[str]) -> Any:
        """Hashed n-gram counts, a CSR matrix [documents, n_features]."""
        return self.vectorizer().transform(texts)


def fit_idf(counts: Any) -> np.ndarray:
    """Smoothed inverse document frequencies of a sample's counts (``TfidfTransformer``'s)."""
    from sklearn.feature_extraction.text import TfidfTransformer  # scikit-learn: the curate extra

    return TfidfTransformer(sublinear_tf=True).fit(counts).idf_.astype(np.float64)


def tfidf(counts: Any, idf: np.ndarray) -> Any:
    """``1 + log(count)`` times ``idf``, each row scaled to unit L2 norm (an empty row stays zero):
    the arithmetic of ``TfidfTransformer(sublinear_tf=True)`` with the saved ``idf``."""
    from sklearn.preprocessing import normalize  # scikit-learn: the curate extra

    x = counts.tocsr().astype(np.float64, copy=True)  # one copy: the caller's counts stay as they are
    np.log(x.data, x.data)
    x.data += 1.0
    x.data *= idf[x.indices]
    return normalize(x, norm="l2", copy=False)


def content_id(arrays: dict[str, np.ndarray]) -> str:
    """A short content hash of named arrays: a fit's or a classifier's identity in the manifests that
    name what a corpus was built with."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        h.update(name.encode() + np.ascontiguousarray(arrays[name]).tobytes())
    return h.hexdigest()[:16]


def read_fitted(path: str, manifest: str, state: str) -> tuple[dict, dict[str, np.ndarray]]:
    """A fitted model's ``manifest`` (JSON) and ``state`` (``.npz``, no pickles) under ``path``, as the
    domain fit and the quality classifier write them; FileNotFoundError if either is missing."""
    with fsspec.open(f"{path}/{manifest}", "r") as f:
        meta = json.load(f)
    with fsspec.open(f"{path}/{state}", "rb") as f:
        z = np.load(f, allow_pickle=False)
        return meta, {k: z[k] for k in z.files}
