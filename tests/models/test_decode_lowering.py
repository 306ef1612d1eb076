"""The hero's decode step (KV cache, dropless expert parallelism over a rack) lowers for CUDA from
this CPU-only machine: abstract params and cache (no 535B allocation), an abstract 1 x 64 mesh."""

import jax
import jax.numpy as jnp

from marin.jaxcompat import lowering_for
from marin.models.config import get_preset
from marin.models.decode import decode_step, init_cache
from marin.models.transformer import init_params, init_router_bias
from marin.parallel.mesh import batch_sharding, param_shardings, replicated
from marin.training.lowering import abstract_mesh, forbidden_ops


def test_hero_decode_step_lowers_for_cuda_on_a_rack():
    cfg = get_preset("hero", n_layers=2)  # one local and one global layer: both cache kinds
    mesh = abstract_mesh(1, 64)
    rows, cache_len = 64, 4096
    with lowering_for("cuda"):
        params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
        params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), params,
                              param_shardings(params, mesh))
        bias = jax.ShapeDtypeStruct(init_router_bias(cfg).shape, jnp.float32, sharding=replicated(mesh))
        cache = jax.eval_shape(lambda: init_cache(cfg, rows, cache_len))
        tokens = jax.ShapeDtypeStruct((rows, 1), jnp.int32, sharding=batch_sharding(mesh))
        step = jax.jit(lambda p, b, c, t, pos: decode_step(p, b, c, t, pos, cfg, mesh))
        text = step.trace(params, bias, cache, tokens, tokens).lower(lowering_platforms=("cuda",)).as_text()
    assert forbidden_ops(text) == []
    assert "stablehlo.all_to_all" in text  # tokens go to their experts' devices (dropless EP)
    assert cache["local_k"].shape[2] == cfg.sliding_window and cache["global_k"].shape[2] == cache_len
