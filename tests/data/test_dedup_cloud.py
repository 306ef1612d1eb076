"""The dedup and decontamination steps on s3:// (moto server) and gs:// (GCS emulator): the same
output, byte for byte, as the in-process run on local disk (fanned out as Ray tasks over several band
partitions in the slow test), and a rerun after a kill on S3 reuses the finished signatures."""

from __future__ import annotations

import json

import fsspec
import pytest

import marin.data.dedup as dd
from marin.data.corpus_steps import CorpusInput
from marin.data.decontaminate import DecontaminateConfig, decontaminate
from marin.data.dedup import DedupConfig, dedup
from marin.data.readers import list_document_files
from marin.data.synthetic import write_planted_corpus

LOCAL = CorpusInput(show_progress=False, use_ray=False)


def _files(root: str) -> dict[str, bytes]:
    fs, base = fsspec.core.url_to_fs(root)
    fs.invalidate_cache()
    out = {}
    for f in list_document_files(root):
        rel = fs._strip_protocol(f)[len(base.rstrip("/")) + 1:]
        out[rel] = fs.cat_file(f)
    return out


def test_s3_to_gcs_matches_local(s3_bucket, gcs_bucket, tmp_path):
    write_planted_corpus(f"{s3_bucket}/corpus", docs_per_source=10, changed=(0.01,))
    write_planted_corpus(str(tmp_path / "corpus"), docs_per_source=10, changed=(0.01,))
    remote = f"{gcs_bucket}/dedup"
    dedup(DedupConfig(f"{s3_bucket}/corpus", remote, LOCAL))
    dedup(DedupConfig(str(tmp_path / "corpus"), str(tmp_path / "dedup"), LOCAL))
    assert _files(remote) == _files(str(tmp_path / "dedup"))
    with fsspec.open(f"{remote}/dedup_manifest.json") as f:
        assert json.load(f)["totals"]["documents_out"] < 60


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_s3_to_gcs_on_ray_matches_local(s3_bucket, gcs_bucket, tmp_path):
    truth = write_planted_corpus(f"{s3_bucket}/corpus", docs_per_source=30, changed=(0.01,))
    remote = f"{gcs_bucket}/dedup"
    dedup(DedupConfig(f"{s3_bucket}/corpus", remote, CorpusInput(show_progress=False, min_task_bytes=0),
                      partition_bytes=40_000))
    local = tmp_path / "dedup"
    write_planted_corpus(str(tmp_path / "corpus"), docs_per_source=30, changed=(0.01,))
    dedup(DedupConfig(str(tmp_path / "corpus"), str(local), LOCAL))
    assert _files(remote) == _files(str(local))
    with fsspec.open(f"{remote}/dedup_manifest.json") as f:
        man = json.load(f)
    assert man["params"]["partitions"] > 1 and man["totals"]["documents_out"] < man["totals"]["documents_in"]
    assert not fsspec.filesystem("gs").exists(f"{remote}/_work")

    out = f"{s3_bucket}/decon"
    decontaminate(DecontaminateConfig(remote, out, {"eval": truth["eval_path"]}, CorpusInput(show_progress=False)))
    with fsspec.open(f"{out}/decontamination_manifest.json") as f:
        dm = json.load(f)
    assert dm["against"]["eval"]["matched_training_documents"] >= 1


def test_rerun_after_a_kill_on_s3_skips_finished_signatures(s3_bucket, monkeypatch):
    corpus, out = f"{s3_bucket}/corpus", f"{s3_bucket}/dedup"
    write_planted_corpus(corpus, docs_per_source=8, changed=(0.01,))
    real = dd.write_kept_records

    def killed(*a, **k):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(dd, "write_kept_records", killed)
    cfg = DedupConfig(corpus, out, LOCAL)
    with pytest.raises(KeyboardInterrupt):
        dedup(cfg)
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    markers = fs.glob(f"{out}/_work/signatures/*.json")
    assert len(markers) == 6
    monkeypatch.setattr(dd, "write_kept_records", real)
    monkeypatch.setattr(dd, "minhash_signatures", lambda *a, **k: pytest.fail("signatures recomputed"))
    dedup(cfg)
    fs.invalidate_cache()
    assert fs.exists(f"{out}/dedup_manifest.json")


@pytest.mark.usefixtures("ray_local")
def test_ray_tasks_write_what_one_process_writes(tmp_path):
    write_planted_corpus(str(tmp_path / "corpus"), docs_per_source=6, changed=(0.01,))
    for name, kw in (("ray", {"min_task_bytes": 0}), ("local", {"use_ray": False})):
        dedup(DedupConfig(str(tmp_path / "corpus"), str(tmp_path / name), CorpusInput(show_progress=False, **kw)))
    assert _files(str(tmp_path / "ray")) == _files(str(tmp_path / "local"))


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_the_quickstart_data_steps_on_an_s3_prefix_are_cached_and_resume(s3_bucket):
    """The quickstart's data part (miniature corpus -> dedup -> decontamination against the IsoFLOP
    experiment's task) through the executor under an s3:// prefix: a run that stops after dedup
    leaves it finished, the next run does only what is missing, and a third finds everything cached."""
    from experiments.defaults import default_decontaminate, default_dedup, default_k40_miniature
    from marin.execution import ExecutorMainConfig, executor_main

    corpus = default_k40_miniature("qs/k40-mini", total_bytes=60_000, seed=0)
    deduped = default_dedup("qs/dedup", corpus)
    clean = default_decontaminate("qs/decontaminate", deduped)
    prefix = f"{s3_bucket}/run"

    def run(**flags):
        result = executor_main(ExecutorMainConfig(prefix=prefix, progress=False, **flags), steps=[clean])
        by_path = {s.output_path: s.name for s in result.plan.steps}
        return result, {by_path[p]: o for p, o in result.outcome.items()}

    _, first = run(run_only=["qs/dedup"])
    assert first == {"qs/k40-mini": "succeeded", "qs/dedup": "succeeded", "qs/decontaminate": "not_selected",
                     "tiny-isoflop/task": "not_selected"}
    second, outcome = run()
    assert outcome["qs/dedup"] == "cached" and outcome["qs/decontaminate"] == "succeeded"
    assert set(run()[1].values()) == {"cached"}
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    out = second.plan.planned(clean).output_path
    with fsspec.open(f"{out}/decontamination_manifest.json") as f:
        man = json.load(f)
    assert list(man["against"]) == ["k40_domains"] and man["totals"]["documents_in"] > 0
    with fsspec.open(f"{second.plan.planned(deduped).output_path}/dedup_manifest.json") as f:
        assert json.load(f)["params"]["threshold"] == 0.7
    assert list_document_files(out)  # the K40 layout, for tokenize
