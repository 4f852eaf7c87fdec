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
