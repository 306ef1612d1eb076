"""K40 build benchmark: domain assignment and quality scoring throughput against scikit-learn's own
predict, the domain fit's cost as its sample grows, and what the clustering recovers without the
generator's title lines.

    python benchmarks/k40_build_bench.py                       # ~12,700 documents (4 MB), a few minutes here
    python benchmarks/k40_build_bench.py --total-bytes 1000000 --samples 500,1000,2000

The corpus is the miniature generator's (marin.data.synthetic: 40 domains x 5 quality buckets, true
labels known), held in memory. Times are CPU seconds of this process with BLAS and OpenMP held to one
thread (threadpoolctl), best of ``--repeats`` runs alternating ours and the library's, so they are
documents per second per core and the machine's other jobs weigh less.

1. Assignment: ``DomainFit.assign`` (hashed TF-IDF from saved arrays, projection, nearest centroid)
   against a scikit-learn pipeline fitted on the same sample (HashingVectorizer -> TfidfTransformer ->
   TruncatedSVD -> Normalizer -> KMeans) calling its ``predict`` on the same documents; and how often
   the two agree (adjusted Rand index of their labels).
2. Scoring: ``QualityModel.score`` against the pipeline HashingVectorizer -> TfidfTransformer ->
   LogisticRegression calling ``decision_function`` (and ``predict_proba``) on the same documents.
3. The fit (embedding fit + k-means, k=40, n_init=4) at growing sample sizes: seconds per part.
4. Adjusted Rand index of the recovered domains with the true ones, with and without the documents'
   first line (the generator writes the domain's title there, e.g. "Council note 3.").

Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from marin.data.domains import DomainFit, Embedding, fit_embedding  # noqa: E402
from marin.data.k40 import K40_DOMAINS, QUALITY_BUCKETS  # noqa: E402
from marin.data.ngram_features import fit_idf, tfidf  # noqa: E402
from marin.data.quality import QualityModel, default_quality_features  # noqa: E402
from marin.data.synthetic import BUCKET_FRACTION, generate_documents  # noqa: E402

AVG_DOC_BYTES = 330  # the generator's average document, to size the corpus as the miniature step does


def corpus(total_bytes: int, seed: int = 0) -> tuple[list[str], list[int], list[int]]:
    """(texts, true domain, true bucket) sized as the miniature step sizes its sources."""
    texts, dom, buck = [], [], []
    for di, d in enumerate(K40_DOMAINS):
        for bi, b in enumerate(QUALITY_BUCKETS):
            n = max(8, math.ceil(total_bytes * d.share * BUCKET_FRACTION[b] / AVG_DOC_BYTES))
            texts += generate_documents(d.name, b, n, seed)
            dom += [di] * n
            buck += [bi] * n
    return texts, dom, buck


def cpu(fn, repeats: int) -> tuple[float, object]:
    best, out = math.inf, None
    for _ in range(repeats):
        t0 = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t0)
    return best, out


def fit(texts: list[str], emb: Embedding, k: int, seed: int) -> tuple[DomainFit, dict]:
    from sklearn.cluster import KMeans

    t0 = time.process_time()
    fe = fit_embedding(emb, texts, seed)
    x = fe(texts)
    t1 = time.process_time()
    km = KMeans(n_clusters=k, n_init=4, random_state=seed).fit(x)
    t2 = time.process_time()
    return DomainFit("<memory>", {}, fe, km.cluster_centers_), {"embed_s": round(t1 - t0, 3),
                                                                 "kmeans_s": round(t2 - t1, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--total-bytes", type=int, default=4_000_000)
    p.add_argument("--sample", type=int, default=2000, help="documents the assignment's fit uses")
    p.add_argument("--samples", default="1000,2000,4000,8000", help="sample sizes for the fit's cost")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    from scipy.stats import spearmanr
    from sklearn.cluster import KMeans
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfTransformer
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import adjusted_rand_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import Normalizer
    from threadpoolctl import threadpool_limits

    texts, dom, buck = corpus(args.total_bytes)
    n = len(texts)
    rng = np.random.default_rng(0)
    order = rng.permutation(n)
    sample = [texts[i] for i in order[: args.sample]]
    emb = Embedding()
    out: dict = {"documents": n, "sample": args.sample, "n_features": emb.features.n_features, "dims": emb.dims}
    with threadpool_limits(1):
        # 1. assignment
        domain_fit, _ = fit(sample, emb, 40, 0)
        lib = make_pipeline(emb.features.vectorizer(), TfidfTransformer(sublinear_tf=True),
                            TruncatedSVD(emb.dims, algorithm="randomized", random_state=0), Normalizer(),
                            KMeans(40, n_init=4, random_state=0)).fit(sample)
        ours_s = lib_s = math.inf
        for _ in range(args.repeats):  # alternated, best of each
            a, ours = cpu(lambda: domain_fit.assign(texts), 1)
            b, theirs = cpu(lambda: lib.predict(texts), 1)
            ours_s, lib_s = min(ours_s, a), min(lib_s, b)
        out.update(assign_docs_per_s=round(n / ours_s), assign_library_docs_per_s=round(n / lib_s),
                   assign_ratio=round(ours_s / lib_s, 3),
                   assign_agreement_ari=round(adjusted_rand_score(ours, theirs), 4),
                   ari_recovered=round(adjusted_rand_score(dom, ours), 4))
        # 2. scoring
        feats = default_quality_features()
        pos = [t for i, t in enumerate(texts) if buck[i] == 4][::4]
        neg = [t for i, t in enumerate(texts) if buck[i] == 0][::6]
        ex, y = pos + neg, [1] * len(pos) + [0] * len(neg)
        counts = feats.counts(ex)
        idf = fit_idf(counts)
        lr = LogisticRegression(class_weight="balanced", max_iter=1000).fit(tfidf(counts, idf), y)
        model = QualityModel(feats, idf, lr.coef_.ravel(), float(lr.intercept_[0]))
        lib_q = make_pipeline(feats.vectorizer(), TfidfTransformer(sublinear_tf=True),
                              LogisticRegression(class_weight="balanced", max_iter=1000)).fit(ex, y)
        ours_s = lib_s = proba_s = math.inf
        for _ in range(args.repeats):
            a, scores = cpu(lambda: model.score(texts), 1)
            b, _ = cpu(lambda: lib_q.decision_function(texts), 1)
            c, _ = cpu(lambda: lib_q.predict_proba(texts), 1)
            ours_s, lib_s, proba_s = min(ours_s, a), min(lib_s, b), min(proba_s, c)
        out.update(score_docs_per_s=round(n / ours_s), score_library_docs_per_s=round(n / lib_s),
                   score_library_proba_docs_per_s=round(n / proba_s), score_ratio=round(ours_s / lib_s, 3),
                   score_examples=len(ex), score_spearman=round(float(spearmanr(scores, buck).statistic), 4))
        # 3. the fit's cost as the sample grows
        cost = []
        for m in [int(s) for s in args.samples.split(",") if int(s) <= n]:
            _, t = fit([texts[i] for i in order[:m]], emb, 40, 0)
            cost.append({"sample": m, **t})
        out["fit_cost"] = cost
        # 4. without the title line
        bodies = [t.split("\n", 1)[-1] for t in texts]
        bare, _ = fit([bodies[i] for i in order[: args.sample]], emb, 40, 0)
        out["ari_without_titles"] = round(adjusted_rand_score(dom, bare.assign(bodies)), 4)

    print(f"{n:,} documents; fit sample {args.sample:,}; hashed n-grams 2^{int(math.log2(emb.features.n_features))},"
          f" {emb.dims} dims; CPU s with one thread, best of {args.repeats}")
    print(f"assign: ours {out['assign_docs_per_s']:,} docs/s, scikit-learn predict {out['assign_library_docs_per_s']:,}"
          f" docs/s: ratio (our time / theirs) {out['assign_ratio']}x; labels agree (ARI) "
          f"{out['assign_agreement_ari']}")
    print(f"score:  ours {out['score_docs_per_s']:,} docs/s, decision_function {out['score_library_docs_per_s']:,}, "
          f"predict_proba {out['score_library_proba_docs_per_s']:,} docs/s: ratio {out['score_ratio']}x")
    for c in cost:
        print(f"fit: sample {c['sample']:>6,}  embedding fit {c['embed_s']:7.2f} s  k-means {c['kmeans_s']:7.2f} s")
    print(f"ARI with the true domains: {out['ari_recovered']} (titles kept), {out['ari_without_titles']} (first line "
          f"removed); Spearman of scores with true buckets {out['score_spearman']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
