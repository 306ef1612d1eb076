"""Canonical encoding and step hashes: stability, invariances, sensitivity, clear refusals."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from marin.execution import ExecutorStep, UnhashableConfigError, output_path_of, plan_steps, this_output_path, versioned
from marin.execution.hashing import canonical_json, encode


class Color(enum.Enum):
    RED = 1
    BLUE = 2


@dataclasses.dataclass(frozen=True)
class Inner:
    width: int
    rate: float


def noop(config) -> None:
    pass


def test_encoding_of_every_supported_type():
    value = {
        "s": "x", "i": 3, "big": 2**80, "f": 0.1, "b": True, "n": None, "e": Color.BLUE,
        "p": pathlib.PurePosixPath("a/b"), "t": (1, 2), "l": [1, 2], "d": {"k": 1}, "dc": Inner(4, 0.5),
    }
    enc = encode(value)["dict"]
    assert enc["s"] == "x" and enc["i"] == 3 and enc["big"] == 2**80
    assert enc["f"] == {"float": "0.1"}
    assert enc["b"] is True and enc["n"] is None
    assert enc["e"] == {"enum": "Color.BLUE"}
    assert enc["p"] == {"path": "a/b"}
    assert enc["t"] == {"tuple": [1, 2]} and enc["l"] == [1, 2]
    assert enc["d"] == {"dict": {"k": 1}}
    assert enc["dc"] == {"dataclass": "Inner", "fields": {"width": 4, "rate": {"float": "0.5"}}}


def test_types_that_compare_equal_in_python_encode_differently():
    encodings = {canonical_json(encode(v)) for v in (1, 1.0, True, "1", (1,), [1])}
    assert len(encodings) == 6


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_are_refused_with_field_path(bad):
    step = ExecutorStep("s", noop, {"opt": {"lr": versioned(bad)}})
    with pytest.raises(UnhashableConfigError) as e:
        plan_steps([step], "/tmp/p")
    assert 'opt["lr"]' in str(e.value) and "NaN" in str(e.value)
    assert "step 's'" in str(e.value)


def test_unsupported_types_are_refused_naming_path_and_type():
    @dataclasses.dataclass
    class C:
        sizes: object

    with pytest.raises(UnhashableConfigError) as e:
        plan_steps([ExecutorStep("s", noop, C(sizes=versioned({"a": b"\x00"})))], "/tmp/p")
    msg = str(e.value)
    assert 'sizes["a"]' in msg and "builtins.bytes" in msg
    with pytest.raises(UnhashableConfigError, match="dict key .*Opaque"):
        encode({Opaque(): "x"}, "weights")


class Opaque:
    """An object whose only text is its repr (which holds its address)."""


def test_dict_order_does_not_change_hash():
    a = ExecutorStep("s", noop, {"w": versioned({"x": 1, "y": 2})})
    b = ExecutorStep("s", noop, {"w": versioned({"y": 2, "x": 1})})
    assert plan_steps([a], "/p").steps[0].hash == plan_steps([b], "/p").steps[0].hash


def _hash(config, name="s", prefix="/p"):
    return plan_steps([ExecutorStep(name, noop, config)], prefix).steps[-1].hash


def test_each_leaf_changes_the_hash_wrapped_or_not():
    """Every value of a config is versioned; ``versioned(x)`` (upstream Marin's spelling) is the same as ``x``."""
    base = {"a": versioned(1), "b": versioned("x"), "c": versioned([1.5, 2.5]), "plain": 7}
    h = _hash(base)
    for key, new in [("a", versioned(2)), ("b", versioned("y")), ("c", versioned([1.5, 2.0])), ("plain", 8)]:
        assert _hash({**base, key: new}) != h, key
    assert _hash({**base, "plain": versioned(7)}) == h
    assert _hash({"a": 1, "b": "x", "c": [1.5, 2.5], "plain": 7}) == h
    assert _hash(base, name="t") != h
    assert len(h) >= 8 and int(h, 16) >= 0


def test_upstream_version_changes_downstream_hash_and_prefix_does_not():
    def chain(n_docs):
        up = ExecutorStep("up", noop, {"n": versioned(n_docs), "out": this_output_path()})
        return ExecutorStep("down", noop, {"inp": output_path_of(up, "f.txt")})

    assert _plan_hash(chain(1)) != _plan_hash(chain(2))
    assert _plan_hash(chain(1), "/p") == _plan_hash(chain(1), "gs://bucket/other")
    # the subpath read from the upstream is part of the version
    up = ExecutorStep("up", noop, {"n": versioned(1)})
    assert _plan_hash(ExecutorStep("d", noop, {"i": output_path_of(up, "a")})) != _plan_hash(
        ExecutorStep("d", noop, {"i": output_path_of(up, "b")})
    )


def _plan_hash(step, prefix="/p"):
    return plan_steps([step], prefix).planned(step).hash


def test_identical_steps_collapse_and_same_name_different_version_coexist():
    a1 = ExecutorStep("tok", noop, {"v": versioned(1)})
    a2 = ExecutorStep("tok", noop, {"v": versioned(1)})
    b = ExecutorStep("tok", noop, {"v": versioned(2)})
    plan = plan_steps([a1, a2, b], "/p")
    assert len(plan.steps) == 2
    assert plan.planned(a1) is plan.planned(a2)
    assert plan.planned(a1).output_path != plan.planned(b).output_path


EXPERIMENT = textwrap.dedent(
    """
    import dataclasses, enum, json, pathlib, sys
    from marin.execution import ExecutorStep, output_path_of, plan_steps, this_output_path, versioned

    class Mode(enum.Enum):
        FAST = "fast"

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        out: str
        lr: float
        mode: Mode
        path: pathlib.PurePosixPath
        weights: dict
        shape: tuple

    def f(c):
        pass

    a = ExecutorStep("a", f, Cfg(this_output_path(), versioned(3e-4), versioned(Mode.FAST),
                     versioned(pathlib.PurePosixPath("x/y")), versioned({"web": 0.25, "code": 0.75}),
                     versioned((1, 2))))
    b = ExecutorStep("b", f, {"inp": output_path_of(a, "z"), "n": versioned(10**20)})
    plan = plan_steps([b], sys.argv[1])
    print(json.dumps({s.name: s.hash for s in plan.steps}))
    """
)


def test_hashes_are_stable_across_processes_and_prefixes(tmp_path):
    script = tmp_path / "exp.py"
    script.write_text(EXPERIMENT)
    outs = []
    for seed, prefix in [("1", "/tmp/a"), ("2", "s3://bucket/b"), ("3", "gs://c/d")]:
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, str(script), prefix], capture_output=True, text=True, env=env, check=True)
        outs.append(json.loads(out.stdout))
    assert outs[0] == outs[1] == outs[2]
    # pin the encoding: a change here renames every output directory of every user
    assert outs[0] == {"a": "a81b572a80", "b": "2197187ffe"}, outs[0]


def test_hash_is_sha256_of_the_documented_encoding():
    import hashlib

    step = ExecutorStep("x", noop, {"n": versioned(1), "lr": versioned(0.5)})
    expected = hashlib.sha256(
        b'{"config":{"lr":{"float":"0.5"},"n":1},"dependencies":[],"name":"x"}'
    ).hexdigest()
    ps = plan_steps([step], "/p").steps[0]
    assert ps.digest == expected and ps.hash == expected[:10]
    assert ps.output_path == f"/p/x-{expected[:10]}"


def test_a_field_added_later_leaves_a_nested_dataclass_encoding_alone_at_its_default():
    """A dataclass versioned as one value (not field by field) keeps its hash when a field declared
    added_later joins it, until that field is set."""
    import dataclasses

    from marin.execution.hashing import encode
    from marin.execution.versioning import added_later

    @dataclasses.dataclass(frozen=True)
    class Before:
        a: int = 1

    @dataclasses.dataclass(frozen=True)
    class After:
        a: int = 1
        b: int = added_later(default=2)

    After.__qualname__ = Before.__qualname__
    assert encode(After()) == encode(Before())
    assert encode(After(b=3)) != encode(Before())
