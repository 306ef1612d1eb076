"""Planning: dependencies, cycles, bad inputs, placeholder resolution, selection."""

from __future__ import annotations

import dataclasses

import pytest

from marin.execution import (
    ExecutorStep,
    InputName,
    InvalidStepError,
    PlanError,
    output_path_of,
    plan_steps,
    resolve_config,
    this_output_path,
    versioned,
)
from marin.execution.selection import select_steps
from marin.execution.versioning import live


def noop(config) -> None:
    pass


@dataclasses.dataclass
class Cfg:
    inp: object = None
    out: object = None
    n: object = 1


def test_steps_reached_only_through_dependencies_are_planned_first():
    a = ExecutorStep("a", noop, Cfg(out=this_output_path()))
    b = ExecutorStep("b", noop, Cfg(inp=output_path_of(a)))
    c = ExecutorStep("c", noop, Cfg(inp=[output_path_of(b, "x"), output_path_of(a, "y")]))
    plan = plan_steps([c], "/p")
    assert [s.name for s in plan.steps] == ["a", "b", "c"]
    assert {d.name for d in plan.planned(c).dependencies} == {"a", "b"}


def test_placeholders_resolve_to_paths_and_versioned_values_unwrap():
    a = ExecutorStep("a", noop, Cfg(out=this_output_path("data"), n=versioned(5)))
    b = ExecutorStep("b", noop, Cfg(inp={"k": (output_path_of(a, "f.bin"),)}, out=this_output_path()))
    plan = plan_steps([b], "s3://bucket/run")
    ca = resolve_config(plan.planned(a), plan)
    cb = resolve_config(plan.planned(b), plan)
    pa = plan.planned(a).output_path
    assert ca.out == f"{pa}/data" and ca.n == 5
    assert cb.inp == {"k": (f"{pa}/f.bin",)} and cb.out == plan.planned(b).output_path
    assert pa.startswith("s3://bucket/run/a-")


def test_cycle_is_refused_naming_the_cycle():
    a = ExecutorStep("a", noop, Cfg())
    b = ExecutorStep("b", noop, Cfg(inp=output_path_of(a)))
    c = ExecutorStep("c", noop, Cfg(inp=output_path_of(b)))
    a.config.inp = output_path_of(c)  # configs are plain objects: a cycle can be built by mutation
    with pytest.raises(PlanError) as e:
        plan_steps([c], "/p")
    assert "dependency cycle" in str(e.value)
    assert (
        "c -> b -> a -> c" in str(e.value) or "a -> c -> b -> a" in str(e.value) or "b -> a -> c -> b" in str(e.value)
    )


def test_non_step_inputs_are_refused_with_the_field_path():
    with pytest.raises(TypeError, match="output_path_of\\(\\) needs an ExecutorStep, got str"):
        output_path_of("some/path")
    bad = ExecutorStep("bad", noop, Cfg(inp=InputName(step="tokenized/k40")))  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="step 'bad', config field inp is an input on str"):
        plan_steps([bad], "/p")
    a = ExecutorStep("a", noop, Cfg())
    holder = ExecutorStep("h", noop, Cfg(inp=a))
    with pytest.raises(PlanError, match="holds the step 'a' itself; use output_path_of"):
        plan_steps([holder], "/p")
    with pytest.raises(PlanError, match="not an ExecutorStep"):
        plan_steps(["a"], "/p")  # type: ignore[list-item]


@pytest.mark.parametrize("name", ["../escape", "a/../../b", "/abs/path", "gs://bucket/x", "", "white space"])
def test_bad_step_names_are_refused(name):
    with pytest.raises(InvalidStepError) as e:
        ExecutorStep(name, noop, Cfg())
    assert repr(name) in str(e.value) or "non-empty" in str(e.value)


def test_override_output_path_must_stay_inside_the_prefix():
    ok = ExecutorStep("a", noop, Cfg(), override_output_path="pinned/tokenizer")
    assert plan_steps([ok], "/p").steps[0].output_path == "/p/pinned/tokenizer"
    for bad in ("/elsewhere/x", "../x", "pinned/../../x", "gs://other/x"):
        with pytest.raises(InvalidStepError, match="outside the prefix"):
            plan_steps([ExecutorStep("a", noop, Cfg(), override_output_path=bad)], "/p")


def test_unknown_resource_keys_are_refused():
    with pytest.raises(InvalidStepError, match="unknown resource keys \\['gpus'\\]"):
        ExecutorStep("a", noop, Cfg(), resources={"gpus": 1})


def test_nonblocking_input_changes_hash_but_is_not_waited_for():
    a1 = ExecutorStep("a", noop, Cfg(n=versioned(1)))
    a2 = ExecutorStep("a", noop, Cfg(n=versioned(2)))
    e1 = ExecutorStep("eval", noop, Cfg(inp=InputName(a1).nonblocking()))
    e2 = ExecutorStep("eval", noop, Cfg(inp=InputName(a2).nonblocking()))
    p1 = plan_steps([e1], "/p")
    assert p1.planned(e1).dependencies == [] and p1.planned(e1).nonblocking_dependencies == [p1.planned(a1)]
    assert p1.planned(e1).hash != plan_steps([e2], "/p").planned(e2).hash


def test_run_only_selects_matches_and_their_unfinished_dependencies():
    a = ExecutorStep("tokenize", noop, Cfg())
    b = ExecutorStep("train", noop, Cfg(inp=output_path_of(a)))
    c = ExecutorStep("eval", noop, Cfg(inp=output_path_of(b)))
    other = ExecutorStep("unrelated", noop, Cfg())
    plan = plan_steps([c, other], "/p")
    none = {s: None for s in plan.steps}
    assert [s.name for s in select_steps(plan, none, ["^train$"])] == ["tokenize", "train"]
    done = dict(none)
    done[plan.planned(a)] = {"status": "SUCCESS", "events": []}
    assert [s.name for s in select_steps(plan, done, ["train"])] == ["train"]
    assert [s.name for s in select_steps(plan, none, None)] == ["tokenize", "train", "eval", "unrelated"]


def test_importing_the_executor_pulls_in_neither_jax_nor_ray():
    import subprocess
    import sys

    code = ("import sys, marin.execution, marin.review, marin.cli, experiments.quickstart; "
            "bad = [m for m in ('jax', 'ray', 'optax', 'tokenizers') if m in sys.modules]; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@dataclasses.dataclass
class LiveCfg:
    out: object = None
    mirror: str = live("where the operator copies outputs to; it does not change them", default="")


@pytest.mark.parametrize("make", [
    lambda: ExecutorStep("n", noop, Cfg(inp=versioned("s3://AKIAFAKE:secretvalue@bucket/k40"))),
    lambda: ExecutorStep("n", noop, Cfg(inp="s3://AKIAFAKE:secretvalue@bucket/k40")),
    lambda: ExecutorStep("n", noop, Cfg(inp={"web": ["gs://x", "s3://AKIAFAKE:secretvalue@bucket/k40"]})),
    lambda: ExecutorStep("n", noop, LiveCfg(mirror="s3://AKIAFAKE:secretvalue@bucket/k40")),
    lambda: ExecutorStep("n", noop, Cfg(), override_output_path="s3://AKIAFAKE:secretvalue@bucket/k40"),
], ids=["versioned", "plain", "nested", "live", "override"])
def test_a_url_with_credentials_anywhere_in_a_config_is_refused_without_echoing_them(make):
    with pytest.raises(PlanError) as e:
        plan_steps([make()], "s3://bucket/p")
    text = str(e.value)
    assert text.startswith("step 'n': ") and "s3://***@bucket/k40 has credentials in it" in text
    assert "secretvalue" not in text and "AKIAFAKE" not in text and "\n" not in text


def test_an_at_sign_past_the_host_is_not_a_credential():
    a = ExecutorStep("a", noop, Cfg(inp="hf://datasets/org/name@main", out="me@example.org"))
    assert plan_steps([a], "/p").steps[0].name == "a"
