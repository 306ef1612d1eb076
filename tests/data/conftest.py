"""Fixtures for the data track: a small K40-shaped corpus, its tokenizer and token store.

The storage servers (``s3_endpoint``/``s3_bucket`` via moto, ``gcs_endpoint``/``gcs_bucket`` via the
GCS emulator) and the session Ray cluster (``ray_local``, started after the servers so its workers
inherit their endpoints) come from the shared ``tests/conftest.py``.
"""

from __future__ import annotations

import pytest

# --------------------------------------------------------------------------------------------------
# A small K40-shaped corpus, tokenizer and token store shared by the data tests.

MINI_DOMAINS = ("council", "infra", "web_code", "science")


@pytest.fixture(scope="session")
def mini_corpus(tmp_path_factory) -> str:
    from marin.data.synthetic import SyntheticK40Config, generate_k40_miniature

    root = str(tmp_path_factory.mktemp("k40mini"))
    generate_k40_miniature(SyntheticK40Config(root, total_bytes=400_000, seed=3, domains=MINI_DOMAINS))
    return root


@pytest.fixture(scope="session")
def mini_tokenizer(mini_corpus, tmp_path_factory) -> str:
    from marin.data.tokenizer import TrainTokenizerConfig, train_tokenizer

    out = str(tmp_path_factory.mktemp("tok"))
    train_tokenizer(TrainTokenizerConfig(mini_corpus, out, vocab_size=1024))
    return out


@pytest.fixture(scope="session")
def mini_store(mini_corpus, mini_tokenizer, tmp_path_factory) -> str:
    """Tokenized in this process (no Ray), with small shards (2,000 tokens) so sources span several
    shards and windows cross shard edges."""
    from marin.data.tokenize import TokenizeConfig, tokenize

    out = str(tmp_path_factory.mktemp("store"))
    tokenize(TokenizeConfig(mini_corpus, mini_tokenizer, out, shard_max_tokens=2000, batch_docs=16,
                            show_progress=False, use_ray=False))
    return out
