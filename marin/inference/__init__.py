"""Using a trained model: load a run's checkpoint (:func:`load_run`), sample text from it
(:func:`generate`), export its weights (:mod:`marin.inference.export`), score its checkpoints in the
eval step (:mod:`marin.inference.evaluate`) and run lm-evaluation-harness tasks on it
(:mod:`marin.inference.harness`). Sits above training, evaluation, scaling and monitoring and below
review; decoding itself is model code (:mod:`marin.models.decode`)."""
from marin.inference.generate import generate, generate_with_ids
from marin.inference.run import LoadedRun, RunLoadError, load_run

__all__ = ["LoadedRun", "RunLoadError", "generate", "generate_with_ids", "load_run"]
