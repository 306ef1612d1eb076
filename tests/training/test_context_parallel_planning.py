"""The planner's context parallelism: buffers, causal imbalance against a brute-force count, the
smallest C that fits, and `marin plan --context-parallel`."""

from __future__ import annotations

import json

import pytest

from marin.cli import main as marin_main
from marin.models.config import get_preset
from marin.pools import get_pool
from marin.training.planning import (
    causal_imbalance,
    context_parallel_bytes,
    context_parallel_degrees,
    imbalance_cost,
    memory_plan,
    plan_with_context_parallel,
)

HERO_TOKENS = 11_264 * 4096
LONG = 262_144


def _brute_imbalance(degree: int, order: str, chunk: int = 64) -> float:
    """Causal work (keys visible to each query, summed) of each shard of one sequence, position by position."""
    length = 2 * degree * chunk
    chunks_of = ({c: [2 * c, 2 * c + 1] for c in range(degree)} if order == "contiguous"
                 else {c: [c, 2 * degree - 1 - c] for c in range(degree)})
    work = [sum(i + 1 for j in chunks_of[c] for i in range(j * chunk, (j + 1) * chunk)) for c in range(degree)]
    assert sum(len(v) for v in chunks_of.values()) * chunk == length
    return max(work) / (sum(work) / degree)


@pytest.mark.parametrize("degree", [1, 2, 4, 8])
def test_causal_imbalance_against_brute_force(degree):
    assert causal_imbalance(degree, "zigzag") == pytest.approx(_brute_imbalance(degree, "zigzag"), abs=1e-12)
    # the closed form counts each chunk's mean position; the discrete count differs by O(1 / chunk)
    assert causal_imbalance(degree, "contiguous") == pytest.approx(_brute_imbalance(degree, "contiguous"), rel=0.02)
    assert causal_imbalance(4, "contiguous") == pytest.approx(1.75)


def test_hero_imbalance_cost_is_over_the_bar_contiguous_and_zero_zigzag():
    hero = get_preset("hero")
    assert 0.25 < imbalance_cost(hero, LONG, 4) < 0.40  # > 20%: balance it
    assert imbalance_cost(hero, LONG, 4, "zigzag") == pytest.approx(0.0, abs=1e-12)


def test_degrees_and_buffers():
    hero, pool = get_preset("hero"), get_pool("gb200-11racks")
    assert context_parallel_degrees(hero, pool, HERO_TOKENS, LONG) == [4, 8, 16, 32, 64]  # 176 sequences, 704 devices
    assert context_parallel_degrees(hero, pool, HERO_TOKENS, 4096)[0] == 1
    b = context_parallel_bytes(hero.replace(context_parallel=4), LONG)
    # one global layer's gather: K, V at 6 heads + the 12-head copy in bf16, and float32 dK, dV at 12 heads
    assert b["gathered"] == LONG * 128 * (2 * 2 * 6 + 2 * 2 * 12 + 2 * 4 * 12)
    assert b["halo"] == 2 * 2047 * 2 * 2 * 12 * 128 * 2 and b["total"] == b["gathered"]


def test_activations_per_device_fall_with_c():
    hero, pool = get_preset("hero", remat_policy="full"), get_pool("gb200-11racks")
    a4 = memory_plan(hero.replace(context_parallel=4), pool, HERO_TOKENS, LONG, param_sharding="fsdp")
    a8 = memory_plan(hero.replace(context_parallel=8), pool, HERO_TOKENS, LONG, param_sharding="fsdp")
    # tokens per device are tokens_per_step / devices either way (1/C of a sequence's: C = 4 holds one
    # 65,536-token shard, C = 8 two 32,768-token shards of two sequences), so the per-token activations
    # stay, while the gathered K/V (the whole sequence per shard row) doubles
    assert a8["activations"] == pytest.approx(a4["activations"], rel=0.01)
    assert a8["context_parallel"] == pytest.approx(2 * a4["context_parallel"], rel=1e-9)
    with pytest.raises(ValueError, match="at context parallelism 2"):
        memory_plan(hero.replace(context_parallel=2), pool, HERO_TOKENS, LONG, param_sharding="fsdp")


def test_smallest_c_that_fits_is_chosen_and_said():
    hero, pool = get_preset("hero", remat_policy="full"), get_pool("gb200-11racks")
    p = plan_with_context_parallel(hero, pool, tokens_per_step=HERO_TOKENS, seq_len=LONG, param_sharding="fsdp")
    assert p["fits"] and p["context_parallel"] == 4 and "context parallelism 4 chosen" in p["context_parallel_note"]
    short = plan_with_context_parallel(hero, pool, tokens_per_step=HERO_TOKENS, seq_len=4096, param_sharding="fsdp",
                                       microbatches=4)
    assert short["context_parallel"] == 1 and short["context_parallel_note"] is None


def test_marin_plan_context_parallel_flag(capsys):
    assert marin_main(["plan", "hero", "--pool", "gb200-11racks", "--seq-len", "262144", "--remat", "full",
                       "--context-parallel", "8", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["context_parallel"] == 8 and p["fits"]
    assert marin_main(["plan", "hero", "--pool", "gb200-11racks", "--seq-len", "262144"]) == 0
    out = capsys.readouterr().out
    assert "chosen: the smallest that fits" in out and "context_parallel" in out
    assert marin_main(["plan", "hero", "--pool", "gb200-11racks", "--seq-len", "262144",
                       "--context-parallel", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("marin plan: error:") and err.count("\n") == 1
