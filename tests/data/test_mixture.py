"""Mixture weights and the stateless loader, checked against slow obvious references."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from marin.data.corpus_steps import CorpusInput
from marin.data.loader import MixtureLoader, ring_pieces
from marin.data.mixture import (
    MixtureConfig,
    MixtureError,
    MixtureStage,
    source_probabilities,
    validation_documents,
)
from marin.data.order import WITH_REPLACEMENT
from marin.data.segments import segment_ids_from_eos
from marin.data.store import TokenizerMismatchError, TokenStore, shard_paths
from marin.data.tokenize import TokenizeConfig, tokenize
from marin.data.tokenizer import load_tokenizer

# ------------------------------------------------------------------------------------------------
# pure functions


def test_source_probabilities_by_hand():
    names, toks = ["a/q1", "a/q2", "b/q1"], [100, 300, 50]
    p = source_probabilities(names, toks, {"a": 1, "b": 3}, None)
    np.testing.assert_allclose(p, [0.25 * 0.25, 0.25 * 0.75, 0.75])  # stage 1: uniform over a's tokens
    p = source_probabilities(names, toks, {"a": 1, "b": 3}, {"q1": 2, "q2": 1})
    np.testing.assert_allclose(p, [0.25 * 200 / 500, 0.25 * 300 / 500, 0.75])  # stage 2: tokens x quality
    p = source_probabilities(names, toks, None, None)
    np.testing.assert_allclose(p, np.array(toks) / 450)  # no weights: natural token shares
    p = source_probabilities(names, toks, {"a": 1}, None, {"a": {"q1": 1, "q2": 0}})
    np.testing.assert_allclose(p, [1, 0, 0])  # missing domain = weight 0; per-domain bucket override


@pytest.mark.parametrize(
    "dw,qw,expect",
    [
        ({"a": -1, "b": 1}, None, "weight for 'a' is negative (-1)"),
        ({"a": 0, "b": 0}, None, "all weights are zero"),
        ({"a": 1, "wiki": 1}, None, "unknown domain(s) ['wiki']"),
        ({"a": 1}, {"q9": 1}, "unknown bucket(s) ['q9']"),
        ({"a": float("nan")}, None, "weight for 'a' is nan"),
        ({"c": 1}, None, "domain 'c' has weight 1.0 but no training tokens"),
        ({"a": 1}, {"q1": 0, "q2": 0}, "all weights are zero"),
        ({"b": 1}, {"q1": 0, "q2": 1}, "give every bucket with tokens zero weight"),
    ],
)
def test_bad_weights_are_clear_errors(dw, qw, expect):
    with pytest.raises(MixtureError) as e:
        source_probabilities(["a/q1", "a/q2", "b/q1", "c/q1"], [100, 300, 50, 0], dw, qw)
    print(e.value)
    assert expect in str(e.value)


def test_segment_ids_and_ring_against_loops():
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 5, (7, 40)).astype(np.int32)
    ref = np.zeros_like(toks)
    for r in range(toks.shape[0]):
        seg = 0
        for j in range(toks.shape[1]):
            ref[r, j] = seg
            seg += toks[r, j] == 0
    np.testing.assert_array_equal(segment_ids_from_eos(toks, 0), ref)
    edge = np.array([[0, 1, 2, 0], [3, 0, 0, 0], [5, 5, 5, 5], [0, 0, 0, 0]], dtype=np.int32)
    np.testing.assert_array_equal(
        segment_ids_from_eos(edge, 0), [[0, 1, 1, 1], [0, 0, 1, 2], [0, 0, 0, 0], [0, 1, 2, 3]]
    )
    np.testing.assert_array_equal(segment_ids_from_eos(np.zeros((3, 1), np.int32), 0), np.zeros((3, 1)))
    for start, n, ring in [(3, 4, 10), (8, 5, 10), (9, 25, 10), (0, 10, 10)]:
        got = np.concatenate([np.arange(a, b) for a, b in ring_pieces(start, n, ring)])
        np.testing.assert_array_equal(got, (start + np.arange(n)) % ring)
    assert validation_documents(1000, 0.01, 1, 5) == 5
    assert validation_documents(10, 0.01, 1, 5) == 1
    assert validation_documents(1, 0.5, 1, 5) == 0  # never the only document
    assert validation_documents(100, 0.0, 1, 5) == 0


# ------------------------------------------------------------------------------------------------
# loader against a reference


def _reference_streams(loader: MixtureLoader) -> list[np.ndarray]:
    """Each source's training tokens, read whole from the shard files (slow, obvious)."""
    out = []
    for r, t in zip(loader.readers, loader.train_tokens):
        parts = [np.fromfile(shard_paths(r.store, r.name, s.id)["tokens"], dtype="<u4") for s in r.shards]
        out.append(np.concatenate(parts)[:t])
    return out


def _reference_batch(loader, streams, step, batch_size, seq_len):
    src, starts = loader.plan(step, batch_size)
    rows = [np.take(streams[s], (st + np.arange(seq_len + 1)) % streams[s].size) for s, st in zip(src, starts)]
    return np.stack(rows).astype(np.int32)


@pytest.fixture(scope="module")
def loader(mini_store):
    """The legacy order's loader: its rows are drawn independently, so any (step, batch, seq_len) plans."""
    return MixtureLoader(MixtureConfig(stores=(mini_store,), domain_weights={"council": 4, "infra": 2, "web_code": 1,
                                                                             "science": 1}, seed=7,
                                       order=WITH_REPLACEMENT))


def test_batches_match_reference(loader):
    streams = _reference_streams(loader)
    for step, (bs, sl) in enumerate([(8, 16), (4, 3000), (16, 257), (2, 20000)]):  # 3000+: crosses shards, wraps
        b = loader.batch(step, bs, sl)
        assert b["tokens"].dtype == np.int32 and b["tokens"].shape == (bs, sl + 1)
        assert b["segment_ids"].dtype == np.int32 and b["segment_ids"].shape == (bs, sl + 1)
        np.testing.assert_array_equal(b["tokens"], _reference_batch(loader, streams, step, bs, sl))
        np.testing.assert_array_equal(b["segment_ids"], segment_ids_from_eos(b["tokens"], loader.eos_id))
    assert loader.vocab_size == load_tokenizer(json.loads(Path(loader.stores[0].path, "manifest.json").read_text())
                                               ["tokenizer"]["path"]).vocab_size


def test_sampled_shares_converge_to_weights(loader):
    counts = np.zeros(len(loader.source_names))
    steps, bs = 300, 64
    for s in range(steps):
        np.add.at(counts, loader.plan(s, bs)[0], 1)
    expected = np.array([loader.effective_shares().get(n, 0.0) for n in loader.source_names])
    n = steps * bs
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(counts / n - expected) <= 4 * sigma + 1e-12), (counts / n, expected)
    dom = loader.effective_domain_shares()
    assert dom == pytest.approx({"council": 0.5, "infra": 0.25, "web_code": 0.125, "science": 0.125})
    # stage 1 within a domain: buckets in proportion to their training tokens
    sh = loader.effective_shares()
    council = {n: loader.train_tokens[loader.source_names.index(n)] for n in sh if n.startswith("council/")}
    for n, t in council.items():
        assert sh[n] == pytest.approx(0.5 * t / sum(council.values()))


def test_resume_at_any_step_without_replay(mini_store, loader):
    run = [loader.batch(s, 8, 64) for s in range(25)]
    fresh = MixtureLoader(loader.config)
    for s in [24, 0, 13, 7, 13]:
        b = fresh.batch(s, 8, 64)
        np.testing.assert_array_equal(b["tokens"], run[s]["tokens"])
        np.testing.assert_array_equal(b["segment_ids"], run[s]["segment_ids"])
    other = MixtureLoader(MixtureConfig(**{**loader.config.__dict__, "seed": 8}))
    assert not np.array_equal(other.batch(3, 8, 64)["tokens"], run[3]["tokens"])
    assert not np.array_equal(run[3]["tokens"], run[4]["tokens"])


def test_seq_len_change_keeps_tokens_per_step(loader):
    tokens_per_step = 4096
    for step, seq_len in [(0, 128), (1, 128), (2, 256), (3, 512), (4, 1024)]:
        b = loader.batch(step, tokens_per_step // seq_len, seq_len)
        assert b["tokens"][:, :-1].size == tokens_per_step


def test_stages_switch_weights_at_their_step(mini_store):
    qw = {"q1": 0.0, "q2": 0.0, "q3": 0.0, "q4": 1.0, "q5": 3.0}
    cfg = MixtureConfig(stores=(mini_store,), stages=(MixtureStage(start_step=10, quality_weights=qw),),
                        order=WITH_REPLACEMENT)  # rows drawn independently: plan(step, rows) needs no schedule
    ld = MixtureLoader(cfg)
    assert any(n.endswith("/q1") for n in ld.effective_shares(9))
    late = ld.effective_shares(10)
    assert set(n[-2:] for n in late) == {"q4", "q5"} and ld.effective_shares(10**6) == late
    assert ld.effective_domain_shares(0) == pytest.approx(ld.effective_domain_shares(10))  # domains unchanged
    srcs = np.concatenate([ld.plan(s, 64)[0] for s in range(10, 30)])
    assert {ld.source_names[i][-2:] for i in srcs} == {"q4", "q5"}
    with pytest.raises(MixtureError, match="unknown bucket"):
        MixtureLoader(MixtureConfig(stores=(mini_store,), stages=(MixtureStage(100, quality_weights={"gold": 1}),)))


def test_stages_at_a_fraction_of_the_run_follow_its_length(mini_store):
    """A stage at 30% of the run starts at 30% of every run length (ceil, like seq-len phases); an
    absolute step keeps working; a fractional stage without the run's horizon is a clear error."""
    qw = {"q1": 0.0, "q2": 0.0, "q3": 0.0, "q4": 1.0, "q5": 3.0}
    stage = MixtureStage(start_fraction=0.3, quality_weights=qw)
    cfg = MixtureConfig(stores=(mini_store,), stages=(stage,), order=WITH_REPLACEMENT)
    for total, first in [(10, 3), (100, 30), (390_139, 117_042), (7, 3)]:
        ld = MixtureLoader(cfg, total_steps=total)
        assert any(n.endswith("/q1") for n in ld.effective_shares(first - 1)), total
        assert {n[-2:] for n in ld.effective_shares(first)} == {"q4", "q5"}, total
    unplaced = MixtureLoader(cfg)  # builds (weights validated), but cannot say which stage a step is in
    with pytest.raises(MixtureError, match="30% of the run, but the run's total_steps was not given"):
        unplaced.plan(0, 4)
    with pytest.raises(MixtureError, match="exactly one of start_step and start_fraction"):
        MixtureStage(start_step=5, start_fraction=0.5)
    with pytest.raises(MixtureError, match="exactly one of start_step and start_fraction"):
        MixtureStage(quality_weights=qw)
    with pytest.raises(MixtureError, match=r"start_fraction must be in \[0, 1\]"):
        MixtureStage(start_fraction=30.0)
    absolute = MixtureLoader(MixtureConfig(stores=(mini_store,), stages=(MixtureStage(117_042, quality_weights=qw),)),
                             total_steps=1_000)
    assert absolute.effective_shares(999) == absolute.effective_shares(0)  # never reached: stays stage 1


# ------------------------------------------------------------------------------------------------
# validation split


@pytest.fixture(scope="module")
def marked_store(mini_tokenizer, tmp_path_factory):
    """Every document carries a unique marker, so its appearance in a batch can be detected."""
    root = tmp_path_factory.mktemp("marked")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "router", "expert", "token"]
    for src in ["news/q1", "news/q2", "law/q1"]:
        d = root / "corpus" / src
        d.mkdir(parents=True)
        with open(d / "docs.jsonl", "w") as f:
            for i in range(60):
                body = " ".join(rng.choice(words, int(rng.integers(5, 40))))
                f.write(json.dumps({"text": f"[{src.replace('/', '-')}-{i:03d}] {body}"}) + "\n")
    tokenize(TokenizeConfig(str(root / "corpus"), mini_tokenizer, str(root / "store"), CorpusInput(show_progress=False),
                            shard_max_tokens=300, batch_docs=8))
    return str(root / "store")


def test_validation_documents_never_in_training(marked_store, mini_tokenizer):
    tok = load_tokenizer(mini_tokenizer)
    ld = MixtureLoader(MixtureConfig(stores=(marked_store,), validation_fraction=0.1, seed=3, order=WITH_REPLACEMENT))
    assert list(ld.validation_docs) == [6, 6, 6]
    held = {f"{n.replace('/', '-')}-{i:03d}" for n in ld.source_names for i in range(54, 60)}
    seen: set[str] = set()
    for step in range(150):
        b = ld.batch(step, 8, 48)
        src, starts = ld.plan(step, 8)
        assert np.all(starts < ld.train_tokens[src])
        for row in b["tokens"]:
            seen |= set(re.findall(r"\[(\w+-q\d-\d{3})\]", tok.decode(row)))
    assert len(seen) > 100  # the check has teeth: most training documents were seen
    assert not (seen & held)
    # and the validation batches are exactly the held-out documents
    val_seen: set[str] = set()
    for dom in ("news", "law"):
        rows = []
        for i in range(ld.num_validation_batches(dom, 4, 32)):
            v = ld.validation_batch(dom, i, 4, 32)
            np.testing.assert_array_equal(v["segment_ids"], segment_ids_from_eos(v["tokens"], ld.eos_id))
            rows.extend(v["tokens"])
        # consecutive windows: their concatenation is the domain's held-out stream (then wraps)
        stream = np.concatenate(rows)
        assert stream.size >= ld.validation_tokens(dom)
        val_seen |= set(re.findall(r"\[(\w+-q\d-\d{3})\]", tok.decode(stream)))
    assert val_seen == held
    np.testing.assert_array_equal(ld.validation_batch("news/q2", 1, 2, 16)["tokens"],
                                  ld.validation_batch("news/q2", 1, 2, 16)["tokens"])
    with pytest.raises(KeyError, match="unknown domain or source 'sports'"):
        ld.validation_batch("sports", 0, 1, 8)


def test_stores_with_different_tokenizers_do_not_mix(marked_store, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(marked_store, copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["tokenizer"]["identity"] = "0" * 64
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(TokenizerMismatchError) as e:
        MixtureLoader(MixtureConfig(stores=(marked_store, str(copy))))
    print(e.value)
    assert "disagree on the tokenizer" in str(e.value)
    with pytest.raises(TokenizerMismatchError):
        MixtureLoader(MixtureConfig(stores=(str(copy),), tokenizer=TokenStore.open(marked_store).tokenizer_identity))
    m["tokenizer"]["identity"] = TokenStore.open(marked_store).tokenizer_identity
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(MixtureError, match="must be a tuple of store paths"):
        MixtureLoader(MixtureConfig(stores=marked_store))
    with pytest.raises(MixtureError, match="appears in both"):
        MixtureLoader(MixtureConfig(stores=(marked_store, str(copy))))


def test_a_host_builds_only_its_rows_and_they_are_the_global_batchs(loader):
    """Per-host batches: the rows a host builds are exactly its slice of the whole batch, and it reads
    only their tokens (so the cluster reads a batch once, whatever the number of hosts)."""
    full = loader.batch(3, 16, 24)
    for hosts in (1, 2, 4, 8):
        fresh = MixtureLoader(loader.config)
        per = 16 // hosts
        parts = [fresh.batch(3, 16, 24, rows=slice(h * per, (h + 1) * per)) for h in range(hosts)]
        for k in ("tokens", "segment_ids"):
            assembled = np.concatenate([p[k] for p in parts])
            assert assembled.dtype == full[k].dtype and assembled.tobytes() == full[k].tobytes()
        assert fresh.tokens_read == 16 * 25  # all hosts together: one batch
        one_host = MixtureLoader(loader.config)
        one_host.batch(3, 16, 24, rows=slice(0, per))
        assert one_host.tokens_read == per * 25
