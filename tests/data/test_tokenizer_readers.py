"""Tokenizer identity and loading; document readers and the errors users see for bad input."""

from __future__ import annotations

import gzip
import json

import pytest

from marin.data.readers import CorruptInputError, iter_documents
from marin.data.tokenizer import (
    TokenizerError,
    load_tokenizer,
    load_tokenizer_from_json,
    tokenizer_identity,
    train_bpe_tokenizer,
)

TEXTS = ["héllo wörld, ünïcode 🚀 and tabs\tand\nnewlines", "the router routes tokens to experts"] * 50


@pytest.fixture(scope="module")
def tok_json() -> str:
    return train_bpe_tokenizer(iter(TEXTS), vocab_size=300, min_frequency=1).to_str()


def test_identity_ignores_formatting_but_not_content(tok_json):
    pretty = json.dumps(json.loads(tok_json), indent=2)
    assert tokenizer_identity(pretty) == tokenizer_identity(tok_json)
    changed = json.loads(tok_json)
    changed["added_tokens"][0]["content"] = "<|eot|>"
    assert tokenizer_identity(json.dumps(changed)) != tokenizer_identity(tok_json)


def test_byte_level_round_trip_and_literal_eos_is_text(tok_json):
    tok = load_tokenizer_from_json(tok_json)
    assert tok.eos_id == 0 and tok.vocab_size <= 300
    for text in TEXTS[:2] + ["unseen ∑ characters ✓ <|endoftext|> inside"]:
        ids = tok.encode_batch([text])[0]
        assert tok.decode(ids) == text
        if "<|endoftext|>" in text:
            assert tok.eos_id not in ids  # a literal EOS string must not end the document


def test_load_from_file_or_directory(tok_json, tmp_path):
    (tmp_path / "tokenizer.json").write_text(tok_json)
    a = load_tokenizer(str(tmp_path))
    b = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert a.identity == b.identity == tokenizer_identity(tok_json)


def test_tokenizer_errors_users_see(tok_json, tmp_path):
    with pytest.raises(TokenizerError) as e:
        load_tokenizer(str(tmp_path / "nowhere"))
    print(e.value)
    assert "tokenizer not found" in str(e.value) and "nowhere/tokenizer.json" in str(e.value)
    with pytest.raises(TokenizerError) as e:
        load_tokenizer_from_json(tok_json, path="x/tokenizer.json", eos_token="</s>")
    print(e.value)
    assert "'</s>' is not in the vocabulary" in str(e.value)
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        load_tokenizer_from_json("{not json", path="bad.json")


def test_bad_documents_are_classified(tmp_path):
    p = tmp_path / "docs.jsonl"
    lines = [
        json.dumps({"text": "good one"}).encode(),
        b'{"text": "bad \xff\xfe bytes"}',
        json.dumps({"text": ""}).encode(),
        json.dumps({"text": "   \n  "}).encode(),
        json.dumps({"body": "no text field"}).encode(),
        json.dumps({"text": None}).encode(),
        json.dumps({"text": "x" * 200}).encode(),
        b"{truncated json",
        b'{"text": "lone surrogate \\udc80"}',
        b"",
        json.dumps({"text": "good two"}).encode(),
    ]
    p.write_bytes(b"\n".join(lines))
    recs = list(iter_documents(str(p), max_doc_bytes=100))
    assert [r.skip for r in recs] == [None, "invalid_utf8", "empty", "empty", "missing_text", "missing_text",
                                      "too_large", "invalid_json", "invalid_utf8", None]
    assert [r.index for r in recs] == list(range(10))  # the blank line is not a record
    assert [r.text for r in recs if r.text] == ["good one", "good two"]


def test_parquet_missing_column_and_binary_text(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "a.parquet")
    assert [r.skip for r in iter_documents(str(tmp_path / "a.parquet"))] == ["missing_text"] * 2
    pq.write_table(pa.table({"text": pa.array([b"ok", b"\xff"], pa.binary())}), tmp_path / "b.parquet")
    assert [(r.text, r.skip) for r in iter_documents(str(tmp_path / "b.parquet"))] == [
        ("ok", None),
        (None, "invalid_utf8"),
    ]


@pytest.mark.parametrize("kind", ["gz", "zst", "parquet"])
def test_corrupt_file_error_names_the_file(tmp_path, kind):
    raw = "".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(300)).encode()
    if kind == "gz":
        p = tmp_path / "part.jsonl.gz"
        p.write_bytes(gzip.compress(raw)[:-200])  # truncated download
    elif kind == "zst":
        import zstandard

        p = tmp_path / "part.jsonl.zst"
        blob = bytearray(zstandard.ZstdCompressor().compress(raw))
        blob[len(blob) // 2:len(blob) // 2 + 16] = b"\x00" * 16
        p.write_bytes(bytes(blob))
    else:
        p = tmp_path / "part.parquet"
        p.write_bytes(b"PAR1" + b"garbage" * 50)
    with pytest.raises(CorruptInputError) as e:
        list(iter_documents(str(p)))
    print(e.value)
    assert str(p) in str(e.value) and str(e.value).startswith("corrupt input file")
