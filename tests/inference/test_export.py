"""Export round trips: safetensors shards + index + config, the numpy-only reference forward and
load_exported against the JAX model's logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from marin.inference.export import ExportError, export_model, plan_shards
from marin.models import load_exported
from marin.models.config import get_preset
from marin.models.exported import INDEX_FILE, ExportFormatError, exported_shapes
from marin.models.transformer import forward, init_params, init_router_bias


@pytest.fixture(scope="module")
def model():
    # local + global layers, padded expert storage (stored width 40 > 36), untied head
    cfg = get_preset("tiny", vocab_size=61, n_layers=3, global_every=2, sliding_window=3, expert_width=36,
                     expert_width_multiple=8)
    params = init_params(cfg, jax.random.PRNGKey(0))
    bias = jax.random.normal(jax.random.PRNGKey(1), init_router_bias(cfg).shape) * 0.2
    return cfg, params, bias


def test_numpy_module_imports_no_jax():
    code = ("import sys; import marin.models.numpy_forward; "
            "assert not any(m == 'jax' or m.startswith('jax.') for m in sys.modules), 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_shard_plan_bounds_shard_size():
    shapes = {"a": (10,), "b": (10,), "c": (100,), "d": (1,)}
    assert plan_shards(shapes, 80) == [["a", "b"], ["c"], ["d"]]  # c (400 bytes) alone, over the bound
    assert plan_shards(shapes, 10**6) == [["a", "b", "c", "d"]]


def test_export_reference_forward_and_load_exported_match_jax(model, tmp_path):
    cfg, params, bias = model
    out = str(tmp_path / "export")
    res = export_model(params, bias, cfg, out, lineage={"step_name": "train-tiny"}, max_shard_bytes=20_000)
    assert res["shards"] > 2
    index = json.load(open(os.path.join(out, INDEX_FILE)))
    assert set(index["weight_map"]) == set(exported_shapes(cfg))
    assert {"config.json", "README.md", "reference_forward.py"} <= set(os.listdir(out))
    for shard in set(index["weight_map"].values()):  # bounded (one oversize tensor may stand alone)
        size = os.path.getsize(os.path.join(out, shard))
        names = [n for n, s in index["weight_map"].items() if s == shard]
        assert size < 20_000 + 4096 or len(names) == 1
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)).astype(np.int32)
    run_forward = jax.jit(forward, static_argnums=3)  # one program for both models (op by op: one per op)
    want = np.asarray(run_forward(params, bias, tokens, cfg)[0])

    # the shipped file, imported from the export directory itself: numpy only
    sys.path.insert(0, out)
    try:
        import reference_forward
    finally:
        sys.path.remove(out)
    config, tensors = reference_forward.load(out)
    assert tensors["layers.0.expert_gate"].shape == (cfg.n_experts, cfg.latent_dim, 36)  # padding dropped
    np.testing.assert_allclose(reference_forward.forward(tensors, config, tokens), want, rtol=1e-4, atol=1e-4)

    cfg2, params2, bias2 = load_exported(out)
    assert cfg2 == cfg
    np.testing.assert_array_equal(np.asarray(run_forward(params2, bias2, tokens, cfg2)[0]), want)


def test_refuses_a_non_empty_directory_unless_overwrite(model, tmp_path):
    cfg, params, bias = model
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="is not empty: choose a new directory or pass --overwrite"):
        export_model(params, bias, cfg, str(out))
    assert (out / "keep.txt").read_text() == "mine"
    export_model(params, bias, cfg, str(out), overwrite=True)
    assert not (out / "keep.txt").exists() and (out / INDEX_FILE).exists()


def test_load_exported_names_what_is_missing(tmp_path):
    with pytest.raises(ExportFormatError, match="config.json is missing"):
        load_exported(str(tmp_path))
