/* Skinny matrix products for decoding on AVX2 CPUs: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 *
 * Why: a decode or verify step multiplies 1-16 activation rows by every weight matrix once, so
 * its cost is reading the weights. This kernel streams each weight once per call, whatever M,
 * strictly sequentially (the weight is stored interleaved, see below), with the activation rows
 * in L1. Measured on 2 Zen 3 cores: Gemma 3's 262,144 x 640 head in ~28-38 ms for one row
 * (19-24 GB/s, the machine's read bandwidth), where oneDNN's packed GEMM takes ~57 ms.
 *
 * Row-count invariance by construction (what lossless verification needs): output (m, n) is
 * always accumulated the same way -- eight float lanes, fused multiply-adds over k in order, one
 * fixed horizontal sum -- no matter how many rows share the call, which rows they are grouped
 * with, or how outputs are split across threads. Built without -ffast-math and with
 * -ffp-contract=off so the compiler cannot reassociate or fuse differently in different places.
 *
 * Weight layout ("interleaved"): blocks of NB = 4 output rows, each block stored as
 * [K / 8][4][8] floats (or int8), so K % 8 == 0 and N % 4 == 0 (the caller pads). Weights are
 * fp32, or int8 with one float scale per output row (weight-only quantisation:
 * y[m, n] = scale[n] * sum_k x[m, k] * q[n, k]).
 */
#include <immintrin.h>
#include <stdint.h>

#define NB 4 /* output rows per block: one sequential stream of 4 x 8 values per k step */
#define MB 2 /* activation rows per pass over a block: 8 accumulators + 4 weights + 1 x */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
    return _mm_cvtss_f32(s);
}

static inline __m256 load_f32(const float *w) { return _mm256_loadu_ps(w); }

static inline __m256 load_i8(const int8_t *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}

/* Rows [m0, m0 + mb) against the block of outputs [n0, n0 + NB); mb <= MB. Inlined with a
 * constant mb so the accumulators live in registers; the operations for a given (m, n) are the
 * same whatever mb is. */
#define BLOCK(NAME, WTYPE, LOADW, FINISH)                                                     \
    static inline __attribute__((always_inline)) void NAME(                                   \
        const float *x, int64_t ldx, int64_t m0, const int mb, int64_t K, const WTYPE *wb,    \
        const float *scale, int64_t n0, const float *bias, float *y, int64_t ldy,             \
        const int prefetch) {                                                                 \
        __m256 acc[MB][NB];                                                                   \
        for (int i = 0; i < MB; i++)                                                          \
            for (int j = 0; j < NB; j++) acc[i][j] = _mm256_setzero_ps();                     \
        for (int64_t k = 0; k < K; k += 8) {                                                  \
            if (prefetch) { /* a block ahead, while this one is computed from L1 */           \
                const char *next = (const char *)(wb + prefetch * NB * K + k * NB);           \
                _mm_prefetch(next, _MM_HINT_T0);                                              \
                _mm_prefetch(next + 64, _MM_HINT_T0);                                         \
            }                                                                                 \
            __m256 wv[NB];                                                                    \
            for (int j = 0; j < NB; j++) wv[j] = LOADW(wb + k * NB + j * 8);                  \
            for (int i = 0; i < mb; i++) {                                                    \
                const __m256 xv = _mm256_loadu_ps(x + (m0 + i) * ldx + k);                    \
                for (int j = 0; j < NB; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]); \
            }                                                                                 \
        }                                                                                     \
        for (int i = 0; i < mb; i++) {                                                        \
            for (int j = 0; j < NB; j++) {                                                    \
                const int64_t n = n0 + j;                                                     \
                float s = hsum(acc[i][j]);                                                    \
                FINISH;                                                                       \
                y[(m0 + i) * ldy + n] = s;                                                    \
            }                                                                                 \
        }                                                                                     \
    }

BLOCK(block_f32, float, load_f32, (void)scale; if (bias) s += bias[n])
BLOCK(block_i8, int8_t, load_i8, s *= scale[n]; if (bias) s += bias[n])


/* Every row pass over block b. AHEAD: how many blocks ahead the first pass prefetches (0:
 * none). Measured on 2 Zen 3 cores: fp32 with 1-2 rows streams at the full read bandwidth on
 * the hardware prefetcher alone, and with more rows gains from fetching the next block; int8
 * (SmolLM2-shaped, 1 row) gains ~12 % from fetching two blocks ahead. */
#define PASSES(BLOCKFN, WB, AHEAD)                                                            \
    do {                                                                                      \
        const int pf = b + (AHEAD) < blocks ? (AHEAD) : 0;                                    \
        int64_t m0 = 0;                                                                       \
        for (; m0 + 2 <= M; m0 += 2)                                                          \
            BLOCKFN(x, ldx, m0, 2, K, WB, scale, b * NB, bias, y, ldy, m0 == 0 ? pf : 0);     \
        if (m0 < M) BLOCKFN(x, ldx, m0, 1, K, WB, scale, b * NB, bias, y, ldy, m0 == 0 ? pf : 0); \
    } while (0)

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ w[N, K]^T in the interleaved layout,
 * then per output n: times scale[n] (int8 only), plus bias[n] (bias may be NULL). */
void uag_linear_f32(const float *x, int64_t ldx, int64_t M, int64_t K, const float *w,
                    const float *scale, int64_t N, const float *bias, float *y, int64_t ldy) {
    const int64_t blocks = N / NB;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) PASSES(block_f32, w + b * NB * K, M > 2 ? 1 : 0);
}

void uag_linear_i8(const float *x, int64_t ldx, int64_t M, int64_t K, const int8_t *w,
                   const float *scale, int64_t N, const float *bias, float *y, int64_t ldy) {
    const int64_t blocks = N / NB;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) PASSES(block_i8, w + b * NB * K, 2);
}
