"""The model's grouped_impl: it reaches the routed experts of every layer, and the same tiny-ep model
gives the same loss, stats and gradients with every grouped-compute implementation (it changes float
summation order only, which is why the training config may change it on a live run)."""

import jax
import numpy as np
import pytest
from test_moe_transformer import setup

from marin.kernels.grouped import GROUPED_IMPLS
from marin.models import transformer as tf
from marin.parallel.mesh import make_mesh

needs8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
pytest.importorskip("tokamax")  # the `test` extra installs it (Python >= 3.12)


def _loss(cfg, mesh, impl):
    return lambda p, b, t: tf.loss_and_stats(p, b, t, cfg, mesh=mesh, transport="ragged", grouped_impl=impl)


@needs8
def test_the_choice_reaches_the_routed_experts():
    """Traced only: the capacity program sorts no rows for a ragged_dot, the sorted ones do."""
    cfg, params, bias, tokens = setup("tiny-ep")
    mesh = make_mesh(2, 4)
    for impl in GROUPED_IMPLS:
        loss = _loss(cfg, mesh, impl)
        jaxpr = str(jax.make_jaxpr(jax.grad(lambda p, b, t, loss=loss: loss(p, b, t)[0]))(params, bias, tokens))
        assert ("ragged_dot" in jaxpr) == (impl != "capacity"), impl  # tokamax's CPU path is XLA's ragged_dot


@needs8
@pytest.mark.slow
def test_every_grouped_impl_trains_the_same_model():
    cfg, params, bias, tokens = setup("tiny-ep")
    mesh = make_mesh(2, 4)

    def run(impl):
        return jax.jit(jax.value_and_grad(_loss(cfg, mesh, impl), has_aux=True))(params, bias, tokens)

    (loss0, stats0), grads0 = run(GROUPED_IMPLS[0])
    for impl in GROUPED_IMPLS[1:]:
        (loss, stats), grads = run(impl)
        # f32 tiny model: the implementations differ in summation order only (observed ~1e-7 relative)
        np.testing.assert_allclose(float(loss), float(loss0), rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(stats["expert_load"]), np.asarray(stats0["expert_load"]))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6),
                     grads, grads0)
