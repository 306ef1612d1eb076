"""CPU kernels for the MoE hot path, as XLA FFI custom calls built on first use.

`grouped_matmul(a, b)` computes out[g] = op(a[g]) @ op(b[g]) over a leading group (expert) axis;
`swiglu_fwd` / `swiglu_bwd` are the routed experts' whole SwiGLU forward and backward over capacity
buffers (the MoE's CPU path, marin.kernels.grouped). On CPU they run `grouped_gemm.cc`: the experts
are split across threads, each running single-threaded OpenBLAS SGEMMs and the elementwise work on
whole experts in cache, instead of XLA:CPU's batched dot that splits every expert's small GEMM across
all cores. All of them compute only the filled rows of each expert's buffer. On other platforms, or
when the kernel is unavailable, the same formulas run as einsums (the `*_reference` functions; the
choice is made at lowering time by `jax.lax.platform_dependent`).

The library is compiled once per (source, jaxlib, OpenBLAS, CPU model) with the system C++ compiler
(-march=native) into marin's native cache and loaded from there afterwards (compiler, cache,
atomic build and the off switch MARIN_DISABLE_NATIVE=1 follow :mod:`marin.nativebuild`). If it cannot
be built (no compiler, the `scipy-openblas32` wheel of the `train` extra missing) a warning says so
once and the einsums are used.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from marin import nativebuild
from marin.jaxcompat import compute_platform, vary_like

SOURCE = Path(__file__).with_name("grouped_gemm.cc")
TARGET = "marin_grouped_gemm"
TARGETS = {TARGET: "MarinGroupedGemm", "marin_swiglu_fwd": "MarinSwigluFwd", "marin_swiglu_bwd": "MarinSwigluBwd"}


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (the cache may be shared)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.machine()


def _build_inputs() -> tuple[list[str], list[str], list[str], str]:
    """Compile flags, link flags, libraries (`build` puts the object file between the last two) and a
    key naming everything the binary depends on."""
    try:
        import scipy_openblas32 as openblas  # the train extra's BLAS wheel: needed only to build the kernel
    except ImportError as e:
        raise RuntimeError("the scipy-openblas32 wheel is missing; install marin's train extra "
                           "(pip install -e '.[train]')") from e

    cxx = nativebuild.compiler_command("c++")
    lib_dir = openblas.get_lib_dir()
    # -ffast-math for the vectorised exp of the SwiGLU loops; the link step goes without it, so
    # crtfastmath (flush-to-zero for the whole process) is never linked in.
    compile_flags = [*cxx, "-O3", "-march=native", "-ffast-math", "-std=c++17", "-fPIC",
                     f"-I{jax.ffi.include_dir()}", f"-I{openblas.get_include_dir()}"]
    link_flags = [*cxx, "-shared", "-pthread"]  # then the object file, then the libraries it needs
    libs = [f"-L{lib_dir}", f"-l{openblas.get_library()}", f"-Wl,-rpath,{lib_dir}", "-lmvec", "-lm"]
    key = hashlib.sha256("\0".join([SOURCE.read_text(), jaxlib.__version__, openblas.__version__,
                                    _cpu_identity(), *compile_flags, *link_flags, *libs]).encode()).hexdigest()[:16]
    return compile_flags, link_flags, libs, key


def build() -> Path:
    """Compile the kernel library (or find it in the cache). Raises with the compiler's message."""
    compile_flags, link_flags, libs, key = _build_inputs()

    def compile_and_link(workdir: Path, output: Path) -> None:
        obj = workdir / "grouped_gemm.o"
        nativebuild.run_build_command([*compile_flags, "-c", str(SOURCE), "-o", str(obj)])
        nativebuild.run_build_command([*link_flags, str(obj), *libs, "-o", str(output)])

    return nativebuild.build_cached(nativebuild.writable_cache_dir() / f"grouped_gemm-{key}.so", compile_and_link)


@functools.cache
def available() -> bool:
    """Build (once per process), load and register the kernel; False (with one warning) if that fails."""
    if nativebuild.native_disabled():
        return False
    try:
        lib = ctypes.CDLL(str(build()))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except Exception as e:  # noqa: BLE001 - any failure means: use the einsum
        nativebuild.warn_unavailable("CPU grouped GEMM kernel", "XLA's batched dot for the MoE experts", e)
        return False
    return True


def default_threads() -> int:
    """Threads per kernel call: the cores this process may use."""
    return len(os.sched_getaffinity(0))


def _einsum(a, b, trans_a: bool, trans_b: bool):
    return jnp.einsum(f"{'gkm' if trans_a else 'gmk'},{'gnk' if trans_b else 'gkn'}->gmn", a, b)


def use_kernel(*arrays) -> bool:
    """f32 operands in a CPU process with the kernel built (a GPU process never builds it)."""
    return (all(a.dtype == jnp.float32 for a in arrays) and compute_platform() == "cpu"
            and available())


def _ffi(target: str, out_shapes, *args, **attrs):
    """Call a registered kernel; inside shard_map the operands get one manual-axis type and the
    results inherit it."""
    args = tuple(vary_like(v, *args) for v in args)
    t = jax.typeof(args[0])
    mesh = t.sharding.mesh
    outs = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P(*[None] * len(shape))),
                                 manual_axis_type=getattr(t, "manual_axis_type", None)) for shape in out_shapes]
    return jax.ffi.ffi_call(target, outs)(*args, threads=attrs.pop("threads", None) or default_threads(), **attrs)


def grouped_matmul(a, b, trans_a: bool = False, trans_b: bool = False, rows=None, threads: int | None = None):
    """out[g] = op(a[g]) @ op(b[g]); a, b rank 3 with the group axis first.

    rows (int [G], optional): a's axis 1 is a buffer whose first rows[g] rows are filled and whose
    other rows are zero. The kernel then skips the padding (the results are the same either way:
    zero rows give zero output rows, or add nothing to a contraction over them).
    Not differentiable by itself: callers write the VJP with it."""
    if not use_kernel(a, b):
        return _einsum(a, b, trans_a, trans_b)
    g = a.shape[0]
    m = a.shape[2] if trans_a else a.shape[1]
    n = b.shape[1] if trans_b else b.shape[2]
    rows = jnp.full((g,), a.shape[1], jnp.int32) if rows is None else rows.astype(jnp.int32)

    def cpu(a, b, rows):
        return _ffi(TARGET, [(g, m, n)], a, b, rows, trans_a=trans_a, trans_b=trans_b, threads=threads)[0]

    def other(a, b, rows):
        return _einsum(a, b, trans_a, trans_b)

    return jax.lax.platform_dependent(a, b, rows, cpu=cpu, default=other)


# ---- per-expert SwiGLU over capacity buffers ---------------------------------------------------
def _silu_grad(g):
    s = jax.nn.sigmoid(g)
    return s * (1 + g * (1 - s))


def swiglu_reference(x, w_gate, w_up, w_down):
    """Per-expert SwiGLU as einsums: x [E, C, D] -> [E, C, D]."""
    return _swiglu_fwd_reference(x, w_gate, w_up, w_down, None)[0]


def _swiglu_fwd_reference(x, w_gate, w_up, w_down, rows):
    g = _einsum(x, w_gate, False, False)
    u = _einsum(x, w_up, False, False)
    return _einsum(jax.nn.silu(g) * u, w_down, False, False), g, u


def swiglu_fwd(x, w_gate, w_up, w_down, rows):
    """Per-expert SwiGLU over capacity buffers x [E, C, D] whose first rows[e] rows are filled (the
    rest zero): returns y [E, C, D] and the pre-activations g, u [E, C, F] for `swiglu_bwd`. On CPU
    one kernel call does all three GEMMs and the activation per expert, in cache."""
    if not use_kernel(x, w_gate, w_up, w_down):
        return _swiglu_fwd_reference(x, w_gate, w_up, w_down, rows)
    e, c, d = x.shape
    f = w_gate.shape[2]

    def cpu(*args):
        return tuple(_ffi("marin_swiglu_fwd", [(e, c, d), (e, c, f), (e, c, f)], *args))

    return jax.lax.platform_dependent(x, w_gate, w_up, w_down, rows.astype(jnp.int32), cpu=cpu,
                                      default=_swiglu_fwd_reference)


def _swiglu_bwd_reference(x, dy, row_weight, g, u, w_gate, w_up, w_down, rows):
    sg = jax.nn.silu(g)
    h = sg * u
    dhu = _einsum(dy, w_down, False, True)  # d(unweighted output) . w_down^T
    d_row_weight = jnp.sum(dhu * h, axis=-1)
    dh = dhu * row_weight[..., None]
    du = dh * sg
    dg = dh * u * _silu_grad(g)
    dw_down = _einsum(h * row_weight[..., None], dy, True, False)
    dw_gate = _einsum(x, dg, True, False)
    dw_up = _einsum(x, du, True, False)
    dx = _einsum(dg, w_gate, False, True) + _einsum(du, w_up, False, True)
    return dx, d_row_weight, dw_gate, dw_up, dw_down


def swiglu_bwd(x, dy, row_weight, g, u, w_gate, w_up, w_down, rows):
    """Backward of y[e, i] = row_weight[e, i] * SwiGLU_e(x[e, i]) over capacity buffers (first
    rows[e] rows filled), given dy = dL/dy and the forward's g, u. row_weight [E, C] is the combine
    weight of each buffer row (ones for a plain SwiGLU). Returns dx, d row_weight [E, C],
    dw_gate, dw_up, dw_down. On CPU one kernel call does the six GEMMs and the
    elementwise derivative per expert, in cache."""
    if not use_kernel(x, dy, row_weight, g, u, w_gate, w_up, w_down):
        return _swiglu_bwd_reference(x, dy, row_weight, g, u, w_gate, w_up, w_down, rows)
    e, c, d = x.shape
    f = w_gate.shape[2]

    def cpu(*args):
        return tuple(_ffi("marin_swiglu_bwd", [(e, c, d), (e, c), (e, d, f), (e, d, f), (e, f, d)], *args))

    return jax.lax.platform_dependent(x, dy, row_weight, g, u, w_gate, w_up, w_down, rows.astype(jnp.int32),
                                      cpu=cpu, default=_swiglu_bwd_reference)
