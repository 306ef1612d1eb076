"""The forward pass that scores packed windows: per-target negative log-likelihood, summed per sequence.

One compiled program per (model, mesh, rows, seq_len), memoised per process, so the in-training eval
and the standalone eval of the same checkpoint on the same pool run the very same executable on the
very same batches (their results agree to the last bit). Routed experts are computed without any
capacity limit ("local" on one device, "dropless" on an expert-parallel mesh): with a capacity, which
tokens get dropped would depend on what else is in the batch, and a document's score must not.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from marin.evaluation.metrics import SetTotals
from marin.evaluation.suite import PreparedSuite
from marin.evaluation.windows import PackedRows
from marin.models.transformer import forward
from marin.parallel.mesh import batch_sharding, param_shardings, place_host_arrays, replicated

_EVAL_CACHE: dict[tuple[Any, ...], Any] = {}
_MAX_IN_FLIGHT = 2  # batches dispatched ahead of the one whose result is read


def eval_model_config(cfg, mesh):
    """The model config evaluation runs: same weights and numerics, no expert capacity, no remat."""
    return cfg.replace(transport="local" if mesh is None or mesh.size == 1 else "dropless", remat_policy="none")


def nll_fn(cfg, mesh, with_greedy: bool = False):
    """``f(params, router_bias, inputs, targets, segment_ids) -> nll [B, L]`` (float32, nats), jitted
    for ``mesh`` (rows split over every device, the result replicated so every host has all of it).
    ``with_greedy``: ``(nll, target is the argmax [B, L])``, what lm-evaluation-harness calls is_greedy."""

    cfg = eval_model_config(cfg, mesh)
    key = (cfg, mesh, with_greedy)
    if key in _EVAL_CACHE:
        return _EVAL_CACHE[key]

    def f(params, router_bias, inputs, targets, segment_ids):
        logits, _ = forward(params, router_bias, inputs, cfg, mesh=mesh, segment_ids=segment_ids)
        lse = jax.nn.logsumexp(logits, axis=-1)
        nll = lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        if with_greedy:
            return nll, (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
        return nll

    if mesh is None:
        fn = jax.jit(f)
    else:
        rows = batch_sharding(mesh)
        fn = jax.jit(f, in_shardings=(None, replicated(mesh), rows, rows, rows), out_shardings=replicated(mesh))
    _EVAL_CACHE[key] = fn
    return fn


def sequence_nll(params, router_bias, rows: PackedRows, n_sequences: int, cfg, mesh, batch_rows: int,
                 greedy: bool = False):
    """Summed NLL (nats, float64) of the scored targets of each sequence in ``rows``; with ``greedy``
    also whether every scored target of the sequence is the model's argmax (bool), as a pair.

    ``params`` / ``router_bias`` are host arrays or arrays already placed for ``mesh`` (the trainer's
    state); ``rows.num_rows`` must be a multiple of ``batch_rows``.
    """
    fn = nll_fn(cfg, mesh, greedy)
    if mesh is not None:

        params = place_host_arrays(params, param_shardings(params, mesh))
        router_bias = place_host_arrays(router_bias, replicated(mesh))
        sharding = batch_sharding(mesh)
    out = np.zeros(n_sequences, np.float64)
    missed = np.zeros(n_sequences, np.float64)  # scored targets that are not the argmax
    in_flight: list[tuple[np.ndarray, Any]] = []

    def host(a) -> np.ndarray:
        # replicated: every process holds the whole result (addressable_data works across processes)
        return np.asarray(a.addressable_data(0) if mesh is not None else a, dtype=np.float64)

    def collect() -> None:
        seq, res = in_flight.pop(0)
        nll = host(res[0] if greedy else res)
        m = seq >= 0
        out[:] += np.bincount(seq[m], weights=nll[m], minlength=n_sequences)
        if greedy:
            missed[:] += np.bincount(seq[m], weights=1.0 - host(res[1])[m], minlength=n_sequences)

    for b in range(0, rows.num_rows, batch_rows):
        sl = slice(b, b + batch_rows)
        seq = rows.sequence[sl]
        if not (seq >= 0).any():
            continue
        batch = [rows.inputs[sl], rows.targets[sl], rows.segment_ids[sl]]
        if mesh is not None:
            batch = [place_host_arrays(x, sharding) for x in batch]
        # dispatch is asynchronous: the next batch is placed while this one computes
        in_flight.append((seq, fn(params, router_bias, *batch)))
        if len(in_flight) > _MAX_IN_FLIGHT:
            collect()
    while in_flight:
        collect()
    return (out, missed == 0) if greedy else out


def evaluate_prepared(params, router_bias, suite: PreparedSuite, cfg, mesh) -> dict[str, SetTotals]:
    """Per-set totals of a prepared suite (:func:`marin.evaluation.suite.prepare_suite`) under ``params``."""
    nll = sequence_nll(params, router_bias, suite.rows, suite.sequence_set.size, cfg, mesh, suite.batch_rows)
    k = len(suite.set_names)
    set_nll = np.bincount(suite.sequence_set, weights=nll, minlength=k)
    set_tokens = np.bincount(suite.sequence_set, weights=suite.sequence_tokens, minlength=k)
    return {n: SetTotals(int(suite.set_documents[i]), int(set_tokens[i]), int(suite.set_bytes[i]), float(set_nll[i]))
            for i, n in enumerate(suite.set_names)}
