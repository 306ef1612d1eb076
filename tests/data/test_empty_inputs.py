"""Nothing in, nothing succeeds: a tokenizer that could not learn the vocabulary asked for, a token
store with no documents (or a source without any), and a corpus of damaged lines fail with a message
that says what to do; each is allowed only by an explicit setting."""

from __future__ import annotations

import gzip
import json

import pytest

from marin.data.corpus_steps import CorpusInput
from marin.data.tokenize import TokenizeConfig, TokenizeError, tokenize
from marin.data.tokenizer import TokenizerError, TrainTokenizerConfig, train_tokenizer

LOCAL = CorpusInput(show_progress=False, use_ray=False)
ALLOW_EMPTY = CorpusInput(show_progress=False, use_ray=False, allow_empty=True)


def test_a_tokenizer_trained_on_an_empty_corpus_fails_unless_allowed(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("")
    out = tmp_path / "tok"
    with pytest.raises(TokenizerError) as e:
        train_tokenizer(TrainTokenizerConfig(str(corpus), str(out), vocab_size=512))
    assert str(e.value) == (
        f"the tokenizer learned 0 merges, 257 of the 512 vocabulary entries asked: the text under {corpus} "
        "(1 file(s), 0 bytes sampled from field 'text') is empty or too small; give it more text, lower "
        "vocab_size or min_frequency, or pass allow_small_vocab=True (default_tokenizer, TrainTokenizerConfig) to "
        "accept a smaller vocabulary")
    assert not (out / "tokenizer.json").exists()
    train_tokenizer(TrainTokenizerConfig(str(corpus), str(out), vocab_size=512, allow_small_vocab=True))
    assert json.loads((out / "tokenizer_info.json").read_text())["vocab_size"] == 257


def _tokenizer(tmp_path) -> str:
    corpus = tmp_path / "tok-corpus"
    corpus.mkdir()
    words = " ".join(f"word{i} common text" for i in range(400))
    (corpus / "a.jsonl").write_text("\n".join(json.dumps({"text": words}) for _ in range(5)))
    out = tmp_path / "tok"
    train_tokenizer(TrainTokenizerConfig(str(corpus), str(out), vocab_size=300))
    return str(out)


def test_a_store_of_damaged_lines_fails_with_the_count(tmp_path):
    tok = _tokenizer(tmp_path)
    corpus = tmp_path / "corpus" / "web"
    corpus.mkdir(parents=True)
    (corpus / "a.jsonl.gz").write_bytes(gzip.compress(b"".join(b"this is not json %d\n" % i for i in range(50))))
    out = tmp_path / "store"
    cfg = TokenizeConfig(str(tmp_path / "corpus"), tok, str(out), LOCAL)
    with pytest.raises(TokenizeError) as e:
        tokenize(cfg)
    assert str(e.value).startswith(
        f"no documents under {tmp_path / 'corpus'} (text field 'text'): 1 file(s), skipped: 50 "
        "invalid_json; check the path and text_field, or set CorpusInput(allow_empty=True) if "
        "an empty output is what you want (the shards are kept; no manifest was written")
    assert not (out / "manifest.json").exists()
    # allowing an empty store does not allow damage beyond the corrupt-input policy
    with pytest.raises(TokenizeError) as e:
        tokenize(TokenizeConfig(str(tmp_path / "corpus"), tok, str(out), ALLOW_EMPTY))
    assert "50 of 50 documents (100.0%) are damaged (invalid JSON or UTF-8), more than max_corrupt_fraction=0.01" \
        in str(e.value)


def test_one_empty_source_among_good_ones_fails_unless_allowed(tmp_path):
    tok = _tokenizer(tmp_path)
    root = tmp_path / "corpus"
    (root / "good").mkdir(parents=True)
    (root / "blank").mkdir()
    (root / "good" / "a.jsonl").write_text("\n".join(json.dumps({"text": f"doc {i}"}) for i in range(20)))
    (root / "blank" / "a.jsonl").write_text("\n".join(json.dumps({"body": f"doc {i}"}) for i in range(3)))
    out = tmp_path / "store"
    with pytest.raises(TokenizeError) as e:
        tokenize(TokenizeConfig(str(root), tok, str(out), LOCAL))
    assert str(e.value).startswith(f"1 source(s) under {root} (text field 'text') have no documents: blank; check "
                                   "them, drop them from sources, or set CorpusInput(allow_empty=True)")
    tokenize(TokenizeConfig(str(root), tok, str(out), ALLOW_EMPTY))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["sources"]["blank"]["documents"] == 0 and manifest["sources"]["good"]["documents"] == 20


def test_the_settings_the_advice_names_are_options_of_the_experiment_defaults(tmp_path):
    """The advice says to set CorpusInput(allow_empty=True) / allow_small_vocab: default_tokenize (its
    input group) and default_tokenizer take them, pass them through, and (deciding only whether a step
    may succeed) keep its hash."""
    from experiments.defaults import default_tokenize, default_tokenizer
    from marin.execution.plan import plan_steps

    tok = default_tokenizer("probe/tok", str(tmp_path / "corpus"), vocab_size=512)
    tok_small = default_tokenizer("probe/tok", str(tmp_path / "corpus"), vocab_size=512, allow_small_vocab=True)
    store = default_tokenize("probe/store", str(tmp_path / "corpus"), tok)
    store_empty = default_tokenize("probe/store", str(tmp_path / "corpus"), tok, CorpusInput(allow_empty=True))
    assert tok_small.config.allow_small_vocab and store_empty.config.input.allow_empty
    assert not tok.config.allow_small_vocab and not store.config.input.allow_empty
    hashes = [[s.hash for s in plan_steps([x], str(tmp_path / "out")).steps] for x in (store, store_empty)]
    assert hashes[0] == hashes[1]
    assert plan_steps([tok], "/o").steps[0].hash == plan_steps([tok_small], "/o").steps[0].hash
