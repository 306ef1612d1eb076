"""The data track through s3:// (moto server) and gs:// (GCS emulator), with Ray workers."""

from __future__ import annotations

import gzip
import json

import fsspec
import numpy as np
import pytest

from marin.data.corpus_steps import CorpusInput
from marin.data.loader import MixtureLoader
from marin.data.mixture import MixtureConfig
from marin.data.store import TokenStore
from marin.data.synthetic import SyntheticK40Config, generate_k40_miniature
from marin.data.tokenize import TokenizeConfig, TokenizeError, tokenize
from marin.data.tokenizer import TrainTokenizerConfig, load_tokenizer, train_tokenizer

QUIET = CorpusInput(show_progress=False)

# the shared ray_local starts after the S3 and GCS servers, so Ray workers inherit their endpoints
pytestmark = pytest.mark.usefixtures("ray_local")


def test_s3_corpus_to_gcs_store_and_back(s3_bucket, gcs_bucket, tmp_path):
    corpus = f"{s3_bucket}/k40"
    generate_k40_miniature(SyntheticK40Config(corpus, total_bytes=60_000, seed=5, domains=("council", "infra")))
    train_tokenizer(TrainTokenizerConfig(corpus, f"{gcs_bucket}/tok", vocab_size=600))
    tok = load_tokenizer(f"{gcs_bucket}/tok")

    remote = f"{gcs_bucket}/store"
    tokenize(TokenizeConfig(corpus, f"{gcs_bucket}/tok", remote, QUIET, shard_max_tokens=1500, batch_docs=8))
    local = str(tmp_path / "store")
    tokenize(TokenizeConfig(corpus, f"{gcs_bucket}/tok", local, QUIET, shard_max_tokens=1500, batch_docs=8))
    rs, ls_ = TokenStore.open(remote, tokenizer=tok), TokenStore.open(local, tokenizer=tok)
    assert rs.manifest["sources"] == ls_.manifest["sources"]
    assert len(rs.source_names) == 10
    src = rs.source("council/q1")
    assert not src.is_local and len(src.shards) > 1
    np.testing.assert_array_equal(src.read(100, 2900), ls_.source("council/q1").read(100, 2900))  # ranged reads

    # the loader reads remotely (ranged GETs) and gives exactly the local batches
    cfg = dict(domain_weights={"council": 2, "infra": 1}, seed=1)
    rl = MixtureLoader(MixtureConfig(stores=(remote,), **cfg))
    ll = MixtureLoader(MixtureConfig(stores=(local,), **cfg))
    for step, seq_len in [(0, 64), (5, 1000), (9, 4000)]:
        np.testing.assert_array_equal(rl.batch(step, 4, seq_len)["tokens"], ll.batch(step, 4, seq_len)["tokens"])
    np.testing.assert_array_equal(rl.validation_batch("infra", 0, 2, 32)["tokens"],
                                  ll.validation_batch("infra", 0, 2, 32)["tokens"])

    # the same store on S3
    tokenize(TokenizeConfig(corpus, f"{gcs_bucket}/tok", f"{s3_bucket}/store", QUIET))
    s3s = TokenStore.open(f"{s3_bucket}/store", tokenizer=tok)
    assert s3s.manifest["totals"]["tokens"] == ls_.manifest["totals"]["tokens"]
    d = s3s.source("infra/q5")
    assert tok.decode(d.document(0)[:-1]).startswith("Infra note 0.")


def test_corrupt_object_on_s3_is_named(s3_bucket, mini_tokenizer):
    fs = fsspec.filesystem("s3")
    good = "".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(100)).encode()
    fs.pipe(f"{s3_bucket}/c/law/q1/a.jsonl", good)
    fs.pipe(f"{s3_bucket}/c/law/q1/b.jsonl.gz", gzip.compress(good)[:40])
    with pytest.raises(TokenizeError) as e:
        tokenize(TokenizeConfig(f"{s3_bucket}/c", mini_tokenizer, f"{s3_bucket}/out", QUIET))
    print(e.value)
    assert f"corrupt input file {s3_bucket}/c/law/q1/b.jsonl.gz" in str(e.value)
    with fsspec.open(f"{s3_bucket}/out/tokenize_failures.json") as f:
        assert json.load(f)[0]["input_file"] == f"{s3_bucket}/c/law/q1/b.jsonl.gz"
