"""The planner per phase of a run (sequence length x transport), the hero on the capacity-bounded
ragged transport, the largest capacity factor that still fits, and the drop health per phase."""

import contextlib
import io
import json

import pytest

from marin.cli import main
from marin.commands.plan import (
    HERO_CONTEXT_PARALLEL,
    HERO_REMAT_BY_SEQ_LEN,
    HERO_SEQ_LEN_PHASES,
    HERO_TRANSPORT_SWITCHES,
    run_phases,
)
from marin.models.config import get_preset
from marin.monitoring.health import health
from marin.pools import get_pool
from marin.training.planning import (
    largest_fitting_capacity_factor,
    memory_plan,
    phase_plans,
    train_config_plans,
)


def _plan_json(argv):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    return rc, json.loads(buf.getvalue())


def test_hero_fits_every_phase_of_its_run():
    rc, p = _plan_json(["plan", "hero", "--pool", "gb200-11racks", "--json"])
    phases = p["phases"]
    assert [(ph["seq_len"], ph["transport"]) for ph in phases] == [
        (n, t) for n in (4096, 8192, 65536, 262144) for t in ("fixed", "ragged_capacity")]
    usable = p["usable_memory_bytes"]
    assert usable == pytest.approx(166.5 * 2**30, rel=1e-3)
    for ph in phases:
        assert set(ph) >= {"seq_len", "transport", "total_bytes", "fits"}
        assert ph["fits"] and ph["total_bytes"] <= usable
        assert ph["capacity_factor"] == 1.15 and ph["largest_fitting_capacity_factor"] > 1.15
    by = {(ph["seq_len"], ph["transport"]): ph for ph in phases}
    # the ragged phases cost about what the fixed ones do: the same rows in total, no send padding
    for n in (4096, 8192, 65536):
        assert by[n, "ragged_capacity"]["total_bytes"] <= by[n, "fixed"]["total_bytes"] * 1.01
    assert by[65536, "fixed"]["remat_policy"] == "full" and by[4096, "fixed"]["remat_policy"] == "dots"
    assert by[262144, "ragged_capacity"]["context_parallel"] == 4 and by[65536, "fixed"]["context_parallel"] == 1
    assert p["fits"] is True and rc == 0


def test_top_level_fits_needs_every_phase():
    """A pinned worst-case transport (and no context parallelism, which would spread its buffers): its
    one phase does not fit, so neither does the plan."""
    rc, p = _plan_json(["plan", "hero", "--pool", "gb200-11racks", "--json", "--transport", "dropless",
                        "--context-parallel", "1"])
    assert [ph["transport"] for ph in p["phases"]] == ["dropless"]
    assert p["phases"][0]["fits"] is False and "largest_fitting_capacity_factor" not in p["phases"][0]
    assert p["fits"] is False and rc == 1


def test_plan_table_names_the_largest_fitting_factor(capsys):
    assert main(["plan", "hero", "--pool", "gb200-11racks"]) == 0
    out = capsys.readouterr().out
    assert "phases of the run" in out and "ragged_capacity" in out and "fits up to" in out


@pytest.mark.usefixtures("offline_k40")  # importing the hero imports the K40 experiment, which reads its root
def test_the_hero_schedule_in_marin_plan_is_experiments_hero():
    from experiments.hero import HERO_TRAIN
    from marin.training.config import SyntheticDataConfig, TrainConfig

    par = HERO_TRAIN["parallelism"]
    assert tuple(par.transport_switches) == HERO_TRANSPORT_SWITCHES
    assert tuple(HERO_TRAIN["seq_len_phases"]) == HERO_SEQ_LEN_PHASES
    assert tuple(par.remat_by_seq_len) == HERO_REMAT_BY_SEQ_LEN
    assert tuple(par.context_parallel_by_seq_len) == HERO_CONTEXT_PARALLEL
    assert HERO_TRAIN["memory_check"] == "error"
    # the declaration-time check plans the same phases
    keys = ("model", "pool", "train_steps", "tokens_per_step", "seq_len_phases", "parallelism")
    config = TrainConfig(output_path="", data=SyntheticDataConfig(), **{k: HERO_TRAIN[k] for k in keys})
    plans = train_config_plans(config)
    assert sorted((p["seq_len"], p["transport"]) for p in plans) == sorted(
        run_phases(HERO_SEQ_LEN_PHASES, HERO_TRANSPORT_SWITCHES))
    assert all(p["fits"] for p in plans)


def test_largest_fitting_factor_is_the_edge_of_fitting():
    cfg, pool = get_preset("hero"), get_pool("gb200-11racks")
    tokens, usable = 11_264 * 4096, int(166.5 * 2**30)
    best = largest_fitting_capacity_factor(cfg, pool, tokens, 4096, 8, "ragged_capacity", "fsdp", usable)

    def total(cf):
        return memory_plan(cfg.replace(capacity_factor=cf), pool, tokens, 4096, 8, "ragged_capacity", "fsdp")["total"]

    assert total(best) <= usable < total(round(best + 0.01, 2))
    assert largest_fitting_capacity_factor(cfg, pool, tokens, 4096, 8, "ragged_capacity", "fsdp", 2**30) is None


def test_phase_plans_are_generic_over_phases():
    """Any list of (seq_len, transport): a new sequence-length phase is one more entry."""
    cfg, pool = get_preset("tiny-ep"), get_pool("local-cpu")
    got = phase_plans(cfg, pool, tokens_per_step=4096, phases=[(64, "fixed"), (128, "ragged_capacity"), (128, "local")],
                      remat_by_seq_len=((128, "full"),))
    assert [(p["seq_len"], p["transport"], p["remat_policy"]) for p in got] == [
        (64, "fixed", cfg.remat_policy), (128, "ragged_capacity", "full"), (128, "local", "full")]
    assert "largest_fitting_capacity_factor" not in got[2]


def _records(transport_drops):
    recs, step = [], 0
    for transport, recv in transport_drops:
        for _ in range(5):
            recs.append({"step": step, "loss": 5.0 - 0.01 * step, "grad_norm": 0.5, "seq_len": 4096,
                         "transport": transport, "drop_frac_send": 0.0, "drop_frac_recv": recv})
            step += 1
    return recs


def test_health_flags_a_ragged_phase_dropping_more_than_a_tenth_of_a_percent():
    ok = health(_records([("fixed", 0.03), ("ragged_capacity", 0.0002)]))
    checks = {c["name"]: c for c in ok["checks"]}
    assert checks["drop_phase_4096_fixed"]["ok"] and checks["drop_phase_4096_ragged_capacity"]["ok"]
    assert [p["transport"] for p in ok["summary"]["phases"]] == ["fixed", "ragged_capacity"]
    bad = health(_records([("fixed", 0.03), ("ragged_capacity", 0.002)]))
    c = {c["name"]: c for c in bad["checks"]}["drop_phase_4096_ragged_capacity"]
    assert not c["ok"] and "0.200% of assignments dropped (healthy <= 0.1%)" in c["detail"]
    assert not bad["ok"]
    # the fixed transport's limit stays 8%
    assert health(_records([("fixed", 0.05)]))["ok"]
