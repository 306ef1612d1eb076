"""Using a trained run: marin sample, marin export, and lm-evaluation-harness through marin's model
class, on the tiny run the evaluation tests train (tokenizer, expert-parallel mesh)."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from marin.cli import main
from marin.pools import with_device_count

MC_YAML = """task: k40_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""
ROLLING_YAML = """task: k40_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
GEN_YAML = """task: k40_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""


def _noop(config):
    return None


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def run(trained_run):
    """The run's model on one device (the run's own 2 x 4 mesh is exercised by the CLI tests)."""
    from marin.inference import load_run

    return load_run(trained_run.output_path, pool="local-cpu-1")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """A directory of three local lm_eval tasks and their jsonl data, from the K40 miniature's domains."""
    from marin.data.synthetic import generate_documents

    d = tmp_path_factory.mktemp("harness_tasks")
    domains = ("council", "infra", "web_code", "science")
    bodies = {k: [t.split("\n", 1)[1] for t in generate_documents(k, "q5", 4, seed=9, start=60_000)] for k in domains}
    mc, texts, gen = [], [], []
    for i in range(4):
        words = {k: bodies[k][i].split() for k in domains}
        for gi, k in enumerate(domains):
            mc.append({"context": " ".join(words[k][:8]), "choices": [" " + " ".join(words[o][8:12]) for o in domains],
                       "gold": gi})
            texts.append({"text": bodies[k][i][:400]})
            gen.append({"context": " ".join(words[k][:10]), "answer": " " + words[k][10]})
    for name, rows, yaml in (("mc", mc, MC_YAML), ("text", texts, ROLLING_YAML), ("gen", gen, GEN_YAML)):
        with open(d / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        (d / f"{name}.yaml").write_text(yaml.format(data=d / f"{name}.jsonl"))
    return str(d)


# ---- sampling ------------------------------------------------------------------------------------
def test_sample_cli_greedy_is_deterministic(capsys, trained_run):
    base = ["sample", trained_run.output_path, "--prompt", "Council note", "--prompt", "The infra team said that",
            "--max-new-tokens", "12", "--json"]
    rc, out, err = _run(capsys, *base, "--greedy")
    assert rc == 0, err
    greedy = json.loads(out)
    assert greedy["step"] == 40 and len(greedy["samples"]) == 2
    assert all(s["completion"] for s in greedy["samples"])
    assert json.loads(_run(capsys, *base, "--greedy")[1]) == greedy


@pytest.mark.slow
def test_sample_cli_seeded_sampling_is_reproducible_and_a_smaller_pool_decodes_the_same(capsys, trained_run):
    base = ["sample", trained_run.output_path, "--prompt", "Council note", "--prompt", "The infra team said that",
            "--max-new-tokens", "12", "--json"]
    greedy = json.loads(_run(capsys, *base, "--greedy")[1])
    sampled = [json.loads(_run(capsys, *base, "--seed", str(s), "--temperature", "1.2", "--top-p", "0.95")[1])
               for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]
    # a smaller pool (one device instead of the run's 2 x 4 mesh) decodes the same greedy text
    rc, out, err = _run(capsys, *base, "--greedy", "--pool", "local-cpu-1", "--step", "40")
    assert rc == 0, err
    assert json.loads(out) == greedy


@pytest.mark.parametrize("extra,message", [
    (["--prompt", ""], "prompt 0 is empty"),
    (["--prompt", "x " * 200], "exceeds the model's context"),
    (["--prompt", "hi", "--temperature", "0"], "temperature must be > 0 when sampling"),
    (["--prompt", "hi", "--step", "7"], "no committed checkpoint at step 7; committed: [15, 30, 40]"),
])
def test_sample_bad_input_is_one_line(capsys, trained_run, extra, message):
    rc, out, err = _run(capsys, "sample", trained_run.output_path, *extra)
    assert rc == 2 and out == ""
    assert err.startswith("marin: error: ") and message in err and err.count("\n") == 1, err


def test_a_run_without_checkpoints_is_one_line(capsys, tmp_path):
    rc, _, err = _run(capsys, "sample", str(tmp_path), "--prompt", "hi")
    assert rc == 2 and "has no committed checkpoint" in err and err.count("\n") == 1


def test_token_outside_vocabulary(run):
    from marin.models.decode import DecodeError, generate_tokens

    with pytest.raises(DecodeError, match=f"token id {run.cfg.vocab_size} outside the vocabulary"):
        generate_tokens(run.params, run.router_bias, run.cfg, [[1, run.cfg.vocab_size]], 2, mesh=run.mesh)


# ---- export --------------------------------------------------------------------------------------
def test_export_cli_writes_a_usable_directory(capsys, trained_run, run, tmp_path):
    import jax

    from marin.models import load_exported
    from marin.models.numpy_forward import forward as np_forward
    from marin.models.numpy_forward import load as np_load
    from marin.models.transformer import forward

    out = str(tmp_path / "exported")
    rc, text, err = _run(capsys, "export", trained_run.output_path, "-o", out, "--max-shard-size", "200000",
                         "--dtype", "float32")  # float32: the logits below are compared bit for bit
    assert rc == 0, err
    assert "exported step 40" in text
    files = set(os.listdir(out))
    assert {"config.json", "tokenizer.json", "README.md", "reference_forward.py",
            "model.safetensors.index.json"} <= files
    assert sum(f.endswith(".safetensors") for f in files) > 1
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["model"]["n_experts"] == run.cfg.n_experts and config["marin_version"]
    lineage = config["lineage"]
    assert lineage["checkpoint_step"] == 40 and lineage["train_tokens"] > 0 and lineage["data"]["stores"]
    card = open(os.path.join(out, "README.md")).read()
    assert "## Lineage" in card and "`layers.{i}.expert_gate`" in card and "eval/macro_bpb" in card
    tokens = np.array([[run.tokenizer.eos_id, *run.tokenizer.encode_batch(["Council note 12 says"])[0]]], np.int32)
    host_params = jax.device_get(run.params)
    want = np.asarray(forward(host_params, np.asarray(run.router_bias), tokens, run.cfg.replace(transport="local"))[0])
    cfg, params, bias = load_exported(out)
    np.testing.assert_array_equal(np.asarray(forward(params, bias, tokens, cfg.replace(transport="local"))[0]), want)
    np.testing.assert_allclose(np_forward(np_load(out)[1], np_load(out)[0], tokens), want, rtol=1e-4, atol=1e-4)
    # lm_eval's registry builds the model class from the export alone (weights + tokenizer)
    from lm_eval.api.registry import get_model

    from marin.evaluation.harness import MarinLM

    exported_lm = get_model("marin").create_from_arg_string(f"export={out},seq_len=64", {"batch_size": 4})
    live_lm = MarinLM(host_params, np.asarray(run.router_bias), run.cfg, run.tokenizer, seq_len=64)
    text = ["Council note 12 says the vote is on the budget."]
    np.testing.assert_allclose(exported_lm.rolling_logliks(text), live_lm.rolling_logliks(text), rtol=1e-6)
    # a second export into the same directory is refused, the first left intact
    rc, _, err = _run(capsys, "export", trained_run.output_path, "-o", out)
    assert rc == 2 and "is not empty: choose a new directory or pass --overwrite" in err and err.count("\n") == 1
    assert set(os.listdir(out)) == files


# ---- lm-evaluation-harness -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def manager(tasks):
    """The checked TaskManager of the three local tasks. Building one indexes every task lm_eval ships
    (about 15,000 YAML files, tens of CPU seconds), so check_tasks builds one per state of the task
    files and hands the same one out until a file changes; its refusals have their own test
    (test_harness_bad_task_files_are_one_line)."""
    from marin.evaluation.harness import check_tasks

    manager = check_tasks(["k40_mc", "k40_ppl", "k40_gen"], tasks)
    assert check_tasks(["k40_gen"], tasks) is manager  # the same files: the same index, not a new one
    return manager


@pytest.fixture(scope="module")
def lm(run):
    from marin.evaluation.harness import MarinLM

    return MarinLM(run.params, run.router_bias, run.cfg, run.tokenizer, run.mesh, seq_len=64)


def test_harness_multiple_choice_equals_marins_scorer(lm, run, tasks, manager):
    import lm_eval

    from marin.evaluation.multiple_choice import choice_logliks, read_task, score_task

    res = lm_eval.simple_evaluate(model=lm, tasks=["k40_mc"], task_manager=manager,
                                  log_samples=True, bootstrap_iters=0)
    questions = read_task(os.path.join(tasks, "mc.jsonl"))
    ours = choice_logliks(questions, run.tokenizer, run.params, run.router_bias, run.cfg, run.mesh, 64, 16)
    samples = sorted(res["samples"]["k40_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(questions) == 16
    for s, want in zip(samples, ours):
        got = np.array([r[0][0] for r in s["resps"]])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    acc = score_task(questions, run.tokenizer, run.params, run.router_bias, run.cfg, run.mesh, 64, 16)
    assert res["results"]["k40_mc"]["acc,none"] == pytest.approx(acc["acc"])
    assert res["results"]["k40_mc"]["acc_norm,none"] == pytest.approx(acc["acc_norm"])


def test_harness_rolling_bits_per_byte_agrees_with_marin_eval(capsys, lm, trained_run, tasks, manager):
    import lm_eval

    res = lm_eval.simple_evaluate(model=lm, tasks=["k40_ppl"], task_manager=manager,
                                  bootstrap_iters=0)
    harness_bpb = res["results"]["k40_ppl"]["bits_per_byte,none"]
    rc, out, err = _run(capsys, "eval", trained_run.output_path, "--data", f"text={tasks}/text.jsonl", "--json")
    assert rc == 0, err
    marin_bpb = json.loads(out)["sets"]["text"]["bpb"]
    assert harness_bpb == pytest.approx(marin_bpb, rel=1e-5)
    assert 0 < harness_bpb < 10 and math.isfinite(res["results"]["k40_ppl"]["word_perplexity,none"])


def test_harness_generation_is_greedy_decoding_cut_at_until(lm, run, manager):
    import lm_eval

    from marin.models.decode import generate_tokens

    res = lm_eval.simple_evaluate(model=lm, tasks=["k40_gen"], task_manager=manager,
                                  log_samples=True, bootstrap_iters=0, limit=4)
    assert "exact_match,none" in res["results"]["k40_gen"]
    tok = run.tokenizer
    samples = res["samples"]["k40_gen"]
    assert len(samples) == 4
    prompts = [[tok.eos_id, *tok.encode_batch([s["doc"]["context"]])[0]] for s in samples]
    # one batch (a row decodes as it would alone: tests/models/test_decode.py), so it reuses the compiled step
    new = generate_tokens(run.params, run.router_bias, run.cfg, prompts, 6, stop_ids=(tok.eos_id,), mesh=run.mesh)
    for s, ids in zip(samples, new):
        text = tok.decode([t for t in ids if t != tok.eos_id])
        assert s["resps"][0][0] == text.split(".")[0]


@pytest.mark.slow  # 21 s through lm-eval's CLI; the adapter's cores: the harness tests above
def test_marin_harness_cli_writes_lm_evals_results(capsys, trained_run, tasks, tmp_path):
    rc, out, err = _run(capsys, "harness", trained_run.output_path, "--tasks", "k40_mc,k40_ppl", "--include-path",
                        tasks, "--output-path", str(tmp_path / "res"), "--limit", "4")
    assert rc == 0, err
    assert "k40_mc" in out and "bits_per_byte" in out
    written = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "res") for f in fs if f.endswith(".json")]
    assert len(written) == 1
    saved = json.load(open(written[0]))
    assert {"k40_mc", "k40_ppl"} <= set(saved["results"])


@pytest.mark.parametrize("setup,message", [
    ("missing_dir", "task directory not found"),
    ("bad_yaml", "is not valid YAML"),
    ("no_data", "data file"),
    ("unknown", "unknown harness task 'nope'"),
])
def test_harness_bad_task_files_are_one_line(capsys, trained_run, tasks, tmp_path, setup, message):
    d = tmp_path / "tasks"
    d.mkdir()
    task = "nope"
    if setup == "unknown":  # among the local tasks the harness tests indexed: that index, not a new one
        d = tasks
    elif setup == "missing_dir":
        d = tmp_path / "absent"
    elif setup == "bad_yaml":
        (d / "t.yaml").write_text("task: t\ndataset_path: [json\n")
        task = "t"
    elif setup == "no_data":
        (d / "t.yaml").write_text(ROLLING_YAML.replace("k40_ppl", "t").format(data=tmp_path / "missing.jsonl"))
        task = "t"
    rc, out, err = _run(capsys, "harness", trained_run.output_path, "--tasks", task, "--include-path", str(d))
    assert rc == 2 and message in err and err.count("\n") == 1, err


def test_compare_curves_of_a_run_have_a_flop_axis(trained_run, run):
    from marin.models.config import flops_per_token
    from marin.review import Step
    from marin.review.compare import compare

    step = Step(trained_run.output_path)
    res = compare([step, step])
    assert res["differences"] == {}
    loss = res["curves"][res["steps"][0]]["loss"]
    # every record at seq_len 64: FLOPs = tokens x FLOPs per token of the run's model at 64
    assert loss["flops"][-1] == pytest.approx(loss["tokens"][-1] * flops_per_token(run.cfg, 64))
    bpb = res["curves"][res["steps"][0]]["eval/macro_bpb"]
    assert bpb["step"] == [15, 30, 40]
    assert bpb["flops"][0] == pytest.approx(loss["flops"][loss["step"].index(15)])


@pytest.mark.slow
def test_harness_step_writes_harness_json_and_its_version_follows_the_task_files(trained_run, tasks, tmp_path):
    import shutil

    from experiments.defaults import default_harness_eval
    from marin.execution import ExecutorStep, plan_steps, this_output_path
    from marin.inference.harness import HarnessConfig, harness_eval

    out = tmp_path / "harness-step"
    out.mkdir()
    res = harness_eval(HarnessConfig(trained_run.output_path, str(out), ("k40_mc",), include_path=tasks, limit=4))
    saved = json.load(open(out / "harness.json"))
    assert saved["step"] == res["step"] == 40
    assert set(saved["summary"]["k40_mc"]) >= {"acc", "acc_norm"} and saved["results"]["k40_mc"]

    train = ExecutorStep("t/train", _noop, {"out": this_output_path()})
    copy = tmp_path / "tasks-copy"
    shutil.copytree(tasks, copy)

    def version_hash():
        step = default_harness_eval("t/harness", train, ["k40_mc"], include_path=str(copy))
        return plan_steps([step], str(tmp_path / "p")).planned(step).hash

    before = version_hash()
    assert version_hash() == before
    (copy / "mc.jsonl").write_text((copy / "mc.jsonl").read_text().replace('"gold": 0', '"gold": 1', 1))
    assert version_hash() != before  # the task data changed: the step's version changed


@pytest.mark.slow
def test_sample_in_a_fresh_process_sets_up_the_runs_devices(trained_run):
    """The run's pool has 8 (fake) devices: `marin sample` must request them before JAX starts."""
    import subprocess
    import sys

    env = dict(os.environ)
    env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), None)
    r = subprocess.run([sys.executable, "-m", "marin.cli", "sample", trained_run.output_path, "--prompt", "Council",
                        "--greedy", "--max-new-tokens", "4", "--json"], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["samples"][0]["completion"]
