"""The corrupt-input policy of the tokenizer trainer and the tokenize step (in this process, no Ray).

The corpus holds good files, a truncated gzip, a truncated zstd, a parquet file that is not parquet,
and a file with invalid UTF-8 documents (a bad *document*, counted under either policy, never a
corrupt *file*).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import zstandard

from marin.data.corpus_steps import CorpusInput
from marin.data.readers import CorruptInputError, TooManyCorruptFilesError
from marin.data.store import TokenStore
from marin.data.tokenize import TokenizeConfig, TokenizeError, tokenize
from marin.data.tokenizer import TrainTokenizerConfig, train_tokenizer

GOOD_DOCS = 40


def _jsonl(tag: str) -> bytes:
    return "".join(json.dumps({"text": f"{tag} document {i} about expert routing"}) + "\n"
                   for i in range(GOOD_DOCS)).encode()


def _corpus(root: Path) -> dict[str, Path]:
    for d in ("news/q1", "news/q2", "blog/q1"):
        (root / d).mkdir(parents=True)
    for i in range(4):
        (root / "news" / "q1" / f"good{i}.jsonl").write_bytes(_jsonl(f"news{i}"))
    utf8 = root / "blog" / "q1" / "mixed.jsonl"
    utf8.write_bytes(_jsonl("blog") + b'{"text": "bad \xff\xfe bytes"}\n')
    gz = gzip.compress(_jsonl("gz") * 20)
    zst = zstandard.ZstdCompressor().compress(_jsonl("zst") * 20)
    bad = {
        "gz": root / "news" / "q2" / "truncated.jsonl.gz",
        "zst": root / "news" / "q2" / "truncated.jsonl.zst",
        "parquet": root / "news" / "q2" / "broken.parquet",
    }
    bad["gz"].write_bytes(gz[: len(gz) // 2])
    bad["zst"].write_bytes(zst[: len(zst) // 2])
    bad["parquet"].write_bytes(b"PAR1" + b"not really parquet" * 20 + b"PAR1")
    return bad


def _tokenize_config(corpus, tokenizer, out, **kw) -> TokenizeConfig:
    return TokenizeConfig(str(corpus), tokenizer, str(out), CorpusInput(show_progress=False, use_ray=False, **kw))


def test_tokenize_skip_lists_corrupt_files_in_the_manifest(mini_tokenizer, tmp_path):
    bad = _corpus(tmp_path / "corpus")
    out = tmp_path / "store"
    tokenize(_tokenize_config(tmp_path / "corpus", mini_tokenizer, out, on_corrupt="skip", max_corrupt_fraction=0.5))

    store = TokenStore.open(str(out), tokenizer=mini_tokenizer)
    m = store.manifest
    assert sorted(s["input_file"] for s in m["skipped_files"]) == sorted(str(p) for p in bad.values())
    reasons = {s["input_file"]: s["reason"] for s in m["skipped_files"]}
    assert "EOFError" in reasons[str(bad["gz"])] or "Compressed file ended" in reasons[str(bad["gz"])]
    assert "truncated zstd stream" in reasons[str(bad["zst"])]
    assert all(r.startswith("corrupt input file ") for r in reasons.values())
    assert m["totals"]["skipped_files"] == 3 and m["totals"]["files"] == 5
    # nothing of a skipped file is in the store; invalid UTF-8 is a skipped document, not a file
    assert store.source_names == ("blog/q1", "news/q1")
    assert m["sources"]["news/q1"]["documents"] == 4 * GOOD_DOCS
    assert m["sources"]["blog/q1"]["documents"] == GOOD_DOCS
    assert m["sources"]["blog/q1"]["skipped"] == {"invalid_utf8": 1}
    assert not (out / "tokenize_failures.json").exists()


def test_tokenize_over_budget_or_fail_policy_fails_and_a_clean_rerun_clears_the_failures(mini_tokenizer, tmp_path):
    bad = _corpus(tmp_path / "corpus")
    out = tmp_path / "store"
    # the default policy (skip, at most 1% of files) refuses 3 corrupt files out of 8
    with pytest.raises(TokenizeError) as err:
        tokenize(_tokenize_config(tmp_path / "corpus", mini_tokenizer, out))
    msg = str(err.value)
    assert msg.startswith("3 of 8 input files failed in the tokenize step; 3 corrupt: 37.5% of the files are corrupt, "
                          "more than max_corrupt_fraction=0.01 allows")
    assert all(str(p) in msg for p in bad.values())
    assert not (out / "manifest.json").exists()

    with pytest.raises(TokenizeError, match="3 corrupt: on_corrupt='fail'"):
        tokenize(_tokenize_config(tmp_path / "corpus", mini_tokenizer, out, on_corrupt="fail"))
    failures = json.loads((out / "tokenize_failures.json").read_text())
    assert sorted(f["input_file"] for f in failures) == sorted(str(p) for p in bad.values())

    # the files are re-fetched whole; the rerun succeeds and the old failure list goes away
    bad["gz"].write_bytes(gzip.compress(_jsonl("gz")))
    bad["zst"].write_bytes(zstandard.ZstdCompressor().compress(_jsonl("zst")))
    bad["parquet"].unlink()
    tokenize(_tokenize_config(tmp_path / "corpus", mini_tokenizer, out, on_corrupt="fail"))
    m = TokenStore.open(str(out)).manifest
    assert m["skipped_files"] == [] and m["sources"]["news/q2"]["documents"] == 2 * GOOD_DOCS
    assert not (out / "tokenize_failures.json").exists()


def test_tokenize_refuses_an_unknown_policy(mini_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="on_corrupt must be one of"):
        tokenize(_tokenize_config(tmp_path, mini_tokenizer, tmp_path / "o", on_corrupt="ignore"))


def test_tokenizer_trainer_policies(tmp_path):
    bad = _corpus(tmp_path / "corpus")
    skip = tmp_path / "tok-skip"
    train_tokenizer(TrainTokenizerConfig(str(tmp_path / "corpus"), str(skip), vocab_size=300,
                                         max_corrupt_fraction=0.5))
    info = json.loads((skip / "tokenizer_info.json").read_text())
    assert info["files"] == 8
    assert sorted(s["input_file"] for s in info["skipped_files"]) == sorted(str(p) for p in bad.values())
    assert (skip / "tokenizer.json").exists()

    # the default budget (1%) stops at the first corrupt file, without reading the rest
    too_many = (
        r"1 of 8 input files corrupt so far \(12.5% of the files are corrupt, more than max_corrupt_fraction=0.01"
    )
    with pytest.raises(TooManyCorruptFilesError, match=too_many):
        train_tokenizer(TrainTokenizerConfig(str(tmp_path / "corpus"), str(tmp_path / "tok-default"), vocab_size=300))
    with pytest.raises(CorruptInputError, match="corrupt input file"):
        train_tokenizer(TrainTokenizerConfig(str(tmp_path / "corpus"), str(tmp_path / "tok-fail"), vocab_size=300,
                                             on_corrupt="fail"))
