/* AMX set-up shared by kvfleet's CPU kernels that use tiles (cpu_prefill.c, cpu_attention*.c,
 * cpu_gemm.c): the per-process permission Linux requires, the one tile shape they all use, and
 * their softmax's rescaling slack. HAVE_AMX is defined where the compiler targets AMX-BF16 (gcc
 * -march=native on Sapphire Rapids and later). Its functions are marked unused: a file may
 * include it for HAVE_AMX alone, as decode attention's paths do (its driver sets the tiles up). */
#ifndef KVFLEET_CPU_AMX_H
#define KVFLEET_CPU_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* The attention kernels' conditional rescaling: a running max moves only when a score passes it
 * by more than this (natural-log units), so probabilities stay below e^8 in between. */
#define RESCALE_SLACK 8.0f

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands out the AMX register state only to processes that ask for it (once per process;
 * oneDNN asks too, which makes this a no-op after a bf16 GEMM has run). Each file including
 * this header asks on its own first use. */
__attribute__((unused)) static int amx_permitted(void) {
    static int state; /* 0 not asked yet, 1 granted, -1 refused */
    if (state == 0)
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* All eight tiles as 16 rows of 64 bytes: 16 x 32 bf16 (A, B operands) or 16 x 16 float32 (C).
 * The configuration is per thread: call in every thread before its first tile instruction. */
__attribute__((unused)) static void configure_tiles(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}
#endif

#endif
