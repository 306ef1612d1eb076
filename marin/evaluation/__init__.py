"""Evaluation: bits per byte of held-out text, multiple-choice log-likelihood tasks, eval steps.

    metrics.py          pure math: per-set loss / perplexity / bits per byte, suite macro and micro
    windows.py          pure: which tokens a document contributes, split into windows, packed in rows
    sets.py             eval sets (token stores, the mixture's held-out split) -> documents + bytes
    evaluator.py        the JAX forward pass that scores packed windows (documents never see each other)
    step.py             the executor step: committed checkpoints of a training step -> eval.json
    multiple_choice.py  lm-eval-harness style tasks: accuracy and byte-length-normalised accuracy
    cli.py              ``marin eval``

What is predicted, exactly, is documented in docs/evaluation.md.
"""
