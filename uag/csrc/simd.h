/* What q8.c and q4.c share about the instruction sets they may use. */
#ifndef UAG_SIMD_H
#define UAG_SIMD_H

/* AVX-VNNI's intrinsics need GCC 11 or clang 12: older compilers build the other paths only. */
#if !defined(UAG_NO_AVXVNNI) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define HAVE_AVXVNNI 1
#else
#define HAVE_AVXVNNI 0
#endif

int uag_use_vnni(void);       /* q8.c: the CPU has AVX-VNNI (and the tests left it on) */
int uag_use_avx512vnni(void); /* q8.c: likewise AVX-512 VNNI (F, BW, VL) */

#endif
