"""A deterministic, K40-shaped miniature corpus: 40 domains x 5 quality buckets, any size.

Why synthetic text has structure: a tiny model trained on it should show a falling loss, different
per-domain losses, and lower loss on higher quality buckets, so the pipeline's evaluation and mixture
effects are visible on a laptop. Each domain is a small *language*: its own vocabulary (words built
from a domain-specific syllable set) and a sparse first-order Markov chain over it (every word has a few
likely successors), so text is predictable once learned and differs between domains. Quality buckets
add noise: with probability ``NOISE[bucket]`` a word is replaced by random characters, and lower
buckets carry spam boilerplate; q5 is clean. Everything is a pure function of (seed, domain, bucket,
document index), so the same config writes byte-identical files.
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

from marin.data.k40 import K40_DOMAINS, QUALITY_BUCKETS, K40Layout, make_k40_manifest
from marin.execution.versioning import input_field

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
    counts: dict[str, dict[str, int]] = {}
    k = 0
    for d in domains:
        for b in config.buckets:
            nbytes = config.total_bytes * d.share / share_sum * BUCKET_FRACTION.get(b, 1.0) / frac_sum
            n_docs = max(config.min_docs_per_source, math.ceil(nbytes / _AVG_DOC_BYTES))
            texts = generate_documents(d.name, b, n_docs, config.seed)
            fmt = config.formats[k % len(config.formats)]
            k += 1
            src_dir = layout.source_path(d.name, b)
            fs.makedirs(fsspec.core.url_to_fs(src_dir)[1], exist_ok=True)
            per_file = math.ceil(n_docs / config.files_per_source)
            for fi in range(config.files_per_source):
                chunk = texts[fi * per_file:(fi + 1) * per_file]
                recs = [{"id": f"{d.name}-{b}-{fi * per_file + j}", "text": t, "domain": d.name, "bucket": b}
                        for j, t in enumerate(chunk)]
                with fsspec.open(f"{src_dir}/part-{fi:05d}.{fmt}", "wb") as f:
                    f.write(_encode_file(fmt, recs))
            counts[f"{d.name}/{b}"] = {
                "documents": n_docs,
                "bytes": sum(len(t.encode()) for t in texts),
                "files": config.files_per_source,
            }
    manifest = make_k40_manifest(counts, domains, synthetic={"seed": config.seed, "total_bytes": config.total_bytes},
                                 source_template=config.source_template)
    with fsspec.open(layout.manifest_path, "w") as f:
        json.dump(manifest, f, indent=1)
    logger.info("wrote K40 miniature: %d sources, %d bytes under %s", len(counts),
                sum(c["bytes"] for c in counts.values()), config.output_path)


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
