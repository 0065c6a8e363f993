// What the kernels on codes in groups, in blocks of 64 outputs, share (int4_pairs_cpu.cpp,
// int8_groups_cpu.cpp, superblock_cpu.cpp, lut4_cpu.cpp): the loop of the few-rows route over
// blocks and tiles of rows, the store of a row tile's fp32 totals as bf16, and the route for many
// rows, where the weight is dequantized to bf16 a tile of blocks at a time for oneDNN's GEMM.

#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "pair_gemv.h"

namespace qrt_blocks {

using qrt_pairs::kOutputs;
using qrt_pairs::kRowsPerTile;

// A tile of `rows` (1 .. Rows) rows from m0 against block b, as the kernel's
// `block_rows(std::integral_constant<int, R>, b, m0)` takes R rows: the row count a template
// argument, so each tile size gets its own unrolled loop and accumulators.
template <int Rows, class BlockRows>
inline void tile_against_block(BlockRows& block_rows, int64_t b, int64_t m0, int64_t rows) {
  if constexpr (Rows > 1) {
    if (rows < Rows) return tile_against_block<Rows - 1>(block_rows, b, m0, rows);
  }
  block_rows(std::integral_constant<int, Rows>{}, b, m0);
}

// Few rows: every tile of kRowsPerTile rows of the M rows against each of `blocks` blocks, each
// thread taking a run of blocks, so a block's codes are read from memory once for all the tiles.
template <class BlockRows>
inline void all_tiles_against_block(int64_t m_rows, int64_t b, BlockRows& block_rows) {
  for (int64_t m0 = 0; m0 < m_rows; m0 += kRowsPerTile)
    tile_against_block<kRowsPerTile>(block_rows, b, m0, std::min<int64_t>(kRowsPerTile, m_rows - m0));
}

template <class BlockRows>
void exact_rows(int64_t m_rows, int64_t blocks, BlockRows&& block_rows) {
  at::parallel_for(0, blocks, 1, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) all_tiles_against_block(m_rows, b, block_rows);
  });
}

// Rows [m0, m0 + Rows) of block b: total[r][c] holds outputs 64 b + 16 c .. + 15 of row m0 + r in
// fp32; plus the fp32 bias (or none), rounded to bf16 into dst [M, n].
template <int Rows>
inline void store_totals(const __m512 (&total)[Rows][4], int64_t m0, int64_t b, const float* bias, uint16_t* dst,
                         int64_t n) {
  for (int r = 0; r < Rows; ++r) {
    for (int c = 0; c < 4; ++c) {
      const int64_t n0 = b * kOutputs + 16 * c;
      __m512 value = total[r][c];
      if (bias) value = _mm512_add_ps(value, _mm512_loadu_ps(bias + n0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (m0 + r) * n + n0), (__m256i)_mm512_cvtneps_pbh(value));
    }
  }
}

// Many rows: x [M, K] bf16 against `blocks` blocks -> out [M, 64 blocks]. dequantize(b0, count,
// tile) writes blocks [b0, b0 + count) as bf16 columns, tile [K, 64 count] row-major (what a GEMM
// reads as W^T with no transpose). Tiles of about 4 MiB, in a buffer kept from call to call (a
// fresh one page-faults on every call), each multiplied by oneDNN while it is in the last-level
// cache. bias: [N] in x's dtype, or undefined.
template <class Dequantize>
void dequantized_rows(const at::Tensor& x, int64_t blocks, const at::Tensor& bias, at::Tensor& out,
                      Dequantize&& dequantize) {
  const int64_t k = x.size(1);
  const int64_t tile_blocks = std::max<int64_t>(1, (int64_t{4} << 20) / (kOutputs * k * 2));
  thread_local std::vector<uint16_t> buffer;
  buffer.resize(std::min(tile_blocks, blocks) * kOutputs * k);
  uint16_t* tile = buffer.data();
  for (int64_t b0 = 0; b0 < blocks; b0 += tile_blocks) {
    const int64_t count = std::min(tile_blocks, blocks - b0), cols = count * kOutputs;
    dequantize(b0, count, tile);
    const at::Tensor weight_t = at::from_blob(tile, {k, cols}, x.options());  // [K, cols]
    at::Tensor part = out.narrow(1, b0 * kOutputs, cols);
    if (bias.defined()) {
      part.copy_(at::addmm(bias.narrow(0, b0 * kOutputs, cols), x, weight_t));
    } else {
      part.copy_(at::mm(x, weight_t));
    }
  }
}

}  // namespace qrt_blocks
