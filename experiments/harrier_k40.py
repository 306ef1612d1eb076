"""Deduplicate, decontaminate and tokenize the real Harrier K40 corpus: 40 semantic domains x 5
quality buckets from an S3 root.

    python experiments/harrier_k40.py --prefix s3://my-bucket/marin --dry_run true   # plan only, no network
    python experiments/harrier_k40.py --prefix s3://my-bucket/marin                  # run on a Ray cluster

Where the data lives is a convention (marin.data.k40.K40Layout): ``{root}/{domain}/{bucket}/*.jsonl.zst``
by default. Point HARRIER_K40_ROOT at a mirror and HARRIER_K40_TEMPLATE at its directory template
if its naming differs.

Before tokenizing, one dedup step over the whole corpus removes exact and near-duplicate documents
within and across domains (the surviving copy is the one in the highest quality bucket), and one
decontamination step removes documents sharing a 13-gram with what the scaling experiments evaluate
on (``DECONTAMINATE_AGAINST``: the IsoFLOP experiment's task by default; add your eval sets or task
files there). The ladder and the hero evaluate on the mixture's held-out split (the last documents
of every source): the corpus-wide dedup is what keeps near-copies of those documents out of the
training part. Both steps write the K40 layout, so one tokenize step per domain (5 bucket sources
each) reads their output; the mixture (weights per domain and per quality bucket) changes later
without re-tokenizing anything. Dedup is corpus-wide, so adding or re-fetching a domain reruns it
and, through it, every domain's tokenize step (their input changed).

Tokenizer: HARRIER_K40_TOKENIZER (a tokenizer.json or its directory, any fsspec path) if set;
otherwise a byte-level BPE with the hero's 128,256-entry vocabulary is trained on a 2 GB sample.
"""

from __future__ import annotations

import dataclasses
import os

from experiments.defaults import (
    default_decontaminate,
    default_decontamination_sets,
    default_dedup,
    default_mixture,
    default_tokenize,
    default_tokenizer,
)
from marin.data import hero_mixture
from marin.data.corpus_steps import CorpusInput
from marin.data.k40 import K40_DOMAINS, K40Layout, published_shares, source_name
from marin.execution import executor_main

K40_ROOT = os.environ.get("HARRIER_K40_ROOT", "s3://harrier-k40/v1")
LAYOUT = K40Layout(K40_ROOT, source_template=os.environ.get("HARRIER_K40_TEMPLATE", "{domain}/{bucket}"))
HERO_VOCAB = 128_256

tokenizer = os.environ.get("HARRIER_K40_TOKENIZER") or default_tokenizer(
    "tokenizers/harrier_k40_bpe128k", K40_ROOT, vocab_size=HERO_VOCAB, max_bytes=2_000_000_000
)

SOURCES = {source_name(d.name, b): LAYOUT.source_dir(d.name, b) for d in K40_DOMAINS for b in LAYOUT.buckets}
deduped = default_dedup("data/harrier_k40/dedup", K40_ROOT, input=CorpusInput(sources=SOURCES))
DECONTAMINATE_AGAINST = default_decontamination_sets()
clean = default_decontaminate("data/harrier_k40/decontaminate", deduped, DECONTAMINATE_AGAINST)

# the steps above write each source under its name ("domain/bucket"), whatever the mirror's template
tokenized = {
    d.name: default_tokenize(
        f"tokenized/harrier_k40/{d.name}",
        clean,
        tokenizer,
        CorpusInput(sources={source_name(d.name, b): source_name(d.name, b) for b in LAYOUT.buckets}),
    )
    for d in K40_DOMAINS
}

# Stage 1 (uniform within each domain) from the start; stage 2 (quality-weighted) from 30% of
# every run that uses the mixture (step 117,042 of the hero's 390,139; the same 30% of each ladder
# rung); for the hero, mid-training for the last 20% of the run (the published 15T + 3.75T split),
# from step 312,112. Which buckets or domains mid-training favours is not published: we assume the
# domain shares stay and the top two quality buckets are weighted up twice as much again as in stage
# 2 (marin.data.hero_mixture says what is published and what is assumed). The quality weights are a
# starting point to tune on the ladder.
QUALITY_WEIGHTS = hero_mixture.QUALITY_WEIGHTS
STAGE2_FRACTION = hero_mixture.QUALITY_STAGE_FRACTION
MIDTRAINING_QUALITY_WEIGHTS = hero_mixture.MIDTRAINING_QUALITY_WEIGHTS


def harrier_k40_mixture(stage2_fraction: float = STAGE2_FRACTION, midtraining: bool = False):
    """The hero's mixture: K40 domain shares; quality-weighted from ``stage2_fraction`` of the run on;
    with ``midtraining``, the mid-training stage for the last 20% of the run (the hero has it; the
    ladder's rungs keep the two pretraining stages: their fit predicts the pretraining loss)."""
    stages = tuple(dataclasses.replace(s, start_fraction=stage2_fraction) if i == 0 else s
                   for i, s in enumerate(hero_mixture.hero_stages(midtraining)))
    return default_mixture(list(tokenized.values()), domain_weights=published_shares(), stages=stages)


if __name__ == "__main__":
    executor_main(steps=list(tokenized.values()),
                  description="Dedup, decontaminate and tokenize Harrier K40 (40 domains x 5 quality buckets)")
