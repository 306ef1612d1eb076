"""Credentials in the shapes configs and error messages carry them (URL user-info, authorization
headers, bearer tokens, signed-URL query parameters, API tokens) are masked by the one masking rule,
everywhere a step's strings leave the process: a table of token shapes x surfaces (the status file,
marin show, the report, the terminal, log lines, W&B's run files) for a step's description and error."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import ray.cloudpickle

from marin.execution import ExecutorError, ExecutorStep, this_output_path, versioned
from marin.execution.jsonable import MASK, mask_argv, mask_text, to_jsonable
from marin.execution.plan import PlanError

sys.path.insert(0, os.path.dirname(__file__))
from test_executor import run  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SHAPES = [
    ("https://alice:s3cr3t-pw@data.example.com/k40/shard-0.jsonl",
     f"https://{MASK}@data.example.com/k40/shard-0.jsonl"),
    ("s3://AKIDEXAMPLE:wJalrXUtnFEMI@bucket/x", f"s3://{MASK}@bucket/x"),
    ("https://ghtoken123@github.com/org/repo.git", f"https://{MASK}@github.com/org/repo.git"),
    ("Authorization: Bearer eyJhbGciOi.J9.eyJzdWIi", f"Authorization: Bearer {MASK}"),
    ('{"Authorization": "Basic dXNlcjpwYXNzd29yZA=="}', f'{{"Authorization": "Basic {MASK}"}}'),
    ("curl -H 'X-Api-Key: 0123456789abcdef' https://h", f"curl -H 'X-Api-Key: {MASK}' https://h"),
    ("proxy-authorization=Digest abcdefgh", f"proxy-authorization=Digest {MASK}"),
    ("retrying with bearer abcdefghijklmnop", f"retrying with bearer {MASK}"),
    ("https://h/obj?X-Amz-Credential=AKID%2F2026&X-Amz-Signature=9f8e7d&part=1",
     f"https://h/obj?X-Amz-Credential={MASK}&X-Amz-Signature={MASK}&part=1"),
    ("https://h/x?access_token=ya29.a0Af&alt=json", f"https://h/x?access_token={MASK}&alt=json"),
]
KEPT = ["git@github.com:org/repo.git", "write to a@b.com", "tokens_per_step=4096", "s3://bucket/run/step-abc",
        "the key=value grammar", "Authorization header missing"]


@pytest.mark.parametrize(("text", "masked"), SHAPES, ids=[s[0][:30] for s in SHAPES])
def test_each_credential_shape_is_masked(text, masked):
    assert mask_text(text) == masked


@pytest.mark.parametrize("text", KEPT)
def test_look_alikes_are_kept(text):
    assert mask_text(text) == text


def test_header_fields_and_argv():
    @dataclasses.dataclass
    class Source:
        url: str
        headers: dict

    out = to_jsonable(Source("https://u:p@h/x", {"Authorization": "Bearer qwertyuiop", "Accept": "json"}))
    assert out == {"url": f"https://{MASK}@h/x", "headers": {"Authorization": MASK, "Accept": "json"}}
    assert mask_argv(["exp.py", "--source", "https://u:p@h/x"])[-1] == f"https://{MASK}@h/x"


@dataclasses.dataclass(frozen=True)
class FetchCfg:
    out: str
    url: str
    headers: tuple = ()


def fetch(cfg: FetchCfg) -> None:
    raise ConnectionError(f"GET {cfg.url} with {dict(cfg.headers)} refused")


def test_a_steps_record_show_and_error_never_hold_the_credentials(tmp_path, ray_local):
    """A signed URL and an authorization header (credentials a store or server may legitimately take
    in a config) are masked in the step's record, in marin show and in its error."""
    from marin.review.steps import show

    signed_url = "https://data.example.com/shard.jsonl?X-Amz-Signature=s3cr3t-pw"
    step = ExecutorStep("fetch", fetch, FetchCfg(this_output_path(), versioned(signed_url),
                                                 (("Authorization", "Bearer eyJhbGciOiJIUzI1NiJ9.payload"),)))
    with pytest.raises(ExecutorError) as e:
        run([step], tmp_path / "out", infra_retries=0)
    for text in (str(e.value), *(p.read_text() for p in (tmp_path / "out").rglob("*") if p.is_file())):
        assert "s3cr3t-pw" not in text and "eyJhbGciOiJIUzI1NiJ9" not in text
    d = show("fetch", str(tmp_path / "out"))
    assert d["config"]["url"] == f"https://data.example.com/shard.jsonl?X-Amz-Signature={MASK}"
    assert "Bearer ***" in d["error"] or MASK in d["error"]


def test_a_url_with_user_info_in_a_config_is_refused_masked_before_anything_runs(tmp_path):
    """Credentials in a URL's user-info part are refused at planning (a store client quotes them in
    forms no mask finds), in one line that shows the URL masked; nothing is written."""
    step = ExecutorStep("fetch", fetch, FetchCfg(this_output_path(),
                                                 versioned("https://alice:s3cr3t-pw@data.example.com/shard.jsonl")))
    with pytest.raises(PlanError) as e:
        run([step], tmp_path / "out")
    message = str(e.value)
    assert "s3cr3t-pw" not in message and "\n" not in message
    assert "step 'fetch'" in message and "https://***@data.example.com/shard.jsonl" in message
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*"))


# ---- one masking path, every surface: the known token shapes x where a user sees a step's strings --------
TOKEN_SHAPES = {  # shape -> (the text as written, the secret part that must never be shown)
    "url user-info": ("https://bob:S3cretPw9@example.com/x", "S3cretPw9"),
    "X-Amz-Signature": ("https://b.s3.amazonaws.com/o?X-Amz-Date=1&X-Amz-Signature=a1b2c3amzsig", "a1b2c3amzsig"),
    "X-Goog-Signature": ("https://storage.googleapis.com/b/o?X-Goog-Signature=9f8e7dgoogsig", "9f8e7dgoogsig"),
    "sig=": ("https://acct.blob.core.windows.net/c/o?sv=2024&sig=AzureSasSig42", "AzureSasSig42"),
    "ghp_": ("ghp_" + "Ab3" * 12, "Ab3Ab3Ab3Ab3"),
    "ghp_ short": ("ghp_Q1w2E3r4T5y6U7i8", "Q1w2E3r4T5y6U7i8"),
    "github_pat_": ("github_pat_11ABCDEFG0_Zy9Xw8Vu7Ts6Rq5Po4Nm3", "Zy9Xw8Vu7Ts6Rq5Po4Nm3"),
    "hf_": ("hf_" + "Hf7" * 11 + "x", "Hf7Hf7Hf7Hf7"),
    "sk-": ("sk-proj-Sk9Sk9Sk9Sk9Sk9Sk9", "Sk9Sk9Sk9Sk9"),
    "AWS access key": ("AKIAIOSFODNN7EXAMPLE", "IOSFODNN7EXAMPLE"),
    "Bearer": ("Bearer eyJhbGciOiJIUzI1NiJ9.e30.c2ln", "eyJhbGciOiJIUzI1NiJ9"),
}
SHAPE_TEXT = " | ".join(text for text, _ in TOKEN_SHAPES.values())
LOGGER = "experiments.mirror"


@dataclasses.dataclass(frozen=True)
class MirrorCfg:
    out: str


def mirror(cfg: MirrorCfg) -> None:
    """A step that logs its sources (to a file of its own: the test's Ray workers do not echo their
    logs to the driver) and then fails quoting them, as a download error would."""
    import logging

    handler = logging.FileHandler(os.path.join(cfg.out, "step.log"))
    log = logging.getLogger(LOGGER)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        log.info("mirroring %s", SHAPE_TEXT)
        try:
            raise PermissionError(f"403 for {SHAPE_TEXT}")
        except PermissionError:
            log.exception("the first source refused")
    finally:
        log.removeHandler(handler)
        handler.close()
    raise RuntimeError(f"push refused: {SHAPE_TEXT}")


@pytest.fixture(scope="module")
def failed_mirror(tmp_path_factory, ray_local):
    """One run of a step whose description and error quote every shape; what each surface showed."""
    import contextlib
    import io

    from marin.cli import main

    tmp = tmp_path_factory.mktemp("masking")
    prefix = str(tmp / "out")
    step = ExecutorStep("mirror", mirror, MirrorCfg(this_output_path()), description=f"mirror of {SHAPE_TEXT}")
    terminal = io.StringIO()
    with contextlib.redirect_stderr(terminal), pytest.raises(ExecutorError) as e:
        run([step], prefix, infra_retries=0)
    [step_dir] = [p for p in (tmp / "out").iterdir() if p.name.startswith("mirror-")]
    surfaces = {"terminal": terminal.getvalue() + str(e.value),
                "status file": "".join(p.read_text() for p in (step_dir / ".executor_status",
                                                               step_dir / ".executor_lease") if p.exists()),
                "log lines": (step_dir / "step.log").read_text()}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["show", "mirror", "--prefix", prefix]) == 0
    surfaces["marin show"] = out.getvalue()
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["report", "--prefix", prefix, "-o", str(tmp / "report.html")]) == 0
    surfaces["report"] = (tmp / "report.html").read_text()
    return surfaces


SURFACES = ["terminal", "status file", "log lines", "marin show", "report"]


@pytest.mark.parametrize("surface", SURFACES)
def test_every_token_shape_is_masked_on_every_surface(failed_mirror, surface):
    text = failed_mirror[surface]
    assert "mirror" in text and MASK in text, text[:2000]  # the surface did show the strings, masked
    shown = [shape for shape, (_, secret) in TOKEN_SHAPES.items() if secret in text]
    assert not shown, f"{surface} shows {shown}"


def test_the_surfaces_show_the_description_and_the_error_they_mask(failed_mirror):
    masked = mask_text(SHAPE_TEXT)
    assert f"about     mirror of {masked}" in failed_mirror["marin show"]
    assert f"push refused: {masked}" in failed_mirror["marin show"]
    assert "FAILED mirror" in failed_mirror["terminal"] and f"push refused: {masked}" in failed_mirror["terminal"]
    log = failed_mirror["log lines"]
    assert f"mirroring {masked}" in log and f"PermissionError: 403 for {masked}" in log  # the traceback too


def test_a_record_written_in_clear_is_shown_masked(tmp_path):
    """A step record written before its free text was masked (or by hand) is masked where it is read."""
    import contextlib
    import io
    import json

    from marin.cli import main

    step_dir = tmp_path / "out" / "mirror-0123456789"
    step_dir.mkdir(parents=True)
    info = {"name": "mirror", "description": f"mirror of {SHAPE_TEXT}", "error": f"push refused: {SHAPE_TEXT}",
            "traceback": SHAPE_TEXT, "output_path": str(step_dir)}
    (step_dir / ".executor_status").write_text(json.dumps(
        {"status": "FAILED", "events": [{"status": "FAILED", "time": 1.0}], "info": info}))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["show", str(step_dir)]) == 0
    assert [s for s, (_, secret) in TOKEN_SHAPES.items() if secret in out.getvalue()] == []
    assert f"about     mirror of {mask_text(SHAPE_TEXT)}" in out.getvalue()


def test_every_token_shape_is_masked_in_the_wandb_run_files(tmp_path):
    """W&B (offline) gets a run's config as the trainer renders it (:func:`mask_secrets`, the one
    rendering of every record): a config string quoting every shape reaches W&B's run file masked."""
    import glob
    import time

    from marin.execution.jsonable import mask_secrets
    from marin.training.config import SyntheticDataConfig, TrainConfig
    from marin.training.metrics import WandbTracker

    @dataclasses.dataclass(frozen=True)
    class MirroredData(SyntheticDataConfig):
        source: str = SHAPE_TEXT

    out = str(tmp_path / "run")
    cfg = TrainConfig(output_path=out, data=MirroredData(vocab_size=512))
    tracker = WandbTracker(project="marin-test", name="mirror", config=mask_secrets(cfg), output_path=out,
                           run_id="masking-shapes")
    tracker.log({"step": 1, "loss": 1.0})
    tracker.finish()
    [run_file] = glob.glob(f"{out}/wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 60  # W&B's service process may still be flushing when finish() returns
    while b'"source":' not in open(run_file, "rb").read() and time.monotonic() < deadline:
        time.sleep(0.5)
    data = open(run_file, "rb").read()
    assert b'"source":' in data and MASK.encode() in data
    assert [s for s, (_, secret) in TOKEN_SHAPES.items() if secret.encode() in data] == []


def test_log_records_of_marin_and_experiment_loggers_are_masked_when_made(caplog):
    """The log record factory masks the message and the traceback of the loggers it covers, once
    however often it is installed, and leaves other libraries' records as they are."""
    import logging

    from marin.execution.jsonable import mask_log_records

    mask_log_records()
    factory = logging.getLogRecordFactory()
    mask_log_records()
    assert logging.getLogRecordFactory() is factory
    with caplog.at_level(logging.INFO):
        logging.getLogger("marin.training.x").info("reading %s", SHAPE_TEXT)
        try:
            raise OSError(SHAPE_TEXT)
        except OSError:
            logging.getLogger("experiments.x").exception("fetch failed")
        logging.getLogger("some.library").info("kept %s", "ghp_Q1w2E3r4T5y6U7i8")
    masked, failed, kept = caplog.records
    assert masked.getMessage() == f"reading {mask_text(SHAPE_TEXT)}"
    assert f"OSError: {mask_text(SHAPE_TEXT)}" in failed.exc_text and "S3cretPw9" not in failed.exc_text
    assert f"OSError: {mask_text(SHAPE_TEXT)}" in caplog.text  # the handler shows the masked traceback
    assert kept.getMessage() == "kept ghp_Q1w2E3r4T5y6U7i8"
