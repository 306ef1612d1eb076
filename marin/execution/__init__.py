"""marin.execution: experiment steps -> versioned DAG -> Ray tasks -> resumable outputs.

Importing this package never imports JAX (nor Ray: Ray is started only when a step must run), and
installs no process-wide hook in a library, a notebook or a test run: the one-line report of an
experiment-file mistake (:mod:`marin.execution.errors`) is installed by the entry points, the
``marin`` command (:func:`marin.cli.main`) and an experiment file run as a script (``python exp.py``,
detected by :func:`marin.execution.errors.running_a_script`).
"""

from marin.execution.errors import ExecutorError, PreviouslyFailedError, install_excepthook, running_a_script
from marin.execution.hashing import UnhashableConfigError
from marin.execution.main import ExecutorMainConfig, executor_main
from marin.execution.outcome import RunResult
from marin.execution.plan import Plan, PlanError, PlannedStep, plan_steps, resolve_config
from marin.execution.status import StepStatus
from marin.execution.step import (
    ExecutorStep,
    InputName,
    InvalidStepError,
    OutputName,
    VersionedValue,
    output_path_of,
    this_output_path,
    versioned,
)

if running_a_script():
    install_excepthook()

__all__ = [
    "ExecutorError",
    "ExecutorMainConfig",
    "ExecutorStep",
    "InputName",
    "InvalidStepError",
    "OutputName",
    "Plan",
    "PlanError",
    "PlannedStep",
    "PreviouslyFailedError",
    "RunResult",
    "StepStatus",
    "UnhashableConfigError",
    "VersionedValue",
    "executor_main",
    "output_path_of",
    "plan_steps",
    "resolve_config",
    "this_output_path",
    "versioned",
]
