// qrt's CPU kernel for 4-bit codes that index a 16-entry table of values, times a scale per group of
// input channels (bitsandbytes NF4 and FP4, NVFP4, MXFP4), built with the other sources by
// qrt/kernels/native_cpu.py into the `qrt_cpu` namespace:
//
//   lut4_linear(x [M, K] bf16, codes uint8 [N / 64, K / 2, 64], table fp32 [16],
//               scales [N / 64, K / G, 64] (fp32, or uint8 e4m3 / e8m0 bits), scale_format,
//               global_multiplier fp32 [1], group_size G, bias? [N], min_rows_dequantized) -> [M, N] bf16
//
// W[n, k] = table[q[n, k]] * decode(scales[n, k / G]) * global_multiplier. The weight keeps its 4-bit
// codes and its block scales as the checkpoint stores them: NF4 4.5 bits a weight (an fp32 absmax per
// 64), NVFP4 4.5 (an e4m3 scale per 16), MXFP4 4.25 (an e8m0 exponent per 32).
//
// The codes lie as int4_pairs_cpu.cpp lays out integer codes (kernels/lut4_cpu.py writes them):
// block b holds outputs 64 b .. 64 b + 63; its step j is 32 little-endian 16-bit words, word
// w = 2 i + t holding the code of output 16 c + i at column 2 j + t in nibble c. A step widens into
// four registers of bf16 pairs with one shift and one vpermw each: vpermw looks each 16-bit lane up
// in a 32-entry table by the lane's low 5 bits, so the table is held twice (entries 16-31 repeat
// 0-15) and the nibble above the wanted one needs no mask.
//
// The table's values are rounded to bf16 once (exact for E2M1's values; NF4's lose at most 2^-9 of
// their size, as a bf16 copy of the dequantized weight does). Below `min_rows_dequantized` rows each
// row sums the exact products table[q] * x in fp32 per group, then adds the group's scale times that
// sum to its total, in the same order at any M there, so a row's result does not depend on its
// batch. From there the weight is dequantized to bf16 a tile of outputs at a time for oneDNN's GEMM.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "block_rows.h"
#include "pair_gemv.h"

#include <algorithm>
#include <cstring>
#include <optional>

namespace {

using qrt_pairs::kOutputs;        // outputs per block
using qrt_pairs::kPrefetchBytes;  // read-ahead within a block

constexpr int64_t kStepBytes = 64;  // 64 outputs x 2 columns x 4 bits

enum ScaleFormat : int64_t { kFp32 = 0, kE4m3 = 1, kE8m0 = 2 };

// The four registers of a step: bf16 table values of outputs 16 c .. 16 c + 15 (c = 0 .. 3), each
// lane a pair of columns.
inline void widen_step(const uint8_t* step, __m512i table, __m512i v[4]) {
  const __m512i words = _mm512_loadu_si512(step);
  v[0] = _mm512_permutexvar_epi16(words, table);
  v[1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
  v[2] = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 8), table);
  v[3] = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 12), table);
}

// The table as 32 bf16 words, entries 16-31 repeating 0-15, each rounded to nearest even.
inline __m512i bf16_table(const float* table) {
  const __m512 values = _mm512_loadu_ps(table);
  const __m256i half = (__m256i)_mm512_cvtneps_pbh(values);
  return _mm512_inserti64x4(_mm512_castsi256_si512(half), half, 1);
}

// 16 stored scales -> fp32 times the global multiplier. e4m3 goes through fp16: its exponent and
// mantissa bits shifted into fp16's places make 2^-8 of its value (subnormals included, which
// vcvtph2ps converts exactly), so the multiplier carries a factor 256. e8m0's exponent, shifted into
// fp32's, is its value; the packer accepts exponents 1 .. 254 only (0 and 255 are not normal here).
template <int64_t Format>
inline __m512 scale_lanes(const void* scales, int64_t at, __m512 multiplier) {
  if constexpr (Format == kFp32) {
    return _mm512_mul_ps(_mm512_loadu_ps(static_cast<const float*>(scales) + at), multiplier);
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(scales) + at));
    if constexpr (Format == kE4m3) {
      const __m256i wide = _mm256_cvtepu8_epi16(bytes);
      const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x80)), 8),
                                           _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x7F)), 7));
      return _mm512_mul_ps(_mm512_cvtph_ps(half), multiplier);
    } else {
      return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(bytes), 23)), multiplier);
    }
  }
}

struct Weight {
  const uint8_t* codes;  // [blocks, half_k, 64]
  const void* scales;    // [blocks, groups, 64]
  __m512i table;         // bf16, twice
  __m512 multiplier;     // the global multiplier (times 256 for e4m3)
  int64_t blocks, half_k, groups, group_steps;

  const uint8_t* block_codes(int64_t b) const { return codes + b * half_k * kStepBytes; }
  int64_t scale_at(int64_t b, int64_t g, int c) const { return (b * groups + g) * kOutputs + 16 * c; }
};

// Rows [m0, m0 + Rows) of x against block b.
template <int64_t Format, int Rows>
void rows_against_block(const uint16_t* xb, int64_t k, const Weight& w, int64_t b, int64_t m0, const float* bias,
                        uint16_t* dst, int64_t n) {
  const uint8_t* block = w.block_codes(b);
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
      widen_step(step, w.table, v);
      for (int r = 0; r < Rows; ++r) {
        const __m512bh pair = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xb + (m0 + r) * k + 2 * j));
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)v[c], pair);
      }
    }
    for (int c = 0; c < 4; ++c) {
      const __m512 scale = scale_lanes<Format>(w.scales, w.scale_at(b, g, c), w.multiplier);
      for (int r = 0; r < Rows; ++r) total[r][c] = _mm512_fmadd_ps(scale, acc[r][c], total[r][c]);
    }
  }
  qrt_blocks::store_totals<Rows>(total, m0, b, bias, dst, n);
}

// Few rows: every tile of rows against each block (block_rows.h).
template <int64_t Format>
void exact_rows(const at::Tensor& x, const Weight& w, const float* bias, uint16_t* dst) {
  const int64_t k = x.size(1), n = w.blocks * kOutputs;
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
  qrt_blocks::exact_rows(x.size(0), w.blocks, [&](auto rows, int64_t b, int64_t m0) {
    rows_against_block<Format, decltype(rows)::value>(xb, k, w, b, m0, bias, dst, n);
  });
}

// Blocks [b0, b0 + blocks) as bf16 columns, dst [K, 64 * blocks] row-major (W^T for a GEMM),
// W = table[q] * scale rounded once. Register c of step j holds output 16 c + i's values at columns
// 2 j, 2 j + 1 in lane i: its even halves go to row 2 j, its odd ones to 2 j + 1.
template <int64_t Format>
void dequantize_columns(const Weight& w, int64_t b0, int64_t blocks, uint16_t* dst) {
  const int64_t cols = blocks * kOutputs;
  at::parallel_for(0, w.groups, 1, [&](int64_t g_begin, int64_t g_end) {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = w.block_codes(b0 + b);
      for (int64_t g = g_begin; g < g_end; ++g) {
        __m512 scale[4];
        for (int c = 0; c < 4; ++c) scale[c] = scale_lanes<Format>(w.scales, w.scale_at(b0 + b, g, c), w.multiplier);
        for (int64_t j = g * w.group_steps; j < (g + 1) * w.group_steps; ++j) {
          __m512i v[4];
          widen_step(block + j * kStepBytes, w.table, v);
          uint16_t* even_row = dst + 2 * j * cols + b * kOutputs;
          for (int c = 0; c < 4; ++c) {
            const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v[c], 16));
            const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v[c], high));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(even_row + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(even, scale[c])));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(even_row + cols + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(odd, scale[c])));
          }
        }
      }
    }
  });
}

template <int64_t Format>
void run(const at::Tensor& x, const Weight& w, const std::optional<at::Tensor>& bias, int64_t min_rows_dequantized,
         at::Tensor& out) {
  if (x.size(0) >= min_rows_dequantized) {
    const at::Tensor b = bias.has_value() ? bias->to(x.scalar_type()).contiguous() : at::Tensor();
    qrt_blocks::dequantized_rows(x, w.blocks, b, out, [&](int64_t b0, int64_t count, uint16_t* tile) {
      dequantize_columns<Format>(w, b0, count, tile);
    });
  } else if (x.size(0) > 0) {
    const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
    exact_rows<Format>(x, w, b.defined() ? b.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(out.data_ptr()));
  }
}

at::Tensor lut4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& table, const at::Tensor& scales,
                       int64_t scale_format, const at::Tensor& global_multiplier, int64_t group_size,
                       const std::optional<at::Tensor>& bias, int64_t min_rows_dequantized) {
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == kStepBytes && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "qrt_cpu::lut4_linear: contiguous uint8 codes [N / 64, K / 2, 64] expected, got ", codes.sizes(), " ",
              codes.scalar_type());
  const int64_t blocks = codes.size(0), half_k = codes.size(1), n = blocks * kOutputs, k = 2 * half_k;
  TORCH_CHECK(group_size >= 2 && group_size % 2 == 0 && k % group_size == 0,
              "qrt_cpu::lut4_linear: an even group size dividing K = ", k, " expected, got ", group_size);
  const int64_t groups = k / group_size;
  TORCH_CHECK(scale_format == kFp32 || scale_format == kE4m3 || scale_format == kE8m0,
              "qrt_cpu::lut4_linear: scale format 0 (fp32), 1 (e4m3) or 2 (e8m0) expected, got ", scale_format);
  const at::ScalarType scale_dtype = scale_format == kFp32 ? at::kFloat : at::kByte;
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == blocks && scales.size(1) == groups && scales.size(2) == kOutputs &&
                  scales.scalar_type() == scale_dtype && scales.is_contiguous(),
              "qrt_cpu::lut4_linear: contiguous scales [", blocks, ", ", groups, ", 64] of ", scale_dtype,
              " expected, got ", scales.sizes(), " ", scales.scalar_type());
  TORCH_CHECK(table.numel() == 16 && table.scalar_type() == at::kFloat && table.is_contiguous(),
              "qrt_cpu::lut4_linear: a contiguous fp32 table of 16 values expected");
  TORCH_CHECK(global_multiplier.numel() == 1 && global_multiplier.scalar_type() == at::kFloat,
              "qrt_cpu::lut4_linear: an fp32 global multiplier of one value expected");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kBFloat16,
              "qrt_cpu::lut4_linear: bf16 x [M, ", k, "] expected, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n), "qrt_cpu::lut4_linear: bias [", n,
              "] expected");
  const float multiplier = global_multiplier.item<float>() * (scale_format == kE4m3 ? 256.0f : 1.0f);
  const Weight w{codes.data_ptr<uint8_t>(), scales.data_ptr(), bf16_table(table.data_ptr<float>()),
                 _mm512_set1_ps(multiplier), blocks, half_k, groups, group_size / 2};
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  if (scale_format == kFp32) run<kFp32>(xc, w, bias, min_rows_dequantized, out);
  else if (scale_format == kE4m3) run<kE4m3>(xc, w, bias, min_rows_dequantized, out);
  else run<kE8m0>(xc, w, bias, min_rows_dequantized, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(qrt_cpu, m) {
  m.def("lut4_linear(Tensor x, Tensor codes, Tensor table, Tensor scales, int scale_format, Tensor global_multiplier, "
        "int group_size, Tensor? bias, int min_rows_dequantized) -> Tensor");
}

TORCH_LIBRARY_IMPL(qrt_cpu, CPU, m) { m.impl("lut4_linear", &lut4_linear); }
