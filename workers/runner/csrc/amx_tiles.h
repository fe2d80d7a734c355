/* The AMX tile configuration both AMX kernels load (palette 1: eight tiles of up to 16 rows
   of 64 bytes), shared by csrc/amx_gemm.c and csrc/amx_attention.c. */
#ifndef SWITCHBOARD_AMX_TILES_H
#define SWITCHBOARD_AMX_TILES_H

#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* A palette-1 configuration with tile t holding rows[t] rows of 64 bytes (0: unused). */
static inline tile_config tile_rows(const int rows[8]) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)rows[t];
        cfg.colsb[t] = rows[t] ? 64 : 0;
    }
    return cfg;
}

#endif
