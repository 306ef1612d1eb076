"""Gradient accumulation: one optimizer step over ``microbatches`` sequential slices of the batch.

The optimizer batch stays ``tokens_per_step``; only the activations of one microbatch are alive at a
time. Every device keeps its own rows: microbatch m takes the m-th slice of each device's shard of
the batch, so no token moves between devices. The result equals the whole-batch step up to float
summation order:

    loss, ce_loss, z_loss    mean over microbatches (equal token counts: the whole-batch mean)
    gradients                mean over microbatches (the gradient of the whole-batch mean loss)
    drop fractions           mean over microbatches (every microbatch has the same number of
                             assignments, so this is total drops / total assignments)
    expert_load              summed (the whole batch's assignments per expert)
    bias_hist                summed (margin histograms are additive), and the router-bias target is
                             recomputed from the sum: the same balancing target the whole batch gives
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from marin.models import router as rt
from marin.parallel.mesh import DATA, EXPERT, TOKEN_AXES

_SUMMED = ("expert_load", "bias_hist")


def split_microbatches(x, microbatches: int, mesh, context_parallel: int = 1) -> jax.Array:
    """[B, ...] split over the token axes -> [M, B / M, ...]; microbatch m holds the m-th slice of
    every device's rows, so each microbatch is again spread over all devices.

    With context parallelism C > 1 a sequence spans a group of C devices (the batch is split over
    "data" only, marin.parallel.mesh.batch_sharding) and the group's sequences are its rows: the
    slices are taken per group of C devices, so each microbatch still gives every group the same
    number of whole sequences (marin.models.context_parallel's layout) and no token moves."""
    shards = mesh.shape[DATA] * mesh.shape[EXPERT] // context_parallel  # devices, or groups of C
    b = x.shape[0]
    if b % (shards * microbatches):
        where = f"{shards} devices" if context_parallel == 1 else \
            f"{shards} groups of {context_parallel} context-parallel devices"
        raise ValueError(f"batch of {b} sequences does not split into {microbatches} microbatches over {where}")
    per = b // (shards * microbatches)
    y = x.reshape((shards, microbatches, per) + x.shape[1:])
    y = jnp.swapaxes(y, 0, 1).reshape((microbatches, shards * per) + x.shape[1:])
    rows = TOKEN_AXES if context_parallel == 1 else DATA  # as batch_sharding places the whole batch
    return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, rows)))


def aggregate_stats(total: dict[str, Any], microbatches: int, router_bias, top_k: int, tokens: int) -> dict[str, Any]:
    """Summed per-microbatch stats -> the step's stats (see the module docstring)."""
    out = {k: (v if k in _SUMMED else v / microbatches) for k, v in total.items()}
    load = out["expert_load"]
    out["max_over_mean_load"] = jnp.mean(jnp.max(load, axis=-1) / jnp.mean(load, axis=-1))
    if "bias_hist" in out:
        out["bias_target"] = jax.vmap(lambda h, b: rt.bias_target_from_histogram(h, b, tokens, top_k))(
            out["bias_hist"], router_bias)
    return out


def accumulate(grad_fn: Callable, params, router_bias, tokens, segment_ids, *, microbatches: int, mesh,
               top_k: int, context_parallel: int = 1):
    """``grad_fn(params, tokens, segment_ids) -> ((loss, stats), grads)`` over the whole batch in
    ``microbatches`` sequential pieces (a lax.scan: one microbatch's activations live at a time);
    ``context_parallel`` is the model's (how the batch's sequences are laid over the devices)."""
    if microbatches == 1:
        return grad_fn(params, tokens, segment_ids)
    xs = tuple(split_microbatches(x, microbatches, mesh, context_parallel) for x in (tokens, segment_ids))
    (loss_shape, stats_shape), grads_shape = jax.eval_shape(grad_fn, params, xs[0][0], xs[1][0])
    zeros = lambda s: jnp.zeros(s.shape, s.dtype)  # noqa: E731
    init = (jax.tree.map(zeros, grads_shape), zeros(loss_shape),
            {k: zeros(v) for k, v in stats_shape.items() if k != "bias_target"})

    def body(carry, mb):
        g_acc, l_acc, s_acc = carry
        (loss, stats), g = grad_fn(params, *mb)
        s_acc = {k: s_acc[k] + stats[k] for k in s_acc}
        return (jax.tree.map(jnp.add, g_acc, g), l_acc + loss, s_acc), None

    (g_sum, l_sum, s_sum), _ = jax.lax.scan(body, init, xs)
    grads = jax.tree.map(lambda g: g / microbatches, g_sum)
    n_tokens = (tokens.shape[1] - 1) * tokens.shape[0]
    stats = aggregate_stats(s_sum, microbatches, router_bias, top_k, n_tokens)
    return (l_sum / microbatches, stats), grads
