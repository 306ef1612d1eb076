"""Paired gates: the verdict math against its references, the changes a restored state cannot take,
a fixed -> ragged_capacity gate of a tiny EP run on the 8-device CPU mesh (both arms from the same
checkpoint on identical batches), a diverging candidate, a gate killed midway, and cutovers resting
on a gate's verdict."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from marin.execution.jsonable import to_jsonable
from marin.models.config import get_preset
from marin.training.config import (
    AdamWConfig,
    CheckpointPolicy,
    Cutover,
    InitFrom,
    ParallelismConfig,
    SyntheticDataConfig,
    TelemetryConfig,
    TrainConfig,
    train_config_from_record,
)
from marin.training.cutover import CutoverRefused, check_cutovers
from marin.training.gate import (
    CONTROL,
    GATE_FILE,
    GATE_PLOT,
    GateConfig,
    GateRefused,
    GateThresholds,
    arm_config,
    check_gate,
    check_pool,
    dropped,
    gate_report,
    judge,
    paired_difference,
    step_time_summary,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_config(path, **kw) -> TrainConfig:
    base = dict(output_path=str(path), data=SyntheticDataConfig(vocab_size=512), model="tiny-ep", pool="local-cpu",
                train_steps=4, tokens_per_step=1024, seq_len_phases=((0.0, 32),),
                optimizer=AdamWConfig(peak_lr=1e-2, warmup_steps=1),
                checkpoint=CheckpointPolicy(every_steps=2, every_minutes=None, keep_last=2),
                telemetry=TelemetryConfig(wandb_project=None, progress_every_s=1e9))
    return TrainConfig(**{**base, **kw})


# ---- the verdict math --------------------------------------------------------------------------


def test_the_paired_difference_is_the_paired_t_interval():
    rng = np.random.default_rng(0)
    control = rng.normal(3.0, 0.3, size=25)
    candidate = control + rng.normal(0.01, 0.004, size=25)  # the same batches: the noise is shared
    got = paired_difference(control.tolist(), candidate.tolist(), 0.9)
    ref = stats.ttest_rel(candidate, control).confidence_interval(0.9)
    assert got["mean"] == pytest.approx(float(np.mean(candidate - control)), rel=1e-12)
    assert (got["low"], got["high"]) == (pytest.approx(ref.low, rel=1e-9), pytest.approx(ref.high, rel=1e-9))
    # the two curves' own spread is two orders larger: pairing is what makes a 200-step gate decisive
    assert got["high"] - got["low"] < 0.01 * (np.std(control) + np.std(candidate))
    diverged = paired_difference([1.0, 1.0, 1.0], [1.0, float("nan"), 2.0])
    assert math.isnan(diverged["high"])
    with pytest.raises(ValueError, match="equal lengths"):
        paired_difference([1.0, 2.0], [1.0])


def test_step_time_summary_against_numpy():
    times = [0.31, 0.2, 0.22, 0.5, 0.21, 0.19, 0.23]
    got = step_time_summary(times)
    assert got["median_s"] == pytest.approx(float(np.median(times)))
    assert got["p10_s"] == pytest.approx(float(np.percentile(times, 10)))
    assert got["p90_s"] == pytest.approx(float(np.percentile(times, 90)))
    assert got["spread"] == pytest.approx((got["p90_s"] - got["p10_s"]) / got["median_s"])
    assert got["n"] == 7 and math.isnan(step_time_summary([])["median_s"])


def _arm(loss, time_s, drop=0.0, status="done", reason=None, peak=None, capacity=None):
    return {"status": status, "reason": reason, "steps": list(range(1, len(loss) + 1)), "loss": loss,
            "grad_norm": [1.0] * len(loss), "step_time": step_time_summary(time_s), "drop_frac_send": drop,
            "drop_frac_recv": drop / 2, "peak_memory_bytes": peak, "device_memory_bytes": capacity,
            "batch_digests": [f"b{i}" for i in range(len(loss))], "step_time_s": time_s,
            "compiled": [False] * len(loss)}


def test_the_verdict_names_each_threshold_it_judged():
    control = _arm([3.0, 2.9, 2.8, 2.7], [1.0, 1.0, 1.0, 1.0], drop=0.03)
    good = _arm([3.0, 2.9, 2.8, 2.7], [0.8, 0.8, 0.8, 0.8], drop=1e-4)
    t = GateThresholds()
    v = judge(control, good, paired_difference(control["loss"], good["loss"]), t, expected_steps=4)
    assert v["pass"] and v["speedup"] == pytest.approx(1.25)
    for name in ("max_loss_delta", "min_speedup", "max_drop_fraction"):
        assert name in v["line"]
    assert "max_memory_fraction" not in v["line"]  # the backend reported no memory: not judged
    worse = _arm([3.1, 3.0, 2.95, 2.8], [1.2, 1.2, 1.2, 1.2], drop=0.2, peak=31.5 * 2**30, capacity=32 * 2**30)
    v = judge(control, worse, paired_difference(control["loss"], worse["loss"]), t, expected_steps=4)
    assert not v["pass"]
    assert v["line"].startswith("FAIL (max_loss_delta, min_speedup, max_drop_fraction, max_memory_fraction): ")
    relaxed = GateThresholds(max_loss_delta=1.0, min_speedup=0.0, max_drop_fraction=0.5, max_memory_fraction=1.0)
    assert judge(control, worse, paired_difference(control["loss"], worse["loss"]), relaxed, expected_steps=4)["pass"]


# ---- the changes a restored state can take -------------------------------------------------------


@pytest.mark.parametrize("changes, refusal", [
    ({"model.n_experts": 16}, r"reshapes the weights \(blocks/expert_down"),
    ({"seed": 3}, "seed cannot be a gate's change: it changes the batches"),
    ({"tokens_per_step": 2048}, "tokens_per_step cannot be a gate's change"),
    ({"checkpoint.every_steps": 5}, "the gate sets its arms' own checkpoints"),
    ({"parallelism.microbatches": 0}, "microbatches must be >= 1"),
    ({"parallelism.transport_switches": ((0, "dropless"),)}, "rewrites what ran before step 2"),
    ({"transport": "pigeon"}, "unknown transport 'pigeon'"),
    ({"optimiser.peak_lr": 1.0}, "unknown field 'optimiser.peak_lr'"),
    ({"model.wings": 2}, "the model has no field 'wings'"),
])
def test_a_change_a_restored_state_cannot_take_is_refused_in_one_line(tmp_path, changes, refusal):
    with pytest.raises(GateRefused, match=refusal) as e:
        arm_config(_run_config(tmp_path), changes, at_step=2, label="x")
    assert "\n" not in str(e.value) and str(e.value).startswith("candidate 'x': ")


def test_what_a_candidate_may_change(tmp_path):
    run = _run_config(tmp_path, parallelism=ParallelismConfig(transport_switches=((0, "fixed"), (1, "dropless"))))
    arm = arm_config(run, {"transport": "ragged_capacity", "parallelism.microbatches": 2,
                           "optimizer.peak_lr": 3e-3, "model.remat_policy": "full"}, at_step=2)
    assert arm.parallelism.transport_switches == ((0, "fixed"), (1, "dropless"), (2, "ragged_capacity"))
    assert (arm.parallelism.microbatches, arm.optimizer.peak_lr, arm.model.remat_policy) == (2, 3e-3, "full")
    assert arm.model.replace(remat_policy="none") == run.model  # nothing else of the model moved

    def gate(**kw):
        return GateConfig(run=str(tmp_path), output_path=str(tmp_path / "g"), at_step=2, steps=2,
                          candidates={"r": {"transport": "ragged_capacity"}}, **kw)

    with pytest.raises(GateRefused, match="past the run's horizon"):
        check_gate(dataclasses.replace(gate(), steps=3), run)
    with pytest.raises(GateRefused, match=r"gate's pool h200-1 has H200 devices but the run trains on cpu"):
        check_gate(gate(pool="h200-1"), run)
    # a smaller pool of the run's device kind is allowed, and gate.json says so
    assert check_pool(run.pool, None) is None and check_pool(run.pool, "local-cpu") is None
    assert "smaller than the run's local-cpu (8): step times" in check_pool(run.pool, "local-cpu-1")
    with pytest.raises(GateRefused, match="'control' is the arm of the run's own settings"):
        GateConfig(run="r", output_path="o", at_step=2, candidates={CONTROL: {"transport": "fixed"}})


def test_default_gate_refuses_before_anything_runs_and_versions_what_it_measures():
    from experiments.defaults import default_gate, default_train
    from marin.execution import plan_steps

    train = default_train("main", mixture=SyntheticDataConfig(vocab_size=512), model="tiny-ep", pool="local-cpu",
                          train_steps=60, tokens_per_step=1024, seq_len_phases=((0.0, 32),), telemetry=TelemetryConfig(
                              wandb_project=None))
    with pytest.raises(GateRefused, match="candidate 'wide': the change reshapes the weights"):
        default_gate("gate", train, 40, {"wide": {"model.d_model": 128}}, steps=10)

    def planned(**kw):
        gate = default_gate("gate", train, **{"at_step": 40, "candidates": {"r": {"transport": "ragged_capacity"}},
                                               "steps": 10, **kw})
        return plan_steps([gate], "/tmp/p").planned(gate)

    p = planned()
    assert [d.name for d in p.nonblocking_dependencies] == ["main"]  # the gate runs beside the live run
    assert p.config_leaves["at_step"] == 40
    for other in (dict(at_step=20), dict(steps=12), dict(candidates={"r": {"transport": "dropless"}}),
                  dict(thresholds=GateThresholds(min_speedup=1.1))):
        assert planned(**other).hash != p.hash


# ---- a gate on the 8-device CPU mesh -------------------------------------------------------------


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    """A tiny EP run (fixed transport, 5 steps, checkpoints at 2, 4 and 5) and a 3-step gate at step 2 of
    two candidates: the ragged_capacity transport, and an absurd learning rate. A branch from the
    checkpoint at step 2 pinned it before the gate."""
    from marin.training.checkpoint import pin_checkpoint
    from marin.training.gate_run import run_gate
    from marin.training.trainer import run_training

    root = tmp_path_factory.mktemp("gate")
    # one layer: XLA drops a one-step scan's loop, so each of the fixture's two compiles (fixed, ragged_capacity)
    # takes about 2/3 of the 4-layer time; nothing here depends on depth
    source = _run_config(root / "main", model=get_preset("tiny-ep", n_layers=1), train_steps=5,
                         checkpoint=CheckpointPolicy(every_steps=2, every_minutes=None, keep_last=3))
    run_training(source, use_ray=False)
    snapshot = _snapshot(root / "main")
    pin_checkpoint(str(root / "main"), 2, by=str(root / "branch"))  # what a branch's start writes
    # step times on a shared CPU are not judged here, and a 3-step window's t interval is wide (t = 4.3)
    # the arms checkpoint at steps 3 and 5 only (the default cadence, every step here, writes and then
    # deletes three per arm): a finished arm's removed checkpoints are still checked below
    gate = GateConfig(run=str(root / "main"), output_path=str(root / "gate"), at_step=2, steps=3, checkpoint_every=3,
                      candidates={"ragged": {"transport": "ragged_capacity"}, "hot": {"optimizer.peak_lr": 1e6}},
                      thresholds=GateThresholds(min_speedup=0.0, max_loss_delta=0.05))
    result = run_gate(gate, use_ray=False)
    return source, gate, result, snapshot


def _snapshot(path):
    """Every file of a run but its pins (other steps write them, so its retention keeps their sources)."""
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and "pins" not in p.relative_to(path).parts}


def _gate_json(gate: GateConfig) -> dict:
    with open(f"{gate.output_path}/{GATE_FILE}") as f:
        return json.load(f)


def test_a_fixed_to_ragged_capacity_gate_on_identical_batches(gated):
    from marin.training.checkpoint import read_pins
    from marin.training.metrics import read_metrics
    from marin.training.trainer import synthetic_batch

    source, gate, result, snapshot = gated
    doc = _gate_json(gate)
    control, ragged = doc["arms"][CONTROL], doc["arms"]["ragged"]
    # both arms from the run's checkpoint at step 2
    assert doc["checkpoint"].endswith("step-00000002") and doc["window"] == [3, 5]
    for label in (CONTROL, "ragged"):
        with open(f"{gate.output_path}/arms/{label}/arm.json") as f:
            assert json.load(f)["resumed_from"] == 2
    # the control continues the run exactly: same state, batches and LR in the same process, so bitwise
    assert control["loss"] == [r["loss"] for r in read_metrics(source.output_path)[2:]]
    # identical batches: each arm's fingerprints are those of the run's batches 2, 3 and 4
    from marin.training.gate_run import batch_digest

    expected = [batch_digest(synthetic_batch(source.data, s, 32, 32)["tokens"]) for s in (2, 3, 4)]
    assert control["batch_digests"] == ragged["batch_digests"] == expected and doc["identical_batches"]
    assert control["transport"] == ["fixed"] and ragged["transport"] == ["ragged_capacity"]
    # pooled capacity drops fewer tokens than fixed per-expert slots on the same routing
    assert dropped(ragged) < dropped(control) and ragged["drop_frac_send"] == 0.0  # ragged sends every token
    paired = ragged["paired_loss_delta"]
    assert paired["n"] == 3 and paired["low"] <= paired["mean"] <= paired["high"]
    assert ragged["verdict"]["pass"] and "ragged" in result["passed"]
    assert os.path.getsize(f"{gate.output_path}/{GATE_PLOT}") > 0
    # marin show and the report render it
    from marin.review.gate import format_gate, gate_comparison, gate_html
    from marin.review.steps import step_content

    shown = format_gate(step_content(gate.output_path, [GATE_FILE])["gate"])
    assert "identical batches: yes" in shown and "ragged: pass: 3 finite steps" in shown and "hot: FAIL" in shown
    assert gate_html(doc).count("<svg") == 2  # the arms' loss and step time
    rows = gate_comparison({"g": doc})  # marin compare of gates: one row per candidate
    assert [(r[1], r[-1]) for r in rows] == [("ragged", "pass"), ("hot", "FAIL")]
    assert not os.path.exists(f"{gate.output_path}/arms/ragged/checkpoints")  # a finished arm keeps its records only
    # nothing of the run's output was written but the pins on the gated checkpoint, and those went with
    # the verdict: the gate's and its arms' (the branch's pin on the same checkpoint stays)
    assert _snapshot(Path(source.output_path)) == snapshot
    assert read_pins(source.output_path) == {2: [f"branch {Path(gate.output_path).parent / 'branch'}"]}


def test_a_diverging_candidate_fails_with_its_reason(gated):
    _, gate, result, _ = gated
    hot = _gate_json(gate)["arms"]["hot"]
    assert hot["status"] == "diverged" and "hot" in result["failed"]
    assert hot["verdict"]["line"].startswith("FAIL (finished")
    assert "diverged: non-finite training signal at step" in hot["verdict"]["line"]
    assert "hot: FAIL" in result["verdict"] and "ragged: pass" in result["verdict"]


# ---- cutovers -------------------------------------------------------------------------------------


def _written_gate(tmp_path, candidate_loss, run="r", candidates=None) -> str:
    """A gate directory whose gate.json is gate_report's for a control and its candidates (each with
    ``candidate_loss``), gating the run at ``run``'s checkpoint at step 2."""
    gate = GateConfig(run=str(run), output_path=str(tmp_path / "gate"), at_step=2, steps=4,
                      candidates=candidates or {"ragged": {"transport": "ragged_capacity"}})
    arms = {CONTROL: _arm([3.0, 2.9, 2.8, 2.7], [1.0] * 4, drop=0.03),
            **{label: _arm(candidate_loss, [0.9] * 4) for label in gate.candidates}}
    os.makedirs(gate.output_path)
    with open(f"{gate.output_path}/{GATE_FILE}", "w") as f:
        json.dump(gate_report(gate, arms, checkpoint="c", pool_note=None, changes=gate.candidates), f)
    return gate.output_path


def test_a_cutover_rests_on_its_gate_and_a_failed_gate_is_refused_unless_forced(tmp_path):
    from marin.training.trainer import run_training

    good = _written_gate(tmp_path / "a", [3.0, 2.9, 2.8, 2.7], run=tmp_path / "run")
    bad = _written_gate(tmp_path / "b", [3.5, 3.4, 3.3, 3.2], run=tmp_path / "run")
    switches = ParallelismConfig(transport_switches=((0, "fixed"), (3, "ragged_capacity")))
    run = _run_config(tmp_path / "run", parallelism=switches, cutovers=(Cutover(3, good, "ragged"),))
    [ev] = check_cutovers(run)
    assert ev["pass"] is True and ev["changes"] == {"transport": "ragged_capacity"} and ev["verdict"].startswith("pass")
    # the record says which gate the switch rests on, reads back, and marin show lists it
    from marin.review.gate import cutover_lines

    record = to_jsonable(run)
    assert train_config_from_record(record).cutovers == (Cutover(3, good, "ragged"),)
    assert cutover_lines(record) == [f"step 3: transport fixed -> ragged_capacity; gate {good} candidate ragged: pass"]
    later = dict(record, parallelism={**record["parallelism"], "transport_switches": [[0, "fixed"], [3, "ragged"],
                                                                                      [5, "dropless"]]})
    assert cutover_lines(later)[1] == "step 5: transport ragged -> dropless; no gate recorded"
    refused = dataclasses.replace(run, cutovers=(Cutover(3, bad, "ragged"),))
    with pytest.raises(CutoverRefused, match=r"cutover at step 3 rests on gate .* candidate 'ragged', which failed: "
                                          r"FAIL \(max_loss_delta\).*forced=True") as e:
        run_training(refused, use_ray=False)  # refused before the pool starts
    assert "\n" not in str(e.value) and not os.path.exists(tmp_path / "run")
    [forced] = check_cutovers(dataclasses.replace(run, cutovers=(Cutover(3, bad, "ragged", forced=True),)))
    assert forced["forced"] and forced["pass"] is False
    for missing, why in ((Cutover(3, str(tmp_path / "nowhere"), "ragged"), "has no gate.json yet"),
                         (Cutover(3, good, "dropless"), "has no verdict for it")):
        with pytest.raises(CutoverRefused, match=why):
            check_cutovers(dataclasses.replace(run, cutovers=(missing,)))


# ---- a gate killed midway -------------------------------------------------------------------------

_GATE_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import conftest  # the fake devices' environment
from marin.training.gate import GateConfig, GateThresholds
from marin.training.gate_run import run_gate
run_gate(GateConfig(run={run!r}, output_path={out!r}, at_step=2, steps=4, checkpoint_every=1,
                    candidates={{"ragged": {{"transport": "ragged_capacity"}}}},
                    thresholds=GateThresholds(min_speedup=0.0)), use_ray=False)
"""


@pytest.mark.slow
def test_a_gate_killed_midway_resumes(tmp_path):
    """The gate is killed (SIGKILL) once its candidate arm has committed a checkpoint; run again it
    keeps the finished control, resumes the candidate from its own checkpoint, and writes what an
    uninterrupted gate writes."""
    from marin.training.gate_run import run_gate
    from marin.training.trainer import run_training

    source = _run_config(tmp_path / "main", train_steps=6,
                         checkpoint=CheckpointPolicy(every_steps=2, every_minutes=None, keep_last=3))
    run_training(source, use_ray=False)
    out = str(tmp_path / "gate")
    script = _GATE_SCRIPT.format(tests=os.path.join(REPO, "tests"), run=source.output_path, out=out)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, start_new_session=True)
    arm_ckpts = tmp_path / "gate" / "arms" / "ragged" / "checkpoints"
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None and not list(arm_ckpts.glob("step-*/COMMIT")):
        time.sleep(0.2)
    assert proc.poll() is None, "the gate ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (tmp_path / "gate" / "arms" / CONTROL / "arm.json").exists()
    assert not (tmp_path / "gate" / GATE_FILE).exists()
    # no verdict yet: the gated checkpoint stays pinned (by the gate, and by each arm that restored it)
    from marin.training.checkpoint import read_pins

    assert sorted(read_pins(source.output_path)[2]) == [f"branch {out}/arms/{CONTROL}", f"branch {out}/arms/ragged",
                                                        f"gate {out}"]
    control_before = (tmp_path / "gate" / "arms" / CONTROL / "arm.json").stat().st_mtime_ns
    gate = GateConfig(run=source.output_path, output_path=out, at_step=2, steps=4, checkpoint_every=1,
                      candidates={"ragged": {"transport": "ragged_capacity"}}, thresholds=GateThresholds(min_speedup=0))
    run_gate(gate, use_ray=False)
    assert (tmp_path / "gate" / "arms" / CONTROL / "arm.json").stat().st_mtime_ns == control_before
    with open(tmp_path / "gate" / "arms" / "ragged" / "arm.json") as f:
        assert json.load(f)["resumed_from"] > 2  # from its own checkpoint, not the run's
    resumed = _gate_json(gate)
    assert read_pins(source.output_path) == {}  # released with the verdict
    whole = dataclasses.replace(gate, output_path=str(tmp_path / "whole"))
    run_gate(whole, use_ray=False)
    uninterrupted = _gate_json(whole)
    for label in (CONTROL, "ragged"):
        assert resumed["arms"][label]["steps"] == [3, 4, 5, 6]
        assert resumed["arms"][label]["batch_digests"] == uninterrupted["arms"][label]["batch_digests"]
        # restored state and the same batches; the killed part ran in another process (the same program
        # on the same machine, so equal but for a compile that orders float sums differently)
        assert resumed["arms"][label]["loss"] == pytest.approx(uninterrupted["arms"][label]["loss"], rel=1e-6)


def test_a_cutover_needs_a_gate_of_this_runs_checkpoint_and_of_this_change(tmp_path):
    """A passing verdict is evidence only for the checkpoint it started from and the change it tried:
    another run's gate, a gate after the cutover's step, or a candidate that tested another change is
    refused in one line unless forced, and a forced one is shown as such."""
    from marin.review.gate import cutover_lines

    candidates = {"ragged": {"transport": "ragged_capacity"}, "mb2": {"parallelism.microbatches": 2}}
    own = _written_gate(tmp_path / "own", [3.0, 2.9, 2.8, 2.7], run=tmp_path / "run", candidates=candidates)
    other = _written_gate(tmp_path / "other", [3.0, 2.9, 2.8, 2.7], run=tmp_path / "other-run",
                          candidates=candidates)
    switch = ParallelismConfig(transport_switches=((0, "fixed"), (10, "ragged_capacity")))
    run = _run_config(tmp_path / "run", train_steps=20, parallelism=switch)
    [ok] = check_cutovers(dataclasses.replace(run, cutovers=(Cutover(10, own, "ragged"),)))
    assert ok["pass"] is True and ok["mismatch"] is None
    refusals = {
        (other, "mb2"): f"gated {tmp_path / 'other-run'} at step 2, which is not this run ({tmp_path / 'run'}) nor the "
                        "checkpoint it branched from; a gate is evidence only for the state it started from",
        (other, "ragged"): f"gated {tmp_path / 'other-run'} at step 2, which is not this run",
        (own, "mb2"): "tested parallelism.microbatches=2, but this run has parallelism.microbatches=None",
    }
    for (gate, label), why in refusals.items():
        with pytest.raises(CutoverRefused) as e:
            check_cutovers(dataclasses.replace(run, cutovers=(Cutover(10, gate, label),)))
        line = str(e.value)
        assert "\n" not in line and line.startswith(f"cutover at step 10 rests on gate {gate} candidate {label!r}, "
                                                   f"which does not back this run's change: it {why}"), line
        assert line.endswith("; pass Cutover(..., forced=True) to apply it anyway")
    # the microbatch candidate backs a run that made that change and no transport switch at the step
    mb2 = _run_config(tmp_path / "run", train_steps=20, parallelism=ParallelismConfig(microbatches=2),
                      cutovers=(Cutover(10, own, "mb2"),))
    assert check_cutovers(mb2)[0]["mismatch"] is None
    # ... but not a run whose change at that step is a transport switch
    both = dataclasses.replace(mb2, parallelism=dataclasses.replace(switch, microbatches=2))
    with pytest.raises(CutoverRefused, match="it tested parallelism.microbatches, but this run's change at step 10 "
                                             "is a transport switch to ragged_capacity;"):
        check_cutovers(both)
    # a gate of this run's checkpoint after the cutover is not the state the change started from
    with pytest.raises(CutoverRefused, match="it gated this run's checkpoint at step 2, after the cutover's step 1;"):
        check_cutovers(dataclasses.replace(run, parallelism=ParallelismConfig(transport_switches=(
            (0, "fixed"), (1, "ragged_capacity"))), cutovers=(Cutover(1, own, "ragged"),)))
    # a branch shares its source's history up to the branch point: the source's gate at or before it backs it
    branch = dataclasses.replace(run, output_path=str(tmp_path / "branch"),
                                 init_from=InitFrom(run=str(tmp_path / "run"), step=4), cutovers=(Cutover(10, own,
                                                                                                          "ragged"),))
    assert check_cutovers(branch)[0]["mismatch"] is None
    # forced: applied, recorded as forced, and marin show says both the verdict and why it does not back it
    forced = dataclasses.replace(run, cutovers=(Cutover(10, other, "mb2", forced=True),))
    [ev] = check_cutovers(forced)
    assert ev["forced"] and ev["pass"] is True and ev["mismatch"].startswith("gated ")
    [line] = cutover_lines(to_jsonable(forced))
    assert line == (f"step 10: transport fixed -> ragged_capacity; gate {other} candidate mb2: pass, but it does not "
                    f"back this change: it gated {tmp_path / 'other-run'} at step 2, which is not this run "
                    f"({tmp_path / 'run'}) nor the checkpoint it branched from; a gate is evidence only for the state "
                    "it started from (applied anyway: forced)")
