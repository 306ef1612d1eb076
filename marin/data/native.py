"""Optional compiled kernel for the training loader: window copy + segment ids in one pass.

The kernel is plain C (no Python C API), kept in this module as a string so it ships with the package.
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

C_SOURCE = r"""
/* marin loader kernel: copy token windows into a batch and write segment ids in the same pass.
   Plain C, no Python API. Built by marin/data/native.py; see docs/data.md, "Native loader kernel". */
#include <stdint.h>
#include <stddef.h>

#define MARIN_LOADER_ABI 1

/* PREFIX[m][j]: EOS tokens before lane j of an 8-token block whose EOS lanes are the bits of m.
   POP[m]: EOS tokens in the block. Filled by marin_loader_init(). */
static int32_t PREFIX[256][8] __attribute__((aligned(64)));
static uint8_t POP[256];

int marin_loader_abi(void) { return MARIN_LOADER_ABI; }

typedef int32_t (*block_fn)(const uint32_t *src, uint32_t *dst, int32_t *seg, int64_t n, uint32_t eos,
                            int32_t count, int copy);

/* Scalar reference, branch-free: seg = count; count += (tok == eos). */
static int32_t run_scalar(const uint32_t *src, uint32_t *dst, int32_t *seg, int64_t n, uint32_t eos,
                          int32_t count, int copy) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t t = src[i];
        if (copy) dst[i] = t;
        seg[i] = count;
        count += (t == eos);
    }
    return count;
}

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define MARIN_X86 1
#include <immintrin.h>

/* Software prefetch this many tokens (2 KB) ahead: windows are ~16 KB at random places in the memory
   maps, and the hardware prefetcher restarts at every 4 KB page (measured ~15% faster). x86 prefetches
   never fault, so reading ahead past a window's end is harmless. */
#define PREFETCH 512

/* SSE2 (every x86-64): 8 tokens per step; EOS lanes -> 8-bit mask -> prefix from the table. */
static int32_t run_sse2(const uint32_t *src, uint32_t *dst, int32_t *seg, int64_t n, uint32_t eos,
                        int32_t count, int copy) {
    const __m128i e = _mm_set1_epi32((int)eos);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __builtin_prefetch(src + i + PREFETCH);
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 4));
        if (copy) {
            _mm_storeu_si128((__m128i *)(dst + i), a);
            _mm_storeu_si128((__m128i *)(dst + i + 4), b);
        }
        int m = _mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(a, e)))
              | (_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(b, e))) << 4);
        __m128i c = _mm_set1_epi32(count);
        _mm_storeu_si128((__m128i *)(seg + i), _mm_add_epi32(c, _mm_load_si128((const __m128i *)PREFIX[m])));
        _mm_storeu_si128((__m128i *)(seg + i + 4), _mm_add_epi32(c, _mm_load_si128((const __m128i *)(PREFIX[m] + 4))));
        count += POP[m];
    }
    return run_scalar(src + i, dst + i, seg + i, n - i, eos, count, copy);
}

/* AVX2 (chosen at run time): 16 tokens per step as two 8-lane blocks. */
__attribute__((target("avx2")))
static int32_t run_avx2(const uint32_t *src, uint32_t *dst, int32_t *seg, int64_t n, uint32_t eos,
                        int32_t count, int copy) {
    const __m256i e = _mm256_set1_epi32((int)eos);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __builtin_prefetch(src + i + PREFETCH);
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 8));
        if (copy) {
            _mm256_storeu_si256((__m256i *)(dst + i), a);
            _mm256_storeu_si256((__m256i *)(dst + i + 8), b);
        }
        int ma = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a, e)));
        int mb = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(b, e)));
        int32_t cb = count + POP[ma];
        _mm256_storeu_si256((__m256i *)(seg + i),
                            _mm256_add_epi32(_mm256_set1_epi32(count), _mm256_load_si256((const __m256i *)PREFIX[ma])));
        _mm256_storeu_si256((__m256i *)(seg + i + 8),
                            _mm256_add_epi32(_mm256_set1_epi32(cb), _mm256_load_si256((const __m256i *)PREFIX[mb])));
        count = cb + POP[mb];
    }
    return run_scalar(src + i, dst + i, seg + i, n - i, eos, count, copy);
}
#endif

static block_fn RUN = run_scalar;

/* Fill the tables and pick the widest implementation the CPU has. force: 0 best, 1 scalar, 2 SSE2. */
int marin_loader_init(int force) {
    for (int m = 0; m < 256; m++) {
        int32_t c = 0;
        for (int j = 0; j < 8; j++) {
            PREFIX[m][j] = c;
            c += (m >> j) & 1;
        }
        POP[m] = (uint8_t)c;
    }
    RUN = run_scalar;
#ifdef MARIN_X86
    if (force == 1) return 1;
    RUN = run_sse2;
    if (force == 2) return 2;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) { RUN = run_avx2; return 3; }
    return 2;
#else
    (void)force;
    return 1;
#endif
}

/* Batch of n_rows rows of row_len tokens: out and seg are contiguous [n_rows * row_len].
   row_ptr[r] != 0: row r is the row_len tokens at address row_ptr[r].
   row_ptr[r] == 0: row r is made of the next pieces of `extra` ((address, length) pairs, in order),
   whose lengths add up to row_len (windows that wrap around their source or cross a shard boundary);
   empty pieces are allowed anywhere.
   Returns 0, or -1 when the pieces do not add up (the output is then incomplete). */
int marin_fill_rows(int64_t n_rows, int64_t row_len, const uint64_t *row_ptr, int64_t n_extra,
                    const uint64_t *extra, uint32_t *out, int32_t *seg, uint32_t eos) {
    int64_t e = 0;
    for (int64_t r = 0; r < n_rows; r++) {
        uint32_t *o = out + r * row_len;
        int32_t *s = seg + r * row_len;
        if (row_ptr[r]) {
            RUN((const uint32_t *)(uintptr_t)row_ptr[r], o, s, row_len, eos, 0, 1);
            continue;
        }
        int64_t left = row_len;
        int32_t count = 0;
        while (left > 0 || (e < n_extra && extra[2 * e + 1] == 0)) {
            if (e >= n_extra) return -1;
            uint64_t len = extra[2 * e + 1];
            if (len > (uint64_t)left || (len > 0 && !extra[2 * e])) return -1;
            count = RUN((const uint32_t *)(uintptr_t)extra[2 * e], o, s, (int64_t)len, eos, count, 1);
            o += len;
            s += len;
            left -= (int64_t)len;
            e++;
        }
    }
    return e == n_extra ? 0 : -1;
}

/* Segment ids only, of an existing contiguous [n_rows, row_len] token array. */
void marin_segment_ids(int64_t n_rows, int64_t row_len, const uint32_t *tokens, int32_t *seg, uint32_t eos) {
    for (int64_t r = 0; r < n_rows; r++)
        RUN(tokens + r * row_len, NULL, seg + r * row_len, row_len, eos, 0, 0);
}
"""


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
