/* One decoder layer (Llama or Gemma 3) for 1-16 rows, in one call.
 *
 * Why: at batch size 1 the work between the matrix products (norms, rotary embedding, the KV
 * cache write, attention, activations, residuals) is tiny, but as ~25 torch calls per layer it
 * cost ~9 ms of a ~19 ms SmolLM2 draft step on these CPUs. Here it is plain loops; the products
 * go to skinny.c.
 *
 * Row-count invariance by construction, as in skinny.c: every row is normalised, rotated and
 * attended on its own, with fixed summation orders, so a row's result never depends on how
 * many rows share the call. Built with -ffp-contract=off (no silent fusing).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "vexp.h"

typedef struct {
    const void *weight; /* interleaved (skinny.c) */
    const float *scale; /* int8: one per output; block int8: [out/8][in/32][8]; block affine:
                           [out/8][in/16][2][8]; q4: [out/8][in/32][2][8]; else NULL */
    const int32_t *wsum; /* dynamic int8: each output's sum of int8 weights; else NULL */
    const float *bias;  /* or NULL */
    int64_t in, out;    /* out: a multiple of 8 (the kernels' layout) */
    int64_t format;     /* enum uag_format (formats.h): which kernel, what scale points at */
    int64_t block, affine; /* UAG_FMT_EXACT: inputs per block; whether blocks have bases */
    int64_t bits, offset;  /* UAG_FMT_EXACT: 8, or packed at 4-6 bits plus offset (exact.c) */
    int64_t span;          /* UAG_FMT_EXACT: 0, or inputs per span of factored params */
} uag_linear_t;

typedef struct uag_layer {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    int64_t gemma;  /* Gemma 3: norms after attention and MLP too, q/k norms, gelu-tanh */
    int64_t window; /* sliding window (0: full attention) */
    float eps, scaling;
    const float *norm_in, *norm_post_attn, *norm_pre_ff, *norm_post_ff; /* effective weights */
    const float *q_norm, *k_norm;                                       /* Gemma only */
    uag_linear_t qkv, o, gate_up, down;
    int64_t kv_half; /* keys and values cached as IEEE half floats (the assistant: half the
                        bytes a decode step's attention reads), else float */
} uag_layer_t;

typedef struct uag_scratch {
    float *x, *qkv, *attn, *o, *gu, *act; /* scratch: [rows, width] each, sized by the caller */
} uag_scratch_t;

static void linear(const uag_linear_t *l, const float *x, int64_t rows, float *y) {
    switch (l->format) {
    case UAG_FMT_EXACT:
        uag_linear_x8(x, l->in, rows, l->in, (const int8_t *)l->weight, l->scale, l->block,
                      l->affine, l->bits, l->offset, l->span, l->out, l->bias, y, l->out);
        break;
    case UAG_FMT_Q4:
        uag_linear_q4(x, l->in, rows, l->in, (const uint8_t *)l->weight,
                      (const uint16_t *)l->scale, l->out, l->bias, y, l->out);
        break;
    case UAG_FMT_DYNAMIC_INT8:
        uag_linear_q8(x, l->in, rows, l->in, (const int8_t *)l->weight, l->scale, l->wsum, l->out,
                      l->bias, y, l->out, 1, NULL, NULL, 0, NULL, 0, 0, NULL);
        break;
    case UAG_FMT_BLOCK_INT8:
        uag_linear_b8(x, l->in, rows, l->in, (const int8_t *)l->weight, l->scale, l->out, l->bias,
                      y, l->out);
        break;
    case UAG_FMT_BLOCK_AFFINE:
        uag_linear_a8(x, l->in, rows, l->in, (const uint8_t *)l->weight, l->scale, l->out, l->bias,
                      y, l->out);
        break;
    case UAG_FMT_INT8:
        uag_linear_i8(x, l->in, rows, l->in, (const int8_t *)l->weight, l->scale, l->out, l->bias,
                      y, l->out);
        break;
    default:
        uag_linear_f32(x, l->in, rows, l->in, (const float *)l->weight, NULL, l->out, l->bias, y,
                       l->out);
    }
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
    return _mm_cvtss_f32(s);
}

/* Sum of a[i] * b[i]: eight lanes of fused multiply-adds in order, then a fixed reduction and
 * the tail in order. */
static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum8(acc);
    for (; i < n; i++) s = fmaf(a[i], b[i], s);
    return s;
}

/* y = x / sqrt(mean(x^2) + eps) * w over n values (y may be x). */
static inline void rms_norm(const float *x, const float *w, int64_t n, float eps, float *y) {
    const float inv = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = (x[i] * inv) * w[i];
}

/* Rotary embedding as Transformers applies it: x * cos + rotate_half(x) * sin. */
static inline void rope(float *x, const float *cos, const float *sin, int64_t d) {
    const int64_t h = d / 2;
    for (int64_t i = 0; i < h; i++) {
        const float a = x[i], b = x[i + h];
        x[i] = a * cos[i] - b * sin[i];
        x[i + h] = b * cos[i + h] + a * sin[i + h];
    }
}

/* act(g) * u for 8 values: gelu-tanh (Gemma) as g / (1 + e^(-2 inner)), which is
 * 0.5 g (1 + tanh(inner)); SiLU (Llama) as g / (1 + e^(-g)). */
static inline __m256 gated8(__m256 g, __m256 u, int gemma) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 z;
    if (gemma) {
        const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
        const __m256 inner = _mm256_mul_ps(
            _mm256_set1_ps(0.7978845608028654f),
            _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), g3)));
        z = _mm256_mul_ps(_mm256_set1_ps(-2.0f), inner);
    } else {
        z = _mm256_sub_ps(_mm256_setzero_ps(), g);
    }
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, exp8(z))), u);
}

/* a[c] = act(g[c]) * u[c] for c < n, 8 at a time (a tail goes through a padded vector, so
 * every element gets the same operations wherever it sits). */
static void gated(const float *g, const float *u, float *a, int64_t n, int gemma) {
    int64_t c = 0;
    for (; c + 8 <= n; c += 8)
        _mm256_storeu_ps(a + c, gated8(_mm256_loadu_ps(g + c), _mm256_loadu_ps(u + c), gemma));
    if (c < n) {
        float gb[8] = {0}, ub[8] = {0}, ab[8];
        for (int64_t i = c; i < n; i++) gb[i - c] = g[i], ub[i - c] = u[i];
        _mm256_storeu_ps(ab, gated8(_mm256_loadu_ps(gb), _mm256_loadu_ps(ub), gemma));
        for (int64_t i = c; i < n; i++) a[i] = ab[i - c];
    }
}

/* Element i of a cache row: a float, or (half) an IEEE half float widened exactly. Inlined
 * with a constant half, so each caller compiles to one load form. */
static inline __attribute__((always_inline)) __m256 kv8(const void *p, int64_t i, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
                : _mm256_loadu_ps((const float *)p + i);
}
static inline __attribute__((always_inline)) float kv1(const void *p, int64_t i, int half) {
    return half ? _cvtsh_ss(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* dot(q, k_j, n) for the four keys j..j + 3 of K (rows of n) at once: each its own chain of
 * multiply-adds in the same order, reduction and tail as dot(), so bitwise dot()'s results, but
 * four chains in flight instead of one waiting on its own latency (a verify's attention: ~0.2
 * ms of a layer's rows). keys (4, or 1 for the last few) is a constant after inlining. */
static inline __attribute__((always_inline)) void dot4(const float *q, const void *K, int64_t j,
                                                       int keys, int64_t n, int half, float *out) {
    __m256 a[4];
    for (int t = 0; t < 4; t++) a[t] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(q + i);
        for (int t = 0; t < keys; t++)
            a[t] = _mm256_fmadd_ps(x, kv8(K, (j + t) * n + i, half), a[t]);
    }
    for (int t = 0; t < keys; t++) {
        float st = hsum8(a[t]);
        for (int64_t r = i; r < n; r++) st = fmaf(q[r], kv1(K, (j + t) * n + r, half), st);
        out[t] = st;
    }
}

#define PARALLEL_ROWS 16 /* rows from which a layer's row-wise steps use both threads */
#define PV_CHUNK 64 /* output values per pass over the keys' weights: 8 accumulators */
#define SHARE 4       /* query heads of one kv head attended together (see attention) */
#define SHARE_CHUNK 16 /* their output values per pass: 4 heads x 2 accumulators */

/* Softmax of score[lo..pos] in place, after scaling: the max, then e^(s - max) by exp8 (the
 * MLP activations' exp, ~1 ulp) summed in eight lanes by position from lo, then each divided by
 * the sum. Every step depends only on the scores and (lo, pos), so a row gets the same bits in
 * any call. Why vectorised: libm's scalar expf per key was most of a decode step's attention
 * (SmolLM2, ~10 us of a layer at a 100-token context, growing with the context). */
static inline void softmax_row(float *score, int64_t lo, int64_t pos, float scaling) {
    float *s = score + lo;
    const int64_t n = pos - lo + 1;
    const __m256 sc = _mm256_set1_ps(scaling);
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + j), sc);
        _mm256_storeu_ps(s + j, x);
        top8 = _mm256_max_ps(top8, x);
    }
    float top = -INFINITY;
    for (int i = 0; i < 8; i++) top = top8[i] > top ? top8[i] : top;
    for (int64_t t = j; t < n; t++) {
        s[t] = s[t] * scaling;
        if (s[t] > top) top = s[t];
    }
    const __m256 vt = _mm256_set1_ps(top);
    __m256 sum8 = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vt));
        _mm256_storeu_ps(s + j, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    if (j < n) { /* the last n - j keys through the same lanes; the others add nothing */
        float buf[8];
        for (int i = 0; i < 8; i++) buf[i] = j + i < n ? s[j + i] : top;
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(buf), vt));
        const __m256 valid = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
                                           _mm256_set1_ps((float)(n - j)), _CMP_LT_OQ);
        sum8 = _mm256_add_ps(sum8, _mm256_and_ps(e, valid));
        _mm256_storeu_ps(buf, e);
        for (int i = 0; j + i < n; i++) s[j + i] = buf[i];
    }
    const float total = hsum8(sum8);
    const __m256 vtot = _mm256_set1_ps(total);
    for (j = 0; j + 8 <= n; j += 8)
        _mm256_storeu_ps(s + j, _mm256_div_ps(_mm256_loadu_ps(s + j), vtot));
    for (; j < n; j++) s[j] = s[j] / total;
}

/* One query head at row position pos over keys lo..pos: scores, softmax, and o = sum_j p_j v_j,
 * each output value one chain of multiply-adds over the keys in order (from 0). K and V hold
 * floats, or (half: the assistant's cache) IEEE half floats, widened exactly as they load. */
static inline __attribute__((always_inline)) void attend(const float *q, const void *K,
                                                         const void *V, int64_t d, int64_t lo,
                                                         int64_t pos, float scaling, float *score,
                                                         float *o, int half) {
    int64_t j = lo;
    for (; j + 4 <= pos + 1; j += 4) dot4(q, K, j, 4, d, half, score + j);
    for (; j <= pos; j++) dot4(q, K, j, 1, d, half, score + j);
    softmax_row(score, lo, pos, scaling);
    int64_t c = 0;
    for (; c + PV_CHUNK <= d; c += PV_CHUNK) {
        __m256 acc[PV_CHUNK / 8];
        for (int v = 0; v < PV_CHUNK / 8; v++) acc[v] = _mm256_setzero_ps();
        for (j = lo; j <= pos; j++) {
            const __m256 p = _mm256_set1_ps(score[j]);
            for (int v = 0; v < PV_CHUNK / 8; v++)
                acc[v] = _mm256_fmadd_ps(p, kv8(V, j * d + c + 8 * v, half), acc[v]);
        }
        for (int v = 0; v < PV_CHUNK / 8; v++) _mm256_storeu_ps(o + c + 8 * v, acc[v]);
    }
    for (; c < d; c++) {
        float acc = 0.0f;
        for (j = lo; j <= pos; j++) acc = fmaf(score[j], kv1(V, j * d + c, half), acc);
        o[c] = acc;
    }
}

/* attend for SHARE query heads of one kv head (q at stride d, o at stride d, scores at
 * stride sstride): each key's and value's bytes are loaded once for all of them, and every
 * head's chains (dot()'s per score, one per output value) are attend's in the same order,
 * so the same bits. Why: a verify's rows x heads re-read the layer's keys and values from L2
 * once per head; Gemma's four query heads share one kv head. d a multiple of SHARE_CHUNK. */
static void attend_shared(const float *q, const float *K, const float *V, int64_t d, int64_t lo,
                          int64_t pos, float scaling, float *score, int64_t sstride, float *o) {
    for (int64_t j = lo; j <= pos; j++) {
        const float *k = K + j * d;
        __m256 a[SHARE];
        for (int g = 0; g < SHARE; g++) a[g] = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= d; i += 8) {
            const __m256 kv = _mm256_loadu_ps(k + i);
            for (int g = 0; g < SHARE; g++)
                a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + i), kv, a[g]);
        }
        for (int g = 0; g < SHARE; g++) {
            float sg = hsum8(a[g]);
            for (int64_t t = i; t < d; t++) sg = fmaf(q[g * d + t], k[t], sg);
            score[g * sstride + j] = sg;
        }
    }
    for (int g = 0; g < SHARE; g++) softmax_row(score + g * sstride, lo, pos, scaling);
    for (int64_t c = 0; c < d; c += SHARE_CHUNK) {
        __m256 acc[SHARE][SHARE_CHUNK / 8];
        for (int g = 0; g < SHARE; g++)
            for (int v = 0; v < SHARE_CHUNK / 8; v++) acc[g][v] = _mm256_setzero_ps();
        for (int64_t j = lo; j <= pos; j++) {
            const float *vj = V + j * d + c;
            __m256 vv[SHARE_CHUNK / 8];
            for (int v = 0; v < SHARE_CHUNK / 8; v++) vv[v] = _mm256_loadu_ps(vj + 8 * v);
            for (int g = 0; g < SHARE; g++) {
                const __m256 p = _mm256_set1_ps(score[g * sstride + j]);
                for (int v = 0; v < SHARE_CHUNK / 8; v++)
                    acc[g][v] = _mm256_fmadd_ps(p, vv[v], acc[g][v]);
            }
        }
        for (int g = 0; g < SHARE; g++)
            for (int v = 0; v < SHARE_CHUNK / 8; v++)
                _mm256_storeu_ps(o + g * d + c + 8 * v, acc[g][v]);
    }
}

/* Row i (position start + i) of every query head over the keys it may see, row-count
 * invariant: every head's results are attend's bits however the work is split. With
 * several rows and SHARE query heads per kv head (Gemma 3), a task is a row's SHARE heads
 * (attend_shared); otherwise, and for one row (both cores then take heads), a task is one head. */
static void attention(const uag_layer_t *L, const float *qkv, int64_t rows, int64_t start,
                      const float *keys, const float *values, int64_t capacity, float *out) {
    const int64_t d = L->head_dim, groups = L->heads / L->kv_heads;
    const int64_t width = (L->heads + 2 * L->kv_heads) * d;
    const int shared = rows > 1 && groups == SHARE && d % SHARE_CHUNK == 0 && !L->kv_half;
    const int64_t per = shared ? SHARE : 1, tasks = rows * L->heads / per;
    const int64_t sstride = start + rows + 4;
#pragma omp parallel
    {
        float *score = (float *)malloc(sizeof(float) * (size_t)(per * sstride));
        /* Several rows: round robin, since a prompt's later rows see more keys (static blocks
         * gave one thread ~70 % of the work). One row: each thread a run of neighbouring heads,
         * so fewer kv heads' keys and values to fetch per thread (a decode step's are cold,
         * after the weights' stream): SmolLM2's draft step 0.91-0.96x, 9 heads on 3 kv heads.
         * Which thread computes a head never changes its bits. */
        const int64_t threads = omp_get_num_threads();
        const int64_t chunk = rows == 1 ? (tasks + threads - 1) / threads : 1;
#pragma omp for schedule(static, chunk)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t i = t * per / L->heads, h = t * per % L->heads, kv = h / groups;
            const int64_t pos = start + i;
            const int64_t lo = (L->window > 0 && pos - L->window + 1 > 0) ? pos - L->window + 1 : 0;
            const float *q = qkv + i * width + h * d;
            float *o = out + i * L->heads * d + h * d;
            if (L->kv_half) {
                const uint16_t *K = (const uint16_t *)keys + kv * capacity * d;
                const uint16_t *V = (const uint16_t *)values + kv * capacity * d;
                attend(q, K, V, d, lo, pos, L->scaling, score, o, 1);
                continue;
            }
            const float *K = keys + kv * capacity * d, *V = values + kv * capacity * d;
            if (shared) attend_shared(q, K, V, d, lo, pos, L->scaling, score, sstride, o);
            else attend(q, K, V, d, lo, pos, L->scaling, score, o, 0);
        }
        free(score);
    }
}

/* hidden [rows, H] (updated in place) through one layer; positions start .. start + rows - 1.
 * keys/values: this layer's cache, [kv_heads, capacity, head_dim]; cos/sin: [rows, head_dim]. */
void uag_decoder_layer(const uag_layer_t *L, float *hidden, int64_t rows, int64_t start,
                       float *keys, float *values, int64_t capacity, const float *cos,
                       const float *sin, const uag_scratch_t *S) {
    const int64_t H = L->hidden, d = L->head_dim, hq = L->heads, hkv = L->kv_heads;
    const int64_t width = (hq + 2 * hkv) * d;
    /* Row-wise steps split between the threads for a prompt's rows (each row on its own: the
     * same bits); a verify's few rows stay on one (a parallel region costs more than they do). */
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t i = 0; i < rows; i++) rms_norm(hidden + i * H, L->norm_in, H, L->eps, S->x + i * H);
    linear(&L->qkv, S->x, rows, S->qkv);
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t i = 0; i < rows; i++) {
        float *q = S->qkv + i * width, *k = q + hq * d, *v = k + hkv * d;
        for (int64_t h = 0; h < hq; h++) {
            if (L->gemma) rms_norm(q + h * d, L->q_norm, d, L->eps, q + h * d);
            rope(q + h * d, cos + i * d, sin + i * d, d);
        }
        for (int64_t h = 0; h < hkv; h++) {
            if (L->gemma) rms_norm(k + h * d, L->k_norm, d, L->eps, k + h * d);
            rope(k + h * d, cos + i * d, sin + i * d, d);
            const int64_t at = (h * capacity + start + i) * d;
            if (L->kv_half) { /* round to nearest even, as torch's cast in the prefill path */
                uint16_t *kd = (uint16_t *)keys + at, *vd = (uint16_t *)values + at;
                int64_t c = 0;
                for (; c + 8 <= d; c += 8) {
                    const __m256 kc = _mm256_loadu_ps(k + h * d + c);
                    const __m256 vc = _mm256_loadu_ps(v + h * d + c);
                    const int rne = _MM_FROUND_TO_NEAREST_INT;
                    _mm_storeu_si128((__m128i *)(kd + c), _mm256_cvtps_ph(kc, rne));
                    _mm_storeu_si128((__m128i *)(vd + c), _mm256_cvtps_ph(vc, rne));
                }
                for (; c < d; c++) {
                    kd[c] = _cvtss_sh(k[h * d + c], _MM_FROUND_TO_NEAREST_INT);
                    vd[c] = _cvtss_sh(v[h * d + c], _MM_FROUND_TO_NEAREST_INT);
                }
                continue;
            }
            float *kd = keys + at, *vd = values + at;
            for (int64_t c = 0; c < d; c++) {
                kd[c] = k[h * d + c];
                vd[c] = v[h * d + c];
            }
        }
    }
    attention(L, S->qkv, rows, start, keys, values, capacity, S->attn);
    linear(&L->o, S->attn, rows, S->o);
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t i = 0; i < rows; i++) {
        float *h = hidden + i * H, *o = S->o + i * H, *x = S->x + i * H;
        if (L->gemma) {
            rms_norm(o, L->norm_post_attn, H, L->eps, o);
            for (int64_t c = 0; c < H; c++) h[c] = h[c] + o[c];
            rms_norm(h, L->norm_pre_ff, H, L->eps, x);
        } else {
            for (int64_t c = 0; c < H; c++) h[c] = h[c] + o[c];
            rms_norm(h, L->norm_post_attn, H, L->eps, x);
        }
    }
    linear(&L->gate_up, S->x, rows, S->gu);
    const int64_t I = L->inter;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const float *g = S->gu + i * 2 * I;
        gated(g, g + I, S->act + i * I, I, (int)L->gemma);
    }
    linear(&L->down, S->act, rows, S->o);
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t i = 0; i < rows; i++) {
        float *h = hidden + i * H, *o = S->o + i * H;
        if (L->gemma) rms_norm(o, L->norm_post_ff, H, L->eps, o);
        for (int64_t c = 0; c < H; c++) h[c] = h[c] + o[c];
    }
}

/* hidden [rows, H] through count layers in order (layers: an array of them), layer l with
 * keys[l], values[l] (its cache) and rotary table kind[l] (cos[kind[l]], sin[kind[l]]).
 *
 * Why one call for the whole body: a decode step's 30 SmolLM2 layers as 30 ctypes calls cost
 * ~9 us each in Python (~0.27 ms of a ~5.5 ms draft step). Each layer is uag_decoder_layer,
 * so the same bits. */
void uag_decoder_layers(const struct uag_layer *layers, int64_t count, float *hidden,
                        int64_t rows, int64_t start, float *const *keys, float *const *values,
                        int64_t capacity, const int64_t *kind, const float *const *cos,
                        const float *const *sin, const struct uag_scratch *S) {
    for (int64_t l = 0; l < count; l++)
        uag_decoder_layer(layers + l, hidden, rows, start, keys[l], values[l], capacity,
                          cos[kind[l]], sin[kind[l]], S);
}

/* x [rows, n] through the layers' own RMS norm into y (may be x): the body's final norm, in
 * one call instead of torch's (~0.2 ms a forward, cold after the layers). */
void uag_rms_norm_rows(const float *x, int64_t rows, int64_t n, const float *w, float eps,
                       float *y) {
    for (int64_t i = 0; i < rows; i++) rms_norm(x + i * n, w, n, eps, y + i * n);
}
