// AMX tile state, shared by the kernels that multiply a prompt's rows in tiles: quant_c16_cpu.cpp (Q4_K, Q6_K) and
// quant_c16_legacy_cpu.cpp (Q4_0).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

// The 64-byte tile configuration (palette 1): each tile's rows and bytes a row. Tile state is per thread.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Whether tile products may run in this process: built with AMX, the system granted the tile state and
// SPECDECODE_AMX is not 0 (defined in quant_c16_cpu.cpp).
bool amx_on();

// At least `count` elements of `buffer`, 64-byte aligned (tile loads want whole lines); the caller's buffer is kept
// from call to call (thread_local where it is).
template <typename U>
U* scratch(std::vector<U>& buffer, size_t count) {
  if (buffer.size() < count + 64) buffer.resize(count + 64);
  return reinterpret_cast<U*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
}

// This thread's scratch for a channel group's unpacked weights: at least `bytes`.
inline uint8_t* tile_scratch(size_t bytes) {
  thread_local std::vector<uint8_t> buffer;
  return scratch(buffer, bytes);
}
