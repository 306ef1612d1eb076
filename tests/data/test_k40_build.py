"""The K40 layout from raw text: domains by clustering, quality buckets by a classifier, the layout.

The measured test runs on the quickstart's generated corpus (1 MB, seed 0: 3,167 documents whose
true domain and bucket are fields of each record; without the faults the quickstart plants for dedup
and decontamination) with its layout taken away (shuffled into flat files); every step runs in this
process (the Ray fan-out is the frame's, tested with dedup; the slow test runs the experiment on Ray)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import fsspec
import numpy as np
import pytest

from marin.data.corpus_steps import CorpusInput, plan_files
from marin.data.domains import (
    DomainAssignConfig,
    DomainError,
    DomainFitConfig,
    Embedding,
    assign_domains,
    fit_domains,
    load_fit,
    read_labels,
    read_sample,
)
from marin.data.k40 import K40_DOMAINS, QUALITY_BUCKETS, read_k40_manifest
from marin.data.layout import K40BuildConfig, LayoutError, build_k40_layout, quantile_cuts
from marin.data.ngram_features import HashedNgrams, fit_idf, tfidf
from marin.data.quality import (
    QualityError,
    QualityExamplesConfig,
    QualityTrainConfig,
    load_quality_model,
    train_quality,
    write_quality_examples,
)
from marin.data.raw_text import FlattenConfig, flatten_corpus
from marin.data.readers import iter_documents, list_document_files
from marin.data.synthetic import SyntheticK40Config, domain_language, generate_k40_miniature

LOCAL = CorpusInput(use_ray=False, show_progress=False)
# smaller hashed spaces than the defaults (2^17 and 2^20): the test corpus has a few thousand distinct
# n-grams, so collisions stay rare, and the SVD and the classifier fit in a few seconds
EMBEDDING = Embedding(features=HashedNgrams(n_features=1 << 15), dims=48)
QUALITY_FEATURES = HashedNgrams(n_features=1 << 18, analyzer="char_wb", ngram_min=3, ngram_max=5)


def records(root: str) -> list[tuple[str, dict]]:
    """(source directory relative to root, record) of every record under a K40-layout root."""
    out = []
    for f in list_document_files(root):
        src = "/".join(f.split("/")[-3:-1])
        with fsspec.open(f, "rt", compression="infer") as fh:
            out.extend((src, json.loads(line)) for line in fh)
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The quickstart's corpus, flattened, then fit (k=40), assign, classify and lay out."""
    root = tmp_path_factory.mktemp("k40build")
    p = {name: str(root / name) for name in ("mini", "raw", "fit", "assign", "examples", "clf", "k40")}
    generate_k40_miniature(SyntheticK40Config(p["mini"], total_bytes=1_000_000, seed=0))
    flatten_corpus(FlattenConfig(p["mini"], p["raw"], files=4))
    fit_domains(DomainFitConfig(p["raw"], p["fit"], LOCAL, k=40, sample_documents=2000, embedding=EMBEDDING,
                                keep_work=True))  # the sample stays: the reference pipeline is fitted on it
    assign_domains(DomainAssignConfig(p["raw"], p["fit"], p["assign"], LOCAL))
    write_quality_examples(QualityExamplesConfig(p["examples"], per_domain=10))
    train_quality(QualityTrainConfig(p["clf"], (f"{p['examples']}/positive",), (f"{p['examples']}/negative",),
                                     features=QUALITY_FEATURES))
    build_k40_layout(K40BuildConfig(p["raw"], p["assign"], p["clf"], p["k40"], LOCAL))
    return p


VOCABULARY = {d.name: set(domain_language(d.name, 0).words) for d in K40_DOMAINS}


def vocabulary_share(text: str, domain: str) -> float:
    """The share of a document's body words that are words of its domain's language: the generator's
    own noise measure (noise replaces words by random letters), which no classifier can beat."""
    words = re.findall(r"[a-z]+", text.split("\n", 1)[-1].lower())
    return float(np.mean([w in VOCABULARY[domain] for w in words])) if words else 0.0


def test_recovers_the_generated_domains_and_quality_order(built):
    from scipy.stats import spearmanr
    from sklearn.metrics import adjusted_rand_score

    rows = records(built["k40"])
    assert len(rows) == 3167  # every document of the corpus is in the layout, once
    true_domain = [r["domain"] for _, r in rows]
    found_domain = [src.split("/")[0] for src, _ in rows]
    ari = adjusted_rand_score(true_domain, found_domain)
    # The reference: the true domains with the two largest merged into one cluster and the third split
    # in two (computed here, on these documents). Recovered domains at least this good make at most
    # about one such mistake among 40; random labels score about 0.
    names = [d.name for d in K40_DOMAINS]
    flawed = ["council" if d == "infra" else d for d in true_domain]
    flawed = [f"{d}-{i % 2}" if d == "web_code" else d for i, d in enumerate(flawed)]
    reference = adjusted_rand_score(true_domain, flawed)
    print(f"ARI {ari:.4f} (reference with one merge and one split: {reference:.4f})")
    assert len(set(found_domain)) == 40 and set(true_domain) == set(names)
    assert ari >= reference

    # Quality: the classifier's score orders documents as their true buckets do
    model = load_quality_model(built["clf"])
    texts = [r["text"] for _, r in rows]
    true_rank = [QUALITY_BUCKETS.index(r["bucket"]) for _, r in rows]
    rho = spearmanr(model.score(texts), true_rank).statistic
    oracle = spearmanr([vocabulary_share(r["text"], r["domain"]) for _, r in rows], true_rank).statistic
    print(f"Spearman of scores with true buckets {rho:.4f} (the generator's own noise measure: {oracle:.4f})")
    # The layout uses the score only through its order within a domain, and a mixture favours the high
    # buckets to train on cleaner text; so what must hold is that each recovered bucket is cleaner than
    # the one below it, by the generator's own measure, and that q5 is far cleaner than q1.
    noise = {b: [] for b in QUALITY_BUCKETS}
    for src, r in rows:
        noise[src.split("/")[1]].append(1 - vocabulary_share(r["text"], r["domain"]))
    mean_noise = [float(np.mean(noise[b])) for b in QUALITY_BUCKETS]
    print("mean noise per recovered bucket q1..q5:", [round(x, 4) for x in mean_noise])
    assert all(a > b for a, b in zip(mean_noise, mean_noise[1:]))
    assert mean_noise[0] > 3 * mean_noise[-1]
    # and the ranking keeps most of the order the generator put in (0.7 of the noise measure's own
    # rank correlation: a classifier trained on 720 generated examples, never told the vocabulary)
    assert rho >= 0.7 * oracle


def test_assignment_reproduces_the_fit_and_equals_scikit_learns_own_pipeline(built):
    """The labels are those of scikit-learn's own pipeline fitted on the fit's sample with the same seeds
    (HashingVectorizer -> TfidfTransformer -> TruncatedSVD -> Normalizer -> KMeans), up to numbering."""
    from sklearn.cluster import KMeans
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfTransformer
    from sklearn.metrics import adjusted_rand_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import Normalizer

    fit = load_fit(built["fit"])
    texts, ours = [], []
    for f in plan_files(built["raw"], built["fit"], None):
        labels = read_labels(built["assign"], f.key)
        for rec in iter_documents(f.url):
            texts.append(rec.text)
            ours.append(int(labels[rec.index]))
    ours = np.array(ours)
    assert ours.min() >= 0 and (fit.assign(texts) == ours).all()  # the assignment is the fit's own embedding
    files = plan_files(built["raw"], built["fit"], None)
    sample = read_sample(f"{built['fit']}/_work", files, [{"index": f.index} for f in files], 2000)
    assert len(sample) == 2000 == sum(d["sample_documents"] for d in fit.manifest["domains"])
    counts = EMBEDDING.features.counts(texts)
    tf = TfidfTransformer(sublinear_tf=True).fit(counts)
    # the same arithmetic as TfidfTransformer: equal to rounding
    np.testing.assert_allclose(tfidf(counts, tf.idf_).toarray(), tf.transform(counts).toarray(), rtol=1e-12)
    reference = make_pipeline(
        TfidfTransformer(sublinear_tf=True),
        TruncatedSVD(EMBEDDING.dims, algorithm="randomized", random_state=0),
        Normalizer(),
        KMeans(40, n_init=4, random_state=0),
    ).fit(EMBEDDING.features.counts(sample))
    agreement = adjusted_rand_score(reference.predict(counts), ours)
    print(f"ARI between the assignment and scikit-learn's pipeline: {agreement}")
    # rounding differs between the two (row norms, summation order) by ~1e-16: a document would have to
    # sit that close to the middle of two centroids to change side; allow one such document in 3,167
    assert agreement >= 0.999


def test_the_layout_and_its_manifest(built):
    m = read_k40_manifest(built["k40"])
    assert m["format"] == "k40-layout/1" and m["buckets"] == list(QUALITY_BUCKETS)
    assert len(m["domains"]) == 40 and len(m["sources"]) == 200  # every domain keeps its 5 buckets
    assert m["totals"]["documents"] == sum(s["documents"] for s in m["sources"].values()) == 3167
    assert sum(d["share"] for d in m["domains"]) == pytest.approx(1.0)
    fit = json.loads(Path(built["fit"], "domain_fit.json").read_text())
    clf = json.loads(Path(built["clf"], "quality_classifier.json").read_text())
    assert m["built_from"]["fit"]["fit_id"] == fit["fit_id"]
    assert m["built_from"]["classifier"]["classifier_id"] == clf["classifier_id"]
    for d in m["domains"]:
        o = m["overview"][d["name"]]
        assert o["top_terms"] and o["samples"] and o["score_quantiles"]["p10"] <= o["score_quantiles"]["p90"]
        assert o["share"] == pytest.approx(d["share"], abs=1e-6) and m["share_measure"] == "bytes"
        n = o["documents"]
        # per-domain quintiles: each bucket holds a fifth of the domain, give or take a histogram bin's
        # documents (a bin is 1/256 logit wide; the scores here spread over several logits)
        assert all(abs(c - n / 5) <= max(2, 0.05 * n) for c in o["buckets"].values()), o["buckets"]
    # the tokenize step reads it: one source per domain/bucket directory
    files = list_document_files(built["k40"])
    assert {"/".join(f.split("/")[-3:-1]) for f in files} == set(m["sources"])


def test_quantile_cuts_split_a_histogram_into_fifths():
    hist = np.zeros(100, np.int64)
    hist[10:60] = 2  # 100 documents over 50 bins
    cuts = quantile_cuts(hist)
    per = np.bincount(np.searchsorted(cuts, np.repeat(np.arange(100), hist), side="left"), minlength=5)
    assert per.tolist() == [20, 20, 20, 20, 20]
    assert quantile_cuts(np.zeros(10, np.int64)).tolist() == [0, 0, 0, 0]


def test_quality_score_equals_scikit_learns_decision_function(tmp_path):
    from sklearn.linear_model import LogisticRegression

    write_quality_examples(QualityExamplesConfig(str(tmp_path / "ex"), per_domain=3, domains=("council", "law")))
    feats = HashedNgrams(n_features=1 << 12, analyzer="char_wb", ngram_min=3, ngram_max=4)
    train_quality(QualityTrainConfig(str(tmp_path / "clf"), (str(tmp_path / "ex/positive"),),
                                     (str(tmp_path / "ex/negative"),), features=feats, holdout_fraction=0.0))
    texts = [r.text for side in ("positive", "negative")
             for r in iter_documents(str(tmp_path / f"ex/{side}/part-00000.jsonl"))]
    counts = feats.counts(texts)
    x = tfidf(counts, fit_idf(counts))
    lr = LogisticRegression(C=1.0, class_weight="balanced", max_iter=1000).fit(x, [1] * 6 + [0] * 6)
    # the same arithmetic in another order of summation: equal to rounding
    np.testing.assert_allclose(load_quality_model(str(tmp_path / "clf")).score(texts), lr.decision_function(x),
                               rtol=1e-9, atol=1e-9)


def letter_embedding(texts: list[str]) -> np.ndarray:
    """A user's embedding model: letter frequencies (the seam's contract: texts in, [n, dims] out)."""
    out = np.zeros((len(texts), 26))
    for i, t in enumerate(texts):
        for c, n in Counter(ch for ch in t.lower() if "a" <= ch <= "z").items():
            out[i, ord(c) - 97] = n
    return out


def bad_shape_embedding(texts: list[str]) -> np.ndarray:
    return np.zeros(len(texts))


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("small") / "mini")
    generate_k40_miniature(SyntheticK40Config(root, total_bytes=30_000, seed=1, domains=("council", "law", "news"),
                                              buckets=("q1", "q5")))
    return root


def test_a_users_embedding_by_import_path(small_corpus, tmp_path):
    emb = Embedding(model=f"{__name__}:letter_embedding", version="letters-1")
    fit_domains(DomainFitConfig(small_corpus, str(tmp_path / "fit"), LOCAL, k=3, sample_documents=50, embedding=emb))
    m = json.loads((tmp_path / "fit/domain_fit.json").read_text())
    assert m["embedding"] == {"model": emb.model, "version": "letters-1", "dims": 26}
    assert not (tmp_path / "fit/_work").exists()
    assign_domains(DomainAssignConfig(small_corpus, str(tmp_path / "fit"), str(tmp_path / "assign"), LOCAL))
    a = json.loads((tmp_path / "assign/domain_assignment.json").read_text())
    assert sum(d["documents"] for d in a["domains"]) == a["documents"] > 50


@pytest.mark.parametrize("config, line", [
    (dict(k=500, sample_documents=1000), "holds 101 documents, fewer than k=500 clusters; lower k"),
    (dict(k=1), "k must be at least 2 clusters, got 1"),
    (dict(k=40, sample_documents=10), "sample_documents (10) must be at least k (40)"),
    (dict(embedding=Embedding(dims=1)), "embedding dims must be at least 2, got 1"),
    (dict(embedding=Embedding(features=HashedNgrams(analyzer="char"))), "analyzer must be one of ('word', 'char_wb')"),
    (dict(embedding=Embedding(model="no_such_module_xyz:embed")), "cannot import 'no_such_module_xyz'"),
    (dict(embedding=Embedding(model=f"{__name__}:nothing_here")), "has no 'nothing_here'"),
    (dict(embedding=Embedding(model="sentence-transformers")), "is neither 'hashed-tfidf-svd' nor an import path"),
    (dict(k=2, embedding=Embedding(model=f"{__name__}:bad_shape_embedding")), "returned shape (101,) for 101 texts"),
])
def test_bad_fit_settings_fail_in_one_line(small_corpus, tmp_path, config, line):
    with pytest.raises(DomainError) as e:
        fit_domains(DomainFitConfig(small_corpus, str(tmp_path / "fit"), LOCAL, **{"k": 3, **config}))
    assert line in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_bad_classifier_and_layout_inputs_fail_in_one_line(small_corpus, built, tmp_path):
    with pytest.raises(QualityError) as e:
        train_quality(QualityTrainConfig(str(tmp_path / "clf"), (str(tmp_path),), ()))
    assert str(e.value).startswith("the quality classifier needs both example sets") and "\n" not in str(e.value)
    with pytest.raises(QualityError) as e:
        train_quality(QualityTrainConfig(str(tmp_path / "clf"), (str(tmp_path / "nowhere"),), (str(tmp_path),)))
    assert "positive examples: no document files" in str(e.value) and "\n" not in str(e.value)
    # an assignment of another corpus: refused before anything is scored
    with pytest.raises(LayoutError) as e:
        build_k40_layout(K40BuildConfig(small_corpus, built["assign"], built["clf"], str(tmp_path / "k40"), LOCAL))
    assert "was made from other files than the corpus at" in str(e.value) and "\n" not in str(e.value)
    assert "assign domains to this corpus first" in str(e.value)
    with pytest.raises(LayoutError) as e:
        build_k40_layout(K40BuildConfig(built["raw"], built["assign"], built["clf"], str(tmp_path / "k40"), LOCAL,
                                        bucketing="per_source"))
    assert str(e.value) == "bucketing must be one of ('per_domain', 'global'), got 'per_source'"
    with pytest.raises(DomainError) as e:
        build_k40_layout(K40BuildConfig(built["raw"], str(tmp_path), built["clf"], str(tmp_path / "k40"), LOCAL))
    assert "holds no finished domain assignment" in str(e.value) and "\n" not in str(e.value)


def test_global_buckets_and_a_corrupt_file_skipped(built, tmp_path):
    """With bucketing="global" one set of cuts serves every domain; a corrupt input file is skipped by
    every step under the corrupt-input policy and listed in the layout's manifest."""
    raw = tmp_path / "raw"
    raw.mkdir()
    for f in Path(built["raw"]).glob("*.jsonl.gz"):
        (raw / f.name).write_bytes(f.read_bytes())
    (raw / "part-00009.jsonl.gz").write_bytes(Path(built["raw"], "part-00000.jsonl.gz").read_bytes()[:500])
    lenient = CorpusInput(use_ray=False, show_progress=False, max_corrupt_fraction=0.25)
    assign_domains(DomainAssignConfig(str(raw), built["fit"], str(tmp_path / "assign"), lenient))
    build_k40_layout(K40BuildConfig(str(raw), str(tmp_path / "assign"), built["clf"], str(tmp_path / "k40"), lenient,
                                    bucketing="global", output_format="jsonl"))
    m = read_k40_manifest(str(tmp_path / "k40"))
    assert list(m["bucketing"]["cuts_logit"]) == ["all"] and len(m["bucketing"]["cuts_logit"]["all"]) == 4
    assert m["skipped_files"] == [str(raw / "part-00009.jsonl.gz")] and m["totals"]["skipped_files"] == 1
    per_bucket = Counter()
    for src, s in m["sources"].items():
        per_bucket[src.split("/")[1]] += s["documents"]
    assert sum(per_bucket.values()) == 3167
    assert all(abs(n - 3167 / 5) <= 0.02 * 3167 for n in per_bucket.values()), per_bucket
    assert not (tmp_path / "k40/_work").exists()


def test_changing_k_or_the_example_sets_moves_exactly_the_steps_after_them(tmp_path):
    from experiments.k40_from_raw import pipeline
    from marin.execution.plan import plan_steps

    def paths(**kw) -> dict[str, str]:
        steps = pipeline(**kw)
        plan = plan_steps(list(steps.values()), str(tmp_path))
        return {role: plan.planned(s).output_path for role, s in steps.items()}

    base = paths()
    assert paths() == base  # the same experiment plans the same paths

    def moved(other: dict[str, str]) -> list[str]:
        return sorted(role for role in base if other[role] != base[role])

    after = ["layout", "mixture_report", "tokenized"]
    assert moved(paths(k=20)) == sorted(["domain_fit", "domain_assign", *after])
    assert moved(paths(examples_per_domain=20)) == sorted(["quality_examples", "quality_classifier", *after])


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_the_experiment_runs_and_a_rerun_is_a_no_op(tmp_path):
    """experiments/k40_from_raw.py through the executor on Ray (3.6 min at a load average of 20 on 2 cores)."""
    from experiments.k40_from_raw import steps
    from marin.execution import ExecutorMainConfig, executor_main

    cfg = ExecutorMainConfig(prefix=str(tmp_path), progress=False)
    res = executor_main(cfg, steps=[steps["mixture_report"]])
    assert set(res.outcome.values()) == {"succeeded"} and len(res.outcome) == 13, res.errors
    store = json.loads(Path(res.plan.planned(steps["tokenized"]).output_path, "manifest.json").read_text())
    layout = read_k40_manifest(res.plan.planned(steps["layout"]).output_path)
    decon = json.loads(Path(res.plan.planned(steps["decontaminate"]).output_path,
                            "decontamination_manifest.json").read_text())
    dedup = json.loads(Path(res.plan.planned(steps["dedup"]).output_path, "dedup_manifest.json").read_text())
    # the quickstart's planted copies and contaminated documents are gone before the clustering
    assert dedup["totals"]["documents_out"] < dedup["totals"]["documents_in"] == 3167
    assert decon["totals"]["documents_out"] < decon["totals"]["documents_in"] == dedup["totals"]["documents_out"]
    assert layout["totals"]["documents"] == decon["totals"]["documents_out"] and len(layout["sources"]) == 200
    # the layout's token counts are the store's, less one end-of-document token per document
    assert {k: s["tokens"] + s["documents"] for k, s in layout["sources"].items()} == \
        {k: s["tokens"] for k, s in store["sources"].items()}
    again = executor_main(cfg, steps=[steps["mixture_report"]])
    assert set(again.outcome.values()) == {"cached"}


def test_a_failed_assignment_keeps_its_finished_files_and_a_rerun_redoes_only_the_rest(built, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for f in Path(built["raw"]).glob("*.jsonl.gz"):
        (raw / f.name).write_bytes(f.read_bytes())
    whole = (raw / "part-00003.jsonl.gz").read_bytes()
    (raw / "part-00003.jsonl.gz").write_bytes(whole[:300])  # truncated: a corrupt gzip stream
    strict = CorpusInput(use_ray=False, show_progress=False, on_corrupt="fail")
    out = tmp_path / "assign"
    with pytest.raises(DomainError) as e:
        assign_domains(DomainAssignConfig(str(raw), built["fit"], str(out), strict))
    assert str(e.value).splitlines()[0].startswith("1 of 4 input files failed in the domain assign step; 1 corrupt: "
                                                   "on_corrupt='fail' (finished work is kept; a rerun redoes only")
    done = {p.name: p.stat().st_mtime_ns for p in (out / "labels").glob("*.npy")}
    assert len(done) == 3 and not (out / "domain_assignment.json").exists()
    (raw / "part-00003.jsonl.gz").write_bytes(whole)
    assign_domains(DomainAssignConfig(str(raw), built["fit"], str(out), strict))
    assert {p.name: p.stat().st_mtime_ns for p in (out / "labels").glob("*.npy") if p.name in done} == done
    for f in plan_files(str(raw), str(out), None):  # the same labels as the uninterrupted assignment
        assert (read_labels(str(out), f.key) == read_labels(built["assign"], f.key)).all()
