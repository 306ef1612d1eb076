"""Configs the executor must refuse or encode canonically: odd dict keys, deep nesting, plain objects,
steps declared twice, and the one masking rule every rendering uses."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from marin.execution import (
    ExecutorStep,
    PlanError,
    UnhashableConfigError,
    output_path_of,
    plan_steps,
    resolve_config,
    this_output_path,
    versioned,
)
from marin.execution.jsonable import MASK, mask_leaves, mask_secrets, mask_text, to_jsonable
from marin.execution.versioning import live

REPO = Path(__file__).resolve().parents[2]


def noop(config) -> None:
    pass


# -------------------------------------------------------------------------------- canonical keys


HASH_SCRIPT = textwrap.dedent(
    """
    from marin.execution import ExecutorStep, plan_steps, versioned
    def noop(c): pass
    a = ExecutorStep("a", noop, {frozenset({"x", "y", "z", "w"}): versioned(2), "s": versioned({"q", "r", "t"})})
    b = ExecutorStep("b", noop, {"w": versioned({frozenset({"x", "y", "z"}): 1, (1, "k"): 2})})
    print(plan_steps([a, b], "/tmp/p").steps[0].hash, plan_steps([b], "/tmp/p").steps[0].hash)
    """
)


def test_non_str_keys_and_sets_hash_the_same_under_every_hash_seed():
    hashes = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-c", HASH_SCRIPT], env=env, capture_output=True, text=True, check=True)
        hashes.add(out.stdout.strip())
    assert len(hashes) == 1, hashes


def test_frozenset_key_is_named_by_its_canonical_encoding_and_resolves():
    step = ExecutorStep("a", noop, {frozenset({"y", "x"}): versioned(2)})
    plan = plan_steps([step], "/tmp/p")
    assert list(plan.steps[0].config_leaves) == ['[{"set":["x","y"]}]']
    assert resolve_config(plan.steps[0], plan) == {frozenset({"x", "y"}): 2}


class Opaque:
    pass


def test_versioned_value_under_a_key_without_canonical_form_is_refused_with_its_path():
    key = Opaque()
    step = ExecutorStep("a", noop, {"weights": {key: versioned(2)}})
    with pytest.raises(UnhashableConfigError) as e:
        plan_steps([step], "/tmp/p")
    msg = str(e.value)
    assert "step 'a'" in msg and "weights[" in msg and "Opaque" in msg and "canonical" in msg
    # a plain value under such a key is versioned too (every value is), so it is refused the same way;
    # in a field declared live it is never named in a version
    with pytest.raises(UnhashableConfigError, match=r"step 'b'.*weights\["):
        plan_steps([ExecutorStep("b", noop, {"weights": {key: 2}, "n": versioned(1)})], "/tmp/p")
    plan_steps([ExecutorStep("b", noop, LiveClient(client={key: 2}))], "/tmp/p")


@dataclasses.dataclass(frozen=True)
class LiveClient:
    """A config with a live field: what stays out of the version (a client, a handle) goes here."""

    client: object = live("a connection: how the step reaches its store, not what it writes", default=None)
    n: int = 1
    out: str = dataclasses.field(default_factory=this_output_path)


# -------------------------------------------------------------------------------- deep nesting


def _nested(depth: int, leaf) -> dict:
    d = leaf
    for _ in range(depth):
        d = {"x": d}
    return d


@pytest.mark.parametrize("versioned_inside", [True, False])
def test_config_nested_600_deep_is_a_clear_error_not_a_recursion_error(versioned_inside):
    config = versioned(_nested(600, 1)) if versioned_inside else _nested(600, versioned(1))
    with pytest.raises(UnhashableConfigError) as e:
        plan_steps([ExecutorStep("deep", noop, config)], "/tmp/p")
    assert "nested more than 100 levels" in str(e.value) and "step 'deep'" in str(e.value)
    assert not isinstance(e.value, RecursionError)


def test_config_that_contains_itself_is_refused():
    loop: dict = {"n": versioned(1)}
    loop["self"] = loop
    with pytest.raises(UnhashableConfigError, match="contains itself"):
        plan_steps([ExecutorStep("loop", noop, loop)], "/tmp/p")


# -------------------------------------------------------------------------------- plain objects


class PlainConfig:
    def __init__(self):
        self.out = this_output_path()
        self.n = versioned(3)


def test_plain_object_holding_placeholders_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(PlanError) as e:
        plan_steps([ExecutorStep("plain", noop, PlainConfig())], str(tmp_path))
    msg = str(e.value)
    assert "PlainConfig object" in msg and "OutputName" in msg and "@dataclasses.dataclass" in msg
    nested = {"inner": [PlainConfig()]}
    with pytest.raises(PlanError, match=r"inner\[0\] is a PlainConfig"):
        plan_steps([ExecutorStep("plain", noop, nested)], str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_plain_object_in_a_live_field_is_passed_through_and_elsewhere_refused_with_a_line(tmp_path):
    class Client:
        def __init__(self):
            self.me = self  # a cycle inside an opaque object is not the config's business

    client = Client()
    plan = plan_steps([ExecutorStep("ok", noop, LiveClient(client=client))], str(tmp_path))
    assert resolve_config(plan.steps[0], plan).client is client
    with pytest.raises(UnhashableConfigError) as e:  # not declared live: versioned, and it has no encoding
        plan_steps([ExecutorStep("ok", noop, {"client": client, "out": this_output_path()})], str(tmp_path))
    msg = str(e.value)
    assert "step 'ok'" in msg and "client" in msg and "Client" in msg and 'live("why")' in msg and "\n" not in msg


def test_placeholder_as_dict_key_is_refused():
    with pytest.raises(PlanError, match="as a dict key"):
        plan_steps([ExecutorStep("k", noop, {versioned("a"): 1})], "/tmp/p")


# -------------------------------------------------------------------------------- masking


@dataclasses.dataclass
class Creds:
    api_key: str
    note: str
    aws: dict
    commit_note: str
    tokenizer: str = "bpe"


def test_one_masking_rule_for_names_and_values():
    aws_id, wandb = "AKIA" + "ABCDEFGHIJKLMNOP", "0123456789abcdef" * 2 + "01234567"
    aws_secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    c = Creds(api_key="hunter2", note=f"id {aws_id} in a sentence", aws={"secret": aws_secret, "base": aws_secret},
              commit_note=f"wandb {wandb}")
    out = to_jsonable({"c": c, "args": ["--x", "sk-" + "a" * 24], "hf": "hf_" + "b" * 30})
    text = repr(out)
    for secret in ("hunter2", aws_id, aws_secret, wandb, "sk-" + "a" * 24, "hf_" + "b" * 30):
        assert secret not in text, secret
    assert out["c"]["api_key"] == MASK and out["c"]["note"] == f"id {MASK} in a sentence"
    assert out["c"]["tokenizer"] == "bpe" and out["c"]["aws"]["base"] == MASK
    assert mask_secrets is to_jsonable
    # ordinary values survive: paths, 64-hex digests, 10-hex step hashes, words
    keep = ["/data/AKIA-notes/x", "a" * 64, "c48fa1c45c", "tokens_per_step", "ASIAN-food"]
    assert to_jsonable(keep) == keep
    assert mask_text(f"failed with key={aws_id}") == f"failed with key={MASK}"
    assert mask_leaves({'auth["hf_token"]': "abc", "lr": 1, "note": wandb}) == {
        'auth["hf_token"]': MASK, "lr": 1, "note": MASK}


# -------------------------------------------------------------------------------- secrets end to end

SECRET_EXPERIMENT = textwrap.dedent(
    '''
    import dataclasses, os
    from marin.execution import ExecutorStep, executor_main, this_output_path, versioned

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        out: str
        wandb_api_key: str
        note: str
        n: int

    def work(cfg):
        with open(os.path.join(cfg.out, "out.txt"), "w") as f:
            f.write("done")
        if cfg.n == 2:
            raise ValueError(f"refusing {cfg}")

    KEY = "0123456789abcdef0123456789abcdef01234567"
    NOTE = "creds AKIA" + "QWERTYUIOPASDFGH"
    ok = ExecutorStep("ok", work, Cfg(this_output_path(), KEY, versioned(NOTE), versioned(1)))
    bad = ExecutorStep("bad", work, Cfg(this_output_path(), KEY, NOTE, versioned(2)))
    if __name__ == "__main__":
        executor_main(steps=[ok, bad], description="secret " + NOTE)
    '''
)


def test_secrets_never_reach_info_records_or_logs(tmp_path):
    exp = tmp_path / "exp.py"
    exp.write_text(SECRET_EXPERIMENT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    prefix = tmp_path / "store"
    r = subprocess.run([sys.executable, str(exp), "--prefix", str(prefix), "--progress", "false"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert r.returncode == 1 and "step(s) failed" in r.stderr and "ValueError: refusing" in r.stderr, r.stderr
    secrets = ["0123456789abcdef0123456789abcdef01234567", "AKIA" + "QWERTYUIOPASDFGH"]
    files = [p for p in prefix.rglob("*") if p.is_file() and p.suffix in (".json", "") and p.name != "out.txt"]
    assert any(p.name == ".executor_status" for p in files) and any("experiments" in p.parts for p in files)
    for where, text in [("stdout", r.stdout), ("stderr", r.stderr), *((str(p), p.read_text()) for p in files)]:
        for secret in secrets:
            assert secret not in text, f"{secret} leaked into {where}"
    (ok_dir,) = prefix.glob("ok-*")
    assert (ok_dir / "out.txt").read_text() == "done" and "SUCCESS" in (ok_dir / ".executor_status").read_text()


# -------------------------------------------------------------------------------- declared twice


def test_same_step_declared_twice_with_different_live_config_is_refused():
    a1 = ExecutorStep("a", noop, LiveClient(client="x1"))
    a2 = ExecutorStep("a", noop, LiveClient(client="x2"))
    with pytest.raises(PlanError) as e:
        plan_steps([a1, a2], "/tmp/p")
    msg = str(e.value)
    assert "declared twice" in msg and "client: 'x1' vs 'x2'" in msg and "live" in msg
    # a plain value that differs is versioned: two steps, not one declared twice
    assert len(plan_steps([ExecutorStep("a", noop, {"x": 1}), ExecutorStep("a", noop, {"x": 2})], "/tmp/p").steps) == 2
    # identical declarations (even as separate objects, with equal upstreams) are still one step
    up1, up2 = ExecutorStep("up", noop, {"k": versioned(1)}), ExecutorStep("up", noop, {"k": versioned(1)})
    b1 = ExecutorStep("b", noop, {"in": output_path_of(up1), "x": [1, {"y": "z"}]})
    b2 = ExecutorStep("b", noop, {"in": output_path_of(up2), "x": [1, {"y": "z"}]})
    assert [s.name for s in plan_steps([b1, b2], "/tmp/p").steps] == ["up", "b"]


# -------------------------------------------------------------------------------- step names


@pytest.mark.parametrize("name", ["a/./b", "./a", "a//b", "a/"])
def test_names_with_empty_or_dot_parts_are_refused_with_their_one_spelling(name):
    from marin.execution import InvalidStepError

    with pytest.raises(InvalidStepError, match="empty or '.' part; write it as"):
        ExecutorStep(name, noop, {})


BAD_NAME_EXPERIMENT = textwrap.dedent(
    '''
    from marin.execution import ExecutorStep, executor_main

    def work(cfg):
        pass

    step = ExecutorStep("NAME", work, {})
    if __name__ == "__main__":
        executor_main(steps=[step])
    '''
)


@pytest.mark.parametrize("name", ["a/./b", "white space", ".."])
def test_invalid_step_name_in_an_experiment_file_is_one_line_not_a_traceback(tmp_path, name):
    exp = tmp_path / "exp.py"
    exp.write_text(BAD_NAME_EXPERIMENT.replace("NAME", name))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for cmd in ([sys.executable, str(exp)], [sys.executable, "-m", "marin.cli", "run", str(exp)]):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
        assert r.returncode == 1, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("marin: error: step name") and "Traceback" not in r.stderr
        assert lines[0].endswith("(at exp.py:7)"), lines[0]
    assert not (tmp_path / "local_store").exists()
