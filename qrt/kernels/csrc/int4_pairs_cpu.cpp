// qrt's CPU kernel for 4-bit weight-only linears in groups along K, built with quantized_cpu.cpp
// by qrt/kernels/native_cpu.py into the `qrt_cpu` namespace:
//
//   int4_pairs_linear(x [M, K] bf16, packed uint8 [N / 64, K / 2, 64], scale_offsets bf16
//                     [N / 64, K / g, 64, 2], group_size g, bias? [N], min_rows_dequantized)
//     -> [M, N] bf16
//
// W[n, k] = (q[n, k] - 8) * scale[n, k / g] + offset[n, k / g], as ATen's int4 CPU kernel defines it.
//
// The layout (kernels/int4_pairs_cpu.py writes it): block b holds outputs 64 b .. 64 b + 63; its
// step j, 64 bytes, is 32 little-endian 16-bit words, word 2 i + t holding in its four nibbles
// (low first) the codes q[64 b + 16 c + i, 2 j + t] for c = 0 .. 3. So one mask, or a shift and a
// mask, puts the nibbles c of every word in the low bits of its 16, and an or with 0x4300 makes
// each the bf16 value 128 + q, exactly: register c then holds, in 32-bit lane i, the pair of
// outputs 16 c + i at columns 2 j and 2 j + 1, in order, ready for vdpbf16ps against the pair
// (x[2 j], x[2 j + 1]). That is seven instructions to widen 128 codes, where ATen's pack (two
// columns unpacked byte by byte, then each byte's nibbles split and unpacked with 0x43) took ten.
// A block's group scales sit together, [K / g, 64, 2], so they are read front to back too.
//
// Below `min_rows_dequantized` rows (decode steps, small batches): each tile of up to 4 rows against
// each block, the products exact, summed in fp32 per group, and each group adding
// scale * (sum - 136 * sum(x)) + offset * sum(x) to the output's total. A row's arithmetic is the
// same at any M below the threshold, so its result does not depend on its batch. From there
// (prompts): the weight dequantized to bf16 (W rounded once) a tile at a time, and oneDNN's GEMM.

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

using qrt_pairs::kOutputs;        // outputs per block, as in the pair GEMV (pair_gemv.h)
using qrt_pairs::kPrefetchBytes;  // read-ahead within a block
constexpr int64_t kStepBytes = 64;  // one step: 64 outputs x 2 columns x 4 bits

// The four registers of a step: bf16 (128 + q) pairs of outputs 16 c .. 16 c + 15 (c = 0 .. 3).
inline void widen_step(const uint8_t* step, __m512i v[4]) {
  const __m512i words = _mm512_loadu_si512(step);
  const __m512i nibble = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
  constexpr int kMaskOr = 0xEA;  // ternary logic (a & b) | c
  v[0] = _mm512_ternarylogic_epi32(words, nibble, bias, kMaskOr);
  v[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 4), nibble, bias, kMaskOr);
  v[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 8), nibble, bias, kMaskOr);
  v[3] = _mm512_or_si512(_mm512_srli_epi16(words, 12), bias);
}

// The scales and offsets of outputs 16 c .. 16 c + 15 for one group, from their bf16 pairs.
inline void group_scales(const uint16_t* pairs, __m512& scale, __m512& offset) {
  const __m512i bits = _mm512_loadu_si512(pairs);  // (scale, offset) of 16 outputs
  scale = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
  offset = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

struct Int4Weight {
  const uint8_t* codes;     // [blocks, half_k, 64]
  const uint16_t* scales;   // [blocks, groups, 64, 2] bf16 bits
  int64_t blocks, half_k, groups, group_steps;

  const uint8_t* block_codes(int64_t b) const { return codes + b * half_k * kStepBytes; }
  const uint16_t* block_scales(int64_t b) const { return scales + b * groups * kOutputs * 2; }
};

// Rows [m0, m0 + Rows) of x against block b: per group, the exact products of the codes (as
// bf16 128 + q) with each row's pairs summed in fp32, then out += scale * (sum - 136 * sum(x))
// + offset * sum(x). Each row's arithmetic is the same whatever the other rows of its tile.
template <int Rows>
void rows_against_block(const uint16_t* xb, int64_t k, const float* x_sums, const Int4Weight& w, int64_t b,
                        int64_t m0, const float* bias, uint16_t* dst, int64_t n) {
  const uint8_t* block = w.block_codes(b);
  const uint16_t* scales = w.block_scales(b);
  __m512 total[Rows][4];
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < 4; ++c) total[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    __m512 acc[Rows][4];
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t j = g * w.group_steps; j < (g + 1) * w.group_steps; ++j) {
      const uint8_t* step = block + j * kStepBytes;
      _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes, _MM_HINT_T0);
      __m512i v[4];
      widen_step(step, v);
      for (int r = 0; r < Rows; ++r) {
        const __m512bh pair = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xb + (m0 + r) * k + 2 * j));
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)v[c], pair);
      }
    }
    for (int c = 0; c < 4; ++c) {
      __m512 scale, offset;
      group_scales(scales + (g * kOutputs + 16 * c) * 2, scale, offset);
      for (int r = 0; r < Rows; ++r) {
        const float sum = x_sums[(m0 + r) * w.groups + g];
        total[r][c] = _mm512_fmadd_ps(scale, _mm512_sub_ps(acc[r][c], _mm512_set1_ps(136.0f * sum)),
                                      _mm512_fmadd_ps(offset, _mm512_set1_ps(sum), total[r][c]));
      }
    }
  }
  qrt_blocks::store_totals<Rows>(total, m0, b, bias, dst, n);
}

// Few rows: every tile of rows against each block (block_rows.h), after each row's sums of x per group.
void exact_rows(const at::Tensor& x, const Int4Weight& w, const float* bias, uint16_t* dst) {
  const int64_t m_rows = x.size(0), k = x.size(1), n = w.blocks * kOutputs;
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
  std::vector<float> x_sums(m_rows * w.groups);  // [M, groups]: sum of x per group, in fp32
  for (int64_t m = 0; m < m_rows; ++m) qrt_sums::bf16_group_sums(xb + m * k, k, 2 * w.group_steps, &x_sums[m * w.groups]);
  qrt_blocks::exact_rows(m_rows, w.blocks, [&](auto rows, int64_t b, int64_t m0) {
    rows_against_block<decltype(rows)::value>(xb, k, x_sums.data(), w, b, m0, bias, dst, n);
  });
}

// Blocks [b0, b0 + blocks) as bf16 columns, dst [K, 64 * blocks] row-major (what a GEMM reads
// as W^T with no transpose): W = (q - 8) * scale + offset, rounded once. In step j, register c
// holds output 16 c + i's values at columns 2 j, 2 j + 1 in lane i, so its even halves are 16
// adjacent values of row 2 j of dst and its odd halves 16 of row 2 j + 1. Threads take groups.
void dequantize_columns(const Int4Weight& w, int64_t b0, int64_t blocks, uint16_t* dst) {
  const int64_t cols = blocks * kOutputs;
  at::parallel_for(0, w.groups, 1, [&](int64_t g_begin, int64_t g_end) {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    const __m512 centre = _mm512_set1_ps(136.0f);  // bf16 (128 + q) - 136 = q - 8
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = w.block_codes(b0 + b);
      const uint16_t* scales = w.block_scales(b0 + b);
      for (int64_t g = g_begin; g < g_end; ++g) {
        __m512 scale[4], offset[4];
        for (int c = 0; c < 4; ++c) group_scales(scales + (g * kOutputs + 16 * c) * 2, scale[c], offset[c]);
        for (int64_t j = g * w.group_steps; j < (g + 1) * w.group_steps; ++j) {
          __m512i v[4];
          widen_step(block + j * kStepBytes, v);
          uint16_t* even_row = dst + 2 * j * cols + b * kOutputs;
          for (int c = 0; c < 4; ++c) {
            const __m512 even = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v[c], 16)), centre);
            const __m512 odd = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_and_si512(v[c], high)), centre);
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
void dequantized_rows(const at::Tensor& x, const Int4Weight& w, const at::Tensor& bias, at::Tensor& out) {
  qrt_blocks::dequantized_rows(x, w.blocks, bias, out, [&](int64_t b0, int64_t count, uint16_t* tile) {
    dequantize_columns(w, b0, count, tile);
  });
}

at::Tensor int4_pairs_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_offsets,
                             int64_t group_size, const std::optional<at::Tensor>& bias, int64_t min_rows_dequantized) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kStepBytes && packed.scalar_type() == at::kByte &&
                  packed.is_contiguous(),
              "qrt_cpu::int4_pairs_linear: contiguous uint8 codes [N / 64, K / 2, 64] expected, got ", packed.sizes(),
              " ", packed.scalar_type());
  const int64_t blocks = packed.size(0), half_k = packed.size(1), n = blocks * kOutputs, k = 2 * half_k;
  TORCH_CHECK(group_size >= 2 && group_size % 2 == 0 && k % group_size == 0,
              "qrt_cpu::int4_pairs_linear: an even group size dividing K = ", k, " expected, got ", group_size);
  const int64_t groups = k / group_size;
  TORCH_CHECK(scale_offsets.dim() == 4 && scale_offsets.size(0) == blocks && scale_offsets.size(1) == groups &&
                  scale_offsets.size(2) == kOutputs && scale_offsets.size(3) == 2 &&
                  scale_offsets.scalar_type() == at::kBFloat16 && scale_offsets.is_contiguous(),
              "qrt_cpu::int4_pairs_linear: contiguous bf16 scale_offsets [", blocks, ", ", groups,
              ", 64, 2] expected, got ", scale_offsets.sizes(), " ", scale_offsets.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kBFloat16,
              "qrt_cpu::int4_pairs_linear: bf16 x [M, ", k, "] expected, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n),
              "qrt_cpu::int4_pairs_linear: bias [", n, "] expected");
  const at::Tensor xc = x.contiguous();
  const Int4Weight w{packed.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scale_offsets.data_ptr()), blocks,
                     half_k, groups, group_size / 2};
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
  m.def("int4_pairs_linear(Tensor x, Tensor packed, Tensor scale_offsets, int group_size, Tensor? bias, "
        "int min_rows_dequantized) -> Tensor");
}

TORCH_LIBRARY_IMPL(qrt_cpu, CPU, m) { m.impl("int4_pairs_linear", &int4_pairs_linear); }
