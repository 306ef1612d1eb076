"""Memory and compute planning for a training step: will it fit, and what will it cost?

Pure Python (no JAX): ``marin plan``, experiment files at declaration time and the trainer all call
it cheaply. Per device, in bytes, for one optimizer step of ``tokens_per_step`` tokens at one
sequence length split into ``microbatches`` (gradient accumulation):

    params           compute-dtype working copies of the weights (bf16 runs: the embedding and head
                     once, the stacked block weights once; float32 runs compute on the masters)
    master_weights   float32 parameters (the training state)
    grads            float32 gradients (twice with accumulation: the running sum + one microbatch)
    optimizer_state  the optimizer's state, float32, leaf by leaf by its group (marin.training.optimizers):
                     AdamW two moments per parameter; MuonH one momentum buffer for its matrices and
                     two Adam moments for the LM head, the embedding, the router and the gains
    optimizer_workspace  MuonH only: the Newton-Schulz temporaries of the largest matrix group, one
                     layer at a time (its Gram matrices and iterates) plus the orthogonalised
                     direction of that leaf and its hyperball step
    activations      what the backward pass keeps per layer under the preset's remat policy, for all
                     layers of one microbatch, plus one layer's recomputation workspace
    all_to_all       one layer's EP buffers: send, receive and return buffers sized by the transport
                     (capacity factor for "fixed", the worst case for "dropless" and "ragged"; for
                     "ragged_capacity" the t * k assignments out and back and one chunk's pooled
                     receive buffer) and the routed experts' intermediates over those rows; on CPU
                     pools the ragged transports also hold the emulated collective's worst-case blocks
    logits           float32 logits of one microbatch (their gradient is computed in place)
    grouped          the routed experts' grouped compute (marin.kernels.grouped), one call at a time
                     (one layer, one chunk): what its implementation allocates beyond the rows in
                     and out. "capacity": per-expert buffers [E, C, .] at the largest bucket C (at
                     most 2x the expected rows per expert, a multiple of 8) for the input, gate, up,
                     hidden and output, and its int32 slot indices; "ragged_dot" and "tokamax": the
                     rows sorted by expert and their output, and the sort's indices. A dense
                     fallback of ragged_dot (rows x experts x width, what XLA:CPU always does and
                     XLA:GPU does below cuDNN 9.22) is not planned: the compiled step's own memory
                     analysis is held against this plan before the first step
                     (marin.training.compiled_memory) and refuses it. The fixed transport's
                     receivers compute over its own per-expert buffers: 0 here.

    gathered         fsdp only: the weights the step gathers where it uses them and their whole float32
                     gradients before the reduce-scatter, for one layer (inside the layer scan) and
                     for the larger of the embedding and the head

Sharding follows marin.parallel.layout, leaf by leaf: under "replicated" routed-expert weights (and
their moments) split over the expert axis and everything else is replicated; under "fsdp" weight
matrices split over the mesh too; tokens split over data x expert. Dense attention materialises the
full [L, L] score matrix per head (local layers mask it), so it is counted at L keys per query;
blocked attention keeps only its output and a log-normaliser per query, and holds block x block score
tiles while it runs (counted once per microbatch, at block^2 / L keys per query). The model is
approximate: XLA's buffer reuse and fusion decide the real peak.

Per host, in bytes (``host_plan``), against the pool's host memory:

    resident_state       state held in host memory: on CPU pools the devices are host memory, so the
                         host's devices' whole step; on GPU pools nothing (the state lives on the
                         devices, created there by the sharded init and restored there shard by shard)
    checkpoint_staging   the state shards this host writes, copied to host memory while the save is
                         written in the background (one save in flight): exactly one replica of each
                         shard is written, by the host whose device holds replica 0 of it
    data_buffers         this host's rows of one batch (tokens and segment ids, int32), twice (the
                         batch being placed and the next one)
    runtime              a fixed allowance for the Python process, the XLA runtime and its pinned buffers
tests/training/test_planning.py holds the model to within 15% of ``compiled.memory_analysis()`` of
the same step on CPU (within 10% for each grouped implementation that runs its own algorithm
there); docs/training.md lists where it is known to be rough.
"""

from __future__ import annotations

import math
import os
from typing import Any

from marin.kernels.names import GROUPED_IMPLS, canonical_grouped_impl
from marin.models.config import (
    TRANSPORTS,
    MoEConfig,
    flops_per_token,
    mean_attended_keys,
    mean_flops_per_token,
    param_shapes,
)
from marin.models.params import role_of
from marin.parallel.capacity import (
    DROPPING_TRANSPORTS,
    buffer_rows_per_token,
    check_expert_chunks,
    chunk_capacity,
    emulated_ragged_rows_per_token,
    send_capacity,
)
from marin.parallel.layout import (
    EXPERT,
    check_param_sharding,
    leaf_partition,
    shard_shape,
)
from marin.parallel.roles import EXPERT_STACK
from marin.pools import ACCELERATOR_MEMORY_BYTES, POOLS, PoolSpec
from marin.textfmt import format_bytes, format_table, parse_bytes
from marin.training.config import model_at
from marin.training.metrics import peak_flops_per_device
from marin.training.optimizers import AdamWConfig

GiB = 1 << 30

# Memory one device offers, bytes (what nvidia-smi reports for the part; the inventory in
# marin/pools/pools.toml), and the share of it the training step may plan on: XLA's allocator
# needs headroom for fragmentation and the runtime. JAX preallocates XLA_PYTHON_CLIENT_MEM_FRACTION
# (0.75 by default) of the device: production images set it to 0.90 (infra/Dockerfile).
DEVICE_MEMORY_BYTES: dict[str, int] = ACCELERATOR_MEMORY_BYTES
USABLE_FRACTION = 0.90
DEFAULT_MFU = 0.21  # observed on the hero run after warm-up
PARTS = ("params", "master_weights", "grads", "optimizer_state", "optimizer_workspace", "gathered",
         "activations", "all_to_all", "grouped", "logits", "context_parallel")
STATE_PARTS = ("master_weights", "optimizer_state")
"""The parts that are the step's arguments (the training state, donated and updated in place); the
rest are the compiled program's temporaries, which the pre-step check holds against
``compiled.memory_analysis().temp_size_in_bytes``."""


# Of host memory the training process may plan on (the OS, agents and page cache keep the rest).
HOST_USABLE_FRACTION = 0.90
HOST_RUNTIME_BYTES = {"cpu": 2 * GiB}  # per host process: Python, XLA runtime, compiled programs
HOST_RUNTIME_BYTES_GPU = 32 * GiB  # GPU hosts: also the CUDA context and pinned transfer buffers of 4 GPUs
STORAGE_WRITE_BYTES_PER_S = 1.0e9  # per host, to an object store (a few parallel streams); --storage-gbps overrides
HOST_PARTS = ("resident_state", "checkpoint_staging", "data_buffers", "runtime")


class StorageQuotaExceeded(ValueError):
    """A run's checkpoints would exceed ``checkpoint.storage_quota`` at their peak (refused before launch)."""


class StepDoesNotFit(ValueError):
    """A training step needs more memory per device than its pool offers (the message has the table)."""


def cpu_device_memory_bytes(devices_per_host: int) -> int:
    """Host RAM shared by a CPU pool's fake devices (one process holds them all)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 * GiB
    return int(total // max(1, devices_per_host))


def host_memory_bytes(pool: PoolSpec) -> int:
    """Host memory of one host of ``pool``: its spec's, or this machine's for the local CPU pools."""
    if pool.host_memory_bytes is not None:
        return int(pool.host_memory_bytes)
    return cpu_device_memory_bytes(1)


def device_memory_bytes(pool: PoolSpec) -> int:
    if pool.device_memory_bytes is not None:
        return int(pool.device_memory_bytes)
    if pool.is_cpu:
        return cpu_device_memory_bytes(pool.devices_per_host)
    try:
        return DEVICE_MEMORY_BYTES[pool.accelerator]
    except KeyError:
        raise KeyError(f"no device memory known for accelerator {pool.accelerator!r}; "
                       f"known: {sorted(DEVICE_MEMORY_BYTES)}") from None


# ---- memory ----------------------------------------------------------------------------------
def params_per_device(cfg: MoEConfig, mesh_shape: tuple[int, int], param_sharding: str = "replicated"
                      ) -> dict[str, float]:
    """Parameters one device holds, leaf by leaf under the mesh's sharding rule
    (marin.parallel.layout.leaf_partition), and the working set the step gathers from them.

    ``total``: the device's shards of every leaf (its master weights; AdamW moments and gradients
    have the same shapes). ``layer_gathered``: one layer's weights as the layer uses them (dense
    leaves whole; routed experts whole over "data", still split over "expert" by the EP shard_map);
    ``embed_head_gathered``: the larger of the embedding and the head whole (one end of the network
    at a time: the embedding's gradient is made after the head's is reduced). Under "replicated" nothing is gathered
    (both are 0), so only "fsdp" steps pay the transient."""
    data, expert = mesh_shape
    total = routed = embed_head = 0.0
    layer_gathered = embed_head_full = 0.0
    for key, shape in param_shapes(cfg).items():
        experts = role_of(key) == EXPERT_STACK
        stacked = key.startswith("blocks/")
        part = leaf_partition(role_of(key), shape, mesh_shape, param_sharding, stacked)
        n = math.prod(shard_shape(shape, part, mesh_shape))
        total += n
        if experts:
            routed += n
        if not stacked:
            embed_head += n
        # what the step gathers: fsdp's extra splits (an expert leaf keeps its "expert" split)
        if part != (_expert_only(part) if experts else (None,) * len(part)):
            if stacked:
                per_layer = math.prod(shape[1:])
                layer_gathered += per_layer / expert if experts else per_layer
            else:  # the embedding is used (and its gradient made) at one end, the head at the other
                embed_head_full = max(embed_head_full, math.prod(shape))
    return {"total": total, "routed": routed, "replicated": total - routed, "embed_head": embed_head,
            "layer_gathered": layer_gathered, "embed_head_gathered": embed_head_full}


def default_optimizer(optimizer: Any = None) -> Any:
    """The optimizer a plan is for: ``optimizer``, or AdamW at its defaults (what a run gets by default)."""
    return optimizer if optimizer is not None else AdamWConfig()


def optimizer_bytes_per_device(cfg: MoEConfig, mesh_shape: tuple[int, int], param_sharding: str = "replicated",
                               optimizer: Any = None) -> dict[str, float]:
    """Per-device bytes of the optimizer, leaf by leaf under the mesh's sharding rule.

    ``state``: each leaf's shard x its group's state bytes per element (``STATE_BYTES``: AdamW 8;
    MuonH 4 for its matrices, 8 for the Adam groups). ``workspace``: for the Newton-Schulz groups,
    the largest leaf's temporaries: the orthogonalised direction and the hyperball's step over the
    whole shard (2 x 4 bytes per element), and one layer's iteration (``lax.map`` over the layers):
    per matrix this device holds (its experts, for a routed stack), three float32 m x m Gram
    products (m the matrix's smaller side: XLA reduces a sharded Gram matrix to a whole one) and
    three iterates of the layer's shard."""
    opt = default_optimizer(optimizer)
    state = workspace = 0.0
    for key, shape in param_shapes(cfg).items():
        stacked = key.startswith("blocks/")
        part = leaf_partition(role_of(key), shape, mesh_shape, param_sharding, stacked)
        local = shard_shape(shape, part, mesh_shape)
        n = math.prod(local)
        state += n * opt.state_bytes(key, shape)
        if opt.leaf_group(key, shape) in opt.NEWTON_SCHULZ_GROUPS and len(shape) >= 2:
            layers = shape[0] if stacked and len(shape) >= 3 else 1
            matrices = math.prod(local[1:-2]) if stacked and len(shape) >= 3 else 1  # this device's experts
            m = min(shape[-2], shape[-1])
            workspace = max(workspace, 4.0 * (2 * n + 3 * matrices * m * m + 3 * n / layers))
    return {"state": state, "workspace": workspace}


def _expert_only(part) -> tuple:
    """The partition the EP shard_map takes expert weights in: the expert axis only."""
    return tuple(EXPERT if axes == EXPERT else None for axes in part)


def _bytes(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else 4


def expert_rows_per_token(cfg: MoEConfig, transport: str, ep: int, tokens_per_shard: int) -> dict[str, float]:
    """Rows per local token in the EP buffers: sent/returned rows and the rows the experts compute
    (the transports' own capacities, :mod:`marin.parallel.capacity`)."""
    return buffer_rows_per_token(transport, tokens_per_shard, cfg.top_k, cfg.n_experts, ep, cfg.capacity_factor,
                                 cfg.expert_chunks)


# ---- grouped expert compute: which implementation, and its buffers --------------------------------
ACCELERATOR_COMPUTE_CAPABILITY: dict[str, float] = {"H100": 9.0, "H200": 9.0, "B200": 10.0, "GB200": 10.0}
"""CUDA compute capability of each GPU marin knows (NVIDIA's CUDA GPU list: Hopper 9.0, Blackwell
10.0): what the grouped-compute rule needs to know of a pool it is not running on."""
TOKAMAX_ARCHS = (9.0, 10.0)
"""Compute capabilities [lo, hi) on which tokamax runs the grouped SwiGLU forward and backward (Hopper)."""
CAPACITY_LARGEST_BUCKET = 2.0
"""The ``capacity`` implementation's largest per-expert buffer, x the expected rows per expert (its
buffers are picked per call from static buckets up to this; rounded up to a multiple of 8 rows)."""
TOKAMAX_ROW_MULTIPLE = 128
"""tokamax's rows are padded (with skipped rows) to a multiple of its kernels' largest row tile."""
TOKAMAX_WIDTH_MULTIPLE = 64
"""tokamax's expert width is padded (with zero weights, a copy of the three local weights) to this."""


def pool_grouped_impl(requested: str, pool: PoolSpec) -> str:
    """The grouped-compute implementation a run asking for ``requested`` gets on ``pool``: the
    per-platform rule of :func:`marin.kernels.grouped.resolve_grouped_impl` with the facts of the
    pool's accelerator and of the ``gpu`` extra's stack (tokamax installed, cuDNN at its floor), so a
    plan made on a laptop names what the pool's devices will run. "auto": capacity on CPU, tokamax
    on Hopper, ragged_dot on Blackwell (XLA's cuDNN grouped GEMM), capacity on a GPU marin does not
    know; an explicit name is kept."""
    name = canonical_grouped_impl(requested)
    if name != "auto":
        return name
    if pool.is_cpu:
        return "capacity"
    cc = ACCELERATOR_COMPUTE_CAPABILITY.get(pool.accelerator)
    if cc is None:
        return "capacity"
    # Hopper: tokamax's kernels; Blackwell: XLA's grouped GEMM (the extra pins cuDNN >= 9.22)
    return "tokamax" if TOKAMAX_ARCHS[0] <= cc < TOKAMAX_ARCHS[1] else "ragged_dot"


def grouped_call(cfg: MoEConfig, transport: str, ep: int, tokens_per_shard: int) -> dict[str, float] | None:
    """The grouped-compute call of one MoE layer of ``transport`` on one device (the largest, for a
    transport that runs several one after the other): ``rows`` it receives (skipped rows included),
    ``experts`` it groups them over and ``expected_rows`` per expert, as
    :mod:`marin.parallel.transports` calls :func:`marin.kernels.grouped.grouped_swiglu`. None for
    ``fixed``, whose receivers multiply their own per-expert buffers."""
    t, k, n_exp = max(1, tokens_per_shard), cfg.top_k, cfg.n_experts
    if transport == "fixed":
        return None
    if transport == "local":  # every expert on the device's own assignments
        return {"rows": float(t * k), "experts": float(n_exp), "expected_rows": t * k / n_exp}
    e_loc = n_exp // ep
    expected = ep * t * k / n_exp
    if transport == "ragged_capacity":  # one chunk's pooled buffer at a time
        per_chunk = check_expert_chunks(n_exp, ep, cfg.expert_chunks)
        cap = chunk_capacity(t, k, n_exp, ep, cfg.capacity_factor, cfg.expert_chunks)
        return {"rows": float(cap), "experts": float(per_chunk), "expected_rows": cap / per_chunk}
    if transport == "ragged":  # the worst-case receive buffer
        return {"rows": float(ep * t * min(k, e_loc)), "experts": float(e_loc), "expected_rows": expected}
    # dropless: the worst-case all_to_all buffer
    return {"rows": float(ep * send_capacity(t, k, n_exp, ep, None)), "experts": float(e_loc),
            "expected_rows": expected}


def grouped_buffer_bytes(impl: str, rows: float, experts: float, d_model: int, d_ff: int, dtype_bytes: int,
                         expected_rows: float | None = None) -> dict[str, float]:
    """Bytes one grouped-compute call of ``impl`` allocates beyond its rows in and out and the values
    the backward keeps (which the activations count), by what they are; ``total`` is their sum.
    The same count as :func:`marin.kernels.grouped.grouped_buffers` (a test holds them equal), here
    without JAX so that ``marin plan`` and experiment files stay cheap.

    ``padding_rows``: capacity's per-expert buffers [E, C, .] at the largest bucket (input, gate,
    up, hidden and output: 2 d + 3 f per buffer row); the sorted implementations' rows sorted by
    expert and their output (2 d per row; tokamax's rows padded to its row tile). ``index``: int32
    sort and slot indices. ``workspace``: tokamax's zero-padded copy of the three local weights when
    the width is not a multiple of its tile; none else (capacity multiplies its buffers; cuDNN's
    scratch is XLA's choice and shows in the compiled program's analysis)."""
    name = canonical_grouped_impl(impl)
    if name not in GROUPED_IMPLS:
        raise ValueError(f"grouped_buffer_bytes counts one implementation ({', '.join(GROUPED_IMPLS)}), "
                         f"not {impl!r}: resolve 'auto' first (pool_grouped_impl)")
    e, d, f, b = experts, d_model, d_ff, dtype_bytes
    if name == "capacity":
        expected = rows / e if expected_rows is None else expected_rows
        cap = max(8, -(-math.ceil(CAPACITY_LARGEST_BUCKET * expected) // 8) * 8)
        slots = e * cap
        out = {"padding_rows": slots * (2 * d + 3 * f) * b, "index": (3 * rows + slots) * 4, "workspace": 0.0}
    else:
        workspace = 0.0
        if name == "tokamax":  # padded to its kernels' tiles: the rows, and the width with a copy of the weights
            rows = -(-rows // TOKAMAX_ROW_MULTIPLE) * TOKAMAX_ROW_MULTIPLE
            if f % TOKAMAX_WIDTH_MULTIPLE:
                workspace = 3 * e * d * (-(-f // TOKAMAX_WIDTH_MULTIPLE) * TOKAMAX_WIDTH_MULTIPLE) * b
        out = {"padding_rows": rows * 2 * d * b, "index": 3 * rows * 4, "workspace": workspace}
    out["total"] = sum(out.values())
    return out


def grouped_bytes(cfg: MoEConfig, transport: str, ep: int, tokens_per_shard: int, impl: str) -> float:
    """The plan's ``grouped`` part: :func:`grouped_buffer_bytes` of one layer's call (0 for ``fixed``)."""
    call = grouped_call(cfg, transport, ep, tokens_per_shard)
    if call is None:
        return 0.0
    return grouped_buffer_bytes(impl, call["rows"], call["experts"], cfg.latent_dim, cfg.stored_expert_width,
                                _bytes(cfg.dtype), call["expected_rows"])["total"]


def activation_bytes_per_token_layer(cfg: MoEConfig, seq_len: int, rows: float) -> dict[str, float]:
    """Bytes per token and layer of the forward values, grouped by what a remat policy keeps.

    ``dots_nobatch``: outputs of matmuls without batch dimensions (projections, shared experts,
    router); ``dots_batch``: batched matmuls (dense attention's scores and values, routed experts per
    expert); ``other``: elementwise and data-movement values (norms, RoPE, softmax, masks, SwiGLU
    products, gathers, blocked attention's output); ``attention_workspace``: blocked attention's
    transient tiles and gradient buffers, live for one layer at a time whatever the remat policy."""
    c = _bytes(cfg.dtype)
    d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.stored_kv_heads, cfg.head_dim  # K, V as trained: stored heads
    lat, f, k, E = cfg.latent_dim, cfg.stored_expert_width, cfg.top_k, cfg.n_experts  # as computed
    fs = cfg.n_shared_experts * cfg.shared_width
    dots_nobatch = c * (h * hd + 2 * kv * hd + d + 2 * fs + d + lat + E + d)
    dots_batch = c * rows * (2 * f + lat)
    other = c * (3 * d + (h + kv) * hd + fs + k * lat + 2 * lat) + 4 * 2 * E + c * rows * (f + lat)
    attention_workspace = 0.0
    if cfg.attention_impl == "blocked":
        # kept: the output and the float32 log-normaliser (outputs of loops, not of dots); while it
        # runs, a few float32 tiles [h, block, block] per sequence (scores, probabilities and their
        # gradients), the backward's dq and its float32 dk, dv and rowsum(dO * O) buffers
        block = min(cfg.attention_block, seq_len)
        other += c * h * hd + 4 * h
        attention_workspace = 5 * 4 * h * block * block / seq_len + c * h * hd + 4 * (2 * kv * hd + h)
    else:
        dots_batch += 4 * h * seq_len + c * h * hd  # scores, values
        other += (4 + c) * h * seq_len  # softmax, probabilities
    return {"dots_nobatch": dots_nobatch, "dots_batch": dots_batch, "other": other, "carry": c * d,
            "attention_workspace": attention_workspace}


def memory_plan(cfg: MoEConfig, pool: PoolSpec, tokens_per_step: int, seq_len: int, microbatches: int = 1,
                transport: str | None = None, param_sharding: str = "replicated", optimizer: Any = None,
                grouped_impl: str = "auto") -> dict[str, Any]:
    """Per-device bytes of one train step (see the module docstring for the parts). ``optimizer``: the
    run's (marin.training.optimizers; None: AdamW); ``grouped_impl``: the run's
    ``parallelism.grouped_impl`` ("auto": what the pool runs, :func:`pool_grouped_impl`)."""
    check_param_sharding(param_sharding)
    transport = transport or cfg.transport
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; choose from {TRANSPORTS}")
    data, ep = pool.mesh
    n = pool.num_devices
    if transport == "local":
        ep_eff = 1
    else:
        ep_eff = ep
    sequences = tokens_per_step // seq_len
    cp = cfg.context_parallel
    if tokens_per_step % seq_len:
        unit = seq_len * n  # whole sequences, the same count on every device
        lower, upper = tokens_per_step // unit * unit, (tokens_per_step // unit + 1) * unit
        raise ValueError(f"tokens per step {tokens_per_step:,} is not a multiple of seq_len {seq_len} "
                         f"({tokens_per_step / seq_len:g} sequences): a step is whole sequences; "
                         + (f"{lower:,} or " if lower else "") + f"{upper:,} split evenly over {n} devices")
    if (sequences * cp) % (n * microbatches):
        raise ValueError(f"{sequences} sequences of {seq_len} per step do not split over {n} devices x "
                         f"{microbatches} microbatches" + (f" at context parallelism {cp}" if cp > 1 else ""))
    tokens = tokens_per_step // (n * microbatches)  # per device and microbatch (1/C of a sequence's under CP)
    c = _bytes(cfg.dtype)
    p = params_per_device(cfg, (data, ep), param_sharding)
    rows = expert_rows_per_token(cfg, transport, ep_eff, tokens)
    a = activation_bytes_per_token_layer(cfg, seq_len, rows["compute"])
    kept = {
        "none": a["carry"] + a["dots_nobatch"] + a["dots_batch"] + a["other"],
        "dots": a["carry"] + a["dots_nobatch"] + a["dots_batch"],
        "dots_no_batch": a["carry"] + a["dots_nobatch"],
        "full": a["carry"],
    }[cfg.remat_policy]
    layer_all = a["carry"] + a["dots_nobatch"] + a["dots_batch"] + a["other"]
    workspace = layer_all - kept  # what the backward pass recomputes for one layer at a time
    activations = tokens * (cfg.n_layers * kept + workspace + a["attention_workspace"])
    lat = cfg.latent_dim
    # the fixed-slot transports carry the expert id as one extra column; ragged_capacity sends none
    cols = lat if transport == "ragged_capacity" else lat + 1
    a2a = tokens * rows["buffers"] * cols * c
    if pool.is_cpu:  # XLA:CPU runs the ragged transports through an emulation with worst-case blocks
        a2a += tokens * emulated_ragged_rows_per_token(transport, tokens, cfg.top_k, cfg.n_experts, ep_eff,
                                                       cfg.capacity_factor, cfg.expert_chunks) * cols * c
    logits = tokens * cfg.vocab_size * 4  # float32; its gradient reuses the buffer (elementwise)
    opt = optimizer_bytes_per_device(cfg, (data, ep), param_sharding, optimizer)
    parts = {
        "params": (p["total"] * c) if c < 4 else 0.0,
        "master_weights": 4.0 * p["total"],
        "grads": 4.0 * p["total"] * (2 if microbatches > 1 else 1),
        "optimizer_state": opt["state"],
        "optimizer_workspace": opt["workspace"],
        "activations": activations,
        "all_to_all": a2a,
        "grouped": grouped_bytes(cfg, transport, ep_eff, tokens, pool_grouped_impl(grouped_impl, pool)),
        "logits": logits,
        # fsdp: the weights the step gathers where it uses them (compute dtype) and their whole
        # float32 gradients before the reduce-scatter: one layer at a time inside the layer scan, the
        # embedding or the head around it
        "gathered": (c + 4) * (p["layer_gathered"] + p["embed_head_gathered"]),
        "context_parallel": context_parallel_bytes(cfg, seq_len, tokens // max(1, seq_len // cp))["total"] if cp > 1
        else 0.0,
    }
    parts = {k: int(round(v)) for k, v in parts.items()}
    parts["total"] = sum(parts.values())
    return parts


def plan(cfg: MoEConfig, pool: PoolSpec, *, tokens_per_step: int, seq_len: int, microbatches: int | None = None,
         transport: str | None = None, train_steps: int | None = None, mfu: float = DEFAULT_MFU,
         device_memory: int | None = None, seq_len_phases=None, planned_tokens: float | None = None,
         param_sharding: str = "replicated", storage_bytes_per_s: float = STORAGE_WRITE_BYTES_PER_S,
         host_memory: int | None = None, optimizer: Any = None, grouped_impl: str = "auto") -> dict[str, Any]:
    """The whole plan: memory at ``microbatches`` (default: the smallest count that fits), whether it
    fits (on the devices and on the hosts), the smallest pool that would fit at one microbatch, the
    checkpoint's size and save time, and the run's compute cost. ``grouped_impl``: the run's
    ``parallelism.grouped_impl``; the plan names the implementation the pool runs for it."""
    device_memory = device_memory if device_memory is not None else device_memory_bytes(pool)
    usable = int(device_memory * USABLE_FRACTION)
    sequences = tokens_per_step // seq_len
    counts = valid_microbatches(sequences * cfg.context_parallel, pool.num_devices)
    chosen = microbatches
    fitting = None
    for m in counts:
        if memory_plan(cfg, pool, tokens_per_step, seq_len, m, transport, param_sharding, optimizer,
                       grouped_impl)["total"] <= usable:
            fitting = m
            break
    if chosen is None:
        chosen = fitting if fitting is not None else (counts[-1] if counts else 1)
    mem = memory_plan(cfg, pool, tokens_per_step, seq_len, chosen, transport, param_sharding, optimizer, grouped_impl)
    out: dict[str, Any] = {
        "model": None,
        "pool": pool.name,
        "devices": pool.num_devices,
        "hosts": pool.hosts,
        "mesh": list(pool.mesh),
        "accelerator": pool.accelerator,
        "tokens_per_step": tokens_per_step,
        "seq_len": seq_len,
        "transport": transport or cfg.transport,
        "remat_policy": cfg.remat_policy,
        "attention_impl": cfg.attention_impl,
        "dtype": cfg.dtype,
        "param_sharding": param_sharding,
        "optimizer": default_optimizer(optimizer).kind,
        "grouped_impl": pool_grouped_impl(grouped_impl, pool),
        "context_parallel": cfg.context_parallel,
        "microbatches": fitting,
        "planned_microbatches": chosen,
        "device_fits": mem["total"] <= usable,
        "bytes_per_device": mem,
        "device_memory_bytes": device_memory,
        "usable_memory_bytes": usable,
        "smallest_fitting_pool": None if fitting is not None else smallest_fitting_pool(
            cfg, pool, tokens_per_step, seq_len, transport, param_sharding, optimizer, grouped_impl),
    }
    out.update(host_plan(cfg, pool, mem["total"], tokens_per_step, seq_len, param_sharding, storage_bytes_per_s,
                         host_memory, optimizer))
    out["fits"] = out["device_fits"] and out["host_fits"]
    out.update(compute_plan(cfg, pool, tokens_per_step=tokens_per_step, seq_len=seq_len,
                            train_steps=train_steps, mfu=mfu, seq_len_phases=seq_len_phases,
                            planned_tokens=planned_tokens))
    out["seq_len_phases"] = [list(x) for x in seq_len_phases] if seq_len_phases else None
    return out


def valid_microbatches(sequences: int, devices: int) -> list[int]:
    """Microbatch counts that split a step's sequences evenly over the devices, ascending."""
    if sequences % devices:
        return []
    per_device = sequences // devices
    return [m for m in range(1, per_device + 1) if per_device % m == 0]


def smallest_fitting_pool(cfg: MoEConfig, pool: PoolSpec, tokens_per_step: int, seq_len: int,
                          transport: str | None, param_sharding: str = "replicated", optimizer: Any = None,
                          grouped_impl: str = "auto") -> str | None:
    """The smallest known pool of the same accelerator on which the step fits (any microbatch count)."""
    mem = device_memory_bytes(pool)
    for other in sorted(POOLS.values(), key=lambda p: p.num_devices):
        if other.accelerator != pool.accelerator or other.num_devices <= pool.num_devices:
            continue
        for m in valid_microbatches(tokens_per_step // seq_len, other.num_devices):
            if (memory_plan(cfg, other, tokens_per_step, seq_len, m, transport, param_sharding, optimizer,
                            grouped_impl)["total"] <= mem * USABLE_FRACTION):
                return other.name
    return None


def checkpoint_bytes_per_host(cfg: MoEConfig, pool: PoolSpec, param_sharding: str = "replicated",
                              optimizer: Any = None) -> list[int]:
    """Bytes of state each host writes in a checkpoint (float32 master weights and the optimizer's
    state, leaf by leaf: AdamW's two moments make 12 bytes per parameter; the router bias and step
    count are a rounding error), host by host.

    Devices are ordered host by host and laid over the (data, expert) mesh row by row, as
    marin.parallel.mesh.make_mesh does. Of each leaf, the devices at index 0 of every mesh axis the
    leaf is not split over hold replica 0 of their shard and write it: a leaf split over the whole
    mesh is written by every host, a leaf split over "expert" only by the hosts of the first data
    row (rack), a replicated one by host 0."""
    data, expert = pool.mesh
    opt = default_optimizer(optimizer)
    out = [0] * pool.hosts
    for key, shape in param_shapes(cfg).items():
        part = leaf_partition(role_of(key), shape, (data, expert), param_sharding, key.startswith("blocks/"))
        used = {a for axes in part if axes is not None for a in ((axes,) if isinstance(axes, str) else axes)}
        shard = (4 + opt.state_bytes(key, shape)) * math.prod(shard_shape(shape, part, (data, expert)))
        for d in range(pool.num_devices):
            i, j = divmod(d, expert)
            if ("data" in used or i == 0) and (EXPERT in used or j == 0):
                out[d // pool.devices_per_host] += shard
    return out


def host_plan(cfg: MoEConfig, pool: PoolSpec, device_total: int, tokens_per_step: int, seq_len: int,
              param_sharding: str = "replicated", storage_bytes_per_s: float = STORAGE_WRITE_BYTES_PER_S,
              host_memory: int | None = None, optimizer: Any = None) -> dict[str, Any]:
    """Per-host bytes of a run (module docstring), the checkpoint's size and its save time at
    ``storage_bytes_per_s`` per host (hosts write in parallel; the busiest host sets the time)."""
    per_host = checkpoint_bytes_per_host(cfg, pool, param_sharding, optimizer)
    staging = max(per_host)
    rows = tokens_per_step // seq_len // pool.hosts
    if cfg.context_parallel > 1:  # the batch splits over "data" only: every host holds its rack's rows
        rows = tokens_per_step // seq_len // pool.mesh[0]
    parts = {
        "resident_state": device_total * pool.devices_per_host if pool.is_cpu else 0,
        "checkpoint_staging": staging,
        "data_buffers": 2 * rows * (seq_len + 1) * 4 * 2,
        "runtime": HOST_RUNTIME_BYTES.get(pool.accelerator, HOST_RUNTIME_BYTES_GPU),
    }
    parts["total"] = sum(parts.values())
    memory = host_memory if host_memory is not None else host_memory_bytes(pool)
    usable = int(memory * HOST_USABLE_FRACTION)
    return {
        "host_bytes": parts,
        "host_bytes_per_host": parts["total"],
        "host_memory_bytes": memory,
        "host_usable_memory_bytes": usable,
        "host_fits": parts["total"] <= usable,
        "checkpoint_bytes": sum(per_host),
        "checkpoint_bytes_per_host": staging,
        "checkpoint_writing_hosts": sum(1 for b in per_host if b),
        "storage_bytes_per_s": storage_bytes_per_s,
        "checkpoint_save_s": staging / storage_bytes_per_s,
    }


# ---- checkpoint storage --------------------------------------------------------------------------
def handoff_steps(transport_switches, every_steps: int, train_steps: int) -> tuple[int, ...]:
    """The checkpoint each transport switch hands off from (the newest save at or before the switch's
    step, where the relaunch resumes): pinned, so a later look at the switch can restore both sides."""
    return tuple(sorted({min(train_steps, (int(at) // every_steps) * every_steps)
                         for at, _ in transport_switches if int(at) > 0} - {0}))


def transport_handoffs(config) -> dict[int, str]:
    """``{step: why}``: the checkpoints a TrainConfig's transport switches hand off from, which its
    retention pins (the trainer and ``marin checkpoints`` read the same)."""
    every, total = config.checkpoint.every_steps, config.total_steps
    return {s: f"transport handoff to {t} at step {at:,}" for at, t in config.parallelism.transport_switches
            for s in handoff_steps(((at, t),), every, total)}


def storage_plan(checkpoint_bytes: int, policy, train_steps: int, *, pinned=(), quota: int | str | None = None
                 ) -> dict[str, Any]:
    """The checkpoint storage a run holds under ``policy`` (a :class:`CheckpointPolicy`): in the
    permanent store at its peak (while the last save is written beside everything retention keeps)
    and at the end, and in the temporary tier (one kept plus one being written). Saves by wall time
    (``every_minutes``) roll off with the others, so they add nothing here; a failed save's leftover
    (removed at the next commit) may add one checkpoint for a while. ``quota``: bytes or a size such
    as ``"100TiB"`` (default the policy's ``storage_quota``); a peak above it is refused by
    :func:`check_storage_quota`, with the ``keep_every`` that would fit."""
    every, keep_every = policy.every_steps, policy.keep_every
    pins = tuple(policy.pinned_steps) + tuple(pinned)
    saves = sorted(set(range(every, train_steps + 1, every)) | {train_steps})
    # the policy's own retention rule, the one the checkpoint manager deletes by
    before_last = policy.retained(saves[:-1], pinned) if len(saves) > 1 else set()
    at_end = policy.retained(saves, pinned)
    permanent = sorted(s for s in at_end if (keep_every and s % keep_every == 0) or s in set(pins))
    peak_n, end_n = len(before_last) + 1, len(at_end)
    quota = policy.storage_quota if quota is None else quota
    quota_bytes = parse_bytes(quota) if quota is not None else None
    out: dict[str, Any] = {
        "checkpoint_bytes": checkpoint_bytes, "saves": len(saves), "permanent_kept": len(permanent),
        "rolling_kept": end_n - len(permanent), "peak_checkpoints": peak_n, "end_checkpoints": end_n,
        "peak_bytes": peak_n * checkpoint_bytes, "end_bytes": end_n * checkpoint_bytes,
        "temporary_bytes": 2 * checkpoint_bytes if policy.temp_every_minutes is not None else 0,
        "quota_bytes": quota_bytes, "fits_quota": quota_bytes is None or peak_n * checkpoint_bytes <= quota_bytes,
        "keep_every_to_fit": None,
    }
    if not out["fits_quota"] and checkpoint_bytes > 0:
        room = quota_bytes // checkpoint_bytes - policy.keep_last - 1 - len(set(pins))  # permanent ones that fit
        if room >= 1:
            need = math.ceil(train_steps / room)
            out["keep_every_to_fit"] = math.ceil(need / every) * every  # a multiple of every_steps is a save
    return out


def check_storage_quota(plan: dict[str, Any], what: str = "the run") -> None:
    """Raise :class:`StorageQuotaExceeded` in one line when ``plan`` (:func:`storage_plan`) does not fit its quota."""
    if plan["fits_quota"]:
        return
    fix = (f"raise checkpoint.keep_every to {plan['keep_every_to_fit']:,} or more" if plan["keep_every_to_fit"]
           else "lower checkpoint.keep_last or the pinned checkpoints")
    raise StorageQuotaExceeded(
        f"{what} would hold {format_bytes(plan['peak_bytes'])} of checkpoints at its peak "
        f"({plan['peak_checkpoints']} of {format_bytes(plan['checkpoint_bytes'])}: {plan['permanent_kept']} permanent, "
        f"the rolling ones and one being written), over checkpoint.storage_quota "
        f"{format_bytes(plan['quota_bytes'])}: {fix}, or raise the quota")


def train_config_storage(config) -> dict[str, Any]:
    """:func:`storage_plan` of a TrainConfig: its checkpoint's bytes on its pool, its policy, its
    transport handoffs pinned."""
    policy = config.checkpoint
    size = sum(checkpoint_bytes_per_host(config.model, config.pool, config.parallelism.param_sharding,
                                         config.optimizer))
    return storage_plan(size, policy, config.train_steps,
                        pinned=handoff_steps(config.parallelism.transport_switches, policy.every_steps,
                                             config.train_steps))


def check_train_config_storage(config) -> dict[str, Any] | None:
    """Refuse (:class:`StorageQuotaExceeded`, one line) a TrainConfig whose checkpoints would exceed
    its ``checkpoint.storage_quota``; None when it sets none."""
    if config.checkpoint.storage_quota is None:
        return None
    plan = train_config_storage(config)
    check_storage_quota(plan, f"training step {config.preset or 'model'!r}")
    return plan


def format_storage(plan: dict[str, Any]) -> str:
    """The plan's checkpoint storage line(s)."""
    line = (f"  checkpoint storage: {format_bytes(plan['peak_bytes'])} at its peak, "
            f"{format_bytes(plan['end_bytes'])} at the end ({plan['permanent_kept']} permanent + "
            f"{plan['rolling_kept']} rolling of {format_bytes(plan['checkpoint_bytes'])}; peak with one being written)")
    if plan["temporary_bytes"]:
        line += f"; temporary tier {format_bytes(plan['temporary_bytes'])} (one kept, one being written)"
    if plan["quota_bytes"] is not None:
        line += (f"\n  storage quota {format_bytes(plan['quota_bytes'])}: "
                 + ("fits" if plan["fits_quota"] else "EXCEEDED"
                    + (f" (checkpoint.keep_every {plan['keep_every_to_fit']:,} would fit)"
                       if plan["keep_every_to_fit"] else "")))
    return line


# ---- context parallelism -----------------------------------------------------------------------
def context_parallel_bytes(cfg: MoEConfig, seq_len: int, rows: int = 1) -> dict[str, float]:
    """Per-device bytes of the context-parallel attention buffers for ``rows`` shard rows (one layer
    at a time: the layer scan runs one layer's attention at a time), by layer kind:

    ``halo``      a local layer: each of the two chunks receives the ``window - 1`` keys and values
                  before it (compute dtype), at the local KV heads
    ``gathered``  a global layer: the whole sequence's K and V at the global KV heads (the all-gather),
                  the copy expanded to the stored heads the kernel reads, and the backward's float32
                  dK and dV over the whole sequence (then reduce-scattered back)
    When the chunk is shorter than the window, local layers gather like global ones."""
    c, hd, cp = _bytes(cfg.dtype), cfg.head_dim, cfg.context_parallel
    chunk = seq_len // (2 * cp)
    halo_keys = cfg.sliding_window - 1
    gathered = rows * seq_len * hd * (2 * c * cfg.kv_heads_global + (2 * c + 8) * cfg.stored_kv_heads)
    if 1 <= halo_keys <= chunk:
        halo = rows * 2 * halo_keys * 2 * c * cfg.n_kv_heads * hd * 2  # 2 chunks, k and v, received + expanded
    else:
        halo = rows * seq_len * hd * (2 * c * cfg.n_kv_heads + (2 * c + 8) * cfg.stored_kv_heads)
    return {"halo": halo, "gathered": gathered, "total": max(halo, gathered)}


def causal_imbalance(degree: int, order: str = "zigzag") -> float:
    """max / mean attention work of a global layer's shards under a causal mask (1.0 = balanced):
    ``contiguous`` shards of one sequence (shard c sees (c + 1/2) x L/C keys on average: the last
    one 2 - 1/C times the mean) or ``zigzag`` (chunks c and 2C-1-c: every shard the same)."""
    if degree < 1:
        raise ValueError(f"context parallelism must be >= 1, got {degree}")
    if order == "contiguous":
        work = [c + 0.5 for c in range(degree)]
    elif order == "zigzag":
        work = [(c + 0.5) + (2 * degree - 1 - c + 0.5) for c in range(degree)]
    else:
        raise ValueError(f"unknown shard order {order!r}; choose contiguous or zigzag")
    return max(work) / (sum(work) / degree)


def imbalance_cost(cfg: MoEConfig, seq_len: int, degree: int, order: str = "contiguous") -> float:
    """The step time a shard order adds under context parallelism, as a fraction: the global
    layers' attention FLOPs (their share of the step's FLOPs at ``seq_len``) run at the slowest
    shard's pace. The hero at 262,144 tokens, C = 4, contiguous: about 0.33 (zig-zag: 0)."""
    glob = sum(12.0 * cfg.n_heads * cfg.head_dim * mean_attended_keys(seq_len, None)
               for w in cfg.layer_windows() if w is None)
    share = glob / flops_per_token(cfg, seq_len)
    return share * (causal_imbalance(degree, order) - 1.0)


def context_parallel_degrees(cfg: MoEConfig, pool: PoolSpec, tokens_per_step: int, seq_len: int) -> list[int]:
    """Context-parallel degrees a step could use on ``pool``, ascending: C divides the expert axis,
    2C divides the sequence, and the step's sequences x C split over the devices."""
    sequences = tokens_per_step // seq_len
    ep = pool.mesh[1]
    return [c for c in range(1, ep + 1) if ep % c == 0 and seq_len % (2 * c if c > 1 else 1) == 0
            and (sequences * c) % pool.num_devices == 0]


def plan_with_context_parallel(cfg: MoEConfig, pool: PoolSpec, *, context_parallel: int | None = None,
                               tokens_per_step: int, seq_len: int, **kw) -> dict[str, Any]:
    """:func:`plan` at ``context_parallel`` C, or, when None, at the smallest C that fits (C = 1 if it
    fits; the plan says which C it chose and why in ``context_parallel_note``)."""
    if context_parallel is not None:
        if context_parallel < 1:
            raise ValueError(f"--context-parallel must be >= 1, got {context_parallel}")
        out = plan(cfg.replace(context_parallel=context_parallel), pool, tokens_per_step=tokens_per_step,
                   seq_len=seq_len, **kw)
        out["context_parallel_note"] = None
        return out
    degrees = context_parallel_degrees(cfg, pool, tokens_per_step, seq_len)
    if not degrees:
        return plan(cfg, pool, tokens_per_step=tokens_per_step, seq_len=seq_len, **kw)
    last = None
    for c in degrees:
        last = plan(cfg.replace(context_parallel=c), pool, tokens_per_step=tokens_per_step, seq_len=seq_len, **kw)
        if last["fits"]:
            break
    c = last["context_parallel"]
    last["context_parallel_note"] = None if c == 1 else (
        f"context parallelism {c} chosen: the smallest that "
        + ("fits" if last["fits"] else "splits the step's sequences (none fits)")
        + f" (each sequence over {c} devices of the expert axis; "
        f"zig-zag shards: contiguous ones would cost {imbalance_cost(cfg, seq_len, c):.0%} more step time)")
    return last


# ---- compute ---------------------------------------------------------------------------------
def compute_plan(cfg: MoEConfig, pool: PoolSpec, *, tokens_per_step: int, seq_len: int,
                 train_steps: int | None = None, mfu: float = DEFAULT_MFU,
                 planned_tokens: float | None = None, seq_len_phases=None) -> dict[str, Any]:
    """Training FLOPs, device-hours and wall-clock days at ``mfu``, and the token rate that needs.
    With ``seq_len_phases`` the attention term follows the schedule (else ``seq_len`` throughout)."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    fpt = mean_flops_per_token(cfg, seq_len_phases, train_steps) if seq_len_phases else flops_per_token(cfg, seq_len)
    peak = peak_flops_per_device(pool.accelerator)
    rate = pool.num_devices * peak * mfu / fpt  # tokens/s the pool sustains at this MFU
    out: dict[str, Any] = {"flops_per_token": fpt, "mfu": mfu, "tokens_per_s": rate,
                           "train_steps": train_steps, "train_tokens": None, "train_flops": None,
                           "device_hours": None, "days": None, "steps_per_day": 86400 * rate / tokens_per_step}
    if train_steps is not None:
        tokens = train_steps * tokens_per_step
        flops = fpt * tokens
        seconds = flops / (pool.num_devices * peak * mfu)
        out.update(train_tokens=tokens, train_flops=flops, device_hours=seconds * pool.num_devices / 3600,
                   days=seconds / 86400)
        if planned_tokens is not None and abs(planned_tokens - tokens) > 0.005 * planned_tokens:
            out["warning"] = (f"{train_steps:,} steps x {tokens_per_step:,} tokens = {tokens / 1e12:.2f}T tokens, "
                              f"not the planned {planned_tokens / 1e12:.2f}T")
    return out


# ---- presentation ----------------------------------------------------------------------------
def _gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB"


def format_plan(p: dict[str, Any]) -> str:
    """The table ``marin plan`` prints (and a StepDoesNotFit message carries)."""
    mem = p["bytes_per_device"]
    lines = [f"{p['model']} on {p['pool']} ({p['devices']} x {p['accelerator']}, mesh data x expert = "
             f"{p['mesh'][0]} x {p['mesh'][1]}), {p['tokens_per_step']:,} tokens/step at seq_len {p['seq_len']}, "
             f"transport {p['transport']}"
             + (f" (grouped compute: {p['grouped_impl']})" if p.get("grouped_impl") and p["transport"] != "fixed"
                else "")
             + f", remat {p['remat_policy']}, {p['attention_impl']} attention, {p['dtype']}, "
             f"params {p.get('param_sharding', 'replicated')}, "
             f"{p['planned_microbatches']} microbatch(es)"
             + (f", context parallelism {p['context_parallel']}" if p.get("context_parallel", 1) > 1 else "")]
    if p.get("context_parallel_note"):
        lines.append(f"  {p['context_parallel_note']}")
    rows: list[tuple[str, str, str]] = [(k, _gib(mem[k]), "") for k in PARTS]
    rows.append(("total", _gib(mem["total"]),
                 f"usable {_gib(p['usable_memory_bytes'])} of {_gib(p['device_memory_bytes'])}"))
    header = ("per device", "bytes", "")
    if "host_bytes" in p:  # one table, so the host's parts line up under the device's
        h = p["host_bytes"]
        rows.append(("per host", "bytes", ""))
        rows += [(k, _gib(h[k]), "") for k in HOST_PARTS]
        rows.append(("total", _gib(h["total"]), f"usable {_gib(p['host_usable_memory_bytes'])} of "
                     f"{_gib(p['host_memory_bytes'])} host memory" + ("" if p["host_fits"] else "  DOES NOT FIT")))
    lines.append(format_table(header, rows, right=(1,), rule=False, indent="  "))
    if "host_bytes" in p:
        lines.append(f"  checkpoint: {_gib(p['checkpoint_bytes'])} in all, at most "
                     f"{_gib(p['checkpoint_bytes_per_host'])} written per host by {p['checkpoint_writing_hosts']} "
                     f"of {p['hosts']} hosts in parallel; "
                     f"~{p['checkpoint_save_s']:,.0f} s per save at {p['storage_bytes_per_s'] / 1e9:g} GB/s per host")
    if p["fits"]:
        lines.append(f"  fits with {p['planned_microbatches']} microbatch(es)")
    elif p.get("device_fits", False) and not p.get("host_fits", True):
        lines.append("  DOES NOT FIT in host memory (the devices would hold it)")
    elif p.get("device_fits", False):  # this step fits; what a whole run adds (its phases, its storage) does not
        why = []
        if failing := sum(not ph["fits"] for ph in p.get("phases") or ()):
            why.append(f"{failing} of its phases (below)")
        if p.get("storage") and not p["storage"]["fits_quota"]:
            why.append("its checkpoints exceed the storage quota (below)")
        lines.append(f"  this step fits with {p['planned_microbatches']} microbatch(es); the run DOES NOT FIT: "
                     + (" and ".join(why) or "see below"))
    else:
        hint = (f"smallest microbatch count that fits: {p['microbatches']}" if p["microbatches"] else
                "no microbatch count fits on this pool" + (
                    f"; smallest pool that fits: {p['smallest_fitting_pool']}" if p["smallest_fitting_pool"]
                    else "; no known pool fits either"))
        lines.append(f"  DOES NOT FIT; {hint}")
    if p.get("train_flops") is not None:
        lines.append(f"  compute: {p['train_steps']:,} steps x {p['tokens_per_step']:,} tokens = "
                     f"{p['train_tokens']:.4g} tokens, {p['train_flops']:.3g} FLOPs; at {p['mfu']:.0%} MFU "
                     f"{p['device_hours']:,.0f} device-hours, {p['days']:.1f} days, "
                     f"{p['tokens_per_s']:,.0f} tokens/s ({p['steps_per_day']:,.0f} steps/day)")
    else:
        lines.append(f"  compute: {p['flops_per_token']:.4g} FLOPs/token; at {p['mfu']:.0%} MFU "
                     f"{p['tokens_per_s']:,.0f} tokens/s ({p['steps_per_day']:,.0f} steps/day)")
    if p.get("warning"):
        lines.append(f"  warning: {p['warning']}")
    return "\n".join(lines)


# ---- training configs -------------------------------------------------------------------------
def train_config_plans(config, device_memory: int | None = None) -> list[dict[str, Any]]:
    """One plan per (sequence length, transport) a TrainConfig will run, with its microbatch setting
    and the phase's remat policy."""
    cfg = config.model  # resolved when the TrainConfig was built (preset, overrides and compute dtype)
    pool = config.pool
    seq_lens = sorted({int(n) for _, n in config.seq_len_phases})
    transports = sorted({t for _, t in config.parallelism.transport_switches}) or [cfg.transport]
    plans = []
    for L in seq_lens:
        for t in transports:
            p = plan(model_at(config, cfg, L), pool, tokens_per_step=config.tokens_per_step, seq_len=L,
                     microbatches=config.parallelism.microbatches, transport=t,
                     train_steps=config.train_steps, device_memory=device_memory,
                     seq_len_phases=config.seq_len_phases,
                     param_sharding=config.parallelism.param_sharding, optimizer=config.optimizer,
                     grouped_impl=config.parallelism.grouped_impl)
            p["model"] = config.preset or f"d{cfg.d_model}"
            plans.append(p)
    return plans


def check_train_config_fits(config, device_memory: int | None = None) -> list[dict[str, Any]]:
    """Raise StepDoesNotFit (with the planner's tables) when a phase of the run cannot fit its pool."""
    plans = train_config_plans(config, device_memory)
    bad = [p for p in plans if not p["fits"]]
    if bad:
        raise StepDoesNotFit(
            f"training step {config.preset or 'model'!r} on pool {config.pool.name!r} does not fit in device "
            f"memory ({len(bad)} of {len(plans)} phase/transport combinations):\n"
            + "\n".join(format_plan(p) for p in bad))
    return plans


# ---- phases: one plan per (sequence length, transport) a run uses --------------------------------
def phase_plans(cfg: MoEConfig, pool: PoolSpec, *, tokens_per_step: int, phases, microbatches: int | None = None,
                param_sharding: str = "replicated", device_memory: int | None = None,
                remat_by_seq_len=(), context_parallel_by_seq_len=(), optimizer: Any = None,
                grouped_impl: str = "auto") -> list[dict[str, Any]]:
    """A short plan per phase of a run: ``phases`` is a sequence of (seq_len, transport), one per
    combination the run will use (any order, any count: a new sequence-length phase is one more
    entry). Each entry: ``seq_len``, ``transport``, ``remat_policy``, ``microbatches`` (the smallest
    count that fits, or the one asked for), ``total_bytes`` per device, ``fits``, and for a transport
    that can drop, ``largest_fitting_capacity_factor`` (how far a user who sees drops can raise the
    factor before the phase stops fitting; None when even 1.0 does not fit). ``remat_by_seq_len`` and
    ``context_parallel_by_seq_len``: the run's per-phase remat policy and context parallelism, as the
    trainer applies them; each entry also says its ``context_parallel``, and the grouped compute's
    implementation there (``grouped_impl``, "-" for the fixed transport, which does not use it) and
    its bytes per device (``grouped_bytes``)."""
    remat = {int(n): p for n, p in remat_by_seq_len}
    cp = {int(n): int(c) for n, c in context_parallel_by_seq_len}
    out = []
    for seq_len, transport in phases:
        phase_cfg = cfg.replace(remat_policy=remat.get(int(seq_len), cfg.remat_policy),
                                context_parallel=cp.get(int(seq_len), cfg.context_parallel))
        p = plan(phase_cfg, pool, tokens_per_step=tokens_per_step, seq_len=int(seq_len), microbatches=microbatches,
                 transport=transport, device_memory=device_memory, param_sharding=param_sharding,
                 optimizer=optimizer, grouped_impl=grouped_impl)
        entry = {"seq_len": int(seq_len), "transport": transport, "remat_policy": phase_cfg.remat_policy,
                 "context_parallel": phase_cfg.context_parallel,
                 "grouped_impl": p["grouped_impl"] if transport != "fixed" else "-",
                 "grouped_bytes": p["bytes_per_device"]["grouped"],
                 "microbatches": p["planned_microbatches"], "total_bytes": p["bytes_per_device"]["total"],
                 "usable_memory_bytes": p["usable_memory_bytes"], "fits": p["fits"]}
        if transport in DROPPING_TRANSPORTS:
            entry["capacity_factor"] = phase_cfg.capacity_factor
            entry["largest_fitting_capacity_factor"] = largest_fitting_capacity_factor(
                phase_cfg, pool, tokens_per_step, int(seq_len), p["planned_microbatches"], transport,
                param_sharding, p["usable_memory_bytes"], optimizer=optimizer, grouped_impl=grouped_impl)
        out.append(entry)
    return out


def largest_fitting_capacity_factor(cfg: MoEConfig, pool: PoolSpec, tokens_per_step: int, seq_len: int,
                                    microbatches: int, transport: str, param_sharding: str, usable: int,
                                    low: float = 1.0, high: float = 8.0, step: float = 0.01,
                                    optimizer: Any = None, grouped_impl: str = "auto") -> float | None:
    """The largest capacity factor on the grid low, low + step, ..., high at which the step still fits
    ``usable`` bytes per device (memory grows with the factor, so a bisection over the grid finds
    it); None when not even ``low`` fits."""

    def fits(i: int) -> bool:
        c = cfg.replace(capacity_factor=round(low + i * step, 6))
        total = memory_plan(c, pool, tokens_per_step, seq_len, microbatches, transport, param_sharding,
                            optimizer, grouped_impl)["total"]
        return total <= usable

    lo, hi = 0, int(round((high - low) / step))
    if not fits(lo):
        return None
    if fits(hi):
        return round(low + hi * step, 6)
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return round(low + lo * step, 6)


def format_phases(phases: list[dict[str, Any]]) -> str:
    """The per-phase lines ``marin plan`` prints under its table."""
    rows = []
    for ph in phases:
        note = ""
        if "largest_fitting_capacity_factor" in ph:
            best = ph["largest_fitting_capacity_factor"]
            note = (f"capacity factor {ph['capacity_factor']:g}; fits up to {best:g}" if best is not None
                    else f"capacity factor {ph['capacity_factor']:g}; does not fit even at 1.0")
        rows.append((f"{ph['seq_len']:,}", ph["transport"], ph["remat_policy"], str(ph["microbatches"]),
                     str(ph.get("context_parallel", 1)), ph.get("grouped_impl", "-"),
                     _gib(ph.get("grouped_bytes", 0)), _gib(ph["total_bytes"]),
                     "fits" if ph["fits"] else "DOES NOT FIT", note))
    table = format_table(("seq_len", "transport", "remat", "microbatches", "context par.", "grouped impl",
                          "grouped", "per device", "", ""),
                         rows, right=(0, 3, 4, 6, 7), rule=False, indent="  ")
    return "  phases of the run:\n" + table
