"""Optional compiled kernel for the training loader: window copy + segment ids in one pass.

The kernel is plain C (no Python C API) in ``loader_kernel.c`` next to this module (package data, like
the C++ of :mod:`marin.kernels`).
It is compiled on first use with the system C compiler (``$CC`` or ``cc``; ``-O3 -shared -fPIC``) into
marin's native cache under a name keyed by the sha256 of the source, the compiler command, the flags
and the platform, atomically (the rules shared by every native kernel are in :mod:`marin.nativebuild`).
It is loaded with :mod:`ctypes` and checked against the numpy reference on a small random batch.

When there is no compiler, the build or the check fails, or the platform is unsupported, one warning
is logged and :func:`kernel` returns None: callers then use their numpy path, which gives identical
results. ``MARIN_DISABLE_NATIVE=1`` forces that fallback (checked on every call).

Semantics of the segment ids (same as :func:`marin.data.segments.segment_ids_from_eos`): per row,
``seg[i]`` is the number of EOS tokens strictly before position ``i`` in the row, so an EOS token
belongs to the document it ends, and every row starts at 0.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path

import numpy as np

from marin import nativebuild
from marin.data.segments import segment_ids_from_eos
from marin.nativebuild import DISABLE_ENV, native_disabled  # noqa: F401  (re-exported for callers and tests)

logger = logging.getLogger(__name__)

ABI_VERSION = 1
CFLAGS = ("-O3", "-shared", "-fPIC")

SOURCE = Path(__file__).with_name("loader_kernel.c")
"""The kernel's C source, a file next to this module (as every native kernel's is: marin/kernels/*.cc)."""
C_SOURCE = SOURCE.read_text()


def compiler_command() -> list[str]:
    """The C compiler command: ``$CC`` (split like a shell would) or ``cc``."""
    return nativebuild.compiler_command("c")


def build_key(cc: list[str]) -> str:
    """sha256 of everything that determines the binary: source, compiler command, flags, platform."""
    h = hashlib.sha256()
    for part in (C_SOURCE, "\0".join(cc), "\0".join(CFLAGS), platform.system(), platform.machine(), str(ABI_VERSION)):
        h.update(part.encode())
        h.update(b"\1")
    return h.hexdigest()[:24]


class NativeKernel:
    """The loaded library, with typed entry points. ctypes drops the GIL during each call."""

    def __init__(self, path: Path, lib: ctypes.CDLL, level: int):
        self.path, self._lib, self.level = path, lib, level
        self.isa = {1: "scalar", 2: "sse2", 3: "avx2"}.get(level, str(level))
        i64, vp, u32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_uint32
        self._fill = lib.marin_fill_rows
        self._fill.argtypes = [i64, i64, vp, i64, vp, vp, vp, u32]
        self._fill.restype = ctypes.c_int
        self._seg = lib.marin_segment_ids
        self._seg.argtypes = [i64, i64, vp, vp, u32]
        self._seg.restype = None

    def use_isa(self, level: int) -> str:
        """Switch the implementation (0: best the CPU has, 1: scalar, 2: SSE2) for every user of this
        library in the process (tests compare them); returns the one now in use."""
        self.level = self._lib.marin_loader_init(int(level))
        self.isa = {1: "scalar", 2: "sse2", 3: "avx2"}.get(self.level, str(self.level))
        return self.isa

    def fill_rows(self, row_ptr: np.ndarray, extra: np.ndarray | None, out: np.ndarray, seg: np.ndarray,
                  eos: int) -> None:
        """Copy every row into ``out`` (uint32/int32 [rows, n], C-contiguous) and its segment ids into
        ``seg`` (int32, same shape). ``row_ptr`` (uint64 [rows]): address of the row's ``n`` tokens, or 0
        for a row made of the next pieces of ``extra`` (uint64 [pieces, 2]: address, length in tokens).
        The caller keeps the memory behind every address alive and valid for the call."""
        rows, n = out.shape
        assert out.dtype.itemsize == 4 and out.dtype.kind in "iu" and seg.dtype == np.int32
        assert seg.shape == out.shape and out.flags.c_contiguous and seg.flags.c_contiguous
        assert row_ptr.dtype == np.uint64 and row_ptr.shape == (rows,) and row_ptr.flags.c_contiguous
        ne = 0
        if extra is not None:
            extra = np.ascontiguousarray(extra, dtype=np.uint64).reshape(-1, 2)
            ne = extra.shape[0]
        self.fill_rows_at(rows, n, row_ptr.ctypes.data, ne, extra.ctypes.data if ne else None, out.ctypes.data,
                          seg.ctypes.data, eos)

    def fill_rows_at(self, rows: int, n: int, row_ptr: int, n_extra: int, extra: int | None, out: int, seg: int,
                     eos: int) -> None:
        """:meth:`fill_rows` on raw addresses, unchecked (the loader's hot path: each ``.ctypes.data``
        costs ~1 us). ``out`` and ``seg`` must hold ``rows * n`` 4-byte values each."""
        if self._fill(rows, n, row_ptr, n_extra, extra, out, seg, int(eos) & 0xFFFFFFFF) != 0:
            raise RuntimeError("native loader kernel: the window pieces do not add up to the rows")

    def segment_ids(self, tokens: np.ndarray, eos: int, out: np.ndarray | None = None) -> np.ndarray:
        """Segment ids of a C-contiguous int32/uint32 [rows, n] token array (see module docstring)."""
        assert tokens.ndim == 2 and tokens.dtype.itemsize == 4 and tokens.dtype.kind in "iu"
        tokens = np.ascontiguousarray(tokens)
        if out is None:
            out = np.empty(tokens.shape, dtype=np.int32)
        assert out.shape == tokens.shape and out.dtype == np.int32 and out.flags.c_contiguous
        self._seg(tokens.shape[0], tokens.shape[1], tokens.ctypes.data, out.ctypes.data, int(eos) & 0xFFFFFFFF)
        return out


def _self_test(k: NativeKernel) -> None:
    """A small random batch (odd lengths, split rows, dense EOS) against the numpy reference."""
    rng = np.random.default_rng(12345)
    for rows, n in [(3, 1), (4, 7), (5, 37), (2, 130)]:
        src = rng.integers(0, 6, rows * n + 5).astype(np.uint32)
        want = np.empty((rows, n), np.uint32)
        row_ptr = np.zeros(rows, np.uint64)
        extra = []
        for r in range(rows):
            a = int(rng.integers(0, 5))
            want[r] = src[a + r * n:a + (r + 1) * n]
            if r % 2 == 0:
                row_ptr[r] = src[a + r * n:].ctypes.data
            else:
                cut = int(rng.integers(0, n + 1))
                for lo, hi in ((0, cut), (cut, n)):
                    extra.append((src[a + r * n + lo:].ctypes.data, hi - lo))
        out = np.empty((rows, n), np.uint32)
        seg = np.empty((rows, n), np.int32)
        k.fill_rows(row_ptr, np.array(extra, np.uint64), out, seg, 0)
        if not (np.array_equal(out, want) and np.array_equal(seg, segment_ids_from_eos(want.view(np.int32), 0))
                and np.array_equal(k.segment_ids(want, 0), seg)):
            raise RuntimeError("self-test: native result differs from numpy")


def _compile(cc: list[str], target: Path) -> None:
    """Build the library into ``target`` (atomically, see :mod:`marin.nativebuild`); the C source is
    kept next to it, for reading and debugging."""

    def build(workdir: Path, output: Path) -> None:
        src = workdir / "loader.c"
        src.write_text(C_SOURCE)
        nativebuild.run_build_command([*cc, *CFLAGS, "-o", str(output), str(src)])
        os.replace(src, target.with_suffix(".c"))

    nativebuild.build_cached(target, build)


def _load(path: Path, force_level: int) -> NativeKernel:
    lib = ctypes.CDLL(str(path))
    if lib.marin_loader_abi() != ABI_VERSION:
        raise RuntimeError(f"{path} has ABI {lib.marin_loader_abi()}, expected {ABI_VERSION}")
    level = lib.marin_loader_init(int(force_level))
    k = NativeKernel(path, lib, level)
    _self_test(k)
    return k


def build_and_load(force_level: int = 0) -> NativeKernel:
    """Load the cached kernel for the current source and compiler, building it first if needed.
    Raises on any failure (no compiler, compile error, unloadable library, failed self-test)."""
    if sys.byteorder != "little":
        raise RuntimeError("token stores are little-endian; the kernel copies raw bytes")
    cc = compiler_command()
    target = nativebuild.writable_cache_dir() / f"loader-{build_key(cc)}.so"
    if target.exists():
        try:
            return _load(target, force_level)
        except Exception as e:  # noqa: BLE001  (a broken cached file, whatever the error: rebuild it once)
            logger.debug("cached native kernel %s unusable (%s); rebuilding", target, e)
            target.unlink(missing_ok=True)
    _compile(cc, target)
    return _load(target, force_level)


_UNSET = object()
_KERNEL: object = _UNSET
_LOCK = threading.Lock()


def kernel() -> NativeKernel | None:
    """The native kernel, built and loaded on first use; None when disabled or unavailable.

    The first failure in a process logs one warning and is remembered (no retry per batch).
    """
    if native_disabled():
        return None
    k = _KERNEL
    if k is _UNSET:
        k = _init()
    return k  # type: ignore[return-value]


def _init() -> NativeKernel | None:
    global _KERNEL
    with _LOCK:
        if _KERNEL is _UNSET:
            try:
                _KERNEL = build_and_load()
                logger.debug("native loader kernel: %s (%s)", _KERNEL.path, _KERNEL.isa)
            except Exception as e:  # noqa: BLE001  (any failure means: use the numpy path)
                nativebuild.warn_unavailable("native loader kernel", "the numpy path", e)
                _KERNEL = None
        return _KERNEL  # type: ignore[return-value]


def reset() -> None:
    """Forget the loaded kernel (and any remembered failure) so the next :func:`kernel` retries. Tests."""
    global _KERNEL
    with _LOCK:
        _KERNEL = _UNSET
