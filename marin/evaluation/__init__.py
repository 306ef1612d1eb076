"""Evaluation: bits per byte of held-out text, multiple-choice log-likelihood tasks.

    metrics.py          pure math: per-set loss / perplexity / bits per byte, suite macro and micro
    windows.py          pure: which tokens a document contributes, split into windows, packed in rows
    sets.py             eval sets (token stores, the mixture's held-out split) -> documents + bytes
    suite.py            a training run's eval suite (sets, packing, batch rows), its metrics record (no JAX)
    evaluator.py        the JAX forward pass that scores packed windows (documents never see each other)
    multiple_choice.py  lm-eval-harness style tasks: accuracy and byte-length-normalised accuracy
    harness.py          the lm-evaluation-harness model class (``MarinLM``)

Nothing here knows training: the trainer's in-training eval imports the suite and the forward pass;
the eval step (committed checkpoints of a training step -> eval.json) is :mod:`marin.inference.evaluate`
and ``marin eval`` is :mod:`marin.commands.eval`.

What is predicted, exactly, is documented in docs/evaluation.md.
"""
