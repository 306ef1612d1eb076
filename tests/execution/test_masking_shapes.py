"""Credentials in the shapes configs and error messages carry them (URL user-info, authorization
headers, bearer tokens, signed-URL query parameters) are masked by the one masking rule, everywhere
a step's config leaves the process: its record, marin show, errors."""

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
