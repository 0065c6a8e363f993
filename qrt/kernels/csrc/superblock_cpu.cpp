// qrt's CPU kernel for 4-, 5- and 6-bit weight codes with two levels of scales, as llama.cpp's
// block types store them (Q4_0 ... Q6_K), built with the other sources by qrt/kernels/native_cpu.py
// into the `qrt_cpu` namespace:
//
//   superblock_linear(x [M, K] bf16, codes uint8 [N / 64, K / 2, 64 + 16 (bits - 4)], bits, zero,
//                     sub_scales? int8 [N / 64, K / G, 64], sub_offsets? int8 [N / 64, K / G, 64],
//                     super_scales fp16 [N / 64, K / S, 64], super_offsets? fp16 [N / 64, K / S, 64],
//                     group_size G, bias? [N], min_rows_dequantized) -> [M, N] bf16
//
// W[n, k] = d[n, k / S] * sc[n, k / G] * (q[n, k] - zero) + dmin[n, k / S] * m[n, k / G], where an
// absent sub_scales reads as sc = 1, an absent sub_offsets as m = 1 and an absent super_offsets as
// dmin = 0. So a weight holds its codes at their own width plus the file's small integer group
// scales and its fp16 super-block scales: Q6_K 6.5625 bits a weight, as in the file.
//
// The codes (kernels/superblock_cpu.py writes them): block b holds outputs 64 b .. 64 b + 63; its
// step j is the low nibbles exactly as int4_pairs_cpu.cpp lays them out (32 little-endian 16-bit
// words, word w = 2 i + t holding the code of output 16 c + i at column 2 j + t in nibble c), then
// the high bits of the same 128 codes:
//   - 6 bits: 32 bytes, byte w holding bits 4-5 of word w's code c at bits 2 c, 2 c + 1;
//   - 5 bits: 16 bytes, byte p holding bit 4 of word p's code c at bit c and word p + 16's at bit 4 + c.
// A step widens into four registers of bf16 (128 + q) pairs with two logic instructions a
// register more than the 4-bit one: a shift and a masked or of the high bits beside the nibble's.
//
// Below `min_rows_dequantized` rows each row sums the exact products of the codes with x in fp32 per
// group and adds d * sc * (sum - (128 + zero) * sum(x)) + dmin * m * sum(x) to its total, in the same
// order at any M there, so a row's result does not depend on its batch. From there the weight is
// dequantized to bf16 a tile of outputs at a time for oneDNN's GEMM.

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

using qrt_pairs::kOutputs;        // outputs per block
using qrt_pairs::kPrefetchBytes;  // read-ahead within a block

constexpr int64_t step_bytes(int bits) { return 64 + 16 * (bits - 4); }

// The four registers of a step: bf16 (128 + q) pairs of outputs 16 c .. 16 c + 15 (c = 0 .. 3).
template <int Bits>
inline void widen_step(const uint8_t* step, __m512i v[4]) {
  constexpr int kMaskOr = 0xEA;  // ternary logic (a & b) | c
  const __m512i words = _mm512_loadu_si512(step);
  const __m512i nibble = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
  v[0] = _mm512_ternarylogic_epi32(words, nibble, bias, kMaskOr);
  v[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 4), nibble, bias, kMaskOr);
  v[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 8), nibble, bias, kMaskOr);
  v[3] = _mm512_or_si512(_mm512_srli_epi16(words, 12), bias);
  if constexpr (Bits == 6) {
    const __m512i high = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + 64)));
    const __m512i mask = _mm512_set1_epi16(0x0030);
    v[0] = _mm512_ternarylogic_epi32(_mm512_slli_epi16(high, 4), mask, v[0], kMaskOr);
    v[1] = _mm512_ternarylogic_epi32(_mm512_slli_epi16(high, 2), mask, v[1], kMaskOr);
    v[2] = _mm512_ternarylogic_epi32(high, mask, v[2], kMaskOr);
    v[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(high, 2), mask, v[3], kMaskOr);
  } else if constexpr (Bits == 5) {
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(step + 64)));
    // Words 0-15 hold bytes 0-15 whole (word p's bits in the low nibble), words 16-31 their high nibbles.
    const __m512i high = _mm512_inserti64x4(_mm512_castsi256_si512(bytes), _mm256_srli_epi16(bytes, 4), 1);
    const __m512i mask = _mm512_set1_epi16(0x0010);
    v[0] = _mm512_ternarylogic_epi32(_mm512_slli_epi16(high, 4), mask, v[0], kMaskOr);
    v[1] = _mm512_ternarylogic_epi32(_mm512_slli_epi16(high, 3), mask, v[1], kMaskOr);
    v[2] = _mm512_ternarylogic_epi32(_mm512_slli_epi16(high, 2), mask, v[2], kMaskOr);
    v[3] = _mm512_ternarylogic_epi32(_mm512_slli_epi16(high, 1), mask, v[3], kMaskOr);
  }
}

inline __m512 int8_lanes(const int8_t* values) {  // 16 int8 -> fp32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values))));
}

inline __m512 fp16_lanes(const uint16_t* values) {  // 16 fp16 -> fp32, exactly
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values)));
}

struct Weight {
  const uint8_t* codes;          // [blocks, half_k, step]
  const int8_t* sub_scales;      // [blocks, groups, 64] or null (1)
  const int8_t* sub_offsets;     // [blocks, groups, 64] or null (1)
  const uint16_t* super_scales;  // [blocks, supers, 64] fp16 bits
  const uint16_t* super_offsets; // [blocks, supers, 64] fp16 bits, or null (0)
  int64_t blocks, half_k, step, groups, group_steps, groups_per_super;
  float code_centre;             // 128 + zero: the widened code's bias and the zero point together

  const uint8_t* block_codes(int64_t b) const { return codes + b * half_k * step; }
  int64_t supers() const { return groups / groups_per_super; }
};

// The factors of outputs 16 c .. 16 c + 15 (c = 0 .. 3) of one block: its super-block's fp16 d and
// dmin, loaded once a super-block, and each group's scale d * sc and offset dmin * m from them.
struct BlockFactors {
  __m512 d[4], dmin[4];

  void load_super(const Weight& w, int64_t b, int64_t s) {
    const int64_t at = (b * w.supers() + s) * kOutputs;
    for (int c = 0; c < 4; ++c) {
      d[c] = fp16_lanes(w.super_scales + at + 16 * c);
      dmin[c] = w.super_offsets ? fp16_lanes(w.super_offsets + at + 16 * c) : _mm512_setzero_ps();
    }
  }

  void group(const Weight& w, int64_t b, int64_t g, int c, __m512& scale, __m512& offset) const {
    const int64_t at = (b * w.groups + g) * kOutputs + 16 * c;
    scale = w.sub_scales ? _mm512_mul_ps(d[c], int8_lanes(w.sub_scales + at)) : d[c];
    offset = w.sub_offsets ? _mm512_mul_ps(dmin[c], int8_lanes(w.sub_offsets + at)) : dmin[c];
  }
};

// Rows [m0, m0 + Rows) of x against block b.
template <int Bits, int Rows>
void rows_against_block(const uint16_t* xb, int64_t k, const float* x_sums, const Weight& w, int64_t b, int64_t m0,
                        const float* bias, uint16_t* dst, int64_t n) {
  const uint8_t* block = w.block_codes(b);
  __m512 total[Rows][4];
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < 4; ++c) total[r][c] = _mm512_setzero_ps();
  BlockFactors factors;
  for (int64_t g = 0, s = 0, next_super = 0; g < w.groups; ++g) {
    if (g == next_super) {  // counted, not divided: an integer division per group costs more than its scales
      factors.load_super(w, b, s++);
      next_super += w.groups_per_super;
    }
    __m512 acc[Rows][4];
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t j = g * w.group_steps; j < (g + 1) * w.group_steps; ++j) {
      const uint8_t* step = block + j * step_bytes(Bits);
      _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes, _MM_HINT_T0);
      if constexpr (Bits > 4) _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes + 64, _MM_HINT_T0);
      __m512i v[4];
      widen_step<Bits>(step, v);
      for (int r = 0; r < Rows; ++r) {
        const __m512bh pair = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xb + (m0 + r) * k + 2 * j));
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)v[c], pair);
      }
    }
    for (int c = 0; c < 4; ++c) {
      __m512 scale, offset;
      factors.group(w, b, g, c, scale, offset);
      for (int r = 0; r < Rows; ++r) {
        const float sum = x_sums[(m0 + r) * w.groups + g];
        total[r][c] = _mm512_fmadd_ps(scale, _mm512_sub_ps(acc[r][c], _mm512_set1_ps(w.code_centre * sum)),
                                      _mm512_fmadd_ps(offset, _mm512_set1_ps(sum), total[r][c]));
      }
    }
  }
  qrt_blocks::store_totals<Rows>(total, m0, b, bias, dst, n);
}

// Few rows: every tile of rows against each block (block_rows.h), after each row's sums of x per group.
template <int Bits>
void exact_rows(const at::Tensor& x, const Weight& w, const float* bias, uint16_t* dst) {
  const int64_t m_rows = x.size(0), k = x.size(1), n = w.blocks * kOutputs;
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
  std::vector<float> x_sums(m_rows * w.groups);  // [M, groups]: sum of x per group, in fp32
  for (int64_t m = 0; m < m_rows; ++m) qrt_sums::bf16_group_sums(xb + m * k, k, 2 * w.group_steps, &x_sums[m * w.groups]);
  qrt_blocks::exact_rows(m_rows, w.blocks, [&](auto rows, int64_t b, int64_t m0) {
    rows_against_block<Bits, decltype(rows)::value>(xb, k, x_sums.data(), w, b, m0, bias, dst, n);
  });
}

// Blocks [b0, b0 + blocks) as bf16 columns, dst [K, 64 * blocks] row-major (W^T for a GEMM):
// W = scale * (q - zero) + offset, rounded once. Register c of step j holds output 16 c + i's
// values at columns 2 j, 2 j + 1 in lane i: its even halves go to row 2 j, its odd ones to 2 j + 1.
template <int Bits>
void dequantize_columns(const Weight& w, int64_t b0, int64_t blocks, uint16_t* dst) {
  const int64_t cols = blocks * kOutputs;
  at::parallel_for(0, w.groups, 1, [&](int64_t g_begin, int64_t g_end) {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    const __m512 centre = _mm512_set1_ps(w.code_centre);
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = w.block_codes(b0 + b);
      BlockFactors factors;
      int64_t s = g_begin / w.groups_per_super, next_super = g_begin;  // divided once a run, then counted
      for (int64_t g = g_begin; g < g_end; ++g) {
        if (g == next_super) {
          factors.load_super(w, b0 + b, s);
          next_super = ++s * w.groups_per_super;
        }
        __m512 scale[4], offset[4];
        for (int c = 0; c < 4; ++c) factors.group(w, b0 + b, g, c, scale[c], offset[c]);
        for (int64_t j = g * w.group_steps; j < (g + 1) * w.group_steps; ++j) {
          __m512i v[4];
          widen_step<Bits>(block + j * step_bytes(Bits), v);
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
template <int Bits>
void dequantized_rows(const at::Tensor& x, const Weight& w, const at::Tensor& bias, at::Tensor& out) {
  qrt_blocks::dequantized_rows(x, w.blocks, bias, out, [&](int64_t b0, int64_t count, uint16_t* tile) {
    dequantize_columns<Bits>(w, b0, count, tile);
  });
}

template <int Bits>
void run(const at::Tensor& x, const Weight& w, const std::optional<at::Tensor>& bias, int64_t min_rows_dequantized,
         at::Tensor& out) {
  if (x.size(0) >= min_rows_dequantized) {
    dequantized_rows<Bits>(x, w, bias.has_value() ? bias->to(x.scalar_type()).contiguous() : at::Tensor(), out);
  } else if (x.size(0) > 0) {
    const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
    exact_rows<Bits>(x, w, b.defined() ? b.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(out.data_ptr()));
  }
}

void check_scales(const std::optional<at::Tensor>& t, const char* name, at::ScalarType dtype, int64_t blocks,
                  int64_t count) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->dim() == 3 && t->size(0) == blocks && t->size(1) == count && t->size(2) == kOutputs &&
                  t->scalar_type() == dtype && t->is_contiguous(),
              "qrt_cpu::superblock_linear: contiguous ", name, " [", blocks, ", ", count, ", 64] of ", dtype,
              " expected, got ", t->sizes(), " ", t->scalar_type());
}

at::Tensor superblock_linear(const at::Tensor& x, const at::Tensor& codes, int64_t bits, int64_t zero,
                             const std::optional<at::Tensor>& sub_scales, const std::optional<at::Tensor>& sub_offsets,
                             const at::Tensor& super_scales, const std::optional<at::Tensor>& super_offsets,
                             int64_t group_size, const std::optional<at::Tensor>& bias, int64_t min_rows_dequantized) {
  TORCH_CHECK(bits >= 4 && bits <= 6, "qrt_cpu::superblock_linear: 4-, 5- or 6-bit codes expected, got ", bits);
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == step_bytes(bits) && codes.scalar_type() == at::kByte &&
                  codes.is_contiguous(),
              "qrt_cpu::superblock_linear: contiguous uint8 codes [N / 64, K / 2, ", step_bytes(bits),
              "] expected for ", bits, "-bit codes, got ", codes.sizes(), " ", codes.scalar_type());
  const int64_t blocks = codes.size(0), half_k = codes.size(1), n = blocks * kOutputs, k = 2 * half_k;
  TORCH_CHECK(group_size >= 2 && group_size % 2 == 0 && k % group_size == 0,
              "qrt_cpu::superblock_linear: an even group size dividing K = ", k, " expected, got ", group_size);
  const int64_t groups = k / group_size;
  TORCH_CHECK(super_scales.dim() == 3 && super_scales.size(1) > 0 && groups % super_scales.size(1) == 0,
              "qrt_cpu::superblock_linear: super_scales [N / 64, S, 64] with S dividing the ", groups, " groups expected");
  const int64_t supers = super_scales.size(1);
  check_scales(super_scales, "super_scales", at::kHalf, blocks, supers);
  check_scales(super_offsets, "super_offsets", at::kHalf, blocks, supers);
  check_scales(sub_scales, "sub_scales", at::kChar, blocks, groups);
  check_scales(sub_offsets, "sub_offsets", at::kChar, blocks, groups);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kBFloat16,
              "qrt_cpu::superblock_linear: bf16 x [M, ", k, "] expected, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n),
              "qrt_cpu::superblock_linear: bias [", n, "] expected");
  auto data = [](const std::optional<at::Tensor>& t) -> const void* { return t.has_value() ? t->data_ptr() : nullptr; };
  const Weight w{codes.data_ptr<uint8_t>(),
                 static_cast<const int8_t*>(data(sub_scales)),
                 static_cast<const int8_t*>(data(sub_offsets)),
                 reinterpret_cast<const uint16_t*>(super_scales.data_ptr()),
                 static_cast<const uint16_t*>(data(super_offsets)),
                 blocks, half_k, step_bytes(bits), groups, group_size / 2, groups / supers,
                 128.0f + static_cast<float>(zero)};
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  if (bits == 4) run<4>(xc, w, bias, min_rows_dequantized, out);
  else if (bits == 5) run<5>(xc, w, bias, min_rows_dequantized, out);
  else run<6>(xc, w, bias, min_rows_dequantized, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(qrt_cpu, m) {
  m.def("superblock_linear(Tensor x, Tensor codes, int bits, int zero, Tensor? sub_scales, Tensor? sub_offsets, "
        "Tensor super_scales, Tensor? super_offsets, int group_size, Tensor? bias, int min_rows_dequantized) -> Tensor");
}

TORCH_LIBRARY_IMPL(qrt_cpu, CPU, m) { m.impl("superblock_linear", &superblock_linear); }
