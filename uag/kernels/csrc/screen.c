/* Candidate screening for uag/screened.py's exact greedy head.
 *
 * Why in C: for 8 rows of Gemma 3's 262,144-entry vocabulary, the same screening as torch
 * element-wise ops (bound, floor, comparison, nonzero) made several full-size temporaries and
 * cost ~6 ms, a fifth of the head, plus ~3 ms for the full argmax that the candidates make
 * unnecessary. Here: 0.06 / 0.18 / 0.32 ms for 1 / 4 / 8 rows (two full passes per row, rows
 * in parallel, took 0.20 / 0.39 / 0.77 ms: the bound terms were read once per row, and the
 * second pass read every logit again).
 *
 * Row m's logit v is within bound = coef[v] * xn[m] + coef2[v] * xr[m] + coef3[v] * xo[m] +
 * slack of its fp32 value (screened.py),
 * so floor = max_v(logit - bound) is a lower bound of the best fp32 logit, and only tokens with
 * logit + bound >= floor can be the argmax: those are written out as (row, id), by row then
 * id. Each row is screened on its own (row-count invariance). Returns the number of
 * candidates, or -1 when more than cap (the caller retries with more room).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "vexp.h"

/* The three terms and the slack of a bound. */
typedef struct {
    const float *coef, *coef2, *coef3;
    float x, r, o, slack;
} terms_t;

/* The bound, multiplied then added in order (never fused), the same in the vector and scalar
 * paths. */
static inline __m256 bound8(const terms_t *t, int64_t v) {
    const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(t->coef + v), _mm256_set1_ps(t->x));
    const __m256 b = _mm256_mul_ps(_mm256_loadu_ps(t->coef2 + v), _mm256_set1_ps(t->r));
    const __m256 c = _mm256_mul_ps(_mm256_loadu_ps(t->coef3 + v), _mm256_set1_ps(t->o));
    return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a, b), c), _mm256_set1_ps(t->slack));
}
static inline float bound1(const terms_t *t, int64_t v) {
    return ((t->coef[v] * t->x + t->coef2[v] * t->r) + t->coef3[v] * t->o) + t->slack;
}

#define VB 1024 /* vocabulary entries per block: its bound terms stay in L1 for every row */

/* Over entries [v0, v1) of row l (v0 a multiple of 8): the largest l - bound and l + bound.
 * Whole groups of 8 take the vector path, the tail the scalar one, as in the candidates pass. */
static void block_extremes(const float *l, int64_t v0, int64_t v1, int64_t V, const terms_t *t,
                           float *low, float *high) {
    __m256 lo = _mm256_set1_ps(-INFINITY), hi = lo;
    int64_t v = v0;
    for (; v + 8 <= v1 && v + 8 <= V; v += 8) {
        const __m256 x = _mm256_loadu_ps(l + v), b = bound8(t, v);
        lo = _mm256_max_ps(lo, _mm256_sub_ps(x, b));
        hi = _mm256_max_ps(hi, _mm256_add_ps(x, b));
    }
    float fl = -INFINITY, fh = -INFINITY;
    for (int i = 0; i < 8; i++) {
        fl = lo[i] > fl ? lo[i] : fl;
        fh = hi[i] > fh ? hi[i] : fh;
    }
    for (; v < v1; v++) {
        const float b = bound1(t, v), x = l[v];
        fl = x - b > fl ? x - b : fl;
        fh = x + b > fh ? x + b : fh;
    }
    *low = fl, *high = fh;
}

/* Entries [v0, v1) of row l whose l + bound reaches floor, appended to out[*count..cap) in
 * increasing order; 0, or -1 when more than cap. */
static int block_candidates(const float *l, int64_t v0, int64_t v1, int64_t V, const terms_t *t,
                            float floor, int64_t *out, int64_t *count, int64_t cap) {
    const __m256 f = _mm256_set1_ps(floor);
    for (int64_t v = v0; v < v1; v += 8) {
        int mask = 0;
        if (v + 8 <= V) {
            const __m256 hi = _mm256_add_ps(_mm256_loadu_ps(l + v), bound8(t, v));
            mask = _mm256_movemask_ps(_mm256_cmp_ps(hi, f, _CMP_GE_OQ));
        } else {
            for (int i = 0; v + i < V; i++) mask |= (l[v + i] + bound1(t, v + i) >= floor) << i;
        }
        while (mask) {
            const int i = __builtin_ctz(mask);
            mask &= mask - 1;
            if (*count == cap) return -1;
            out[(*count)++] = v + i;
        }
    }
    return 0;
}

/* First every row's largest l - bound and l + bound per block of VB entries, blocks split over
 * the threads (all rows of a block together: the bound terms are read once per block, not once
 * per row); a row's floor is the largest of its blocks' (a maximum: exact in any order, so a
 * row's floor and candidates never depend on the other rows or the threads). Then each row's
 * candidates, from only the blocks whose largest l + bound reaches its floor (a few). Writes the
 * candidates row by row, ids increasing; returns how many, or -1 when more than cap. */
int64_t uag_screen(const float *logits, int64_t M, int64_t V, int64_t ldl, const float *coef,
                   const float *xn, const float *coef2, const float *xr, const float *coef3,
                   const float *xo, float slack, int64_t *rows, int64_t *cols, int64_t cap) {
    const int64_t nb = (V + VB - 1) / VB;
    float *low = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    float *high = (float *)malloc(sizeof(float) * (size_t)(M * nb));
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nb; b++) {
        const int64_t v0 = b * VB, v1 = v0 + VB < V ? v0 + VB : V;
        for (int64_t m = 0; m < M; m++) {
            const terms_t t = {coef, coef2, coef3, xn[m], xr[m], xo[m], slack};
            block_extremes(logits + m * ldl, v0, v1, V, &t, low + m * nb + b, high + m * nb + b);
        }
    }
    int64_t total = 0;
    for (int64_t m = 0; m < M && total >= 0; m++) {
        float floor = -INFINITY;
        for (int64_t b = 0; b < nb; b++) floor = low[m * nb + b] > floor ? low[m * nb + b] : floor;
        const terms_t t = {coef, coef2, coef3, xn[m], xr[m], xo[m], slack};
        const int64_t first = total;
        for (int64_t b = 0; b < nb && total >= 0; b++) {
            if (!(high[m * nb + b] >= floor)) continue;
            const int64_t v0 = b * VB, v1 = v0 + VB < V ? v0 + VB : V;
            if (block_candidates(logits + m * ldl, v0, v1, V, &t, floor, cols, &total, cap) < 0)
                total = -1;
        }
        for (int64_t i = first; i < total; i++) rows[i] = m;
    }
    free(low), free(high);
    return total;
}

/* The statistics a drafted token's features read, from the assistant's logits l[0..V): its
 * argmax (the lowest id on a tie), the top two probabilities and the entropy of softmax(l).
 *
 * Why in C: torch took ~0.45 ms a draft step for them (softmax, top-2, log, product, sum over
 * SmolLM2's 49,152 entries, each op cold after the model's forward), ~10 % of the step. Here:
 * one vector pass for the maximum m, one for Z = sum e^(l - m) and T = sum e^(l - m) (l - m)
 * (exp8 of vexp.h, summed in double), so p1 = 1 / Z and the entropy is log Z - T / Z. out: p1, p2, entropy in
 * nats. Returns the argmax, or -1 where there is none (NaN logits). */
int64_t uag_draft_stats(const float *l, int64_t V, double *out) {
    __m256 mx = _mm256_set1_ps(-INFINITY);
    int64_t v = 0;
    for (; v + 8 <= V; v += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(l + v));
    float m = -INFINITY;
    for (int i = 0; i < 8; i++) m = mx[i] > m ? mx[i] : m;
    for (; v < V; v++) m = l[v] > m ? l[v] : m;
    int64_t top = -1;
    for (v = 0; v < V && top < 0; v++)
        if (l[v] == m) top = v;
    if (top < 0 || !isfinite(m)) return -1;
    const __m256 mv = _mm256_set1_ps(m);
    __m256d z = _mm256_setzero_pd(), t = _mm256_setzero_pd();
    __m256 second = _mm256_set1_ps(-INFINITY);
    for (v = 0; v + 8 <= V; v += 8) {
        const __m256 x = _mm256_loadu_ps(l + v);
        const __m256 d = _mm256_sub_ps(x, mv);
        const __m256 e = exp8(d); /* d <= 0; below -87.3 it adds nothing a feature sees */
        const __m256 ed = _mm256_mul_ps(e, d);
        z = _mm256_add_pd(z, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(e)),
                                           _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1))));
        t = _mm256_add_pd(t, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(ed)),
                                           _mm256_cvtps_pd(_mm256_extractf128_ps(ed, 1))));
        if (top >= v && top < v + 8) { /* the second largest excludes the top entry itself */
            float lanes[8];
            _mm256_storeu_ps(lanes, x);
            lanes[top - v] = -INFINITY;
            second = _mm256_max_ps(second, _mm256_loadu_ps(lanes));
        } else {
            second = _mm256_max_ps(second, x);
        }
    }
    double zs = 0.0, ts = 0.0;
    float s2 = -INFINITY;
    for (int i = 0; i < 4; i++) zs += z[i], ts += t[i];
    for (int i = 0; i < 8; i++) s2 = second[i] > s2 ? second[i] : s2;
    for (; v < V; v++) {
        const double d = (double)(l[v] - m), e = exp(d);
        zs += e, ts += e * d;
        if (v != top && l[v] > s2) s2 = l[v];
    }
    out[0] = 1.0 / zs;
    out[1] = s2 > -INFINITY ? exp((double)(s2 - m)) / zs : 0.0;
    out[2] = log(zs) - ts / zs;
    return top;
}

/* The screened head's constants (uag/kernels/screened.py builds one per head). */
typedef struct uag_head {
    int64_t in, padded_in; /* hidden width; the int8 product's (a multiple of its quads) */
    int64_t outliers;      /* channels on their own scale, stored last */
    const int64_t *order;  /* [padded_in]: the input channel at each stored position */
    const int8_t *weight;  /* the int8 product (q8.c) */
    const float *scale, *bias;
    const int32_t *wsum, *wsum_o; /* per output: all quads' weight sums; the outlier quads' */
    int64_t padded_out, quad0, quads;
    const float *coef, *coef2, *coef3; /* the bound's terms per vocabulary entry (uag_screen) */
    float slack;
    int64_t vocab;
    int64_t exact_format; /* the exact weight, as skinny.c's formats (uag_exact_candidates) */
    const void *exact_weight;
    const float *exact_params, *exact_bias;
} uag_head_t;

/* A greedy head call in one: ||x||_1 per row, the activations in the product's channel order
 * (the outliers apart), the int8 product with its bounds, the screen, the candidates' exact
 * logits and each row's argmax: what screened.py's greedy did in ~25 torch ops, each slow on
 * caches the head's 168 MB stream had just evicted (~0.6 ms of a 15 ms step on a Zen 3).
 * Every step is the same code as before, so the same bits, except ||x||_1, summed here in
 * double (torch summed floats): the bound only needs it to within its 1 % margin.
 *
 * x [M, in] contiguous; out: logits [M, padded_out], norms [M], missed [M, 2] (the two r of
 * q8.c), candidates (rows, cols) with room for cap, ids [M]. Returns the candidates' count;
 * -1 when a row has more than limit (or cap overflows): then logits, norms and missed are
 * complete and the caller takes over (a second activation level); -2 when a row has none
 * (NaN hidden states). Rows are computed on their own. */
int64_t uag_screened_greedy(const struct uag_head *H, const float *x, int64_t M, float *logits,
                            float *norms, float *missed, int64_t *rows, int64_t *cols,
                            int64_t cap, int64_t limit, int64_t *ids) {
    const int64_t K = H->in, Kp = H->padded_in, split = Kp - H->outliers;
    float *rest = (float *)malloc(sizeof(float) * (size_t)(M * Kp));
    float *xo = H->outliers ? (float *)calloc((size_t)(M * Kp), sizeof(float)) : NULL;
    float *r = (float *)malloc(sizeof(float) * (size_t)(2 * M)), *r_o = r + M;
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K;
        double sum = 0.0;
        for (int64_t k = 0; k < K; k++) sum += fabs((double)xm[k]);
        norms[m] = (float)sum;
        float *rm = rest + m * Kp;
        for (int64_t p = 0; p < Kp; p++) {
            const int64_t c = H->order[p];
            const float v = c < K ? xm[c] : 0.0f;
            if (p < split) {
                rm[p] = v;
            } else {
                rm[p] = 0.0f;
                xo[m * Kp + p] = v;
            }
        }
        r_o[m] = 0.0f;
    }
    uag_linear_q8(rest, Kp, M, Kp, H->weight, H->scale, H->wsum, H->padded_out, H->bias, logits,
                  H->padded_out, 1, r, xo, Kp, r_o, H->quad0, H->quads, H->wsum_o);
    free(rest), free(xo);
    for (int64_t m = 0; m < M; m++) missed[2 * m] = r[m], missed[2 * m + 1] = r_o[m];
    int64_t count = uag_screen(logits, M, H->vocab, H->padded_out, H->coef, norms, H->coef2, r,
                               H->coef3, r_o, H->slack, rows, cols, cap);
    free(r);
    if (count < 0) return -1;
    for (int64_t i = 0, run = 0; i < count; i++) {
        run = i > 0 && rows[i] == rows[i - 1] ? run + 1 : 1;
        if (run > limit) return -1;
    }
    if (uag_exact_candidates(H->exact_format, H->exact_weight, H->exact_params, K, x, K, M,
                             H->exact_bias, rows, cols, count, logits, H->padded_out, ids) < 0)
        return -2;
    return count;
}
