/* Skinny matrix products for decoding on AVX2 CPUs: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 *
 * Why: a decode or verify step multiplies 1-16 activation rows by every weight matrix once, so
 * its cost should be one read of the weights. This kernel streams each weight once per tile of
 * outputs, with the activation rows in L1, and keeps enough independent accumulators in
 * registers that several rows cost little more than one: the classic outer-product micro-kernel
 * (broadcast one activation, multiply a vector of 8 outputs' weights), register-blocked as
 * mb rows x nv vectors. Measured on 2 Zen 3 cores (FMA peak ~174 GFLOP/s): fp32 layers in cache
 * at ~125 GFLOP/s for 3-9 rows (the previous dot-product kernel: ~80), Gemma 3's int8
 * 262,144 x 640 head in ~11 ms for 1 row and ~27 ms for 8 (previously ~11 and ~45).
 *
 * Row-count invariance by construction (what lossless verification needs): output (m, n) is one
 * float lane accumulated by fused multiply-adds over k = 0, 1, ..., K-1 in order, then scaled
 * and biased, whatever the register blocking, how many rows share the call or which thread
 * computes it. Built without -ffast-math and with -ffp-contract=off so the compiler cannot
 * reassociate or fuse differently in different places.
 *
 * Weight layout: [N / 8][K][8] -- eight outputs' weights side by side for every k, so a tile of
 * nv vectors is nv sequential streams (N % 8 == 0; the caller pads). Weights are fp32; or int8
 * with one float scale per output (weight-only quantisation:
 * y[m, n] = scale[n] * sum_k x[m, k] * q[n, k]); or block-scaled int8 that *is* the fp32 weight
 * (q[n, k] * s[n, k / 32] exact, as in models de-quantised from GGUF's Q8_0 / Q5_0), widened back
 * in registers before each multiply-add, so its outputs are bitwise the fp32 path's; or
 * block-affine uint8 that is the fp32 weight (q[n, k] * s + b per block of 16, as in models
 * de-quantised from GGUF's k-quants Q4_K / Q6_K), likewise widened back bitwise.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "simd.h"

#define LANES 8 /* outputs per vector; the weight is stored as [N/8][K][8] */
#define BLOCK_K 32 /* inputs sharing one scale in the block-scaled int8 layout */
#define ABLOCK_K 16 /* inputs sharing one scale and base in the block-affine uint8 layout */

static inline __attribute__((always_inline)) __m256 w_f32(const float *w) { return _mm256_loadu_ps(w); }
static inline __attribute__((always_inline)) __m256 w_i8(const int8_t *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}
/* The exact fp32 weights of the block formats below, eight outputs at one input: the one
 * definition every AVX2 loop uses, so the weights each multiply-add sees cannot differ. */
static inline __attribute__((always_inline)) __m256 w_b8(const int8_t *w, __m256 s) {
    return _mm256_mul_ps(w_i8(w), s);
}
static inline __attribute__((always_inline)) __m256 w_a8(const uint8_t *w, __m256 s, __m256 b) {
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)w)));
    return _mm256_add_ps(_mm256_mul_ps(q, s), b);
}

/* One row (a decode step) of a block format against nv vectors for k in [k0, k1): block by
 * block, each block's parameters loaded into registers once instead of once per input. Why:
 * one row shares no weight with another, so its widening and its parameter loads are the
 * whole cost. On a 2-core Zen 3 (AVX2) Gemma 3's body products took 28 % less time (same
 * bits), 4-vector tiles for the affine format included (tile_vectors). Each output is the same
 * chain of multiply-adds over k in order as in the loops below, on the same weights. Several
 * rows (k_blocks) also go block by block, each block's parameter row found once (2-4 % at
 * 2-9 rows), but reload the parameters per input: their accumulators fill the registers. */
static inline __attribute__((always_inline)) void row_blocks(
    const float *x, int64_t k0, int64_t k1, int64_t K, const void *w, const float *params,
    const int affine, const int nv, __m256 *state) {
    const int64_t blk = affine ? ABLOCK_K : BLOCK_K, KB = K / blk, np = affine ? 2 : 1;
    __m256 acc[8];
    _Pragma("GCC unroll 8") for (int j = 0; j < nv; j++) acc[j] = state[j];
    for (int64_t kb = k0; kb < k1;) {
        const int64_t end = (kb / blk + 1) * blk < k1 ? (kb / blk + 1) * blk : k1;
        __m256 sv[8], bv[8];
        _Pragma("GCC unroll 8") for (int j = 0; j < nv; j++) {
            const float *p = params + (j * KB + kb / blk) * np * LANES;
            sv[j] = _mm256_loadu_ps(p);
            bv[j] = affine ? _mm256_loadu_ps(p + LANES) : sv[j];
        }
        for (int64_t k = kb; k < end; k++) {
            const __m256 xb = _mm256_broadcast_ss(x + k);
            _Pragma("GCC unroll 8") for (int j = 0; j < nv; j++) {
                const __m256 wv = affine ? w_a8((const uint8_t *)w + (j * K + k) * LANES, sv[j], bv[j])
                                         : w_b8((const int8_t *)w + (j * K + k) * LANES, sv[j]);
                acc[j] = _mm256_fmadd_ps(xb, wv, acc[j]);
            }
        }
        kb = end;
    }
    _Pragma("GCC unroll 8") for (int j = 0; j < nv; j++) state[j] = acc[j];
}

/* Rows [0, mb) of x against nv vectors of outputs, for k in [k0, k1): adds to the
 * accumulators in state (row i, vector j at state[i * 8 + j]). mb and nv are constants after
 * inlining, so the accumulators live in registers within the k loop. */
#define KERNEL(NAME, WTYPE, LOADW)                                                             \
static inline __attribute__((always_inline)) void NAME(                                        \
    const float *x, int64_t ldx, const int mb, int64_t k0, int64_t k1, int64_t K,              \
    const WTYPE *w, const int nv, __m256 *state) {                                             \
    __m256 acc[6][8];                                                                          \
    _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++)                                       \
        _Pragma("GCC unroll 8") for (int j = 0; j < nv; j++) acc[i][j] = state[i * 8 + j];     \
    for (int64_t k = k0; k < k1; k++) {                                                        \
        __m256 wv[8];                                                                          \
        _Pragma("GCC unroll 8") for (int j = 0; j < nv; j++) wv[j] = LOADW(w + (j * K + k) * LANES); \
        _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++) {                                 \
            const __m256 xb = _mm256_broadcast_ss(x + i * ldx + k);                            \
            _Pragma("GCC unroll 8") for (int j = 0; j < nv; j++)                               \
                acc[i][j] = _mm256_fmadd_ps(xb, wv[j], acc[i][j]);                             \
        }                                                                                      \
    }                                                                                          \
    _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++)                                       \
        _Pragma("GCC unroll 8") for (int j = 0; j < nv; j++) state[i * 8 + j] = acc[i][j];     \
}

KERNEL(k_f32, float, w_f32)
KERNEL(k_i8, int8_t, w_i8)

/* The two block formats, each bitwise the fp32 kernel's output on its exact weight (checked when
 * the layer is built: uag.kernels.native.block_int8 / block_affine):
 *   - block-scaled int8 (affine 0): w[n, k] = q[n, k] * s[n, k / 32], every product exact, from
 *     ~a quarter of fp32's bytes; scales [N/8][K/32][8];
 *   - block-affine uint8 (affine 1): w[n, k] = fl(fl(q[n, k] * s) + b) for the (s, b) of its
 *     block of 16 inputs, from 1.5 of fp32's 4 bytes; parameters [N/8][K/16][2][8] (eight
 *     scales, then eight bases).
 * Rows [0, mb) against nv vectors for k in [k0, k1), block by block; one row goes to
 * row_blocks. affine, mb and nv are constants after inlining. */
static inline __attribute__((always_inline)) void k_blocks(
    const float *x, int64_t ldx, const int mb, int64_t k0, int64_t k1, int64_t K, const void *w,
    const float *params, const int affine, const int nv, __m256 *state) {
    if (mb == 1) {
        row_blocks(x, k0, k1, K, w, params, affine, nv, state);
        return;
    }
    const int64_t blk = affine ? ABLOCK_K : BLOCK_K, KB = K / blk, np = affine ? 2 : 1;
    __m256 acc[6][8];
    _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++)
        _Pragma("GCC unroll 8") for (int j = 0; j < nv; j++) acc[i][j] = state[i * 8 + j];
    for (int64_t kb = k0; kb < k1;) {
        const int64_t end = (kb / blk + 1) * blk < k1 ? (kb / blk + 1) * blk : k1;
        const float *pb = params + (kb / blk) * np * LANES;
        for (int64_t k = kb; k < end; k++) {
            __m256 wv[8];
            _Pragma("GCC unroll 8") for (int j = 0; j < nv; j++) {
                const float *p = pb + j * KB * np * LANES;
                wv[j] = affine ? w_a8((const uint8_t *)w + (j * K + k) * LANES, _mm256_loadu_ps(p),
                                      _mm256_loadu_ps(p + LANES))
                               : w_b8((const int8_t *)w + (j * K + k) * LANES, _mm256_loadu_ps(p));
            }
            _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++) {
                const __m256 xb = _mm256_broadcast_ss(x + i * ldx + k);
                _Pragma("GCC unroll 8") for (int j = 0; j < nv; j++)
                    acc[i][j] = _mm256_fmadd_ps(xb, wv[j], acc[i][j]);
            }
        }
        kb = end;
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++)
        _Pragma("GCC unroll 8") for (int j = 0; j < nv; j++) state[i * 8 + j] = acc[i][j];
}

/* The register-blocking shapes (mb rows x nv vectors) every kernel is instantiated for; one
 * list, so the kernels cannot disagree on which shapes tile_vectors / max_rows may ask for. */
#define SHAPES(C) \
    C(1,1) C(1,2) C(1,3) C(1,4) C(1,8) \
    C(2,1) C(2,2) C(2,3) C(2,4) \
    C(3,1) C(3,2) C(3,3) C(3,4) \
    C(4,1) C(4,2) C(4,3) \
    C(5,1) C(5,2) \
    C(6,1) C(6,2)

#define CASE_F32(MB, NV) case (MB) * 16 + (NV): k_f32(x, ldx, MB, k0, k1, K, w, NV, state); break;
#define CASE_I8(MB, NV) case (MB) * 16 + (NV): k_i8(x, ldx, MB, k0, k1, K, w, NV, state); break;
#define CASE_B8(MB, NV) case (MB) * 16 + (NV): k_blocks(x, ldx, MB, k0, k1, K, w, bs, 0, NV, state); break;
#define CASE_A8(MB, NV) case (MB) * 16 + (NV): k_blocks(x, ldx, MB, k0, k1, K, w, ab, 1, NV, state); break;

static void dispatch_f32(const float *x, int64_t ldx, int mb, int64_t k0, int64_t k1, int64_t K,
                         const float *w, int nv, __m256 *state) {
    switch (mb * 16 + nv) { SHAPES(CASE_F32) }
}
static void dispatch_i8(const float *x, int64_t ldx, int mb, int64_t k0, int64_t k1, int64_t K,
                        const int8_t *w, int nv, __m256 *state) {
    switch (mb * 16 + nv) { SHAPES(CASE_I8) }
}
static void dispatch_b8(const float *x, int64_t ldx, int mb, int64_t k0, int64_t k1, int64_t K,
                        const int8_t *w, const float *bs, int nv, __m256 *state) {
    switch (mb * 16 + nv) { SHAPES(CASE_B8) }
}
static void dispatch_a8(const float *x, int64_t ldx, int mb, int64_t k0, int64_t k1, int64_t K,
                        const uint8_t *w, const float *ab, int nv, __m256 *state) {
    switch (mb * 16 + nv) { SHAPES(CASE_A8) }
}

/* AVX-512, where the CPU has it (checked at run time): two of a tile's 8-output vectors side by
 * side in one 16-lane register, so each multiply-add serves 16 outputs. Lane l of the pair is
 * still output l of its vector, accumulated by one fused multiply-add per k in order, so every
 * output is the same chain of roundings as on the AVX2 path: bitwise the same results (tested by
 * switching paths), at up to half the multiply-add instructions once several rows share the
 * weights (a verify). One row stays on the AVX2 path: it is bound by memory, not arithmetic. */
#define AVX512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl")))
#define PAIRS 2   /* 8-output vectors per tile on this path: 2 pairs, 32 outputs */
#define MAX_MB512 12 /* rows per pass: 12 x 2 accumulators + 2 weights + 1 broadcast of 32 */

static inline AVX512 __attribute__((always_inline)) __m512 join(__m256 lo, __m256 hi) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
static inline AVX512 __attribute__((always_inline)) __m512 w2_f32(const float *a, const float *b) {
    return join(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
}
static inline AVX512 __attribute__((always_inline)) __m128i bytes2(const void *a, const void *b) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b));
}
static inline AVX512 __attribute__((always_inline)) __m512 w2_i8(const int8_t *a, const int8_t *b) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes2(a, b)));
}
static inline AVX512 __attribute__((always_inline)) __m512 w2_u8(const uint8_t *a, const uint8_t *b) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes2(a, b)));
}

/* Rows [0, mb) against PAIRS pairs of vectors (4 vectors: j = 2p, 2p + 1) for k in [k0, k1);
 * state as in the AVX2 kernels. fmt: one of this file's formats (formats.h: fp32, int8 with
 * the scale applied at the end as k_i8, block int8, block affine); the weight each multiply-add
 * sees is bitwise the AVX2 path's. */
static inline AVX512 __attribute__((always_inline)) void k512(
    const float *x, int64_t ldx, const int mb, int64_t k0, int64_t k1, int64_t K, const void *w,
    const float *bs, const int fmt, __m256 *state) {
    __m512 acc[MAX_MB512][PAIRS];
    _Pragma("GCC unroll 12") for (int i = 0; i < mb; i++)
        _Pragma("GCC unroll 2") for (int p = 0; p < PAIRS; p++)
            acc[i][p] = join(state[i * 8 + 2 * p], state[i * 8 + 2 * p + 1]);
    const float *wf = (const float *)w;
    const int8_t *wq = (const int8_t *)w;
    const uint8_t *wu = (const uint8_t *)w;
    for (int64_t k = k0; k < k1; k++) {
        __m512 wv[PAIRS];
        _Pragma("GCC unroll 2") for (int p = 0; p < PAIRS; p++) {
            const int64_t a = ((2 * p) * K + k) * LANES, b = ((2 * p + 1) * K + k) * LANES;
            if (fmt == UAG_FMT_FP32) {
                wv[p] = w2_f32(wf + a, wf + b);
            } else if (fmt == UAG_FMT_INT8) {
                wv[p] = w2_i8(wq + a, wq + b);
            } else if (fmt == UAG_FMT_BLOCK_INT8) {
                const int64_t KB = K / BLOCK_K;
                const __m512 sc = w2_f32(bs + ((2 * p) * KB + k / BLOCK_K) * LANES,
                                         bs + ((2 * p + 1) * KB + k / BLOCK_K) * LANES);
                wv[p] = _mm512_mul_ps(w2_i8(wq + a, wq + b), sc);
            } else {
                const int64_t KB = K / ABLOCK_K;
                const float *pa = bs + ((2 * p) * KB + k / ABLOCK_K) * 2 * LANES;
                const float *pb = bs + ((2 * p + 1) * KB + k / ABLOCK_K) * 2 * LANES;
                wv[p] = _mm512_add_ps(_mm512_mul_ps(w2_u8(wu + a, wu + b), w2_f32(pa, pb)),
                                      w2_f32(pa + LANES, pb + LANES));
            }
        }
        _Pragma("GCC unroll 12") for (int i = 0; i < mb; i++) {
            const __m512 xb = _mm512_set1_ps(x[i * ldx + k]);
            _Pragma("GCC unroll 2") for (int p = 0; p < PAIRS; p++)
                acc[i][p] = _mm512_fmadd_ps(xb, wv[p], acc[i][p]);
        }
    }
    _Pragma("GCC unroll 12") for (int i = 0; i < mb; i++)
        _Pragma("GCC unroll 2") for (int p = 0; p < PAIRS; p++) {
            state[i * 8 + 2 * p] = _mm512_castps512_ps256(acc[i][p]);
            state[i * 8 + 2 * p + 1] = _mm512_extractf32x8_ps(acc[i][p], 1);
        }
}

#define CASE512(FMT, MB) case (FMT) * 16 + (MB): k512(x, ldx, MB, k0, k1, K, w, bs, FMT, state); break;
#define ROWS512(FMT) CASE512(FMT, 1) CASE512(FMT, 2) CASE512(FMT, 3) CASE512(FMT, 4) \
    CASE512(FMT, 5) CASE512(FMT, 6) CASE512(FMT, 7) CASE512(FMT, 8) CASE512(FMT, 9) \
    CASE512(FMT, 10) CASE512(FMT, 11) CASE512(FMT, 12)
static AVX512 void dispatch512(const float *x, int64_t ldx, int mb, int64_t k0, int64_t k1,
                               int64_t K, const void *w, const float *bs, int fmt, __m256 *state) {
    switch (fmt * 16 + mb) {
        ROWS512(UAG_FMT_FP32) ROWS512(UAG_FMT_INT8)
        ROWS512(UAG_FMT_BLOCK_INT8) ROWS512(UAG_FMT_BLOCK_AFFINE)
        default: abort();
    }
}

/* AVX-512 with F, BW, DQ, VL (else AVX2). */
static int detect_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}
UAG_CPU_PATH(static, use_avx512, uag_set_avx512, detect_avx512())

#define GROUP 16 /* rows whose accumulators stay in one state buffer (16 x 8 vectors, 4 KB) */
#define KC 128   /* inputs per chunk when a tile takes several passes */

/* Register blocking by row count: nv vectors per tile, at most max_rows(nv) rows per pass over
 * a tile (mb * nv accumulators + nv weights + 1 broadcast <= 16 ymm registers; >= 8
 * accumulators where possible, since 2 FMA pipes x 4 cycles of latency need 8 in flight).
 * One row of the affine format takes 4: its weights cost a multiply and an add each before the
 * multiply-add, and 8 vectors' parameters do not fit in registers beside them (Zen 3: ~20 %
 * faster than 8, the same bits). From 9 rows, the formats widened before their multiply-adds
 * take 2 vectors: 6 rows a pass, so a 9-row verify widens each weight in 2 passes instead of 3
 * (Gemma 3's body products 11 % less time on a Zen 3; 12 rows 6 %, 16 rows 2.5 %). fp32, with
 * nothing to widen, keeps 3 (2 ran 14 % slower at 9 rows), as do 7-8 rows (two passes anyway). */
static int tile_vectors(int64_t M, int fmt) {
    if (M == 1) return fmt == UAG_FMT_BLOCK_AFFINE ? 4 : 8;
    if (M >= 9 && fmt != UAG_FMT_FP32) return 2;
    return M <= 3 ? 4 : M == 4 ? 3 : M <= 6 ? 2 : 3;
}
static int max_rows(int nv) { return nv >= 8 ? 1 : nv == 4 ? 3 : nv == 3 ? 4 : 6; }


/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ w[N, K]^T in the layout above, then
 * per output n: times scale[n] (int8), plus bias[n] (bias may be NULL).
 *
 * When a tile needs several passes (more rows than fit in registers), the passes take turns
 * over chunks of KC inputs, keeping the accumulators in a small buffer between chunks: the
 * tile's weights then stream from memory once, at an even pace, overlapped with the compute,
 * instead of stalling the first pass and idling in the others (fp32 layers of Gemma 3, 8 rows:
 * ~29 ms instead of ~31). Per-output int8 tiles are not chunked: their in-register widening, not
 * memory, bounds them, and chunking measured slower. Block int8 tiles are chunked: they widen
 * each weight again in every pass, yet measured ~10 % faster than fp32 at 7-8 rows (widening a
 * chunk once into an fp32 buffer for all passes measured slower than either). Chunking changes nothing in the arithmetic: each
 * output is still one chain of FMAs over k in order. */
static void drive(const float *x, int64_t ldx, int64_t M, int64_t K, const void *w, int fmt,
                  const float *scale, int64_t N, const float *bias, float *y, int64_t ldy) {
    /* fmt (formats.h): fp32; int8 with one scale per output (applied at the end); block int8
     * (scale: [N/8][K/32][8], applied to each weight before its multiply-add); block affine
     * uint8 (scale: [N/8][K/16][2][8], likewise) */
    const int blocks = fmt == UAG_FMT_BLOCK_INT8 || fmt == UAG_FMT_BLOCK_AFFINE;
    const float *bscale = blocks ? scale : NULL;
    if (blocks) scale = NULL;
    const int64_t vectors = N / LANES;
    const int wide = M > 1 && use_avx512(); /* several rows: the AVX-512 path where there is one */
    const int nv = wide ? 2 * PAIRS : tile_vectors(M, fmt);
    const int64_t tiles = (vectors + nv - 1) / nv;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t v0 = t * nv, n0 = v0 * LANES;
        const int width = vectors - v0 < nv ? (int)(vectors - v0) : nv;
        /* rows per pass: a narrower last tile goes one vector at a time on the AVX2 kernels */
        const int most = width < nv ? max_rows(1) : wide ? MAX_MB512 : max_rows(nv);
        const float *wf = (const float *)w + n0 * K;
        const int8_t *wq = (const int8_t *)w + n0 * K;
        for (int64_t g0 = 0; g0 < M; g0 += GROUP) {
            const int64_t rows = M - g0 < GROUP ? M - g0 : GROUP;
            const int64_t passes = (rows + most - 1) / most;
            const int64_t chunk = passes > 1 && fmt != UAG_FMT_INT8 ? KC : K;
            __m256 state[GROUP * 8];
            for (int64_t i = 0; i < rows * 8; i++) state[i] = _mm256_setzero_ps();
            for (int64_t k0 = 0; k0 < K; k0 += chunk) {
                const int64_t k1 = k0 + chunk < K ? k0 + chunk : K;
                int64_t m0 = 0;
                for (int64_t p = 0; p < passes; p++) {
                    const int64_t left = rows - m0, rest = passes - p;
                    const int mb = (int)((left + rest - 1) / rest);
                    const float *xm = x + (g0 + m0) * ldx;
                    __m256 *st = state + m0 * 8;
                    /* the last tile may be narrower: then one vector at a time */
                    const int step = width == nv ? nv : 1;
                    if (wide && step == nv) {
                        const void *wt = fmt == UAG_FMT_FP32 ? (const void *)wf : (const void *)wq;
                        const float *bt =
                            fmt == UAG_FMT_BLOCK_INT8     ? bscale + v0 * (K / BLOCK_K) * LANES
                            : fmt == UAG_FMT_BLOCK_AFFINE ? bscale + v0 * (K / ABLOCK_K) * 2 * LANES
                                                          : NULL;
                        dispatch512(xm, ldx, mb, k0, k1, K, wt, bt, fmt, st);
                        m0 += mb;
                        continue;
                    }
                    for (int j = 0; j < width; j += step) {
                        if (fmt == UAG_FMT_FP32)
                            dispatch_f32(xm, ldx, mb, k0, k1, K, wf + j * LANES * K, step, st + j);
                        else if (fmt == UAG_FMT_INT8)
                            dispatch_i8(xm, ldx, mb, k0, k1, K, wq + j * LANES * K, step, st + j);
                        else if (fmt == UAG_FMT_BLOCK_INT8)
                            dispatch_b8(xm, ldx, mb, k0, k1, K, wq + j * LANES * K,
                                        bscale + (v0 + j) * (K / BLOCK_K) * LANES, step, st + j);
                        else
                            dispatch_a8(xm, ldx, mb, k0, k1, K, (const uint8_t *)wq + j * LANES * K,
                                        bscale + (v0 + j) * (K / ABLOCK_K) * 2 * LANES, step,
                                        st + j);
                    }
                    m0 += mb;
                }
            }
            for (int64_t i = 0; i < rows; i++)
                for (int j = 0; j < width; j++) {
                    __m256 s = state[i * 8 + j];
                    if (scale) s = _mm256_mul_ps(s, _mm256_loadu_ps(scale + n0 + j * LANES));
                    if (bias) s = _mm256_add_ps(s, _mm256_loadu_ps(bias + n0 + j * LANES));
                    _mm256_storeu_ps(y + (g0 + i) * ldy + n0 + j * LANES, s);
                }
        }
    }
}

/* The entry points, one per weight storage (uag.kernels.formats names each): the one driver on
 * that storage. scale: per-output scales (int8), per-block scales (block int8: K a multiple of
 * 32) or per-block (scale, base) pairs (block affine: K a multiple of 16), NULL for fp32. The
 * block forms are bitwise uag_linear_f32 on the exact weight. */
#define UAG_LINEAR(name, weight_t, format)                                                        \
    void name(const float *x, int64_t ldx, int64_t M, int64_t K, const weight_t *w,              \
              const float *scale, int64_t N, const float *bias, float *y, int64_t ldy) {         \
        drive(x, ldx, M, K, w, format, scale, N, bias, y, ldy);                                  \
    }
UAG_LINEAR(uag_linear_f32, float, UAG_FMT_FP32)
UAG_LINEAR(uag_linear_i8, int8_t, UAG_FMT_INT8)
UAG_LINEAR(uag_linear_b8, int8_t, UAG_FMT_BLOCK_INT8)
UAG_LINEAR(uag_linear_a8, uint8_t, UAG_FMT_BLOCK_AFFINE)

/* One block's exact form: writes the block's integers (q) and parameters (p) and returns 1 when
 * they reproduce every weight of x, else 0. */
typedef int (*block_form)(const float *x, void *q, float *p, const void *ctx);

/* `form` over every block of `block` weights of w[N, K] (row-major fp32, K a multiple of
 * `block`), rows in parallel: block (n, b)'s integers at q + (n * K + b * block) * qbytes, its
 * `np` parameters at p + (n * K / block + b) * np. Returns 1, or 0 when some block has no such
 * form. */
static int64_t every_block(const float *w, int64_t N, int64_t K, int64_t block, int64_t qbytes,
                           int64_t np, block_form form, const void *ctx, void *q, float *p) {
    const int64_t KB = K / block;
    int64_t bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad)
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < KB && !bad; b++)
            bad += !form(w + n * K + b * block, (char *)q + (n * K + b * block) * qbytes,
                         p + (n * KB + b) * np, ctx);
    return bad == 0;
}

typedef struct {
    const int32_t *mult;
    int64_t nm;
} multipliers;

/* Block int8: the scale is the block's largest |weight| over each of mult[0..nm) in turn, the
 * first that reproduces the block wins (an all-zero block: scale 0). */
static int int8_form(const float *x, void *qv, float *s, const void *ctx) {
    const multipliers *m = ctx;
    int8_t *qb = qv;
    float top = 0.0f;
    for (int i = 0; i < BLOCK_K; i++) top = fabsf(x[i]) > top ? fabsf(x[i]) : top;
    if (top == 0.0f) {
        *s = 0.0f;
        for (int i = 0; i < BLOCK_K; i++) qb[i] = 0;
        return 1;
    }
    for (int64_t j = 0; j < m->nm; j++) {
        const float sc = top / (float)m->mult[j];
        int ok = 1;
        for (int i = 0; i < BLOCK_K && ok; i++) {
            const float r = nearbyintf(x[i] / sc);
            ok = fabsf(r) <= 127.0f && r * sc == x[i];
            qb[i] = (int8_t)r;
        }
        if (ok) {
            *s = sc;
            return 1;
        }
    }
    return 0;
}

/* Split w[N, K] (row-major fp32, K a multiple of 32) into q[N, K] int8 and s[N, K/32] with
 * q * s equal to every weight (see uag.kernels.native.block_int8), per block of 32 as int8_form
 * finds it. Returns 1, or 0 when some block has no such form. */
int64_t uag_block_int8(const float *w, int64_t N, int64_t K, const int32_t *mult, int64_t nm,
                       int8_t *q, float *s) {
    const multipliers m = {mult, nm};
    return every_block(w, N, K, BLOCK_K, sizeof(int8_t), 1, int8_form, &m, q, s);
}

/* Greatest common divisor of two non-negative floats that are integer multiples of one step:
 * Euclid, each remainder a - floor(a / b) * b computed with one rounding (fmaf), which is exact
 * when a and b are such multiples (fmodf is exact too, but ~10x slower: 2.5 s on SmolLM2's
 * 141M weights). A pair that is not gives some value the caller's reproduction check rejects.
 * Bounded, since Euclid on integers up to 255 takes at most 12 steps. */
static float gcd_f(float a, float b) {
    for (int i = 0; i < 64 && b > 0.0f; i++) {
        float t = fmaf(-floorf(a / b), b, a);
        t = t < 0.0f ? t + b : t >= b ? t - b : t;
        a = b, b = t;
    }
    return a;
}

/* Block affine: the base is the block's smallest weight and the scale the greatest common
 * divisor of the weights' distances from it; taken when the integers are 0..255 and
 * reproduce every weight. */
static int affine_form(const float *x, void *qv, float *p, const void *ctx) {
    (void)ctx;
    uint8_t *qb = qv;
    float lo = x[0], sc = 0.0f;
    for (int i = 1; i < ABLOCK_K; i++) lo = x[i] < lo ? x[i] : lo;
    for (int i = 0; i < ABLOCK_K; i++) sc = gcd_f(x[i] - lo, sc);
    int ok = isfinite(lo) && isfinite(sc);
    for (int i = 0; i < ABLOCK_K && ok; i++) {
        const float r = sc > 0.0f ? nearbyintf((x[i] - lo) / sc) : 0.0f;
        ok = r <= 255.0f && r * sc + lo == x[i]; /* one value throughout: scale 0 */
        qb[i] = (uint8_t)r;
    }
    p[0] = sc, p[1] = lo;
    return ok;
}

/* Split w[N, K] (row-major fp32, K a multiple of 16) into q[N, K] uint8 and p[N, K/16][2] with
 * fl(fl(q * p[0]) + p[1]) equal to every weight (see uag.kernels.native.block_affine), per
 * block of 16 as affine_form finds it. Returns 1, or 0 when some block has no such form. */
int64_t uag_block_affine(const float *w, int64_t N, int64_t K, uint8_t *q, float *p) {
    return every_block(w, N, K, ABLOCK_K, sizeof(uint8_t), 2, affine_form, NULL, q, p);
}

/* Weight (r, k) of a matrix in this file's layout, in fp32 exactly as the kernels widen it:
 * fmt (formats.h): fp32, block int8 (q * s, one exact product), block affine (fl(q * s) + b). */
static inline float weight_at(int64_t fmt, const void *w, const float *params, int64_t K,
                              int64_t r, int64_t k) {
    const int64_t blk = r / LANES, lane = r % LANES, at = (blk * K + k) * LANES + lane;
    if (fmt == UAG_FMT_BLOCK_INT8)
        return (float)((const int8_t *)w)[at] *
               params[(blk * (K / BLOCK_K) + k / BLOCK_K) * LANES + lane];
    if (fmt == UAG_FMT_BLOCK_AFFINE) {
        const float *p = params + (blk * (K / ABLOCK_K) + k / ABLOCK_K) * 2 * LANES + lane;
        return (float)((const uint8_t *)w)[at] * p[0] + p[LANES];
    }
    return ((const float *)w)[at];
}

/* Rows ids[0..n) of a weight in this file's layout as fp32 out[n, K], each times scale:
 * bitwise what uag.kernels.native.NativeLinear.rows computes in torch (one exact product q * s for
 * block int8, fl(q * s) + b for block affine, then the one multiply by scale), for an embedding
 * lookup or the screened head's candidate rows. fmt (formats.h): fp32, block int8 or block
 * affine. Why in C: the same in torch is six ops, ~0.17 ms a forward, each cold after the
 * layers stream their weights. */
void uag_gather_rows(int64_t fmt, const void *w, const float *params, int64_t K,
                     const int64_t *ids, int64_t n, float scale, float *out) {
    for (int64_t i = 0; i < n; i++) {
        float *y = out + i * K;
        for (int64_t k = 0; k < K; k++) y[k] = weight_at(fmt, w, params, K, ids[i], k) * scale;
    }
}

/* The screened head's exact step (uag/kernels/screened.py): for each candidate i, row rows[i] of x and
 * vocabulary id cols[i] (sorted by row, then id), its fp32 logit as the full product computes
 * it: one chain of fused multiply-adds over k in order from 0, on the weight exactly as the
 * kernels see it (weight_at), then + bias[id]; so bitwise the value drive() gives that
 * (row, id) in any call. Written to logits[row * ldl + id];
 * ids[m] = row m's candidate with the largest logit, the lowest id on a tie (argmax's choice).
 * Returns 0, or -1 when some row has no candidate (the screen guarantees one).
 * Why in C: in torch it was a gather, an interleave, a product and four ops for the argmax,
 * ~0.5 ms a forward, each op cold after the head's product streamed 185 MB. */
int64_t uag_exact_candidates(int64_t fmt, const void *w, const float *params, int64_t K,
                             const float *x, int64_t ldx, int64_t M, const float *bias,
                             const int64_t *rows, const int64_t *cols, int64_t count,
                             float *logits, int64_t ldl, int64_t *ids) {
#pragma omp parallel for schedule(static) if (count > 64)
    for (int64_t i = 0; i < count; i++) {
        const int64_t r = cols[i];
        const float *xm = x + rows[i] * ldx;
        float acc = 0.0f;
        for (int64_t k = 0; k < K; k++) acc = fmaf(xm[k], weight_at(fmt, w, params, K, r, k), acc);
        logits[rows[i] * ldl + r] = bias ? acc + bias[r] : acc;
    }
    for (int64_t m = 0; m < M; m++) ids[m] = -1;
    for (int64_t i = 0; i < count; i++) {
        const int64_t m = rows[i], r = cols[i];
        if (ids[m] < 0 || logits[m * ldl + r] > logits[m * ldl + ids[m]]) ids[m] = r;
    }
    for (int64_t m = 0; m < M; m++)
        if (ids[m] < 0) return -1;
    return 0;
}
