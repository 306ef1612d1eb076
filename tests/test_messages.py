"""What a user sees for mistakes that used to end in a traceback or a wrong message: a --prefix that is a
file, a step name too long for a directory, non-positive sizes for marin plan, an added lr_replans in
explain, and the experiment record after a cached re-run or alongside a concurrent run."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from marin.execution import ExecutorStep, InvalidStepError
from marin.execution.experiment_record import merged_outcomes
from marin.review.explain import unversioned_changes

REPO = Path(__file__).resolve().parents[1]


def marin(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marin.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)


@pytest.mark.parametrize("command", [["status"], ["report"], ["watch", "--count", "1"]])
def test_a_prefix_that_is_a_file_is_one_line(tmp_path, command):
    afile = tmp_path / "notes.txt"
    afile.write_text("not a store")
    r = marin(*command, "--prefix", str(afile), cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        f"marin: error: --prefix {afile} is a file, not a directory of step outputs; pass the directory a run wrote "
        "to (the --prefix it ran with; the default is $MARIN_PREFIX, else ./local_store)")
    assert "Traceback" not in r.stderr


def test_a_step_name_too_long_for_a_directory_is_refused_at_declaration():
    with pytest.raises(InvalidStepError) as e:
        ExecutorStep("probe/" + "x" * 300, print, {})
    assert str(e.value) == (
        "step name 'xxxxxxxxxxxxxxxxxxxxxxxx...' has a part of 300 characters; a part becomes a directory name, which "
        "filesystems limit to 255 bytes (the last part to 244, leaving room for '-' and the hash): shorten it, or "
        "split it into parts with '/'")
    ExecutorStep("probe/" + "x" * 244, print, {})  # the longest that fits


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--seq-len", "-4", "argument --seq-len: must be a positive whole number, got -4"),
    ("--tokens-per-step", "0", "argument --tokens-per-step: must be a positive whole number, got 0"),
    ("--steps", "-100", "argument --steps: must be a positive whole number, got -100"),
    ("--planned-tokens", "-1e12", "argument --planned-tokens: must be a positive number, got -1e12"),
])
def test_marin_plan_refuses_non_positive_sizes(tmp_path, flag, value, message):
    r = marin("plan", "tiny", "--pool", "local-cpu-1", f"{flag}={value}", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == f"marin plan: error: {message}"
    assert "GiB" not in r.stdout and "fits" not in r.stdout


def test_explain_shows_an_added_lr_replan_and_eval_set_whole():
    from marin.evaluation.sets import EvalSet
    from marin.execution.jsonable import to_jsonable
    from marin.training.config import SyntheticDataConfig, TrainConfig, TrainEvalConfig

    before = TrainConfig(output_path="/x", data=SyntheticDataConfig(vocab_size=512), model="tiny")
    after = dataclasses.replace(before, optimizer=dataclasses.replace(before.optimizer, lr_replans=((60, 100),)))
    assert unversioned_changes(to_jsonable(before), after, []) == ["optimizer.lr_replans: [] -> [[60, 100]]"]
    again = dataclasses.replace(before, optimizer=dataclasses.replace(before.optimizer, lr_replans=((60, 90),)))
    assert unversioned_changes(to_jsonable(after), again, []) == ["optimizer.lr_replans[0][1]: 100 -> 90"]
    # a field of the evaluation config too: an eval set added reads as one change of evaluation.sets
    evaluated = dataclasses.replace(before, evaluation=TrainEvalConfig(sets=(EvalSet("val", "/stores/val"),)))
    [change] = unversioned_changes(to_jsonable(before), evaluated, [])
    assert change.startswith("evaluation.sets: [] -> [{"), change


def test_explain_words_a_field_added_removed_or_changed():
    recorded = {"lr": 1e-3, "data": {"seed": 1}}
    assert unversioned_changes(recorded, {"lr": 1e-3, "data": {"seed": 1}, "tag": "x"}, []) == ["tag added ('x')"]
    assert unversioned_changes(recorded, {"data": {"seed": 1}}, []) == ["lr removed (was 0.001)"]
    # a field whose shape changed reads whole; one whose shape stayed names the leaf
    assert unversioned_changes(recorded, {"lr": 1e-3, "data": {"seed": 1, "shuffle": True}}, []) == \
        ["data: {'seed': 1} -> {'seed': 1, 'shuffle': True}"]
    assert unversioned_changes(recorded, {"lr": 1e-3, "data": {"seed": 2}}, []) == ['data["seed"]: 1 -> 2']


def test_the_record_keeps_the_run_that_produced_an_output():
    previous = {"a": "succeeded", "b": "failed", "c": "succeeded", "d": "succeeded"}
    new = {"a": "cached", "b": "succeeded", "c": "reused", "d": "not_selected", "e": "dry_run"}
    assert merged_outcomes(previous, new) == {"a": "succeeded", "b": "succeeded", "c": "succeeded",
                                              "d": "succeeded", "e": "dry_run"}


def test_a_cached_rerun_reports_the_run_that_produced_the_outputs(tmp_path, ray_local):
    sys.path.insert(0, str(REPO / "tests" / "execution"))
    from test_executor import run, step

    import marin.review as mr

    a = step("a", tmp_path / "log", value=1)
    b = step("b", tmp_path / "log", a, value=2)
    first = run([b], tmp_path / "out")
    again = run([b], tmp_path / "out")
    assert set(again.outcome.values()) == {"cached"}
    record = json.loads(Path(again.record_path).read_text())  # the rerun's own record
    assert [s["outcome"] for s in record["steps"]] == ["succeeded", "succeeded"]
    assert os.path.dirname(first.record_path) == os.path.dirname(again.record_path)  # one experiment, two runs
    exp = mr.load_prefix(str(tmp_path / "out"))
    assert {s.state.category for s in exp.steps} == {"succeeded"}


def test_explain_names_outputs_left_without_a_record(tmp_path):
    from marin.review.explain import explain

    exp = tmp_path / "exp.py"
    exp.write_text(
        "import dataclasses\nfrom marin.execution import ExecutorStep, executor_main, this_output_path, versioned\n"
        "@dataclasses.dataclass(frozen=True)\nclass Cfg:\n    out: str\n    n: int\n"
        "def work(cfg):\n    pass\n"
        "if __name__ == '__main__':\n"
        "    executor_main(steps=[ExecutorStep('probe/train', work, Cfg(this_output_path(), versioned(1)))])\n")
    (row,) = explain(str(exp), str(tmp_path / "store"))
    assert row["reasons"] == ["no previous output at this hash"]
    step_dir = Path(row["output_path"])
    (step_dir / "checkpoints" / "step-00000005").mkdir(parents=True)
    (step_dir / "metrics.jsonl").write_text("{}\n")
    (row,) = explain(str(exp), str(tmp_path / "store"))
    assert row["reasons"] == ["no status record at this hash, but its directory holds 2 entries (checkpoints, "
                              "metrics.jsonl): the run resumes from what is there"]


def _no_store_credentials() -> dict:
    """An environment in which no S3 credentials can be found (none set, no files, no instance metadata)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
            "AWS_EC2_METADATA_DISABLED": "true", "PYTHONPATH": str(REPO)}


@pytest.mark.parametrize("command", [["status"], ["show", "quickstart/train"], ["report", "-o", "r.html"]])
def test_a_store_that_cannot_be_read_is_one_line_as_for_marin_run(tmp_path, command):
    r = subprocess.run([sys.executable, "-m", "marin.cli", *command, "--prefix", "s3://marin-probe-bucket/x"],
                       capture_output=True, text=True, cwd=tmp_path, env=_no_store_credentials(), timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "marin: error: cannot read step outputs under s3://marin-probe-bucket/x: NoCredentialsError: Unable to locate "
        "credentials; check the prefix, your credentials and the network"]


@pytest.mark.parametrize("command", [["status"], ["show", "quickstart/train"]])
def test_a_store_that_refuses_connections_is_one_line_at_once(tmp_path, command):
    """Nothing listens at the endpoint: no retries (each a warning line) under a limit of ten minutes,
    which the subprocess's timeout would cut short. botocore's own retries of each call (about 10 s
    of backoff) are turned off here: they are not what is tested."""
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},  # the test server's endpoint too
           "PYTHONPATH": str(REPO), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "MARIN_STORAGE_RETRY_S": "600",
           "AWS_MAX_ATTEMPTS": "1"}
    r = subprocess.run([sys.executable, "-m", "marin.cli", *command, "--prefix", "s3://marin-probe-bucket/x"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert line.startswith("marin: error: cannot read step outputs under s3://marin-probe-bucket/x: "
                           "EndpointConnectionError: Could not connect to the endpoint URL"), line


def test_the_store_error_is_found_through_the_chain_and_a_bug_is_not_one():
    from marin.execution.failures import store_access_error, unreadable_store_message
    from marin.execution.retry import StorageUnavailable

    try:
        try:
            raise ConnectionRefusedError(111, "refused")
        except ConnectionRefusedError as e:
            raise StorageUnavailable("list s3://b/x: the store stayed unreachable for 300s") from e
    except StorageUnavailable as e:
        outage = e
    assert store_access_error(RuntimeError("wrapped")) is None
    assert store_access_error(KeyError("a bug")) is None
    assert store_access_error(PermissionError(13, "Permission denied", "/ro/r.html")) is None  # a local file's
    assert store_access_error(outage) is outage
    from botocore.exceptions import ClientError

    try:
        try:
            raise ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "ListObjectsV2")
        except ClientError as client_error:
            raise PermissionError("Access Denied") from client_error  # s3fs's translation keeps it as the cause
    except PermissionError as e:
        denied = e
    assert isinstance(store_access_error(denied), ClientError)
    assert unreadable_store_message("step outputs under s3://b", denied) == (
        "cannot read step outputs under s3://b: PermissionError: Access Denied")
    assert unreadable_store_message("step outputs under s3://b/x", outage) == (
        "cannot read step outputs under s3://b/x: StorageUnavailable: list s3://b/x: the store stayed unreachable for "
        "300s")


SECRET_PREFIX = "s3://AKIAFAKE:secretvalue@bucket/x"


def test_a_prefix_with_credentials_is_refused_in_one_line_without_echoing_them(tmp_path):
    exp = tmp_path / "exp.py"
    exp.write_text("import dataclasses\nfrom marin.execution import ExecutorStep, executor_main, this_output_path\n"
                   "@dataclasses.dataclass(frozen=True)\nclass Cfg:\n    out: str\n"
                   "def work(cfg):\n    pass\n"
                   "if __name__ == '__main__':\n"
                   "    executor_main(steps=[ExecutorStep('probe/a', work, Cfg(this_output_path()))])\n")
    want = ("marin: error: --prefix s3://***@bucket/x has credentials in it (the part before '@'); an object store "
            "takes credentials from the environment, never from the URL: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(or ~/.aws/credentials, AWS_PROFILE) for s3://, GOOGLE_APPLICATION_CREDENTIALS (or `gcloud auth "
            "application-default login`) for gs://")
    dry = subprocess.run([sys.executable, str(exp), "--prefix", SECRET_PREFIX, "--dry_run", "true"],
                         capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                         timeout=120)
    status = marin("status", "--prefix", SECRET_PREFIX, cwd=tmp_path)
    for r, code in ((dry, 1), (status, 2)):
        assert r.returncode == code and r.stdout == ""
        assert r.stderr.strip().splitlines() == [want]
        assert "secretvalue" not in r.stderr and "AKIAFAKE" not in r.stderr


def test_a_data_path_with_credentials_is_refused_by_the_dry_run_and_nothing_is_written(tmp_path):
    """The store client quotes a bad bucket name ("KEY:SECRET@bucket") where no mask can find it,
    so a data path with credentials never gets as far as running."""
    exp = tmp_path / "exp.py"
    exp.write_text("from experiments.defaults import default_dedup\n"
                   "from marin.execution import executor_main\n"
                   "if __name__ == '__main__':\n"
                   f"    executor_main(steps=[default_dedup('n', {SECRET_PREFIX!r})])\n")
    prefix = tmp_path / "p"
    for dry in ("true", "false"):
        r = subprocess.run([sys.executable, str(exp), "--prefix", str(prefix), "--dry_run", dry],
                           capture_output=True, text=True, cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
        assert r.returncode == 1 and r.stdout == ""
        assert r.stderr.strip().splitlines() == [
            "marin: error: step 'n': config field input_path s3://***@bucket/x has credentials in it (the part "
            "before '@'); an object store takes credentials from the environment, never from the URL: "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or ~/.aws/credentials, AWS_PROFILE) for s3://, "
            "GOOGLE_APPLICATION_CREDENTIALS (or `gcloud auth application-default login`) for gs:// (at exp.py:4)"]
    assert not prefix.exists()


BAD_BATCH = """
import os
from experiments.defaults import default_train
from marin.execution import executor_main
from marin.training import SyntheticDataConfig

if os.environ.get("OWN_ERROR"):
    raise ValueError("the file's own check")
train = default_train("t", mixture=SyntheticDataConfig(), model="tiny-ep", pool="local-cpu", tokens_per_step=64 * 9,
                      seq_len_phases=((0.0, 64),))
if __name__ == "__main__":
    executor_main(steps=[train])
"""


def test_a_batch_the_pool_cannot_split_is_one_line_from_the_experiment_file_as_from_explain(tmp_path):
    exp = tmp_path / "exp.py"
    exp.write_text(BAD_BATCH)
    want = "marin: error: 9 sequences of 64 per step do not split over 8 devices x 1 microbatches"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    dry = subprocess.run([sys.executable, str(exp), "--prefix", str(tmp_path / "p"), "--dry_run", "true"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    explain = marin("explain", str(exp), "--prefix", str(tmp_path / "p"), cwd=tmp_path)
    assert dry.returncode == 1 and dry.stderr.splitlines() == [f"{want} (at exp.py:9)"], dry.stderr
    assert explain.returncode == 2 and explain.stderr.splitlines() == [want], explain.stderr
    own = subprocess.run([sys.executable, str(exp)], capture_output=True, text=True, cwd=tmp_path,
                         env={**env, "OWN_ERROR": "1"}, timeout=120)
    assert own.returncode == 1 and "Traceback" in own.stderr  # the file's own error keeps its traceback


def test_report_of_an_experiment_file_masks_its_card_as_the_stored_record_does(tmp_path, capsys):
    from marin.cli import main

    exp = tmp_path / "exp.py"
    exp.write_text("from marin.execution import ExecutorStep, executor_main, this_output_path\n"
                   "def work(cfg):\n    pass\n"
                   "if __name__ == '__main__':\n"
                   "    executor_main(steps=[ExecutorStep('probe/a', work, {'out': this_output_path()})],\n"
                   "                  description='calls the API with Bearer abc.def.ghi',\n"
                   "                  risks='the endpoint wants Authorization: Bearer abc.def.ghi')\n")
    out = tmp_path / "r.html"
    assert main(["report", str(exp), "--prefix", str(tmp_path / "store"), "-o", str(out)]) == 0, capsys.readouterr()
    page = out.read_text()
    assert "abc.def.ghi" not in page
    assert "the endpoint wants Authorization: Bearer ***" in page and "calls the API with Bearer ***" in page


def test_marin_plan_names_a_batch_that_is_not_whole_sequences(capsys):
    from marin.cli import main

    assert main(["plan", "tiny-ep", "--pool", "local-cpu", "--tokens-per-step", "4000", "--seq-len", "64"]) == 2
    assert capsys.readouterr().err == (
        "marin plan: error: tokens per step 4,000 is not a multiple of seq_len 64 (62.5 sequences): a step is whole "
        "sequences; 3,584 or 4,096 split evenly over 8 devices\n")


def test_marin_plan_says_a_longer_sequence_raises_the_context_as_training_does(capsys):
    from marin.cli import main
    from marin.training.config import SyntheticDataConfig, TrainConfig

    assert main(["plan", "tiny-ep", "--pool", "local-cpu", "--seq-len", "256", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert (p["max_seq_len"], p["preset_max_seq_len"]) == (256, 128)
    trained = TrainConfig(output_path="/x", data=SyntheticDataConfig(vocab_size=512), model="tiny-ep",
                          seq_len_phases=((0.0, 256),), tokens_per_step=2048)
    assert trained.model.max_seq_len == p["max_seq_len"]  # what the run records, and sample then allows
    assert main(["plan", "tiny-ep", "--pool", "local-cpu", "--seq-len", "256"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "  context: 256 tokens, the longest sequence trained (the preset's max_seq_len is 128; a training run raises "
        "it the same way and records it, so sample, eval and export of the run take up to 256)")


def test_a_copy_of_the_quickstart_with_other_step_names_prints_commands_for_its_own_steps(tmp_path):
    import importlib.util

    from marin.execution.plan import plan_steps

    copy = tmp_path / "my_experiment.py"
    copy.write_text((REPO / "experiments" / "quickstart.py").read_text().replace('"quickstart/', '"mine/'))
    spec = importlib.util.spec_from_file_location("my_experiment", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # declares the steps; runs nothing (not __main__)
    plan = plan_steps([module.mixture_report, module.health, module.evaluation], str(tmp_path / "store"))
    hints = module.review_hints(plan)
    assert "quickstart/" not in hints.replace(str(tmp_path), "")
    assert f"  marin show mine/train-tiny-moe --prefix {plan.prefix}" in hints.splitlines()
    assert f"  marin show mine/health --prefix {plan.prefix}" in hints.splitlines()
    assert f"  marin eval {plan.planned(module.train).output_path}" in hints.splitlines()


def test_rays_notice_that_token_authentication_is_on_is_dropped_and_its_warnings_kept():
    import logging

    from ray._private.authentication import authentication_token_setup as ray_tokens

    from marin.execution.cluster import RAY_TOKEN_LOGGER, quiet_default_token_notice

    assert ray_tokens.logger.name == RAY_TOKEN_LOGGER
    quiet_default_token_notice()
    quiet_default_token_notice()  # once per process, however many clusters it starts
    assert len(logging.getLogger(RAY_TOKEN_LOGGER).filters) == 1
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # Ray's loggers do not propagate to caplog's
    logging.getLogger(RAY_TOKEN_LOGGER).addHandler(handler)
    try:
        ray_tokens._warn_token_auth_enabled()  # Ray's own notice, on every local cluster with its default
        ray_tokens._warn_token_auth_disabled()  # authentication off: a real warning, kept
    finally:
        logging.getLogger(RAY_TOKEN_LOGGER).removeHandler(handler)
    assert [m.split(".")[0] for m in seen] == ["Token authentication is disabled for this Ray cluster"]


def test_lm_evals_git_lookup_outside_a_repository_prints_nothing(tmp_path, monkeypatch, capfd):
    import lm_eval.evaluator

    from marin.evaluation.harness import quiet_git_commit_hash

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # tmp_path is in no repository
    lm_eval.evaluator.get_git_commit_hash()  # lm_eval's own lookup, as simple_evaluate calls it
    assert "fatal: not a git repository" in capfd.readouterr().err
    assert quiet_git_commit_hash() is None
    assert capfd.readouterr() == ("", "")
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("GIT_CEILING_DIRECTORIES")
    assert quiet_git_commit_hash() == lm_eval.evaluator.get_git_commit_hash()  # the same record where there is one
