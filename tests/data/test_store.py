"""Token store format: byte-exact shards, random access against a slow reference, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from marin.data.store import StoreError, TokenizerMismatchError, TokenStore, shard_paths, write_shard
from marin.data.tokenizer import load_tokenizer, train_bpe_tokenizer


def test_shard_round_trip_is_byte_exact(tmp_path):
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 50, 30)
    tokens = rng.integers(0, 2**32 - 1, int(lens.sum()), dtype=np.uint64).astype(np.uint32)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.uint64)
    meta = write_shard(str(tmp_path), "dom/q1", "f-00000", tokens, offsets, {"bytes": 7})
    p = shard_paths(str(tmp_path), "dom/q1", "f-00000")
    assert Path(p["tokens"]).read_bytes() == tokens.astype("<u4").tobytes()
    assert Path(p["docs"]).read_bytes() == offsets.astype("<u8").tobytes()
    assert json.loads(Path(p["meta"]).read_text()) == meta
    assert meta["documents"] == 30 and meta["tokens"] == tokens.size
    with pytest.raises(ValueError, match="doc_offsets must start at 0"):
        write_shard(str(tmp_path), "dom/q1", "bad", tokens, offsets[1:], {})


def _reference_stream(store_path: str, source: str) -> tuple[np.ndarray, np.ndarray]:
    """Slow obvious reference: read every finished shard file whole, in manifest order."""
    m = json.loads(Path(store_path, "manifest.json").read_text())
    toks, starts, base = [], [], 0
    for sh in m["sources"][source]["shards"]:
        p = shard_paths(store_path, source, sh["id"])
        t = np.fromfile(p["tokens"], dtype="<u4")
        o = np.fromfile(p["docs"], dtype="<u8").astype(np.int64)
        toks.append(t)
        starts.extend((o[:-1] + base).tolist())
        base += t.size
    return np.concatenate(toks), np.array(starts + [base])


def test_random_access_matches_reference(mini_store):
    store = TokenStore.open(mini_store)
    src = store.source("council/q1")
    assert len(src.shards) >= 3  # shard_max_tokens=2000 in the fixture: ranges cross shard edges
    ref, doc_starts = _reference_stream(mini_store, "council/q1")
    assert src.num_tokens == ref.size and src.num_documents == doc_starts.size - 1
    rng = np.random.default_rng(1)
    ranges = [
        (int(a), int(min(a + b, ref.size))) for a, b in zip(rng.integers(0, ref.size, 50), rng.integers(0, 5000, 50))
    ]
    for (a, b), got in zip(ranges, src.read_many(ranges)):
        np.testing.assert_array_equal(got, ref[a:b])
    for d in rng.integers(0, src.num_documents, 20).tolist():
        np.testing.assert_array_equal(src.document(d), ref[doc_starts[d]:doc_starts[d + 1]])
        assert src.document(d)[-1] == store.eos_id
    assert src.read(5, 5).size == 0
    with pytest.raises(IndexError, match="outside source council/q1"):
        src.read(0, ref.size + 1)


def test_tokenizer_mismatch_is_a_clear_error(mini_store, mini_tokenizer, tmp_path):
    TokenStore.open(mini_store, tokenizer=mini_tokenizer)  # the right one is fine
    other = train_bpe_tokenizer(iter(["some other corpus entirely"] * 20), vocab_size=280, min_frequency=1)
    (tmp_path / "tokenizer.json").write_text(other.to_str())
    with pytest.raises(TokenizerMismatchError) as e:
        TokenStore.open(mini_store, tokenizer=str(tmp_path))
    print(e.value)
    msg = str(e.value)
    assert mini_store in msg and "Re-tokenize" in msg
    assert load_tokenizer(str(tmp_path)).identity[:16] in msg


def test_missing_store_and_unknown_source(mini_store, tmp_path):
    with pytest.raises(StoreError) as e:
        TokenStore.open(str(tmp_path / "no_store"))
    print(e.value)
    assert "manifest.json is missing" in str(e.value)
    with pytest.raises(KeyError, match="not in token store"):
        TokenStore.open(mini_store).source("council/q9")
