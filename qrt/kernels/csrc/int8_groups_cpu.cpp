// qrt's CPU kernel for byte-wide integer codes with a scale and an offset per group along K (GPTQ
// 8-bit in groups; codes of fewer bits stored a byte each), built with the others by
// qrt/kernels/native_cpu.py into the `qrt_cpu` namespace:
//
//   int8_groups_linear(x [M, K] bf16, packed int8 [N / 64, K / 2, 64, 2], scale_offsets bf16
//                      [N / 64, K / g, 64, 2], bias? [N], min_rows_dequantized) -> [M, N] bf16
//
// W[n, k] = c[n, k] * scale[n, k / g] + offset[n, k / g], c the stored signed code (the loader
// subtracts a centre from the unsigned codes, kernels/int8_groups_cpu.py). The group size g is
// K / scale_offsets.size(1). The codes lie in the pair layout of pair_gemv.h, widened to bf16 as
// the int8 per-channel kernel widens them (Int8Source, exact); a block's (scale, offset) pairs lie
// together, group after group, as in int4_pairs_cpu.cpp.
//
// Below `min_rows_dequantized` rows (decode steps, small batches): each tile of up to 4 rows against
// each block, the products exact, summed in fp32 per group, each group adding scale * sum + offset
// * sum(x) to the output's total. Up to 4 rows the codes are widened in registers; from 5, each
// block is widened once into a bf16 block that every tile reads from L2. Both widenings are exact
// and the order of a row's sums is fixed, so a row's result does not depend on its batch. From
// `min_rows_dequantized` (prompts): the weight dequantized to bf16 (W rounded once) a tile at a
// time, and oneDNN's GEMM.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "block_rows.h"
#include "group_sums.h"
#include "pair_gemv.h"

#include <algorithm>
#include <optional>
#include <vector>

namespace {

using qrt_pairs::Bf16Source;
using qrt_pairs::Int8Source;
using qrt_pairs::kOutputs;        // outputs per block
using qrt_pairs::kPrefetchBytes;  // read-ahead within a block
using qrt_pairs::kRowsPerTile;    // 16 accumulators
constexpr int64_t kStepElements = kOutputs * 2;  // one step: 64 outputs x 2 columns

// The scales and offsets of outputs 16 c .. 16 c + 15 for one group, from their bf16 pairs.
inline void group_scales(const uint16_t* pairs, __m512& scale, __m512& offset) {
  const __m512i bits = _mm512_loadu_si512(pairs);  // (scale, offset) of 16 outputs
  scale = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
  offset = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

struct GroupedWeight {
  const int8_t* codes;     // [blocks, half_k, 64, 2]
  const uint16_t* scales;  // [blocks, groups, 64, 2] bf16 bits
  int64_t blocks, half_k, groups, group_steps;

  const int8_t* block_codes(int64_t b) const { return codes + b * half_k * kStepElements; }
  const uint16_t* block_scales(int64_t b) const { return scales + b * groups * kStepElements; }
};

// Rows [m0, m0 + Rows) of x against block b, whose steps `Source` reads from `block` (the packed
// codes, or the block widened to bf16): per group, the exact products summed in fp32, then
// out += scale * sum + offset * sum(x). Each row's arithmetic is the same whatever its tile.
template <int Rows, class Source>
void rows_against_block(const uint16_t* xb, int64_t k, const float* x_sums, const typename Source::Element* block,
                        const GroupedWeight& w, int64_t b, int64_t m0, const float* bias, uint16_t* dst, int64_t n) {
  constexpr int64_t step_bytes = kStepElements * sizeof(typename Source::Element);
  const uint16_t* scales = w.block_scales(b);
  __m512 total[Rows][4];
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < 4; ++c) total[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    __m512 acc[Rows][4];
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t j = g * w.group_steps; j < (g + 1) * w.group_steps; ++j) {
      const typename Source::Element* step = block + j * kStepElements;
      for (int64_t line = 0; line < step_bytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes + line, _MM_HINT_T0);
      __m512i v[4];
      Source::load(step, v);
      for (int r = 0; r < Rows; ++r) {
        const __m512bh pair = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xb + (m0 + r) * k + 2 * j));
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)v[c], pair);
      }
    }
    for (int c = 0; c < 4; ++c) {
      __m512 scale, offset;
      group_scales(scales + (g * kOutputs + 16 * c) * 2, scale, offset);
      for (int r = 0; r < Rows; ++r) {
        const __m512 sum = _mm512_set1_ps(x_sums[(m0 + r) * w.groups + g]);
        total[r][c] = _mm512_fmadd_ps(scale, acc[r][c], _mm512_fmadd_ps(offset, sum, total[r][c]));
      }
    }
  }
  qrt_blocks::store_totals<Rows>(total, m0, b, bias, dst, n);
}

// Few rows: every tile of rows against each block (block_rows.h), each thread taking a run of blocks.
void exact_rows(const at::Tensor& x, const GroupedWeight& w, const float* bias, uint16_t* dst) {
  const int64_t m_rows = x.size(0), k = x.size(1), n = w.blocks * kOutputs;
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
  std::vector<float> x_sums(m_rows * w.groups);  // [M, groups]: sum of x per group, in fp32
  for (int64_t m = 0; m < m_rows; ++m)
    qrt_sums::bf16_group_sums(xb + m * k, k, 2 * w.group_steps, &x_sums[m * w.groups]);
  // Widening costs more than a tile's products: past one tile, once per block rather than per tile.
  const bool widen_once = m_rows > kRowsPerTile;
  at::parallel_for(0, w.blocks, 1, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      if (!widen_once) {
        const int8_t* codes = w.block_codes(b);
        auto from_codes = [&](auto rows, int64_t block, int64_t m0) {
          rows_against_block<decltype(rows)::value, Int8Source>(xb, k, x_sums.data(), codes, w, block, m0, bias, dst, n);
        };
        qrt_blocks::all_tiles_against_block(m_rows, b, from_codes);
        continue;
      }
      thread_local std::vector<uint16_t> widened;  // [half_k, 64, 2] bf16 bits, kept from block to block
      widened.resize(w.half_k * kStepElements);
      for (int64_t j = 0; j < w.half_k; ++j) {
        __m512i v[4];
        Int8Source::load(w.block_codes(b) + j * kStepElements, v);
        for (int c = 0; c < 4; ++c) _mm512_storeu_si512(widened.data() + j * kStepElements + 32 * c, v[c]);
      }
      auto from_widened = [&](auto rows, int64_t block, int64_t m0) {
        rows_against_block<decltype(rows)::value, Bf16Source>(xb, k, x_sums.data(), widened.data(), w, block, m0, bias,
                                                              dst, n);
      };
      qrt_blocks::all_tiles_against_block(m_rows, b, from_widened);
    }
  });
}

// Blocks [b0, b0 + blocks) as bf16 columns, dst [K, 64 * blocks] row-major (what a GEMM reads as
// W^T with no transpose): W = c * scale + offset, rounded once. In step j, register c holds output
// 16 c + i's codes at columns 2 j, 2 j + 1 in lane i, so its even halves are 16 adjacent values of
// row 2 j of dst and its odd halves 16 of row 2 j + 1. Threads take groups.
void dequantize_columns(const GroupedWeight& w, int64_t b0, int64_t blocks, uint16_t* dst) {
  const int64_t cols = blocks * kOutputs;
  at::parallel_for(0, w.groups, 1, [&](int64_t g_begin, int64_t g_end) {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t b = 0; b < blocks; ++b) {
      const int8_t* block = w.block_codes(b0 + b);
      const uint16_t* scales = w.block_scales(b0 + b);
      for (int64_t g = g_begin; g < g_end; ++g) {
        __m512 scale[4], offset[4];
        for (int c = 0; c < 4; ++c) group_scales(scales + (g * kOutputs + 16 * c) * 2, scale[c], offset[c]);
        for (int64_t j = g * w.group_steps; j < (g + 1) * w.group_steps; ++j) {
          __m512i v[4];
          Int8Source::load(block + j * kStepElements, v);
          uint16_t* even_row = dst + 2 * j * cols + b * kOutputs;
          for (int c = 0; c < 4; ++c) {
            const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v[c], 16));
            const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v[c], high));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(even_row + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(even, scale[c], offset[c])));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(even_row + cols + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(odd, scale[c], offset[c])));
          }
        }
      }
    }
  });
}

// Many rows: the weight dequantized a tile of blocks at a time for oneDNN's GEMM (block_rows.h).
void dequantized_rows(const at::Tensor& x, const GroupedWeight& w, const at::Tensor& bias, at::Tensor& out) {
  qrt_blocks::dequantized_rows(x, w.blocks, bias, out, [&](int64_t b0, int64_t count, uint16_t* tile) {
    dequantize_columns(w, b0, count, tile);
  });
}

at::Tensor int8_groups_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_offsets,
                              const std::optional<at::Tensor>& bias, int64_t min_rows_dequantized) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kOutputs && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kChar && packed.is_contiguous(),
              "qrt_cpu::int8_groups_linear: contiguous int8 codes [N / 64, K / 2, 64, 2] expected, got ",
              packed.sizes(), " ", packed.scalar_type());
  const int64_t blocks = packed.size(0), half_k = packed.size(1), n = blocks * kOutputs, k = 2 * half_k;
  TORCH_CHECK(scale_offsets.dim() == 4 && scale_offsets.size(0) == blocks && scale_offsets.size(1) > 0 &&
                  half_k % scale_offsets.size(1) == 0 && scale_offsets.size(2) == kOutputs &&
                  scale_offsets.size(3) == 2 && scale_offsets.scalar_type() == at::kBFloat16 &&
                  scale_offsets.is_contiguous(),
              "qrt_cpu::int8_groups_linear: contiguous bf16 scale_offsets [", blocks,
              ", groups of an even size dividing K = ", k, ", 64, 2] expected, got ", scale_offsets.sizes(), " ",
              scale_offsets.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kBFloat16,
              "qrt_cpu::int8_groups_linear: bf16 x [M, ", k, "] expected, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n),
              "qrt_cpu::int8_groups_linear: bias [", n, "] expected");
  const int64_t groups = scale_offsets.size(1);
  const at::Tensor xc = x.contiguous();
  const GroupedWeight w{packed.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(scale_offsets.data_ptr()),
                        blocks, half_k, groups, half_k / groups};
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) >= min_rows_dequantized) {
    dequantized_rows(xc, w, bias.has_value() ? bias->to(x.scalar_type()).contiguous() : at::Tensor(), out);
  } else if (x.size(0) > 0) {
    const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
    exact_rows(xc, w, b.defined() ? b.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(out.data_ptr()));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(qrt_cpu, m) {
  m.def("int8_groups_linear(Tensor x, Tensor packed, Tensor scale_offsets, Tensor? bias, int min_rows_dequantized) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(qrt_cpu, CPU, m) { m.impl("int8_groups_linear", &int8_groups_linear); }
