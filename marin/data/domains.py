"""Semantic domains by clustering: fit K clusters on a sample of document embeddings, then assign every
document to its nearest centroid. Two corpus steps in the frame of :mod:`marin.data.corpus_steps`
(Ray tasks per file, resumable through per-file markers, the corrupt-input policy, progress).

**The fit** (:func:`fit_domains`):

1. *sample*, one task per input file: every document gets a priority, a 64-bit hash of (seed, file,
   record); each file keeps its ``sample_documents`` lowest-priority documents, and the step keeps the
   lowest of all files. That is a uniform sample without replacement, the same whichever way the
   files are spread over tasks, and no task holds more than one sample's worth of text;
2. *embed*: the default embedding needs no download: hashed word n-gram TF-IDF
   (:mod:`marin.data.ngram_features`) projected on its first ``dims`` singular vectors (scikit-learn's
   randomized ``TruncatedSVD``, latent semantic analysis) and scaled to unit length, so k-means on it
   clusters by cosine similarity. A user's model plugs in by import path (:class:`Embedding`);
3. *cluster*: scikit-learn's ``KMeans`` (Lloyd, k-means++ seeding, ``n_init`` restarts) on the
   embedded sample; clusters are renumbered by size (``d00`` the largest) and named by their top
   terms (class-based TF-IDF over the sample's words, as BERTopic names topics).

The fit writes ``domain_fit.npz`` (the centroids and the embedding's arrays: inverse document
frequencies and the SVD projection, plain arrays, no pickle) and ``domain_fit.json`` (a name, top terms
and sample share per domain, the embedding's settings, the content hash ``fit_id``).

**The assignment** (:func:`assign_domains`), one task per input file: every document embedded as the
fit embedded its sample and labelled with its nearest centroid; ``labels/<file>.npy`` holds one int16
per record (-1 for a record that is not a document), and ``domain_assignment.json`` the counts per
domain, the fit it used and the files it labelled. Its input is the fit step's output, so a new fit
(another K, sample or embedding) is a new assignment.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np

from marin.data.corpus_steps import (
    WORK_DIR,
    CorpusInput,
    CorpusStep,
    CorpusStepError,
    InputFile,
    file_task,
    fingerprint,
    input_group,
    run_tasks,
)
from marin.data.dedup import mix64
from marin.data.ngram_features import HashedNgrams, content_id, fit_idf, read_fitted, tfidf
from marin.data.readers import iter_documents
from marin.execution.versioning import by_field, input_field, live

logger = logging.getLogger(__name__)

DEFAULT_EMBEDDING = "hashed-tfidf-svd"
FIT_MANIFEST = "domain_fit.json"
FIT_STATE = "domain_fit.npz"
ASSIGN_MANIFEST = "domain_assignment.json"
EMBED_BATCH = 2048
"""Documents embedded at a time by the per-file tasks: the default embedding's memory is a few
megabytes a batch."""


class DomainError(CorpusStepError):
    """A domain step cannot produce its output; the message says why."""


FIT_STEP = CorpusStep("domain fit", DomainError, FIT_MANIFEST, "domain_fit_failures.json")
ASSIGN_STEP = CorpusStep("domain assign", DomainError, ASSIGN_MANIFEST, "domain_assign_failures.json")


def domain_name(i: int) -> str:
    """The directory-safe name of cluster ``i`` (clusters are numbered by size, largest first)."""
    return f"d{i:02d}"


# --------------------------------------------------------------------------------------------------
# The embedding: a component


@dataclass(frozen=True)
class Embedding:
    """How a document becomes a vector.

    model: ``"hashed-tfidf-svd"`` (the default: no download, fitted on the sample) or the import path
        of your own embedding function, ``"package.module:function"``: it takes a list of texts and
        returns a float array ``[len(texts), dims]`` (rows are scaled to unit length before k-means,
        so clusters follow cosine similarity). The function must be importable on every Ray worker.
    version: your model's version: the step's hash sees the import path, not the weights behind it,
        so change this when the model changes (the default embedding ignores it).
    """

    model: str = DEFAULT_EMBEDDING
    features: HashedNgrams = by_field("each n-gram setting named on its own",
                                      default_factory=lambda: HashedNgrams(n_features=1 << 17))
    """The hashed n-grams of the default embedding."""
    dims: int = 64
    """SVD components of the default embedding."""
    version: str = ""

    def validate(self) -> str | None:
        """Why this embedding cannot work, or None (before any file is read)."""
        if self.model == DEFAULT_EMBEDDING:
            if self.dims < 2:
                return f"embedding dims must be at least 2, got {self.dims}"
            return self.features.validate()
        if ":" not in self.model:
            return (f"embedding model {self.model!r} is neither {DEFAULT_EMBEDDING!r} nor an import path "
                    "'package.module:function'")
        try:
            resolve_callable(self.model)
        except DomainError as e:
            return str(e)
        return None


def resolve_callable(path: str) -> Callable[[list[str]], Any]:
    """The function an import path ``"package.module:function"`` names; a clear error when it does not."""
    module, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise DomainError(f"embedding model {path!r}: cannot import {module!r} ({e})") from None
    except AttributeError:
        raise DomainError(f"embedding model {path!r}: module {module!r} has no {attr!r}") from None
    if not callable(fn):
        raise DomainError(f"embedding model {path!r} is not callable")
    return fn


@dataclass(frozen=True)
class FittedEmbedding:
    """What turns texts into the vectors the centroids live among: the spec and, for the default,
    its fitted arrays (``idf`` [n_features], ``projection`` [n_features, dims])."""

    spec: Embedding
    idf: np.ndarray | None = None
    projection: np.ndarray | None = None

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-length embeddings [len(texts), dims] (float64; a row of zeros stays zero)."""
        if self.spec.model == DEFAULT_EMBEDDING:
            x = np.asarray(tfidf(self.spec.features.counts(texts), self.idf) @ self.projection)
        else:
            x = np.asarray(resolve_callable(self.spec.model)(list(texts)), dtype=np.float64)
            if x.ndim != 2 or x.shape[0] != len(texts):
                raise DomainError(f"embedding model {self.spec.model!r} returned shape {x.shape} for "
                                  f"{len(texts)} texts; it must return [len(texts), dims]")
            if not np.isfinite(x).all():
                raise DomainError(f"embedding model {self.spec.model!r} returned NaN or infinite values")
        norms = np.sqrt((x * x).sum(axis=1, keepdims=True))
        return x / np.where(norms > 0, norms, 1.0)


def fit_embedding(spec: Embedding, texts: Sequence[str], seed: int) -> FittedEmbedding:
    """Fit the default embedding on a sample (IDF, then a randomized SVD of the TF-IDF matrix); a
    user's model needs no fit."""
    if spec.model != DEFAULT_EMBEDDING:
        return FittedEmbedding(spec)
    from sklearn.decomposition import TruncatedSVD  # scikit-learn: the curate extra

    counts = spec.features.counts(texts)
    idf = fit_idf(counts)
    svd = TruncatedSVD(n_components=spec.dims, algorithm="randomized", random_state=seed).fit(tfidf(counts, idf))
    return FittedEmbedding(spec, idf, np.ascontiguousarray(svd.components_.T))


def nearest_centroid(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Index of the nearest centroid (squared Euclidean distance, as k-means assigns) of each row."""
    d = (centroids * centroids).sum(axis=1)[None, :] - 2.0 * (x @ centroids.T)
    return np.argmin(d, axis=1)


# --------------------------------------------------------------------------------------------------
# Reading documents in batches


@dataclass
class Batch:
    """Documents of one file, read ``batch`` at a time (:func:`document_batches`)."""

    records: list[int]
    """Record numbers of the documents (as :func:`~marin.data.readers.iter_documents` numbers them)."""
    texts: list[str]
    sizes: list[int]
    skipped: Counter
    """Records skipped so far, by reason (final in the last batch)."""
    n_records: int
    """Records read so far, documents and skipped (final in the last batch)."""


def document_batches(url: str, text_field: str, max_doc_bytes: int, batch: int = EMBED_BATCH) -> Iterator[Batch]:
    """A file's documents ``batch`` at a time; the last batch carries the final counts (and may be empty)."""
    b = Batch([], [], [], Counter(), 0)
    for rec in iter_documents(url, text_field, max_doc_bytes):
        b.n_records = rec.index + 1
        if rec.skip is not None:
            b.skipped[rec.skip] += 1
            continue
        b.records.append(rec.index)
        b.texts.append(rec.text)
        b.sizes.append(rec.nbytes)
        if len(b.texts) >= batch:
            yield b
            b = Batch([], [], [], b.skipped, b.n_records)
    yield b


# --------------------------------------------------------------------------------------------------
# The fit


@dataclass(frozen=True)
class DomainFitConfig:
    """Fit ``k`` domains on a sample of the corpus at ``input_path``."""

    input_path: str = input_field()
    output_path: str = input_field()
    input: CorpusInput = input_group()
    k: int = 40
    """Clusters (semantic domains)."""
    sample_documents: int = 100_000
    """Documents the clusters are fitted on (all of them, if the corpus holds fewer)."""
    embedding: Embedding = by_field("each embedding setting named on its own", default_factory=Embedding)
    n_init: int = 4
    """k-means restarts from new k-means++ seeds; the run with the least inertia is kept."""
    seed: int = 0
    """Seeds the sample, the SVD and k-means."""
    top_terms: int = 10
    """Words listed per domain (its name is the first three)."""
    keep_work: bool = live("whether the sampled texts stay after success, not the output", default=False)

    def validate(self) -> None:
        """Refuse settings that cannot work, before any file is read."""
        self.input.validate()
        if self.k < 2:
            raise DomainError(f"k must be at least 2 clusters, got {self.k}")
        if self.sample_documents < self.k:
            raise DomainError(f"sample_documents ({self.sample_documents}) must be at least k ({self.k})")
        if self.n_init < 1:
            raise DomainError(f"n_init must be at least 1, got {self.n_init}")
        why = self.embedding.validate()
        if why:
            raise DomainError(why)


@dataclass(frozen=True)
class SampleTask:
    file: InputFile
    work: str
    keep: int
    seed: int
    text_field: str
    max_doc_bytes: int
    marker_fp: str


def priorities(seed: int, key: str, records: np.ndarray) -> np.ndarray:
    """A 64-bit sampling priority per record of a file: a hash of (seed, file key, record number)."""
    base = int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "little")
    with np.errstate(over="ignore"):
        return mix64(np.asarray(records, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) ^ np.uint64(base))


def sample_paths(work: str, key: str) -> dict[str, str]:
    base = f"{work}/sample/{key}"
    return {"prio": base + ".npy", "texts": base + ".jsonl", "meta": base + ".json"}


def sample_file(task: SampleTask) -> dict:
    """The ``keep`` lowest-priority documents of one file, written in priority order."""
    return file_task(task.file, sample_paths(task.work, task.file.key)["meta"], task.marker_fp,
                     lambda: _sample_file(task))


def _sample_file(task: SampleTask) -> dict:
    paths = sample_paths(task.work, task.file.key)
    prio = np.zeros(0, np.uint64)
    texts: list[str] = []
    n_docs = n_bytes = 0
    skipped: Counter = Counter()
    for b in document_batches(task.file.url, task.text_field, task.max_doc_bytes):
        n_docs += len(b.texts)
        n_bytes += sum(b.sizes)
        skipped = b.skipped
        prio = np.concatenate([prio, priorities(task.seed, task.file.key, np.array(b.records, np.uint64))])
        texts.extend(b.texts)
        if prio.size > 2 * task.keep:  # prune: memory stays at two samples' worth of text
            top = np.argsort(prio, kind="stable")[: task.keep]
            prio, texts = prio[top], [texts[i] for i in top]
    order = np.argsort(prio, kind="stable")[: task.keep]
    prio, texts = prio[order], [texts[i] for i in order]
    fs, p = fsspec.core.url_to_fs(paths["prio"])
    fs.makedirs(p.rsplit("/", 1)[0], exist_ok=True)
    with fsspec.open(paths["prio"], "wb") as f:
        np.save(f, prio)
    with fsspec.open(paths["texts"], "w", encoding="utf-8") as f:
        f.write("".join(json.dumps(t, ensure_ascii=False) + "\n" for t in texts))
    return {"documents": n_docs, "bytes": n_bytes, "skipped": dict(sorted(skipped.items())), "kept": len(texts)}


def read_sample(work: str, files: Sequence[InputFile], results: Sequence[dict], keep: int) -> list[str]:
    """The ``keep`` lowest-priority documents over all files, in priority order (the driver holds one
    sample's priorities at a time, merged file by file)."""
    best_p = np.zeros(0, np.uint64)
    best_f = np.zeros(0, np.int64)
    for r in results:
        with fsspec.open(sample_paths(work, files[r["index"]].key)["prio"], "rb") as f:
            p = np.load(f)
        best_p = np.concatenate([best_p, p])
        best_f = np.concatenate([best_f, np.full(p.size, r["index"], np.int64)])
        if best_p.size > keep:
            top = np.argsort(best_p, kind="stable")[:keep]
            best_p, best_f = best_p[top], best_f[top]
    texts: list[tuple[int, str]] = []
    for fi in sorted(set(best_f.tolist())):
        with fsspec.open(sample_paths(work, files[fi].key)["texts"], "r", encoding="utf-8") as f:
            mine = np.sort(best_p[best_f == fi])
            for p, line in zip(mine.tolist(), f):  # each file's sample is written in priority order
                texts.append((p, json.loads(line)))
    texts.sort(key=lambda t: t[0])
    return [t for _, t in texts]


def cluster_terms(texts: Sequence[str], labels: np.ndarray, k: int, top: int) -> list[list[str]]:
    """The ``top`` most distinctive words of each cluster by class-based TF-IDF: a word's frequency in
    the cluster's text times log(1 + average words per cluster / the word's frequency overall)."""
    from sklearn.feature_extraction.text import CountVectorizer  # scikit-learn: the curate extra

    try:
        cv = CountVectorizer(lowercase=True, max_features=50_000, token_pattern=r"(?u)\b[^\W\d_]{2,}\b")
        counts = cv.fit_transform(texts)
    except ValueError:  # no word at all in the sample
        return [[] for _ in range(k)]
    vocab = cv.get_feature_names_out()
    per_class = np.zeros((k, counts.shape[1]))
    for c in range(k):
        rows = np.flatnonzero(labels == c)
        if rows.size:
            per_class[c] = np.asarray(counts[rows].sum(axis=0)).ravel()
    totals = per_class.sum(axis=0)
    avg = per_class.sum() / k
    with np.errstate(divide="ignore", invalid="ignore"):
        tf = per_class / np.maximum(per_class.sum(axis=1, keepdims=True), 1)
        score = tf * np.log1p(avg / np.maximum(totals, 1))[None, :]
    return [[str(vocab[j]) for j in np.argsort(-score[c], kind="stable")[:top] if score[c, j] > 0] for c in range(k)]


def fit_domains(config: DomainFitConfig) -> None:
    """Executor step: write ``domain_fit.npz`` and ``domain_fit.json`` (see the module docstring)."""
    from sklearn.cluster import KMeans  # scikit-learn: the curate extra

    config.validate()
    t0 = time.monotonic()
    inputs = config.input
    out = config.output_path.rstrip("/")
    work = f"{out}/{WORK_DIR}"
    files = FIT_STEP.plan(config.input_path, out, inputs)
    tasks = [SampleTask(f, work, config.sample_documents, config.seed, inputs.text_field, inputs.max_doc_bytes,
                        fingerprint([config.sample_documents, config.seed, inputs.text_field, inputs.max_doc_bytes,
                                     f.url, f.size, f.key])) for f in files]
    results = run_tasks(sample_file, tasks, "domain fit: sample", inputs, sizes=[f.size for f in files])
    good, corrupt, skipped, documents = FIT_STEP.check_results(results, out, config.input_path, inputs,
                                                               "nothing was fitted")
    sample = read_sample(work, files, good, config.sample_documents)
    if len(sample) < config.k:
        raise DomainError(f"the corpus under {config.input_path} holds {len(sample)} documents, fewer than "
                          f"k={config.k} clusters; lower k or give it more documents (the sample is kept)")
    if config.embedding.model == DEFAULT_EMBEDDING and len(sample) <= config.embedding.dims:
        raise DomainError(f"the sample holds {len(sample)} documents, not more than the embedding's "
                          f"dims={config.embedding.dims}; lower dims or give it more documents (the sample is kept)")
    t_sample = time.monotonic()
    emb = fit_embedding(config.embedding, sample, config.seed)
    x = emb(sample)
    t_embed = time.monotonic()
    km = KMeans(n_clusters=config.k, n_init=config.n_init, random_state=config.seed).fit(x)
    raw = nearest_centroid(x, km.cluster_centers_)
    sizes = np.bincount(raw, minlength=config.k)
    order = np.argsort(-sizes, kind="stable")  # new cluster i is old cluster order[i]
    centroids = km.cluster_centers_[order]
    labels = np.argsort(order)[raw]
    t_kmeans = time.monotonic()
    terms = cluster_terms(sample, labels, config.k, config.top_terms)
    state = {"centroids": centroids}
    if emb.idf is not None:
        state.update(idf=emb.idf, projection=emb.projection)
    fs, p = fsspec.core.url_to_fs(f"{out}/{FIT_STATE}")
    fs.makedirs(p.rsplit("/", 1)[0], exist_ok=True)
    with fsspec.open(f"{out}/{FIT_STATE}", "wb") as f:
        np.savez(f, **state)
    counts = np.bincount(labels, minlength=config.k)
    import sklearn  # scikit-learn: the curate extra (its version is recorded)

    manifest = {
        "kind": "domain_fit",
        "fit_id": content_id(state),
        "input_path": config.input_path,
        "k": config.k,
        "embedding": {"model": config.embedding.model, "version": config.embedding.version,
                      "dims": int(centroids.shape[1]), **(
                          {"features": vars(config.embedding.features)}
                          if config.embedding.model == DEFAULT_EMBEDDING else {})},
        "params": {"sample_documents": config.sample_documents, "n_init": config.n_init, "seed": config.seed,
                   "text_field": inputs.text_field, "max_doc_bytes": inputs.max_doc_bytes,
                   "scikit_learn": sklearn.__version__},
        "sample": {"documents": len(sample), "corpus_documents": documents, "files": len(good),
                   "skipped": dict(sorted(skipped.items()))},
        "inertia": float(((x - centroids[labels]) ** 2).sum()),
        "domains": [{"name": domain_name(i), "title": " ".join(terms[i][:3]) or domain_name(i),
                     "top_terms": terms[i], "sample_documents": int(counts[i]),
                     "sample_share": round(float(counts[i]) / len(sample), 6)} for i in range(config.k)],
        "skipped_files": [{"source": r["source"], "input_file": r["url"], "reason": r["error"]} for r in corrupt],
        "seconds": {"sample": round(t_sample - t0, 3), "embed": round(t_embed - t_sample, 3),
                    "kmeans": round(t_kmeans - t_embed, 3), "total": round(time.monotonic() - t0, 3)},
    }
    FIT_STEP.finish(out, manifest, config.keep_work)
    logger.info("domain fit %s: k=%d on %d of %d documents, largest %s (%s)", out, config.k, len(sample), documents,
                manifest["domains"][0]["name"], manifest["domains"][0]["title"])


# --------------------------------------------------------------------------------------------------
# Reading a fit


@dataclass(frozen=True)
class DomainFit:
    """A finished fit, as the assignment and the layout read it."""

    path: str
    manifest: dict
    embedding: FittedEmbedding
    centroids: np.ndarray

    @property
    def k(self) -> int:
        return int(self.centroids.shape[0])

    @property
    def names(self) -> list[str]:
        return [d["name"] for d in self.manifest["domains"]]

    def assign(self, texts: Sequence[str]) -> np.ndarray:
        """The domain index of each text."""
        return nearest_centroid(self.embedding(texts), self.centroids)


_FITS: dict[str, DomainFit] = {}  # per worker process: a fit is read once


def load_fit(path: str) -> DomainFit:
    """Read the fit step's output at ``path`` (cached per process); a clear error if it is not one."""
    path = path.rstrip("/")
    if path in _FITS:
        return _FITS[path]
    try:
        manifest, state = read_fitted(path, FIT_MANIFEST, FIT_STATE)
    except FileNotFoundError:
        raise DomainError(f"{path} holds no finished domain fit ({FIT_MANIFEST} and {FIT_STATE}); "
                          "give the output of a domain fit step") from None
    e = manifest["embedding"]
    spec = Embedding(model=e["model"], version=e.get("version", ""), dims=e["dims"],
                     **({"features": HashedNgrams(**e["features"])} if "features" in e else {}))
    fit = DomainFit(path, manifest, FittedEmbedding(spec, state.get("idf"), state.get("projection")),
                    state["centroids"])
    _FITS.clear()
    _FITS[path] = fit
    return fit


# --------------------------------------------------------------------------------------------------
# The assignment


@dataclass(frozen=True)
class DomainAssignConfig:
    """Label every document of the corpus at ``input_path`` with its nearest domain of the fit at
    ``fit_path`` (a domain fit step's output)."""

    input_path: str = input_field()
    fit_path: str = input_field()
    output_path: str = input_field()
    input: CorpusInput = input_group()


@dataclass(frozen=True)
class AssignTask:
    file: InputFile
    fit_path: str
    out: str
    text_field: str
    max_doc_bytes: int
    marker_fp: str


def labels_path(out: str, key: str) -> str:
    """Where the assignment keeps one file's labels."""
    return f"{out}/labels/{key}.npy"


def assign_file(task: AssignTask) -> dict:
    """One file: every document's domain, written as one int16 per record (-1: not a document)."""
    return file_task(task.file, f"{task.out}/{WORK_DIR}/assigned/{task.file.key}.json", task.marker_fp,
                     lambda: _assign_file(task))


def _assign_file(task: AssignTask) -> dict:
    fit = load_fit(task.fit_path)
    idx_all: list[int] = []
    lab_all: list[np.ndarray] = []
    n_bytes = n_records = 0
    skipped: Counter = Counter()
    for b in document_batches(task.file.url, task.text_field, task.max_doc_bytes):
        skipped, n_records = b.skipped, b.n_records
        if b.texts:
            idx_all.extend(b.records)
            lab_all.append(fit.assign(b.texts))
            n_bytes += sum(b.sizes)
    labels = np.full(n_records, -1, np.int16)
    if idx_all:
        labels[np.array(idx_all)] = np.concatenate(lab_all).astype(np.int16)
    path = labels_path(task.out, task.file.key)
    fs, p = fsspec.core.url_to_fs(path)
    fs.makedirs(p.rsplit("/", 1)[0], exist_ok=True)
    with fsspec.open(path, "wb") as f:
        np.save(f, labels)
    return {"documents": len(idx_all), "bytes": n_bytes, "records": n_records,
            "skipped": dict(sorted(skipped.items())),
            "per_domain": np.bincount(labels[labels >= 0], minlength=fit.k).tolist()}


def assign_domains(config: DomainAssignConfig) -> None:
    """Executor step: write ``labels/<file>.npy`` per input file and ``domain_assignment.json``."""
    inputs = config.input
    inputs.validate()
    t0 = time.monotonic()
    out = config.output_path.rstrip("/")
    fit = load_fit(config.fit_path)
    files = ASSIGN_STEP.plan(config.input_path, out, inputs)
    tasks = [AssignTask(f, config.fit_path, out, inputs.text_field, inputs.max_doc_bytes,
                        fingerprint([fit.manifest["fit_id"], inputs.text_field, inputs.max_doc_bytes, f.url, f.size,
                                     f.key])) for f in files]
    results = run_tasks(assign_file, tasks, "domain assign", inputs, sizes=[f.size for f in files])
    good, corrupt, skipped, documents = ASSIGN_STEP.check_results(results, out, config.input_path, inputs,
                                                                  "no manifest was written")
    per_domain = np.sum([r["per_domain"] for r in good], axis=0).tolist()
    manifest = {
        "kind": "domain_assignment",
        "input_path": config.input_path,
        "fit_path": config.fit_path,
        "fit_id": fit.manifest["fit_id"],
        "k": fit.k,
        "text_field": inputs.text_field,
        "max_doc_bytes": inputs.max_doc_bytes,
        "documents": documents,
        "skipped": dict(sorted(skipped.items())),
        "domains": [{**{k: d[k] for k in ("name", "title", "top_terms")}, "documents": int(per_domain[i]),
                     "share": round(per_domain[i] / max(documents, 1), 6)}
                    for i, d in enumerate(fit.manifest["domains"])],
        "files": [{"key": files[r["index"]].key, "url": r["url"], "size": files[r["index"]].size,
                   "records": r["records"], "documents": r["documents"]} for r in good],
        "skipped_files": [{"source": r["source"], "input_file": r["url"], "reason": r["error"]} for r in corrupt],
        "seconds": round(time.monotonic() - t0, 3),
    }
    ASSIGN_STEP.finish(out, manifest)
    logger.info("domain assign %s: %d documents into %d domains (largest %d, smallest %d)", out, documents, fit.k,
                max(per_domain), min(per_domain))


def read_assignment(path: str) -> dict:
    """The assignment step's manifest at ``path``; a clear error if there is none."""
    try:
        with fsspec.open(f"{path.rstrip('/')}/{ASSIGN_MANIFEST}", "r") as f:
            return json.load(f)
    except FileNotFoundError:
        raise DomainError(f"{path} holds no finished domain assignment ({ASSIGN_MANIFEST}); give the output of "
                          "a domain assign step") from None


def read_labels(path: str, key: str) -> np.ndarray:
    with fsspec.open(labels_path(path.rstrip("/"), key), "rb") as f:
        return np.load(f)
