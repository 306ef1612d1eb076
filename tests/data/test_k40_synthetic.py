"""The K40 layout facts and the miniature generator's promises (deterministic, learnable, graded)."""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path

import pytest

from marin.data import k40
from marin.data.readers import iter_documents, list_document_files
from marin.data.synthetic import NOISE, SyntheticK40Config, domain_language, generate_documents, generate_k40_miniature


def test_forty_domains_with_published_shares():
    assert len(k40.K40_DOMAINS) == 40
    shares = k40.published_shares()
    assert shares["council"] == 0.0752 and shares["infra"] == 0.0704 and shares["web_code"] == 0.0673
    assert sum(shares.values()) == pytest.approx(1.0)
    published = {d.name for d in k40.K40_DOMAINS if d.published}
    assert published == {"council", "infra", "web_code"}
    # The published three are the largest; every assumed share is the same equal split.
    assumed = {d.share for d in k40.K40_DOMAINS if not d.published}
    assert len(assumed) == 1 and max(assumed) < 0.0673


def test_layout_is_configurable():
    lay = k40.K40Layout("s3://bucket/k40/", source_template="domain={domain}/quality={bucket}")
    assert lay.source_path("infra", "q3") == "s3://bucket/k40/domain=infra/quality=q3"
    assert len(lay.sources()) == 200
    assert lay.sources()["council/q1"] == "domain=council/quality=q1"
    assert k40.split_source_name("web_code/q5") == ("web_code", "q5")
    assert k40.split_source_name("wiki") == ("wiki", "")


def _tree_digest(root: str) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*")) if p.is_file()}


def test_miniature_is_byte_identical_for_a_seed(tmp_path):
    cfg = dict(total_bytes=60_000, seed=11, domains=("council", "law"))
    generate_k40_miniature(SyntheticK40Config(str(tmp_path / "a"), **cfg))
    generate_k40_miniature(SyntheticK40Config(str(tmp_path / "b"), **cfg))
    generate_k40_miniature(SyntheticK40Config(str(tmp_path / "c"), **{**cfg, "seed": 12}))
    a, b, c = (_tree_digest(str(tmp_path / x)) for x in "abc")
    assert a == b
    assert a != c
    # every format of the rotation is used and readable; the manifest counts match the files
    files = list_document_files(str(tmp_path / "a"))
    assert {f.split(".", 1)[1] for f in files} == {"jsonl", "jsonl.gz", "jsonl.zst", "parquet"}
    manifest = json.loads((tmp_path / "a" / k40.MANIFEST_NAME).read_text())
    for f in files:
        src = "/".join(Path(f).parts[-3:-1])
        docs = [r.text for r in iter_documents(f)]
        assert len(docs) == manifest["sources"][src]["documents"]
        assert all(docs)


def test_text_differs_by_domain_and_is_cleaner_in_higher_buckets():
    vocab = {d: set(domain_language(d, 0).words) for d in ("council", "infra")}
    common = set(vocab["council"]) & set(vocab["infra"])
    assert len(common) < 0.2 * len(vocab["council"])  # mostly the shared function words

    def foreign_fraction(bucket: str) -> float:
        words = " ".join(t.split("\n", 1)[1] for t in generate_documents("council", bucket, 200)).split()
        known = vocab["council"]
        return sum(w.strip(".!").lower() not in known for w in words) / len(words)

    fr = [foreign_fraction(b) for b in k40.QUALITY_BUCKETS]
    assert fr == sorted(fr, reverse=True), fr
    assert fr[-1] < 0.05 and fr[0] > 0.2
    assert NOISE["q5"] == 0.0

    # "learnable": clean text compresses far better than noisy text (a proxy for lower LM loss)
    def ratio(bucket):
        raw = "".join(generate_documents("council", bucket, 200)).encode()
        return len(zlib.compress(raw, 9)) / len(raw)

    assert ratio("q5") < ratio("q1") - 0.05
