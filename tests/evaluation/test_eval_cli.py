"""``marin eval``: per-set and macro/micro bits per byte of a run's checkpoint; one-line errors."""

from __future__ import annotations

import json

import pytest

from marin.cli import main


def _run(capsys, *argv):
    rc = main(["eval", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_eval_cli_json_and_table(capsys, trained_run, eval_corpus, eval_store):
    rc, out, err = _run(capsys, trained_run.output_path, "--data", f"council={eval_corpus}/council/*/*",
                        "--data", f"store={eval_store}", "--checkpoint", "30", "--json")
    assert rc == 0, err
    res = json.loads(out)
    assert set(res) == {"sets", "macro_bpb", "micro_bpb", "step"} and res["step"] == 30
    assert set(res["sets"]) == {"council", "store"}
    assert set(res["sets"]["council"]) == {"documents", "tokens", "bytes", "loss", "bpb"}
    assert res["macro_bpb"] == pytest.approx((res["sets"]["council"]["bpb"] + res["sets"]["store"]["bpb"]) / 2)
    assert 0 < res["sets"]["council"]["bpb"] < 10
    rc, out, err = _run(capsys, trained_run.output_path)  # no --data: the run's held-out split
    assert rc == 0, err
    assert "val/council" in out and "macro bpb" in out and "step 40" in out


def test_eval_cli_task(capsys, trained_run, tmp_path):
    task = tmp_path / "task.jsonl"
    task.write_text(
        "".join(
            json.dumps({"context": "Council note 1.", "choices": [" Vote", " zzqx", " kkk"], "gold": i % 3}) + "\n"
            for i in range(6)
        )
    )
    rc, out, err = _run(capsys, trained_run.output_path, "--task", f"toy={task}", "--json")
    assert rc == 0, err
    res = json.loads(out)
    assert set(res) == {"step", "tasks"}  # a task alone evaluates no text set
    t = res["tasks"]["toy"]
    assert t["questions"] == 6 and t["chance"] == pytest.approx(1 / 3)
    assert t["acc"] == pytest.approx(1 / 3)  # the same choices for every question: one gold in three is right
    (tmp_path / "bad.jsonl").write_text('{"context": "x"}\n')
    rc, _, err = _run(capsys, trained_run.output_path, "--task", f"bad={tmp_path}/bad.jsonl")
    assert rc == 2 and "line 1: needs context, choices and gold" in err and err.count("\n") == 1


def test_eval_cli_errors_are_one_line(capsys, trained_run, eval_corpus, tmp_path):
    from marin.data.corpus_steps import CorpusInput
    from marin.data.tokenize import TokenizeConfig, tokenize
    from marin.data.tokenizer import TrainTokenizerConfig, train_tokenizer

    cases = []
    cases.append(((trained_run.output_path, "--data", f"x={tmp_path}/nope.jsonl"), "no such file"))
    cases.append(((str(tmp_path / "not-a-run"), "--data", f"x={eval_corpus}"),
                  f"no training run at {tmp_path}/not-a-run: the path does not exist"))
    (tmp_path / "empty.jsonl").write_text("")
    cases.append(((trained_run.output_path, "--data", f"x={tmp_path}/empty.jsonl"),
                  f"--data x: cannot score {tmp_path}/empty.jsonl: no documents under "
                  f"{tmp_path}/empty.jsonl (text field 'text')"))
    import gzip

    whole = gzip.compress(b"".join(b'{"text": "document %d"}\n' % i for i in range(2000)))
    (tmp_path / "torn.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    cases.append(((trained_run.output_path, "--data", f"x={tmp_path}/torn.jsonl.gz"),
                  f"--data x: cannot score {tmp_path}/torn.jsonl.gz: corrupt input file {tmp_path}/torn.jsonl.gz: "))
    # --step as sample, export and harness spell it; --checkpoint, its older spelling, means the same
    cases.append(((trained_run.output_path, "--step", "7"), "no committed checkpoint at step 7"))
    cases.append(((trained_run.output_path, "--checkpoint", "7"), "no committed checkpoint at step 7"))
    cases.append(((trained_run.output_path, "--step", "last"),
                  "--step must be a step number (or 'latest'), got 'last'"))
    other_tok = str(tmp_path / "tok")
    train_tokenizer(TrainTokenizerConfig(f"{eval_corpus}/infra/q5", other_tok, vocab_size=300))
    other_store = str(tmp_path / "other")
    tokenize(TokenizeConfig(f"{eval_corpus}/infra/q5", other_tok, other_store,
                            CorpusInput(show_progress=False, use_ray=False)))
    cases.append(((trained_run.output_path, "--data", f"x={other_store}"), "tokenizer mismatch"))
    for argv, needle in cases:
        rc, _, err = _run(capsys, *argv)
        assert rc == 2 and needle in err, (argv, err)
        assert err.count("\n") == 1 and err.startswith("marin eval: error: "), err
        assert "marin-eval-" not in err and not err.rstrip().endswith(":"), err  # never the temporary store
