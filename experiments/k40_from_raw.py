"""A K40-shaped token store built from raw text: deduplicate, decontaminate, cluster into K semantic
domains, score with a quality classifier, bucket into q1..q5, tokenize.

    python experiments/k40_from_raw.py --prefix ./local_store       # a few minutes here, on generated text

The raw text is the quickstart's miniature corpus (with its planted duplicates and contaminated
documents) with its layout taken away (every record shuffled into 4 flat files), so the steps below
must find its 40 domains and 5 quality buckets from the text alone; its records keep their true
``domain`` and ``bucket`` fields, so the result can be checked (tests/data/test_k40_build.py measures
it). The corpus and the task it is decontaminated against are the quickstart's own steps: under one
prefix, the two experiments share them. Point ``RAW`` at your own crawl (a directory, file or glob
of jsonl / parquet documents) and the classifier at your own example sets to build the same shape
from it.

1. dedup and decontaminate the raw text (as the quickstart does: its planted copies and
   contaminated documents are removed)
2. fit K domains (default 40) on a sample: hashed n-gram TF-IDF, randomized SVD, k-means; each domain
   named by its top terms (``domain_fit.json``)
3. assign every document to its nearest domain
4. train a quality classifier from a positive and a negative example set (here a generated pair)
5. score every document, bucket it by its domain's score quintiles, and write the K40 layout with
   ``k40_manifest.json`` (documents, bytes and tokens per source; an overview per domain)
6. tokenize the layout and report a mixture over it (uniform first, quality-weighted from 30%)

Run it twice: the second run does nothing. Change ``K`` and the fit, the assignment, the layout and
everything after them run again; change the example sets and only the classifier, the layout and what
follows do; `marin explain experiments/k40_from_raw.py` says which and why.
"""

from __future__ import annotations

from experiments import quickstart
from experiments.defaults import (
    default_decontaminate,
    default_dedup,
    default_domain_assign,
    default_domain_fit,
    default_k40_layout,
    default_mixture,
    default_mixture_report,
    default_quality_classifier,
    default_quality_examples,
    default_raw_text,
    default_tokenize,
    default_tokenizer,
)
from marin.data.mixture import MixtureStage
from marin.execution import ExecutorStep, executor_main

K = 40
"""Semantic domains to find."""
SAMPLE_DOCUMENTS = 2_000
"""Documents the domains are fitted on (the miniature holds about 3,200)."""
EXAMPLES_PER_DOMAIN = 10
"""Generated quality examples per domain and side (positive: clean text, negative: as noisy as q1)."""
QUALITY_WEIGHTS = {"q1": 0.25, "q2": 0.5, "q3": 1.0, "q4": 2.0, "q5": 4.0}


def pipeline(k: int = K, examples_per_domain: int = EXAMPLES_PER_DOMAIN,
             sample_documents: int = SAMPLE_DOCUMENTS) -> dict[str, ExecutorStep]:
    """Every step of the build by its role, for ``k`` domains and a generated example pair of
    ``examples_per_domain`` documents per domain and side."""
    raw = default_raw_text("k40_from_raw/raw", quickstart.corpus, files=4)
    deduped = default_dedup("k40_from_raw/dedup", raw)
    clean = default_decontaminate("k40_from_raw/decontaminate", deduped, against={"quickstart_task": quickstart.task})
    fit = default_domain_fit("k40_from_raw/domain-fit", clean, k=k, sample_documents=sample_documents)
    assignment = default_domain_assign("k40_from_raw/domains", clean, fit)
    examples = default_quality_examples("k40_from_raw/quality-examples", per_domain=examples_per_domain)
    classifier = default_quality_classifier("k40_from_raw/quality-classifier", positive=[examples],
                                            negative=[examples])
    tokenizer = default_tokenizer("k40_from_raw/tokenizer", clean, vocab_size=512)
    layout = default_k40_layout("k40_from_raw/k40", clean, assignment, classifier, tokenizer=tokenizer)
    tokenized = default_tokenize("k40_from_raw/tokenized", layout, tokenizer)
    mixture = default_mixture([tokenized], stages=(MixtureStage(start_fraction=0.3, quality_weights=QUALITY_WEIGHTS),))
    report = default_mixture_report("k40_from_raw/mixture", mixture, total_tokens=1_000_000, total_steps=100)
    return {"corpus": quickstart.corpus, "raw": raw, "dedup": deduped, "decontaminate": clean, "domain_fit": fit,
            "domain_assign": assignment, "quality_examples": examples, "quality_classifier": classifier,
            "tokenizer": tokenizer, "layout": layout, "tokenized": tokenized, "mixture_report": report}


steps = pipeline()

if __name__ == "__main__":
    import json

    import fsspec

    result = executor_main(steps=[steps["mixture_report"]],
                           description=f"K40 layout from raw text: dedup, decontaminate, {K} domains, 5 quality "
                                       "buckets, tokenize")
    if result.finished(steps["layout"]):
        with fsspec.open(f"{result.plan.planned(steps['layout']).output_path}/k40_manifest.json") as f:
            m = json.load(f)
        print(f"\nK40 layout: {m['totals']['documents']:,} documents, {m['totals'].get('tokens', 0):,} tokens in "
              f"{len(m['sources'])} sources; largest domains:")
        for d in sorted(m["domains"], key=lambda d: -d["share"])[:5]:
            o = m["overview"][d["name"]]
            print(f"  {d['name']} {d['share']:.1%}  {', '.join(o['top_terms'][:5])}")
