"""The dedup and decontamination steps (in this process, no Ray; the Ray and object-store runs are in
test_dedup_cloud.py): the math against slow references, planted duplicates and contamination found,
the survivor rule, output read by tokenize unchanged, restart after a kill, bounded band partitions,
corrupt and empty input."""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import json
import re
from pathlib import Path

import numpy as np
import pytest

import marin.data.dedup as dd
from marin.data.corpus_steps import CorpusInput, batches
from marin.data.decontaminate import (
    DecontaminateConfig,
    DecontaminationError,
    build_ngram_table,
    cut_spans,
    decontaminate,
    eval_texts,
    ngram_hashes,
    ngram_hits,
)
from marin.data.dedup import (
    DedupConfig,
    DedupError,
    band_keys,
    candidate_probability,
    dedup,
    implied_threshold,
    jaccard_of_sets,
    normalize_words,
    normalized_text,
    resolve_clusters,
    shingle_hashes,
    shingles,
    verified_pairs,
    word_spans,
)
from marin.data.k40 import QUALITY_BUCKETS
from marin.data.readers import iter_documents, list_document_files
from marin.data.store import TokenStore
from marin.data.synthetic import write_planted_corpus
from marin.data.tokenize import TokenizeConfig, tokenize

LOCAL = CorpusInput(show_progress=False, use_ray=False)


def _cfg(src, out, inputs: CorpusInput = LOCAL, **kw) -> DedupConfig:
    return DedupConfig(str(src), str(out), inputs, **kw)


def _kept(out: Path) -> dict[str, list[str]]:
    """source -> texts of the output corpus, in file order."""
    res = {}
    for f in list_document_files(str(out)):
        src = str(Path(f).parent.relative_to(out))
        res.setdefault(src, []).extend(r.text for r in iter_documents(f) if r.text is not None)
    return res


# --- pure functions against slow references -------------------------------------------------------

def test_normalisation_ignores_case_spacing_and_punctuation():
    assert normalize_words("Hello,  WORLD!\n It's  ok") == ["hello", "world", "it", "s", "ok"]
    assert normalize_words("ＡＢＣ Straße") == ["abc", "strasse"]  # NFKC (full width) and case folding
    text = "Ａb, cd!  EF"
    assert [w for w, _, _ in word_spans(text)] == normalize_words(text)
    assert [text[s:e] for _, s, e in word_spans(text)] == ["Ａb", "cd", "EF"]
    assert shingles(["a", "b", "c"], 2) == ["a b", "b c"] and shingles(["a"], 5) == ["a"] and shingles([], 5) == []
    # the step's one-pass form: the words joined by one space, on ASCII (byte path) and other text
    samples = ["Hello,  WORLD!\n It's  ok", "ＡＢＣ Straße", "", "  ,;  ", "snake_case x2 \t tab", "naïve café",
               "a" * 3 + "_" + "B" * 2, "".join(chr(c) for c in range(128))]
    for t in samples:
        assert normalized_text(t) == " ".join(normalize_words(t)), repr(t)
        assert [w for w, _, _ in word_spans(t)] == normalize_words(t), repr(t)  # cut mode sees the same words
        if t.isascii():  # the byte path against the regular expression it replaces
            assert normalize_words(t) == re.findall(r"\w+", t.lower()), repr(t)


def _poly_hash_slow(shingle: str) -> int:
    """The shingle hash written the slow obvious way: Horner's rule over the UTF-8 bytes (+1)."""
    h = 0
    for c in shingle.encode("utf-8"):
        h = (h * dd._BASE + c + 1) % (1 << 64)
    return h


def test_shingle_hashes_match_a_string_reference():
    texts = ["Hello, World! this is  a Test of the shingles", "a b", "", "ünïcode ﬁ Straße text here one two",
             "x", "one two three"]
    norm = [normalized_text(t) for t in texts]
    for n in (1, 3, 5):
        flat, off = shingle_hashes(norm, n)
        assert off.tolist()[0] == 0 and off.size == len(texts) + 1
        for d, t in enumerate(texts):
            ref = [_poly_hash_slow(s) for s in shingles(normalize_words(t), n)]
            want = dd.mix64(np.array(ref, dtype=np.uint64)) if ref else np.zeros(0, np.uint64)
            assert np.array_equal(flat[off[d]:off[d + 1]], want), (n, t)
    # a shingle's hash depends on its text only, not on its place in the batch
    a, _ = shingle_hashes(["p q r s"], 3)
    b, ob = shingle_hashes(["x y", "z p q r s"], 3)
    assert set(a.tolist()) <= set(b[ob[1]:ob[2]].tolist())


def test_candidates_are_verified_by_their_jaccard_similarity():
    sets = {i: np.unique(np.array(v, dtype=np.uint32)) for i, v in
            {0: range(10), 1: range(1, 11), 2: range(100, 110), 3: range(101, 111), 4: range(50, 60)}.items()}
    assert jaccard_of_sets(sets[0], sets[1]) == pytest.approx(9 / 11)
    # one band key held by all five: 1 joins 0, 3 joins 2 (the second representative), 4 joins no one
    cache: dict = {}
    edges = verified_pairs([np.array([0, 1, 2, 3, 4], dtype=np.uint64)], sets, 0.7, cache)
    assert edges == [(0, 1), (2, 3)]
    assert verified_pairs([np.array([0, 1])], sets, 0.82, {}) == []  # 9/11 = 0.818 is below 0.82
    # a group of mutually dissimilar documents keeps at most MAX_REPRESENTATIVES: bounded comparisons
    many = {i: np.array([i], dtype=np.uint32) for i in range(200)}
    big: dict = {}
    assert verified_pairs([np.arange(200, dtype=np.uint64)], many, 0.7, big) == []
    cap = dd.MAX_REPRESENTATIVES
    assert len(big) == cap * (cap - 1) // 2 + (200 - cap) * cap
    # the same pair in another band is not compared again
    n = len(cache)
    assert verified_pairs([np.array([0, 1])], sets, 0.7, cache) == [(0, 1)] and len(cache) == n


def test_threshold_and_s_curve():
    t = implied_threshold(14, 8)
    assert t == pytest.approx((1 / 14) ** (1 / 8)) and 0.71 < t < 0.73
    # the S-curve: about one half near the threshold, rising steeply above it
    assert candidate_probability(0.5, 14, 8) < 0.06 < 0.95 < candidate_probability(0.9, 14, 8)
    # the defaults: a pair at the verified threshold (0.7) is a candidate with probability > 0.95
    c = DedupConfig("/in", "/out")
    assert (c.bands, c.rows, c.threshold) == (20, 5, 0.7)
    assert candidate_probability(0.7, 20, 5) == pytest.approx(1 - (1 - 0.7 ** 5) ** 20) and \
        candidate_probability(0.7, 20, 5) > 0.95


def test_band_keys_equal_exactly_when_a_band_is_equal():
    rng = np.random.default_rng(0)
    sig = rng.integers(0, 2**32, size=(50, 12), dtype=np.uint64).astype(np.uint32)
    sig[1, :4] = sig[0, :4]  # rows 0 and 1 share band 0 only
    k = band_keys(sig, 3, 4)
    for a, b in itertools.combinations(range(50), 2):
        for band in range(3):
            same = np.array_equal(sig[a, band * 4:(band + 1) * 4], sig[b, band * 4:(band + 1) * 4])
            assert (k[a, band] == k[b, band]) == same
    assert not np.array_equal(band_keys(sig, 3, 4, salt=7)[0], k[0])


def _components_slow(pairs):
    parent = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for a, b in pairs:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return {x: find(x) for x in parent}


@pytest.mark.parametrize("seed", range(5))
def test_resolve_clusters_matches_union_find(seed):
    rng = np.random.default_rng(seed)
    pairs = rng.integers(0, 300, size=(200, 2)).astype(np.uint64) * np.uint64(1 << 20)
    nodes, roots = resolve_clusters(pairs)
    slow = _components_slow([(int(a), int(b)) for a, b in pairs])
    assert sorted(slow) == nodes.tolist()
    assert [slow[n] for n in nodes.tolist()] == roots.tolist()
    chain = np.array([[i, i + 1] for i in range(100)][::-1], dtype=np.uint64)  # a long path, reversed
    assert set(resolve_clusters(chain)[1].tolist()) == {0}


def test_ngram_hashes_match_a_tuple_reference():
    words = "a b c a b c d a b".split()
    h = ngram_hashes(words, 3)
    grams = [tuple(words[i:i + 3]) for i in range(len(words) - 2)]
    for i, j in itertools.combinations(range(len(grams)), 2):
        assert (h[i] == h[j]) == (grams[i] == grams[j])
    assert ngram_hashes(words[:2], 3).size == 0
    table, masks, stats = build_ngram_table({"x": ["b c d a"], "y": ["c d a b", "too short"]}, 3)
    assert stats["y"] == {"texts": 2, "too_short": 1, "ngrams": 2}
    hit, bits = ngram_hits(h, table, masks)
    assert [grams[i] for i in hit] == [("b", "c", "d"), ("c", "d", "a"), ("d", "a", "b")] and bits == 0b11


def test_eval_texts_and_cut_spans():
    assert eval_texts({"context": "Vote on the", "choices": [" sky", " budget"], "gold": 1}, "text") == [
        "Vote on the  budget"]
    assert eval_texts({"text": "a doc"}, "text") == ["a doc"]
    assert cut_spans("aa bb cc dd", [(3, 5), (4, 8)]) == "aa   dd"


# --- the step ---------------------------------------------------------------------------------------

@pytest.fixture()
def planted(tmp_path):
    truth = write_planted_corpus(str(tmp_path / "corpus"), docs_per_source=40, changed=(0.01, 0.02))
    return tmp_path / "corpus", truth


def _expected_removals(truth: dict) -> set[tuple[str, int]]:
    """Every planted cluster (an original and its copies) minus its survivor: the document of the
    highest quality bucket, then the first by source name and record."""
    def rank(x):
        return (-QUALITY_BUCKETS.index(x[0].split("/")[1]), x[0], x[1])

    members = _components_slow([(c.copy, c.original) for c in truth["copies"]])
    clusters = {}
    for m, root in members.items():
        clusters.setdefault(root, []).append(m)
    return {m for ms in clusters.values() for m in sorted(ms, key=rank)[1:]}


def _removed(out: Path, truth) -> set[tuple[str, int]]:
    kept = _kept(out)
    return {(s, i) for s, texts in truth["texts"].items() for i, t in enumerate(texts) if t not in kept.get(s, [])}


def test_planted_duplicates_are_removed_and_the_survivor_is_the_higher_bucket(planted, tmp_path):
    corpus, truth = planted
    out = tmp_path / "out"
    dedup(_cfg(corpus, out))
    man = json.loads((out / "dedup_manifest.json").read_text())
    removed = _removed(out, truth)
    expected = _expected_removals(truth)
    assert expected <= removed, sorted(expected - removed)  # 1-2% of words changed: well above 0.72
    assert removed == expected
    t = man["totals"]
    assert t["documents_in"] - t["documents_out"] == len(removed)
    n_exact = sum(1 for c in truth["copies"] if c.kind == "exact")
    assert t["removed"]["exact_duplicate"] == n_exact and t["removed"]["near_duplicate"] == len(removed) - n_exact
    assert man["clusters"] >= 1 and man["params"]["threshold"] == 0.7
    assert man["candidate_pairs"] >= man["duplicate_pairs"] - n_exact >= 1
    assert {"law", "council", "infra"} == set(man["domains"])
    assert all(s["similarity"] is not None and s["similarity"] > 0.5 for s in man["sample"])
    assert any(s["removed"]["source"].split("/")[0] != s["kept"]["source"].split("/")[0] for s in man["sample"]) or \
        all(c.copy[0].split("/")[0] == c.original[0].split("/")[0] for c in truth["copies"])
    assert not (out / "_work").exists()

    # the output keeps every field and is read by tokenize unchanged
    first = json.loads((out / "law" / "q5" / "part-00000.jsonl").read_text().splitlines()[0])
    assert set(first) == {"id", "text"}


def test_tokenize_reads_the_output(planted, tmp_path, mini_tokenizer):
    corpus, _ = planted
    out = tmp_path / "out"
    dedup(_cfg(corpus, out))
    tokenize(TokenizeConfig(str(out), mini_tokenizer, str(tmp_path / "store"), LOCAL))
    man = json.loads((out / "dedup_manifest.json").read_text())
    store = TokenStore.open(str(tmp_path / "store"))
    assert store.manifest["totals"]["documents"] == man["totals"]["documents_out"]
    assert sorted(store.source_names) == sorted(man["sources"])


def test_scope_domain_keeps_cross_domain_copies(planted, tmp_path):
    corpus, truth = planted
    dedup(_cfg(corpus, tmp_path / "a", scope="domain"))
    removed = _removed(tmp_path / "a", truth)
    cross = [c for c in truth["copies"] if c.copy[0].split("/")[0] != c.original[0].split("/")[0]]
    assert cross, "the planted corpus has cross-domain copies"
    within = [c for c in truth["copies"] if c not in cross]
    assert removed == _expected_removals({"copies": within})


def test_partitions_bound_the_band_index_and_change_nothing(planted, tmp_path, monkeypatch):
    corpus, _ = planted
    dedup(_cfg(corpus, tmp_path / "one"))
    seen = []
    real = dd.band_pairs

    def spy(task):
        r = real(task)
        seen.append(r["keys"])
        return r

    monkeypatch.setattr(dd, "band_pairs", spy)
    total = sum(p.stat().st_size for p in Path(corpus).rglob("*.jsonl"))
    dedup(_cfg(corpus, tmp_path / "eight", partition_bytes=total // 8 + 1))
    m1 = json.loads((tmp_path / "one" / "dedup_manifest.json").read_text())
    m8 = json.loads((tmp_path / "eight" / "dedup_manifest.json").read_text())
    assert m8["params"]["partitions"] == 8 and m1["params"]["partitions"] == 1
    docs = m1["totals"]["documents_in"]
    # each task holds about 1/8 of each band (a duplicate's keys equal its original's, so they land in
    # one partition together: the spread is wider than a binomial's; 2x of 1/8 is far from the whole)
    assert len(seen) == 8 and max(seen) < docs / 8 * 2
    assert _kept(tmp_path / "one") == _kept(tmp_path / "eight")
    for k in ("totals", "sources", "clusters", "duplicate_pairs", "sample"):
        assert m1[k] == m8[k]


def test_restart_after_a_kill_skips_finished_work(planted, tmp_path, monkeypatch):
    corpus, _ = planted
    out = tmp_path / "out"
    calls = {"sig": 0, "write": 0}
    real_sig, real_write = dd.minhash_signatures, dd.write_kept_records

    def sig(*a, **k):
        calls["sig"] += 1
        return real_sig(*a, **k)

    def killed(src, dst, *a, **k):
        calls["write"] += 1
        if calls["write"] == 3:
            raise KeyboardInterrupt("killed")  # a kill: not an error the step catches
        return real_write(src, dst, *a, **k)

    monkeypatch.setattr(dd, "minhash_signatures", sig)
    monkeypatch.setattr(dd, "write_kept_records", killed)
    with pytest.raises(KeyboardInterrupt):
        dedup(_cfg(corpus, out))
    assert calls["sig"] == 6 and not (out / "dedup_manifest.json").exists()
    monkeypatch.setattr(dd, "write_kept_records", real_write)
    calls["write"] = 0
    dedup(_cfg(corpus, out))
    assert calls["sig"] == 6  # no signature recomputed
    dedup(_cfg(corpus, tmp_path / "clean"))
    assert _kept(out) == _kept(tmp_path / "clean")


def test_corrupt_file_follows_the_policy(planted, tmp_path):
    corpus, _ = planted
    bad = corpus / "law" / "q1" / "part-00001.jsonl.gz"
    bad.write_bytes(gzip.compress(b'{"text": "x"}\n' * 2000)[:60])
    with pytest.raises(DedupError) as e:
        dedup(_cfg(corpus, tmp_path / "a", dataclasses.replace(LOCAL, on_corrupt="fail")))
    msg = str(e.value)
    assert "1 of 7 input files failed" in msg and f"corrupt input file {bad}" in msg
    print(msg)
    assert (tmp_path / "a" / "dedup_failures.json").exists()
    dedup(_cfg(corpus, tmp_path / "b", dataclasses.replace(LOCAL, max_corrupt_fraction=0.2)))
    man = json.loads((tmp_path / "b" / "dedup_manifest.json").read_text())
    assert man["totals"]["skipped_files"] == 1 and man["skipped_files"][0]["input_file"] == str(bad)
    assert not (tmp_path / "b" / "law" / "q1" / "part-00001.jsonl.gz").exists()


def test_empty_input_is_refused(tmp_path):
    (tmp_path / "none" / "a").mkdir(parents=True)
    with pytest.raises(DedupError, match="no document files"):
        dedup(_cfg(tmp_path / "none", tmp_path / "o1"))
    (tmp_path / "blank" / "a" / "q1").mkdir(parents=True)
    (tmp_path / "blank" / "a" / "q1" / "x.jsonl").write_text('{"text": "  "}\n{"other": 1}\n')
    with pytest.raises(DedupError) as e:
        dedup(_cfg(tmp_path / "blank", tmp_path / "o2"))
    assert "no documents under" in str(e.value) and "1 empty, 1 missing_text" in str(e.value)
    with pytest.raises(DedupError, match="num_perm"):
        dedup(_cfg(tmp_path / "blank", tmp_path / "o3", num_perm=112))
    with pytest.raises(DedupError, match="threshold"):
        dedup(_cfg(tmp_path / "blank", tmp_path / "o4", threshold=1.5))


def test_decontamination_removes_or_cuts_the_planted_passages(planted, tmp_path, capsys):
    corpus, truth = planted
    task = tmp_path / "task.jsonl"
    ev = json.loads(Path(truth["eval_path"]).read_text().splitlines()[0])["text"].split(" ")
    task.write_text(json.dumps({"context": " ".join(ev[:30]), "choices": ["x", " ".join(ev[30:40])], "gold": 1})
                    + "\n")
    out = tmp_path / "clean"
    decontaminate(DecontaminateConfig(str(corpus), str(out), {"evalset": truth["eval_path"], "task": str(task)},
                                      LOCAL))
    man = json.loads((out / "decontamination_manifest.json").read_text())
    removed = _removed(out, truth)
    planted_ids = {(s, i) for s, i, _ in truth["contaminated"]}
    assert removed == planted_ids  # 20-word passages: found; nothing else shares a 13-gram
    assert man["against"]["evalset"]["matched_training_documents"] == len(planted_ids)
    assert man["against"]["task"]["matched_training_documents"] == sum(1 for *_, e in truth["contaminated"] if e == 0)
    assert man["totals"]["removed"]["contaminated"] == len(planted_ids) and len(man["sample"]) == len(planted_ids)

    cut = tmp_path / "cut"
    decontaminate(DecontaminateConfig(str(corpus), str(cut), {"evalset": truth["eval_path"]}, LOCAL, mode="cut"))
    mc = json.loads((cut / "decontamination_manifest.json").read_text())
    assert mc["totals"]["documents_out"] == mc["totals"]["documents_in"] and mc["totals"]["cut_documents"] == 5
    kept = _kept(cut)
    for s, i, _ in truth["contaminated"]:
        original = truth["texts"][s][i]
        assert any(original.startswith(t[:200]) and len(t) < len(original) for t in kept[s])
    from marin.commands.show import _print_content  # the command's printer, tested without a step record
    from marin.review.steps import step_content

    _print_content(step_content(str(out), ["decontamination_manifest.json"]))
    shown = capsys.readouterr().out
    assert "evalset: 10 texts (0 too short)" in shown and f"matched {len(planted_ids)} training documents" in shown
    with pytest.raises(DecontaminationError, match="against is empty"):
        decontaminate(DecontaminateConfig(str(corpus), str(tmp_path / "x"), {}, LOCAL))


def test_marin_show_and_the_report_show_the_manifest(planted, tmp_path, capsys):
    from marin.commands.show import _print_content  # the command's printer, tested without a step record
    from marin.review.sections import corpus_filter_section
    from marin.review.steps import step_content

    corpus, _ = planted
    out = tmp_path / "out"
    dedup(_cfg(corpus, out))
    content = step_content(str(out), ["dedup_manifest.json"])
    _print_content(content)
    text = capsys.readouterr().out
    assert "deduplication (dedup_manifest.json): 5-word shingles, 20 bands x 5 rows (Jaccard >= 0.7)" in text
    assert all(f"  {d} " in text for d in ("council", "infra", "law", "total")) and "similarity 1.0) kept " in text
    html = corpus_filter_section(content["corpus_filter"])
    assert html.count("<svg") == 4 and "exact_duplicate" in html  # a bar per domain and the total



def test_default_builders_version_the_parameters_and_default_to_the_isoflop_task():
    from experiments.defaults import default_decontaminate, default_dedup
    from marin.execution import plan_steps

    a, b = default_dedup("d", "/corpus"), default_dedup("d", "/corpus", bands=14, rows=8)
    c = default_dedup("d", "/corpus", threshold=0.8)
    assert len({plan_steps([x], "/p").steps[0].hash for x in (a, b, c)}) == 3
    decon = default_decontaminate("c", a)
    plan = {s.name: s.hash for s in plan_steps([a, b, decon], "/p").steps}
    assert plan_steps([a], "/p").steps[0].hash != plan_steps([b], "/p").steps[0].hash
    pinned = json.loads((Path(__file__).parents[1] / "experiments" / "pinned_step_hashes.json").read_text())
    assert plan["tiny-isoflop/task"] == pinned["tiny_isoflop"]["tiny-isoflop/task"]  # the experiment's own task
    assert "Jaccard >= 0.7" in a.description and "k40_domains" in decon.description


def test_small_files_are_grouped_into_tasks():
    assert batches([5, 5, 5, 20, 1], 10) == [range(0, 2), range(2, 4), range(4, 5)]
    assert batches([5, 5], 0) == [range(0, 1), range(1, 2)] and batches([], 10) == []


def test_signatures_are_the_same_in_another_process():
    """Ray workers and restarts must agree on every signature: no per-process hash salt (the
    subprocess calls rensa as minhash_signatures does, without importing marin)."""
    import subprocess
    import sys

    hashes, offsets = shingle_hashes(["a b c d", "x y z"], 3)
    code = ("import json, numpy as np, rensa; print(json.dumps(rensa.RMinHash.digest_matrix_from_flat_token_hashes("
            f"np.array({hashes.tolist()}, dtype=np.uint64), np.array({offsets.tolist()}, dtype=np.uint64), 16, 3)"
            ".to_rows()))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"}, cwd=Path(__file__).parents[2])
    assert json.loads(other.stdout) == dd.minhash_signatures(hashes, offsets, 16, 3).tolist()


def test_decontaminate_against_takes_a_list_or_a_mapping_and_refuses_anything_else():
    """A list names each set (a step by its name, a path by itself) and versions as the same mapping
    would; a lone path, a set or a list of other things is refused with what to pass instead."""
    from experiments.defaults import default_decontaminate, default_domain_task
    from marin.execution import plan_steps

    task = default_domain_task("t/task", ("council", "infra", "law", "news"))
    as_list = default_decontaminate("c", "/corpus", [task, "/eval/web.jsonl"])
    as_map = default_decontaminate("c", "/corpus", {"t/task": task, "/eval/web.jsonl": "/eval/web.jsonl"})
    assert list(as_list.config.against) == ["t/task", "/eval/web.jsonl"]
    assert plan_steps([as_list], "/p").steps[-1].hash == plan_steps([as_map], "/p").steps[-1].hash
    assert plan_steps([as_list], "/p").steps[-1].hash != plan_steps([default_decontaminate("c", "/corpus", [task])],
                                                                    "/p").steps[-1].hash
    refused = [("/eval/web.jsonl", TypeError, r"against= takes a list of evaluation sets \(steps or paths\) or a "
                                               r"\{name: set\} mapping, got str '/eval/web.jsonl'"),
               (frozenset({"/eval/web.jsonl"}), TypeError, "mapping, got frozenset"),
               ([{"/eval/web.jsonl"}], TypeError, r"against=\[...\]: each evaluation set is a step or a path, got set"),
               ([task, task], ValueError, r"against=\[...\]: 't/task' is given twice")]
    for against, error, message in refused:
        with pytest.raises(error, match=message):
            default_decontaminate("c", "/corpus", against)
