/* Decode attention on a CPU, read straight from the paged pool: each row is one new token's query, and its keys
   and values are the slots its block table names. ext/cpu_kernel.py builds this file with the system's C compiler
   (-O3 -march=native -fopenmp) and calls it through ctypes, after torch has loaded its own OpenMP runtime, so the
   rows are shared out among torch's threads, one row per thread at a time.
   Shapes, every array contiguous: q and out (B, H, D); k_pool and v_pool (slots, H, D), one layer's pool with its
   blocks flattened (slot = block * block_size + offset); table (B, W) int64 blocks; kv_len (B,) int64 keys.
   Built twice: REAL float (float32 pools, or bfloat16 ones: bf16 != 0) and REAL double (float64 pools, so that the
   tests hold it to the exact oracles). Scores, softmax and sums are in REAL; where the compiler targets AVX512-BF16,
   a bf16 pool's scores are products of bf16 pairs summed in float32 (dot_bf16). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef REAL
#define REAL float
#define EXP expf
#endif
typedef REAL real;

/* n values as reals: x itself, or converted into buf (bfloat16: its 16 bits are a float32's high half) */
static const real *as_reals(const void *x, int64_t n, int bf16, real *buf) {
    if (!bf16)
        return x;
    const uint16_t *half = x;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)half[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        buf[i] = f;
    }
    return buf;
}

/* value i of x: a real, or a bfloat16 (its 16 bits are a float32's high half) */
static inline real load(const void *x, int64_t i, int bf16) {
    if (!bf16)
        return ((const real *)x)[i];
    uint32_t u = (uint32_t)((const uint16_t *)x)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
/* q . k over D bfloat16 values (D a multiple of 32): AVX512-BF16's products of bf16 pairs, summed in float32,
   without widening each value first (1.15-1.25x a bf16 layer's decode attention alone on a Xeon with AMX) */
static inline float dot_bf16(const uint16_t *q, const uint16_t *k, int64_t D) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32)
        sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
    return _mm512_reduce_add_ps(sum);
}
#endif

/* float32 -> bfloat16, rounded to nearest even, as torch rounds */
static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
}

/* the first key of a row's block j, every head's: HD values of `size` bytes each */
static const char *block_start(const void *pool, const int64_t *blocks, int64_t j, int64_t block_size, int64_t HD,
                               int64_t size) {
    return (const char *)pool + blocks[j] * block_size * HD * size;
}

/* One row's L keys: scores (H, max_len), each head's softmax, then the weighted values summed into acc (H, D).
   Keys and values are read block by block and slot by slot, every head at once, as the pool lays them out.
   q: the row's query scaled, in reals; q16: as it came, where it is bf16 (the products in bf16 pairs, scaled after).
   Inlined, so that a constant D (the common head sizes, below) lets the compiler unroll the head's loops. */
static inline __attribute__((always_inline)) void attend_row(const real *q, const void *k_pool, const void *v_pool,
                                                             const int64_t *blocks, int64_t L, int64_t H, int64_t D,
                                                             int64_t block_size, int64_t max_len, int bf16,
                                                             real *scores, real *acc, const uint16_t *q16,
                                                             real scale) {
    int64_t HD = H * D, size = bf16 ? 2 : sizeof(real);
    for (int64_t j = 0, t = 0; t < L; j++) {
        const char *k = block_start(k_pool, blocks, j, block_size, HD, size);
        for (int64_t offset = 0; offset < block_size && t < L; offset++, t++, k += HD * size) {
#if defined(__AVX512BF16__)
            if (bf16 && D % 32 == 0) {
                for (int64_t h = 0; h < H; h++)
                    scores[h * max_len + t] = dot_bf16(q16 + h * D, (const uint16_t *)k + h * D, D) * scale;
                continue;
            }
#endif
            for (int64_t h = 0; h < H; h++) {
                real dot = 0;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++)
                    dot += q[h * D + d] * load(k, h * D + d, bf16);
                scores[h * max_len + t] = dot;
            }
        }
    }
    for (int64_t h = 0; h < H; h++) {
        real *s = scores + h * max_len, best = -INFINITY, total = 0;
        for (int64_t t = 0; t < L; t++)
            best = s[t] > best ? s[t] : best;
        for (int64_t t = 0; t < L; t++) {
            s[t] = EXP(s[t] - best);
            total += s[t];
        }
        for (int64_t t = 0; t < L; t++)
            s[t] /= total;
    }
    memset(acc, 0, sizeof(real) * HD);
    for (int64_t j = 0, t = 0; t < L; j++) {
        const char *v = block_start(v_pool, blocks, j, block_size, HD, size);
        for (int64_t offset = 0; offset < block_size && t < L; offset++, t++, v += HD * size) {
            for (int64_t h = 0; h < H; h++) {
                real p = scores[h * max_len + t];
#pragma omp simd
                for (int64_t d = 0; d < D; d++)
                    acc[h * D + d] += p * load(v, h * D + d, bf16);
            }
        }
    }
}

/* whether a row reads only what it has: at most its table's keys, each in a block of the pool */
static int row_fits(const int64_t *blocks, int64_t L, int64_t block_size, int64_t max_len, int64_t num_blocks) {
    if (L < 0 || L > max_len)
        return 0;
    for (int64_t j = 0; j * block_size < L; j++)
        if (blocks[j] < 0 || blocks[j] >= num_blocks)
            return 0;
    return 1;
}

/* The rows, shared among num_threads threads (torch's count: OpenMP keeps one per calling thread); returns 0, -1
   where a thread's scratch could not be allocated, or -2 where a row's keys run past its table or the pool (that
   row's output is not written; a scratch failure on another thread may say -1 instead). */
int decode_attend(const void *q, const void *k_pool, const void *v_pool, const int64_t *table, const int64_t *kv_len,
                  void *out, int64_t B, int64_t W, int64_t H, int64_t D, int64_t block_size, int64_t num_blocks,
                  double scale, int bf16, int num_threads) {
    int64_t HD = H * D, max_len = W * block_size, size = bf16 ? 2 : sizeof(real);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        real *scores = malloc(sizeof(real) * (H * max_len + 3 * HD)); /* then q, acc and q's buf: HD each */
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t b = 0; b < B; b++) {
            const int64_t *blocks = table + b * W;
            int fits = row_fits(blocks, kv_len[b], block_size, max_len, num_blocks);
            if (!fits) {
#pragma omp atomic write
                failed = 2;
            }
            if (!scores || !fits)
                continue;
            real *row_q = scores + H * max_len, *acc = row_q + HD, *buf = acc + HD;
            const uint16_t *q16 = (const uint16_t *)q + b * HD; /* read only where bf16 */
            const real *x = as_reals((const char *)q + b * HD * size, HD, bf16, buf);
            for (int64_t i = 0; i < HD; i++)
                row_q[i] = x[i] * (real)scale;
            /* the common head sizes, and bf16, as constants: the inlined row's loops unroll, and branch on neither */
#define ATTEND(BF16, HEAD_SIZE)                                                                                        \
    attend_row(row_q, k_pool, v_pool, blocks, kv_len[b], H, HEAD_SIZE, block_size, max_len, BF16, scores, acc, q16,    \
               (real)scale)
            if (bf16)
                D == 64 ? ATTEND(1, 64) : D == 32 ? ATTEND(1, 32) : ATTEND(1, D);
            else
                D == 64 ? ATTEND(0, 64) : D == 32 ? ATTEND(0, 32) : ATTEND(0, D);
            for (int64_t i = 0; i < HD; i++) {
                if (bf16)
                    ((uint16_t *)out)[b * HD + i] = to_bf16(acc[i]);
                else
                    ((real *)out)[b * HD + i] = acc[i];
            }
        }
        free(scores);
    }
    return -failed;
}
