"""Context parallelism against single-device blocked attention on the same sequences: forward and
gradients, local and global layers, packed documents, lengths 2C does not divide, C = 2 and 4; and
a whole train step with context parallelism (with and without microbatches) against the step without
it; and the context-parallel step lowered for CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin.models.blocked_attention import blocked_attention
from marin.models.config import get_preset
from marin.models.context_parallel import (
    ContextParallelError,
    check_split,
    chunk_order,
    from_shards,
    sequence_attention,
    to_shards,
)
from marin.models.transformer import GLOBAL_WINDOW, layer_kv
from marin.parallel.mesh import make_mesh

# 4 query heads; 2 KV heads on local layers, 1 on global ones (stored at 2); window 5; block 4
CFG = get_preset("tiny", n_heads=4, n_kv_heads=2, n_kv_heads_global=1, head_dim=8, sliding_window=5,
                 attention_impl="blocked", attention_block=4)


def test_chunk_order_and_layout_round_trip():
    assert chunk_order(2) == [0, 3, 1, 2] and chunk_order(4) == [0, 7, 1, 6, 2, 5, 3, 4]
    x = jnp.arange(4 * 16).reshape(4, 16)
    rows = to_shards(x, 2, 4)  # 2 groups of 2 devices, 2 sequences per group
    # device 1 (group 0, shard 1) holds chunks 1 and 2 of sequences 0 and 1: positions 4..11
    np.testing.assert_array_equal(rows[2], np.arange(4, 12))
    np.testing.assert_array_equal(rows[3], 16 + np.arange(4, 12))
    np.testing.assert_array_equal(rows[0], np.r_[0:4, 12:16])
    np.testing.assert_array_equal(from_shards(rows, 2, 4), x)


def test_bad_splits_are_one_line_errors():
    mesh = make_mesh(2, 4)
    for args, message in [((4, 16, 3), "must divide the expert axis"), ((4, 18, 2), "not a multiple of 2 x"),
                          ((3, 16, 2), "do not split over 8 devices")]:
        with pytest.raises(ContextParallelError, match=message) as e:
            check_split(*args, mesh)
        assert "\n" not in str(e.value)


def _reference(q, k, v, window, seg):
    k, v = layer_kv(k, v, window, CFG)
    return blocked_attention(q, k, v, window, seg, block=CFG.attention_block)


@pytest.mark.parametrize("degree,length", [  # 37: neither C nor 2C divides it
    (4, 37), pytest.param(2, 37, marks=pytest.mark.slow), pytest.param(2, 40, marks=pytest.mark.slow),
    pytest.param(4, 40, marks=pytest.mark.slow)])
def test_forward_and_gradients_equal_single_device(degree, length):
    mesh = make_mesh(2, 4)
    b = 8 // degree  # B x C rows over 8 devices
    rng = np.random.default_rng(degree * 100 + length)
    q = jnp.asarray(rng.normal(size=(b, length, 2, 2, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, length, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, length, 2, 8)), jnp.float32)
    ct = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    # packed documents: boundaries inside chunks and across shard boundaries
    seg = jnp.asarray(np.cumsum(rng.random((b, length)) < 0.08, axis=1), jnp.int32)
    for window in (CFG.sliding_window, GLOBAL_WINDOW):
        def loss_cp(q, k, v, window=window):
            return jnp.sum(sequence_attention(q, k, v, window, seg, CFG, mesh, degree) * ct)

        def loss_ref(q, k, v, window=window):
            return jnp.sum(_reference(q, k, v, window, seg) * ct)

        got = jax.jit(lambda q, k, v, w=window: sequence_attention(q, k, v, w, seg, CFG, mesh, degree))(q, k, v)
        want = jax.jit(_reference, static_argnums=3)(q, k, v, window, seg)  # op by op: hundreds of compiles
        # float32, the same terms in another summation order
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
        g_cp = jax.jit(jax.grad(loss_cp, argnums=(0, 1, 2)))(q, k, v)
        g_ref = jax.jit(jax.grad(loss_ref, argnums=(0, 1, 2)))(q, k, v)
        for a, r in zip(g_cp, g_ref):
            np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-4)


def _train(context_parallel: int, steps: int = 2, microbatches: int = 1):
    from marin.parallel.mesh import batch_sharding, place_host_arrays
    from marin.training.config import ParallelismConfig, SyntheticDataConfig, TelemetryConfig, TrainConfig
    from marin.training.trainer import init_host_state, make_train_step, model_config, state_shardings, synthetic_batch

    # 2 layers (one local, one global), window 5 < the 8-token chunks of C = 2: the halo path
    config = TrainConfig(output_path="", data=SyntheticDataConfig(), tokens_per_step=8 * 32,
                         model=get_preset("tiny-ep", n_layers=2, sliding_window=5, attention_impl="blocked",
                                          attention_block=8, n_kv_heads_global=1),
                         seq_len_phases=((0.0, 32),), telemetry=TelemetryConfig(wandb_project=None),
                         parallelism=ParallelismConfig(context_parallel_by_seq_len=(
                             ((32, context_parallel),) if context_parallel > 1 else ())))
    from marin.training.config import model_at

    cfg = model_at(config, model_config(config), 32)
    assert cfg.context_parallel == context_parallel
    mesh = make_mesh(2, 4)
    host = init_host_state(config, cfg)
    shardings = state_shardings(host, mesh)
    state = place_host_arrays(host, shardings)
    step = make_train_step(config, cfg, mesh, "local", shardings, microbatches)
    out = []
    for i in range(steps):
        b = synthetic_batch(config.data, i, 8, 32)
        b["segment_ids"] = (np.arange(33)[None, :] >= 13).astype(np.int32) + 1 + np.zeros((8, 1), np.int32)
        batch = place_host_arrays((b["tokens"], b["segment_ids"]), batch_sharding(mesh, context_parallel))
        state, m = step(state, *batch, jnp.float32(3e-3))
        out.append({k: float(v) for k, v in m.items()})
    return out, jax.device_get(state)


@pytest.mark.slow  # ~25 s: two train programs compiled; the attention's exactness keeps a fast test above
def test_a_train_step_with_context_parallelism_equals_the_step_without():
    ref, s_ref = _train(1)
    cp, s_cp = _train(2)
    for a, b in zip(ref, cp):
        for key in ("loss", "ce_loss", "z_loss", "grad_norm", "expert_load_max", "router_bias_spread"):
            np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-6, err_msg=key)  # float order only
    for x, y in zip(jax.tree.leaves(s_ref["params"]), jax.tree.leaves(s_cp["params"])):
        # AdamW normalises each element: a gradient near zero amplifies float reordering a little
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # ~25 s: two train programs compiled; the split's layout keeps a fast test (test_accumulation)
def test_microbatches_with_context_parallelism_equal_the_whole_batch_step_without():
    # 8 sequences, C = 2 on a 2 x 4 mesh: 4 groups of 2 devices, each group's 2 sequences in 2
    # microbatches of one (each microbatch again fills every device: 4 sequences x 2 shards)
    ref, s_ref = _train(1)
    got, s_got = _train(2, microbatches=2)
    for a, b in zip(ref, got):
        for key in ("loss", "ce_loss", "z_loss", "grad_norm", "expert_load_max", "router_bias_spread"):
            # float order only: the "local" transport drops nothing, so the microbatches' mean loss and
            # gradient are the whole batch's (equal token counts), and the router's histograms add up
            np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-6, err_msg=key)
    for x, y in zip(jax.tree.leaves(s_ref["params"]), jax.tree.leaves(s_got["params"])):
        # as above: AdamW's per-element normalisation amplifies float reordering of near-zero gradients
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seq_len", [16384, 1024])  # chunks of 2,048 (halo) and of 128 (< window: gathered)
def test_context_parallel_train_step_lowers_for_cuda(seq_len):
    from marin.training.config import ParallelismConfig, SyntheticDataConfig, TelemetryConfig, TrainConfig
    from marin.training.lowering import forbidden_ops, lower_train_step
    from marin.training.trainer import model_config

    config = TrainConfig(output_path="", data=SyntheticDataConfig(), model=get_preset("hero", n_layers=2),
                         tokens_per_step=64 // 4 * seq_len,  # the lowered batch: whole sequences
                         seq_len_phases=((0.0, seq_len),), telemetry=TelemetryConfig(wandb_project=None),
                         parallelism=ParallelismConfig(context_parallel_by_seq_len=((seq_len, 4),)))
    from marin.training.config import model_at

    cfg = model_at(config, model_config(config), seq_len)
    text = lower_train_step(config, cfg, (1, 64), "ragged", batch_size=64 // 4, seq_len=seq_len).as_text()
    assert forbidden_ops(text) == []
    assert "stablehlo.collective_permute" in text  # the halo / K-V gather over the context-parallel group
    assert "ragged_all_to_all" in text  # the MoE's EP transport, unchanged


def test_the_hero_attention_shape_at_a_tiny_width_lowers_for_cuda_with_context_parallelism_and_microbatches():
    # the hero's attention (head dim 128, 4:1 KV heads on the local layers and 8:1 on the global
    # ones, window 2,048: 8 heads, 2 and 1 KV heads) at width 1,024, one local and one global layer,
    # C = 2 with 4,096-token chunks (the halo path) and gradient accumulation over the groups
    from marin.training.config import ParallelismConfig, SyntheticDataConfig, TelemetryConfig, TrainConfig, model_at
    from marin.training.lowering import forbidden_ops, lower_train_step
    from marin.training.trainer import model_config

    seq_len, degree = 16384, 2
    config = TrainConfig(output_path="", data=SyntheticDataConfig(),
                         model=get_preset("hero", n_layers=2, d_model=1024, n_heads=8, n_kv_heads=2,
                                          n_kv_heads_global=1, latent_dim=512, expert_width=512,
                                          shared_width=512, expert_width_multiple=1),
                         tokens_per_step=8 // degree * 2 * seq_len,  # the lowered batch: whole sequences
                         seq_len_phases=((0.0, seq_len),), telemetry=TelemetryConfig(wandb_project=None),
                         parallelism=ParallelismConfig(context_parallel_by_seq_len=((seq_len, degree),)))
    cfg = model_at(config, model_config(config), seq_len)
    assert (cfg.head_dim, cfg.n_heads // cfg.n_kv_heads, cfg.n_heads // cfg.kv_heads_global,
            cfg.sliding_window, cfg.context_parallel) == (128, 4, 8, 2048, degree)
    microbatches = 2
    batch = 8 // degree * microbatches  # every microbatch: one sequence per group of 2 on a 1 x 8 mesh
    text = lower_train_step(config, cfg, (1, 8), "ragged", batch_size=batch, seq_len=seq_len,
                            microbatches=microbatches).as_text()
    assert forbidden_ops(text) == []
    assert "stablehlo.collective_permute" in text  # the halo and the K/V gather over the group
    assert "ragged_all_to_all" in text
