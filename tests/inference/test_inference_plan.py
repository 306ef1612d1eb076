"""`marin plan --inference`: per-device weights, KV cache (the sliding-window layers' rings) and
activations of decoding, and whether they fit."""

from __future__ import annotations

import json

from marin.cli import main
from marin.inference.planning import inference_plan, kv_cache_bytes
from marin.models.config import get_preset
from marin.pools import get_pool


def _kv_reference(cfg, rows: int, context: int) -> tuple[int, int]:
    """Layer by layer, the slow obvious way: K and V of every cached column of every layer."""
    c = 2 if cfg.dtype == "bfloat16" else 4
    glob = loc = 0
    for window in cfg.layer_windows():
        cols = context if window is None else min(window, context)
        n = 2 * rows * cols * cfg.n_kv_heads * cfg.head_dim * c
        if window is None:
            glob += n
        else:
            loc += n
    return glob, loc


def test_kv_cache_counts_full_global_layers_and_window_rings():
    cfg = get_preset("tiny", n_layers=5, global_every=2, sliding_window=16, max_seq_len=256)
    for rows, context in [(1, 8), (3, 16), (2, 200)]:
        kv = kv_cache_bytes(cfg, rows, context)
        assert (kv["global"], kv["local"]) == _kv_reference(cfg, rows, context)
    # past the window, only the global layers grow with the context
    short, long = kv_cache_bytes(cfg, 1, 32), kv_cache_bytes(cfg, 1, 256)
    assert long["local"] == short["local"] and long["global"] == 8 * short["global"]


def test_rows_split_over_the_pool_and_fit_flips_with_the_batch():
    cfg = get_preset("hero")
    pool = get_pool("gb200-rack")
    small = inference_plan(cfg, pool, batch=pool.num_devices, context=4096)
    assert small["rows_per_device"] == 1 and small["fits"]
    big = inference_plan(cfg, pool, batch=pool.num_devices * 512, context=cfg.max_seq_len)
    assert big["rows_per_device"] == 512 and not big["fits"]
    assert big["per_device"]["weights"] == small["per_device"]["weights"]
    bf16 = inference_plan(cfg, pool, batch=1, context=4096, weights_dtype="bfloat16")
    assert bf16["per_device"]["weights"] * 2 == small["per_device"]["weights"]


def test_plan_inference_cli(capsys):
    rc = main(["plan", "hero", "--pool", "gb200-rack", "--inference", "--batch", "64", "--context", "4096"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "weights (float32, replicated)" in out and "sliding-window layers' rings" in out and ": fits" in out
    rc = main(["plan", "hero", "--pool", "gb200-rack", "--inference", "--batch", "64", "--context", "4096", "--json"])
    rec = json.loads(capsys.readouterr()[0])
    assert rc == 0 and rec["fits"] and rec["total"] == sum(rec["per_device"].values())
    # the hero's run trains to 262,144 tokens (its training plan's context line): sampling that long is planned
    rc = main(["plan", "hero", "--pool", "gb200-11racks", "--inference", "--context", "262144", "--json"])
    rec = json.loads(capsys.readouterr()[0])
    assert rc == (0 if rec["fits"] else 1) and rec["context"] == 262_144, rec
    rc = main(["plan", "tiny", "--pool", "local-cpu-1", "--inference", "--context", "100000"])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "max_seq_len" in err
