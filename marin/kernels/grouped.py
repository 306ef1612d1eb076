"""Grouped expert compute on one device: each row (or token) through the SwiGLU of its own expert.

    y[t] = sum_j weights[t, j] * SwiGLU_{expert_ids[t, j]}(x[t])

with the plain definition in :func:`marin.models.reference.moe_reference`; everything here computes
exactly that (no drops), faster. The transports (:mod:`marin.parallel.transports`) move tokens to
the device that holds their experts and call these on what arrives.

Three named implementations (`GROUPED_IMPLS`), one entry point (`grouped_swiglu`, and
`routed_experts` for one device's tokens):

  capacity    rows go into per-expert buffers [E, C, D] whose size C is picked at run time from
              static buckets (at most 2x the expected rows per expert; a busier expert takes
              several rounds), and the SwiGLU runs as batched matmuls over them: marin's CPU
              kernels on CPU, plain einsums on GPU / TPU. Runs everywhere; its waste is bounded by
              the buckets, never rows x experts.
  ragged_dot  rows sorted by expert, `jax.lax.ragged_dot` (XLA's grouped GEMM). On GPU XLA takes
              its cuDNN grouped-GEMM fusion only with cuDNN >= 9.22 (and its own gates for the
              weight gradient); otherwise it rewrites the op into a dense masked matmul over every
              expert (E times the memory and the work). On XLA:CPU it is always that dense matmul.
  tokamax     rows sorted by expert, `tokamax.ragged_dot` (openxla's kernel library, the `gpu`
              extra): its Pallas Mosaic GPU grouped GEMMs on Hopper. On CPU it runs tokamax's
              XLA implementation (equality tests only).

`resolve_grouped_impl` turns "auto" into one of them per platform (the rule is in docs/model.md)
and refuses an explicit choice the platform cannot run, in one line; `grouped_buffers` says what
each allocates per call, for the memory planner.

This lives in `marin.kernels`, not next to the model in `marin.models`, because the transports
(`marin.parallel`, a floor below `marin.models`) call it on what arrives, and a package imports only
from its own floor or below.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from marin.jaxcompat import compute_platform, sum_to_type_of, vary_like
from marin.kernels.cpu import swiglu_bwd, swiglu_fwd, swiglu_reference, use_kernel
from marin.kernels.names import GROUPED_IMPL_ALIASES, GROUPED_IMPLS, canonical_grouped_impl

CUDNN_GROUPED_GEMM = (9, 22)
"""The oldest cuDNN whose grouped GEMM XLA's GPU backend lowers `ragged_dot` to (the fusion is on by
default in XLA since openxla/xla PR #42313); with an older one XLA's RaggedDotRewriter makes the op a
dense masked matmul over every group."""

TOKAMAX_GPU_ARCHS = (9.0, 10.0)
"""The GPU compute capabilities [lo, hi) on which tokamax 0.0.17 runs the whole grouped SwiGLU,
forward and backward, on its Mosaic GPU kernels: Hopper (sm90). Its Blackwell (sm100) kernels have
no ragged-contracting form, which the weight gradient needs, so training there raises in tokamax."""


def _tokamax_installed() -> bool:
    return importlib.util.find_spec("tokamax") is not None


@functools.cache
def _local_gpu() -> tuple[float | None, tuple[int, int] | None]:
    """(compute capability, cuDNN (major, minor)) of this process's first GPU; None where unknown."""
    if jax.default_backend() != "gpu":
        return None, None
    device = jax.devices()[0]
    cc = getattr(device, "compute_capability", None)
    try:
        # jaxlib's own query of the loaded cuDNN (no public API, so asked only here); 9.22.0 reads 92200
        from jax._src.lib import cuda_versions

        v = cuda_versions.cudnn_get_version() if cuda_versions is not None else None
    except Exception:  # noqa: BLE001 - a jaxlib without the query: the version stays unknown
        v = None
    return (float(cc) if cc is not None else None), ((v // 10000, (v // 100) % 100) if v else None)


def device_facts() -> dict:
    """What `resolve_grouped_impl` needs to know about the platform being traced: this process's GPU
    when it is the one traced for, else nothing (lowering for CUDA from a CPU host: unknown)."""
    cc, cudnn = _local_gpu() if compute_platform() == "gpu" else (None, None)
    return {"compute_capability": cc, "cudnn_version": cudnn, "tokamax_installed": _tokamax_installed()}


def _version_str(v: tuple[int, int]) -> str:
    return ".".join(map(str, v))


def resolve_grouped_impl(requested: str, platform: str, *, compute_capability: float | None = None,
                         cudnn_version: tuple[int, int] | None = None, tokamax_installed: bool = False) -> str:
    """The grouped-compute implementation to run: ``requested`` ("auto" or a name of `GROUPED_IMPLS`)
    on ``platform`` ("cpu", "gpu" / "cuda", "tpu"). Pure: the device facts are arguments (None =
    unknown, e.g. lowering for CUDA from a CPU host); `device_facts()` reads them.

    "auto": capacity on CPU (XLA:CPU's ragged_dot is a dense matmul over every expert); tokamax on a
    Hopper GPU when it is installed; ragged_dot on TPU, and on a GPU whose cuDNN is known to be
    >= 9.22 (XLA's grouped GEMM); capacity otherwise (the fallback whose waste is bounded). An
    explicit name is returned as it is, or refused in one line (ValueError) naming what is missing."""
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    name = canonical_grouped_impl(requested)
    hopper = compute_capability is not None and TOKAMAX_GPU_ARCHS[0] <= compute_capability < TOKAMAX_GPU_ARCHS[1]
    cudnn_ok = cudnn_version is not None and tuple(cudnn_version) >= CUDNN_GROUPED_GEMM
    if name == "auto":
        if platform == "tpu":
            return "ragged_dot"
        if platform == "gpu":
            if tokamax_installed and hopper:
                return "tokamax"
            return "ragged_dot" if cudnn_ok else "capacity"
        return "capacity"
    if name == "tokamax":
        if not tokamax_installed:
            raise ValueError("grouped_impl 'tokamax' needs the tokamax package, which is not installed "
                             "(pip install 'marin[gpu]'); use 'capacity' or 'ragged_dot'")
        if platform == "gpu" and compute_capability is not None and not hopper:
            raise ValueError(f"grouped_impl 'tokamax' runs forward and backward on Hopper GPUs (sm90) only, "
                             f"this one is sm{compute_capability * 10:.0f} (tokamax 0.0.17 has no kernel for the "
                             f"weight gradient there); use 'capacity' or 'ragged_dot'")
    if name == "ragged_dot" and platform == "gpu" and cudnn_version is not None and not cudnn_ok:
        raise ValueError(f"grouped_impl 'ragged_dot' needs cuDNN >= {_version_str(CUDNN_GROUPED_GEMM)} on GPU for "
                         f"XLA's grouped GEMM, this device has {_version_str(cudnn_version)} (XLA would expand it "
                         f"into a dense matmul over every expert); use 'capacity' or 'tokamax'")
    return name


def chosen_impl(impl: str | None) -> str:
    """`resolve_grouped_impl` for the platform being traced (None = "auto")."""
    return resolve_grouped_impl(impl or "auto", compute_platform(), **device_facts())


def grouped_buffers(impl: str, rows: int, n_local_experts: int, d_model: int, d_ff: int, dtype_bytes: int,
                    expected_rows: float | None = None) -> dict[str, int]:
    """Bytes of the buffers one `grouped_swiglu` call of ``impl`` allocates beyond its input rows
    [rows, d_model] and output [rows, d_model], by what they are (for the memory planner; multiply
    by the layers whose buffers are live at once).

    ``expected_rows`` is the expected rows per local expert (default rows / n_local_experts), as
    `grouped_swiglu` takes it. Keys:
      padding_rows     capacity: the per-expert buffers [E, C, .] at the largest bucket C (the worst
                       case a step can pick): gathered input, gate / up / hidden activations and
                       output, 2 * d_model + 3 * d_ff per buffer row. Sorted implementations: the
                       rows sorted by expert and their output (2 * d_model per row; tokamax pads
                       the rows to a multiple of `TOKAMAX_ROW_MULTIPLE`).
      activations      the gate / up pre-activations kept in row order for the backward, and the
                       hidden activation: 3 * d_ff per row (capacity keeps 2: its hidden lives in
                       the buffers).
      index            the int32 sort and slot indices (a few per row).
      workspace        grouped-GEMM scratch beyond these: none for capacity (einsums over the
                       buffers), none counted for ragged_dot (cuDNN's workspace is XLA's choice and
                       shows only in the compiled program's memory analysis); for tokamax (its
                       Mosaic GPU kernels stage tiles in shared memory) the zero-padded copy of the
                       three local weights when d_ff is not a multiple of `TOKAMAX_WIDTH_MULTIPLE`.
    A dense fallback of ragged_dot (rows x experts x width) is not a buffer this plans: the
    compiled-memory check catches it."""
    name = canonical_grouped_impl(impl)
    if name == "auto":
        raise ValueError("grouped_buffers counts one implementation; resolve 'auto' first (resolve_grouped_impl)")
    e, d, f, b = n_local_experts, d_model, d_ff, dtype_bytes
    if name == "capacity":
        cap = max(capacity_buckets(rows / e if expected_rows is None else expected_rows))
        slots = e * cap
        return {"padding_rows": slots * (2 * d + 3 * f) * b, "activations": rows * 2 * f * b,
                "index": (3 * rows + slots) * 4, "workspace": 0}
    workspace = 0
    if name == "tokamax":  # padded to its kernels' tiles: rows, and the width with a copy of the weights
        rows = -(-rows // TOKAMAX_ROW_MULTIPLE) * TOKAMAX_ROW_MULTIPLE
        if f % TOKAMAX_WIDTH_MULTIPLE:
            f = -(-f // TOKAMAX_WIDTH_MULTIPLE) * TOKAMAX_WIDTH_MULTIPLE
            workspace = 3 * e * d * f * b
    return {"padding_rows": rows * 2 * d * b, "activations": rows * 3 * f * b, "index": 3 * rows * 4,
            "workspace": workspace}


def default_impl() -> str:
    """The grouped-compute implementation "auto" picks for the platform being traced."""
    return chosen_impl(None)


# ---- small pure helpers ---------------------------------------------------------------------
def rank_within_groups(group, n_groups: int, key=None):
    """For each element: its rank among the elements of the same group, ordered by (key, index).

    group int [N] in [0, n_groups]; the value n_groups is a "none" bucket. Returns (rank [N], counts
    [n_groups]). key, if given, is a non-negative int [N] with key * (n_groups + 1) fitting in int32."""
    n = group.shape[0]
    group = group.astype(jnp.int32)
    if key is None:
        perm = jnp.argsort(group, stable=True)
    else:
        kmax = jnp.max(key) + 1
        perm = jnp.argsort(group * kmax + key.astype(jnp.int32), stable=True)
    counts = jnp.zeros((n_groups + 1,), jnp.int32).at[group].add(1)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(n, dtype=jnp.int32) - starts[group[perm]]
    rank = jnp.zeros((n,), jnp.int32).at[perm].set(rank_sorted)
    return rank, counts[:n_groups]


def swiglu_experts(x, w_gate, w_up, w_down):
    """Batched per-expert SwiGLU: x [E, C, D] -> [E, C, D] (every row computed).

    With the CPU kernels, forward and backward are one kernel call each (a custom VJP). Elsewhere it
    is plain einsums under autodiff, so remat policies such as "dots" still see and save the dots."""
    if use_kernel(x, w_gate, w_up, w_down):
        return _swiglu_experts_kernel(x, w_gate, w_up, w_down)
    return swiglu_reference(x, w_gate, w_up, w_down)


@jax.custom_vjp
def _swiglu_experts_kernel(x, w_gate, w_up, w_down):
    return _swiglu_experts_fwd(x, w_gate, w_up, w_down)[0]


def _all_rows(x):
    return jnp.full((x.shape[0],), x.shape[1], jnp.int32)


def _swiglu_experts_fwd(x, w_gate, w_up, w_down):
    y, g, u = swiglu_fwd(x, w_gate, w_up, w_down, _all_rows(x))
    return y, (x, g, u, w_gate, w_up, w_down)


def _swiglu_experts_bwd(res, dy):
    x, g, u, w_gate, w_up, w_down = res
    ones = jnp.ones(x.shape[:2], x.dtype)  # no combine weight inside the block
    dx, _, dwg, dwu, dwd = swiglu_bwd(x, dy, ones, g, u, w_gate, w_up, w_down, _all_rows(x))
    return tuple(sum_to_type_of(ct, p) for ct, p in ((dx, x), (dwg, w_gate), (dwu, w_up), (dwd, w_down)))


_swiglu_experts_kernel.defvjp(_swiglu_experts_fwd, _swiglu_experts_bwd)


# ---- capacity-padded grouped SwiGLU (every platform) ---------------------------------------------
CAPACITY_BUCKETS = (1.125, 1.5, 2.0)
"""Per-expert buffer sizes, x the expected rows. Each is one branch of a ``lax.switch`` in the forward
and again in the backward, so each costs compile time in every MoE layer's program; the CPU kernel
skips a buffer's unfilled rows, so a coarser bucket costs little at run time. Three buckets instead
of eight cut a tiny model's train-step compile by about a fifth, and the round loop kept to the
largest bucket (:func:`_bucket_branches`) by as much again, at the same measured throughput."""


def capacity_buckets(expected_rows: float) -> tuple:
    """Static per-expert buffer sizes (multiples of 8) for `expected_rows` rows per expert."""
    return tuple(sorted({max(8, -(-math.ceil(f * expected_rows) // 8) * 8) for f in CAPACITY_BUCKETS}))


class _CapPlan(NamedTuple):
    """Where rows go in the capacity buffers: each row's rank within its expert, whether it has an
    expert, the rows per expert and the number of rounds (computed once, reused by the backward)."""

    rank: jax.Array
    valid: jax.Array
    counts: jax.Array
    n_rounds: jax.Array

    def slots(self, row_expert, n_exp: int, cap: int, r):
        """Buffer row (in [E * cap]) of each row in round r (rank in [r*cap, (r+1)*cap)); E*cap if not."""
        in_round = self.valid & (self.rank >= r * cap) & (self.rank < (r + 1) * cap)
        return jnp.where(in_round, row_expert * cap + self.rank - r * cap, n_exp * cap)

    def filled(self, cap: int, r):
        """Filled rows of each expert's buffer in round r (the rest is zero padding) [E]."""
        return jnp.clip(self.counts - r * cap, 0, cap)


def _slot_source(slot, n_slots):
    """The inverse map: for each buffer row, the input row that fills it (n = none -> zeros). An int
    scatter of N indices, so the activations move by gathers (XLA:CPU scatters rows slowly)."""
    n = slot.shape[0]
    return jnp.full((n_slots,), n, jnp.int32).at[slot].set(jnp.arange(n, dtype=jnp.int32), mode="drop")


def _to_buf(a, src):
    return jnp.take(a, src, axis=0, mode="fill", fill_value=0)


def _from_buf(buf, slot):
    return jnp.take(buf, slot, axis=0, mode="fill", fill_value=0)


def _sum_rounds(n_rounds, one_round, multi_round: bool = True):
    """The sum over rounds r < n_rounds (traced, >= 1) of one_round(r), a tuple of arrays; just
    one_round(0) when not multi_round (a branch that never needs a second round).

    Round 0 is peeled off the loop: in the usual one-round case nothing is zero-filled and nothing
    is accumulated (on XLA:CPU each of those is a full memory pass over [T*k, F]-sized arrays)."""
    if not multi_round:
        return one_round(0)

    def body(r, acc):
        return tuple(a + c for a, c in zip(acc, one_round(r)))

    return jax.lax.fori_loop(1, n_rounds, body, one_round(0))


def _bucket_branches(rounds_fn, buckets):
    """One ``lax.switch`` branch per bucket, ``rounds_fn(cap, multi_round, ...)``. Only the largest
    bucket's branch can need a second round (a smaller bucket is chosen only when it holds the busiest
    expert), so only it carries the round loop: each loop is another copy of the expert compute to
    compile."""
    return [partial(rounds_fn, c, i == len(buckets) - 1) for i, c in enumerate(buckets)]


def _cap_fwd_rounds(cap, multi_round, rows, row_expert, plan, w_gate, w_up, w_down):
    d = rows.shape[1]
    n_exp, _, f = w_gate.shape

    def one_round(r):
        slot, fill = plan.slots(row_expert, n_exp, cap, r), plan.filled(cap, r)
        xb = _to_buf(rows, _slot_source(slot, n_exp * cap)).reshape(n_exp, cap, d)
        yb, g, u = swiglu_fwd(xb, w_gate, w_up, w_down, fill)
        return tuple(_from_buf(a, slot) for a in (yb.reshape(-1, d), g.reshape(-1, f), u.reshape(-1, f)))

    return _sum_rounds(plan.n_rounds, one_round, multi_round)


def _cap_bwd_rounds(cap, multi_round, rows, row_expert, plan, w_gate, w_up, w_down, g_rows, u_rows, dy):
    d = rows.shape[1]
    n_exp, _, f = w_gate.shape

    def one_round(r):
        slot, fill = plan.slots(row_expert, n_exp, cap, r), plan.filled(cap, r)
        src = _slot_source(slot, n_exp * cap)
        xb, dyb = (_to_buf(a, src).reshape(n_exp, cap, d) for a in (rows, dy))
        g, u = (_to_buf(a, src).reshape(n_exp, cap, f) for a in (g_rows, u_rows))
        ones = jnp.ones((n_exp, cap), rows.dtype)  # a plain SwiGLU: every row's weight is 1
        dxb, _, dwg, dwu, dwd = swiglu_bwd(xb, dyb, ones, g, u, w_gate, w_up, w_down, fill)
        return _from_buf(dxb.reshape(-1, d), slot), dwg, dwu, dwd

    return _sum_rounds(plan.n_rounds, one_round, multi_round)


def _cap_plan(buckets, row_expert, n_exp) -> tuple[jax.Array, _CapPlan]:
    """The bucket index (which static buffer size) and the plan for filling it."""
    valid = row_expert < n_exp
    rank, counts = rank_within_groups(row_expert, n_exp)
    cmax = jnp.max(counts)
    caps = jnp.array(buckets, jnp.int32)
    idx = jnp.minimum(jnp.sum(cmax > caps), len(buckets) - 1)
    n_rounds = (cmax + caps[idx] - 1) // caps[idx]  # 1 unless cmax exceeds the largest bucket
    return idx, _CapPlan(rank, valid, counts, n_rounds)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def capacity_swiglu(buckets, rows, row_expert, w_gate, w_up, w_down):
    """Grouped SwiGLU as batched matmuls over per-expert buffers [E, C, D] (exact, dropless).

    C is the smallest of the static `buckets` that holds the busiest expert (chosen at run time by
    lax.switch; padding rows are zero); if none does, the largest bucket is used for several rounds
    (round r takes each expert's rows of rank [r*C, (r+1)*C)). The custom VJP keeps the gate/up
    pre-activations in row order (one shape for every bucket) and reuses the forward's sort."""
    return _capacity_fwd(buckets, rows, row_expert, w_gate, w_up, w_down)[0]


def _capacity_fwd(buckets, rows, row_expert, w_gate, w_up, w_down):
    n_exp = w_gate.shape[0]
    row_expert = row_expert.astype(jnp.int32)
    idx, plan = _cap_plan(buckets, row_expert, n_exp)
    branches = _bucket_branches(_cap_fwd_rounds, buckets)
    y, g_rows, u_rows = jax.lax.switch(idx, branches, rows, row_expert, plan, w_gate, w_up, w_down)
    return y, (rows, row_expert, plan, idx, w_gate, w_up, w_down, g_rows, u_rows)


def _capacity_bwd(buckets, res, dy):
    rows, row_expert, plan, idx, w_gate, w_up, w_down, g_rows, u_rows = res
    branches = _bucket_branches(_cap_bwd_rounds, buckets)
    dx, dwg, dwu, dwd = jax.lax.switch(idx, branches, rows, row_expert, plan, w_gate, w_up, w_down,
                                       g_rows, u_rows, dy)
    return (sum_to_type_of(dx, rows), None, sum_to_type_of(dwg, w_gate), sum_to_type_of(dwu, w_up),
            sum_to_type_of(dwd, w_down))


capacity_swiglu.defvjp(_capacity_fwd, _capacity_bwd)


# ---- grouped SwiGLU: rows with an expert id each (the EP receivers) ----------------------------
def _tokamax_call(lhs, rhs, group_sizes, dims=None):
    """`tokamax.ragged_dot_general` on the kernels of the platform being traced: Mosaic GPU on a GPU,
    Mosaic TPU on a TPU, tokamax's XLA implementation on CPU. One named implementation, not tokamax's
    own fallback list, whose last entry is XLA's ragged_dot (the dense expansion this exists to avoid)."""
    import tokamax  # the `gpu` extra; imported here so marin runs without it (resolve refuses first)

    kernels = {"gpu": "mosaic_gpu", "tpu": "mosaic", "cpu": "xla"}[compute_platform()]
    dims = dims or jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [1]), ([], [])),
                                                     lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    return tokamax.ragged_dot_general(lhs, rhs, group_sizes, dims, implementation=kernels)


# dW[g] = lhs[rows of g]^T @ dout[rows of g]: the rows dimension is both ragged and contracted
_WEIGHT_GRAD_DIMS = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                                      lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


@jax.custom_vjp
def _tokamax_ragged_dot(lhs, rhs, group_sizes):
    """lhs [N, K] (rows sorted by group), rhs [G, K, M], group_sizes [G] -> [N, M] on tokamax's kernels.

    Its own VJP, with tokamax's kernels for both gradients: tokamax's Mosaic GPU kernels return
    results that are not typed as varying over shard_map's mesh axes, which tokamax's own VJP then
    refuses inside the transports' shard_map; here each result takes its operand's type."""
    return vary_like(_tokamax_call(lhs, rhs, group_sizes), lhs, rhs)


def _tokamax_ragged_dot_fwd(lhs, rhs, group_sizes):
    return _tokamax_ragged_dot(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _tokamax_ragged_dot_bwd(res, dout):
    lhs, rhs, group_sizes = res
    dlhs = _tokamax_call(dout, jnp.swapaxes(rhs, 1, 2), group_sizes).astype(lhs.dtype)  # [N, K]
    drhs = _tokamax_call(lhs, dout, group_sizes, _WEIGHT_GRAD_DIMS).astype(rhs.dtype)  # [G, K, M]
    return vary_like(dlhs, lhs), sum_to_type_of(vary_like(drhs, lhs, dout), rhs), None


_tokamax_ragged_dot.defvjp(_tokamax_ragged_dot_fwd, _tokamax_ragged_dot_bwd)


TOKAMAX_ROW_MULTIPLE = 128
"""tokamax's Mosaic GPU kernels refuse a row count that is not a multiple of their tiles (8 in the
forward, 64 as the weight gradient's contracting dimension; a capacity-bounded chunk buffer has e.g.
1,178 rows): the rows are padded with skipped ones to a multiple of 128, its largest row tile."""

TOKAMAX_WIDTH_MULTIPLE = 64
"""...and an expert width that is not a multiple of 64 (the hero's experts are stored 3,080 wide, 11 x
280, for its 11-rack sharding): the weights are padded with zero columns (gate, up) and rows (down),
which add zeros to every output and take no gradient."""


def _sorted_swiglu(rows, row_expert, w_gate, w_up, w_down, ragged_dot, row_multiple: int = 1,
                   width_multiple: int = 1):
    """The grouped SwiGLU on rows sorted by expert, `ragged_dot(lhs [N, K], rhs [E, K, M], counts)`
    for the three matmuls. Rows past the last group (skipped rows) are masked to zero between the
    matmuls, so a kernel that leaves them unwritten cannot leak into the output or the gradients.
    The rows are padded with skipped ones to a multiple of ``row_multiple``, the expert width with
    zero weights to a multiple of ``width_multiple``."""
    n_exp = w_gate.shape[0]
    n = rows.shape[0]
    pad = -n % row_multiple
    if pad:
        rows = jnp.pad(rows, ((0, pad), (0, 0)))
        row_expert = jnp.pad(row_expert, (0, pad), constant_values=n_exp)
    wpad = -w_gate.shape[2] % width_multiple
    if wpad:
        w_gate, w_up = (jnp.pad(w, ((0, 0), (0, 0), (0, wpad))) for w in (w_gate, w_up))
        w_down = jnp.pad(w_down, ((0, 0), (0, wpad), (0, 0)))
    valid = row_expert < n_exp
    perm = jnp.argsort(row_expert, stable=True)
    counts = jnp.zeros((n_exp + 1,), jnp.int32).at[row_expert].add(1)[:n_exp]
    xs = rows[perm]
    in_group = valid[perm][:, None]
    g = ragged_dot(xs, w_gate, counts)
    u = ragged_dot(xs, w_up, counts)
    h = jnp.where(in_group, jax.nn.silu(g) * u, 0)
    ys = jnp.where(in_group, ragged_dot(h, w_down, counts), 0)
    return jnp.zeros_like(ys).at[perm].set(ys)[:n]


def grouped_swiglu(rows, row_expert, w_gate, w_up, w_down, impl: str | None = None,
                   expected_rows: float | None = None):
    """rows [N, D]; row_expert int [N] in [0, E] (E = skip the row). Returns [N, D], 0 for skipped.

    impl (None = "auto", see `resolve_grouped_impl`):
      "capacity"    `capacity_swiglu`, batched matmuls over per-expert buffers sized from
                    `expected_rows` per expert (default N / E; pass the real expectation when most
                    rows are skipped, e.g. a worst-case receive buffer).
      "ragged_dot"  jax.lax.ragged_dot on rows sorted by expert (XLA's grouped GEMM).
      "tokamax"     tokamax.ragged_dot on rows sorted by expert (its Mosaic GPU kernels).
    """
    impl = chosen_impl(impl)
    n_exp = w_gate.shape[0]
    row_expert = row_expert.astype(jnp.int32)
    if impl == "capacity":
        expected = rows.shape[0] / n_exp if expected_rows is None else expected_rows
        return capacity_swiglu(capacity_buckets(expected), rows, row_expert, w_gate, w_up, w_down)
    if impl == "ragged_dot":
        return _sorted_swiglu(rows, row_expert, w_gate, w_up, w_down, jax.lax.ragged_dot)
    return _sorted_swiglu(rows, row_expert, w_gate, w_up, w_down, _tokamax_ragged_dot, TOKAMAX_ROW_MULTIPLE,
                          TOKAMAX_WIDTH_MULTIPLE)


def combine(y_assign, weights):
    """y_assign [T*k, D] in (token, slot) order, weights [T, k] -> [T, D]."""
    t, k = weights.shape
    # elementwise multiply + sum: a "tkd,tk->td" einsum becomes T tiny batched dots on CPU
    return jnp.sum(y_assign.reshape(t, k, -1) * weights.astype(y_assign.dtype)[:, :, None], axis=1)


# ---- fused routed path (capacity buffers filled from the tokens; weighted combine) --------------
def _fused_fwd_rounds(cap, multi_round, x, weights, flat, plan, w_gate, w_up, w_down):
    t, k = weights.shape
    d = x.shape[1]
    n_exp, _, f = w_gate.shape

    def one_round(r):
        slot, fill = plan.slots(flat, n_exp, cap, r), plan.filled(cap, r)
        src = _slot_source(slot, n_exp * cap)  # assignment index per buffer row (t*k = none)
        xb = jnp.take(x, src // k, axis=0, mode="fill", fill_value=0).reshape(n_exp, cap, d)
        yb, g, u = swiglu_fwd(xb, w_gate, w_up, w_down, fill)
        ya = _from_buf(yb.reshape(-1, d), slot).reshape(t, k, d)
        y = jnp.sum(ya * weights[:, :, None], axis=1)
        return y, _from_buf(g.reshape(-1, f), slot), _from_buf(u.reshape(-1, f), slot)

    return _sum_rounds(plan.n_rounds, one_round, multi_round)


def _fused_bwd_rounds(cap, multi_round, x, weights, flat, plan, w_gate, w_up, w_down, g_rows, u_rows, dy):
    t, k = weights.shape
    d = x.shape[1]
    n_exp, _, f = w_gate.shape
    wflat = weights.reshape(-1)

    def one_round(r):
        slot, fill = plan.slots(flat, n_exp, cap, r), plan.filled(cap, r)
        src = _slot_source(slot, n_exp * cap)
        tok = src // k
        xb = jnp.take(x, tok, axis=0, mode="fill", fill_value=0).reshape(n_exp, cap, d)
        dyb = jnp.take(dy, tok, axis=0, mode="fill", fill_value=0).reshape(n_exp, cap, d)
        wb = jnp.take(wflat, src, axis=0, mode="fill", fill_value=0).reshape(n_exp, cap)
        g, u = (_to_buf(a, src).reshape(n_exp, cap, f) for a in (g_rows, u_rows))
        dxb, dwb, dwg, dwu, dwd = swiglu_bwd(xb, dyb, wb, g, u, w_gate, w_up, w_down, fill)
        dwt = _from_buf(dwb.reshape(-1), slot)  # d combine weight of each assignment
        dx = jnp.sum(_from_buf(dxb.reshape(-1, d), slot).reshape(t, k, d), axis=1)
        return dx, dwt, dwg, dwu, dwd

    return _sum_rounds(plan.n_rounds, one_round, multi_round)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def capacity_moe(buckets, x, expert_ids, weights, w_gate, w_up, w_down):
    """y [T, D] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) over capacity buffers (exact, dropless).

    The whole routed path in one custom VJP: the per-expert buffers are filled straight from the
    tokens x [T, D] by one gather (no [T*k, D] repeat), the combine is fused with the gather back,
    and the backward reuses the same indices (gathers, no scatters of rows)."""
    return _capacity_moe_fwd(buckets, x, expert_ids, weights, w_gate, w_up, w_down)[0]


def _capacity_moe_fwd(buckets, x, expert_ids, weights, w_gate, w_up, w_down):
    n_exp = w_gate.shape[0]
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    idx, plan = _cap_plan(buckets, flat, n_exp)
    branches = _bucket_branches(_fused_fwd_rounds, buckets)
    y, g_rows, u_rows = jax.lax.switch(idx, branches, x, weights, flat, plan, w_gate, w_up, w_down)
    return y, (x, weights, flat, plan, idx, w_gate, w_up, w_down, g_rows, u_rows)


def _capacity_moe_bwd(buckets, res, dy):
    x, weights, flat, plan, idx, w_gate, w_up, w_down, g_rows, u_rows = res
    branches = _bucket_branches(_fused_bwd_rounds, buckets)
    dx, dwt, dwg, dwu, dwd = jax.lax.switch(idx, branches, x, weights, flat, plan, w_gate, w_up, w_down,
                                            g_rows, u_rows, dy)
    return (sum_to_type_of(dx, x), None, sum_to_type_of(dwt.reshape(weights.shape), weights),
            sum_to_type_of(dwg, w_gate), sum_to_type_of(dwu, w_up), sum_to_type_of(dwd, w_down))


capacity_moe.defvjp(_capacity_moe_fwd, _capacity_moe_bwd)


# ---- one device's routed experts ------------------------------------------------------------
def routed_experts(x, expert_ids, weights, experts, impl: str | None = None):
    """The routed experts of one device's tokens: x [T, D], expert_ids int [T, k], weights [T, k],
    experts {"gate", "up", "down"} [E, ...] -> y [T, D] (every assignment computed).

    impl "capacity": `capacity_moe`, one custom VJP from the tokens to the combined output; the
    sorted implementations ("ragged_dot", "tokamax"): the assignments repeated per slot,
    `grouped_swiglu`, weighted combine. None = "auto" (`resolve_grouped_impl`)."""
    impl = chosen_impl(impl)
    t, k = expert_ids.shape
    gate, up, down = experts["gate"], experts["up"], experts["down"]
    if impl == "capacity":
        return capacity_moe(capacity_buckets(t * k / gate.shape[0]), x, expert_ids, weights.astype(x.dtype),
                            gate, up, down)
    y = grouped_swiglu(jnp.repeat(x, k, axis=0), expert_ids.reshape(-1), gate, up, down, impl)
    return combine(y, weights)


__all__ = [
    "CUDNN_GROUPED_GEMM",
    "GROUPED_IMPLS",
    "GROUPED_IMPL_ALIASES",
    "TOKAMAX_GPU_ARCHS",
    "capacity_buckets",
    "capacity_moe",
    "capacity_swiglu",
    "combine",
    "chosen_impl",
    "default_impl",
    "device_facts",
    "grouped_buffers",
    "grouped_swiglu",
    "rank_within_groups",
    "resolve_grouped_impl",
    "routed_experts",
    "swiglu_experts",
]
