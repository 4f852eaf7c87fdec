/* Candidate screening for uag/screened.py's exact greedy head, two passes over each row.
 *
 * Why in C: for 8 rows of Gemma 3's 262,144-entry vocabulary, the same screening as torch
 * element-wise ops (bound, floor, comparison, nonzero) made several full-size temporaries and
 * cost ~6 ms, a fifth of the head, plus ~3 ms for the full argmax that the candidates make
 * unnecessary. Here: ~0.1-0.25 ms per row, rows in parallel.
 *
 * Row m's logit v is within bound = coef[v] * xn[m] + coef2[v] * xr[m] + slack of its fp32
 * value (screened.py),
 * so floor = max_v(logit - bound) is a lower bound of the best fp32 logit, and only tokens with
 * logit + bound >= floor can be the argmax: those are written out as (row, id), by row then
 * id. Each row is screened on its own (row-count invariance). Returns the number of
 * candidates, or -1 when more than cap (the caller retries with more room).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vexp.h"

/* The bound, multiplied then added (never fused), the same in the vector and scalar paths. */
static inline __m256 bound8(const float *coef, const float *coef2, int64_t v, __m256 x, __m256 r,
                            __m256 slack) {
    return _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(coef + v), x),
                                       _mm256_mul_ps(_mm256_loadu_ps(coef2 + v), r)),
                         slack);
}
static inline float bound1(const float *coef, const float *coef2, int64_t v, float x, float r,
                           float slack) {
    return (coef[v] * x + coef2[v] * r) + slack;
}

/* Row m: its floor, then its candidates' ids into out[0..cap) in increasing order; returns how
 * many, or -1 when more than cap. */
static int64_t screen_row(const float *l, int64_t V, const float *coef, float xn, const float *coef2,
                          float xr, float slack, int64_t *out, int64_t cap) {
    const __m256 s = _mm256_set1_ps(slack);
    const __m256 x = _mm256_set1_ps(xn), r = _mm256_set1_ps(xr);
    __m256 lo[4];
    for (int j = 0; j < 4; j++) lo[j] = _mm256_set1_ps(-INFINITY);
    int64_t v = 0;
    for (; v + 32 <= V; v += 32)
        for (int j = 0; j < 4; j++) {
            const int64_t u = v + 8 * j;
            lo[j] = _mm256_max_ps(lo[j], _mm256_sub_ps(_mm256_loadu_ps(l + u), bound8(coef, coef2, u, x, r, s)));
        }
    for (; v + 8 <= V; v += 8)
        lo[0] = _mm256_max_ps(lo[0], _mm256_sub_ps(_mm256_loadu_ps(l + v), bound8(coef, coef2, v, x, r, s)));
    float floor = -INFINITY;
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 8; i++) floor = lo[j][i] > floor ? lo[j][i] : floor;
    for (; v < V; v++) {
        const float low = l[v] - bound1(coef, coef2, v, xn, xr, slack);
        floor = low > floor ? low : floor;
    }
    const __m256 f = _mm256_set1_ps(floor);
    int64_t count = 0;
    for (v = 0; v < V; v += 8) {
        int mask = 0;
        if (v + 8 <= V) {
            const __m256 hi = _mm256_add_ps(_mm256_loadu_ps(l + v), bound8(coef, coef2, v, x, r, s));
            mask = _mm256_movemask_ps(_mm256_cmp_ps(hi, f, _CMP_GE_OQ));
        } else {
            for (int i = 0; v + i < V; i++)
                mask |= (l[v + i] + bound1(coef, coef2, v + i, xn, xr, slack) >= floor) << i;
        }
        while (mask) {
            const int i = __builtin_ctz(mask);
            mask &= mask - 1;
            if (count == cap) return -1;
            out[count++] = v + i;
        }
    }
    return count;
}

/* Rows are screened in parallel (a verify's 2-16 rows: ~0.25 ms each on one core), each into its
 * own part of a scratch buffer, then written out in row order. */
int64_t uag_screen(const float *logits, int64_t M, int64_t V, int64_t ldl, const float *coef,
                   const float *xn, const float *coef2, const float *xr, float slack,
                   int64_t *rows, int64_t *cols, int64_t cap) {
    const int64_t row_cap = cap < V ? cap : V;
    int64_t *scratch = M > 1 ? (int64_t *)malloc(sizeof(int64_t) * (size_t)(M * row_cap)) : cols;
    int64_t *counts = (int64_t *)malloc(sizeof(int64_t) * (size_t)M);
#pragma omp parallel for schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; m++)
        counts[m] = screen_row(logits + m * ldl, V, coef, xn[m], coef2, xr[m], slack,
                               scratch + m * row_cap, row_cap);
    int64_t total = 0;
    for (int64_t m = 0; m < M && total >= 0; m++) {
        if (counts[m] < 0 || total + counts[m] > cap) {
            total = -1;
            break;
        }
        for (int64_t i = 0; i < counts[m]; i++) {
            rows[total + i] = m;
            if (M > 1) cols[total + i] = scratch[m * row_cap + i];
        }
        total += counts[m];
    }
    if (M > 1) free(scratch);
    free(counts);
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
