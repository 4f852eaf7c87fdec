/* Every function the kernels export, declared once: each .c file includes this, so the
 * compiler checks its definitions against these prototypes (built with
 * -Werror=missing-prototypes: an exported function missing here does not build), and
 * uag/kernels/native.py makes its ctypes bindings from these lines. Keep to the types its
 * reader knows: void, int, int64_t, float, double and pointers (any pointer binds as void *). */
#ifndef UAG_KERNELS_H
#define UAG_KERNELS_H

#include <stdint.h>

#include "formats.h"

struct uag_layer;   /* layer.c */
struct uag_scratch; /* layer.c */
struct uag_head;    /* screen.c */

/* skinny.c: y[M, N] = x[M, K] @ w^T (+ bias) in [N/8][K][8], by format (formats.h) */
void uag_linear_f32(const float *x, int64_t ldx, int64_t M, int64_t K, const float *w,
                    const float *scale, int64_t N, const float *bias, float *y, int64_t ldy);
void uag_linear_i8(const float *x, int64_t ldx, int64_t M, int64_t K, const int8_t *w,
                   const float *scale, int64_t N, const float *bias, float *y, int64_t ldy);
void uag_linear_b8(const float *x, int64_t ldx, int64_t M, int64_t K, const int8_t *w,
                   const float *bscale, int64_t N, const float *bias, float *y, int64_t ldy);
void uag_linear_a8(const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *w,
                   const float *params, int64_t N, const float *bias, float *y, int64_t ldy);
int64_t uag_set_avx512(int64_t want);
/* skinny.c: finding exact block forms; gathering rows and candidates' exact logits */
int64_t uag_block_int8(const float *w, int64_t N, int64_t K, const int32_t *mult, int64_t nm,
                       int8_t *q, float *s);
int64_t uag_block_affine(const float *w, int64_t N, int64_t K, uint8_t *q, float *p);
void uag_gather_rows(int64_t fmt, const void *w, const float *params, int64_t K,
                     const int64_t *ids, int64_t n, float scale, float *out);
int64_t uag_exact_candidates(int64_t fmt, const void *w, const float *params, int64_t K,
                             const float *x, int64_t ldx, int64_t M, const float *bias,
                             const int64_t *rows, const int64_t *cols, int64_t count,
                             float *logits, int64_t ldl, int64_t *ids);

/* q8.c: int8 weights x int8 activations; which instruction sets it may use */
void uag_linear_q8(const float *x, int64_t ldx, int64_t M, int64_t K, const int8_t *w,
                   const float *wscale, const int32_t *wsum, int64_t N, const float *bias,
                   float *y, int64_t ldy, int64_t levels, float *bound, const float *xo,
                   int64_t ldxo, float *bound_o, int64_t q0, int64_t nq, const int32_t *wsum_o);
void uag_symmetric_int8(const float *w, int64_t N, int64_t K, int8_t *q, float *scale);
int uag_use_vnni(void);       /* the CPU has AVX-VNNI (and the tests left it on) */
int uag_use_avx512vnni(void); /* likewise AVX-512 VNNI (F, BW, VL) */
int uag_use_amx(void);        /* AMX-INT8, and the kernel grants the tile state */
int64_t uag_set_vnni(int64_t want);
int64_t uag_set_avx512vnni(int64_t want);
int64_t uag_set_amx(int64_t want);

/* q4.c: 4-bit blocks x int8 activations */
void uag_linear_q4(const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *w,
                   const uint16_t *params, int64_t N, const float *bias, float *y, int64_t ldy);
int64_t uag_q4_grid(const float *w, int64_t N, int64_t K, float tol, uint8_t *packed,
                    uint16_t *params);

/* exact.c: block integers x activations as exact integer sums */
void uag_linear_x8(const float *x, int64_t ldx, int64_t M, int64_t K, const int8_t *w,
                   const void *params, int64_t blk, int64_t affine, int64_t bits,
                   int64_t offset, int64_t span, int64_t N, const float *bias, float *y,
                   int64_t ldy);
int64_t uag_x8_available(void);
int64_t uag_x8_unpack_check(void);

/* layer.c: a decoder layer in one call, every layer in one call; the layers' RMS norm */
void uag_decoder_layer(const struct uag_layer *L, float *hidden, int64_t rows, int64_t start,
                       float *keys, float *values, int64_t capacity, const float *cos,
                       const float *sin, const struct uag_scratch *S);
void uag_decoder_layers(const struct uag_layer *layers, int64_t count, float *hidden,
                        int64_t rows, int64_t start, float *const *keys, float *const *values,
                        int64_t capacity, const int64_t *kind, const float *const *cos,
                        const float *const *sin, const struct uag_scratch *S);
void uag_rms_norm_rows(const float *x, int64_t rows, int64_t n, const float *w, float eps,
                       float *y);

/* screen.c: the greedy head's candidates, or the whole greedy head in one call; a draft
 * step's statistics */
int64_t uag_screen(const float *logits, int64_t M, int64_t V, int64_t ldl, const float *coef,
                   const float *xn, const float *coef2, const float *xr, const float *coef3,
                   const float *xo, float slack, int64_t *rows, int64_t *cols, int64_t cap);
int64_t uag_draft_stats(const float *l, int64_t V, double *out);
int64_t uag_screened_greedy(const struct uag_head *H, const float *x, int64_t M, float *logits,
                            float *norms, float *missed, int64_t *rows, int64_t *cols,
                            int64_t cap, int64_t limit, int64_t *ids);

#endif
