"""The Harrier K40 layout: 40 semantic domains x 5 quality buckets, and where their files live.

Harrier K40 is published as a bucket of documents per (domain, quality bucket). Its exact file naming
is not known to this project, so the layout is a *convention* with one configurable template:

    {root}/{source_dir}/<any file>.{jsonl,json,parquet}[.gz|.zst]
    source_dir = K40Layout.source_template.format(domain=..., bucket=...)   # default "{domain}/{bucket}"
    {root}/k40_manifest.json                                                 # optional: shares and counts

A *source* is one (domain, bucket) pair; its name is ``"{domain}/{bucket}"`` everywhere in marin
(token stores, mixture weights, reports). Only three domain shares are published: Council
7.52%, Infra 7.04%, Web Code 6.73%. The other 37 shares are *assumed* equal splits of the remaining
78.71% so the list sums to 1; each entry says whether its share is published or assumed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import fsspec

K40_TOTAL_TOKENS = 23_110_000_000_000
"""Tokens after filtering (published figure); the raw crawl had 25.6T."""

QUALITY_BUCKETS: tuple[str, ...] = ("q1", "q2", "q3", "q4", "q5")
"""Quality buckets, lowest (q1) to highest (q5) quality. The names are our convention."""

MANIFEST_NAME = "k40_manifest.json"


@dataclass(frozen=True)
class K40Domain:
    """One semantic domain: its directory-safe name, a display title and its sampling share."""

    name: str
    title: str
    share: float
    published: bool
    """True when ``share`` is the published number; False when it is our assumption."""


_PUBLISHED: dict[str, tuple[str, float]] = {
    "council": ("Council", 0.0752),
    "infra": ("Infra", 0.0704),
    "web_code": ("Web Code", 0.0673),
}

# The 37 other domain names are our own labels for a plausible topic split of a web-scale corpus.
_ASSUMED_NAMES: tuple[str, ...] = (
    "science", "medicine", "law", "finance", "news", "sports", "entertainment", "education",
    "mathematics", "physics", "chemistry", "biology", "history", "geography", "politics",
    "religion", "philosophy", "literature", "poetry", "travel", "food", "fashion", "automotive",
    "gaming", "music", "film", "art", "home", "parenting", "health", "business", "careers",
    "real_estate", "agriculture", "energy", "forums", "reference",
)


def _build_domains() -> tuple[K40Domain, ...]:
    published = [K40Domain(n, t, s, True) for n, (t, s) in _PUBLISHED.items()]
    rest = 1.0 - sum(d.share for d in published)
    each = rest / len(_ASSUMED_NAMES)
    assumed = [K40Domain(n, n.replace("_", " ").title(), each, False) for n in _ASSUMED_NAMES]
    return tuple(published + assumed)


K40_DOMAINS: tuple[K40Domain, ...] = _build_domains()
assert len(K40_DOMAINS) == 40 and len({d.name for d in K40_DOMAINS}) == 40


def domain_names() -> tuple[str, ...]:
    """The 40 domain names in canonical order (published shares first)."""
    return tuple(d.name for d in K40_DOMAINS)


def published_shares() -> dict[str, float]:
    """Domain -> share of K40 tokens (published or assumed; sums to 1)."""
    return {d.name: d.share for d in K40_DOMAINS}


def source_name(domain: str, bucket: str) -> str:
    """The canonical name of one (domain, bucket) source: ``"domain/bucket"``."""
    return f"{domain}/{bucket}"


def split_source_name(name: str) -> tuple[str, str]:
    """Inverse of :func:`source_name`. A name without ``/`` is a domain with the single bucket ``""``."""
    domain, _, bucket = name.partition("/")
    return domain, bucket


@dataclass(frozen=True)
class K40Layout:
    """Where each (domain, bucket) source lives under a root. Change ``source_template`` to match a mirror."""

    root: str
    source_template: str = "{domain}/{bucket}"
    domains: tuple[str, ...] = dataclasses.field(default_factory=domain_names)
    buckets: tuple[str, ...] = QUALITY_BUCKETS

    def source_dir(self, domain: str, bucket: str) -> str:
        """Directory of one source relative to ``root``."""
        return self.source_template.format(domain=domain, bucket=bucket)

    def source_path(self, domain: str, bucket: str) -> str:
        """Absolute (fsspec) directory of one source."""
        return f"{self.root.rstrip('/')}/{self.source_dir(domain, bucket)}"

    def sources(self) -> dict[str, str]:
        """Source name -> directory relative to root, for every domain x bucket (200 by default)."""
        return {source_name(d, b): self.source_dir(d, b) for d in self.domains for b in self.buckets}

    @property
    def manifest_path(self) -> str:
        return f"{self.root.rstrip('/')}/{MANIFEST_NAME}"


def make_k40_manifest(
    counts: Mapping[str, Mapping[str, int]],
    domains: Sequence[K40Domain] = K40_DOMAINS,
    **extra: object,
) -> dict:
    """The JSON object written as ``k40_manifest.json``: shares per domain and counts per source.

    ``counts`` maps source name -> {"documents": .., "bytes": .., "files": ..}.
    """
    return {
        "format": "k40-layout/1",
        "buckets": list(QUALITY_BUCKETS),
        "domains": [
            {"name": d.name, "title": d.title, "share": d.share, "share_published": d.published}
            for d in domains
        ],
        "sources": {k: dict(v) for k, v in sorted(counts.items())},
        **extra,
    }


def read_k40_manifest(root: str) -> dict:
    """Read ``{root}/k40_manifest.json`` through fsspec."""
    with fsspec.open(f"{root.rstrip('/')}/{MANIFEST_NAME}", "r") as f:
        return json.load(f)
