/* What q8.c, q4.c and skinny.c share about the instruction sets they may use. */
#ifndef UAG_SIMD_H
#define UAG_SIMD_H

#include <stdint.h>

/* One optional CPU path (AVX-512, VNNI, AMX): `use()` is 1 where the CPU has it and the tests
 * have not turned it off (`detect` runs on the first ask only, then the answer is kept);
 * `set(want)` is the tests' switch (0: off; 1: on where the CPU has it), returning the path
 * now in use. Every path gives the same bits as the others. */
#define UAG_CPU_PATH(qualifier, use, set, detect)                                                \
    static int use##_state = -1; /* -1: not decided yet */                                      \
    qualifier int use(void) {                                                                    \
        if (use##_state < 0) use##_state = (detect) != 0;                                        \
        return use##_state;                                                                      \
    }                                                                                            \
    int64_t set(int64_t want) {                                                                  \
        use##_state = -1;                                                                        \
        use##_state = want && use();                                                             \
        return use##_state;                                                                      \
    }

/* AVX-VNNI's intrinsics need GCC 11 or clang 12: older compilers build the other paths only. */
#if !defined(UAG_NO_AVXVNNI) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define HAVE_AVXVNNI 1
#else
#define HAVE_AVXVNNI 0
#endif

/* AMX's tile intrinsics as GCC 11+ defines them (inline assembly, usable in any function), and
 * the Linux call that grants a process the tile state: elsewhere the other paths only. */
#if !defined(UAG_NO_AMX) && defined(__linux__) && !defined(__clang__) && __GNUC__ >= 11
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

#if HAVE_AMX
#include <stdint.h>
/* What ldtilecfg reads (palette 1): each tile's bytes per row and rows. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) uag_amx_config;
#endif

#include "kernels.h" /* uag_use_vnni, uag_use_avx512vnni, uag_use_amx (q8.c) */

#endif
