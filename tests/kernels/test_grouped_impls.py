"""The grouped-compute implementations' names, the per-platform rule that picks one, its one-line
refusals, and the buffers each allocates per call (the memory planner's figures) against the
shapes in the lowered program."""

import re

import jax
import jax.numpy as jnp
import pytest

from marin.jaxcompat import lowering_for
from marin.kernels import grouped
from marin.kernels.names import GROUPED_IMPLS, canonical_grouped_impl
from marin.training.config import ParallelismConfig

H100, B200, A100 = 9.0, 10.0, 8.0


def test_the_names_are_fixed_and_the_old_one_still_reads():
    assert GROUPED_IMPLS == grouped.GROUPED_IMPLS == ("capacity", "ragged_dot", "tokamax")
    assert canonical_grouped_impl("ragged") == "ragged_dot"  # before the rename
    assert ParallelismConfig(grouped_impl="ragged").grouped_impl == "ragged_dot"
    assert ParallelismConfig().grouped_impl == "auto"


@pytest.mark.parametrize("platform,facts,want", [
    ("cpu", {}, "capacity"),
    ("cpu", {"tokamax_installed": True}, "capacity"),
    ("tpu", {}, "ragged_dot"),
    ("gpu", {}, "capacity"),  # lowering for CUDA from a CPU host: nothing known, the bounded fallback
    ("cuda", {"compute_capability": H100, "cudnn_version": (9, 10), "tokamax_installed": True}, "tokamax"),
    ("gpu", {"compute_capability": H100, "cudnn_version": (9, 10)}, "capacity"),  # old cuDNN, no tokamax
    ("gpu", {"compute_capability": H100, "cudnn_version": (9, 22)}, "ragged_dot"),
    ("gpu", {"compute_capability": B200, "cudnn_version": (9, 28), "tokamax_installed": True}, "ragged_dot"),
    ("gpu", {"compute_capability": B200, "cudnn_version": (9, 21), "tokamax_installed": True}, "capacity"),
    ("gpu", {"compute_capability": A100, "cudnn_version": (9, 28), "tokamax_installed": True}, "ragged_dot"),
])
def test_auto_follows_the_platform_rule(platform, facts, want):
    assert grouped.resolve_grouped_impl("auto", platform, **facts) == want


def test_an_explicit_name_is_itself_where_it_runs():
    for name in GROUPED_IMPLS:
        assert grouped.resolve_grouped_impl(name, "cpu", tokamax_installed=True) == name
    assert grouped.resolve_grouped_impl("ragged_dot", "gpu") == "ragged_dot"  # cuDNN unknown: not refused
    assert grouped.resolve_grouped_impl("tokamax", "gpu", compute_capability=H100, tokamax_installed=True) == "tokamax"


@pytest.mark.parametrize("name,platform,facts,line", [
    ("tokamax", "gpu", {"compute_capability": H100},
     "grouped_impl 'tokamax' needs the tokamax package, which is not installed (pip install 'marin[gpu]'); "
     "use 'capacity' or 'ragged_dot'"),
    ("tokamax", "gpu", {"compute_capability": B200, "tokamax_installed": True},
     "grouped_impl 'tokamax' runs forward and backward on Hopper GPUs (sm90) only, this one is sm100 (tokamax "
     "0.0.17 has no kernel for the weight gradient there); use 'capacity' or 'ragged_dot'"),
    ("ragged_dot", "gpu", {"compute_capability": H100, "cudnn_version": (9, 10)},
     "grouped_impl 'ragged_dot' needs cuDNN >= 9.22 on GPU for XLA's grouped GEMM, this device has 9.10 (XLA "
     "would expand it into a dense matmul over every expert); use 'capacity' or 'tokamax'"),
    ("blocks", "cpu", {}, "unknown grouped_impl 'blocks'; choose from auto, capacity, ragged_dot, tokamax"),
])
def test_what_cannot_run_is_refused_in_one_line(name, platform, facts, line):
    with pytest.raises(ValueError) as e:
        grouped.resolve_grouped_impl(name, platform, **facts)
    assert str(e.value) == line and "\n" not in line


def test_a_bad_name_in_the_config_is_refused_in_one_line():
    with pytest.raises(ValueError) as e:
        ParallelismConfig(grouped_impl="cutlass")
    assert str(e.value) == "parallelism.unknown grouped_impl 'cutlass'; choose from auto, capacity, ragged_dot, tokamax"


def test_auto_on_this_machine_is_capacity_and_traced_for_cuda_too():
    """On the CPU, and when tracing for CUDA from this CPU host (no GPU to ask for its cuDNN or
    generation), "auto" is the bounded-buffer fallback."""
    assert grouped.default_impl() == "capacity"
    with lowering_for("cuda"):
        assert grouped.device_facts()["compute_capability"] is None
        assert grouped.default_impl() == "capacity"


def _tensor_shapes(text: str) -> set[tuple[int, ...]]:
    return {tuple(int(d) for d in m.split("x")) for m in re.findall(r"tensor<((?:\d+x)+)(?:f32|bf16)>", text)
            for m in [m.rstrip("x")]}


@pytest.mark.parametrize("expected_rows", [None, 40.0])
def test_capacity_buffers_are_the_planned_ones(expected_rows):
    """The capacity buffers the planner counts are the per-expert buffers [E, C, D] / [E, C, F] at the
    largest bucket that the CUDA-lowered program holds; the sorted implementations' are rows x width."""
    n, e, d, f = 96, 4, 16, 24
    rows = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((n,), jnp.int32)
    w = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((e, d, f), (e, d, f), (e, f, d))]

    def loss(rows, ids, *w):
        return jnp.sum(grouped.grouped_swiglu(rows, ids, *w, impl="capacity", expected_rows=expected_rows))

    with lowering_for("cuda"):
        text = jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4))).trace(rows, ids, *w).lower(
            lowering_platforms=("cuda",)).as_text()
    cap = max(grouped.capacity_buckets(n / e if expected_rows is None else expected_rows))
    shapes = _tensor_shapes(text)
    assert (e, cap, d) in shapes and (e, cap, f) in shapes
    bufs = grouped.grouped_buffers("capacity", n, e, d, f, 2, expected_rows=expected_rows)
    assert bufs["padding_rows"] == e * cap * (2 * d + 3 * f) * 2
    assert bufs["activations"] == n * 2 * f * 2 and bufs["workspace"] == 0
    for name in ("ragged_dot", "ragged"):
        b = grouped.grouped_buffers(name, n, e, d, f, 2)
        assert b["padding_rows"] == n * 2 * d * 2 and b["activations"] == n * 3 * f * 2
    tk = grouped.grouped_buffers("tokamax", n, e, d, f, 2)  # one row tile; 24 wide: padded to 64
    assert tk["activations"] == 128 * 3 * 64 * 2 and tk["workspace"] == 3 * e * d * 64 * 2
    assert grouped.grouped_buffers("tokamax", n, e, d, 128, 2)["workspace"] == 0
    with pytest.raises(ValueError, match="^grouped_buffers counts one implementation; resolve 'auto' first"):
        grouped.grouped_buffers("auto", n, e, d, f, 2)
