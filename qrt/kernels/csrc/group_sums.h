// Per-group sums of a bf16 activation row, shared by the kernels on codes in groups: each adds a
// group's offset times sum(x) to its sums (quantized_cpu.cpp's GEMV on ATen's pack,
// int4_pairs_cpu.cpp, int8_groups_cpu.cpp), and the 4-bit ones, which multiply bf16 (128 + q) codes
// exactly, also correct each group's sum by -136 * sum(x). Both need sum(x) per group in fp32.

#pragma once

#include <cstdint>
#include <cstring>

namespace qrt_sums {

// sums[g] = x[g * group_size] + ... + x[(g + 1) * group_size - 1], in fp32, in order along K.
inline void bf16_group_sums(const uint16_t* x, int64_t k, int64_t group_size, float* sums) {
  for (int64_t g = 0; g < k / group_size; ++g) sums[g] = 0.0f;
  for (int64_t kk = 0; kk < k; ++kk) {
    const uint32_t bits = static_cast<uint32_t>(x[kk]) << 16;
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    sums[kk / group_size] += value;
  }
}

}  // namespace qrt_sums
