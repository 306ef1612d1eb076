"""A store location given with credentials in its URL is refused by every command as --prefix is:
one line that shows the URL masked and says where credentials go, before a store client sees it
(botocore refused such a bucket name in a ParamValidationError traceback that quoted it)."""

from __future__ import annotations

import pytest

from marin.cli import main
from marin.execution.plan import CREDENTIALS_HELP

URL = "s3://AKIAFAKEKEY:wJalrSecretValue@bucket/run"
SHOWN = "s3://***@bucket/run"

COMMANDS = [
    (["eval", URL], "RUN"),
    (["sample", URL, "--prompt", "hi"], "RUN"),
    (["health", URL], "PATH"),
    (["checkpoints", URL], "RUN"),
    (["export", URL, "-o", "/tmp/never"], "RUN"),
    (["export", "some-run", "-o", URL], "-o"),
    (["show", URL], "STEP"),
    (["compare", "a-run", URL], "RUN_OR_STEP"),
    (["health", "a-run", "--fit", URL], "--fit"),
    (["eval", "a-run", "--data", f"web={URL}"], "--data"),
    (["status", "--prefix", URL], "--prefix"),
]


@pytest.mark.parametrize(("argv", "spelled"), COMMANDS, ids=[" ".join(a[:1] + [s]) for a, s in COMMANDS])
def test_a_location_with_credentials_is_one_line_naming_the_argument(argv, spelled, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    shown = f"web={SHOWN}" if spelled == "--data" else SHOWN
    assert rc == 2 and out == ""
    assert err == f"marin: error: {spelled} {shown} has credentials in it (the part before '@'); {CREDENTIALS_HELP}\n"
    assert "wJalrSecretValue" not in err and "AKIAFAKEKEY" not in err
