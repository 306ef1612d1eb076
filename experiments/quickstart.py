"""Quickstart: the whole pipeline, tiny, on the embedded defaults (local Ray, local disk).

    python experiments/quickstart.py --prefix ./local_store     # or: marin run experiments/quickstart.py

1. generate a K40-shaped miniature corpus (40 domains x 5 quality buckets, deterministic) with known
   faults planted in it: exact duplicates, near-duplicates, and documents carrying a question of the
   quickstart's own multiple-choice task (``k40_manifest.json`` lists them under ``planted``)
2. train a byte-level BPE tokenizer on it
3. remove exact and near-duplicate documents (MinHash LSH, within and across domains; the output
   keeps the K40 layout, and ``dedup_manifest.json`` says what was removed and why). The evaluation
   below holds out the last documents of every source, so a near-copy of a held-out document in the
   training part would leak it: this step removes such copies
4. decontaminate: remove documents sharing a 13-gram with the quickstart's task (continue a passage
   in its domain's language); ``decontamination_manifest.json`` counts matches. The closing summary
   puts what dedup and decontamination removed next to what was planted
5. tokenize the clean corpus into a token store (one Ray task per file, resumable per shard)
6. report the mixture's effective token shares
7. train a tiny MoE (8 experts, top-2, shared expert, latent projection) with expert parallelism
   over 8 fake CPU devices: fixed-buffer all-to-all first, dropless after a hot switch, and a
   sequence-length extension half way at constant tokens per step
8. check the run's health (loss falling, drops under 8%, grad-norm peak)
9. evaluate the final checkpoint: bits per byte on the K40 held-out split, per domain and macro

Run it twice: the second run finds every step's SUCCESS and does nothing. Change a versioned value
below (say the mixture weights) and only the steps downstream of it run again: `marin explain
experiments/quickstart.py` tells you which and why.
"""

import shlex

from experiments.defaults import (
    default_decontaminate,
    default_dedup,
    default_domain_task,
    default_eval,
    default_health_report,
    default_k40_miniature,
    default_mixture,
    default_mixture_report,
    default_tokenize,
    default_tokenizer,
    default_train,
)
from marin.execution import executor_main
from marin.training.config import AdamWConfig, CheckpointPolicy, ParallelismConfig, TelemetryConfig

TRAIN_STEPS = 60

# the quickstart's evaluation task: continue a passage in its own domain's language (documents beyond
# the corpus's, so only what is planted below carries a question)
task = default_domain_task("quickstart/task", ("council", "infra", "web_code", "law"), questions_per_domain=8)
PLANTED = {"exact_duplicates": 16, "near_duplicates": 16, "contaminated": 8}
corpus = default_k40_miniature("quickstart/k40-mini", total_bytes=1_000_000, seed=0, **PLANTED,
                               contaminate_from=task)
tokenizer = default_tokenizer("quickstart/tokenizer", corpus, vocab_size=512)
deduped = default_dedup("quickstart/dedup", corpus)
clean = default_decontaminate("quickstart/decontaminate", deduped, against={"quickstart_task": task})
tokenized = default_tokenize("quickstart/tokenized", clean, tokenizer)

# the largest published K40 domains only (a domain missing from domain_weights gets weight 0),
# cleaner buckets preferred
DOMAIN_WEIGHTS = {"council": 3.0, "infra": 2.0, "web_code": 2.0}
mixture = default_mixture(
    [tokenized],
    domain_weights=DOMAIN_WEIGHTS,
    quality_weights={"q1": 0.5, "q2": 0.75, "q3": 1.0, "q4": 1.25, "q5": 1.5},
    seed=0,
)
mixture_report = default_mixture_report("quickstart/mixture", mixture, total_tokens=TRAIN_STEPS * 4096)

train = default_train(
    "quickstart/train-tiny-moe",
    mixture=mixture,
    model="tiny-ep",
    pool="local-cpu",                       # 1 process x 8 fake CPU devices, mesh (data 2, expert 4)
    train_steps=TRAIN_STEPS,
    tokens_per_step=4096,
    seq_len_phases=((0.0, 64), (0.5, 128)),  # 64 tokens per sequence, then 128 at half the batch
    optimizer=AdamWConfig(peak_lr=1e-2, warmup_steps=5),
    checkpoint=CheckpointPolicy(every_steps=20),
    telemetry=TelemetryConfig(wandb_project="marin-quickstart"),
    parallelism=ParallelismConfig(transport_switches=((0, "fixed"), (40, "dropless"))),
)
health = default_health_report("quickstart/health", train, total_steps=TRAIN_STEPS)
evaluation = default_eval("quickstart/eval", train, held_out=True)  # the mixture's held-out documents


def review_hints(plan) -> str:
    """The commands to review this run, from the steps themselves (a copy with other names prints its
    own), each quoted for the shell: a prefix with a space or a quote pastes as one argument."""
    run_dir = plan.planned(train).output_path
    commands = [
        ["status", "--prefix", plan.prefix],
        *(["show", step.name, "--prefix", plan.prefix] for step in (train, health, deduped, clean)),
        ["eval", run_dir],
        ["report", "--prefix", plan.prefix, "-o", "report.html"],
        ["health", run_dir],
    ]
    return f"\nDone. Outputs are under {plan.prefix}. Review them with:\n" + "\n".join(
        f"  {shlex.join(['marin', *c])}" for c in commands)


if __name__ == "__main__":
    result = executor_main(
        steps=[mixture_report, health, evaluation],
        description="Quickstart: K40 miniature -> tokenizer, dedup, decontamination -> tokens -> tiny MoE",
    )
    import json

    import fsspec

    from marin.data.k40 import read_k40_manifest
    from marin.data.synthetic import planted_vs_found
    from marin.monitoring.health import format_report

    if result.finished(clean):
        manifests = []
        for step, name in ((deduped, "dedup_manifest.json"), (clean, "decontamination_manifest.json")):
            with fsspec.open(f"{result.plan.planned(step).output_path}/{name}") as f:
                manifests.append(json.load(f))
        planted = read_k40_manifest(result.plan.planned(corpus).output_path)["planted"]
        print("\nData steps on the planted faults:\n" + "\n".join(f"  {line}" for line in planted_vs_found(
            planted, *manifests)))
    if result.finished(health):  # with --run_only, only what ran (or had run) is summarised
        with fsspec.open(f"{result.plan.planned(health).output_path}/health.json") as f:
            print("\nHealth of the training run:\n" + format_report(json.load(f)))
    if result.finished(evaluation):
        with fsspec.open(f"{result.plan.planned(evaluation).output_path}/eval.json") as f:
            ev = json.load(f)
        print(f"\nK40 validation (held-out documents, {len(ev['sets'])} domains) at step {ev['step']}: "
              f"macro bpb {ev['macro_bpb']:.3f}, micro bpb {ev['micro_bpb']:.3f}\n  domains the mixture trains on: "
              + ", ".join(f"{d} {ev['sets'][f'val/{d}']['bpb']:.3f}" for d in DOMAIN_WEIGHTS)
              + " bpb (the others have weight 0)")
    print(review_hints(result.plan))
