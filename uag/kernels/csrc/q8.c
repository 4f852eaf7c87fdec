/* Dynamic int8 products on AVX2: int8 weights times int8 activations, exact int32 sums.
 *
 * Why: skinny.c's weight-only int8 widens every weight to fp32 before its multiply-add (three
 * instructions per 8 products), so an int8 layer is bound by that widening, not by memory:
 * SmolLM2-135M's int8 body drafts one row at ~11 GB/s and 8 rows at ~60 GFLOP/s. Quantising the
 * activation row too (7 bits, per row, at call time) lets vpmaddubsw + vpmaddwd do 32 products
 * in two instructions, so the same weights cost ~a third of the instructions and more rows ride
 * almost free on one read of the weights.
 *
 * Used where approximation is allowed and bounded: the assistant's layers (only the target
 * decides the output), and uag/screened.py's screening head, which runs two levels (the row,
 * then what its 7 bits missed) and reports a per-row bound on what both missed, so screening
 * stays exact.
 *
 * Activations: row m becomes u[k] in 0..127 with x[k] ~ scale * (u[k] - zp), asymmetric over
 * [min(x, 0), max(x, 0)] in 126 steps (so rounding never needs the clamp). 7 bits, not 8:
 * vpmaddubsw adds two u8 x s8 products into an int16, which 127 * 127 * 2 cannot overflow.
 * Weights: symmetric int8 (-127..127) with one float scale per output, in the layout
 * [N/8][K/4][8][4] (eight outputs' four consecutive weights side by side: one 32-byte load per
 * vector), with wsum[n] = sum_k q[n, k] for the zero-point correction:
 *   y[m, n] = scale_x[m] * scale_w[n] * (sum_k q[n, k] u[m, k] - zp[m] * wsum[n]) + bias[n].
 * Integer sums are exact, so a row's result never depends on the other rows in the call.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#if HAVE_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define LANES 8 /* outputs per vector */
#define QK 4    /* consecutive inputs per output in one 32-bit lane */

/* Row x[0..K) → u[0..Kp) (Kp a multiple of QK, padding at the zero point), its scale and zero
 * point; and when residual != NULL, residual[k] = x[k] - scale * (u[k] - zp). Returns max|x|. */
static float quantize_row(const float *x, int64_t K, int64_t Kp, uint8_t *u, float *scale,
                          int32_t *zp, float *residual) {
    __m256 lo8 = _mm256_setzero_ps(), hi8 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 v = _mm256_loadu_ps(x + k);
        lo8 = _mm256_min_ps(lo8, v);
        hi8 = _mm256_max_ps(hi8, v);
    }
    float lo = 0.0f, hi = 0.0f;
    for (int i = 0; i < 8; i++) {
        lo = lo8[i] < lo ? lo8[i] : lo;
        hi = hi8[i] > hi ? hi8[i] : hi;
    }
    for (; k < K; k++) {
        lo = x[k] < lo ? x[k] : lo;
        hi = x[k] > hi ? x[k] : hi;
    }
    float s = (hi - lo) / 126.0f;
    if (!(s > 0.0f)) s = 1.0f; /* an all-zero row */
    const float inv = 1.0f / s;
    int32_t z = (int32_t)nearbyintf(-lo * inv);
    z = z < 0 ? 0 : z > 127 ? 127 : z;
    const __m256 vinv = _mm256_set1_ps(inv), vs = _mm256_set1_ps(s);
    const __m256 vz = _mm256_set1_ps((float)z), top = _mm256_set1_ps(127.0f);
    for (k = 0; k + 8 <= K; k += 8) {
        const __m256 v = _mm256_loadu_ps(x + k);
        __m256 q = _mm256_round_ps(_mm256_mul_ps(v, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(q, vz), _mm256_setzero_ps()), top);
        const __m256i i32 = _mm256_cvtps_epi32(q);
        const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
        _mm_storel_epi64((__m128i *)(u + k), _mm_packus_epi16(i16, i16));
        if (residual)
            _mm256_storeu_ps(residual + k, _mm256_sub_ps(v, _mm256_mul_ps(vs, _mm256_sub_ps(q, vz))));
    }
    for (; k < K; k++) {
        float q = nearbyintf(x[k] * inv) + (float)z;
        q = q < 0.0f ? 0.0f : q > 127.0f ? 127.0f : q;
        u[k] = (uint8_t)q;
        if (residual) residual[k] = x[k] - s * (q - (float)z);
    }
    for (; k < Kp; k++) u[k] = (uint8_t)z;
    *scale = s;
    *zp = z;
    return hi > -lo ? hi : -lo;
}

/* Rows [0, mb) of u against nv vectors of outputs over all K/4 quads: int32 sums into state
 * (row i, vector j at state[i * 8 + j]). mb and nv are constants after inlining. DOT(acc, x, w)
 * adds the four u8 x s8 products of each 32-bit lane into acc, exactly. */
#define TILE(NAME, ATTR, DOT)                                                                      \
    static inline ATTR void NAME(const uint8_t *u, int64_t ldu, const int mb, int64_t Kq,          \
                                 const int8_t *w, const int nv, __m256i *state) {                  \
        __m256i acc[8][8];                                                                         \
        _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++)                                       \
            _Pragma("GCC unroll 8") for (int j = 0; j < nv; j++) acc[i][j] = _mm256_setzero_si256(); \
        for (int64_t kq = 0; kq < Kq; kq++) {                                                      \
            __m256i wv[8];                                                                         \
            if ((kq & 1) == 0) /* a tile's streams, 1 KB ahead: ~15 % at 8 rows (2 Zen 3 cores) */ \
                _Pragma("GCC unroll 8") for (int j = 0; j < nv; j++) _mm_prefetch(                  \
                    (const char *)(w + ((int64_t)j * Kq + kq) * LANES * QK) + 1024, _MM_HINT_T0);   \
            _Pragma("GCC unroll 8") for (int j = 0; j < nv; j++) wv[j] =                            \
                _mm256_loadu_si256((const __m256i *)(w + ((int64_t)j * Kq + kq) * LANES * QK));    \
            _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++) {                                 \
                int32_t four;                                                                      \
                memcpy(&four, u + i * ldu + kq * QK, sizeof four);                                 \
                const __m256i xb = _mm256_set1_epi32(four);                                        \
                _Pragma("GCC unroll 8") for (int j = 0; j < nv; j++) acc[i][j] =                    \
                    DOT(acc[i][j], xb, wv[j]);                                                     \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 8") for (int i = 0; i < mb; i++)                                       \
            _Pragma("GCC unroll 8") for (int j = 0; j < nv; j++) state[i * 8 + j] = acc[i][j];     \
    }

/* AVX2: vpmaddubsw (two products into an int16, which 2 * 127 * 127 cannot overflow), then
 * vpmaddwd to int32. */
static inline __attribute__((always_inline)) __m256i dot_avx2(__m256i acc, __m256i x, __m256i w) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(x, w), _mm256_set1_epi16(1)));
}
TILE(tile_avx2, __attribute__((always_inline)), dot_avx2)

#if HAVE_AVXVNNI
/* AVX-VNNI where the CPU has it (checked at run time): vpdpbusd, the same exact sums in one
 * instruction instead of three, so the same bits. */
#define VNNI __attribute__((target("avx2,fma,avxvnni")))
static inline __attribute__((always_inline)) VNNI __m256i dot_vnni(__m256i acc, __m256i x, __m256i w) {
    return _mm256_dpbusd_avx_epi32(acc, x, w);
}
TILE(tile_vnni, VNNI __attribute__((always_inline)), dot_vnni)
#endif

#define CASES(FN)                                                                                  \
    CASE(FN, 1, 1) CASE(FN, 2, 1) CASE(FN, 3, 1) CASE(FN, 4, 1) CASE(FN, 5, 1) CASE(FN, 6, 1)      \
    CASE(FN, 7, 1) CASE(FN, 8, 1) CASE(FN, 1, 2) CASE(FN, 2, 2) CASE(FN, 3, 2) CASE(FN, 4, 2)      \
    CASE(FN, 5, 2) CASE(FN, 6, 2) CASE(FN, 1, 3) CASE(FN, 2, 3) CASE(FN, 3, 3) CASE(FN, 1, 4)      \
    CASE(FN, 2, 4) CASE(FN, 1, 8)
#define CASE(FN, MB, NV) case (MB) * 16 + (NV): FN(u, ldu, MB, Kq, w, NV, state); break;
static void dispatch_avx2(const uint8_t *u, int64_t ldu, int mb, int64_t Kq, const int8_t *w,
                          int nv, __m256i *state) {
    switch (mb * 16 + nv) {
        CASES(tile_avx2)
        default: abort(); /* tile_vectors / max_rows never ask for another shape */
    }
}
#if HAVE_AVXVNNI
static VNNI void dispatch_vnni(const uint8_t *u, int64_t ldu, int mb, int64_t Kq, const int8_t *w,
                               int nv, __m256i *state) {
    switch (mb * 16 + nv) {
        CASES(tile_vnni)
        default: abort();
    }
}
#endif

/* AVX-VNNI: q8.c and q4.c. */
static int detect_vnni(void) {
#if HAVE_AVXVNNI
    __builtin_cpu_init();
    return __builtin_cpu_supports("avxvnni");
#else
    return 0;
#endif
}
UAG_CPU_PATH(, uag_use_vnni, uag_set_vnni, detect_vnni())

/* AVX-512 VNNI where the CPU has it: two vectors of 8 outputs side by side in one register
 * (lanes 0-7: one vector's quad kq, lanes 8-15: the next vector's, from their own streams in
 * the [N/8][K/4][8][4] layout), times each row's quad kq broadcast to all 16 lanes straight from
 * the quantised row. Each lane's int32 sum is exact, so the integers, and the floats, are the
 * 256-bit paths'. Per 64 weight bytes a row costs one 4-byte broadcast and one vpdpbusd: the
 * activations stay in L1 whatever the row count (an earlier layout expanded them 8-fold, and
 * re-reading those from L2 cost ~2 ms of the head at 8 rows). A last odd vector, and every
 * vector of a product of up to ONE_ROWS rows, runs alone (one512 below). */
#define AVX512VNNI __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")))
#define MAX_MB512 16
#define ONE_ROWS 9 /* product rows (rows x levels) up to which one512 takes each vector alone */

static inline AVX512VNNI __attribute__((always_inline)) void tile512(
    const uint8_t *u, int64_t ldu, const int mb, int64_t Kq, const int8_t *w0, const int8_t *w1,
    __m256i *state) {
    __m512i acc[MAX_MB512];
    _Pragma("GCC unroll 16") for (int i = 0; i < mb; i++) acc[i] = _mm512_setzero_si512();
    for (int64_t kq = 0; kq < Kq; kq++) {
        if ((kq & 1) == 0) { /* each stream one line (two quads) ahead of 1 KB */
            _mm_prefetch((const char *)(w0 + kq * LANES * QK) + 1024, _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + kq * LANES * QK) + 1024, _MM_HINT_T0);
        }
        const __m512i wv = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w0 + kq * LANES * QK))),
            _mm256_loadu_si256((const __m256i *)(w1 + kq * LANES * QK)), 1);
        _Pragma("GCC unroll 16") for (int i = 0; i < mb; i++) {
            int32_t four;
            memcpy(&four, u + i * ldu + kq * QK, sizeof four);
            acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_set1_epi32(four), wv);
        }
    }
    _Pragma("GCC unroll 16") for (int i = 0; i < mb; i++) {
        state[i * 8] = _mm512_castsi512_si256(acc[i]);
        state[i * 8 + 1] = _mm512_extracti64x4_epi64(acc[i], 1);
    }
}

/* One vector alone (a product of up to ONE_ROWS rows, or a tile's odd last vector): a 64-byte
 * load holds its quads kq (lanes 0-7) and kq + 1 (lanes 8-15), each row's two quads broadcast
 * into the matching halves, the halves' int32 sums added at the end. Integer sums do not depend
 * on their order: tile512's integers, so the same bits. Why: a tile's two vectors are two weight
 * streams 8 Kp bytes apart, which a 2-core Zen 4 streamed at ~17 GB/s; one stream reads ~25
 * (SmolLM2's head at one row 1.67 -> 1.30 ms; Gemma's screening head at 1 / 4 / 6 / 9 rows
 * 9.9 -> 7.9 / 12.6 -> 9.4 / 12.1 -> 10.3 / 11.5 -> 10.3 ms, builds alternating; at 10-12 rows a
 * tie, and at 16 the pairs' fewer instructions per row win: 14.3 against 15.4 ms). */
static inline AVX512VNNI __attribute__((always_inline)) void one512(
    const uint8_t *u, int64_t ldu, const int mb, int64_t Kq, const int8_t *w0, __m256i *state) {
    __m512i acc[MAX_MB512];
    _Pragma("GCC unroll 16") for (int i = 0; i < mb; i++) acc[i] = _mm512_setzero_si512();
    int64_t kq = 0;
    for (; kq + 1 < Kq; kq += 2) {
        _mm_prefetch((const char *)(w0 + kq * LANES * QK) + 1024, _MM_HINT_T0);
        const __m512i wv = _mm512_loadu_si512((const void *)(w0 + kq * LANES * QK));
        _Pragma("GCC unroll 16") for (int i = 0; i < mb; i++) {
            int32_t a, b;
            memcpy(&a, u + i * ldu + kq * QK, sizeof a);
            memcpy(&b, u + i * ldu + (kq + 1) * QK, sizeof b);
            const __m512i xv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(a)),
                                                  _mm256_set1_epi32(b), 1);
            acc[i] = _mm512_dpbusd_epi32(acc[i], xv, wv);
        }
    }
    if (kq < Kq) { /* an odd last quad: the upper lanes' weights are zero */
        const __m512i wv = _mm512_zextsi256_si512(
            _mm256_loadu_si256((const __m256i *)(w0 + kq * LANES * QK)));
        _Pragma("GCC unroll 16") for (int i = 0; i < mb; i++) {
            int32_t a;
            memcpy(&a, u + i * ldu + kq * QK, sizeof a);
            acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_set1_epi32(a), wv);
        }
    }
    _Pragma("GCC unroll 16") for (int i = 0; i < mb; i++) state[i * 8] = _mm256_add_epi32(
        _mm512_castsi512_si256(acc[i]), _mm512_extracti64x4_epi64(acc[i], 1));
}

#define CASE512(MB)                                                                                \
    case MB:                                                                                       \
        if (w1) tile512(u, ldu, MB, Kq, w0, w1, state);                                            \
        else one512(u, ldu, MB, Kq, w0, state);                                                    \
        break;
static AVX512VNNI void dispatch512(const uint8_t *u, int64_t ldu, int mb, int64_t Kq,
                                   const int8_t *w0, const int8_t *w1, __m256i *state) {
    switch (mb) {
        CASE512(1) CASE512(2) CASE512(3) CASE512(4) CASE512(5) CASE512(6) CASE512(7) CASE512(8)
        CASE512(9) CASE512(10) CASE512(11) CASE512(12) CASE512(13) CASE512(14) CASE512(15)
        CASE512(16)
        default: abort();
    }
}

/* AVX-512 VNNI with F, BW, VL: q8.c and q4.c. */
static int detect_avx512vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512f");
}
UAG_CPU_PATH(, uag_use_avx512vnni, uag_set_avx512vnni, detect_avx512vnni())

#define AMX_VECTORS 4 /* vectors of 8 outputs per tile of work: C tiles 0-3 */
#define AMX_ROWS 16   /* rows of an A or C tile */
/* Rows from which AMX pays. Gemma's screening head's int8 product, median ms, AVX-512 VNNI vs
 * AMX with the prefetch below, one process alternating: 1 row 5.06 vs 5.71, 4: 5.78 vs 5.90,
 * 6: 6.29 vs 6.13, 8: 6.85 vs 6.30. Without the prefetch AMX paid only from 10 rows (8: 9.1 vs
 * 9.1 in the whole head): a tile load waits for its bytes, and nothing ran ahead of it. */
#define AMX_MIN_ROWS 6
/* How far ahead of its tile loads each weight stream is prefetched (best of 512-4096, T0/T1) */
#define AMX_PREFETCH 1024

#if HAVE_AMX
/* AMX where the CPU and the kernel allow it (checked at run time): one tile multiply adds mb
 * rows x 64 activation bytes times 16 quads of 8 outputs' weights into mb x 8 int32 sums, the
 * same u8 x s8 products as vpdpbusd, summed exactly, so the same integers and floats as every
 * other path. Why: AVX-512 VNNI spends one instruction per row per 64 weight bytes, so many rows
 * (a long verify, a second level) are bound by those instructions; a tile multiply takes up to
 * 16 rows at once. The weights need no new layout: one vector's 16 consecutive quads
 * ([N/8][K/4][8][4]) are 512 contiguous bytes, exactly a 16 x 32-byte B tile. Tiles: 0-3
 * accumulate four vectors, 4 holds the activations (a chunk of 16 quads), 5-7 take turns with
 * the weights. K must be a multiple of 64 (other shapes take the other paths). */
#define AMX_ATTR __attribute__((target("amx-tile,amx-int8")))


/* Configure this thread's tiles for mb rows. */
static AMX_ATTR void amx_configure(int mb) {
    uag_amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < AMX_VECTORS; t++) c.rows[t] = (uint8_t)mb, c.colsb[t] = LANES * 4;
    c.rows[4] = (uint8_t)mb, c.colsb[4] = 16 * QK; /* A: mb rows x 16 quads */
    for (int t = 5; t < 8; t++) c.rows[t] = 16, c.colsb[t] = LANES * QK; /* B: 16 quads x 8 */
    /* GCC 12 drops the stores above as dead (it does not see ldtilecfg read them): keep them */
    __asm__ __volatile__("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

/* Rows [0, mb) of u (configured) against nv <= 4 vectors w + j * Kq * 32, Kq a multiple of 16:
 * int32 sums into state (row i, vector j at state[i * 8 + j]). Three B tiles take turns, so a
 * vector's weights load while the previous vector's multiply still reads its tile. */
static AMX_ATTR void amx_tile(const uint8_t *u, int64_t ldu, int64_t Kq, const int8_t *w,
                              int nv, __m256i *state) {
    const int64_t vstride = Kq * LANES * QK;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < Kq / 16; c++) {
        const int8_t *wc = w + c * 16 * LANES * QK;
        for (int j = 0; j < nv; j++) /* each stream's next 512 bytes, AMX_PREFETCH ahead */
            for (int l = 0; l < 8; l++)
                _mm_prefetch((const char *)(wc + j * vstride) + AMX_PREFETCH + l * 64, _MM_HINT_T0);
        _tile_loadd(4, u + c * 16 * QK, ldu);
        _tile_loadd(5, wc, LANES * QK);
        _tile_dpbusd(0, 4, 5);
        if (nv > 1) {
            _tile_loadd(6, wc + vstride, LANES * QK);
            _tile_dpbusd(1, 4, 6);
        }
        if (nv > 2) {
            _tile_loadd(7, wc + 2 * vstride, LANES * QK);
            _tile_dpbusd(2, 4, 7);
        }
        if (nv > 3) {
            _tile_loadd(5, wc + 3 * vstride, LANES * QK);
            _tile_dpbusd(3, 4, 5);
        }
    }
    const int64_t ld = 8 * (int64_t)sizeof(__m256i); /* state's row stride in bytes */
    _tile_stored(0, state, ld);
    if (nv > 1) _tile_stored(1, state + 1, ld);
    if (nv > 2) _tile_stored(2, state + 2, ld);
    if (nv > 3) _tile_stored(3, state + 3, ld);
}

static AMX_ATTR void amx_release(void) { _tile_release(); }
#endif

/* AMX-INT8, where the kernel also grants this process the tile state. */
static int detect_amx(void) {
#if HAVE_AMX
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1) &&
           syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                   18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}
UAG_CPU_PATH(, uag_use_amx, uag_set_amx, detect_amx())

static void dispatch(const uint8_t *u, int64_t ldu, int mb, int64_t Kq, const int8_t *w, int nv,
                     __m256i *state) {
#if HAVE_AVXVNNI
    if (uag_use_vnni()) {
        dispatch_vnni(u, ldu, mb, Kq, w, nv, state);
        return;
    }
#endif
    dispatch_avx2(u, ldu, mb, Kq, w, nv, state);
}

/* Vectors per tile and rows per pass by row count (mb * nv accumulators + nv weights + 2 fit in
 * 16 registers; more rows take several passes over a tile whose weights are then in cache). */
static int tile_vectors(int64_t M) { (void)M; return 1; }
static int max_rows(int nv) { return nv == 8 ? 1 : nv == 4 ? 2 : nv == 3 ? 3 : nv == 2 ? 6 : 8; }

#define GROUP 32 /* rows whose sums stay in one state buffer (32 x 8 vectors, 8 KB) */

/* One vector of 8 outputs (weights w, [K/4][8][4]) times row u over the quads q0..q0+nq-1:
 * exact int32 sums (AVX2, inlined into the epilogue: nq is a handful). The AVX-512 VNNI tile
 * gives the same integers where there is one. */
static inline __attribute__((always_inline)) __m256i outlier_sums(const uint8_t *u, const int8_t *w,
                                                                  int64_t q0, int64_t nq) {
    __m256i acc = _mm256_setzero_si256();
    for (int64_t q = q0; q < q0 + nq; q++) {
        int32_t four;
        memcpy(&four, u + q * QK, sizeof four);
        acc = dot_avx2(acc, _mm256_set1_epi32(four),
                       _mm256_loadu_si256((const __m256i *)(w + q * LANES * QK)));
    }
    return acc;
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) through the dynamic int8 product.
 *
 * levels 1: each row quantised once. levels 2: each row and then its residual (what the first
 * 7 bits missed) go through the product as two rows, and y is their sum: the error left is what
 * the residual's 7 bits miss, ~1/126 of one level's. When bound != NULL, bound[m] receives a
 * per-row r such that |y[m, n] - sum_k w^[n, k] x[m, k]| <= r * sum_k |w^[n, k]| (w^ = the
 * dequantised weight), float rounding included; ScreenedHead adds the weight's own rounding.
 *
 * Outlier channels (ScreenedHead's: a few channels ~10-20x the others, whose range would
 * coarsen every other channel's 7 bits): x must hold zeros there, and xo[M, K] (row stride
 * ldxo; NULL for none) holds the values there and zeros elsewhere; those channels lie in the
 * nq quads from q0 (ScreenedHead stores them last). Each xo row is quantised on its own scale;
 * its product runs over only those quads (every other quad's (u - zp) is 0: the same integers as
 * the whole row, with wsum_o[n] the weights' sum over those quads for the zero point), and is
 * added to its row's output after the levels. bound_o[m] receives its r (as bound's, times those
 * channels' sum |w^|). Those quads' weights are in L1 from the tile's pass; they take the
 * AVX-512 VNNI tile where there is one, else an AVX2 loop. Gemma's head: +0.34 / 0.25 / 0.24 /
 * 0.24 ms at 1 / 2 / 4 / 8 rows, where a fused fp32 epilogue over exact outlier weights cost
 * ~0.7 / - / - / 1.3 ms and the whole row as one more product row doubled a 2-4 row verify's
 * integer work. */
void uag_linear_q8(const float *x, int64_t ldx, int64_t M, int64_t K, const int8_t *w,
                   const float *wscale, const int32_t *wsum, int64_t N, const float *bias,
                   float *y, int64_t ldy, int64_t levels, float *bound, const float *xo,
                   int64_t ldxo, float *bound_o, int64_t q0, int64_t nq, const int32_t *wsum_o) {
    const int64_t Kp = (K + QK - 1) / QK * QK, Kq = Kp / QK, R = M * levels;
    /* AMX passes all have one height, so the last may read up to 15 rows past R (their sums
     * are never used) */
    uint8_t *u = (uint8_t *)malloc((size_t)((R + AMX_ROWS) * Kp));
    float *xs = (float *)malloc(sizeof(float) * (size_t)R);
    int32_t *zp = (int32_t *)malloc(sizeof(int32_t) * (size_t)R);
    float *res = levels > 1 ? (float *)malloc(sizeof(float) * (size_t)K) : NULL;
    uint8_t *uo = xo ? (uint8_t *)malloc((size_t)(M * Kp)) : NULL; /* the outlier rows */
    float *xso = xo ? (float *)malloc(sizeof(float) * (size_t)M) : NULL;
    int32_t *zpo = xo ? (int32_t *)malloc(sizeof(int32_t) * (size_t)M) : NULL;
    for (int64_t m = 0; m < M; m++) {
        const int64_t r0 = m * levels;
        const float top = quantize_row(x + m * ldx, K, Kp, u + r0 * Kp, xs + r0, zp + r0,
                                       levels > 1 ? res : NULL);
        for (int64_t l = 1; l < levels; l++) {
            const int64_t r = r0 + l;
            quantize_row(res, K, Kp, u + r * Kp, xs + r, zp + r, l + 1 < levels ? res : NULL);
        }
        /* What the last level misses: half a step (rounding to nearest; 1 % for the products'
         * own rounding of x / scale), plus float rounding of the residual and of the output
         * (a few ulps of max|x| per unit of |w^|). */
        if (bound) bound[m] = 0.505f * xs[r0 + levels - 1] + 4e-6f * top;
        if (xo) {
            const float top_o = quantize_row(xo + m * ldxo, K, Kp, uo + m * Kp, xso + m, zpo + m, NULL);
            if (bound_o) bound_o[m] = 0.505f * xso[m] + 4e-6f * top_o;
        }
    }
    const int64_t vectors = N / LANES;
    /* AVX-512 VNNI where there is one, for one row too (Gemma's head 7.5 → 6.8 ms, SmolLM2's
     * 1.3 → 1.1 ms: the same bits); AMX from AMX_MIN_ROWS rows */
    const int amx = HAVE_AMX && R >= AMX_MIN_ROWS && Kq % 16 == 0 && uag_use_amx();
    const int wide = !amx && uag_use_avx512vnni();
    const int nv = amx ? AMX_VECTORS : wide ? (R <= ONE_ROWS ? 1 : 2) : tile_vectors(R < GROUP ? R : GROUP);
    const int most = amx ? AMX_ROWS : wide ? MAX_MB512 : max_rows(nv);
    const int64_t tiles = (vectors + nv - 1) / nv;
#pragma omp parallel
    {
    int configured = -1; /* AMX: the row count this thread's tiles hold */
    /* this thread's outlier sums for a tile: row m, vector j at ostate[m * 8 + j] */
    __m256i *ostate = xo ? (__m256i *)aligned_alloc(32, sizeof(__m256i) * 8 * (size_t)M) : NULL;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t v0 = t * nv, n0 = v0 * LANES;
        const int width = vectors - v0 < nv ? (int)(vectors - v0) : nv;
        const int step = wide ? nv : width == nv ? nv : 1;
        const int8_t *wt = w + n0 * Kp;
        for (int64_t g0 = 0; g0 < R; g0 += GROUP) {
            const int64_t rows = R - g0 < GROUP ? R - g0 : GROUP;
            const int64_t passes = (rows + most - 1) / most;
            __m256i state[GROUP * 8];
            int64_t m0 = 0;
            for (int64_t p = 0; p < passes; p++) {
                const int64_t left = rows - m0, rest = passes - p;
                /* AMX: every pass the same height, so a thread's tiles are configured once */
                const int mb = (int)(amx ? (rows + passes - 1) / passes : (left + rest - 1) / rest);
#if HAVE_AMX
                if (amx) {
                    if (configured != mb) amx_configure(mb), configured = mb;
                    amx_tile(u + (g0 + m0) * Kp, Kp, Kq, wt, width, state + m0 * 8);
                    m0 += mb;
                    continue;
                }
#endif
                for (int j = 0; j < width; j += step)
                    if (wide) /* both vectors of the tile in one pass, or the last one alone */
                        dispatch512(u + (g0 + m0) * Kp, Kp, mb, Kq, wt + j * LANES * Kp,
                                    width > 1 ? wt + (j + 1) * LANES * Kp : NULL,
                                    state + m0 * 8 + j);
                    else
                        dispatch(u + (g0 + m0) * Kp, Kp, mb, Kq, wt + j * LANES * Kp, step,
                                 state + m0 * 8 + j);
                m0 += mb;
            }
            /* after the first group's passes, so those quads' weights are in cache */
            if (g0 == 0) {
                if (xo && nq > 0 && uag_use_avx512vnni()) /* the outlier rows, their quads */
                    for (int j = 0; j < width; j += 2)
                        for (int64_t m0 = 0; m0 < M; m0 += MAX_MB512) {
                            const int mb = (int)(M - m0 < MAX_MB512 ? M - m0 : MAX_MB512);
                            const int8_t *w0 = wt + j * LANES * Kp + q0 * LANES * QK;
                            dispatch512(uo + m0 * Kp + q0 * QK, Kp, mb, nq, w0,
                                        j + 1 < width ? w0 + LANES * Kp : NULL, ostate + m0 * 8 + j);
                        }
                else if (xo)
                    for (int64_t m = 0; m < M; m++)
                        for (int j = 0; j < width; j++)
                            ostate[m * 8 + j] = outlier_sums(uo + m * Kp, wt + j * LANES * Kp, q0, nq);
            }
            for (int64_t i = 0; i < rows; i++) {
                const int64_t r = g0 + i, m = r / levels;
                for (int j = 0; j < width; j++) {
                    const int64_t n = n0 + j * LANES;
                    const __m256i corr = _mm256_mullo_epi32(
                        _mm256_set1_epi32(zp[r]), _mm256_loadu_si256((const __m256i *)(wsum + n)));
                    const __m256 s = _mm256_mul_ps(_mm256_set1_ps(xs[r]), _mm256_loadu_ps(wscale + n));
                    __m256 v = _mm256_mul_ps(
                        _mm256_cvtepi32_ps(_mm256_sub_epi32(state[i * 8 + j], corr)), s);
                    float *out = y + m * ldy + n;
                    /* the row's first level writes (with the bias), its second adds, then its
                     * outlier row adds */
                    if (r % levels != 0) v = _mm256_add_ps(_mm256_loadu_ps(out), v);
                    else if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n));
                    if (xo && r % levels == levels - 1) {
                        const __m256i sums = ostate[m * 8 + j];
                        const __m256i oc = _mm256_mullo_epi32(
                            _mm256_set1_epi32(zpo[m]), _mm256_loadu_si256((const __m256i *)(wsum_o + n)));
                        const __m256 os = _mm256_mul_ps(_mm256_set1_ps(xso[m]), _mm256_loadu_ps(wscale + n));
                        v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sums, oc)), os));
                    }
                    _mm256_storeu_ps(out, v);
                }
            }
        }
    }
#if HAVE_AMX
    if (configured >= 0) amx_release();
#else
    (void)configured;
#endif
    free(ostate);
    }
    free(u), free(xs), free(zp), free(res), free(uo), free(xso), free(zpo);
}

/* w[N, K] (row-major fp32) → q[N, K] int8 and scale[N]: per output, symmetric, scale =
 * max(max|w|, 1e-12) / 127 and q = round-to-nearest-even(w / scale) in -127..127 (torch's
 * round; uag.kernels.native.symmetric_int8, which this replaces for speed: ~0.6 s of start-up). */
void uag_symmetric_int8(const float *w, int64_t N, int64_t K, int8_t *q, float *scale) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *x = w + n * K;
        float top = 0.0f;
        for (int64_t k = 0; k < K; k++) top = fabsf(x[k]) > top ? fabsf(x[k]) : top;
        const float s = (top > 1e-12f ? top : 1e-12f) / 127.0f;
        for (int64_t k = 0; k < K; k++) {
            float r = nearbyintf(x[k] / s);
            r = r < -127.0f ? -127.0f : r > 127.0f ? 127.0f : r;
            q[n * K + k] = (int8_t)r;
        }
        scale[n] = s;
    }
}
