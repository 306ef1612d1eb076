"""The tokenize step on a local Ray cluster: round trip, resume at shard granularity, bad input."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from marin.data.corpus_steps import CorpusInput, file_key
from marin.data.readers import iter_documents, list_document_files
from marin.data.store import TokenStore
from marin.data.tokenize import FileTask, TokenizeConfig, TokenizeError, tokenize, tokenize_file
from marin.data.tokenizer import load_tokenizer

QUIET = CorpusInput(show_progress=False)  # Ray when it is up (the session's Ray), no progress bar

pytestmark = pytest.mark.usefixtures("ray_local")


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_ray_tokenize_round_trips_every_document(mini_corpus, mini_tokenizer, mini_store, tmp_path):
    import ray

    assert ray.is_initialized()
    out = tmp_path / "store"
    tokenize(TokenizeConfig(mini_corpus, mini_tokenizer, str(out), QUIET, shard_max_tokens=2000, batch_docs=16))
    # Ray fan-out writes exactly what the in-process path wrote (the fixture store).
    assert _files(out) == _files(Path(mini_store))
    store = TokenStore.open(str(out), tokenizer=mini_tokenizer)
    tok = load_tokenizer(mini_tokenizer)
    k40 = json.loads(Path(mini_corpus, "k40_manifest.json").read_text())
    assert set(store.source_names) == set(k40["sources"])
    for name in store.source_names:
        entry = store.manifest["sources"][name]
        assert entry["documents"] == k40["sources"][name]["documents"]
        assert entry["bytes"] == k40["sources"][name]["bytes"]
        assert entry["skipped"] == {}
    # Every document of two sources (different formats) decodes back to its exact text.
    for name in ("council/q1", "infra/q4"):
        texts = [r.text for f in list_document_files(f"{mini_corpus}/{name}") for r in iter_documents(f)]
        src = store.source(name)
        assert [tok.decode(src.document(i)[:-1]) for i in range(src.num_documents)] == texts
    assert store.manifest["totals"]["tokens"] == sum(e["tokens"] for e in store.manifest["sources"].values())


def test_kill_and_rerun_redoes_only_unfinished_shards(mini_corpus, mini_tokenizer, mini_store, tmp_path):
    out = tmp_path / "store"
    cfg = TokenizeConfig(mini_corpus, mini_tokenizer, str(out), QUIET, shard_max_tokens=2000, batch_docs=16)
    # "Kill" the worker of council/q1 after its first shard, and leave a half-written second shard
    # (data without its .json marker), as a crash during the write would.
    f = list_document_files(f"{mini_corpus}/council/q1")[0]
    rel = f.rsplit("/", 1)[-1]
    task = FileTask("council/q1", f, file_key(rel), str(out), mini_tokenizer, cfg.eos_token, "text",
                    cfg.input.max_doc_bytes, cfg.shard_max_tokens, cfg.batch_docs)
    r = tokenize_file(task, stop_after_shards=1)
    assert len(r["shards"]) == 1 and not r["shards"][0]["last"]
    d = out / "sources" / "council" / "q1"
    (d / f"{task.file_key}-00001.tokens").write_bytes(b"\x01\x02\x03")  # partial garbage
    first_meta = d / f"{task.file_key}-00000.json"
    os.utime(first_meta, (1_000_000, 1_000_000))
    os.utime(d / f"{task.file_key}-00000.tokens", (1_000_000, 1_000_000))

    tokenize(cfg)

    assert first_meta.stat().st_mtime == 1_000_000  # the finished shard was not redone
    assert (d / f"{task.file_key}-00000.tokens").stat().st_mtime == 1_000_000
    assert _files(out) == _files(Path(mini_store))  # and the result is byte-identical to a clean run
    # a damaged marker counts as unfinished: that shard and the ones after it are redone
    marker = d / f"{task.file_key}-00001.json"
    marker.write_text('{"source": "coun')
    tokenize(cfg)
    assert json.loads(marker.read_text())["part"] == 1
    assert _files(out) == _files(Path(mini_store))
    # a rerun of a finished store writes nothing new
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*.tokens")}
    tokenize(cfg)
    assert before == {p: p.stat().st_mtime_ns for p in out.rglob("*.tokens")}


def test_bad_documents_counted_corrupt_file_named(mini_tokenizer, tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "forum" / "q1").mkdir(parents=True)
    (corpus / "forum" / "q2").mkdir(parents=True)
    good = [json.dumps({"text": f"post number {i} about routers"}) for i in range(20)]
    bad = [b'{"text": "\xff\xfe"}', json.dumps({"text": ""}).encode(), json.dumps({"title": "x"}).encode(),
           json.dumps({"text": "y" * 5000}).encode(), b"{oops"]
    (corpus / "forum" / "q1" / "a.jsonl").write_bytes(b"\n".join([g.encode() for g in good] + bad))
    whole = gzip.compress(("\n".join(good) + "\n").encode() * 50)
    broken = corpus / "forum" / "q2" / "b.jsonl.gz"
    broken.write_bytes(whole[: len(whole) // 2])
    out = tmp_path / "store"
    cfg = TokenizeConfig(str(corpus), mini_tokenizer, str(out), CorpusInput(max_doc_bytes=4096, show_progress=False))

    with pytest.raises(TokenizeError) as e:
        tokenize(cfg)
    print(e.value)
    msg = str(e.value)
    assert "1 of 2 input files failed" in msg and str(broken) in msg and "corrupt input file" in msg
    failures = json.loads((out / "tokenize_failures.json").read_text())
    assert [f["input_file"] for f in failures] == [str(broken)]
    assert not (out / "manifest.json").exists()  # an incomplete store is never readable
    assert list((out / "sources" / "forum" / "q1").glob("*.json"))  # the good file is done

    broken.write_bytes(whole)  # re-fetch the file and rerun: only it is redone
    tokenize(cfg)
    m = TokenStore.open(str(out)).manifest
    assert m["sources"]["forum/q1"]["skipped"] == {"empty": 1, "invalid_json": 1, "invalid_utf8": 1,
                                                   "missing_text": 1, "too_large": 1}
    assert m["sources"]["forum/q1"]["documents"] == 20
    assert m["sources"]["forum/q2"]["documents"] == 1000
    assert m["totals"]["skipped"]["too_large"] == 1


def test_explicit_sources_and_errors(mini_corpus, mini_tokenizer, mini_store, tmp_path):
    out = tmp_path / "store"
    tokenize(TokenizeConfig(mini_corpus, mini_tokenizer, str(out), CorpusInput(
        show_progress=False, sources={"council/q5": "council/q5", "infra_all": "infra/*/*.*"})))
    store = TokenStore.open(str(out))
    assert store.source_names == ("council/q5", "infra_all")
    entry = store.manifest["sources"]["infra_all"]
    assert entry["files"] == 5
    # five files named part-00000.* in five directories: their shards must not collide
    assert len({sh["id"] for sh in entry["shards"]}) == len(entry["shards"]) == 5
    ref = TokenStore.open(mini_store)
    assert entry["documents"] == sum(ref.manifest["sources"][f"infra/q{i}"]["documents"] for i in range(1, 6))
    with pytest.raises(TokenizeError, match="source 'x': no document files at"):
        tokenize(TokenizeConfig(mini_corpus, mini_tokenizer, str(tmp_path / "s2"), CorpusInput(sources={"x": "nope"})))
    with pytest.raises(TokenizeError, match="no document files"):
        tokenize(TokenizeConfig(str(tmp_path / "empty"), mini_tokenizer, str(tmp_path / "s3")))


def test_changed_input_is_redone_and_other_tokenizer_refused(mini_tokenizer, tmp_path):
    from marin.data.tokenizer import train_bpe_tokenizer

    corpus = tmp_path / "corpus" / "wiki"
    corpus.mkdir(parents=True)
    f = corpus / "a.jsonl"
    f.write_text("".join(json.dumps({"text": f"article {i}"}) + "\n" for i in range(10)))
    out = tmp_path / "store"
    cfg = TokenizeConfig(str(tmp_path / "corpus"), mini_tokenizer, str(out), QUIET)
    tokenize(cfg)
    assert TokenStore.open(str(out)).manifest["sources"]["wiki"]["documents"] == 10
    with open(f, "a") as fh:  # the file was re-fetched with more documents
        fh.write("".join(json.dumps({"text": f"article {i}"}) + "\n" for i in range(10, 15)))
    tokenize(cfg)
    assert TokenStore.open(str(out)).manifest["sources"]["wiki"]["documents"] == 15

    other = tmp_path / "other_tok"
    other.mkdir()
    (other / "tokenizer.json").write_text(train_bpe_tokenizer(iter(["x y z"] * 10), 270, 1).to_str())
    with pytest.raises(TokenizeError) as e:
        tokenize(TokenizeConfig(str(tmp_path / "corpus"), str(other), str(out), QUIET))
    print(e.value)
    assert "written with tokenizer" in str(e.value) and "use a fresh output path" in str(e.value)


@pytest.mark.parametrize("glob", [False, True])
def test_same_file_names_in_sibling_folders_under_a_relative_path(mini_tokenizer, tmp_path, monkeypatch, glob):
    """Files named alike in different folders of one source (q1/part-0.jsonl, q5/part-0.jsonl), given as
    a path relative to the working directory: each keeps its own shards, and every document reads back."""
    corpus = tmp_path / "corpus" / "council"
    texts = {}
    for bucket in ("q1", "q5"):
        (corpus / bucket).mkdir(parents=True)
        docs = [f"{bucket} document {i} about the council" for i in range(6)]
        (corpus / bucket / "part-0.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
        texts[bucket] = docs
    monkeypatch.chdir(tmp_path)
    loc = "council/*/*" if glob else "council"
    out = tmp_path / "store"
    tokenize(TokenizeConfig("corpus", mini_tokenizer, str(out), CorpusInput(sources={"council": loc},
                                                                            show_progress=False, use_ray=False)))
    store = TokenStore.open(str(out), tokenizer=mini_tokenizer)
    reader = store.source("council")
    tok = load_tokenizer(mini_tokenizer)
    got = [tok.decode(list(reader.document(d)[:-1])) for d in range(reader.num_documents)]
    assert sorted(got) == sorted(texts["q1"] + texts["q5"])
