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
def mini_corpus(k40_data) -> str:
    return k40_data.corpus("k40mini", total_bytes=400_000, seed=3, domains=MINI_DOMAINS)


@pytest.fixture(scope="session")
def mini_tokenizer(k40_data, mini_corpus) -> str:
    return k40_data.tokenizer("tok", mini_corpus, vocab_size=1024)


@pytest.fixture(scope="session")
def mini_store(k40_data, mini_corpus, mini_tokenizer) -> str:
    """Tokenized in this process (no Ray), with small shards (2,000 tokens) so sources span several
    shards and windows cross shard edges."""
    return k40_data.store("store", mini_corpus, mini_tokenizer, shard_max_tokens=2000, batch_docs=16)
