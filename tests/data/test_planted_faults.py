"""Faults planted in the K40 miniature (exact duplicates, near-duplicates, contaminated documents) are
found by dedup and decontamination, record for record, and a request the corpus cannot hold is
refused in one line before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from marin.data.corpus_steps import CorpusInput
from marin.data.decontaminate import DecontaminateConfig, decontaminate
from marin.data.dedup import REASON_EXACT, REASON_NEAR, DedupConfig, dedup, normalize_words
from marin.data.k40 import MANIFEST_NAME
from marin.data.synthetic import (
    NEAR_MIN_WORDS,
    PlantedFaults,
    SyntheticK40Config,
    generate_k40_miniature,
    planted_vs_found,
)
from marin.evaluation.multiple_choice import DomainTaskConfig, write_domain_task

DOMAINS = ("council", "infra", "law", "web_code")


def _ids(root: Path) -> dict[str, str]:
    """Record id -> text of every record under ``root`` (the corpus is written as jsonl only)."""
    out = {}
    for f in sorted(root.rglob("*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            out[rec["id"]] = rec["text"]
    return out


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory):
    """A four-domain miniature with faults planted from a domain task, deduplicated and decontaminated
    in one process (the Ray path writes the same files: tests/data/test_dedup_cloud.py)."""
    d = tmp_path_factory.mktemp("planted")
    write_domain_task(DomainTaskConfig(str(d / "task"), DOMAINS, questions_per_domain=4))
    generate_k40_miniature(SyntheticK40Config(str(d / "corpus"), total_bytes=120_000, domains=DOMAINS,
                                              formats=("jsonl",), plant=PlantedFaults(6, 6, 4, str(d / "task"))))
    inputs = CorpusInput(show_progress=False, use_ray=False)
    dedup(DedupConfig(str(d / "corpus"), str(d / "dedup"), inputs))
    decontaminate(DecontaminateConfig(str(d / "dedup"), str(d / "clean"), {"task": str(d / "task")}, inputs))
    return d


def test_dedup_removes_one_of_each_planted_pair_and_nothing_else(planted_run):
    d = planted_run
    planted = json.loads((d / "corpus" / MANIFEST_NAME).read_text())["planted"]
    assert planted["counts"] == {REASON_EXACT: 6, REASON_NEAR: 6, "contaminated": 4}
    before, after = _ids(d / "corpus"), _ids(d / "dedup")
    removed = set(before) - set(after)
    pairs = [(p["copy"], p["original"]) for p in planted[REASON_EXACT] + planted[REASON_NEAR]]
    assert len({x for p in pairs for x in p}) == 2 * len(pairs)  # every fault in its own documents
    assert all(len(removed & set(p)) == 1 for p in pairs) and len(removed) == len(pairs)
    for p in planted[REASON_NEAR]:  # a near copy differs from its original, which is long enough
        assert before[p["copy"]] != before[p["original"]]
        assert len(normalize_words(before[p["original"]])) >= NEAR_MIN_WORDS
    for p in planted[REASON_EXACT]:
        assert normalize_words(before[p["copy"]]) == normalize_words(before[p["original"]])
    manifest = json.loads((d / "dedup" / "dedup_manifest.json").read_text())
    assert manifest["totals"]["removed"] == {REASON_EXACT: 6, REASON_NEAR: 6}


def test_decontamination_removes_exactly_the_contaminated_documents(planted_run):
    d = planted_run
    planted = json.loads((d / "corpus" / MANIFEST_NAME).read_text())["planted"]
    removed = set(_ids(d / "dedup")) - set(_ids(d / "clean"))
    assert removed == {p["document"] for p in planted["contaminated"]}
    lines = planted_vs_found(planted, json.loads((d / "dedup" / "dedup_manifest.json").read_text()),
                             json.loads((d / "clean" / "decontamination_manifest.json").read_text()))
    n_docs = sum(1 for _ in _ids(d / "corpus"))
    assert lines == [f"dedup removed 6 exact duplicates (planted 6) and 6 near-duplicates (planted 6) of "
                     f"{n_docs:,} documents",
                     "decontamination removed 4 documents matching task (planted 4)"]


def test_an_unplanted_miniature_is_the_same_bytes_as_before_planting_existed(tmp_path):
    """plant=None (the default) writes what the generator wrote before it could plant: the same
    config with and without the field set to None gives the same files, and no ``planted`` entry."""
    generate_k40_miniature(SyntheticK40Config(str(tmp_path / "a"), total_bytes=30_000, domains=DOMAINS))
    generate_k40_miniature(SyntheticK40Config(str(tmp_path / "b"), total_bytes=30_000, domains=DOMAINS,
                                              plant=PlantedFaults()))
    assert "planted" not in json.loads((tmp_path / "a" / MANIFEST_NAME).read_text())
    assert _ids(tmp_path / "a") == _ids(tmp_path / "b")


@pytest.mark.parametrize("plant, line", [
    (PlantedFaults(exact_duplicates=500),
     "cannot plant 500 exact and 0 near duplicates and 0 contaminated documents in 162 documents: plant fewer "
     "or generate more text (total_bytes)"),
    (PlantedFaults(contaminated=2), "plant.contaminated is 2 but plant.contaminate_from is None: name the "
                                    "evaluation set whose texts to plant"),
    (PlantedFaults(contaminated=99, contaminate_from="TASK"), "cannot plant 99 contaminated documents from "
                                                               "TASK: it holds 16 texts"),
])
def test_a_plant_the_corpus_cannot_hold_is_refused_in_one_line_before_writing(tmp_path, plant, line):
    write_domain_task(DomainTaskConfig(str(tmp_path / "task"), DOMAINS, questions_per_domain=4))
    if plant.contaminate_from:
        plant = PlantedFaults(contaminated=plant.contaminated, contaminate_from=str(tmp_path / "task"))
        line = line.replace("TASK", str(tmp_path / "task"))
    with pytest.raises(ValueError) as e:
        generate_k40_miniature(SyntheticK40Config(str(tmp_path / "c"), total_bytes=30_000, domains=DOMAINS,
                                                  plant=plant))
    assert str(e.value).startswith(line) and "\n" not in str(e.value)
    assert not (tmp_path / "c").exists()  # refused before a file was written


def test_marin_show_and_the_report_fold_the_domains_a_step_left_untouched(tmp_path, capsys):
    """Six domains, one contaminated document: dedup removes nothing (its table is one folded row and
    the total, not six rows of zeros); decontamination shows the one domain it touched, then the
    other five folded, in ``marin show`` and in the report's HTML."""
    from marin.commands.show import _print_content  # the command's printer, tested without a step record
    from marin.review.sections import corpus_filter_section
    from marin.review.steps import step_content

    domains = ("council", "infra", "law", "web_code", "science", "news")
    write_domain_task(DomainTaskConfig(str(tmp_path / "task"), domains[:4], questions_per_domain=2))
    task = str(tmp_path / "task")
    generate_k40_miniature(SyntheticK40Config(str(tmp_path / "corpus"), total_bytes=30_000, domains=domains,
                                              formats=("jsonl",), plant=PlantedFaults(contaminated=1,
                                                                                      contaminate_from=task)))
    inputs = CorpusInput(show_progress=False, use_ray=False)
    dedup(DedupConfig(str(tmp_path / "corpus"), str(tmp_path / "dedup"), inputs))
    decontaminate(DecontaminateConfig(str(tmp_path / "dedup"), str(tmp_path / "clean"), {"task": task}, inputs))
    planted = json.loads((tmp_path / "corpus" / MANIFEST_NAME).read_text())["planted"]["contaminated"][0]["document"]
    touched = next(d for d in domains if planted.startswith(f"{d}-"))

    dedup_content = step_content(str(tmp_path / "dedup"), ["dedup_manifest.json"])
    _print_content(dedup_content)
    text = capsys.readouterr().out
    assert "  6 domains, nothing removed " in text and not any(f"  {d} " in text for d in domains)
    assert f"  nothing removed in: {', '.join(sorted(domains))}" in text
    html = corpus_filter_section(dedup_content["corpus_filter"])
    assert html.count("<svg") == 2 and "6 domains, nothing removed" in html  # the folded row and the total

    decon_content = step_content(str(tmp_path / "clean"), ["decontamination_manifest.json"])
    _print_content(decon_content)
    text = capsys.readouterr().out
    assert f"  {touched} " in text and "  5 domains, nothing removed " in text
    assert sum(f"  {d} " in text for d in domains) == 1
    html = corpus_filter_section(decon_content["corpus_filter"])
    assert html.count("<svg") == 3 and f"<td>{touched}<td" in html
