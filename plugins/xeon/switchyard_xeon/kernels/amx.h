// AMX tile state for the kernels that use it (panel_w8a8.cpp, panel_dot_bf16.cpp).
//
// Linux hands the tile registers only to a process that asks for them
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)), and each thread
// loads its own tile configuration. Every kernel here uses one shape: tiles
// 0-7 all 16 rows of 64 bytes (C: 16 x 16 fp32 or int32; A: 16 rows of 64
// bytes of activations; B: 16 lines of 64 bytes of a panel), configured at
// the start of each parallel region, since another library (oneDNN) may have
// loaded its own configuration on the same thread in between, and released
// at its end.

#pragma once

#if defined(__AMX_TILE__) && defined(__linux__)
#define SY_AMX_TILE 1

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace switchyard_xeon::amx {

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Whether this process may use the tiles (asked once; a CPU without AMX refuses).
inline bool permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

// Whether the CPU has AMX-BF16 (CPUID leaf 7, EDX bit 22) and the process the tiles.
inline bool bf16_permitted() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    return ((d >> 22) & 1u) != 0 && permitted();
  }();
  return ok;
}

// Tiles 0-7: 16 rows of 64 bytes each.
inline void configure() {
  TileConfig c;
  std::memset(&c, 0, sizeof(c));
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

}  // namespace switchyard_xeon::amx

#endif
