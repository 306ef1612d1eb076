"""A deterministic, K40-shaped miniature corpus: 40 domains x 5 quality buckets, any size.

Why synthetic text has structure: a tiny model trained on it should show a falling loss, different
per-domain losses, and lower loss on higher quality buckets, so the pipeline's evaluation and mixture
effects are visible on a laptop. Each domain is a small *language*: its own vocabulary (words built
from a domain-specific syllable set) and a sparse first-order Markov chain over it (every word has a few
likely successors), so text is predictable once learned and differs between domains. Quality buckets
add noise: with probability ``NOISE[bucket]`` a word is replaced by random characters, and lower
buckets carry spam boilerplate; q5 is clean. Everything is a pure function of (seed, domain, bucket,
document index), so the same config writes byte-identical files.

A miniature can also carry known faults (:class:`PlantedFaults`): exact duplicates, near-duplicates
and documents holding an evaluation set's text, written where the generator put them and listed in
the manifest's ``planted`` entry, so a run shows dedup and decontamination finding them and the
count found can be checked against the count planted.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import math
from dataclasses import dataclass

import fsspec
import numpy as np

from marin.data.decontaminate import read_eval_texts
from marin.data.dedup import REASON_EXACT, REASON_NEAR, normalize_words
from marin.data.k40 import K40_DOMAINS, QUALITY_BUCKETS, K40Layout, make_k40_manifest
from marin.execution.versioning import added_later, input_field

logger = logging.getLogger(__name__)

NOISE: dict[str, float] = {"q1": 0.30, "q2": 0.15, "q3": 0.07, "q4": 0.02, "q5": 0.0}
"""Per-word corruption probability by quality bucket (q5 is clean)."""

BUCKET_FRACTION: dict[str, float] = {"q1": 0.30, "q2": 0.25, "q3": 0.20, "q4": 0.15, "q5": 0.10}
"""Share of a domain's bytes in each bucket: like web data, there is more low-quality text."""

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"
_COMMON = ("the", "of", "and", "to", "in", "is", "for", "on", "with", "as", "by", "that")
_SPAM = ("click here to subscribe", "best price guaranteed", "buy now limited offer", "share this page")
_VOCAB = 240
_SUCCESSORS = 4


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(np.random.SeedSequence(list(key))))


def _domain_index(domain: str) -> int:
    names = [d.name for d in K40_DOMAINS]
    if domain in names:
        return names.index(domain)
    # Domains outside K40 still get a stable language: derive an index from the name's bytes.
    return 1000 + sum((i + 1) * b for i, b in enumerate(domain.encode()))


@dataclass(frozen=True)
class DomainLanguage:
    """The vocabulary and Markov chain that make one domain's text."""

    words: tuple[str, ...]
    successors: np.ndarray  # [V, S] word indices
    probs: np.ndarray  # [S] successor probabilities (shared shape: skewed, so text is learnable)


def domain_language(domain: str, seed: int) -> DomainLanguage:
    """Build (deterministically) the language of one domain."""
    rng = _rng(seed, _domain_index(domain), 7)
    cons = "".join(rng.permutation(list(_CONSONANTS))[:9])
    syllables = [c + v for c in cons for v in _VOWELS]
    words: list[str] = []
    seen: set[str] = set(_COMMON)
    while len(words) < _VOCAB - len(_COMMON):
        n = int(rng.integers(1, 4))
        w = "".join(syllables[int(i)] for i in rng.integers(0, len(syllables), n))
        if w not in seen:
            seen.add(w)
            words.append(w)
    vocab = tuple(words) + _COMMON
    successors = rng.integers(0, len(vocab), size=(len(vocab), _SUCCESSORS))
    probs = np.array([0.55, 0.25, 0.13, 0.07])
    return DomainLanguage(vocab, successors, probs)


def generate_document(
    lang: DomainLanguage, domain_title: str, bucket: str, seed: int, domain_i: int, bucket_i: int, doc: int
) -> str:
    """One document: a title line and 2-8 sentences walked on the domain's Markov chain, plus noise."""
    rng = _rng(seed, domain_i, bucket_i, doc)
    noise = NOISE.get(bucket, 0.0)
    n_sent = int(rng.integers(2, 9))
    lens = rng.integers(6, 16, n_sent)
    total = int(lens.sum())
    picks = rng.choice(_SUCCESSORS, size=total, p=lang.probs)
    noisy = rng.random(total) < noise
    garbage = rng.integers(97, 123, size=(total, 6))
    starts = rng.integers(0, len(lang.words), n_sent)
    sentences = []
    i = 0
    for s in range(n_sent):
        w = int(starts[s])
        out = []
        for _ in range(int(lens[s])):
            out.append(bytes(garbage[i, : 2 + i % 5].astype(np.uint8)).decode() if noisy[i] else lang.words[w])
            w = int(lang.successors[w, picks[i]])
            i += 1
        sentences.append(" ".join(out).capitalize() + ".")
    body = " ".join(sentences)
    if noise and rng.random() < noise * 2:
        body += " " + _SPAM[int(rng.integers(0, len(_SPAM)))] + "!"
    return f"{domain_title} note {doc}.\n{body}"


def generate_documents(domain: str, bucket: str, n_docs: int, seed: int = 0, start: int = 0) -> list[str]:
    """Documents ``start .. start + n_docs`` of one source (pure; used by the step and by tests)."""
    lang = domain_language(domain, seed)
    title = next((d.title for d in K40_DOMAINS if d.name == domain), domain.replace("_", " ").title())
    di = _domain_index(domain)
    bi = QUALITY_BUCKETS.index(bucket) if bucket in QUALITY_BUCKETS else 99
    return [generate_document(lang, title, bucket, seed, di, bi, d) for d in range(start, start + n_docs)]


@dataclass(frozen=True)
class PlantedFaults:
    """Known faults planted in a miniature corpus, each in a different document, so the data steps
    have something to find and what they find can be checked against what was planted.

    * an exact duplicate: a document replaced by a copy of another (case and spacing changed, which
      dedup's normalisation undoes);
    * a near-duplicate: a copy of a document of at least ``NEAR_MIN_WORDS`` words with one word in 50
      replaced by a made-up word, so the two share more than 80% of their 5-word shingles (above
      dedup's default 0.7 Jaccard threshold, where its 20x5 MinHash bands find a pair with
      probability above 0.999);
    * a contaminated document: a document with one text of ``contaminate_from`` appended (a task's
      question with its correct answer, or an evaluation document, as decontamination reads them).
    """

    exact_duplicates: int = 0
    near_duplicates: int = 0
    contaminated: int = 0
    contaminate_from: str | None = input_field(default=None)
    """A jsonl evaluation set or task whose texts are planted (each one at most once); each text needs
    at least as many words as decontamination's n-gram (13 by default) to be found."""


NEAR_MIN_WORDS = 60
"""Fewest words of an original that gets a near-duplicate: one changed word in 50 then keeps the
5-shingle Jaccard similarity of the pair above 0.8."""


@dataclass(frozen=True)
class SyntheticK40Config:
    """Write a miniature K40 under ``output_path`` in the :class:`~marin.data.k40.K40Layout` convention."""

    output_path: str = input_field()
    total_bytes: int = 4_000_000
    """Approximate text bytes in all (split by domain share, then by BUCKET_FRACTION)."""
    seed: int = 0
    domains: tuple[str, ...] | None = None
    """Subset of domain names; None means all 40."""
    buckets: tuple[str, ...] = QUALITY_BUCKETS
    files_per_source: int = 1
    formats: tuple[str, ...] = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet")
    """Formats rotate over sources so every reader path gets used."""
    min_docs_per_source: int = 8
    source_template: str = "{domain}/{bucket}"
    plant: PlantedFaults | None = added_later(default=None)
    """Known duplicates and contamination to plant (None: a clean corpus)."""


_AVG_DOC_BYTES = 330  # measured on the generator's output; used only to size document counts


def _encode_file(fmt: str, docs: list[dict]) -> bytes:
    if fmt == "parquet":
        import pyarrow as pa  # pyarrow: the data extra (slow to import), only for parquet
        import pyarrow.parquet as pq  # (the same)

        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(docs), buf, compression="snappy")
        return buf.getvalue()
    raw = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
    if fmt == "jsonl":
        return raw
    if fmt == "jsonl.gz":
        return gzip.compress(raw, mtime=0)  # mtime=0 keeps the bytes deterministic
    if fmt == "jsonl.zst":
        import zstandard  # zstandard: the data extra, only for .zst files

        return zstandard.ZstdCompressor(level=3).compress(raw)
    raise ValueError(f"unknown format {fmt!r}; choose from jsonl, jsonl.gz, jsonl.zst, parquet")


def generate_k40_miniature(config: SyntheticK40Config) -> None:
    """Executor step: write the miniature corpus and its ``k40_manifest.json``."""
    domains = [d for d in K40_DOMAINS if config.domains is None or d.name in config.domains]
    if config.domains is not None:
        unknown = set(config.domains) - {d.name for d in domains}
        if unknown:
            raise ValueError(f"unknown K40 domains {sorted(unknown)}")
    layout = K40Layout(
        config.output_path, config.source_template, tuple(d.name for d in domains), tuple(config.buckets)
    )
    share_sum = sum(d.share for d in domains)
    frac_sum = sum(BUCKET_FRACTION.get(b, 1.0) for b in config.buckets)
    fs, root = fsspec.core.url_to_fs(config.output_path)
    texts: dict[tuple[str, str], list[str]] = {}
    for d in domains:
        for b in config.buckets:
            nbytes = config.total_bytes * d.share / share_sum * BUCKET_FRACTION.get(b, 1.0) / frac_sum
            n_docs = max(config.min_docs_per_source, math.ceil(nbytes / _AVG_DOC_BYTES))
            texts[(d.name, b)] = generate_documents(d.name, b, n_docs, config.seed)
    planted = plant_faults(texts, config.plant, config.seed) if config.plant else None
    counts: dict[str, dict[str, int]] = {}
    for k, ((dn, b), docs) in enumerate(texts.items()):
        fmt = config.formats[k % len(config.formats)]
        src_dir = layout.source_path(dn, b)
        fs.makedirs(fsspec.core.url_to_fs(src_dir)[1], exist_ok=True)
        per_file = math.ceil(len(docs) / config.files_per_source)
        for fi in range(config.files_per_source):
            chunk = docs[fi * per_file:(fi + 1) * per_file]
            recs = [{"id": record_id(dn, b, fi * per_file + j), "text": t, "domain": dn, "bucket": b}
                    for j, t in enumerate(chunk)]
            with fsspec.open(f"{src_dir}/part-{fi:05d}.{fmt}", "wb") as f:
                f.write(_encode_file(fmt, recs))
        counts[f"{dn}/{b}"] = {
            "documents": len(docs),
            "bytes": sum(len(t.encode()) for t in docs),
            "files": config.files_per_source,
        }
    manifest = make_k40_manifest(counts, domains, synthetic={"seed": config.seed, "total_bytes": config.total_bytes},
                                 source_template=config.source_template)
    if planted is not None:
        manifest["planted"] = planted
    with fsspec.open(layout.manifest_path, "w") as f:
        json.dump(manifest, f, indent=1)
    logger.info("wrote K40 miniature: %d sources, %d bytes under %s", len(counts),
                sum(c["bytes"] for c in counts.values()), config.output_path)


def record_id(domain: str, bucket: str, index: int) -> str:
    """The ``id`` of a miniature's record: its source and its index in the source."""
    return f"{domain}-{bucket}-{index}"


def plant_faults(texts: dict[tuple[str, str], list[str]], plant: PlantedFaults, seed: int) -> dict:
    """Plant ``plant``'s faults into ``texts`` (``{(domain, bucket): documents}``, changed in place),
    each in a different document, and return the truth for the manifest: the counts and, per fault,
    the ids of the records involved. A request the corpus cannot hold is refused in one line."""
    rng = _rng(seed, 5151)
    docs = [(key, i) for key, ds in texts.items() for i in range(len(ds))]
    order = [docs[int(j)] for j in rng.permutation(len(docs))]
    used: set[tuple[tuple[str, str], int]] = set()

    def rid(doc: tuple[tuple[str, str], int]) -> str:
        return record_id(doc[0][0], doc[0][1], doc[1])

    def take(ok=lambda doc: True) -> tuple[tuple[str, str], int]:
        doc = next((doc for doc in order if doc not in used and ok(doc)), None)
        if doc is None:
            raise ValueError(f"cannot plant {plant.exact_duplicates} exact and {plant.near_duplicates} near "
                             f"duplicates and {plant.contaminated} contaminated documents in {len(docs)} "
                             f"documents: plant fewer or generate more text (total_bytes)")
        used.add(doc)
        return doc

    def n_words(doc: tuple[tuple[str, str], int]) -> int:
        return len(normalize_words(texts[doc[0]][doc[1]]))

    truth: dict[str, list[dict[str, str]]] = {REASON_EXACT: [], REASON_NEAR: [], "contaminated": []}
    for _ in range(plant.exact_duplicates):
        original, copy = take(), take()
        words = texts[original[0]][original[1]].split(" ")
        texts[copy[0]][copy[1]] = "  ".join(w.upper() if k % 7 == 0 else w for k, w in enumerate(words))
        truth[REASON_EXACT].append({"copy": rid(copy), "original": rid(original)})
    for _ in range(plant.near_duplicates):
        original, copy = take(lambda doc: n_words(doc) >= NEAR_MIN_WORDS), take()
        words = texts[original[0]][original[1]].split(" ")
        title = 1 + texts[original[0]][original[1]].split("\n", 1)[0].count(" ")  # the title's words stay
        for k in rng.choice(np.arange(title, len(words)), size=max(1, len(words) // 50), replace=False):
            words[int(k)] = "zq" + "".join(chr(97 + int(c)) for c in rng.integers(0, 26, 5))
        texts[copy[0]][copy[1]] = " ".join(words)
        truth[REASON_NEAR].append({"copy": rid(copy), "original": rid(original)})
    if plant.contaminated:
        if plant.contaminate_from is None:
            raise ValueError(f"plant.contaminated is {plant.contaminated} but plant.contaminate_from is None: "
                             "name the evaluation set whose texts to plant")
        evals = read_eval_texts(plant.contaminate_from, "text")
        if len(evals) < plant.contaminated:
            raise ValueError(f"cannot plant {plant.contaminated} contaminated documents from "
                             f"{plant.contaminate_from}: it holds {len(evals)} texts")
        for e in rng.choice(len(evals), size=plant.contaminated, replace=False):
            doc = take()
            texts[doc[0]][doc[1]] += " " + evals[int(e)]
            truth["contaminated"].append({"document": rid(doc), "eval_text": evals[int(e)]})
    return {"counts": {k: len(v) for k, v in truth.items()}, **truth}


def planted_vs_found(planted: dict, dedup_manifest: dict, decontamination_manifest: dict) -> list[str]:
    """Lines saying what dedup and decontamination removed next to what was planted (the manifests as
    the three steps write them): the quickstart's closing summary."""
    counts = planted["counts"]
    removed = dedup_manifest["totals"]["removed"]
    decon = decontamination_manifest["totals"]["removed"]
    sets = ", ".join(decontamination_manifest.get("against", {}))
    return [
        f"dedup removed {removed[REASON_EXACT]} exact duplicates (planted {counts[REASON_EXACT]}) and "
        f"{removed[REASON_NEAR]} near-duplicates (planted {counts[REASON_NEAR]}) of "
        f"{dedup_manifest['totals']['documents_in']:,} documents",
        f"decontamination removed {sum(decon.values())} documents matching {sets} "
        f"(planted {counts['contaminated']})",
    ]


@dataclass(frozen=True)
class PlantedCopy:
    """A document planted as a copy of another: where both are and how the copy was made."""

    copy: tuple[str, int]
    """(source, record number) of the copy."""
    original: tuple[str, int]
    kind: str
    """"exact" (same words, case and spacing changed) or "near" (``changed`` of the words replaced)."""
    changed: float


def write_planted_corpus(root: str, domains: tuple[str, ...] = ("council", "infra", "law"),
                         buckets: tuple[str, ...] = ("q1", "q5"), docs_per_source: int = 50,
                         exact_fraction: float = 0.1, near_fraction: float = 0.1,
                         changed: tuple[float, ...] = (0.01, 0.02, 0.05, 0.2), eval_docs: int = 10,
                         contaminated_docs: int = 5, seed: int = 0, parts: int = 3) -> dict:
    """A K40-layout corpus (one jsonl file per source) with planted duplicates and contamination, and
    the truth: which records are copies of which (exact or with a known fraction of words changed,
    within and across domains), and which records carry a passage of which evaluation document.

    Each document joins ``parts`` miniature documents, so it has a few hundred words. The evaluation
    documents are written to ``{root}_eval/eval.jsonl``. Deterministic in ``seed``."""
    rng = _rng(seed, 4242)
    sources = [(d, b) for d in domains for b in buckets]
    texts: dict[str, list[str]] = {}
    for d, b in sources:
        raw = generate_documents(d, b, docs_per_source * parts, seed)
        texts[f"{d}/{b}"] = [" ".join(raw[i * parts:(i + 1) * parts]) for i in range(docs_per_source)]
    names = list(texts)
    copies: list[PlantedCopy] = []
    for name in names:
        for i in range(docs_per_source):
            u = rng.random()
            if u >= exact_fraction + near_fraction:
                continue
            src = names[int(rng.integers(0, len(names)))]
            j = int(rng.integers(0, docs_per_source))
            if (src, j) == (name, i) or any((src, j) in (c.copy, c.original) for c in copies):
                continue  # one copy per original, never a copy of a copy: the truth is a set of disjoint pairs
            if any(c.original == (name, i) for c in copies):
                continue
            words = texts[src][j].split(" ")
            if u < exact_fraction:
                new = "  ".join(w.upper() if k % 7 == 0 else w for k, w in enumerate(words))
                kind, frac = "exact", 0.0
            else:
                frac = float(changed[int(rng.integers(0, len(changed)))])
                n_change = max(1, round(frac * len(words)))
                for k in rng.choice(len(words), size=n_change, replace=False):
                    words[int(k)] = "zq" + "".join(chr(97 + int(c)) for c in rng.integers(0, 26, 5))
                new, kind = " ".join(words), "near"
            texts[name][i] = new
            copies.append(PlantedCopy((name, i), (src, j), kind, frac))
    evals = [" ".join(generate_documents(domains[k % len(domains)], "q5", parts, seed, start=100_000 + k * parts))
             for k in range(eval_docs)]
    contaminated: list[tuple[str, int, int]] = []
    planted = {c.copy for c in copies} | {c.original for c in copies}
    while len(contaminated) < contaminated_docs:
        name = names[int(rng.integers(0, len(names)))]
        i = int(rng.integers(0, docs_per_source))
        if (name, i) in planted or any(c[:2] == (name, i) for c in contaminated):
            continue
        e = int(rng.integers(0, eval_docs))
        words = evals[e].split(" ")
        start = int(rng.integers(0, max(1, len(words) - 20)))
        texts[name][i] = texts[name][i] + " " + " ".join(words[start:start + 20])
        contaminated.append((name, i, e))
    for name, docs in texts.items():
        path = f"{root.rstrip('/')}/{name}/part-00000.jsonl"
        fs, p = fsspec.core.url_to_fs(path)
        fs.makedirs(p.rsplit("/", 1)[0], exist_ok=True)
        with fsspec.open(path, "w") as f:
            f.write("".join(json.dumps({"id": f"{name}-{i}", "text": t}) + "\n" for i, t in enumerate(docs)))
    eval_path = f"{root.rstrip('/')}_eval/eval.jsonl"
    fs, p = fsspec.core.url_to_fs(eval_path)
    fs.makedirs(p.rsplit("/", 1)[0], exist_ok=True)
    with fsspec.open(eval_path, "w") as f:
        f.write("".join(json.dumps({"text": t}) + "\n" for t in evals))
    return {"copies": copies, "contaminated": contaminated, "eval_path": eval_path, "sources": names,
            "texts": texts}
