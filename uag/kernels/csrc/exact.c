/* Block-quantised weights times fp32 activations through exact integers (AVX-512 VNNI, AMX).
 *
 * Why: skinny.c's block paths (b8, a8) widen every weight to fp32 and spend one multiply-add
 * per weight and row, so a forward is bound by those instructions, not by the bytes: Gemma 3's
 * body took ~8 ms for one row and ~13.5 ms for 8 on these 2 cores. Here the products are
 * integer, 64 (vpdpbusd) or 1024 (an AMX tile multiply) per instruction, and row-count
 * invariant by construction:
 *
 *   - each activation block (the weights' block of 32 or 16 inputs) becomes integers on its
 *     own power-of-two grid, x^ = round(x * 2^(14 - e_b)) with max|x_b| < 2^e_b: 15 bits,
 *     every value to within 2^-15 of its block's largest (2^-14 of the largest itself), split
 *     into two bytes (x^ = 2^8 T + D, D unsigned, T = x^ >> 8 in -64..64 and stored as T + 64
 *     so vpdpbusd's u8 x s8 products take every byte). A block's own exponent keeps an outlier
 *     channel from coarsening the rest of its row (llama.cpp rounds activations to 8 bits per
 *     256); e_b is held to at least the row's largest less XSPAN, so a block's factor
 *     2^(e_b - E) times a weight scale stays a normal float;
 *   - the weight integers q of each block (int8: Q8_0 / Q5_0 de-quantised from GGUF, scale s
 *     per block of 32; the k-quants' q with scale s, and base b where it is not a whole number
 *     of steps, per block of 32 or 16) meet each byte in exact int32 sums P_d, and with
 *     S = sum q the block's exact v = sum x^ q = 2^8 (P1 - 64 S) + P0, |v| < 2^27;
 *   - each block meets its scale once, in float, block after block:
 *     acc = fma(s * 2^(e_b - E), float(v), acc) (then acc = fma(b, 2^(e_b - E) sum x^, acc)
 *     for the affine format, that sum exact in one float), and y = acc * 2^(E - 14) + bias,
 *     E the row's largest e_b.
 *
 * Integer sums do not depend on their order, and the float steps after them are the same on
 * every path, so AMX, AVX-512 VNNI and the scalar reference, and every row count, give the same
 * bits: the row-count invariance lossless verification needs. Why two bytes and not four
 * (31 bits a row, until 2026-12-07): an extra verified row costs its byte products, and with
 * four planes they were most of it (the 1.5B Qwen target's 1.5 G multiply-accumulates a row
 * are 6 G vpdpbusd lanes, >= 13 ms on two Zen 4 cores). Against the exact product the error is
 * at most 2^-14 of sum_b max|x_b| sum_k |w_k| (the activations' grid) plus ~1-3 float roundings
 * of sum |x| |w| (tests/test_kernels.py checks that bound against float64).
 *
 * Layout: q as [N/16][K/4][16][4] (sixteen outputs' four consecutive weights side by side: one
 * 64-byte load per quad for vpdpbusd, and a block's 8 (or 4) quads are one AMX B tile);
 * params [N/16][K/B][16] scales, or [N/16][K/B][2][16] scales then bases (affine); or
 * factored (span > 0): per group and span of `span` inputs (SB = span / blk blocks), the fp32
 * units u[P][16] then the int8 multipliers m[P][SB][16] (P = 1, or 2 with bases), a block's
 * scale (base) the float product u * m, exact (NativeLinear.factor stores only spans where
 * it is: the same floats as the plain layout, so the same bits). Why: a k-quant's scale and
 * minimum are an fp16 per 256 inputs times a 6-bit integer per 16 or 32 (Q4_K, Q6_K), and as
 * fp32 per block they were 571 of the 1.5B Qwen body's 1,881 MB a token; factored, 123.
 *
 * Packed (bits 4, 5 or 6): the same integers at the width their range needs, read back
 * exactly before the products (unpack_ref, unpack512; at 4 and 6 bits on VNNI in registers,
 * sums_vnnip), so the sums and every bit after them are the int8 layout's. Why: Gemma 3's
 * body is Q5_0 / Q4_K / Q6_K in its GGUF file (~68 MB)
 * but read as ~119 MB of int8 a token, and a one-row step is bound by the bytes it reads.
 * Each value is stored as u = q - offset (one offset per matrix, 0 <= u < 2^bits); per group
 * and block, in place of its blk / 4 quads of 64 bytes: blk / 8 vectors of nibbles (vector j:
 * quad 2j's u & 15 in the low nibbles, quad 2j + 1's in the high ones), then the high bits in
 * the same byte positions: 5 bits, one vector whose bit r is quad r's bit 4; 6 bits, blk / 16
 * vectors, vector v's bits 2t, 2t + 1 quad 4v + t's bits 4, 5 (packed_bytes).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define XL 16     /* outputs per group: one 512-bit vector of int32 sums */
#define XQ 4      /* consecutive inputs per output in one 32-bit lane */
#define XD 2     /* bytes (planes) per activation value */
#define XBITS 14 /* |x^| <= 2^XBITS: the top byte T = x^ >> 8 in -64..64 */
#define XSPAN 64 /* a block's exponent is at least the row's largest less this */
#define XAMX_ROWS 16 /* rows per AMX pass: 2 planes each, two tile sets of two tiles of 16 */
#define XAMX_MIN_ROWS 1 /* AMX from one row: gate_up alone 0.052 vs 0.068 ms on VNNI (same bits) */
#define XPREFETCH 4096 /* bytes ahead of a block's tile load that its lines are prefetched */
#define XVNNI_ROWS 6 /* rows per VNNI pass: 6 x 2 int32 sums in registers (with four planes,
                      * 4 rows a pass spilled the plane rows' offsets to general registers:
                      * 3 rows of 4 planes was the most) */
#define X8 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

/* Row x[0, K) -> its two bytes per value, block-major: digit d of input k at
 * planes[(k / blk) * bstride + d * blk + k % blk] (a block's plane rows are contiguous, so a
 * tile loads them at stride blk); per block b, rb[2b] = e_b - E (the block's factor's exponent,
 * as a float) and rb[2b + 1] = 2^(e_b - E) sum x^ (exact: |sum| <= 2^19); *row_e = E. The
 * first pass parks e_b itself in rb[2b] until E is known (no scratch array per row).
 * Returns 0 when the row is not finite (its outputs become NaN; planes and rb left alone). */
static int quantize(const float *x, int64_t K, uint8_t *planes, int64_t bstride, int64_t blk,
                    float *rb, int *row_e) {
    const int64_t KB = K / blk;
    int E = INT32_MIN;
    for (int64_t b = 0; b < KB; b++) {
        float top = 0.0f;
        for (int64_t k = b * blk; k < (b + 1) * blk; k++) {
            if (!isfinite(x[k])) return 0;
            top = fmaxf(top, fabsf(x[k]));
        }
        int e;
        frexpf(top, &e); /* top < 2^e (top 0: e 0) */
        rb[2 * b] = (float)e;
        E = e > E ? e : E;
    }
    for (int64_t b = 0; b < KB; b++) {
        const int e = (int)rb[2 * b] > E - XSPAN ? (int)rb[2 * b] : E - XSPAN;
        const double f = ldexp(1.0, XBITS - e);
        int32_t sum = 0;
        for (int64_t k = b * blk; k < (b + 1) * blk; k++) {
            const int32_t v = (int32_t)nearbyint((double)x[k] * f); /* |v| <= 2^14 */
            uint8_t *at = planes + b * bstride + k % blk;
            at[0] = (uint8_t)(v & 255);
            at[blk] = (uint8_t)((v >> 8) + 64);
            sum += v;
        }
        rb[2 * b] = (float)(e - E);
        rb[2 * b + 1] = ldexpf((float)sum, e - E);
    }
    *row_e = E;
    return 1;
}

/* quantize's steps sixteen values at a time (AVX-512): x * 2^shift is exact in float
 * (vscalefps), and its conversion rounds to nearest even, as nearbyint: the same integers. */
static X8 int quantize512(const float *x, int64_t K, uint8_t *planes, int64_t bstride,
                          int64_t blk, float *rb, int *row_e) {
    const int64_t KB = K / blk;
    __mmask16 bad = 0; /* NaN or infinity (vmaxps would drop a NaN) */
    int E = INT32_MIN;
    for (int64_t b = 0; b < KB; b++) {
        __m512 top16 = _mm512_setzero_ps();
        for (int64_t k = b * blk; k < (b + 1) * blk; k += 16) {
            const __m512 v = _mm512_loadu_ps(x + k);
            bad |= _mm512_fpclass_ps_mask(v, 0x99);
            top16 = _mm512_max_ps(top16, _mm512_abs_ps(v));
        }
        int e;
        frexpf(_mm512_reduce_max_ps(top16), &e);
        rb[2 * b] = (float)e;
        E = e > E ? e : E;
    }
    if (bad) return 0;
    const __m512i off = _mm512_set1_epi32(64);
    for (int64_t b = 0; b < KB; b++) {
        const int e = (int)rb[2 * b] > E - XSPAN ? (int)rb[2 * b] : E - XSPAN;
        const __m512 f = _mm512_set1_ps((float)(XBITS - e));
        __m512i sum16 = _mm512_setzero_si512();
        for (int64_t k = b * blk; k < (b + 1) * blk; k += 16) {
            const __m512i v = _mm512_cvtps_epi32(_mm512_scalef_ps(_mm512_loadu_ps(x + k), f));
            uint8_t *at = planes + b * bstride + k % blk;
            _mm_storeu_si128((__m128i *)at, _mm512_cvtepi32_epi8(v));
            _mm_storeu_si128((__m128i *)(at + blk),
                             _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_srai_epi32(v, 8), off)));
            sum16 = _mm512_add_epi32(sum16, v);
        }
        rb[2 * b] = (float)(e - E);
        rb[2 * b + 1] = ldexpf((float)_mm512_reduce_add_epi32(sum16), e - E);
    }
    *row_e = E;
    return 1;
}

/* The scalar definition of every path: one block's planes of mc rows (XD per row, blk bytes
 * each, as quantize lays them out) against one group's block (w: blk / 4 quads of 16 x 4):
 * c[(XD i + d) * 16 + n] = P_d of row i, output n. */
static void sums_ref(const uint8_t *planes, int mc, const int8_t *w, int64_t blk, int32_t *c) {
    for (int n = 0; n < XL; n++)
        for (int r = 0; r < XD * mc; r++) {
            int32_t p = 0;
            for (int64_t k = 0; k < blk; k++)
                p += (int32_t)planes[r * blk + k] * w[(k / XQ) * XL * XQ + n * XQ + k % XQ];
            c[r * XL + n] = p;
        }
}

/* S = the block's sum of q per output (the T + 64 plane's correction). */
static void wsum_ref(const int8_t *w, int64_t blk, int32_t *s) {
    for (int n = 0; n < XL; n++) {
        int32_t t = 0;
        for (int64_t k = 0; k < blk; k++) t += w[(k / XQ) * XL * XQ + n * XQ + k % XQ];
        s[n] = t;
    }
}

/* acc[i * 16 + n] += this block's value for row i, output n, from the sums c and S: the exact
 * v = 2^8 (P1 - 64 S) + P0 in int32, then in float: acc = fma(s * 2^(e_b - E), float(v), acc),
 * and for the affine format acc = fma(b, 2^(e_b - E) sum x^, acc). rb: row 0's (e_b - E,
 * scaled sum) for this block, the next row's ldrb floats on. */
static void epilogue_ref(const int32_t *c, const int32_t *S, int mc, const float *sc,
                         const float *base, const float *rb, int64_t ldrb, float *acc) {
    for (int i = 0; i < mc; i++)
        for (int n = 0; n < XL; n++) {
            const int32_t *p = c + XD * i * XL + n;
            const int32_t v = (p[XL] - 64 * S[n]) * 256 + p[0];
            float a = fmaf(ldexpf(sc[n], (int)rb[i * ldrb]), (float)v, acc[i * XL + n]);
            if (base) a = fmaf(base[n], rb[i * ldrb + 1], a);
            acc[i * XL + n] = a;
        }
}

/* The same steps, sixteen outputs at a time: the same bits (vscalefps by a whole number is
 * ldexpf, exact for the normal results XSPAN keeps). */
static inline X8 void epilogue512(const int32_t *c, const int32_t *S, int mc, const float *sc,
                                  const float *base, const float *rb, int64_t ldrb,
                                  float *acc) {
    const __m512i s64 = _mm512_slli_epi32(_mm512_loadu_si512(S), 6);
    const __m512 vs = _mm512_loadu_ps(sc);
    const __m512 vb = base ? _mm512_loadu_ps(base) : _mm512_setzero_ps();
    for (int i = 0; i < mc; i++) {
        const int32_t *p = c + XD * i * XL;
        const __m512i v = _mm512_add_epi32(
            _mm512_slli_epi32(_mm512_sub_epi32(_mm512_loadu_si512(p + XL), s64), 8),
            _mm512_loadu_si512(p));
        const __m512 f = _mm512_scalef_ps(vs, _mm512_set1_ps(rb[i * ldrb]));
        __m512 a = _mm512_fmadd_ps(f, _mm512_cvtepi32_ps(v), _mm512_loadu_ps(acc + i * XL));
        if (base) a = _mm512_fmadd_ps(vb, _mm512_set1_ps(rb[i * ldrb + 1]), a);
        _mm512_storeu_ps(acc + i * XL, a);
    }
}

/* Bytes of one group's span of factored parameters (np kinds, sb blocks). */
static inline int64_t span_bytes(int64_t np, int64_t sb) { return np * (64 + 16 * sb); }

/* Block b's scales (then bases) of one group: the plain layout's floats, or the factored
 * layout's products u * m written to tmp[np * 16]. The definition: */
static const float *params_ref(const uint8_t *pg, int64_t b, int64_t np, int64_t sb,
                               float *tmp) {
    if (!sb) return (const float *)pg + b * np * XL;
    const uint8_t *at = pg + (b / sb) * span_bytes(np, sb);
    const float *u = (const float *)at;
    const int8_t *m = (const int8_t *)(at + 64 * np) + (b % sb) * XL;
    for (int64_t p = 0; p < np; p++)
        for (int n = 0; n < XL; n++) tmp[p * XL + n] = u[p * XL + n] * (float)m[p * sb * XL + n];
    return tmp;
}

/* The same floats, sixteen at a time (one rounded product each, as params_ref's). */
static inline X8 const float *params512(const uint8_t *pg, int64_t b, int64_t np, int64_t sb,
                                        float *tmp) {
    if (!sb) return (const float *)pg + b * np * XL;
    const uint8_t *at = pg + (b / sb) * span_bytes(np, sb);
    const int8_t *m = (const int8_t *)(at + 64 * np) + (b % sb) * XL;
    for (int64_t p = 0; p < np; p++) {
        const __m512 mult = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(m + p * sb * XL))));
        _mm512_storeu_ps(tmp + p * XL,
                         _mm512_mul_ps(_mm512_loadu_ps((const float *)at + p * XL), mult));
    }
    return tmp;
}

/* S by vpdpbusd against ones: the same integers as wsum_ref. */
static inline X8 void wsum512(const int8_t *w, int64_t blk, int32_t *S) {
    __m512i s = _mm512_setzero_si512();
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t q = 0; q < blk / XQ; q++)
        s = _mm512_dpbusd_epi32(s, ones, _mm512_loadu_si512(w + q * XL * XQ));
    _mm512_storeu_si512(S, s);
}

/* Bytes of one group's block in the packed layout (bits 8: the int8 layout). */
static inline int64_t packed_bytes(int64_t blk, int64_t bits) {
    if (bits == 8) return blk * XL;
    return blk * 8 + (bits == 5 ? 64 : bits == 6 ? 64 * (blk / 16) : 0);
}

/* The packed layout's definition: one group's block back to its int8 quads w[blk / 4][64]. */
static void unpack_ref(const uint8_t *pk, int64_t blk, int64_t bits, int64_t offset, int8_t *w) {
    const uint8_t *high = pk + blk * 8;
    for (int64_t r = 0; r < blk / XQ; r++)
        for (int e = 0; e < XL * XQ; e++) {
            int u = (pk[(r / 2) * 64 + e] >> (4 * (r & 1))) & 15;
            if (bits == 5) u |= ((high[e] >> r) & 1) << 4;
            else if (bits == 6) u |= ((high[(r / 4) * 64 + e] >> (2 * (r % 4))) & 3) << 4;
            w[r * 64 + e] = (int8_t)(u + offset);
        }
}

/* The same integers, two quads a step (AVX-512BW): the 16-bit shifts only ever move a byte's
 * own bits into the positions the masks keep. */
static inline X8 void unpack512(const uint8_t *pk, int64_t blk, int64_t bits, int64_t offset,
                                int8_t *w) {
    const __m512i low4 = _mm512_set1_epi8(15), off = _mm512_set1_epi8((char)offset);
    const __m512i keep = _mm512_set1_epi8(bits == 5 ? 1 : 3);
    const uint8_t *high = pk + blk * 8;
    for (int64_t j = 0; j < blk / 8; j++) {
        const __m512i v = _mm512_loadu_si512(pk + j * 64);
        __m512i a = _mm512_and_si512(v, low4), b = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if (bits > 4) { /* quads r = 2j (into a) and 2j + 1 (into b) */
            const int64_t r = 2 * j;
            const __m512i h = _mm512_loadu_si512(high + (bits == 5 ? 0 : (r / 4) * 64));
            const int s = bits == 5 ? (int)r : (int)(2 * (r % 4)), t = bits == 5 ? 1 : 2;
            const __m512i ha = _mm512_and_si512(_mm512_srl_epi16(h, _mm_cvtsi32_si128(s)), keep);
            const __m512i hb = _mm512_and_si512(_mm512_srl_epi16(h, _mm_cvtsi32_si128(s + t)), keep);
            a = _mm512_or_si512(a, _mm512_slli_epi16(ha, 4));
            b = _mm512_or_si512(b, _mm512_slli_epi16(hb, 4));
        }
        _mm512_storeu_si512(w + 2 * j * 64, _mm512_add_epi8(a, off));
        _mm512_storeu_si512(w + (2 * j + 1) * 64, _mm512_add_epi8(b, off));
    }
}

/* VNNI: mb (<= XVNNI_ROWS, a constant after inlining) rows' planes against one group's block. */
static inline X8 __attribute__((always_inline)) void sums_vnni(
    const uint8_t *planes, const int mb, const int8_t *w, int64_t blk, int32_t *c) {
    __m512i acc[XVNNI_ROWS * XD];
    _Pragma("GCC unroll 16") for (int r = 0; r < XD * mb; r++) acc[r] = _mm512_setzero_si512();
    for (int64_t q = 0; q < blk / XQ; q++) {
        const __m512i wv = _mm512_loadu_si512(w + q * XL * XQ);
        _Pragma("GCC unroll 16") for (int r = 0; r < XD * mb; r++) {
            int32_t four;
            memcpy(&four, planes + r * blk + q * XQ, sizeof four);
            acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(four), wv);
        }
    }
    _Pragma("GCC unroll 16") for (int r = 0; r < XD * mb; r++) _mm512_storeu_si512(c + r * XL, acc[r]);
}

/* sums_vnni on a block packed at 4 or 6 bits, unpacked in registers: nibble vector j holds quad
 * 2j (low nibbles) and 2j + 1 (high); at 6 bits, high-bit vector j / 2 holds their bits 4-5 at
 * bits 2t, 2t + 1 (t = 2j % 4 and 2j % 4 + 1); each u + offset is the int8 quad unpack_ref
 * makes, so the sums are the int8 layout's. With S (the first pass of rows) it also sums the
 * quads into S, as wsum512 would from the unpacked block. Why: unpacking to memory and
 * reading it back cost more than the bytes saved (a one-row step of the 1.5B 1.29x slower);
 * in registers it is three instructions a quad at 4 bits, six at 6. The 16-bit shifts only
 * move a byte's own bits into the positions the masks keep. */
static inline X8 __attribute__((always_inline)) void sums_vnnip(
    const uint8_t *planes, const int mb, const uint8_t *pk, int64_t blk, const int bits,
    __m512i off, int32_t *c, int32_t *S) {
    __m512i acc[XVNNI_ROWS * XD], s = _mm512_setzero_si512();
    const __m512i low4 = _mm512_set1_epi8(15), ones = _mm512_set1_epi8(1);
    const __m512i top2 = _mm512_set1_epi8(0x30);
    _Pragma("GCC unroll 16") for (int r = 0; r < XD * mb; r++) acc[r] = _mm512_setzero_si512();
    for (int64_t j = 0; j < blk / 8; j++) {
        const __m512i v = _mm512_loadu_si512(pk + j * 64);
        __m512i wa = _mm512_and_si512(v, low4);
        __m512i wb = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if (bits == 6) { /* bits 4-5 of quads 2j, 2j + 1 at (2j % 4) * 2 and that + 2 */
            const __m512i h = _mm512_loadu_si512(pk + blk * 8 + (j / 2) * 64);
            const __m512i ha = j & 1 ? _mm512_srli_epi16(h, 0) : _mm512_slli_epi16(h, 4);
            const __m512i hb = j & 1 ? _mm512_srli_epi16(h, 2) : _mm512_slli_epi16(h, 2);
            wa = _mm512_or_si512(wa, _mm512_and_si512(ha, top2));
            wb = _mm512_or_si512(wb, _mm512_and_si512(hb, top2));
        }
        wa = _mm512_add_epi8(wa, off);
        wb = _mm512_add_epi8(wb, off);
        if (S) {
            s = _mm512_dpbusd_epi32(s, ones, wa);
            s = _mm512_dpbusd_epi32(s, ones, wb);
        }
        _Pragma("GCC unroll 16") for (int r = 0; r < XD * mb; r++) {
            int32_t fa, fb;
            memcpy(&fa, planes + r * blk + 2 * j * XQ, sizeof fa);
            memcpy(&fb, planes + r * blk + (2 * j + 1) * XQ, sizeof fb);
            acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(fa), wa);
            acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(fb), wb);
        }
    }
    _Pragma("GCC unroll 16") for (int r = 0; r < XD * mb; r++) _mm512_storeu_si512(c + r * XL, acc[r]);
    if (S) _mm512_storeu_si512(S, s);
}

static inline X8 __attribute__((always_inline)) void sums_vnnip_rows_blk(
    const uint8_t *planes, int mc, const uint8_t *pk, int64_t blk, const int bits,
    int64_t offset, int32_t *c, int32_t *S) {
    const __m512i off = _mm512_set1_epi8((char)offset);
    for (int i = 0; i < mc; i += XVNNI_ROWS) {
        const uint8_t *p = planes + XD * i * blk;
        int32_t *ci = c + XD * i * XL, *Si = i == 0 ? S : NULL;
        switch (mc - i < XVNNI_ROWS ? mc - i : XVNNI_ROWS) {
            case 1: sums_vnnip(p, 1, pk, blk, bits, off, ci, Si); break;
            case 2: sums_vnnip(p, 2, pk, blk, bits, off, ci, Si); break;
            case 3: sums_vnnip(p, 3, pk, blk, bits, off, ci, Si); break;
            case 4: sums_vnnip(p, 4, pk, blk, bits, off, ci, Si); break;
            case 5: sums_vnnip(p, 5, pk, blk, bits, off, ci, Si); break;
            default: sums_vnnip(p, XVNNI_ROWS, pk, blk, bits, off, ci, Si); break;
        }
    }
}

/* One copy per block size and width (4 or 6), as sums_vnni_rows. */
static X8 void sums_vnnip_rows(const uint8_t *planes, int mc, const uint8_t *pk, int64_t blk,
                               int64_t bits, int64_t offset, int32_t *c, int32_t *S) {
    if (bits == 4 && blk == 32) sums_vnnip_rows_blk(planes, mc, pk, 32, 4, offset, c, S);
    else if (bits == 4 && blk == 16) sums_vnnip_rows_blk(planes, mc, pk, 16, 4, offset, c, S);
    else if (bits == 6 && blk == 32) sums_vnnip_rows_blk(planes, mc, pk, 32, 6, offset, c, S);
    else sums_vnnip_rows_blk(planes, mc, pk, 16, 6, offset, c, S);
}

static inline X8 __attribute__((always_inline)) void sums_vnni_rows_blk(
    const uint8_t *planes, int mc, const int8_t *w, int64_t blk, int32_t *c) {
    for (int i = 0; i < mc; i += XVNNI_ROWS) {
        const uint8_t *p = planes + XD * i * blk;
        int32_t *ci = c + XD * i * XL;
        switch (mc - i < XVNNI_ROWS ? mc - i : XVNNI_ROWS) {
            case 1: sums_vnni(p, 1, w, blk, ci); break;
            case 2: sums_vnni(p, 2, w, blk, ci); break;
            case 3: sums_vnni(p, 3, w, blk, ci); break;
            case 4: sums_vnni(p, 4, w, blk, ci); break;
            case 5: sums_vnni(p, 5, w, blk, ci); break;
            default: sums_vnni(p, XVNNI_ROWS, w, blk, ci); break;
        }
    }
}

/* A copy per block size (32, 16): every plane row's offset is then an immediate, not a
 * register (with four planes and 3 rows a pass: a 2-9-row forward 4-10 % faster than 4 rows a
 * pass with blk in a register, on Zen 4; one row the same). blk is always 32 or 16; the last call keeps any
 * other size correct. */
static X8 void sums_vnni_rows(const uint8_t *planes, int mc, const int8_t *w, int64_t blk,
                              int32_t *c) {
    if (blk == 32) sums_vnni_rows_blk(planes, mc, w, 32, c);
    else if (blk == 16) sums_vnni_rows_blk(planes, mc, w, 16, c);
    else sums_vnni_rows_blk(planes, mc, w, blk, c);
}

#if HAVE_AMX
#define XAMX __attribute__((target("amx-tile,amx-int8,avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

/* Tiles for R = XD mc <= 32 plane rows, two sets so one block's products run while the
 * previous block's sums are read: C tiles 0-1 (set 0) and 2-3 (set 1) hold rows 0-15 and
 * 16-31, A tiles 4-5 the planes, B tiles 6 (set 0) and 7 (set 1) one block's quads (blk / 4
 * rows of 16 outputs x 4 bytes). */
static XAMX void xamx_configure(int R, int64_t blk) {
    uag_amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 2 && 16 * t < R; t++) {
        const int rows = R - 16 * t < 16 ? R - 16 * t : 16;
        c.rows[t] = c.rows[2 + t] = (uint8_t)rows;
        c.colsb[t] = c.colsb[2 + t] = XL * 4;
        c.rows[4 + t] = (uint8_t)rows, c.colsb[4 + t] = (uint16_t)blk;
    }
    c.rows[6] = c.rows[7] = (uint8_t)(blk / XQ);
    c.colsb[6] = c.colsb[7] = XL * XQ;
    __asm__ __volatile__("" : : "r"(&c) : "memory"); /* keep the stores (ldtilecfg reads them) */
    _tile_loadconfig(&c);
}

/* One group's blocks for one pass of mc rows (R = XD mc plane rows from planes, block b's at
 * planes + b * bstride, stride blk):
 * block b's tile products are issued before block b - 1's sums are stored and read, so the
 * tile unit and the epilogue overlap. */
static XAMX void pass_amx(const uint8_t *planes, int64_t bstride, int R, int rows, const int8_t *wg,
                          const uint8_t *pg, int64_t KB, int64_t blk, int64_t np, int64_t sb,
                          const float *rb, int64_t ldrb, int32_t *c, float *acc) {
    int32_t S[XL];
    float tmp[2 * XL];
    const int two = R > 16;
#define XAMX_ISSUE(CT0, CT1, BT)                                                                   \
    do {                                                                                           \
        _tile_loadd(BT, wb, XL * XQ);                                                              \
        _tile_loadd(4, planes + b * bstride, blk);                                                 \
        _tile_dpbusd(CT0, 4, BT);                                                                  \
        if (two) {                                                                                 \
            _tile_loadd(5, planes + b * bstride + 16 * blk, blk);                                  \
            _tile_dpbusd(CT1, 5, BT);                                                              \
        }                                                                                          \
    } while (0)
#define XAMX_COLLECT(CT0, CT1)                                                                     \
    do {                                                                                           \
        _tile_stored(CT0, c, XL * 4);                                                              \
        _tile_zero(CT0);                                                                           \
        if (two) {                                                                                 \
            _tile_stored(CT1, c + 16 * XL, XL * 4);                                                \
            _tile_zero(CT1);                                                                       \
        }                                                                                          \
    } while (0)
    _tile_zero(0);
    _tile_zero(2);
    if (two) {
        _tile_zero(1);
        _tile_zero(3);
    }
    for (int64_t b = 0; b <= KB; b++) {
        if (b < KB) {
            const int8_t *wb = wg + b * blk * XL;
            for (int64_t l = 0; l < blk * XL; l += 64) /* the block's lines, XPREFETCH ahead */
                _mm_prefetch((const char *)(wb + XPREFETCH + l), _MM_HINT_T0);
            if (b & 1) XAMX_ISSUE(2, 3, 7);
            else XAMX_ISSUE(0, 1, 6);
        }
        if (b > 0) {
            const int64_t a = b - 1;
            if (a & 1) XAMX_COLLECT(2, 3);
            else XAMX_COLLECT(0, 1);
            wsum512(wg + a * blk * XL, blk, S);
            const float *sc = params512(pg, a, np, sb, tmp);
            epilogue512(c, S, rows, sc, np > 1 ? sc + XL : NULL, rb + 2 * a, ldrb, acc);
        }
    }
#undef XAMX_ISSUE
#undef XAMX_COLLECT
}
static XAMX void xamx_release(void) { _tile_release(); }
#endif

/* 1 where unpack512 gives unpack_ref's integers for every packed width and block size, on
 * pseudo-random bytes (every bit pattern is a valid packed block), and the 4-bit products
 * unpacked in registers give the int8 layout's bits, or where neither can run here; 0 on any
 * difference. Checked before anything is packed (uag/kernels/native.py's
 * packed_body), so a wrong SIMD unpack can never reach a product. */
int64_t uag_x8_unpack_check(void) {
    if (!uag_use_avx512vnni()) return 1;
    uint8_t pk[384];
    int8_t a[512], b[512];
    uint32_t state = 12345u;
    for (int64_t bits = 4; bits <= 6; bits++)
        for (int64_t blk = 16; blk <= 32; blk += 16)
            for (int trial = 0; trial < 8; trial++) {
                for (int i = 0; i < 384; i++) {
                    state = state * 1664525u + 1013904223u;
                    pk[i] = (uint8_t)(state >> 24);
                }
                const int64_t offset = -(int64_t)(trial * 4);
                unpack_ref(pk, blk, bits, offset, a);
                unpack512(pk, blk, bits, offset, b);
                if (memcmp(a, b, (size_t)(blk * XL)) != 0) return 0;
            }
    /* 4 and 6 bits unpacked in registers (sums_vnnip) against the int8 blocks unpack_ref makes,
     * for 7 rows (two VNNI passes): one group of 16 outputs, 64 inputs, both block sizes */
    for (int64_t bits = 4; bits <= 6; bits += 2)
    for (int64_t blk = 16; blk <= 32; blk += 16) {
        const int64_t bb = packed_bytes(blk, bits);
        uint8_t pk4[64 * 8 + 4 * 64];
        int8_t w8[64 * XL];
        float params[(64 / 16) * XL], x[7 * 64], y8[7 * XL], y4[7 * XL];
        for (int i = 0; i < (int)sizeof pk4; i++) {
            state = state * 1664525u + 1013904223u;
            pk4[i] = (uint8_t)(state >> 24);
        }
        for (int i = 0; i < 7 * 64; i++) {
            state = state * 1664525u + 1013904223u;
            x[i] = (float)((int32_t)(state >> 8) - (1 << 23)) * 0x1p-20f;
        }
        for (int i = 0; i < (64 / blk) * XL; i++) params[i] = 0.25f + 0.125f * (float)(i % 5);
        for (int64_t b = 0; b < 64 / blk; b++) unpack_ref(pk4 + b * bb, blk, bits, -3, w8 + b * blk * XL);
        uag_linear_x8(x, 64, 7, 64, w8, params, blk, 0, 8, 0, 0, XL, NULL, y8, XL);
        uag_linear_x8(x, 64, 7, 64, (const int8_t *)pk4, params, blk, 0, bits, -3, 0, XL, NULL, y4, XL);
        if (memcmp(y8, y4, sizeof y8) != 0) return 0;
    }
    return 1;
}

/* 2: AMX, 1: AVX-512 VNNI, 0: the scalar reference, for a call of M rows. */
static int x8_path(int64_t M) {
    if (HAVE_AMX && M >= XAMX_MIN_ROWS && uag_use_amx()) return 2;
    return uag_use_avx512vnni() ? 1 : 0;
}

/* 1 where the fast paths (AVX-512 VNNI, AMX) exist here: where uag stores body weights for this
 * kernel (elsewhere skinny.c's block paths, whose fp32 products are as exact). */
int64_t uag_x8_available(void) { return uag_use_avx512vnni(); }

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) times the block weights (layout above;
 * blk 32 or 16; affine: params hold bases too; bits 8, or 4-6 packed with offset; span 0, or
 * the inputs per factored span of params) + bias. N a multiple of 16, K of blk (and span). */
void uag_linear_x8(const float *x, int64_t ldx, int64_t M, int64_t K, const int8_t *w,
                   const void *params, int64_t blk, int64_t affine, int64_t bits,
                   int64_t offset, int64_t span, int64_t N, const float *bias, float *y,
                   int64_t ldy) {
    const int path = x8_path(M);
    const int64_t KB = K / blk, groups = N / XL, np = affine ? 2 : 1, sb = span / blk;
    /* one group's parameter bytes */
    const int64_t pgb = sb ? (K / span) * span_bytes(np, sb) : KB * np * XL * 4;
    const int64_t bb = packed_bytes(blk, bits); /* one group's block */
    /* AMX: passes of mc rows (the last padded with zero planes: one tile shape for all) */
    const int64_t passes = path == 2 ? (M + XAMX_ROWS - 1) / XAMX_ROWS : 1;
    const int mc = (int)((M + passes - 1) / passes), R = XD * mc;
    const int64_t bstride = passes * R * blk; /* bytes per block of every row's planes */
    uint8_t *planes = (uint8_t *)calloc((size_t)(KB * bstride), 1);
    float *rb = (float *)calloc((size_t)(M * KB * 2), sizeof(float)); /* quantize's rb */
    float *unit = (float *)malloc(sizeof(float) * (size_t)M); /* 2^(E - 14); NaN: not finite */
    for (int64_t m = 0; m < M; m++) {
        int e = 0;
        uint8_t *pm = planes + XD * m * blk;
        const int ok = path ? quantize512(x + m * ldx, K, pm, bstride, blk, rb + m * KB * 2, &e)
                            : quantize(x + m * ldx, K, pm, bstride, blk, rb + m * KB * 2, &e);
        unit[m] = ok ? ldexpf(1.0f, e - XBITS) : NAN;
    }
#pragma omp parallel
    {
        int32_t *c = (int32_t *)aligned_alloc(64, sizeof(int32_t) * (size_t)(R + 1) * XL);
        float *acc = (float *)aligned_alloc(64, sizeof(float) * (size_t)(passes * mc) * XL);
        /* packed: AMX reads a group's blocks unpacked here (every pass reads them), VNNI and
         * the reference one block at a time (its first blk * 16 bytes) */
        int8_t *wbuf = bits == 8 ? NULL : (int8_t *)aligned_alloc(64, (size_t)(K * XL));
        float tmp[2 * XL]; /* a block's factored parameters as floats */
#if HAVE_AMX
        if (path == 2) xamx_configure(R, blk);
#endif
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            memset(acc, 0, sizeof(float) * (size_t)(passes * mc) * XL);
            const uint8_t *pk = (const uint8_t *)w + g * KB * bb;
            const int8_t *wg = (const int8_t *)pk;
            const uint8_t *pg = (const uint8_t *)params + g * pgb;
#if HAVE_AMX
            if (wbuf && path == 2) {
                for (int64_t b = 0; b < KB; b++) unpack512(pk + b * bb, blk, bits, offset, wbuf + b * blk * XL);
                wg = wbuf;
            }
#endif
            for (int64_t p = 0; p < passes; p++) {
                const uint8_t *pp = planes + p * R * blk;
                const int rows = (int)(M - p * mc < mc ? M - p * mc : mc);
                const float *rp = rb + p * mc * KB * 2;
                float *ap = acc + p * mc * XL;
#if HAVE_AMX
                if (path == 2) {
                    pass_amx(pp, bstride, R, rows, wg, pg, KB, blk, np, sb, rp, KB * 2, c, ap);
                    continue;
                }
#endif
                for (int64_t b = 0; b < KB; b++) {
                    const int8_t *wb = wg + b * blk * XL;
                    if (path == 1 && (bits == 4 || bits == 6) && (blk == 16 || blk == 32)) {
                        /* unpacked in registers */
                        int32_t *S = c + R * XL;
                        for (int64_t l = 0; l < bb; l += 64)
                            _mm_prefetch((const char *)(pk + b * bb + XPREFETCH + l), _MM_HINT_T0);
                        _mm_prefetch((const char *)pg + (b * pgb) / KB + XPREFETCH / 4,
                                     _MM_HINT_T0);
                        sums_vnnip_rows(pp + b * bstride, rows, pk + b * bb, blk, bits, offset, c, S);
                        const float *sc = params512(pg, b, np, sb, tmp);
                        epilogue512(c, S, rows, sc, affine ? sc + XL : NULL, rp + 2 * b, KB * 2, ap);
                        continue;
                    }
                    if (wbuf) {
                        if (path == 1) unpack512(pk + b * bb, blk, bits, offset, wbuf);
                        else unpack_ref(pk + b * bb, blk, bits, offset, wbuf);
                        wb = wbuf;
                    }
                    int32_t *S = c + R * XL;
                    if (path == 1) {
                        /* the block's lines and its parameters XPREFETCH ahead: a 9-row
                         * forward of the 1.5B's products 116 -> 94 ms, 1-5 rows the same */
                        for (int64_t l = 0; l < bb; l += 64)
                            _mm_prefetch((const char *)(pk + b * bb + XPREFETCH + l), _MM_HINT_T0);
                        _mm_prefetch((const char *)pg + (b * pgb) / KB + XPREFETCH / 4,
                                     _MM_HINT_T0);
                        sums_vnni_rows(pp + b * bstride, rows, wb, blk, c);
                        wsum512(wb, blk, S);
                        const float *sc = params512(pg, b, np, sb, tmp);
                        epilogue512(c, S, rows, sc, affine ? sc + XL : NULL, rp + 2 * b, KB * 2, ap);
                    } else {
                        sums_ref(pp + b * bstride, rows, wb, blk, c);
                        wsum_ref(wb, blk, S);
                        const float *sc = params_ref(pg, b, np, sb, tmp);
                        epilogue_ref(c, S, rows, sc, affine ? sc + XL : NULL, rp + 2 * b, KB * 2, ap);
                    }
                }
            }
            for (int64_t m = 0; m < M; m++)
                for (int n = 0; n < XL; n++) {
                    const int64_t o = g * XL + n;
                    float v = acc[m * XL + n] * unit[m];
                    if (bias) v += bias[o];
                    y[m * ldy + o] = v;
                }
        }
#if HAVE_AMX
        if (path == 2) xamx_release();
#endif
        free(c);
        free(acc);
        free(wbuf);
    }
    free(planes), free(rb), free(unit);
}
