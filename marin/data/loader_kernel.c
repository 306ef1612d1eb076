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
