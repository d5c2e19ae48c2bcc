// AMX tile set-up shared by the tile kernels (amx_attention.cpp, q4_amx.cpp): every tile is
// configured as 16 rows of 64 bytes, which serves bfloat16 A operands (16 x 32), B operands in
// pair rows (16 x 16 pairs) and float32 accumulators (16 x 16) alike.
#pragma once

namespace pagedserve {
// Whether this build has the tile kernels and Linux granted the tile registers (amx_attention.cpp).
bool amx_attention_available();
}  // namespace pagedserve

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGEDSERVE_AMX 1
#include <immintrin.h>

#include <cstdint>

namespace pagedserve::amx {

struct TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Per thread, before its first tile instruction; `_tile_release()` when done.
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace pagedserve::amx
#endif
