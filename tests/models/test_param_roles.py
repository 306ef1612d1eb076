"""One table gives every parameter leaf its role; the mesh's layout, the optimizers' groups, the export
and the memory planner read the role. A leaf added to the table reaches each of them; a leaf the
model builds without a role is refused when the model is built."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from marin.models import params as table
from marin.models.config import get_preset, param_shapes
from marin.models.exported import exported_shapes, exported_tensor, params_from_tensors
from marin.models.params import PARAMS, Param, register_param, role_of
from marin.models.transformer import init_params
from marin.parallel import roles
from marin.parallel.layout import EXPERT, leaf_partition
from marin.parallel.roles import DENSE_MATRIX, EXPERT_STACK, VECTOR, leaf_role
from marin.training.optimizers import AdamWConfig, MuonHConfig
from marin.training.optimizers.updates import decay_mask
from marin.training.planning import optimizer_bytes_per_device, params_per_device


@pytest.fixture
def restored_table():
    """The parameter table and the registered roles as they were, after the test."""
    saved, saved_roles = dict(PARAMS), dict(roles.LEAF_ROLES)
    yield
    PARAMS.clear()
    PARAMS.update(saved)
    roles.LEAF_ROLES.clear()
    roles.LEAF_ROLES.update(saved_roles)


def test_every_leaf_the_model_builds_has_its_role_in_the_table():
    cfg = get_preset("tiny-ep", n_layers=1)
    shapes = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.PRNGKey(0))
    keys = ["/".join(str(k.key) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]
    assert sorted(keys) == sorted(param_shapes(cfg))
    assert {role_of(k) for k in keys} == {DENSE_MATRIX, EXPERT_STACK, VECTOR, "embedding", "head", "router"}
    assert role_of("blocks/router_bias") == "router_bias" and "blocks/router_bias" not in param_shapes(cfg)


def test_a_leaf_without_a_role_is_refused_when_the_model_is_built(restored_table):
    del PARAMS["blocks/wq"]
    cfg = get_preset("tiny", n_layers=1, vocab_size=97)  # a config no other test compiles init_params for
    with pytest.raises(ValueError) as e:
        init_params(cfg, jax.random.PRNGKey(0))
    assert str(e.value) == ("parameter leaf 'blocks/wq' has no role: give it one in marin.models.params.PARAMS "
                            "(roles: dense_matrix, expert_stack, vector, embedding, head, router, router_bias)")
    with pytest.raises(ValueError, match=r"^parameter leaf 'gate' \[4, 8\] has no role: give it one in the model's"):
        leaf_role("gate", (4, 8))  # the mesh's rule will not guess a large leaf's placement either
    with pytest.raises(ValueError, match="^Param: unknown parameter role 'matrix'; choose from dense_matrix, "):
        Param("matrix", lambda c: (1,))


def test_a_leaf_added_to_the_table_reaches_every_consumer(restored_table):
    cfg = get_preset("tiny-ep", n_layers=2)
    before_params = params_per_device(cfg, (2, 4), "fsdp")["total"]
    before_muonh = optimizer_bytes_per_device(cfg, (2, 4), "fsdp", MuonHConfig())["state"]
    # a per-head attention gate (a dense matrix) and a routed experts' extra projection (an expert stack)
    register_param("blocks/attn_gate", Param(DENSE_MATRIX, lambda c: (c.n_layers, c.d_model, c.n_heads * 8)))
    register_param("blocks/expert_gain", Param(
        EXPERT_STACK, lambda c: (c.n_layers, c.n_experts, c.latent_dim, c.stored_expert_width),
        lambda c, i: (c.n_experts, c.latent_dim, c.expert_width)))
    gate, gain = (2, cfg.d_model, cfg.n_heads * 8), (2, cfg.n_experts, cfg.latent_dim, cfg.stored_expert_width)
    assert param_shapes(cfg)["blocks/attn_gate"] == gate and param_shapes(cfg)["blocks/expert_gain"] == gain

    # the mesh's layout: by role, through the leaf's name as a tree mirroring the params spells it
    assert leaf_role("attn_gate", gate) == DENSE_MATRIX and leaf_role("expert_gain", gain) == EXPERT_STACK
    assert leaf_partition(leaf_role("attn_gate", gate), gate, (2, 4), "fsdp", True) == (None, ("data", "expert"), None)
    assert leaf_partition(leaf_role("expert_gain", gain), gain, (2, 4), "replicated", True)[1] == EXPERT

    # the optimizers: MuonH orthogonalises both; AdamW decays both (not a vector)
    assert MuonHConfig().leaf_group("blocks/attn_gate", gate) == "muonh"
    assert MuonHConfig().leaf_group("blocks/expert_gain", gain) == "muonh"
    mask = decay_mask({"blocks": {"attn_gate": np.zeros(gate), "attn_norm": np.zeros((2, cfg.d_model))}})
    assert mask == {"blocks": {"attn_gate": True, "attn_norm": False}}

    # the memory planner: each device holds its shard of both, and MuonH's momentum for them
    added = math.prod(gate) / 8 + math.prod(gain) / 8  # split 8 ways under fsdp on a 2 x 4 mesh
    assert params_per_device(cfg, (2, 4), "fsdp")["total"] == before_params + added
    assert optimizer_bytes_per_device(cfg, (2, 4), "fsdp", MuonHConfig())["state"] == before_muonh + 4 * added
    assert AdamWConfig().state_bytes("blocks/attn_gate", gate) == 8

    # the export: one tensor per layer at its exported shape, read back into the params
    shapes = exported_shapes(cfg)
    assert shapes["layers.1.attn_gate"] == gate[1:]
    assert shapes["layers.1.expert_gain"] == (cfg.n_experts, cfg.latent_dim, cfg.expert_width)
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in param_shapes(cfg).items()
              if not k.startswith("blocks/")}
    params["blocks"] = {k.split("/")[1]: rng.standard_normal(s).astype(np.float32)
                        for k, s in param_shapes(cfg).items() if k.startswith("blocks/")}
    bias = rng.standard_normal((cfg.n_moe_layers, cfg.n_experts)).astype(np.float32)
    tensors = {name: exported_tensor(params, bias, cfg, name) for name in shapes}
    back, back_bias = params_from_tensors(tensors.__getitem__, cfg)
    np.testing.assert_array_equal(back["blocks"]["attn_gate"], params["blocks"]["attn_gate"])
    np.testing.assert_array_equal(back_bias, bias)
    assert table.leaves_by_role(cfg, EXPERT_STACK)[-1] == "blocks/expert_gain"
