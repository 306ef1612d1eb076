"""Review an experiment from Python (a notebook, a script): steps, configs, metrics, files, results.

    import marin.review as mr

    exp = mr.load("experiments/quickstart.py", prefix="local_store")   # or mr.load(prefix="local_store")
    for step in exp.steps:
        print(step.name, step.status, step.duration_s, step.output_path)
    train = exp.step("quickstart/train-tiny-moe")
    table = train.metrics()            # a pyarrow.Table; .to_pandas() where pandas is installed
    exp.step("quickstart/health").health()   # the health checklist as a dict

Everything here reads the files the executor and the steps wrote; nothing starts Ray or runs a step.
The same objects feed ``marin report`` (:func:`marin.review.report.write_report`).

The package holds everything a person uses to look at outputs, one module per concern:

    experiment.py       the notebook API: load(), Experiment                  (marin.review.load)
    stepdir.py          one step's directory: Step (status, config, metrics, outputs)
    steps.py            a step's state, the status table, one step in full  (marin status, marin show)
    explain.py          would each step run, and why                          (marin explain)
    experiment_file.py  load an experiment file's steps without running them
    live.py             the refreshing status screen                          (marin watch)
    report.py, dag.py, plots.py   the self-contained HTML report              (marin report)
"""

from marin.review.experiment import (
    Experiment,
    dependency_order,
    load,
    load_file,
    load_prefix,
    read_records,
)
from marin.review.explain import explain
from marin.review.stepdir import Step
from marin.review.steps import CATEGORIES, StepState, show, status_rows, step_state

__all__ = ["CATEGORIES", "Experiment", "Step", "StepState", "dependency_order", "explain", "load", "load_file",
           "load_prefix", "read_records", "show", "status_rows", "step_state"]
