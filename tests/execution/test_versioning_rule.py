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


@dataclasses.dataclass(frozen=True)
class Old:
    """A config as steps were recorded with it."""
    output_path: str
    n: int = 100


@dataclasses.dataclass(frozen=True)
class Inner:
    """A nested dataclass versioned as one value: its encoding follows the same rule."""
    step: int = added_later(default=2, before=1)


@dataclasses.dataclass(frozen=True)
class New:
    """``Old`` with a field added whose current behaviour (2) is not what the recorded steps did (1)."""
    output_path: str
    n: int = 100
    step: int = added_later(default=2, before=1)


def test_a_field_added_later_with_a_new_default_keeps_old_records_and_gives_new_configs_their_own_hash():
    """``before`` is what steps recorded before the field did (a record without it reads back as it,
    and hashes as before); ``default`` is what a new config gets, under a hash of its own."""
    from marin.execution.hashing import encode
    from marin.execution.jsonable import from_jsonable, to_jsonable

    old = Old(output_path=this_output_path(), n=7)
    record = to_jsonable(dataclasses.replace(old, output_path="/p/x"))
    assert "step" not in record
    read = from_jsonable(New, record)
    assert read.step == 1 and New(output_path="/p/x").step == 2
    assert _hash(old) == _hash(New(output_path=this_output_path(), n=7, step=1)) == _hash(
        dataclasses.replace(read, output_path=this_output_path()))
    assert _hash(New(output_path=this_output_path(), n=7)) != _hash(old)  # a new config: the new behaviour, own hash
    assert encode(Inner(step=1))["fields"] == {} and encode(Inner())["fields"] == {"step": 2}


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
