"""Every grouped-compute implementation inside every transport that uses it, against the plain
definition (marin.models.reference.moe_reference), forward and gradients, on the tiny EP mesh of 8
fake CPU devices. On CPU, tokamax runs its XLA implementation: tokamax 0.0.17's Mosaic GPU kernels
have no interpret mode, and its Mosaic TPU kernel's interpret mode asks for a TPU generation, which
a CPU host has not got; the kernels themselves are checked by lowering for CUDA
(test_grouped_lowering.py)."""

import jax
import jax.numpy as jnp
import pytest
from test_ep_transports import assert_close, make_experts, make_routing, reference_value_and_grad

from marin.kernels.grouped import GROUPED_IMPLS
from marin.parallel.mesh import make_mesh
from marin.parallel.transports import moe_experts

pytest.importorskip("tokamax")  # the `test` extra installs it (Python >= 3.12)

T, D, E, K = 64, 8, 16, 2

needs8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")


# capacity is the CPU default, which test_ep_transports and test_ragged_capacity check in every transport
@needs8
@pytest.mark.parametrize("impl", [pytest.param(i, marks=pytest.mark.slow) if i == "capacity" else i
                                  for i in GROUPED_IMPLS])
@pytest.mark.parametrize("transport", ["local", "dropless", "ragged", "ragged_capacity"])
def test_values_and_grads_equal_reference(transport, impl):
    """Capacity factor 100: the capacity-bounded transport's chunk buffers hold the worst case, so
    nothing drops and every transport computes the reference exactly (up to float order)."""
    mesh = make_mesh(2, 4)
    x = jax.random.normal(jax.random.key(0), (T, D))
    ids, w = make_routing(jax.random.key(1), skew=1.0, e=E)
    experts = make_experts(jax.random.key(2), e=E)
    probe = jax.random.normal(jax.random.key(3), (T, D))

    def loss(x, w, experts):
        y, s = moe_experts(x, ids, w, experts, n_experts=E, transport=transport, mesh=mesh, capacity_factor=100.0,
                           expert_chunks=2, grouped_impl=impl)
        return jnp.sum(y * probe), s

    (value, stats), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, w, experts)
    assert float(stats["send_drops"]) == 0 and float(stats["recv_drops"]) == 0
    # f32 throughout; the implementations differ from the reference only in summation order
    assert_close((value, grads), reference_value_and_grad(ids, probe)(x, w, experts))
