"""The optimizers' updates in JAX: each an optax ``GradientTransformationExtraArgs`` whose
``update(grads, state, params, lr=...)`` returns the change of every parameter (the step adds it).

The parameters are a dict of float32 leaves (nested: ``params["blocks"]["wq"]``); every state tree
here is a dict with a subset of those leaves under the same keys, so the layout's leaf-name rule
shards a moment or a momentum buffer exactly like its parameter, and the checkpoint stores it
under the parameter's path. Stacked leaves keep their leading axes ([layers, ...] and, for routed
experts, [layers, experts, ...]); every matrix operation here acts on the last two axes, matrix by
matrix.

Under a sharded jit every reduction here is a plain ``jnp.sum`` over the matrix axes of an array
whose sharding the compiler knows, so XLA adds the partial sums of every shard exactly once
(tests/training/test_muonh_sharded.py checks each norm against an unsharded reference on 8 devices).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from marin.parallel.roles import VECTOR, leaf_role
from marin.training.optimizers.base import ADAM_GROUP, ADAMH_GROUP, MUONH_GROUP, NEWTON_SCHULZ_COEFFS, OptimizerBase

NORM_FLOOR = 1e-10
"""Divisor floor of the hyperball's norms (an all-zero matrix or update stays where it is)."""


# ---- trees of parameter leaves ---------------------------------------------------------------------
def flat_leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"blocks/wq": leaf, "embed": leaf, ...}``: a dict tree's leaves by their slash-joined keys."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(flat_leaves(v, key))
        else:
            out[key] = v
    return out


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`flat_leaves`."""
    out: dict[str, Any] = {}
    for key, v in flat.items():
        *parents, last = key.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = v
    return out


def decay_mask(params: Any) -> Any:
    """AdamW's weight decay on every leaf but the vectors (norms' gains), by the leaf's role."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: leaf_role(str(getattr(path[-1], "key", "")), p.shape) != VECTOR, params
    )


# ---- AdamW -------------------------------------------------------------------------------------------
def adamw(cfg: OptimizerBase) -> optax.GradientTransformationExtraArgs:
    """AdamW (``cfg``: an :class:`~marin.training.optimizers.adamw.AdamWConfig`): clip by global norm,
    Adam's direction, decoupled weight decay on matrices, times ``-lr``. The state is the optax
    chain's (what AdamW checkpoints have always held)."""
    inner = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.scale_by_adam(b1=cfg.beta1, b2=cfg.beta2, eps=cfg.adam_eps),
        optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask),
    )

    def update(grads, state, params=None, *, lr, **extra):
        del extra
        direction, state = inner.update(grads, state, params)
        return jax.tree.map(lambda u: -lr * u, direction), state

    return optax.GradientTransformationExtraArgs(inner.init, update)


# ---- MuonH -------------------------------------------------------------------------------------------
def frobenius(x: jax.Array) -> jax.Array:
    """The Frobenius norm of each matrix of ``x`` (its last two axes), float32, kept as [..., 1, 1]."""
    x = x.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))


def newton_schulz(x: jax.Array, steps: int = 5, eps: float = 1e-8) -> jax.Array:
    """The orthogonal factor of one matrix ``x`` [m, n] (U V^T of its SVD, approximately: the
    quintic iteration pushes every singular value towards 1 without converging exactly), float32.
    Normalised by its Frobenius norm first so every singular value is at most 1; iterated on the
    wide orientation, so the Gram matrix is the smaller one."""
    a, b, c = NEWTON_SCHULZ_COEFFS
    x = x.astype(jnp.float32)
    x = x / (frobenius(x) + eps)
    wide = x.shape[-2] <= x.shape[-1]
    if not wide:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x if wide else x.T


def orthogonalise(u: jax.Array, steps: int = 5, eps: float = 1e-8) -> jax.Array:
    """:func:`newton_schulz` of every matrix of ``u`` (its last two axes). A stacked leaf's layers
    run one after another (``lax.map``: one layer's temporaries at a time); the axes between the
    layer axis and the matrix (a routed-expert stack's experts) are vmapped, so each device
    orthogonalises the experts it holds and no stack is gathered onto one device."""
    if u.ndim <= 2:
        return newton_schulz(u, steps, eps) if u.ndim == 2 else u.astype(jnp.float32)
    one = lambda m: newton_schulz(m, steps, eps)  # noqa: E731
    for _ in range(u.ndim - 3):
        one = jax.vmap(one)
    return jax.lax.map(one, u)


def hyperball(p: jax.Array, u: jax.Array, lr: jax.Array) -> jax.Array:
    """The change of parameter ``p`` under the hyperball step along direction ``u``, per matrix (its
    last two axes): ``q = p - lr * u * |p| / |u|``, then ``q`` scaled back to ``|p|``; returns
    ``q * |p| / |q| - p``. Each matrix of a stack keeps its own Frobenius norm."""
    p = p.astype(jnp.float32)
    p_norm = frobenius(p)
    q = p - lr * u * (p_norm / jnp.maximum(frobenius(u), NORM_FLOOR))
    return q * (p_norm / jnp.maximum(frobenius(q), NORM_FLOOR)) - p


class MuonHState(NamedTuple):
    """``momentum``: the MuonH group's buffers; ``mu``, ``nu``: Adam's moments of the AdamH and Adam
    groups; ``count``: Adam's step count (bias correction). Each a dict mirroring the parameters'."""

    count: jax.Array
    momentum: dict[str, Any]
    mu: dict[str, Any]
    nu: dict[str, Any]


def muonh(cfg: OptimizerBase) -> optax.GradientTransformationExtraArgs:
    """MuonH / AdamH / Adam by group (``cfg``: a :class:`~marin.training.optimizers.muonh.MuonHConfig`)."""

    def groups(params: dict[str, Any]) -> dict[str, str]:
        return {k: cfg.leaf_group(k, tuple(v.shape)) for k, v in flat_leaves(params).items()}

    def init(params):
        label = groups(params)
        flat = flat_leaves(params)
        zeros = {k: jnp.zeros(v.shape, jnp.float32) for k, v in flat.items()}
        adam = {k: z for k, z in zeros.items() if label[k] != MUONH_GROUP}
        return MuonHState(count=jnp.zeros([], jnp.int32), momentum=nest({k: z for k, z in zeros.items()
                                                                         if label[k] == MUONH_GROUP}),
                          mu=nest(adam), nu=nest({k: jnp.zeros_like(z) for k, z in adam.items()}))

    def update(grads, state, params=None, *, lr, **extra):
        del extra
        if params is None:
            raise ValueError("MuonH needs the parameters: its step keeps each matrix's norm")
        if cfg.grad_clip is not None:
            grads, _ = optax.clip_by_global_norm(cfg.grad_clip).update(grads, optax.EmptyState())
        label, g, p = groups(params), flat_leaves(grads), flat_leaves(params)
        momentum, mu, nu = flat_leaves(state.momentum), flat_leaves(state.mu), flat_leaves(state.nu)
        count = state.count + 1
        t = count.astype(jnp.float32)
        correct1, correct2 = 1 - cfg.beta1 ** t, 1 - cfg.beta2 ** t
        lr = jnp.asarray(lr, jnp.float32)
        delta, new_m, new_mu, new_nu = {}, {}, {}, {}
        for k, grad in g.items():
            grad = grad.astype(jnp.float32)
            if label[k] == MUONH_GROUP:
                new_m[k] = cfg.momentum * momentum[k] + grad
                direction = cfg.momentum * new_m[k] + grad if cfg.nesterov else new_m[k]
                delta[k] = hyperball(p[k], orthogonalise(direction, cfg.newton_schulz_steps, cfg.muon_eps), lr)
                continue
            new_mu[k] = cfg.beta1 * mu[k] + (1 - cfg.beta1) * grad
            new_nu[k] = cfg.beta2 * nu[k] + (1 - cfg.beta2) * jnp.square(grad)
            direction = (new_mu[k] / correct1) / (jnp.sqrt(new_nu[k] / correct2) + cfg.adam_eps)
            if label[k] == ADAMH_GROUP:
                delta[k] = hyperball(p[k], direction, lr)
            else:
                assert label[k] == ADAM_GROUP
                delta[k] = -(lr * cfg.adam_lr_ratio) * direction
        return nest(delta), MuonHState(count=count, momentum=nest(new_m), mu=nest(new_mu), nu=nest(new_nu))

    return optax.GradientTransformationExtraArgs(init, update)
