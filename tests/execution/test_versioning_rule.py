"""One versioning rule for every step's config: every value is versioned unless its dataclass field
is declared ``live("why")``; ``versioned(x)`` (upstream Marin's spelling) is the same version as ``x``."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from marin.execution import ExecutorStep, UnhashableConfigError, plan_steps, this_output_path, versioned
from marin.execution.versioning import added_later, live, versioned_config

REPO = Path(__file__).resolve().parents[2]


def write(config) -> None:
    pass


def _hash(config, name: str = "tutorial/numbers") -> str:
    return plan_steps([ExecutorStep(name, write, config)], "/p").steps[0].hash


def _tutorial():
    spec = importlib.util.spec_from_file_location("tutorial_copy", REPO / "experiments" / "tutorial.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_field_added_to_a_copy_of_the_tutorial_moves_the_hash():
    tutorial = _tutorial()
    pinned = json.loads((REPO / "tests/experiments/pinned_step_hashes.json").read_text())["tutorial"]
    assert _hash(tutorial.numbers.config) == pinned["tutorial/numbers"]

    @dataclasses.dataclass(frozen=True)
    class WriteConfig:  # the tutorial's, with one undeclared field added by a user
        output_path: str
        n: int = 100
        step: int = 1

    assert _hash(WriteConfig(output_path=this_output_path(), n=1000)) != pinned["tutorial/numbers"]


def test_a_live_field_or_an_added_later_one_at_its_default_keeps_the_hash():
    tutorial = _tutorial()
    before = _hash(tutorial.numbers.config)

    @dataclasses.dataclass(frozen=True)
    class WriteConfig:
        output_path: str
        n: int = 100
        progress: bool = live("printing progress does not change numbers.txt", default=False)
        step: int = added_later(default=1)

    assert _hash(WriteConfig(output_path=this_output_path(), n=1000, progress=True)) == before
    assert _hash(WriteConfig(output_path=this_output_path(), n=1000, step=2)) != before


def test_versioned_spelling_plain_values_and_the_builders_rule_give_one_version():
    @dataclasses.dataclass(frozen=True)
    class Cfg:
        output_path: str
        n: int = 100
        weights: tuple = (0.5, 0.5)

    plain = Cfg(output_path=this_output_path(), n=7)
    wrapped = Cfg(output_path=this_output_path(), n=versioned(7), weights=versioned((0.5, 0.5)))
    assert _hash(plain) == _hash(wrapped) == _hash(versioned_config(plain))
    assert _hash(Cfg(output_path=this_output_path(), n=8)) != _hash(plain)
    assert _hash({"n": 7, "out": this_output_path()}) == _hash({"n": versioned(7), "out": this_output_path()})


def test_a_value_without_an_encoding_in_a_versioned_field_is_refused_in_one_line():
    @dataclasses.dataclass(frozen=True)
    class Cfg:
        output_path: str
        client: object = None

    with pytest.raises(UnhashableConfigError) as e:
        plan_steps([ExecutorStep("fetch", write, Cfg(this_output_path(), client=object()))], "/p")
    msg = str(e.value)
    assert "step 'fetch'" in msg and "client" in msg and 'declared live("why")' in msg and "\n" not in msg
