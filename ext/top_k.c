/* Each row's k largest values, best first, with their ids (torch.topk's contract), in two passes over the row and
   no sort of it. Of equal values the lower id comes first (torch's own order among ties is unspecified); NaN goes
   above every number, as in torch.topk. sample.c's top-k rows and score_rows call top_k_row; top_k, over a whole
   array, is what the tests hold to a stable sort (kernel_topk). ext/cpu_kernel.py builds it beside
   decode_attention.c and sample.c, into one library.
   Shapes, every array contiguous: x (R, V) float32, V < 2**32; values (R, k) float32 and ids (R, k) int64. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#define GROUPS 1024 /* the first pass's groups, at least: with fewer its bar sits lower, and more ids pass it */

/* a value and its id as one integer that orders as the sampler does: a larger value is a larger key (NaN the
   largest), and of equal values the lower id */
static inline uint64_t key_of(float value, int64_t id) {
    uint32_t u;
    memcpy(&u, &value, 4);
    if (value != value)
        u = 0x7FC00000u; /* every NaN as one, above +inf */
    if (u == 0x80000000u)
        u = 0; /* -0.0 as 0.0: equal values, so the lower id first */
    u = u & 0x80000000u ? ~u : u | 0x80000000u;
    return (uint64_t)u << 32 | (uint32_t)~(uint32_t)id;
}

static inline float value_of(uint64_t key) {
    uint32_t u = key >> 32;
    u = u & 0x80000000u ? u & 0x7FFFFFFFu : ~u;
    float value;
    memcpy(&value, &u, 4);
    return value;
}

/* the median of three */
#define MEDIAN(a, b, c) ((a) > (b) ? ((b) > (c) ? (b) : (a) > (c) ? (c) : (a)) : ((a) > (c) ? (a) : (b) > (c) ? (c) : (b)))

/* Quickselect: reorders e[0..n) so that its k largest come first, and returns the k-th largest. Each partition
   moves every element, with no branch on its value (a logit's side of the pivot is a coin toss to the branch
   predictor): those above the pivot, then those equal to it. For keys (all distinct) and for floats (no NaN). */
#define QUICKSELECT(NAME, T)                                                                                           \
    static T NAME(T *e, int64_t n, int64_t k) {                                                                        \
        int64_t lo = 0, hi = n; /* the k-th largest lies in e[lo..hi) */                                               \
        while (hi - lo > 1) {                                                                                          \
            T pivot = MEDIAN(e[lo], e[lo + (hi - lo) / 2], e[hi - 1]);                                                 \
            int64_t above = lo, equal;                                                                                 \
            for (int64_t i = lo; i < hi; i++) {                                                                        \
                T v = e[i];                                                                                            \
                e[i] = e[above];                                                                                       \
                e[above] = v;                                                                                          \
                above += v > pivot;                                                                                    \
            }                                                                                                          \
            equal = above;                                                                                             \
            for (int64_t i = above; i < hi; i++)                                                                       \
                if (e[i] == pivot) {                                                                                   \
                    e[i] = e[equal];                                                                                   \
                    e[equal++] = pivot;                                                                                \
                }                                                                                                      \
            if (k <= above)                                                                                            \
                hi = above;                                                                                            \
            else if (k <= equal)                                                                                       \
                return pivot;                                                                                          \
            else                                                                                                       \
                lo = equal;                                                                                            \
        }                                                                                                              \
        return e[lo];                                                                                                  \
    }
QUICKSELECT(keep_largest_keys, uint64_t)
QUICKSELECT(kth_largest, float)

static int descending(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x < y) - (x > y);
}

/* whether any of x[0..16) is at least bar, or NaN: "not less than" holds for both */
static inline int any_at_least(const float *x, float bar) {
#if defined(__AVX512F__)
    return _mm512_cmp_ps_mask(_mm512_loadu_ps(x), _mm512_set1_ps(bar), _CMP_NLT_UQ) != 0;
#elif defined(__AVX__)
    __m256 b = _mm256_set1_ps(bar);
    __m256 above = _mm256_or_ps(_mm256_cmp_ps(_mm256_loadu_ps(x), b, _CMP_NLT_UQ),
                                _mm256_cmp_ps(_mm256_loadu_ps(x + 8), b, _CMP_NLT_UQ));
    return _mm256_movemask_ps(above) != 0;
#else
    int above = 0;
    for (int j = 0; j < 16; j++)
        above |= !(x[j] < bar);
    return above;
#endif
}

/* One row. The first pass takes the largest value of each of G groups of ids (group c: ids c, c + G, c + 2G, ...,
   so that it is a vectorized maximum of G values at once): the k-th largest of those maxima is at most the row's
   k-th value, as k groups hold one at least as large each. The second keeps only the ids at least as large, in
   runs of 16 read at once: on logits, a few more than k. A full buffer keeps its k largest and raises the bar. */
void top_k_row(const float *x, int64_t V, int64_t k, int64_t G, uint64_t *buf, int64_t capacity,
                      float *group_max, float *values, int64_t *ids) {
    float bar = -__builtin_inff();
    if (4 * G <= V) { /* groups of 4 ids at least; else every id goes to the buffer */
        for (int64_t c = 0; c < G; c++)
            group_max[c] = -__builtin_inff(); /* a NaN never enters (the max skips it), as kth_largest needs */
        for (int64_t s = 0; s < V / G; s++)
            for (int64_t c = 0; c < G; c++)
                group_max[c] = x[s * G + c] > group_max[c] ? x[s * G + c] : group_max[c];
        bar = kth_largest(group_max, G, k);
    }
    int64_t n = 0;
    for (int64_t i = 0; i < V; i += 16) {
        int64_t end = i + 16 < V ? i + 16 : V;
        if (end - i == 16 && !any_at_least(x + i, bar))
            continue;
        for (int64_t j = i; j < end; j++)
            if (!(x[j] < bar))
                buf[n++] = key_of(x[j], j);
        if (n + 16 > capacity) {
            bar = value_of(keep_largest_keys(buf, n, k));
            n = k;
            if (bar != bar) /* k NaNs kept: every id after them ranks below */
                break;
        }
    }
    keep_largest_keys(buf, n, k);
    qsort(buf, k, sizeof(uint64_t), descending);
    for (int64_t j = 0; j < k; j++) {
        values[j] = value_of(buf[j]);
        ids[j] = (uint32_t)~(uint32_t)buf[j];
    }
}

/* The rows, shared among num_threads threads, each row one thread's (so its result is the same whatever runs
   beside it); 0 < k <= V. Returns 0, or -1 where a thread's buffers could not be allocated. */
int top_k(const float *x, int64_t R, int64_t V, int64_t k, float *values, int64_t *ids, int num_threads) {
    int64_t G = 2 * k > GROUPS ? 2 * k : GROUPS, capacity = 2 * k + 1024;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        uint64_t *buf = malloc(sizeof(uint64_t) * capacity);
        float *group_max = malloc(sizeof(float) * G);
        if (!buf || !group_max) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++)
            if (buf && group_max)
                top_k_row(x + r * V, V, k, G, buf, capacity, group_max, values + r * k, ids + r * k);
        free(buf);
        free(group_max);
    }
    return -failed;
}
