"""Per-set and suite-level evaluation metrics (pure, no JAX).

A set's totals are four numbers summed over its documents: documents, predicted tokens, UTF-8 bytes
of the evaluated text, and the summed negative log-likelihood in nats. Everything reported derives
from them, so results of parts of a set (batches, shards, hosts) combine by plain addition:

    loss       = nll / tokens                  (nats per token)
    perplexity = exp(loss)
    bpb        = nll / ln(2) / bytes           (bits per UTF-8 byte: tokenizer-independent)
    macro_bpb  = mean over sets of bpb         (every set counts the same, as Paloma reports)
    micro_bpb  = sum(nll) / ln(2) / sum(bytes) (every byte counts the same)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

LN2 = math.log(2.0)


@dataclass(frozen=True)
class SetTotals:
    """Additive totals of one eval set."""

    documents: int
    tokens: int
    bytes: int
    nll: float  # nats, summed over predicted tokens

    def __add__(self, other: SetTotals) -> SetTotals:
        return SetTotals(self.documents + other.documents, self.tokens + other.tokens, self.bytes + other.bytes,
                         self.nll + other.nll)


def set_metrics(t: SetTotals) -> dict[str, float | int]:
    """documents, tokens, bytes, loss (nats/token), perplexity and bpb of one set."""
    if t.tokens <= 0 or t.bytes <= 0:
        raise ValueError(f"an eval set needs at least one token and one byte, got {t.tokens} tokens, {t.bytes} bytes")
    loss = t.nll / t.tokens
    return {"documents": int(t.documents), "tokens": int(t.tokens), "bytes": int(t.bytes), "loss": float(loss),
            "perplexity": float(math.exp(min(loss, 700.0))), "bpb": float(t.nll / LN2 / t.bytes)}


def suite_metrics(totals: Mapping[str, SetTotals]) -> dict:
    """``{"sets": {name: set_metrics}, "macro_bpb", "micro_bpb"}`` over a suite of sets."""
    if not totals:
        raise ValueError("an eval suite needs at least one set")
    sets = {name: set_metrics(t) for name, t in sorted(totals.items())}
    nll = sum(t.nll for t in totals.values())
    nbytes = sum(t.bytes for t in totals.values())
    return {"sets": sets, "macro_bpb": float(sum(s["bpb"] for s in sets.values()) / len(sets)),
            "micro_bpb": float(nll / LN2 / nbytes)}
