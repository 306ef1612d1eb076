"""A paired gate of the quickstart's run at step 40: before a live change goes in, its evidence.

    python experiments/tiny_gate.py --prefix ./local_store     # or: marin run experiments/tiny_gate.py

The quickstart trains a tiny MoE for 60 steps with expert parallelism over 8 fake CPU devices and
switches its EP transport from fixed to dropless at step 40. This file asks, at that same step, what
two other changes would do: the capacity-bounded ragged transport (the published run's switch) and
two microbatches per step. The gate restores the run's committed checkpoint at step 40 (weights,
AdamW state, data position) and trains the control (the run's own settings) and each candidate for
10 steps from it, on identical batches; ``gate.json`` holds each arm's step time, MFU, drops, loss
and grad norm, the paired loss difference with its interval and the verdict, and ``gate.png`` plots
the arms. Nothing of the run's output is written but the pins that keep its step-40 checkpoint while
the arms train (released with the verdict).

A passing candidate goes into the live run as a cutover: the live field changed and a relaunch from
the newest checkpoint, recording the gate it rests on (docs/training.md, "Changing a live run"):

    parallelism=ParallelismConfig(transport_switches=((0, "fixed"), (40, "dropless"), (60, "ragged_capacity"))),
    cutovers=(Cutover(step=60, gate="<this gate's directory>", candidate="ragged"),),
"""

from experiments.defaults import default_gate
from experiments.quickstart import train
from marin.execution import executor_main
from marin.training.gate import GateThresholds

GATE_AT_STEP = 40  # a committed checkpoint of the quickstart's run (it checkpoints every 20 steps)

gate = default_gate(
    "quickstart/gate-step40",
    train,
    at_step=GATE_AT_STEP,
    candidates={"ragged": {"transport": "ragged_capacity"}, "mb2": {"parallelism.microbatches": 2}},
    steps=10,
    # the run is a rehearsal: gate it once it has finished (a live run's gate runs beside it)
    wait_for_run=True,
    # eight fake devices share this machine's cores, so step times say little: speed is not judged here
    thresholds=GateThresholds(min_speedup=0.0),
)


if __name__ == "__main__":
    result = executor_main(steps=[gate], description="Quickstart gate: ragged_capacity and 2 microbatches at step 40")
    if result.finished(gate):
        import fsspec

        from marin.review.gate import format_gate
        from marin.training.cutover import read_gate
        from marin.training.gate import GATE_PLOT

        out = result.plan.planned(gate).output_path
        print("\n" + format_gate(read_gate(out)))
        with fsspec.open(f"{out}/{GATE_PLOT}", "rb") as f:
            print(f"\nplot: {out}/{GATE_PLOT} ({len(f.read()):,} bytes)")
