/* 4-bit weights times int8 activations, for the assistant (approximate by design).
 *
 * Why: the assistant's draft step reads every weight once per token, so its cost is the bytes
 * it reads. SmolLM2-135M ships as GGUF Q4_1 (each block of 32 weights is d * q + m, q in 0..15):
 * held as q8.c's int8 per output row it reads 1 byte per weight; held as Q4_1 again it reads
 * 0.625 (16 bytes of nibbles plus a scale and a minimum per 32 weights), and for a model that
 * came from Q4_1 the weights are the file's own.
 *
 * Activations: each block of 32 inputs of a row becomes int8 (symmetric, -127..127) with its
 * own scale sx (llama.cpp's Q8_1), and xs = sx * sum(xq) carries the block's sum for the
 * minimum term:
 *   y[m, n] = sum_b d[n, b] * sx[m, b] * sum_k q[n, k] xq[m, k] + m[n, b] * xs[m, b] (+ bias)
 * vpmaddubsw multiplies the unsigned nibbles by the signed activations into int16 pairs that
 * cannot overflow (2 * 15 * 127), vpmaddwd widens them to int32: exact integer sums per block,
 * then one float multiply-add per block and output. Every row is computed on its own.
 *
 * Weight layout, per tile of 8 outputs and block of 32 inputs: 128 bytes, four 32-byte vectors;
 * vector v's byte 4 * j + i holds output j's input 8v + i in its low nibble and 8v + 4 + i in
 * its high nibble. Parameters per tile and block: d[8] then m[8], as IEEE half floats: Q4_1
 * stores them so (for the file's own weights they are exact), and at 32 bytes instead of 64 per
 * 160-byte tile block they cut the assistant's bytes per draft step by a sixth (SmolLM2's body
 * 80 → 67 MB).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define LANES 8 /* outputs per tile */
#define QB 32   /* inputs per block */
#define MAX_MB 4
#define MAX_MB2 8 /* rows per pass over a tile pair (pair512: 8 + 2 mb vector registers) */
#define Q4_SINGLE_ROWS 2 /* up to this many rows: every tile alone (uag_linear_q4) */

/* Block b's d[8] and m[8] from the half-float parameters (F16C: every AVX2 CPU has it). */
static inline __attribute__((always_inline)) __m256 param_d(const uint16_t *p, int64_t b) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + b * 2 * LANES)));
}
static inline __attribute__((always_inline)) __m256 param_m(const uint16_t *p, int64_t b) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + b * 2 * LANES + LANES)));
}

/* One row's block b: x[0..32) -> xq (int8), returns its scale; *sum = scale * sum(xq). */
static float quantize_block(const float *x, int8_t *xq, float *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 top = _mm256_setzero_ps();
    for (int k = 0; k < QB; k += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
    float amax = 0.0f;
    for (int i = 0; i < 8; i++) amax = top[i] > amax ? top[i] : amax;
    const float s = amax / 127.0f;
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i total = _mm256_setzero_si256();
    for (int k = 0; k < QB; k += 8) {
        const __m256 q = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i i32 = _mm256_cvtps_epi32(q); /* |q| <= 127 by construction */
        total = _mm256_add_epi32(total, i32);
        const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
        _mm_storel_epi64((__m128i *)(xq + k), _mm_packs_epi16(i16, i16));
    }
    int32_t n = 0;
    for (int i = 0; i < 8; i++) n += ((int32_t *)&total)[i];
    *sum = s * (float)n;
    return s;
}

/* Rows [0, mb) of xq against one tile (8 outputs) over all blocks; float sums into out[i].
 * DOT(acc, lo, a, hi, c) adds lo.a + hi.c (u8 x s8, four products per int32 lane) into acc. */
#define TILE(NAME, ATTR, DOT)                                                                     \
    static inline ATTR void NAME(const int8_t *xq, const float *sx, const float *xs, int64_t Kb, \
                                 const int mb, const uint8_t *w, const uint16_t *p, __m256 *out) {  \
        const __m256i low = _mm256_set1_epi8(0x0F);                                               \
        __m256 facc[MAX_MB];                                                                      \
        _Pragma("GCC unroll 4") for (int i = 0; i < mb; i++) facc[i] = _mm256_setzero_ps();      \
        for (int64_t b = 0; b < Kb; b++) {                                                        \
            const uint8_t *wb = w + b * (LANES * QB / 2);                                         \
            _mm_prefetch((const char *)wb + 1024, _MM_HINT_T0);                                  \
            _mm_prefetch((const char *)wb + 1024 + 64, _MM_HINT_T0);                             \
            __m256i iacc[MAX_MB];                                                                 \
            _Pragma("GCC unroll 4") for (int i = 0; i < mb; i++) iacc[i] = _mm256_setzero_si256(); \
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; v++) {                                \
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(wb + v * 32));           \
                const __m256i lo = _mm256_and_si256(raw, low);                                    \
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);              \
                _Pragma("GCC unroll 4") for (int i = 0; i < mb; i++) {                           \
                    int32_t a, c;                                                                 \
                    memcpy(&a, xq + i * Kb * QB + b * QB + v * 8, 4);                             \
                    memcpy(&c, xq + i * Kb * QB + b * QB + v * 8 + 4, 4);                         \
                    iacc[i] = DOT(iacc[i], lo, _mm256_set1_epi32(a), hi, _mm256_set1_epi32(c));   \
                }                                                                                 \
            }                                                                                     \
            const __m256 d = param_d(p, b);                                                       \
            const __m256 m = param_m(p, b);                                                       \
            _Pragma("GCC unroll 4") for (int i = 0; i < mb; i++) {                               \
                const __m256 scaled = _mm256_mul_ps(d, _mm256_set1_ps(sx[i * Kb + b]));           \
                facc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[i]), scaled, facc[i]);          \
                facc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[i * Kb + b]), facc[i]);            \
            }                                                                                     \
        }                                                                                         \
        _Pragma("GCC unroll 4") for (int i = 0; i < mb; i++) out[i] = facc[i];                   \
    }

/* AVX2: vpmaddubsw into int16 pairs (two of them added before widening: 2 * 2 * 15 * 127 <
 * 32768, no saturation), vpmaddwd to int32. */
static inline __attribute__((always_inline)) __m256i dot_avx2(__m256i acc, __m256i lo, __m256i a,
                                                              __m256i hi, __m256i c) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, a), _mm256_maddubs_epi16(hi, c));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
TILE(tile_avx2, __attribute__((always_inline)), dot_avx2)

#if HAVE_AVXVNNI
/* AVX-VNNI (where the CPU has it, checked at run time): vpdpbusd does the same sums in one
 * instruction per operand pair, exactly (int32 accumulation). */
#define VNNI __attribute__((target("avx2,fma,avxvnni")))
static inline __attribute__((always_inline)) VNNI __m256i dot_vnni(__m256i acc, __m256i lo,
                                                                   __m256i a, __m256i hi, __m256i c) {
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, lo, a), hi, c);
}
TILE(tile_vnni, VNNI __attribute__((always_inline)), dot_vnni)
#endif

#define CASE(FN, MB) case MB: FN(xq, sx, xs, Kb, MB, w, p, out); break;
static void dispatch_avx2(const int8_t *xq, const float *sx, const float *xs, int64_t Kb, int mb,
                          const uint8_t *w, const uint16_t *p, __m256 *out) {
    switch (mb) {
        CASE(tile_avx2, 1) CASE(tile_avx2, 2) CASE(tile_avx2, 3) CASE(tile_avx2, 4)
        default: abort();
    }
}
#if HAVE_AVXVNNI
static VNNI void dispatch_vnni(const int8_t *xq, const float *sx, const float *xs, int64_t Kb,
                               int mb, const uint8_t *w, const uint16_t *p, __m256 *out) {
    switch (mb) {
        CASE(tile_vnni, 1) CASE(tile_vnni, 2) CASE(tile_vnni, 3) CASE(tile_vnni, 4)
        default: abort();
    }
}
#endif


/* AVX-512 VNNI for one tile (a layer's odd last tile, and every tile of a one- or two-row
 * forward: Q4_SINGLE_ROWS; pair512 below takes the others): one
 * 64-byte load holds two of a block's four vectors; the activations are laid out to match once
 * per call (xe: per row and block, four 64-byte vectors: lanes 0-7 take the quad the first
 * vector's nibbles multiply, lanes 8-15 the second's). Exact int32 lanes, halves added at the
 * end: the same integers as the 256-bit paths, so the same floats. */
#define AVX512VNNI __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")))
#define XE_BLOCK 256 /* bytes of expanded activations per row and block */

static void expand_rows(const int8_t *xq, int64_t M, int64_t Kb, uint8_t *xe) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < Kb; b++) {
            const int8_t *x = xq + (m * Kb + b) * QB;
            int32_t *dst = (int32_t *)(xe + (m * Kb + b) * XE_BLOCK);
            /* vectors (v0 lo, v1 lo), (v0 hi, v1 hi), (v2 lo, v3 lo), (v2 hi, v3 hi): vector v's
             * low nibbles take inputs 8v..8v+3, its high nibbles 8v+4..8v+7 */
            const int first[4] = {0, 4, 16, 20};
            for (int e = 0; e < 4; e++) {
                int32_t a, c;
                memcpy(&a, x + first[e], 4);
                memcpy(&c, x + first[e] + 8, 4);
                for (int l = 0; l < 8; l++) dst[e * 16 + l] = a, dst[e * 16 + 8 + l] = c;
            }
        }
}

static inline AVX512VNNI __attribute__((always_inline)) void tile512(
    const uint8_t *xe, const float *sx, const float *xs, int64_t Kb, const int mb,
    const uint8_t *w, const uint16_t *p, __m256 *out) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m256 facc[MAX_MB];
    _Pragma("GCC unroll 4") for (int i = 0; i < mb; i++) facc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < Kb; b++) {
        const uint8_t *wb = w + b * (LANES * QB / 2);
        _mm_prefetch((const char *)wb + 1024, _MM_HINT_T0);
        _mm_prefetch((const char *)wb + 1024 + 64, _MM_HINT_T0);
        const __m512i r01 = _mm512_loadu_si512((const void *)wb);
        const __m512i r23 = _mm512_loadu_si512((const void *)(wb + 64));
        const __m512i nib[4] = {_mm512_and_si512(r01, low),
                                _mm512_and_si512(_mm512_srli_epi16(r01, 4), low),
                                _mm512_and_si512(r23, low),
                                _mm512_and_si512(_mm512_srli_epi16(r23, 4), low)};
        const __m256 d = param_d(p, b), m = param_m(p, b);
        _Pragma("GCC unroll 4") for (int i = 0; i < mb; i++) {
            const uint8_t *x = xe + (i * Kb + b) * XE_BLOCK;
            __m512i acc = _mm512_setzero_si512();
            _Pragma("GCC unroll 4") for (int e = 0; e < 4; e++) acc = _mm512_dpbusd_epi32(
                acc, nib[e], _mm512_loadu_si512((const void *)(x + e * 64)));
            const __m256i sum = _mm256_add_epi32(_mm512_castsi512_si256(acc),
                                                 _mm512_extracti64x4_epi64(acc, 1));
            const __m256 scaled = _mm256_mul_ps(d, _mm256_set1_ps(sx[i * Kb + b]));
            facc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scaled, facc[i]);
            facc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[i * Kb + b]), facc[i]);
        }
    }
    _Pragma("GCC unroll 4") for (int i = 0; i < mb; i++) out[i] = facc[i];
}

/* AVX-512 VNNI over two tiles at once (16 outputs, tiles t and t + 1): one 512-bit lane per
 * output, so no halves to add and a 512-bit epilogue. A block's two 128-byte tiles become eight
 * vectors of 16 outputs x one quad each (low nibbles of vector v: quad 2v, high: 2v + 1), and
 * each row's quads are broadcast from xq as they are: ~13 instructions per row, block and 16
 * outputs where tile512 takes ~30, so a catch-up or prefill row costs about half as much. The
 * same int32 sums and the same float operations per output as every other path: the same bits. */
static inline AVX512VNNI __attribute__((always_inline)) void pair512(
    const int8_t *xq, int64_t K, const float *sx, const float *xs, int64_t Kb, const int mb,
    const uint8_t *w0, const uint8_t *w1, const uint16_t *p0, const uint16_t *p1, __m512 *out) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 facc[MAX_MB2];
    _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++) facc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < Kb; b++) {
        const uint8_t *a = w0 + b * (LANES * QB / 2), *c = w1 + b * (LANES * QB / 2);
        _mm_prefetch((const char *)a + 1024, _MM_HINT_T0);
        _mm_prefetch((const char *)a + 1024 + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)c + 1024, _MM_HINT_T0);
        _mm_prefetch((const char *)c + 1024 + 64, _MM_HINT_T0);
        __m512i nib[8];
        _Pragma("GCC unroll 4") for (int v = 0; v < 4; v++) {
            const __m512i r = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(a + v * 32))),
                _mm256_loadu_si256((const __m256i *)(c + v * 32)), 1);
            nib[2 * v] = _mm512_and_si512(r, low);
            nib[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(r, 4), low);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p0 + b * 2 * LANES))),
            _mm_loadu_si128((const __m128i *)(p1 + b * 2 * LANES)), 1));
        const __m512 m = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p0 + b * 2 * LANES + LANES))),
            _mm_loadu_si128((const __m128i *)(p1 + b * 2 * LANES + LANES)), 1));
        _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++) {
            const int8_t *x = xq + i * K + b * QB;
            __m512i acc = _mm512_setzero_si512();
            _Pragma("GCC unroll 8") for (int q = 0; q < 8; q++) {
                int32_t four;
                memcpy(&four, x + 4 * q, sizeof four);
                acc = _mm512_dpbusd_epi32(acc, nib[q], _mm512_set1_epi32(four));
            }
            const __m512 scaled = _mm512_mul_ps(d, _mm512_set1_ps(sx[i * Kb + b]));
            facc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), scaled, facc[i]);
            facc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[i * Kb + b]), facc[i]);
        }
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++) out[i] = facc[i];
}

/* All M rows against tiles t and t + 1 (weights w0, w1; parameters p0, p1), bias added, into
 * y's 16 columns from 8 t. */
#define CASEPAIR(MB) case MB: pair512(x, K, s, xsum, Kb, MB, w0, w1, p0, p1, out); break;
static AVX512VNNI void pair_rows(const int8_t *xq, int64_t K, const float *sx, const float *xs,
                                 int64_t Kb, int64_t M, const uint8_t *w0, const uint8_t *w1,
                                 const uint16_t *p0, const uint16_t *p1, const float *bias,
                                 float *y, int64_t ldy) {
    for (int64_t m0 = 0; m0 < M; m0 += MAX_MB2) {
        const int mb = (int)(M - m0 < MAX_MB2 ? M - m0 : MAX_MB2);
        const int8_t *x = xq + m0 * K;
        const float *s = sx + m0 * Kb, *xsum = xs + m0 * Kb;
        __m512 out[MAX_MB2];
        switch (mb) {
            CASEPAIR(1) CASEPAIR(2) CASEPAIR(3) CASEPAIR(4)
            CASEPAIR(5) CASEPAIR(6) CASEPAIR(7) CASEPAIR(8)
            default: abort();
        }
        for (int i = 0; i < mb; i++) {
            __m512 v = out[i];
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
            _mm512_storeu_ps(y + (m0 + i) * ldy, v);
        }
    }
}

#define CASE512(MB) case MB: tile512(xe, sx, xs, Kb, MB, w, p, out); break;
static AVX512VNNI void dispatch512(const uint8_t *xe, const float *sx, const float *xs, int64_t Kb,
                                   int mb, const uint8_t *w, const uint16_t *p, __m256 *out) {
    switch (mb) {
        CASE512(1) CASE512(2) CASE512(3) CASE512(4)
        default: abort();
    }
}


/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) times the Q4_1 weight (K, N multiples of
 * 32 and 8), plus bias. Both instruction paths give the same exact integer sums, so the same
 * floats. */
void uag_linear_q4(const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *w,
                   const uint16_t *params, int64_t N, const float *bias, float *y, int64_t ldy) {
    const int64_t Kb = K / QB, tiles = N / LANES;
    /* AVX-512 VNNI for one row too: SmolLM2's one-row body 4.2-4.5 → 3.9-4.0 ms (same bits) */
    const int vnni = uag_use_vnni(), wide = uag_use_avx512vnni();
    (void)vnni; /* unused where the compiler lacks AVX-VNNI */
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *sx = (float *)malloc(sizeof(float) * (size_t)(M * Kb));
    float *xs = (float *)malloc(sizeof(float) * (size_t)(M * Kb));
    /* each row on its own (a prompt's rows split between the threads; the same values) */
#pragma omp parallel for schedule(static) if (M >= 8)
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < Kb; b++)
            sx[m * Kb + b] = quantize_block(x + m * ldx + b * QB, xq + m * K + b * QB, xs + m * Kb + b);
    /* AVX-512: tiles in pairs (pair512), an odd last tile alone (tile512, expanded rows). A draft
     * step's one or two rows take every tile alone: a pair reads two weight streams and two
     * parameter streams Kb * 128 bytes apart, which a 2-core Zen 4 streamed at ~8 GB/s per
     * thread; one tile's single stream ran SmolLM2's body products 4.5 -> 3.5 ms at one row and
     * 4.4 -> 3.9 ms at two (builds alternating in one process; from three rows pairs win). */
    const int64_t pairs = wide && M > Q4_SINGLE_ROWS ? tiles / 2 : 0;
    const int64_t tasks = pairs + (tiles - 2 * pairs);
    uint8_t *xe = wide && 2 * pairs < tiles ? (uint8_t *)malloc((size_t)(M * Kb * XE_BLOCK)) : NULL;
    if (xe) expand_rows(xq, M, Kb, xe);
#pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < tasks; task++) {
        if (task < pairs) {
            const int64_t t = 2 * task;
            const uint8_t *w0 = w + t * Kb * (LANES * QB / 2), *w1 = w0 + Kb * (LANES * QB / 2);
            const uint16_t *p0 = params + t * Kb * 2 * LANES, *p1 = p0 + Kb * 2 * LANES;
            pair_rows(xq, K, sx, xs, Kb, M, w0, w1, p0, p1, bias ? bias + t * LANES : NULL,
                      y + t * LANES, ldy);
            continue;
        }
        const int64_t t = 2 * pairs + (task - pairs);
        const uint8_t *wt = w + t * Kb * (LANES * QB / 2);
        const uint16_t *pt = params + t * Kb * 2 * LANES;
        for (int64_t m0 = 0; m0 < M; m0 += MAX_MB) {
            const int mb = (int)(M - m0 < MAX_MB ? M - m0 : MAX_MB);
            __m256 out[MAX_MB];
            if (wide)
                dispatch512(xe + m0 * Kb * XE_BLOCK, sx + m0 * Kb, xs + m0 * Kb, Kb, mb, wt, pt, out);
#if HAVE_AVXVNNI
            else if (vnni)
                dispatch_vnni(xq + m0 * K, sx + m0 * Kb, xs + m0 * Kb, Kb, mb, wt, pt, out);
#endif
            else
                dispatch_avx2(xq + m0 * K, sx + m0 * Kb, xs + m0 * Kb, Kb, mb, wt, pt, out);
            for (int i = 0; i < mb; i++) {
                __m256 v = out[i];
                if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + t * LANES));
                _mm256_storeu_ps(y + (m0 + i) * ldy + t * LANES, v);
            }
        }
    }
    free(xq), free(sx), free(xs), free(xe);
}

/* w[N, K] (row-major fp32; N a multiple of 8, K of 32) → the layout above, when every block of
 * 32 weights of each output lies on a 16-level grid: step (max - min) / 15 from the block's
 * minimum, both as half floats, every weight within tol steps of min + step * q (q rounded to
 * nearest, in 0..15) with those halves. Returns 1, or 0 when some block is off the grid (or its
 * step or minimum is not a half float to within tol: see uag.kernels.native.q4_grid). */
int64_t uag_q4_grid(const float *w, int64_t N, int64_t K, float tol, uint8_t *packed,
                    uint16_t *params) {
    const int64_t Kb = K / QB, tiles = N / LANES;
    int64_t bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t b = 0; b < Kb && !bad; b++) {
            uint8_t *pk = packed + (t * Kb + b) * (LANES * QB / 2);
            uint16_t *pp = params + (t * Kb + b) * 2 * LANES;
            for (int j = 0; j < LANES; j++) {
                const float *x = w + (t * LANES + j) * K + b * QB;
                float lo = x[0], hi = x[0];
                for (int i = 1; i < QB; i++) {
                    lo = x[i] < lo ? x[i] : lo;
                    hi = x[i] > hi ? x[i] : hi;
                }
                const uint16_t step16 = _cvtss_sh((hi - lo) / 15.0f, _MM_FROUND_TO_NEAREST_INT);
                const uint16_t lo16 = _cvtss_sh(lo, _MM_FROUND_TO_NEAREST_INT);
                const float step = _cvtsh_ss(step16), base = _cvtsh_ss(lo16);
                const float safe = step > 0.0f ? step : 1.0f;
                uint8_t q[QB];
                for (int i = 0; i < QB; i++) {
                    float r = nearbyintf((x[i] - base) / safe);
                    r = r < 0.0f ? 0.0f : r > 15.0f ? 15.0f : r;
                    if (!(fabsf(base + step * r - x[i]) <= tol * safe + 1e-30f)) bad++;
                    q[i] = (uint8_t)r;
                }
                for (int v = 0; v < 4; v++)
                    for (int i = 0; i < 4; i++)
                        pk[v * 32 + 4 * j + i] = (uint8_t)(q[8 * v + i] | (q[8 * v + 4 + i] << 4));
                pp[j] = step16, pp[LANES + j] = lo16;
            }
        }
    }
    return bad == 0;
}
