/* Each row's next token, drawn as sampling.sample draws it (sampling.py), every row in one call: greedy rows take
   the first of their likeliest ids; sampled rows scale their logits by temperature, keep what top-k, top-p and min-p
   keep (cut_value's rules), and take the id whose CDF, in sampling.invert_cdf's order, first passes the row's u.
   What the core does with a dozen torch ops over (rows, candidates) tensors and a sort of whole rows (top-p
   alone), this does a row at a time in a thread's cache, with no sort of a row: a top-k row's candidates come from
   top_k.c; top-p alone, on a peaked row, takes its cut from the few values within 8 nats of the best, the rest
   weighed in float32 (draw_top_p_peaked), and elsewhere from a histogram of the row's float32 weights, sorting (by
   radix) only the bucket the cut falls in and its nonempty neighbours, where no rounding could move the cut
   (cut_top_p); a row without either sums the float32 weights of the runs of 64 ids that hold one its min-p keeps
   into block sums in one pass (row_block_sums). Each draws from float32 weights where no rounding could move its
   column (invert_cdf_near), and from exp_vec's elsewhere.
   The values it compares are the core's, bit for bit (the same float32 subtractions and divisions, sums in
   float64 stored as float32, as torch's CPU cumsum does); the weights are this file's exp, correctly rounded
   nearly always (torch's differs from it by an ulp in ~1% of values), and the long sums run in another order: a
   draw whose u falls within that rounding of a boundary may take the neighbouring id. Of tied candidates the
   lower id comes first, as in top_k.c. score_rows, at the end, gives ext/logprobs.py's scores the same way.
   Shapes, every array contiguous: logits (R, V) float32; tokens (R,) int64; the settings: sample_rows. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void top_k_row(const float *x, int64_t V, int64_t k, int64_t G, uint64_t *buf, int64_t capacity, float *group_max,
               float *values, int64_t *ids); /* top_k.c */

#define GROUPS 1024   /* top_k.c's */
#define BUCKETS 2048  /* top-p's histogram of a row's scaled values: its float64 sums (16 KB) in the L1 cache */
#define FLOOR -87.0f  /* the core clamps a cut-free row's scaled values here (sampling.sample) */
#define BLOCK 512     /* the draw's CDF: block sums first, then one block in order */
#define BAR -8.0f     /* top-p's candidates on a peaked row: the scaled values of at least this */
#define GATHERED (BAR - 0x1p-10f) /* ... and those a product with 1 / temperature scales to at least this */

/* A vector of floats, and of their bits: the CPU's widest, 16 floats with AVX-512, 8 with AVX (gcc 12 turns a wider
   vector's compares and selects into scalar code: 10x slower on an AVX2 EPYC). What it computes is the same for
   any width: exp is lane by lane, and the one float32 sum (log_total) keeps 16 sums whatever the width. */
#if defined(LANES) /* set by the build: a test of another width */
#elif defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
#if LANES != 4 && LANES != 8 && LANES != 16
#error "LANES must be 4, 8 or 16"
#endif
typedef float floats __attribute__((vector_size(4 * LANES)));
typedef int32_t ints __attribute__((vector_size(4 * LANES)));

#define SUMS (16 / LANES) /* a float32 sum's vectors: 16 sums, whatever the width (log_total, gather_candidates) */

static inline floats splat(float x) { return (floats){0} + x; }

static inline floats blend(ints mask, floats yes, floats no) {
    return (floats)((mask & (ints)yes) | (~mask & (ints)no));
}

/* whether any lane of mask is set: its halves OR-ed down to 16 bytes, in registers, then its two 64-bit halves */
static inline int any_of(ints mask) {
    typedef int32_t quad __attribute__((vector_size(16)));
    typedef int64_t pair __attribute__((vector_size(16)));
#if LANES == 16
    typedef int32_t eight __attribute__((vector_size(32)));
    eight half = __builtin_shufflevector(mask, mask, 0, 1, 2, 3, 4, 5, 6, 7) |
                 __builtin_shufflevector(mask, mask, 8, 9, 10, 11, 12, 13, 14, 15);
    quad q = __builtin_shufflevector(half, half, 0, 1, 2, 3) | __builtin_shufflevector(half, half, 4, 5, 6, 7);
#elif LANES == 8
    quad q = __builtin_shufflevector(mask, mask, 0, 1, 2, 3) | __builtin_shufflevector(mask, mask, 4, 5, 6, 7);
#else
    quad q = mask;
#endif
    pair p = (pair)q;
    return (p[0] | p[1]) != 0;
}

/* a vector's lanes, its first half and its second (__builtin_shufflevector's indices) */
#if LANES == 16
#define LOW_HALF 0, 1, 2, 3, 4, 5, 6, 7
#define HIGH_HALF 8, 9, 10, 11, 12, 13, 14, 15
#elif LANES == 8
#define LOW_HALF 0, 1, 2, 3
#define HIGH_HALF 4, 5, 6, 7
#else
#define LOW_HALF 0, 1
#define HIGH_HALF 2, 3
#endif

/* half a vector's floats, and as many float64 and their bits */
typedef float halves __attribute__((vector_size(2 * LANES)));
typedef double doubles __attribute__((vector_size(4 * LANES)));
typedef int64_t longs __attribute__((vector_size(4 * LANES)));

/* exp(x) in float64: 2**n e**r, n the integer nearest x / ln(2), |r| <= ln(2) / 2, e**r by a polynomial of degree
   8 (Chebyshev's interpolant: relative error ~1e-12). n is rounded by adding 1.5 * 2**52, which leaves it in the
   low bits of the sum, where 2**n's exponent bits are made from it: no conversion to or from an integer (and no
   -ffast-math, which would fold the addition away: FLAGS in cpu_kernel.py). */
static inline doubles exp_doubles(doubles x) {
    const double round = 0x1.8p52;
    doubles shifted = x * 0x1.71547652b82fep0 + round;
    doubles nf = shifted - round;
    doubles r = x - nf * 0x1.62e42fefa39efp-1 - nf * 0x1.abc9e3b39803fp-56;
    static const double coefficient[] = {0x1.a1aa80fc243f7p-13, 0x1.6c164ddf3675bp-10, 0x1.111080ac9d62dp-7,
                                         0x1.5555557432adbp-5,  0x1.555555a26f360p-3,  0x1.fffffffff712ap-2,
                                         0x1.ffffffffd38acp-1,  0x1.0000000000003p+0};
    doubles y = (doubles){0} + 0x1.a15a6a42fed17p-16;
    for (int i = 0; i < 8; i++)
        y = y * r + coefficient[i];
    return y * (doubles)(((longs)shifted + 1023) << 52); /* 2**n */
}

/* exp(x) of x <= 0, in float64 rounded to float32: the correctly rounded exp, nearly always. torch's CPU exp nearly
   always is too: the two differ by an ulp in ~1% of values (a float32 polynomial, Cephes', in ~10%, and on one side
   more often than the other). 0 below -87.3, where torch gives denormals that no draw can tell from 0. */
static inline floats exp_vec(floats x) {
    ints below = x < splat(-87.3f);
    floats t = blend(below, splat(-87.3f), x);
    halves lo = __builtin_shufflevector(t, t, LOW_HALF), hi = __builtin_shufflevector(t, t, HIGH_HALF);
    lo = __builtin_convertvector(exp_doubles(__builtin_convertvector(lo, doubles)), halves);
    hi = __builtin_convertvector(exp_doubles(__builtin_convertvector(hi, doubles)), halves);
    floats e = __builtin_shufflevector(lo, hi, LOW_HALF, HIGH_HALF); /* in registers: a copy through memory of two
                                                                          halves stalled the load of the whole */
    return blend(below, splat(0.0f), e);
}

/* exp(x) of x <= 0 in float32 (Cephes' expf's polynomial, n rounded as exp_doubles rounds it), three times as fast
   as exp_vec: on [-87, 0] within 2**-23 of exp_vec's, relative (tests/test_cpu_kernel.py checks every float there,
   as this CPU's build computes it), which invert_cdf_near's bound rests on; a logsumexp reads it too. x below -87.3
   (-inf too) weighs e**-87.3, ~1.2e-38: nothing beside the row's best, whose weight is 1. */
static inline floats exp_vec_float(floats x) {
    const float round = 0x1.8p23f;
    floats t = blend(x < splat(-87.3f), splat(-87.3f), x); /* NaN stays */
    floats shifted = t * 0x1.715476p0f + round;
    floats nf = shifted - round;
    floats r = t - nf * 0.693359375f + nf * 2.12194440e-4f;
    floats y = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
                1.6666665459e-1f) * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    return y * (floats)(((ints)shifted + 127) << 23); /* 2**n */
}

/* x[i..i+LANES) as a vector, padded with pad past n */
static inline floats load_vec(const float *x, int64_t i, int64_t n, float pad) {
    typedef float unaligned __attribute__((vector_size(4 * LANES), aligned(4)));
    if (i + LANES <= n)
        return *(const unaligned *)(x + i);
    floats v = splat(pad);
    memcpy(&v, x + i, sizeof(float) * (n - i));
    return v;
}

/* v's first m values into x: a whole vector's store, or a tail's */
static inline void store_vec(void *x, floats v, int64_t m) {
    if (m == LANES)
        memcpy(x, &v, sizeof v);
    else
        memcpy(x, &v, sizeof(float) * m);
}

/* x[i] = (row[i] - best) / temperature, at least floor (the core's clamp: NaN stays), a vector at a time */
static void scale_row(const float *row, int64_t n, float best, float temperature, float floor, float *x) {
    for (int64_t i = 0; i < n; i += LANES) {
        floats v = load_vec(row, i, n, best);
        v = (v - best) / temperature;
        store_vec(x + i, blend(v < splat(floor), splat(floor), v), n - i < LANES ? n - i : LANES);
    }
}

/* w[i] = exp_vec(x[i]) where the draw reads it: a run of 64 values with none at least kept (NaN never is) takes no
   exp, and its w is left as it was: every reader of w reads w[i] only where x[i] >= kept. A peaked row's min-p keeps
   a few ids: most runs are skipped. (A top-k row's kept is -inf: only runs of NaN are skipped.) */
static inline void weigh_kept(const float *x, int64_t n, float kept, float *w) {
    for (int64_t run = 0; run < n; run += 64) {
        int64_t end = run + 64 < n ? run + 64 : n;
        ints any_kept = {0};
        for (int64_t i = run; i < end; i += LANES) /* padded with NaN, which no kept is */
            any_kept |= load_vec(x, i, end, __builtin_nanf("")) >= splat(kept);
        if (!any_of(any_kept))
            continue;
        for (int64_t i = run; i < end; i += LANES) {
            floats v = load_vec(x, i, end, 0);
            store_vec(w + i, exp_vec(v), end - i < LANES ? end - i : LANES);
        }
    }
}

/* one value's weight: exp_vec's, so that it equals the same value's weight in a row */
static inline float exp_le0(float x) { return exp_vec(splat(x))[0]; }

static inline float max_of(float a, float b) { return a > b || a != a ? a : b; } /* torch.maximum: NaN wins */

/* A row's range, a vector at a time: -> its largest value, NaN ignored; *nan: whether any is NaN; *least: its least;
   *least_finite: its least above -inf (the padding ids' -inf would stretch top-p's histogram to FLOOR) */
static float row_range(const float *x, int64_t n, int *nan, float *least, float *least_finite) {
    floats best = splat(x[0]), low = splat(x[0]), low_finite = splat(__builtin_inff());
    ints any_nan = {0};
    for (int64_t i = 0; i < n; i += LANES) {
        floats v = load_vec(x, i, n, x[0]);
        best = blend(v > best, v, best);
        low = blend(v < low, v, low);
        low_finite = blend((v < low_finite) & (v > splat(-__builtin_inff())), v, low_finite);
        any_nan |= v != v;
    }
    float largest = best[0];
    *nan = 0, *least = low[0], *least_finite = low_finite[0];
    for (int j = 0; j < LANES; j++) {
        largest = best[j] > largest ? best[j] : largest;
        *least = low[j] < *least ? low[j] : *least;
        *least_finite = low_finite[j] < *least_finite ? low_finite[j] : *least_finite;
        *nan |= any_nan[j] != 0;
    }
    return largest;
}

/* A row's largest value, NaN ignored, two vectors at a time (two chains of compares, each half as long as
   row_range's): row_range's, for a row that needs no least; *nan: whether any is NaN */
static float row_best(const float *x, int64_t n, int *nan) {
    floats even = splat(x[0]), odd = even;
    ints any_nan = {0};
    for (int64_t i = 0; i < n; i += 2 * LANES) {
        floats a = load_vec(x, i, n, x[0]), b = i + LANES < n ? load_vec(x, i + LANES, n, x[0]) : splat(x[0]);
        even = blend(a > even, a, even);
        odd = blend(b > odd, b, odd);
        any_nan |= (a != a) | (b != b);
    }
    float best = even[0];
    *nan = 0;
    for (int j = 0; j < LANES; j++) {
        best = even[j] > best ? even[j] : best;
        best = odd[j] > best ? odd[j] : best;
        *nan |= any_nan[j] != 0;
    }
    return best;
}

/* The first id of the largest value (NaN above every number), as numpy's argmax, in one pass: each lane keeps its
   largest and the first vector's run it was in. */
static int64_t argmax(const float *x, int64_t V) {
    floats best = splat(x[0]);
    ints run = {0}, any_nan = {0};
    for (int64_t i = 0; i < V; i += LANES) {
        floats v = load_vec(x, i, V, x[0]);
        ints above = v > best;
        best = blend(above, v, best);
        run = (ints)blend(above, (floats)((ints){0} + (int32_t)(i / LANES)), (floats)run);
        any_nan |= v != v;
    }
    int64_t first = 0;
    for (int j = 0; j < LANES; j++) {
        if (any_nan[j]) { /* numpy's argmax: the first NaN */
            for (int64_t i = 0; i < V; i++)
                if (x[i] != x[i])
                    return i;
        }
        int64_t id = LANES * (int64_t)run[j] + j, best_id = LANES * (int64_t)run[first] + first;
        if (best[j] > best[first] || (best[j] == best[first] && id < best_id))
            first = j;
    }
    return LANES * (int64_t)run[first] + first;
}

/* the kept weights of x[start..end) (x[i] >= kept), summed in float64 in 8 lanes, so that the sum vectorizes */
static double kept_sum(const float *x, const float *w, int64_t start, int64_t end, float kept) {
    double sum = 0, lane[8] = {0};
    int64_t i = start;
    for (; i + 8 <= end; i += 8)
        for (int j = 0; j < 8; j++)
            lane[j] += x[i + j] >= kept ? w[i + j] : 0.0f;
    for (; i < end; i++)
        sum += x[i] >= kept ? w[i] : 0.0f;
    for (int j = 0; j < 8; j++)
        sum += lane[j];
    return sum;
}

/* The kept weights (x[i] >= kept) of x[0..n) summed block by block into block_sum (n / BLOCK + 1 of them) */
static void block_sums(const float *x, const float *w, int64_t n, float kept, double *block_sum) {
    for (int64_t start = 0; start < n; start += BLOCK)
        block_sum[start / BLOCK] = kept_sum(x, w, start, start + BLOCK < n ? start + BLOCK : n, kept);
}

/* The first i whose CDF over the kept values (x[i] >= kept, weight w[i]) passes u of their sum, or n - 1 where
   rounding leaves none: invert_cdf. The blocks' sums (block_sums) find the block, which is then summed in order.
   wide: the core's u is float64 (torch's default dtype), and so is its target. */
static int64_t invert_cdf(const float *x, const float *w, int64_t n, float kept, float u, int wide,
                          const double *block_sum) {
    int64_t blocks = (n + BLOCK - 1) / BLOCK, b = 0;
    double sum = 0, cdf = 0;
    for (int64_t c = 0; c < blocks; c++)
        sum += block_sum[c];
    float total = (float)sum;
    double target = wide ? (double)u * total : (double)(u * total);
    while (b < blocks - 1 && (float)(cdf + block_sum[b]) <= target)
        cdf += block_sum[b++];
    for (int64_t i = b * BLOCK; i < n; i++) {
        cdf += x[i] >= kept ? w[i] : 0.0f;
        if ((float)cdf > target)
            return i;
    }
    return n - 1;
}

/* the core's target, u of the kept weights' sum as it reads it (float32), in its dtype (invert_cdf's) */
static double target_of(float u, double sum, int wide) {
    float total = (float)sum;
    return wide ? (double)u * total : (double)(u * total);
}

/* the relative error of a sum of weights within 2**-23 of exp_vec's each (exp_vec_float's), with float64's
   rounding of the sum: invert_cdf_near's and cut_top_p's bound */
#define NEAR 0x1p-22

/* cut_sorted's walk over x[0..n), sorted best first, while not below floor: the mass before each value (*before: the
   mass above x[0], then to the value the walk stopped at) until it reaches target -> where the walk stopped;
   *last_kept: the value before it (as it was where the walk stopped at once); *mass: the mass before the value it
   stopped at, in float32 as the core's */
static int64_t walk(const float *x, int64_t n, float floor, double target, double *before, float *last_kept,
                    float *mass) {
    int64_t i = 0;
    for (; i < n && !(x[i] < floor); i++) {
        float p = exp_le0(x[i]);
        *before += p;
        if ((*mass = (float)*before - p) >= target)
            break;
        *last_kept = x[i];
    }
    return i;
}

/* x[0..n): scaled values, best first, w their weights -> the least value that top-k (its k-th, and any tied with
   it), top-p and min-p (least) keep: cut_value. */
static float cut_sorted(const float *x, const float *w, int64_t n, int64_t k, float top_p, float least) {
    float kth = x[k - 1], last_kept = -__builtin_inff();
    if (top_p < 1) {
        double mass = 0;
        for (int64_t i = 0; i < n; i++)
            mass += x[i] >= kth ? w[i] : 0.0f;
        float target = top_p * (float)mass;
        int64_t i = 0;
        mass = 0;
        for (; i < n; i++) { /* the first whose mass before it reaches the target: the one before it is the last kept */
            float p = x[i] >= kth ? w[i] : 0.0f;
            mass += p;
            if ((float)mass - p >= target)
                break;
        }
        last_kept = x[i > 0 ? (i < n ? i - 1 : n - 1) : 0];
    }
    return max_of(max_of(kth, least), last_kept);
}

/* Per thread: a cut-free row's scaled values and weights; a top-k row's candidates and top_k.c's buffers;
   top-p's histogram and window; the draw's block sums. */
struct scratch {
    float *x, *w, *values, *group_max, *window;
    int64_t *ids;
    int64_t sorted; /* how many of the row's best values lie in values and ids, best first (a top-k row's draw's) */
    uint64_t *keys;
    double *bucket_mass, *block_sum;
};

static pthread_key_t scratch_key;
static pthread_once_t scratch_key_once = PTHREAD_ONCE_INIT;
static void make_scratch_key(void) { pthread_key_create(&scratch_key, free); } /* freed as its thread ends */

/* The calling thread's scratch for rows of V ids, in one block kept for its next call (torch's threads live on, and
   a fresh block's pages would fault in again at every step), freed when the thread ends; 0 where it cannot be
   allocated. The block begins with the V it was cut for. */
static int scratch_for(int64_t V, struct scratch *s) {
    int64_t G = 2 * V > GROUPS ? 2 * V : GROUPS, keys = 2 * V + 1024, blocks = V / BLOCK + 1;
    pthread_once(&scratch_key_once, make_scratch_key);
    int64_t *block = pthread_getspecific(scratch_key);
    if (!block || block[0] != V) {
        free(block);
        block = malloc(sizeof(int64_t) * (1 + V) + sizeof(uint64_t) * keys + sizeof(double) * (BUCKETS + blocks) +
                       sizeof(float) * (4 * V + G));
        pthread_setspecific(scratch_key, block);
        if (!block)
            return 0;
        block[0] = V;
    }
    s->ids = block + 1;
    s->keys = (uint64_t *)(s->ids + V);
    s->bucket_mass = (double *)(s->keys + keys);
    s->block_sum = s->bucket_mass + BUCKETS;
    s->x = (float *)(s->block_sum + blocks);
    s->w = s->x + V;
    s->values = s->w + V;
    s->window = s->values + V;
    s->group_max = s->window + V;
    return 1;
}

/* top_k_row's groups for the k best of V: GROUPS, fewer where V is short (groups of 4 ids at least, so that its
   first pass still sets a bar: at V = 2,048, the shipped model's, 512), and at least 2k */
static int64_t groups_for(int64_t k, int64_t V) {
    int64_t G = V / 4 < GROUPS ? V / 4 : GROUPS;
    return G > 2 * k ? G : 2 * k;
}

/* A row with a top_k: its k best and one more, scaled; more where ties with the k-th run past them (top-p's mass
   holds them all, as the core's does). */
static int64_t draw_top_k(const float *row, int64_t V, int64_t k, float temperature, float top_p, float least, float u,
                          int wide, struct scratch *s) {
    int64_t K = k + 1 < V ? k + 1 : V;
    for (;;) {
        int64_t G = groups_for(K, V);
        top_k_row(row, V, K, G, s->keys, 2 * K + 1024, s->group_max, s->values, s->ids);
        scale_row(s->values, K, s->values[0], temperature, -__builtin_inff(), s->x);
        weigh_kept(s->x, K, -__builtin_inff(), s->w);
        if (K < V && s->x[K - 1] >= s->x[k - 1]) {
            K = 2 * (K - 1) + 1 < V ? 2 * (K - 1) + 1 : V;
            continue;
        }
        float kept = cut_sorted(s->x, s->w, K, k, top_p, least);
        block_sums(s->x, s->w, K, kept, s->block_sum);
        s->sorted = K; /* the raw values, as top_k_row left them: a score of the row reads its best there */
        return s->ids[invert_cdf(s->x, s->w, K, kept, u, wide, s->block_sum)];
    }
}

/* x[0..n) sorted, largest first (NaN aside), by a radix sort of their bits made monotone: 4 passes of a byte,
   through tmp (n), whatever the values: a window of every id (a row of one value) too */
static void sort_descending(float *x, int64_t n, uint32_t *tmp) {
    uint32_t *key = (uint32_t *)x, *from = key, *to = tmp;
    for (int64_t i = 0; i < n; i++) /* larger float, smaller key: the complement of the bits made ascending */
        key[i] = key[i] & 0x80000000u ? key[i] : ~(key[i] | 0x80000000u);
    for (int shift = 0; shift < 32; shift += 8) {
        int64_t start[257] = {0};
        for (int64_t i = 0; i < n; i++)
            start[(from[i] >> shift & 0xFF) + 1]++;
        for (int d = 0; d < 256; d++)
            start[d + 1] += start[d];
        for (int64_t i = 0; i < n; i++)
            to[start[from[i] >> shift & 0xFF]++] = from[i];
        uint32_t *swap = from;
        from = to;
        to = swap;
    }
    for (int64_t i = 0; i < n; i++) /* four passes: the keys are back in x */
        key[i] = key[i] & 0x80000000u ? key[i] : ~key[i] & 0x7FFFFFFFu;
}

/* the histogram's bucket of each scaled value: [low, 0] cut into BUCKETS - 1, the best first (scale: their number
   over -low); values at FLOOR and NaN in the last */
static inline ints bucket_of(floats v, float scale) {
    ints b = __builtin_convertvector(-v * scale, ints);
    return (ints)blend((b >= 0) & (b < BUCKETS - 1) & (v > splat(FLOOR)), (floats)b, (floats)(b * 0 + BUCKETS - 1));
}

/* scale_row's x, and every value's weight w, for a top-p row, and in the same pass each value's weight summed into
   its bucket's mass, 256 ids at a time (their buckets kept in the L1 cache). exact: exp_vec's weights, else
   exp_vec_float's. */
static void scale_into_buckets(const float *row, int64_t n, float best, float temperature, float scale, int exact,
                               struct scratch *s) {
    double *mass = s->bucket_mass;
    memset(mass, 0, sizeof(double) * BUCKETS);
    for (int64_t start = 0; start < n; start += 256) {
        int64_t end = start + 256 < n ? start + 256 : n;
        int32_t bucket[256];
        for (int64_t i = start; i < end; i += LANES) {
            int64_t m = end - i < LANES ? end - i : LANES;
            floats v = load_vec(row, i, end, best);
            v = (v - best) / temperature;
            v = blend(v < splat(FLOOR), splat(FLOOR), v);
            store_vec(s->x + i, v, m);
            store_vec(s->w + i, exact ? exp_vec(v) : exp_vec_float(v), m);
            store_vec(bucket + (i - start), (floats)bucket_of(v, scale), m);
        }
        for (int64_t i = start; i < end; i++) /* from memory: a lane of a vector register is a trip through the stack */
            mass[bucket[i - start]] += s->w[i];
    }
}

/* the lanes of v outside [lower, upper] (NaN is not) */
static inline ints outside(floats v, float lower, float upper) { return (v > splat(upper)) | (v < splat(lower)); }

/* Top-p alone: the least value kept, cut_sorted's over the row sorted, without sorting it, into *kept. The row's
   weights go into buckets of its scaled values; the bucket where their mass reaches top_p of the whole holds the
   cut, and it is sorted, with the nonempty buckets on either side, and walked as cut_sorted walks the row. near:
   the weights' error, relative (0 for exp_vec's; NEAR for exp_vec_float's, as invert_cdf_near reads them). The
   window is walked twice, with the mass before it and the target at the ends of their intervals that stop the walk
   soonest and latest -> 1 where both stop at the same value (past the window's first), the core's stop; else 0. */
static int cut_top_p(const float *x, int64_t V, float scale, float top_p, float least, float smallest, double near,
                     float *kept, struct scratch *s) {
    double *mass = s->bucket_mass, total = 0, before = 0;
    for (int b = 0; b < BUCKETS; b++)
        total += mass[b];
    float target = top_p * (float)total;
    int b = 0;
    while (b < BUCKETS - 1 && (float)(before + mass[b]) < target)
        before += mass[b++];
    int lo = b, hi = b;
    while (lo > 0 && mass[lo - 1] == 0)
        lo--;
    if (lo > 0)
        lo--; /* the nonempty bucket before: the last kept may be its smallest */
    before = 0;
    for (int c = 0; c < lo; c++)
        before += mass[c];
    while (hi < BUCKETS - 1 && mass[hi + 1] == 0)
        hi++;
    if (hi < BUCKETS - 1)
        hi++; /* the nonempty bucket after: the first past the target may be its largest */
    /* A bucket falls as its values rise (NaN aside): the window's values lie in [lower, upper], each widened past the
       product's rounding. A run of 64 is tested against those, then the vectors of a run with one there (or NaN)
       bucket by bucket. */
    float upper = -lo / scale, lower = hi < BUCKETS - 1 ? -(hi + 1) / scale : -__builtin_inff();
    upper -= upper * 0x1p-20f, lower += lower * 0x1p-20f;
    int64_t n = 0;
    for (int64_t run = 0; run < V; run += 64) {
        int64_t end = run + 64 < V ? run + 64 : V;
        ints out = ~(ints){0};
        for (int64_t i = run; i < end; i += LANES) /* padded with x[i] */
            out &= outside(load_vec(x, i, end, x[i]), lower, upper);
        for (int64_t i = run; any_of(~out) && i < end; i += LANES) {
            floats v = load_vec(x, i, end, x[i]);
            if (!any_of(~outside(v, lower, upper)))
                continue;
            ints bucket = bucket_of(v, scale), in = (bucket >= lo) & (bucket <= hi);
            for (int64_t j = 0; j < LANES && i + j < end; j++) {
                s->window[n] = x[i + j];
                n += in[j] != 0;
            }
        }
    }
    sort_descending(s->window, n, (uint32_t *)s->ids);
    double before_soon = before * (1 + near), before_late = before * (1 - near);
    float last_kept = n ? s->window[0] : smallest, last_kept_late = last_kept, reached;
    int64_t i = walk(s->window, n, -__builtin_inff(), top_p * (float)(total * (1 - near)), &before_soon, &last_kept,
                     &reached);
    int64_t late = walk(s->window, n, -__builtin_inff(), top_p * (float)(total * (1 + near)), &before_late,
                        &last_kept_late, &reached);
    if (i == n && hi == BUCKETS - 1)
        last_kept = smallest; /* none past the target: the core's search ends on the row's last */
    *kept = max_of(max_of(smallest, least), last_kept);
    return near == 0 || (i == late && i > 0 && (i < n || hi == BUCKETS - 1));
}

/* a run of 64 logits from x[run..V): a pointer into x, or tail holding the last run padded with -inf */
static const float *run_of(const float *x, int64_t run, int64_t V, float *tail) {
    if (run + 64 <= V)
        return x + run;
    for (int64_t i = 0; i < 64; i++)
        tail[i] = run + i < V ? x[run + i] : -__builtin_inff();
    return tail;
}

/* x[0..64): its largest, or m if larger (NaN ignored) */
static float run_max(const float *x, float m) {
    floats top = splat(m);
    for (int k = 0; k < 64; k += LANES) {
        floats v = load_vec(x, k, 64, m);
        top = blend(v > top, v, top);
    }
    for (int j = 0; j < LANES; j++)
        m = top[j] > m ? top[j] : m;
    return m;
}

/* Candidates s->window[0..n) (logits) that the best m, risen since they were gathered, leaves below GATHERED:
   their weights (exp_vec_float's, as the pass weighs the rest) into *rest, and the others kept in order -> how many
   are kept */
static int64_t prune(struct scratch *s, int64_t n, float m, float inverse, double *rest) {
    int64_t kept = 0;
    for (int64_t j = 0; j < n; j++) {
        float approximate = (s->window[j] - m) * inverse;
        if (approximate < GATHERED) {
            *rest += exp_vec_float(splat(approximate))[0];
            continue;
        }
        s->window[kept] = s->window[j];
        s->ids[kept++] = s->ids[j];
    }
    return kept;
}

/* A run's candidates x[0..64) (ids run..), those whose logits scaled against m are at least GATHERED, appended
   to s->window[0..n) and s->ids -> how many then, pruned first (*pruned: the weights pruned) where a run's more
   could pass cap, or -1 where more than cap / 2 - 64 stay (a flat row) */
static int64_t append_candidates(const float *x, int64_t run, int64_t V, float m, float inverse, int64_t cap, int64_t n,
                                 double *pruned, struct scratch *s) {
    if (n + 64 > cap && (n = prune(s, n, m, inverse, pruned)) + 64 > cap / 2) /* once a run: the same at every width */
        return -1;
    for (int k = 0; k < 64 && run + k < V; k += LANES) {
        floats v = load_vec(x, k, 64, 0);
        ints candidate = (v - m) * inverse >= splat(GATHERED);
        if (!any_of(candidate))
            continue;
        for (int j = 0; j < LANES; j++) {
            s->window[n] = v[j];
            s->ids[n] = run + k + j;
            n += candidate[j] != 0;
        }
    }
    return n;
}

/* A top-p row's candidates, in one pass with no pass before it for the row's best: each id whose logit, scaled
   against the best so far, is at least BAR or close below it, with its logit, in id order, into s->window and
   s->ids -> how many, or -1 where more than cap / 2 stay after a prune (a flat row: its histogram costs less than
   this pass). The weight of the rest goes into *rest, summed against the best so far (rescaled where it rises);
   *best: the row's largest logit, NaN ignored, as row_range's. Which ids, and the rest's weights, come from values
   scaled by a product with 1 / temperature, a few ulps from the core's quotient (hence "close below"), and
   weighed by exp_vec_float. The weights are summed in float32 in 16 sums (id i's in sum i % 16) for a run of 64
   ids, then in float64: the same at every vector width. A row with NaN, or an infinite best, sums to NaN. */
static int64_t gather_candidates(const float *row, int64_t V, float temperature, int64_t cap, double *rest, float *best,
                                 struct scratch *s) {
    const float inverse = 1 / temperature;
    float m = row[0], tail[64];
    double sum[16] = {0}, pruned = 0;
    int64_t n = 0;
    for (int64_t run = 0; run < V; run += 64) {
        const float *x = run_of(row, run, V, tail);
        float run_best = run_max(x, m);
        if (run_best > m) { /* the sums so far, against the new best */
            double scale = exp(((double)m - run_best) * inverse);
            for (int j = 0; j < 16; j++)
                sum[j] *= scale;
            pruned *= scale;
            m = run_best;
        }
        floats part[SUMS] = {0};
        ints any = {0};
        for (int k = 0; k < 64; k += LANES) {
            floats v = (load_vec(x, k, 64, 0) - m) * inverse;
            ints candidate = v >= splat(GATHERED);
            part[k / LANES % SUMS] += blend(candidate, splat(0.0f), exp_vec_float(v));
            any |= candidate;
        }
        for (int j = 0; j < 16; j++)
            sum[j] += part[j / LANES][j % LANES];
        if (any_of(any) && (n = append_candidates(x, run, V, m, inverse, cap, n, &pruned, s)) < 0)
            return -1;
    }
    *rest = pruned, *best = m;
    for (int j = 0; j < 16; j++)
        *rest += sum[j];
    return prune(s, n, m, inverse, rest);
}

/* Top-p on a peaked row, whose kept ids lie among the few of at least BAR: the cut from those alone, sorted, and the
   draw among those it keeps, in id order (the others weigh nothing in the core's CDF). The rest's weights, from
   exp_vec_float, move only the row's sum, which the core reads in float32: the cut is taken only where they cannot
   move it (below). -> the id, or -1 where the row is flat, holds NaN or an infinite best, or its cut may lie below
   BAR, or may move (the histogram's path then). */
static int64_t draw_top_p_peaked(const float *row, int64_t V, float temperature, float top_p, float least, float u,
                                 int wide, struct scratch *s) {
    double rest, before = 0;
    float best, inverse = 1 / temperature;
    int64_t n = gather_candidates(row, V, temperature, V / 32 + 512 < V ? V / 32 + 512 : V, &rest, &best, s);
    if (n <= 0 || !(rest < __builtin_inf()) || !(inverse < __builtin_inff()))
        return -1;
    for (int64_t j = 0; j < n; j++) /* scaled as the core scales them */
        s->window[j] = (s->window[j] - best) / temperature;
    weigh_kept(s->window, n, -__builtin_inff(), s->w);
    /* The core's target lies within low..high. The rest's weights, each this file's float32 exp of a product, and
       of a difference from the best so far where the best rose (a value x off by up to ~5 |x| ulps, which move its
       weight by as many), are within 2**-16 of the core's down to 50 nats; past 40 nats they weigh below 1e-17
       each. Then the float32 roundings of the sum and of top_p x it (the 2**-22 also holds the ulp by which this
       file's exp of a candidate may differ from torch's, as the histogram's path's would). */
    double gathered = kept_sum(s->window, s->w, 0, n, -__builtin_inff()), error = rest * 0x1p-16 + V * 1e-17;
    double low = top_p * (rest + gathered - error) * (1 - 0x1p-22);
    double high = top_p * (rest + gathered + error) * (1 + 0x1p-22);
    if (gathered * (1 + 0x1p-20) < low) /* the cut lies below BAR: no walk reaches low */
        return -1;
    memcpy(s->values, s->window, sizeof(float) * n);
    sort_descending(s->values, n, (uint32_t *)s->keys);
    float last_kept = s->values[0], mass = 0;
    int64_t i = walk(s->values, n, BAR, low, &before, &last_kept, &mass); /* over the values surely gathered */
    /* The core's walk stops where this one does, wherever its target lies: past low here means past high. Past the
       values surely gathered, the value the core reads next weighs less than e**-8 of the best, and the mass before
       it must pass high beyond float32's rounding; else the cut may lie below BAR. */
    if (i < n && s->values[i] >= BAR ? !(mass >= high) : !(before * (1 - 0x1p-20) >= high))
        return -1;
    float kept = max_of(least, last_kept);
    block_sums(s->window, s->w, n, kept, s->block_sum);
    int64_t j = invert_cdf(s->window, s->w, n, kept, u, wide, s->block_sum);
    while (j > 0 && !(s->window[j] >= kept)) /* rounding left none: the core's CDF passes at its last kept or before */
        j--;
    return s->ids[j];
}

/* top-p alone's least value kept (cut_top_p), from float32 weights first where near, and else, or where that cut is
   in doubt, from exp_vec's (*rough then 0): s->x and s->w then hold the row's values and the weights it was cut by */
static float top_p_kept(const float *row, int64_t V, float best, float lowest, float lowest_finite, float temperature,
                        float top_p, float least, int near, int *rough, struct scratch *s) {
    float smallest = (lowest - best) / temperature, low = (lowest_finite - best) / temperature, kept;
    smallest = smallest < FLOOR ? FLOOR : smallest; /* the least scaled value (the core's kth) */
    low = low > FLOOR && low < 0 ? low : FLOOR;      /* the histogram's range */
    float scale = (BUCKETS - 1) / -low;
    if (near) {
        scale_into_buckets(row, V, best, temperature, scale, 0, s);
        if (cut_top_p(s->x, V, scale, top_p, least, smallest, NEAR, &kept, s))
            return kept;
    }
    *rough = 0;
    scale_into_buckets(row, V, best, temperature, scale, 1, s);
    cut_top_p(s->x, V, scale, top_p, least, smallest, 0, &kept, s);
    return kept;
}

/* invert_cdf's column, from block sums of weights within 2**-23 of its own, relative (exp_vec_float's): or -1
   where that leaves it in doubt. Each sum invert_cdf compares is known within NEAR of itself, and so is the target
   (from the total's); the column is taken only where every comparison invert_cdf makes, each monotone in its sum,
   comes out the same at either end. The block the target falls in is scaled from the row into s->x and weighed
   into s->w with exp_vec, invert_cdf's own weights. */
static int64_t invert_cdf_near(const float *row, int64_t n, float best, float temperature, float kept, float u,
                               int wide, struct scratch *s) {
    int64_t blocks = (n + BLOCK - 1) / BLOCK, b = 0;
    const double *block_sum = s->block_sum;
    double sum = 0, cdf = 0;
    for (int64_t c = 0; c < blocks; c++)
        sum += block_sum[c];
    double low = target_of(u, sum * (1 - NEAR), wide), high = target_of(u, sum * (1 + NEAR), wide);
    for (; b < blocks - 1; cdf += block_sum[b++]) {
        double next = cdf + block_sum[b];
        if ((float)(next * (1 - NEAR)) > high)
            break; /* surely past the target */
        if (!((float)(next * (1 + NEAR)) <= low))
            return -1; /* in doubt */
    }
    int64_t start = b * BLOCK, end = start + BLOCK < n ? start + BLOCK : n;
    float *x = s->x, *w = s->w;
    scale_row(row + start, end - start, best, temperature, FLOOR, x + start);
    weigh_kept(x + start, end - start, kept, w + start);
    for (int64_t i = start; i < end; i++) {
        if (!(x[i] >= kept))
            continue;
        cdf += w[i];
        if ((float)(cdf * (1 - NEAR)) > high)
            return i;
        if (!((float)(cdf * (1 + NEAR)) <= low))
            return -1;
    }
    return -1; /* the block's end: invert_cdf walks on, or takes n - 1 */
}

/* block_sums of a cut-free row's float32 weights (exp_vec_float's), its values scaled as scale_row scales them, in
   one pass that stores only a run of 64 at a time: a run with none kept takes no exp */
static void row_block_sums(const float *row, int64_t V, float best, float temperature, float kept, double *block_sum) {
    for (int64_t start = 0; start < V; start += BLOCK) {
        int64_t end = start + BLOCK < V ? start + BLOCK : V;
        doubles sum = {0};
        for (int64_t run = start; run < end; run += 64) {
            int64_t stop = run + 64 < end ? run + 64 : end;
            float x[64];
            ints any = {0};
            for (int64_t i = run; i < stop; i += LANES) { /* padded with NaN: never kept */
                floats v = (load_vec(row, i, stop, __builtin_nanf("")) - best) / temperature;
                v = blend(v < splat(FLOOR), splat(FLOOR), v);
                any |= v >= splat(kept);
                memcpy(x + (i - run), &v, sizeof v);
            }
            for (int64_t i = run; any_of(any) && i < stop; i += LANES) {
                floats v;
                memcpy(&v, x + (i - run), sizeof v);
                floats e = blend(v >= splat(kept), exp_vec_float(v), splat(0.0f));
                sum += __builtin_convertvector(__builtin_shufflevector(e, e, LOW_HALF), doubles) +
                       __builtin_convertvector(__builtin_shufflevector(e, e, HIGH_HALF), doubles);
            }
        }
        block_sum[start / BLOCK] = 0;
        for (int j = 0; j < LANES / 2; j++)
            block_sum[start / BLOCK] += sum[j];
    }
}

/* A row with no top_k: every id's scaled value, clamped as the core clamps them, in id order (top-p on a peaked
   row: draw_top_p_peaked's few). Weighed in float32 first: where the row holds no NaN and its best is finite, the
   cut and the draw from those weights stand where no rounding could move them (cut_top_p, invert_cdf_near); else
   the row is weighed again with exp_vec. */
static int64_t draw_uncut(const float *row, int64_t V, float temperature, float top_p, float least, float u, int wide,
                          struct scratch *s) {
    int64_t id = top_p < 1 ? draw_top_p_peaked(row, V, temperature, top_p, least, u, wide, s) : -1;
    if (id >= 0)
        return id;
    int nan, rough = 1; /* rough: s->w holds float32 weights */
    float lowest = 0, lowest_finite = 0, kept = least; /* top-p's histogram reads them */
    float best = top_p < 1 ? row_range(row, V, &nan, &lowest, &lowest_finite) : row_best(row, V, &nan);
    best = nan ? __builtin_nanf("") : best; /* torch's amax: NaN wins */
    int near = !nan && isfinite(best);
    if (top_p < 1) {
        kept = top_p_kept(row, V, best, lowest, lowest_finite, temperature, top_p, least, near, &rough, s);
        block_sums(s->x, s->w, V, kept, s->block_sum);
    } else
        row_block_sums(row, V, best, temperature, kept, s->block_sum);
    id = near && rough ? invert_cdf_near(row, V, best, temperature, kept, u, wide, s) : -1;
    if (id >= 0)
        return id;
    if (rough) { /* the row's every value, and exp_vec's weights */
        scale_row(row, V, best, temperature, FLOOR, s->x);
        weigh_kept(s->x, V, kept, s->w);
        block_sums(s->x, s->w, V, kept, s->block_sum);
    }
    return invert_cdf(s->x, s->w, V, kept, u, wide, s->block_sum);
}

/* sampling.uniform: a hash of (seed, position) -> the middle of one of 2**23 equal intervals of (0, 1), exact in
   float32 (the same integer operations, so the same bits) */
static uint64_t mix32(uint64_t x) {
    x = ((x ^ (x >> 16)) * 0x21F0AAADu) & 0xFFFFFFFFu;
    x = ((x ^ (x >> 15)) * 0x735A2D97u) & 0xFFFFFFFFu;
    return x ^ (x >> 15);
}

static float uniform(int64_t seed, int64_t position) {
    uint64_t x = mix32((mix32((uint64_t)seed) + (uint64_t)position) & 0xFFFFFFFFu);
    return (float)(x >> 8 | 1) / 16777216.0f;
}

/* Calls each(r, scratch, args) for every row r < R, the rows shared among num_threads threads, a row to a thread at
   a time (so that a row's result does not depend on which), with that thread's scratch for rows of V ids. Returns
   0, or -1 where a thread's scratch could not be allocated. */
static int for_each_row(int64_t R, int64_t V, int num_threads, void (*each)(int64_t, struct scratch *, const void *),
                        const void *args) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        struct scratch s = {0};
        int ok = scratch_for(V, &s);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < R; r++)
            if (ok)
                each(r, &s, args);
    }
    return -failed;
}

/* logprobs' scores, each row's at its index: its target's logprob and rank, and its width likeliest ids and their
   logprobs (R, width) */
struct scores {
    int64_t width;
    float *logprob;
    int32_t *rank;
    int64_t *top_ids;
    float *top_logprobs;
};

/* The row's logsumexp from float32 weights (exp_vec_float), runs of 1,024 summed in float32 (16 sums, id i's in
   sum i % 16) and the runs in float64, and how many of its values are at least target
   -> log(sum of exp(x - best)) + best. The sums are local vectors, which the compiler keeps in registers where the
   CPU has enough (not indexed by the vector's place: a store and a load a vector): 16 ids a step, the row's last
   (short) 16 a vector at a time, its padding weighed 0, so that every width sums the same. */
static float log_total(const float *row, int64_t V, float best, float target, int32_t *at_least) {
    double total = 0;
    ints counted = {0}, lane; /* -1 for each value counted */
    for (int j = 0; j < LANES; j++)
        lane[j] = j;
    for (int64_t start = 0; start < V; start += 1024) {
        int64_t end = start + 1024 < V ? start + 1024 : V, i = start;
        floats sum[SUMS] = {0};
        for (; i + 16 <= end; i += 16)
            for (int c = 0; c < SUMS; c++) {
                floats v = load_vec(row, i + c * LANES, V, 0.0f);
                sum[c] += exp_vec_float(v - best);
                counted += (ints)(v >= splat(target));
            }
        for (int c = 0; i < end; i += LANES, c++) {
            floats v = load_vec(row, i, V, -__builtin_inff());
            ints in_row = lane < (int32_t)(V - i);
            sum[c] += blend(in_row, exp_vec_float(v - best), splat(0.0f));
            counted += (v >= splat(target)) & in_row;
        }
        for (int c = 0; c < SUMS; c++)
            for (int j = 0; j < LANES; j++)
                total += sum[c][j];
    }
    *at_least = 0;
    for (int j = 0; j < LANES; j++)
        *at_least -= counted[j];
    return (float)log(total) + best;
}

/* Row r's scores of its target. Its likeliest ids are top_k.c's, unless the scratch holds enough of them from the
   draw (s->sorted: a prefix of the same order, so the same ids); the best value is the logsumexp's shift, whatever
   the width. */
static void score(const float *row, int64_t V, int64_t target, struct scratch *s, const struct scores *out, int64_t r) {
    int64_t width = out->width, k = width > 0 ? width : 1;
    if (s->sorted < k)
        top_k_row(row, V, k, groups_for(k, V), s->keys, 2 * k + 1024, s->group_max, s->values, s->ids);
    float value = row[target], total = log_total(row, V, s->values[0], value, &out->rank[r]);
    out->logprob[r] = value - total;
    for (int64_t j = 0; j < width; j++) {
        out->top_ids[r * width + j] = s->ids[j];
        out->top_logprobs[r * width + j] = s->values[j] - total;
    }
}

struct draw_args {
    const float *logits;
    int64_t V;
    const double *settings;
    const float *least;
    const int64_t *position;
    int wide;
    int64_t *tokens;
    const uint8_t *scored; /* the rows whose token is scored too (NULL: none) */
    struct scores scores;
};

static void draw_row(int64_t r, struct scratch *s, const void *args) {
    const struct draw_args *a = args;
    const float *row = a->logits + r * a->V;
    const double *settings = a->settings + 5 * r;
    float temperature = (float)settings[0], top_p = (float)settings[2];
    float u = uniform((int64_t)settings[4], a->position[r]);
    int64_t top_k = settings[1] < a->V ? (int64_t)settings[1] : 0; /* as SamplingParams.best: every id */
    s->sorted = 0;
    if (temperature == 0)
        a->tokens[r] = argmax(row, a->V);
    else if (top_k > 0)
        a->tokens[r] = draw_top_k(row, a->V, top_k, temperature, top_p, a->least[r], u, a->wide, s);
    else
        a->tokens[r] = draw_uncut(row, a->V, temperature, top_p, a->least[r], u, a->wide, s);
    if (a->scored && a->scored[r]) /* while the row is in this core's cache */
        score(row, a->V, a->tokens[r], s, &a->scores, r);
}

/* Each row's token. settings (R, 5) float64: sampling.sample's (temperature, top_k, top_p, min_p, seed), read in
   float32 as it reads them; least (R,) float32: each row's log(min_p), torch's; position (R,) int64. Where scored
   (R,) uint8 is not NULL, the rows it marks are scored as score_rows scores them, with their drawn token as the
   target, into logprob, rank, top_ids and top_logprobs (score_rows' shapes; the other rows' are left as they
   were), the same bits (a top-k row's likeliest ids read from its candidates, where top_k.c puts the same ids).
   Returns 0, or -1 where a thread's scratch could not be allocated. */
int sample_rows(const float *logits, int64_t R, int64_t V, const double *settings, const float *least,
                const int64_t *position, int wide, int64_t *tokens, const uint8_t *scored, int64_t width,
                float *logprob, int32_t *rank, int64_t *top_ids, float *top_logprobs, int num_threads) {
    struct draw_args args = {logits, V, settings, least, position, wide, tokens, scored,
                             {width, logprob, rank, top_ids, top_logprobs}};
    return for_each_row(R, V, num_threads, draw_row, &args);
}

struct score_args {
    const float *logits;
    const int64_t *targets;
    int64_t V;
    struct scores scores;
};

static void score_row(int64_t r, struct scratch *s, const void *args) {
    const struct score_args *a = args;
    s->sorted = 0;
    score(a->logits + r * a->V, a->V, a->targets[r], s, &a->scores, r);
}

/* Log-probabilities, as ext/logprobs.py's scores() reads them from a row: the target's logprob and rank (how many
   ids are at least as likely, itself among them), and the width likeliest ids with their logprobs (top_k.c's
   selection: of tied values the lower id first). torch sums its weights in float32 in its own order: the logprobs
   agree with the core's to float32's rounding.
   Shapes: logits (R, V) float32; targets (R,) int64; logprob (R,) float32; rank (R,) int32; top_ids (R, width)
   int64 and top_logprobs (R, width) float32. Returns 0, or -1 where a thread's scratch could not be allocated. */
int score_rows(const float *logits, int64_t R, int64_t V, const int64_t *targets, int64_t width, float *logprob,
               int32_t *rank, int64_t *top_ids, float *top_logprobs, int num_threads) {
    struct score_args args = {logits, targets, V, {width, logprob, rank, top_ids, top_logprobs}};
    return for_each_row(R, V, num_threads, score_row, &args);
}
