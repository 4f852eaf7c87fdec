/* The weight storage formats of a native linear layer: one code each, read by every C switch
 * on a format (skinny.c's drive and gathers, layer.c's products) and by Python
 * (uag/kernels/formats.py reads the codes from this file: one numbering). Adding a format is one
 * line here, one row in formats.py's table and its kernel. */
#ifndef UAG_FORMATS_H
#define UAG_FORMATS_H

enum uag_format {
    UAG_FMT_FP32 = 0,         /* fp32, [N/8][K][8] (skinny.c) */
    UAG_FMT_INT8 = 1,         /* int8 with one scale per output, weight-only (skinny.c) */
    UAG_FMT_BLOCK_INT8 = 2,   /* int8 x a scale per block of 32, equal to fp32 (skinny.c) */
    UAG_FMT_BLOCK_AFFINE = 3, /* uint8 x a scale + a base per block of 16, equal (skinny.c) */
    UAG_FMT_DYNAMIC_INT8 = 4, /* int8 weights x int8 activations, approximate (q8.c) */
    UAG_FMT_Q4 = 5,           /* 4-bit blocks x int8 activations, approximate (q4.c) */
    UAG_FMT_EXACT = 6,        /* block integers x activations as exact integer sums (exact.c) */
};

#endif
