// e4m3 codes on AVX-512, shared by qrt's fp8 kernels (quantized_cpu.cpp, fp8_pairs_cpu.cpp): the
// table lookup that widens codes to bf16, and the activations' quantization to e4m3 exactly as the
// reference ops compute it. Its loader of bf16 or fp32 activations (and `mask16`) serves the LoRA
// kernel too (lora_cpu.cpp).

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace qrt_fp8 {

// e4m3 -> bf16 by table lookup: vpermi2b looks up the high and the low byte of the bf16 bits of
// each code's magnitude (128 entries, two registers each); the sign bit is or-ed in after.
struct Fp8Tables {
  __m512i hi0, hi1, lo0, lo1;
};

inline Fp8Tables make_fp8_tables() {
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t lo[128];
  for (int code = 0; code < 128; ++code) {
    float value = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(code), c10::Float8_e4m3fn::from_bits()));
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    uint16_t bf16 = static_cast<uint16_t>(bits >> 16);  // exact: e4m3 has 3 mantissa bits
    hi[code] = static_cast<uint8_t>(bf16 >> 8);
    lo[code] = static_cast<uint8_t>(bf16 & 0xFF);
  }
  return {_mm512_load_si512(hi), _mm512_load_si512(hi + 64), _mm512_load_si512(lo), _mm512_load_si512(lo + 64)};
}

inline const Fp8Tables& fp8_tables() {
  static const Fp8Tables tables = make_fp8_tables();
  return tables;
}

// 64 e4m3 codes -> 64 bf16 values in two registers of pairs, in the order unpack gives within each
// 128-bit lane: `a` holds elements 0-7, 16-23, 32-39, 48-55 and `b` elements 8-15, 24-31, 40-47,
// 56-63. The activations are laid out in the same order (permuted_activations), so the dot
// products pair the right elements.
inline void widen_fp8x64(__m512i codes, const Fp8Tables& t, __m512i& a, __m512i& b) {
  __m512i hi = _mm512_permutex2var_epi8(t.hi0, codes, t.hi1);  // index bit 7 (the sign) is ignored
  __m512i lo = _mm512_permutex2var_epi8(t.lo0, codes, t.lo1);
  hi = _mm512_or_si512(hi, _mm512_and_si512(codes, _mm512_set1_epi8(static_cast<char>(0x80))));
  a = _mm512_unpacklo_epi8(lo, hi);
  b = _mm512_unpackhi_epi8(lo, hi);
}

// ---- activation quantization, as the reference ops compute it (fp8_reference.py and friends):
// scale = max(amax / 448, 1 / (448 * 512)) per row and K-block (or the static scale), then
// round_to_e4m3(clamp(x / scale, -448, 448)), rounding to nearest, ties to even.

inline constexpr float kFp8Max = 448.0f;
inline const float kMinScale = static_cast<float>(1.0 / (448.0 * 512.0));

// fp32 values with |v| <= 448 -> the nearest e4m3 values, as fp32. Normal range: the mantissa cut to
// 3 bits with round-half-even on the bits; below 2**-6 (e4m3's subnormals, a fixed step of 2**-9):
// adding and subtracting 1.5 * 2**14, whose ulp is 2**-9, rounds to that step.
inline __m512 round_to_e4m3(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFFF), odd)),
                                           _mm512_set1_epi32(static_cast<int>(0xFFF00000u)));
  const __m512 magnitude = _mm512_abs_ps(v);
  const __m512 magic = _mm512_set1_ps(24576.0f);
  const __m512 stepped = _mm512_sub_ps(_mm512_add_ps(magnitude, magic), magic);
  const __m512 sign = _mm512_and_ps(v, _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0x80000000u))));
  const __mmask16 tiny = _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(tiny, _mm512_castsi512_ps(rounded), _mm512_or_ps(stepped, sign));
}

inline __mmask16 mask16(int64_t remaining) {
  return remaining >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << remaining) - 1);
}

// 16 activations (bf16 or fp32, up to `mask`) as fp32.
inline __m512 load_activations(const void* row, bool bf16, int64_t c, __mmask16 mask) {
  if (bf16) {
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(row) + c);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(row) + c);
}

// x [M, K] (bf16 or fp32, contiguous) -> q [M, K] bf16 bits of the e4m3 values and scales [M, Kb].
inline void quantize_activations(const at::Tensor& x, int64_t block_k, const at::Tensor& input_scale, at::Tensor& q,
                          at::Tensor& scales) {
  const int64_t m_rows = x.size(0), k = x.size(1), k_blocks = (k + block_k - 1) / block_k;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  q = at::empty({m_rows, k}, x.options().dtype(at::kBFloat16));
  scales = at::empty({m_rows, k_blocks}, x.options().dtype(at::kFloat));
  const char* base = static_cast<const char*>(x.data_ptr());
  const int64_t row_bytes = k * x.element_size();
  uint16_t* qb = reinterpret_cast<uint16_t*>(q.data_ptr());
  float* s = scales.data_ptr<float>();
  const bool fixed = input_scale.defined();
  const float fixed_scale = fixed ? input_scale.to(at::kFloat).item<float>() : 0.0f;
  at::parallel_for(0, m_rows, 4, [&](int64_t m_begin, int64_t m_end) {
    const __m512 limit = _mm512_set1_ps(kFp8Max), neg_limit = _mm512_set1_ps(-kFp8Max);
    for (int64_t m = m_begin; m < m_end; ++m) {
      const void* row = base + m * row_bytes;
      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        const int64_t k0 = kb * block_k, k1 = std::min(k, k0 + block_k);
        float scale = fixed_scale;
        if (!fixed) {
          __m512 amax = _mm512_setzero_ps();
          for (int64_t c = k0; c < k1; c += 16) {
            amax = _mm512_max_ps(amax, _mm512_abs_ps(load_activations(row, bf16, c, mask16(k1 - c))));
          }
          scale = std::max(_mm512_reduce_max_ps(amax) / kFp8Max, kMinScale);
        }
        s[m * k_blocks + kb] = scale;
        const __m512 divisor = _mm512_set1_ps(scale);
        for (int64_t c = k0; c < k1; c += 16) {
          const __mmask16 mask = mask16(k1 - c);
          __m512 v = _mm512_div_ps(load_activations(row, bf16, c, mask), divisor);
          v = round_to_e4m3(_mm512_min_ps(_mm512_max_ps(v, neg_limit), limit));
          _mm256_mask_storeu_epi16(qb + m * k + c, mask, (__m256i)_mm512_cvtneps_pbh(v));  // exact
        }
      }
    }
  });
}

}  // namespace qrt_fp8
