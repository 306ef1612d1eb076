"""metrics.jsonl writer (local and object store), MFU, progress line."""

import io
import json

import pytest

from marin.training.metrics import MetricsWriter, ProgressLine, mfu, peak_flops_per_device, read_metrics


def _rec(step, **kw):
    r = {"step": step, "loss": 10.0 / step, "lr": 1e-3, "grad_norm": 0.5, "drop_frac_send": 0.03,
         "drop_frac_recv": 0.01, "seq_len": 64, "transport": "fixed", "tokens_per_s": 1000.0, "mfu": 0.2}
    r.update(kw)
    return r


@pytest.mark.parametrize("store", ["local", "s3_bucket"])
def test_writer_truncates_replayed_steps_on_resume(store, request, tmp_path):
    out = str(tmp_path) if store == "local" else f"{request.getfixturevalue(store)}/run"
    w = MetricsWriter(out)
    for s in range(1, 8):
        w.log(_rec(s))
    w.close()
    # the run died after logging step 7; its last checkpoint was step 5: steps 6-7 will be redone
    w = MetricsWriter(out, resume_step=5)
    w.log(_rec(6, loss=42.0))
    w.close()
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["loss"] == 42.0


def test_writer_keeps_non_finite_visible(tmp_path):
    w = MetricsWriter(str(tmp_path))
    w.log(_rec(1, loss=float("nan")))
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line)["loss"] == "nan"


def test_mfu_matches_hand_computation():
    # 6 x 22.76B active + attention ~ 1.5e11 FLOP/token; 46.1M tokens/step at 4,400 steps/day on 704 GB200
    tps = 46_137_344 * 4400 / 86400
    got = mfu(tps, 1.5e11, 704, peak_flops_per_device("GB200"))
    assert got == pytest.approx(tps * 1.5e11 / (704 * 2.5e15))
    assert 0.1 < got < 0.3  # the published run reports about 21%
    with pytest.raises(ValueError):
        mfu(1.0, 1.0, 0, 1.0)
    with pytest.raises(KeyError, match="known"):
        peak_flops_per_device("TPU-v9")


def test_progress_line():
    buf = io.StringIO()
    p = ProgressLine(total_steps=100, every_s=3600, stream=buf)
    assert p.update(_rec(1)) is not None  # the first update always prints
    assert p.update(_rec(2)) is None  # throttled
    line = p.update(_rec(100), force=True)
    assert "step 100/100 (100.0%)" in line and "drop 3.00%/1.00%" in line and "mfu 20.00%" in line


def test_phase_summary_groups_by_seq_len_and_transport():
    from marin.training.metrics import phase_summary

    recs = [_rec(s, seq_len=64 if s <= 4 else 128, transport="fixed" if s <= 6 else "dropless",
                 tokens_per_s=10.0 if s in (1, 5, 7) else 100.0, drop_frac_send=0.04 if s <= 6 else 0.0)
            for s in range(1, 9)]
    got = phase_summary(recs)
    assert [(p["seq_len"], p["transport"], p["first_step"], p["last_step"]) for p in got] == [
        (64, "fixed", 1, 4), (128, "fixed", 5, 6), (128, "dropless", 7, 8)]
    assert [p["tokens_per_s"] for p in got] == [100.0, 100.0, 100.0]  # compile steps left out
    assert got[2]["drop_frac_send"] == 0.0 and got[0]["drop_frac_send"] == pytest.approx(0.04)
