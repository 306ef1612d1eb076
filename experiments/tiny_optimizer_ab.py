"""Does MuonH pay? AdamW and MuonH trained side by side on a tiny ladder, fitted, and compared.

    python experiments/tiny_optimizer_ab.py --prefix ./local_store          # 3 widths x 2 optimizers, then the fit
    python experiments/tiny_optimizer_ab.py --prefix ./local_store --widths 16,32,48 --tokens-per-param 10

Three rungs of the tiny ladder's MoE target (8 experts top-2, one shared expert; widths 24, 40 and 64,
2 layers; ``marin.scaling.recipe.ladder_rungs`` at the same tokens per active parameter), each trained
twice on the same synthetic token stream, the same batches in the same order and the same number of
tokens: once with AdamW at the tiny ladder's peak LR, once with MuonH at upstream's size rule
(``MuonHConfig.from_heuristic``). Each run's final loss is the mean training loss over its last 10% of
steps (no step's batch is repeated: synthetic batches are a function of the step). A pure power law
in training FLOPs is fitted per optimizer (``marin.scaling.fit.fit_power_law``), and the result says:

* ``loss_at_equal_compute``: each law's loss at each rung's compute;
* ``compute_multiplier``: how many times less compute MuonH needs for AdamW's loss
  (``marin.scaling.fit.compute_multiplier``; above 1: MuonH pays), at each rung's compute and one
  decade past the largest, with the central 68% interval over the fits' bootstrap laws. Three points
  leave one degree of freedom per law: the interval is wide by construction, and it does not hold
  seed-to-seed variation (one seed per run).

Writes ``<prefix>/tiny-optimizer-ab/ab.json`` (the last line printed is the same JSON) and ``ab.png``;
the runs are kept (``<prefix>/tiny-optimizer-ab/<rung>-<optimizer>``), and a run already finished is
read, not trained again. The timing and the numbers on this machine are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

if __name__ == "__main__":  # one CPU device per run: the process's JAX sees the pool's devices
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.tiny_ladder import TARGET
from marin.scaling.fit import compute_multiplier, fit_power_law
from marin.scaling.recipe import Rung, RunShape, ladder_rungs
from marin.training.config import CheckpointPolicy, SyntheticDataConfig, TelemetryConfig, TrainConfig
from marin.training.optimizers import AdamWConfig, MuonHConfig

WIDTHS = (24, 40, 64)
TOKENS_PER_ACTIVE_PARAM = 20.0
BATCH_SEQUENCES = 32  # x 64 tokens = 2,048 tokens per step
SHAPE = RunShape(seq_len_phases=((0.0, 64),), warmup_fraction=0.05)
ADAMW_PEAK_LR = 5e-3  # the tiny ladder's
DATA = SyntheticDataConfig(vocab_size=512, seed=0, n_rules=64, noise=0.05)
FINAL_FRACTION = 0.1  # the final loss: the mean over the last 10% of a run's steps


def rungs(widths=WIDTHS, tokens_per_param: float = TOKENS_PER_ACTIVE_PARAM) -> list[Rung]:
    """The ladder's rungs: the tiny target at ``widths``, 2 layers, the same tokens per active parameter."""
    return ladder_rungs(TARGET, widths, shape=SHAPE, depths={d: 2 for d in widths}, batch_sequences=BATCH_SEQUENCES,
                        tokens_per_active_param=tokens_per_param)


def optimizers(rung: Rung) -> dict[str, Any]:
    """AdamW and MuonH for one rung, on the same schedule shape (warmup, decay to 5% of peak)."""
    tokens = rung.train_steps * rung.tokens_per_step
    return {"adamw": AdamWConfig(peak_lr=ADAMW_PEAK_LR, warmup_steps=rung.warmup_steps),
            "muonh": MuonHConfig.from_heuristic(tokens, rung.model.d_model, rung.tokens_per_step,
                                                warmup_steps=rung.warmup_steps)}


def run_config(prefix: str, rung: Rung, kind: str, optimizer: Any) -> TrainConfig:
    return TrainConfig(
        output_path=f"{prefix.rstrip('/')}/tiny-optimizer-ab/{rung.name}-{kind}", data=DATA, model=rung.model,
        preset="tiny", pool="local-cpu-1", train_steps=rung.train_steps, tokens_per_step=rung.tokens_per_step,
        seq_len_phases=rung.shape.seq_len_phases, optimizer=optimizer,
        checkpoint=CheckpointPolicy(every_steps=rung.train_steps, every_minutes=None),
        telemetry=TelemetryConfig(wandb_project=None, progress_every_s=30.0))


def final_loss(losses: list[float]) -> tuple[float, float]:
    """(mean, standard error) of the training loss over the last :data:`FINAL_FRACTION` of the steps (at least 3)."""
    tail = losses[-max(3, int(math.ceil(FINAL_FRACTION * len(losses)))):]
    mean = sum(tail) / len(tail)
    var = sum((x - mean) ** 2 for x in tail) / max(1, len(tail) - 1)
    return mean, math.sqrt(var / len(tail))


def compare(points: dict[str, list[tuple[float, float]]], extrapolate: float = 10.0) -> dict[str, Any]:
    """Fit each optimizer's ``(flops, loss)`` points and compare: MuonH's compute multiplier over
    AdamW at each rung's compute and at ``extrapolate`` x the largest."""
    fits = {k: fit_power_law([c for c, _ in v], [y for _, y in v], form="pure") for k, v in points.items()}
    computes = sorted(c for c, _ in points["adamw"])
    at = computes + [computes[-1] * extrapolate]
    return {
        "fits": {k: f.to_json() for k, f in fits.items()},
        "loss_at_equal_compute": [{"flops": c, **{k: float(f.predict(c)) for k, f in fits.items()}} for c in at],
        "compute_multiplier": [{"flops": c, **compute_multiplier(fits["adamw"], fits["muonh"], c)} for c in at],
    }


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib  # matplotlib: only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (the same)

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, colour in (("adamw", "tab:blue"), ("muonh", "tab:orange")):
        runs = [r for r in result["runs"] if r["optimizer"] == kind]
        ax.errorbar([r["flops"] for r in runs], [r["final_loss"] for r in runs],
                    yerr=[r["final_loss_se"] for r in runs], fmt="o", color=colour, label=kind)
        line = result["loss_at_equal_compute"]
        ax.plot([p["flops"] for p in line], [p[kind] for p in line], "-", color=colour, alpha=0.6)
    last = result["compute_multiplier"][-2]
    ax.set(xscale="log", yscale="log", xlabel="training FLOPs", ylabel="final training loss",
           title=f"MuonH's compute multiplier at the largest rung:\n{last['multiplier']:.2f}x "
                 f"(68%: {last['low']:.2f} to {last['high']:.2f})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix", required=True, help="where the runs and the result go (a local directory)")
    p.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="comma-separated rung widths (3 or more)")
    p.add_argument("--tokens-per-param", type=float, default=TOKENS_PER_ACTIVE_PARAM)
    args = p.parse_args(argv)
    widths = tuple(int(w) for w in args.widths.split(","))
    if len(widths) < 3:
        p.error("--widths: give 3 or more (two points leave the fits no degree of freedom)")
    from marin.training.metrics import read_metrics  # the trainer's JAX: only when runs are read or trained
    from marin.training.trainer import run_training  # (the same)

    runs, points = [], {"adamw": [], "muonh": []}
    for rung in rungs(widths, args.tokens_per_param):
        for kind, opt in optimizers(rung).items():
            config = run_config(args.prefix, rung, kind, opt)
            run_training(config, use_ray=False)  # a finished run resumes at its end: nothing is retrained
            losses = [r["loss"] for r in read_metrics(config.output_path) if "loss" in r]
            loss, se = final_loss(losses)
            runs.append({"rung": rung.name, "optimizer": kind, "flops": rung.flops, "train_steps": rung.train_steps,
                         "tokens": rung.train_steps * rung.tokens_per_step, "peak_lr": opt.peak_lr,
                         **({"adam_lr": opt.adam_lr} if kind == "muonh" else {}), "final_loss": loss,
                         "final_loss_se": se})
            points[kind].append((rung.flops, loss))
            print(f"{rung.name} {kind}: loss {loss:.4f} +- {se:.4f}", file=sys.stderr, flush=True)
    result = {"runs": runs, **compare(points)}
    out = f"{args.prefix.rstrip('/')}/tiny-optimizer-ab"
    with open(f"{out}/ab.json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, f"{out}/ab.png")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
