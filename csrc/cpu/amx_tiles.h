// What the two AMX kernels share (quant_amx.cpp: bf16 tiles; quant_int8_amx.cpp: int8 tiles): the
// tile configuration's memory layout (palette 1) and the tile-state request Linux wants first.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pagedserve::cpu::amx {

// _tile_loadconfig's 64-byte operand: per tile register t, rows[t] rows of colsb[t] bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands a process the AMX tile state only on request (arch_prctl); asked once per process.
inline bool request_tile_state() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

}  // namespace pagedserve::cpu::amx
