"""CPU kernels for the MoE hot path, as XLA FFI custom calls built on first use.

`grouped_matmul(a, b)` computes out[g] = op(a[g]) @ op(b[g]) over a leading group (expert) axis.
On CPU it runs `grouped_gemm.cc`: the groups are split across threads, each running single-threaded
OpenBLAS SGEMMs on whole experts, instead of XLA:CPU's batched dot that splits every expert's small
GEMM across all cores. On other platforms, or when the kernel is unavailable, it is the plain einsum
(same values; the choice is made at lowering time by `jax.lax.platform_dependent`).

The kernel is compiled once per (source, jaxlib, OpenBLAS) version with the system C++ compiler into
$MARIN_KERNEL_CACHE (default ~/.cache/marin/kernels) and loaded from there afterwards. If it cannot
be built (no compiler, the `scipy-openblas32` wheel of the `train` extra missing) a warning says so
once and the einsum is used. MARIN_CPU_KERNELS=0 turns the kernel off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

from marin.parallel.mesh import sum_to_type_of, vary_like

SOURCE = Path(__file__).with_name("grouped_gemm.cc")
TARGET = "marin_grouped_gemm"


def cache_dir() -> Path:
    return Path(os.environ.get("MARIN_KERNEL_CACHE", Path.home() / ".cache" / "marin" / "kernels"))


def _build_inputs() -> tuple[list[str], str]:
    """The compile command's flags (without source/output) and a key naming what the binary depends on."""
    import jaxlib

    try:
        import scipy_openblas32 as openblas
    except ImportError as e:
        raise RuntimeError("the scipy-openblas32 wheel is missing; install marin's train extra "
                           "(pip install -e '.[train]')") from e

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++/g++) on PATH; set CXX")
    lib_dir = openblas.get_lib_dir()
    flags = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-pthread",
             f"-I{jax.ffi.include_dir()}", f"-I{openblas.get_include_dir()}",
             f"-L{lib_dir}", f"-l{openblas.get_library()}", f"-Wl,-rpath,{lib_dir}"]
    key = hashlib.sha256("\0".join([SOURCE.read_text(), jaxlib.__version__, openblas.__version__,
                                    *flags]).encode()).hexdigest()[:16]
    return flags, key


def build() -> Path:
    """Compile the kernel library (or find it in the cache). Raises with the compiler's message."""
    flags, key = _build_inputs()
    out = cache_dir() / f"grouped_gemm-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # compile to a private name, then rename: concurrent builders (Ray workers) never see half a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([*flags, str(SOURCE), "-o", tmp], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed:\n{proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def available() -> bool:
    """Build (once per process), load and register the kernel; False (with one warning) if that fails."""
    if os.environ.get("MARIN_CPU_KERNELS", "1") == "0":
        return False
    try:
        lib = ctypes.CDLL(str(build()))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.MarinGroupedGemm), platform="cpu")
    except Exception as e:  # noqa: BLE001 - any failure means: use the einsum
        warnings.warn(f"marin CPU grouped GEMM kernel unavailable, using XLA's batched dot (slower for "
                      f"MoE experts): {e}", RuntimeWarning, stacklevel=2)
        return False
    return True


def default_threads() -> int:
    """Threads per kernel call: the cores this process may use."""
    return len(os.sched_getaffinity(0))


def _einsum(a, b, trans_a: bool, trans_b: bool):
    return jnp.einsum(f"{'gkm' if trans_a else 'gmk'},{'gnk' if trans_b else 'gkn'}->gmn", a, b)


def grouped_matmul(a, b, trans_a: bool = False, trans_b: bool = False, rows=None, threads: int | None = None):
    """out[g] = op(a[g]) @ op(b[g]); a, b rank 3 with the group axis first.

    rows (int [G], optional): a's axis 1 is a buffer whose first rows[g] rows are filled and whose
    other rows are zero. The kernel then skips the padding (the results are the same either way:
    zero rows give zero output rows, or add nothing to a contraction over them).
    Not differentiable by itself: callers write their VJP with it (see marin.parallel.expert), or
    use `grouped_matmul_nn`."""
    g = a.shape[0]
    m = a.shape[2] if trans_a else a.shape[1]
    n = b.shape[1] if trans_b else b.shape[2]
    if a.dtype != jnp.float32 or b.dtype != jnp.float32 or jax.default_backend() != "cpu" or not available():
        return _einsum(a, b, trans_a, trans_b)  # (a GPU process never builds the kernel)
    rows = jnp.full((g,), a.shape[1], jnp.int32) if rows is None else rows.astype(jnp.int32)

    def cpu(a, b, rows):
        a, b, rows = (vary_like(v, a, b, rows) for v in (a, b, rows))  # inside shard_map: one type
        ta = jax.typeof(a)
        out = jax.ShapeDtypeStruct((g, m, n), jnp.float32, sharding=ta.sharding,
                                   manual_axis_type=getattr(ta, "manual_axis_type", None))
        call = jax.ffi.ffi_call(TARGET, out)
        return call(a, b, rows, trans_a=trans_a, trans_b=trans_b, threads=threads or default_threads())

    def other(a, b, rows):
        return _einsum(a, b, trans_a, trans_b)

    return jax.lax.platform_dependent(a, b, rows, cpu=cpu, default=other)


@jax.custom_vjp
def grouped_matmul_nn(a, b):
    """Differentiable out[g] = a[g] @ b[g]: both the forward and the VJP run the grouped kernel."""
    return grouped_matmul(a, b)


def _nn_fwd(a, b):
    return grouped_matmul(a, b), (a, b)


def _nn_bwd(res, dout):
    a, b = res
    return (sum_to_type_of(grouped_matmul(dout, b, trans_b=True), a),
            sum_to_type_of(grouped_matmul(a, dout, trans_a=True), b))


grouped_matmul_nn.defvjp(_nn_fwd, _nn_bwd)
