// The GEMV loop shared by qrt's CPU kernels on weights packed in pairs (dense_bf16_cpu.cpp,
// int8_pairs_cpu.cpp, fp8_pairs_cpu.cpp), and the int8 widening int8_groups_cpu.cpp uses too.
//
// The layout: a weight W [N, K] stored as [N / 64, K / 2, 64, 2], element (b, j, d, t) =
// W[64 b + d, 2 j + t]. One step of the loop reads one (b, j): the pairs (W[n, 2j], W[n, 2j + 1])
// of 64 consecutive outputs, contiguous, which a Source turns into four registers of bf16 pairs for
// vdpbf16ps against a broadcast pair of x. So the outputs lie across the vector lanes and nothing
// is summed horizontally.
//
// Each packed block (64 outputs) is read from memory once and then by every tile of kRowsPerTile
// activation rows, while it is still in L2. Exact products are summed in fp32 in one fixed order
// per output, so a row's result does not depend on the other rows of its batch.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace qrt_pairs {

constexpr int64_t kOutputs = 64;          // outputs per packed block (4 registers of 16 fp32 sums)
constexpr int kRowsPerTile = 4;           // activation rows per pass over a block: 16 accumulators
constexpr int64_t kPrefetchBytes = 4096;  // read-ahead within a block, as the other GEMVs

// bf16 pairs as stored: a step is 256 bytes, loaded as they are.
struct Bf16Source {
  using Element = uint16_t;
  static void load(const Element* step, __m512i w[4]) {
    for (int d = 0; d < 4; ++d) w[d] = _mm512_loadu_si512(step + 32 * d);  // outputs 16 d .. 16 d + 15
  }
};

// int8 pairs, 128 bytes a step: 32 bytes (16 outputs' pairs) per register, widened to fp32 in two
// halves and packed to bf16 (exact: an int8 value has at most 8 significant bits, as bf16). cvtne2ps
// puts its second operand in the low 16 words, so lanes 0-7 hold the first 8 outputs' pairs and
// lanes 8-15 the next 8: the outputs stay in order.
struct Int8Source {
  using Element = int8_t;
  static void load(const Element* step, __m512i w[4]) {
    for (int d = 0; d < 4; ++d) {
      const __m128i* codes = reinterpret_cast<const __m128i*>(step + 32 * d);
      const __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(codes)));
      const __m512 second = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(codes + 1)));
      w[d] = (__m512i)_mm512_cvtne2ps_pbh(second, first);
    }
  }
};

// How the sums of 16 outputs of row m become bf16 in `out`: times a per-row scale (or none), times
// a per-output scale (bf16 or fp32, or none), plus a per-output fp32 bias (or none).
struct Epilogue {
  const float* row_scales = nullptr;      // [M]
  const uint16_t* bf16_scales = nullptr;  // [N] bf16 bits
  const float* fp32_scales = nullptr;     // [N]
  const float* bias = nullptr;            // [N]

  void store(__m512 sums, int64_t m, int64_t n0, uint16_t* dst) const {
    if (row_scales) sums = _mm512_mul_ps(sums, _mm512_set1_ps(row_scales[m]));
    if (bf16_scales) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bf16_scales + n0));
      sums = _mm512_mul_ps(sums, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
    } else if (fp32_scales) {
      sums = _mm512_mul_ps(sums, _mm512_loadu_ps(fp32_scales + n0));
    }
    if (bias) sums = _mm512_add_ps(sums, _mm512_loadu_ps(bias + n0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(sums));
  }
};

// Rows [m0, m0 + Rows) of x (as bf16 pairs, [M, K / 2]) against one packed block (outputs
// [64 b, 64 b + 64)), written into out [M, N].
template <int Rows, class Source>
void gemv_block(const uint32_t* x_pairs, int64_t half_k, const typename Source::Element* block, int64_t b,
                const Epilogue& epilogue, uint16_t* out, int64_t n, int64_t m0) {
  constexpr int64_t step_elements = kOutputs * 2;
  constexpr int64_t step_bytes = step_elements * sizeof(typename Source::Element);
  __m512 acc[Rows][4];
  for (int r = 0; r < Rows; ++r) {
    for (int d = 0; d < 4; ++d) acc[r][d] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < half_k; ++j) {
    const typename Source::Element* step = block + j * step_elements;
    for (int64_t line = 0; line < step_bytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes + line, _MM_HINT_T0);
    }
    __m512i w[4];
    Source::load(step, w);
    for (int r = 0; r < Rows; ++r) {
      const __m512bh xx = (__m512bh)_mm512_set1_epi32(static_cast<int>(x_pairs[(m0 + r) * half_k + j]));
      for (int d = 0; d < 4; ++d) acc[r][d] = _mm512_dpbf16_ps(acc[r][d], (__m512bh)w[d], xx);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    for (int d = 0; d < 4; ++d) {
      const int64_t n0 = b * kOutputs + 16 * d;
      epilogue.store(acc[r][d], m0 + r, n0, out + (m0 + r) * n + n0);
    }
  }
}

template <int Rows, class Source>
void gemv_rows(const uint32_t* x_pairs, int64_t half_k, const typename Source::Element* block, int64_t b,
               const Epilogue& epilogue, uint16_t* out, int64_t n, int64_t m0, int64_t rows) {
  if constexpr (Rows > 1) {
    if (rows < Rows) return gemv_rows<Rows - 1, Source>(x_pairs, half_k, block, b, epilogue, out, n, m0, rows);
  }
  gemv_block<Rows, Source>(x_pairs, half_k, block, b, epilogue, out, n, m0);
}

// Every row tile of x against one block.
template <class Source>
void gemv_all_rows(const uint32_t* x_pairs, int64_t m_rows, int64_t half_k, const typename Source::Element* block,
                   int64_t b, const Epilogue& epilogue, uint16_t* out, int64_t n) {
  for (int64_t m0 = 0; m0 < m_rows; m0 += kRowsPerTile) {
    gemv_rows<kRowsPerTile, Source>(x_pairs, half_k, block, b, epilogue, out, n, m0,
                                    std::min<int64_t>(kRowsPerTile, m_rows - m0));
  }
}

// x [M, K] bf16 (contiguous) against `blocks` packed blocks of `half_k` steps each -> bf16 [M, N].
// `Source` reads the packed weight. With `widen_once`, each block is first widened into a bf16
// block kept by the thread (128 K bytes, in L2) and the row tiles read that: for a Source whose
// widening costs more than the read, once per block rather than once per tile.
template <class Source>
at::Tensor gemv(const at::Tensor& x, const typename Source::Element* packed, int64_t blocks, int64_t half_k,
                const Epilogue& epilogue, bool widen_once) {
  const int64_t m_rows = x.size(0), n = blocks * kOutputs;
  at::Tensor out = at::empty({m_rows, n}, x.options());
  const uint32_t* x_pairs = reinterpret_cast<const uint32_t*>(x.data_ptr());  // (x[m, 2j], x[m, 2j + 1])
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t block_elements = half_k * kOutputs * 2;
  // Each thread takes a run of blocks: its weights are read once, front to back, for every row.
  at::parallel_for(0, blocks, 1, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      const typename Source::Element* block = packed + b * block_elements;
      if (!widen_once) {
        gemv_all_rows<Source>(x_pairs, m_rows, half_k, block, b, epilogue, dst, n);
        continue;
      }
      thread_local std::vector<uint16_t> widened;
      widened.resize(block_elements);
      for (int64_t j = 0; j < half_k; ++j) {
        __m512i w[4];
        Source::load(block + j * kOutputs * 2, w);
        for (int d = 0; d < 4; ++d) _mm512_storeu_si512(widened.data() + j * kOutputs * 2 + 32 * d, w[d]);
      }
      gemv_all_rows<Bf16Source>(x_pairs, m_rows, half_k, widened.data(), b, epilogue, dst, n);
    }
  });
  return out;
}

}  // namespace qrt_pairs
