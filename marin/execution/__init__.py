"""marin.execution: experiment steps -> versioned DAG -> Ray tasks -> resumable outputs.

Importing this package never imports JAX (nor Ray: Ray is started only when a step must run).
"""

from marin.execution.errors import install_excepthook
from marin.execution.executor import ExecutorError, PreviouslyFailedError, RunResult
from marin.execution.hashing import UnhashableConfigError
from marin.execution.main import ExecutorMainConfig, executor_main
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
