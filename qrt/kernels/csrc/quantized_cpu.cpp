// qrt's own CPU kernels for quantized weights, built on first use by qrt/kernels/native_cpu.py
// (AVX-512 with BF16 and VBMI; the loader checks the CPU before building).
//
// Ops, in the `qrt_cpu` namespace, each choosing its route by the number of rows M at run time
// (inside the op, so that a compiled graph with a dynamic M needs no guard on it):
//
//   fp8_linear(x [M, K], weight e4m3 [N, K], weight_scale [Nb, Kb], bias, block_n, block_k, input_scale,
//              min_rows_dequantized) -> [M, N] in x's dtype
//     The activations are quantized to e4m3 here, exactly as qrt's reference ops do: per row and
//     K-block of block_k columns (block_k = K: per token), or with the static `input_scale`. Then
//     out[m, n] = sum over K-blocks kb of x_scale[m, kb] * weight_scale[n / block_n, kb]
//                 * sum_{k in kb} xq[m, k] * weight[n, k]  (+ bias[n]).
//     M < min_rows_dequantized: a GEMV that reads the fp8 bytes once per tile of 8 rows and widens
//     them in registers. Otherwise the weight is dequantized tile by tile and dense GEMMs run
//     (oneDNN for bf16), their output scaled as it is written.
//
//   int4pack_mm(x [M, K], packed, group_size, scale_offsets, min_rows_dequantized) -> [M, N]
//     ATen's CPU int4 pack. One row (a decode step): qrt's GEMV on the pack. Few rows: ATen's own
//     kernel. Many: the pack dequantized to bf16 here, then one bf16 GEMM, which at large M is
//     faster than ATen's kernel (docs/cpu-kernels.md).
//
//   int8pack_mm(x [M, K], weight int8 [N, K], scales [N], min_rows_dequantized) -> [M, N]
//     ATen's int8 weight-only layout. Few rows: the fp8 GEMV's loop with the codes widened by
//     conversion (exact in bf16). Many: dequantized tile by tile, as above. fp32 activations:
//     ATen's own kernel.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include "fp8_codes.h"
#include "group_sums.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using qrt_fp8::Fp8Tables;
using qrt_fp8::fp8_tables;
using qrt_fp8::mask16;
using qrt_fp8::quantize_activations;
using qrt_fp8::widen_fp8x64;

constexpr int64_t kChunk = 64;  // fp8 codes widened per step of the GEMV
constexpr int kMaxTileRows = 8;  // activation rows sharing one read of the weights
// How far ahead of the read the GEMVs prefetch weight bytes (4 KiB measured fastest; 512 B, 2 KiB
// slower, 8 KiB no better: docs/cpu-kernels.md).
constexpr int64_t kPrefetchBytes = 4096;
// Activation bytes a GEMV slice of K keeps in L1 (48 KiB per core here), beside the streaming weights.
constexpr int64_t kL1ActivationBytes = 40960;
constexpr int64_t kTileBytes = 4 << 20;  // dequantized weights per GEMM of the dequantized routes


inline int64_t chunked_width(int64_t width) { return (width + kChunk - 1) / kChunk * kChunk; }

inline __mmask64 chunk_mask(int64_t remaining) {
  return remaining >= kChunk ? ~0ULL : ((1ULL << remaining) - 1);
}

// q [M, K] (bf16 bits) -> [M, K'] in the GEMV's order: each K-block padded with zeros to whole
// chunks of 64; `permuted`: each chunk's 32 `a` slots then its 32 `b` slots (see widen_fp8x64),
// else in order (Int8Widen).
at::Tensor permuted_activations(const at::Tensor& q, int64_t block_k, bool permuted) {
  const int64_t m_rows = q.size(0), k = q.size(1);
  const int64_t blocks = (k + block_k - 1) / block_k;
  const int64_t padded = (blocks - 1) * chunked_width(block_k) + chunked_width(k - (blocks - 1) * block_k);
  at::Tensor out = at::zeros({m_rows, padded}, q.options().dtype(at::kShort));
  const uint16_t* src = reinterpret_cast<const uint16_t*>(q.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  for (int64_t m = 0; m < m_rows; ++m) {
    int64_t offset = 0;
    for (int64_t k0 = 0; k0 < k; k0 += block_k) {
      const int64_t width = std::min(block_k, k - k0);
      for (int64_t c = 0; c < width; ++c) {
        const int64_t chunk = c / kChunk, j = c % kChunk;
        const int64_t lane = j / 16, within = j % 16;
        const int64_t slot = !permuted ? j : within < 8 ? lane * 8 + within : 32 + lane * 8 + within - 8;
        dst[m * padded + offset + chunk * kChunk + slot] = src[m * k + k0 + c];
      }
      offset += chunked_width(width);
    }
  }
  return out;
}


// How the GEMV widens 64 weight codes into two registers of bf16 pairs, and in which order the
// activations must be laid out to match.
struct Fp8Widen {  // e4m3 codes, by table lookup (widen_fp8x64)
  static constexpr bool kPermuted = true;
  const Fp8Tables& t = fp8_tables();
  void operator()(__m512i codes, __m512i& a, __m512i& b) const { widen_fp8x64(codes, t, a, b); }
};

struct Int8Widen {  // int8 codes, exact in bf16: widened to fp32 and packed, elements in order
  static constexpr bool kPermuted = false;
  void operator()(__m512i codes, __m512i& a, __m512i& b) const {
    const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(codes)));
    const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(codes, 1)));
    const __m512 f2 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(codes, 2)));
    const __m512 f3 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(codes, 3)));
    a = (__m512i)_mm512_cvtne2ps_pbh(f1, f0);  // elements 0-31
    b = (__m512i)_mm512_cvtne2ps_pbh(f3, f2);  // elements 32-63
  }
};

struct GemvArgs {
  const uint8_t* weight;  // [N, K] codes (e4m3 or int8)
  const uint16_t* xp;     // [M, padded] bf16 bits, in the Widen's order (permuted_activations)
  const float* x_scale;   // [M, Kb]
  const float* w_scale;   // [Nb, Kb]
  float* out;             // [M, N]
  int64_t n, k, padded, k_blocks, block_n, block_k;
};

// Activation rows [m0, m0 + Rows) against weight rows [n_begin, n_end), over the loop blocks
// [lb0, lb1) of `loop_k` columns each: the scale blocks, or for one scale block slices of K that keep
// the activations in L1. Adds into `out` when `accumulate` (a later slice), else stores.
template <int Rows, bool OneBlock, class Widen>
void gemv_slice(const GemvArgs& p, int64_t m0, int64_t n_begin, int64_t n_end, int64_t lb0, int64_t lb1,
                int64_t loop_k, bool accumulate) {
  const Widen widen;
  const uint16_t* xp = p.xp + m0 * p.padded;
  // Prefetching well ahead keeps enough reads in flight to run at the memory's speed (without it
  // this loop read 13 GB/s where oneDNN's bf16 GEMV read 42). Within a slice of K the next row's
  // bytes are the next to be read.
  const int64_t ahead = lb1 - lb0 == (p.k + loop_k - 1) / loop_k ? kPrefetchBytes : p.k;
  const int64_t loop_padded = chunked_width(loop_k);
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = p.weight + n * p.k;
    __m512 total[Rows];
    for (int r = 0; r < Rows; ++r) total[r] = _mm512_setzero_ps();
    for (int64_t lb = lb0; lb < lb1; ++lb) {
      const int64_t k0 = lb * loop_k, width = std::min(loop_k, p.k - k0);
      const uint16_t* x = xp + lb * loop_padded;
      __m512 acc_a[Rows], acc_b[Rows];  // two chains per output, for latency
      for (int r = 0; r < Rows; ++r) acc_a[r] = acc_b[r] = _mm512_setzero_ps();
      for (int64_t c = 0; c < width; c += kChunk) {
        const uint8_t* codes = row + k0 + c;
        _mm_prefetch(reinterpret_cast<const char*>(codes) + ahead, _MM_HINT_T0);
        __m512i a, b;
        widen(_mm512_maskz_loadu_epi8(chunk_mask(width - c), codes), a, b);
        for (int r = 0; r < Rows; ++r) {
          const uint16_t* xr = x + r * p.padded + c;
          acc_a[r] = _mm512_dpbf16_ps(acc_a[r], (__m512bh)a, (__m512bh)_mm512_loadu_si512(xr));
          acc_b[r] = _mm512_dpbf16_ps(acc_b[r], (__m512bh)b, (__m512bh)_mm512_loadu_si512(xr + 32));
        }
      }
      for (int r = 0; r < Rows; ++r) {
        const __m512 block_sum = _mm512_add_ps(acc_a[r], acc_b[r]);
        if constexpr (OneBlock) {
          total[r] = block_sum;  // a slice is one loop block; scaled once, after the reduction
        } else {
          const float scale = p.x_scale[(m0 + r) * p.k_blocks + lb] * p.w_scale[(n / p.block_n) * p.k_blocks + lb];
          total[r] = _mm512_fmadd_ps(block_sum, _mm512_set1_ps(scale), total[r]);
        }
      }
    }
    for (int r = 0; r < Rows; ++r) {
      float sum = _mm512_reduce_add_ps(total[r]);
      if constexpr (OneBlock) sum *= p.x_scale[m0 + r] * p.w_scale[n / p.block_n];
      float& dst = p.out[(m0 + r) * p.n + n];
      dst = accumulate ? dst + sum : sum;
    }
  }
}

template <int Rows, bool OneBlock, class Widen>
void gemv_sliced(const GemvArgs& p, int64_t m0, int64_t n_begin, int64_t n_end) {
  // Activation columns per slice: Rows rows of bf16 in part of the L1.
  const int64_t budget = std::max<int64_t>(kChunk, kL1ActivationBytes / (2 * Rows) / kChunk * kChunk);
  const int64_t loop_k = OneBlock ? (p.k <= budget ? p.k : budget) : p.block_k;
  const int64_t loop_blocks = (p.k + loop_k - 1) / loop_k;
  const int64_t per_slice = OneBlock ? 1 : std::max<int64_t>(1, budget / chunked_width(p.block_k));
  for (int64_t lb = 0; lb < loop_blocks; lb += per_slice) {
    gemv_slice<Rows, OneBlock, Widen>(p, m0, n_begin, n_end, lb, std::min(loop_blocks, lb + per_slice), loop_k, lb > 0);
  }
}

template <int Rows, class Widen>
void gemv_rows(const GemvArgs& p, int64_t m0, int64_t rows, int64_t n_begin, int64_t n_end) {
  if constexpr (Rows > 1) {
    if (rows < Rows) return gemv_rows<Rows - 1, Widen>(p, m0, rows, n_begin, n_end);
  }
  if (p.k_blocks == 1) {
    gemv_sliced<Rows, true, Widen>(p, m0, n_begin, n_end);
  } else {
    gemv_sliced<Rows, false, Widen>(p, m0, n_begin, n_end);
  }
}

// q [M, K] bf16, x_scale [M, Kb] against weight codes [N, K] and weight_scale [Nb, Kb] -> fp32 [M, N],
// without the bias.
template <class Widen>
at::Tensor gemv(const at::Tensor& q, const at::Tensor& x_scale, const at::Tensor& weight,
                const at::Tensor& weight_scale, int64_t block_n, int64_t block_k) {
  const int64_t m_rows = q.size(0), k = q.size(1), n = weight.size(0);
  at::Tensor xp = permuted_activations(q.contiguous(), block_k, Widen::kPermuted);
  at::Tensor out = at::empty({m_rows, n}, q.options().dtype(at::kFloat));
  GemvArgs p{reinterpret_cast<const uint8_t*>(weight.data_ptr()),
                reinterpret_cast<const uint16_t*>(xp.data_ptr()),
                x_scale.data_ptr<float>(), weight_scale.data_ptr<float>(), out.data_ptr<float>(),
                n, k, xp.size(1), weight_scale.size(1), block_n, block_k};
  // Each thread takes a run of output channels: its weight rows are read once, front to back.
  at::parallel_for(0, n, 16, [&](int64_t n_begin, int64_t n_end) {
    for (int64_t m0 = 0; m0 < m_rows; m0 += kMaxTileRows) {
      gemv_rows<kMaxTileRows, Widen>(p, m0, std::min<int64_t>(kMaxTileRows, m_rows - m0), n_begin, n_end);
    }
  });
  return out;
}

// The dequantized routes run tile by tile over output channels, each tile's bf16 weights (about
// kTileBytes) written into a buffer kept from call to call and read by the GEMM while still in the
// last-level cache. A whole dequantized weight of tens of MiB would be a fresh allocation that
// page-faults on every call (19 ms of a 20 ms call for 11264 x 2048); so, in a 512-token prefill,
// did a fresh 3.5 MiB tile buffer per call.
int64_t tile_rows(int64_t k, int64_t align) {
  return std::max(align, kTileBytes / (2 * k) / align * align);
}

// A bf16 buffer of at least `elements`, reused by the calling thread from call to call.
uint16_t* scratch_bf16(int64_t elements) {
  thread_local std::vector<uint16_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < elements) buffer.resize(elements);
  return buffer.data();
}

// out[:, n0 : n0 + rows] = acc [M, rows] (bf16 or fp32) * row_scale[m] * col_scale[n] + bias[n],
// in out's dtype (bf16 or fp32); row_scale / col_scale / bias may be null.
void write_tile(const at::Tensor& acc, at::Tensor& out, int64_t n0, const float* row_scale, const float* col_scale,
                const float* bias) {
  const int64_t m_rows = acc.size(0), rows = acc.size(1), n = out.size(1);
  const bool acc_bf16 = acc.scalar_type() == at::kBFloat16, out_bf16 = out.scalar_type() == at::kBFloat16;
  const void* src = acc.data_ptr();
  void* dst = out.data_ptr();
  at::parallel_for(0, m_rows, 16, [&](int64_t m_begin, int64_t m_end) {
    for (int64_t m = m_begin; m < m_end; ++m) {
      const __m512 rs = _mm512_set1_ps(row_scale ? row_scale[m] : 1.0f);
      for (int64_t j = 0; j < rows; j += 16) {
        const __mmask16 mask = mask16(rows - j);
        __m512 v = acc_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(
                                  mask, static_cast<const uint16_t*>(src) + m * rows + j)), 16))
                            : _mm512_maskz_loadu_ps(mask, static_cast<const float*>(src) + m * rows + j);
        v = _mm512_mul_ps(v, rs);
        if (col_scale) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, col_scale + n0 + j));
        if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + n0 + j));
        if (out_bf16) {
          _mm256_mask_storeu_epi16(static_cast<uint16_t*>(dst) + m * n + n0 + j, mask, (__m256i)_mm512_cvtneps_pbh(v));
        } else {
          _mm512_mask_storeu_ps(static_cast<float*>(dst) + m * n + n0 + j, mask, v);
        }
      }
    }
  });
}

// e4m3 codes of rows [n0, n0 + rows) -> bf16 [rows, K] into dst, each value times its block's scale
// (or by one): the code's bits shifted into an fp16 (exact, subnormals included, worth 2**-8 of the
// value), then widened to fp32, scaled and rounded once.
void dequantize_fp8_rows_bf16(const uint8_t* src, int64_t k, int64_t n0, int64_t rows, const float* scales,
                              int64_t block_n, int64_t block_k, int64_t k_blocks, bool scaled, uint16_t* dst) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    const __m256i magnitude = _mm256_set1_epi16(0x7F), sign = _mm256_set1_epi16(0x80);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = n0 + i;
      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        const __m512 factor = _mm512_set1_ps(256.0f * (scaled ? scales[(row / block_n) * k_blocks + kb] : 1.0f));
        const int64_t k0 = kb * block_k, k1 = std::min(k, k0 + block_k);
        for (int64_t c = k0; c < k1; c += 16) {
          const __mmask16 mask = mask16(k1 - c);
          __m256i w = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(mask, src + row * k + c));
          __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, magnitude), 7),
                                         _mm256_slli_epi16(_mm256_and_si256(w, sign), 8));
          __m512 value = _mm512_mul_ps(_mm512_cvtph_ps(half), factor);
          _mm256_mask_storeu_epi16(dst + i * k + c, mask, (__m256i)_mm512_cvtneps_pbh(value));
        }
      }
    }
  });
}

// Per-row weight scales [N, Kb] from the block grid [Nb, Kb].
at::Tensor rows_of_scales(const at::Tensor& weight_scale, int64_t block_n, int64_t n) {
  return weight_scale.repeat_interleave(block_n, 0).narrow(0, 0, n);
}

// Many rows: q [M, K] bf16 and x_scale [M, Kb] against the weight dequantized tile by tile.
// One K-block: exact fp8 values on both sides, the scales applied to the GEMM's output as it is
// written. Blocks: both sides dequantized, rounded once to bf16.
at::Tensor fp8_linear_dequantized(const at::Tensor& q, const at::Tensor& x_scale, const at::Tensor& weight,
                                  const at::Tensor& weight_scale, const float* bias, int64_t block_n, int64_t block_k,
                                  at::ScalarType out_dtype) {
  const int64_t m_rows = q.size(0), n = weight.size(0), k = weight.size(1), k_blocks = weight_scale.size(1);
  const bool one_block = k_blocks == 1;
  at::Tensor x = one_block ? q : (q.to(at::kFloat) * x_scale.repeat_interleave(block_k, 1).narrow(1, 0, k)).to(at::kBFloat16);
  at::Tensor col_scale = one_block ? rows_of_scales(weight_scale, block_n, n).reshape({n}).contiguous() : at::Tensor();
  at::Tensor out = at::empty({m_rows, n}, q.options().dtype(out_dtype));
  const int64_t tile = tile_rows(k, 16);
  uint16_t* buffer = scratch_bf16(std::min(tile, n) * k);
  const uint8_t* src = reinterpret_cast<const uint8_t*>(weight.data_ptr());
  for (int64_t n0 = 0; n0 < n; n0 += tile) {
    const int64_t rows = std::min(tile, n - n0);
    dequantize_fp8_rows_bf16(src, k, n0, rows, weight_scale.data_ptr<float>(), block_n, block_k, k_blocks, !one_block,
                             buffer);
    at::Tensor w = at::from_blob(buffer, {rows, k}, q.options().dtype(at::kBFloat16));
    write_tile(at::mm(x, w.t()), out, n0, one_block ? x_scale.data_ptr<float>() : nullptr,
               one_block ? col_scale.data_ptr<float>() : nullptr, bias);
  }
  return out;
}

void check_fp8_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale, int64_t block_n,
                    int64_t block_k) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "qrt_cpu::fp8_linear: x [M, K] and weight [N, K] expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat8_e4m3fn, "qrt_cpu::fp8_linear: e4m3 weight expected, got ",
              weight.scalar_type());
  TORCH_CHECK(block_n > 0 && block_k > 0, "qrt_cpu::fp8_linear: block sizes must be positive");
  TORCH_CHECK(weight_scale.dim() == 2 && weight_scale.size(0) == (weight.size(0) + block_n - 1) / block_n &&
                  weight_scale.size(1) == (weight.size(1) + block_k - 1) / block_k &&
                  weight_scale.scalar_type() == at::kFloat,
              "qrt_cpu::fp8_linear: fp32 weight_scale [ceil(N / block_n), ceil(K / block_k)] expected, got ",
              weight_scale.sizes(), " ", weight_scale.scalar_type());
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                      const std::optional<at::Tensor>& bias, int64_t block_n, int64_t block_k,
                      const std::optional<at::Tensor>& input_scale, int64_t min_rows_dequantized) {
  check_fp8_args(x, weight, weight_scale, block_n, block_k);
  TORCH_CHECK(!input_scale.has_value() || block_k >= x.size(1),
              "qrt_cpu::fp8_linear: a static input_scale covers whole rows (block_k = K)");
  at::Tensor q, x_scale;
  const at::Tensor xin = x.scalar_type() == at::kBFloat16 ? x.contiguous() : x.to(at::kFloat).contiguous();
  quantize_activations(xin, block_k, input_scale.value_or(at::Tensor()), q, x_scale);
  at::Tensor w = weight.contiguous(), ws = weight_scale.contiguous();
  at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* b_ptr = b.defined() ? b.data_ptr<float>() : nullptr;
  const auto dtype = x.scalar_type();
  const auto out_dtype = dtype == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
  at::Tensor out;
  if (x.size(0) >= min_rows_dequantized && dtype == at::kBFloat16) {
    out = fp8_linear_dequantized(q, x_scale, w, ws, b_ptr, block_n, block_k, out_dtype);
  } else {
    at::Tensor acc = gemv<Fp8Widen>(q, x_scale, w, ws, block_n, block_k);  // fp32 [M, N]
    out = at::empty(acc.sizes(), acc.options().dtype(out_dtype));
    write_tile(acc, out, 0, nullptr, nullptr, b_ptr);
  }
  return out.scalar_type() == dtype ? out : out.to(dtype);
}

// ATen's CPU int4 pack (uint8 [N, K / 2]): byte (b, k, d) of its [N / 64, K, 32] view holds output
// row 64 b + d in its low nibble and row 64 b + 32 + d in its high one. W = (q - 8) * scale + offset
// per group of K. Output rows [n0, n0 + rows) (multiples of 64) are written transposed, [K, rows]
// into dst: the 64 rows of a block are then 64 adjacent values.
void dequantize_int4pack_bf16(const uint8_t* src, int64_t k, int64_t n, int64_t group_size, const float* s,
                              const float* o, int64_t n0, int64_t rows, uint16_t* dst) {
  at::parallel_for(0, k, 8, [&](int64_t k_begin, int64_t k_end) {
    const __m512i nibble = _mm512_set1_epi16(0xF);
    const __m512 eight = _mm512_set1_ps(8.0f);
    for (int64_t kk = k_begin; kk < k_end; ++kk) {
      const float* s_row = s + (kk / group_size) * n;
      const float* o_row = o + (kk / group_size) * n;
      for (int64_t b = n0 / 64; b < (n0 + rows) / 64; ++b) {
        __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (b * k + kk) * 32)));
        const __m512i halves[2] = {_mm512_and_si512(bytes, nibble), _mm512_srli_epi16(bytes, 4)};  // rows +0..31, +32..63
        for (int h = 0; h < 2; ++h) {
          for (int q = 0; q < 2; ++q) {
            const int64_t col = b * 64 + h * 32 + q * 16;
            __m256i codes16 = q == 0 ? _mm512_castsi512_si256(halves[h]) : _mm512_extracti64x4_epi64(halves[h], 1);
            __m512 codes = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(codes16)), eight);
            __m512 value = _mm512_fmadd_ps(codes, _mm512_loadu_ps(s_row + col), _mm512_loadu_ps(o_row + col));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + kk * rows + col - n0),
                                (__m256i)_mm512_cvtneps_pbh(value));
          }
        }
      }
    }
  });
}

// One activation row against ATen's CPU int4 pack, at the memory's speed: the codes of two
// adjacent columns k, k + 1 are paired byte by byte, each code q widened to the 16 bits 0x43 q,
// which is bf16 (128 + q), exactly (128 .. 143 needs 8 significant bits), and multiplied with the
// bf16 pair (x[k], x[k + 1]) by vdpbf16ps, 64 output rows at a time. The products are exact and
// summed in fp32. ATen's kernel computes W = (q - 8) * scale + offset, so per group
// out += scale * (sum - 136 * sum(x)) + offset * sum(x). Widening by an interleave with a constant
// byte costs one instruction per 32 codes, where looking up both bytes of bf16(q - 8) took two.
// The accumulators hold the rows of a block permuted (see kInt4Rows).
struct Int4Tables {
  __m512i rows[4];    // accumulator a, lane p -> row of the 64-row block (0..63), mod 32
};

const Int4Tables& int4_tables() {
  static const Int4Tables tables = [] {
    Int4Tables t;
    // Pairs of a k-pair's 64 bytes come in the order of d 0-7, 16-23, 8-15, 24-31 per 128-bit lane
    // (unpacklo/hi of the two columns, then joined); unpack to words takes 4 of a lane's 8 pairs.
    const int base[4] = {0, 16, 8, 24};
    alignas(64) int32_t rows[4][16];
    for (int a = 0; a < 4; ++a)
      for (int p = 0; p < 16; ++p) rows[a][p] = base[p / 4] + (a % 2) * 4 + p % 4;
    for (int a = 0; a < 4; ++a) t.rows[a] = _mm512_load_si512(rows[a]);
    return t;
  }();
  return tables;
}

// scale_offsets of 32 rows (bf16 pairs) -> fp32 scales and offsets, in the accumulator's
// order given by `rows` (0..31 within these 32 rows).
inline void int4_group_scales(const uint16_t* pairs, __m512i rows, __m512& scale, __m512& offset) {
  const __m512i v0 = _mm512_loadu_si512(pairs), v1 = _mm512_loadu_si512(pairs + 32);  // rows 0-15, 16-31
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512 s0 = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)), s1 = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16));
  const __m512 o0 = _mm512_castsi512_ps(_mm512_and_si512(v0, high)), o1 = _mm512_castsi512_ps(_mm512_and_si512(v1, high));
  scale = _mm512_permutex2var_ps(s0, rows, s1);
  offset = _mm512_permutex2var_ps(o0, rows, o1);
}

at::Tensor int4pack_gemv(const at::Tensor& x, const at::Tensor& packed, int64_t group_size,
                         const at::Tensor& scale_offsets) {
  const int64_t n = packed.size(0), k = packed.size(1) * 2, groups = k / group_size;
  at::Tensor xc = x.contiguous();
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  std::vector<float> xs(groups);  // sum of x per group, in fp32
  qrt_sums::bf16_group_sums(xb, k, group_size, xs.data());
  const uint8_t* src = packed.data_ptr<uint8_t>();
  const uint16_t* so = reinterpret_cast<const uint16_t*>(scale_offsets.data_ptr());  // [K / g, N, 2]
  at::Tensor out = at::empty({1, n}, x.options());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  const Int4Tables& t = int4_tables();
  at::parallel_for(0, n / 64, 1, [&](int64_t b_begin, int64_t b_end) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), bias = _mm512_set1_epi8(0x43);
    for (int64_t b = b_begin; b < b_end; ++b) {
      const uint8_t* block = src + b * k * 32;  // [K, 32] bytes of rows 64 b .. 64 b + 63
      __m512 total[4];
      for (int a = 0; a < 4; ++a) total[a] = _mm512_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        __m512 acc[4];
        for (int a = 0; a < 4; ++a) acc[a] = _mm512_setzero_ps();
        for (int64_t kk = g * group_size; kk < (g + 1) * group_size; kk += 2) {
          const uint8_t* bytes = block + kk * 32;
          _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T0);
          const __m256i col0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
          const __m256i col1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32));
          const __m512i pairs = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi8(col0, col1)),
                                                   _mm256_unpackhi_epi8(col0, col1), 1);
          const __m512i low = _mm512_and_si512(pairs, nibble);                          // rows d
          const __m512i high = _mm512_and_si512(_mm512_srli_epi16(pairs, 4), nibble);  // rows d + 32
          const __m512i xx = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xb + kk));  // (x[k], x[k+1])
          const __m512i codes[2] = {low, high};
          for (int h = 0; h < 2; ++h) {  // words 0x43 q: bf16 (128 + q)
            acc[2 * h] = _mm512_dpbf16_ps(acc[2 * h], (__m512bh)_mm512_unpacklo_epi8(codes[h], bias), (__m512bh)xx);
            acc[2 * h + 1] = _mm512_dpbf16_ps(acc[2 * h + 1], (__m512bh)_mm512_unpackhi_epi8(codes[h], bias), (__m512bh)xx);
          }
        }
        const __m512 sum_x = _mm512_set1_ps(xs[g]), widened_x = _mm512_set1_ps(136.0f * xs[g]);
        for (int a = 0; a < 4; ++a) {
          __m512 scale, offset;  // rows 64 b + 32 (a / 2) + t.rows[a]
          int4_group_scales(so + (g * n + b * 64 + 32 * (a / 2)) * 2, t.rows[a], scale, offset);
          total[a] = _mm512_fmadd_ps(scale, _mm512_sub_ps(acc[a], widened_x), _mm512_fmadd_ps(offset, sum_x, total[a]));
        }
      }
      alignas(64) float values[4][16];
      for (int a = 0; a < 4; ++a) _mm512_store_ps(values[a], total[a]);
      alignas(64) float natural[64];
      for (int a = 0; a < 4; ++a) {
        alignas(64) int32_t rows[16];
        _mm512_store_si512(rows, t.rows[a]);
        for (int p = 0; p < 16; ++p) natural[32 * (a / 2) + rows[p]] = values[a][p];
      }
      for (int q = 0; q < 4; ++q) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + b * 64 + 16 * q),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(natural + 16 * q)));
      }
    }
  });
  return out;
}

at::Tensor int4pack_mm(const at::Tensor& x, const at::Tensor& packed, int64_t group_size,
                       const at::Tensor& scale_offsets, int64_t min_rows_dequantized) {
  const bool dequantize = x.size(0) >= min_rows_dequantized && x.scalar_type() == at::kBFloat16 &&
                          packed.size(0) % 64 == 0 && packed.is_contiguous();
  if (!dequantize) {
    const bool gemv = x.size(0) == 1 && x.scalar_type() == at::kBFloat16 && packed.size(0) % 64 == 0 &&
                      packed.is_contiguous() && scale_offsets.is_contiguous() && group_size % 2 == 0;
    return gemv ? int4pack_gemv(x, packed, group_size, scale_offsets)
                : at::_weight_int4pack_mm_for_cpu(x, packed, group_size, scale_offsets);
  }
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  at::Tensor scales = scale_offsets.select(2, 0).to(at::kFloat).contiguous();   // [K / group, N]
  at::Tensor offsets = scale_offsets.select(2, 1).to(at::kFloat).contiguous();  // [K / group, N]
  const int64_t tile = tile_rows(k, 64);
  uint16_t* buffer = scratch_bf16(k * std::min(tile, n));
  at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  for (int64_t n0 = 0; n0 < n; n0 += tile) {
    const int64_t rows = std::min(tile, n - n0);
    dequantize_int4pack_bf16(packed.data_ptr<uint8_t>(), k, n, group_size, scales.data_ptr<float>(),
                             offsets.data_ptr<float>(), n0, rows, buffer);
    write_tile(at::mm(xc, at::from_blob(buffer, {k, rows}, x.options())), out, n0, nullptr, nullptr, nullptr);
  }
  return out;
}

// int8 codes -> bf16 (exact), `count` of them.
void widen_int8_rows_bf16(const int8_t* src, int64_t count, uint16_t* dst) {
  at::parallel_for(0, (count + 15) / 16, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const __mmask16 mask = mask16(count - 16 * i);
      __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, src + 16 * i)));
      _mm256_mask_storeu_epi16(dst + 16 * i, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  });
}

at::Tensor int8pack_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       int64_t min_rows_dequantized) {
  if (x.scalar_type() != at::kBFloat16) return at::_weight_int8pack_mm(x, weight, scales);
  if (x.size(0) < min_rows_dequantized) {
    // The GEMV, its activations unquantized (scale one) and the channel scales per row.
    const int64_t m_rows = x.size(0), n = weight.size(0), k = weight.size(1);
    at::Tensor acc = gemv<Int8Widen>(x, at::ones({m_rows, 1}, x.options().dtype(at::kFloat)), weight.contiguous(),
                                     scales.to(at::kFloat).reshape({n, 1}).contiguous(), 1, k);
    at::Tensor out = at::empty({m_rows, n}, x.options());
    write_tile(acc, out, 0, nullptr, nullptr, nullptr);
    return out;
  }
  // The codes are exact in bf16; the per-channel scale is applied to the GEMM's output as it is written.
  const int64_t n = weight.size(0), k = weight.size(1), tile = tile_rows(k, 16);
  at::Tensor col_scale = scales.to(at::kFloat).contiguous();
  at::Tensor xc = x.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  uint16_t* buffer = scratch_bf16(std::min(tile, n) * k);
  for (int64_t n0 = 0; n0 < n; n0 += tile) {
    const int64_t rows = std::min(tile, n - n0);
    widen_int8_rows_bf16(w.data_ptr<int8_t>() + n0 * k, rows * k, buffer);
    write_tile(at::mm(xc, at::from_blob(buffer, {rows, k}, x.options()).t()), out, n0, nullptr,
               col_scale.data_ptr<float>(), nullptr);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(qrt_cpu, m) {
  m.def("fp8_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, int block_n, int block_k, "
        "Tensor? input_scale, int min_rows_dequantized) -> Tensor");
  m.def("int4pack_mm(Tensor x, Tensor packed, int group_size, Tensor scale_offsets, int min_rows_dequantized) -> Tensor");
  m.def("int8pack_mm(Tensor x, Tensor weight, Tensor scales, int min_rows_dequantized) -> Tensor");
}

TORCH_LIBRARY_IMPL(qrt_cpu, CPU, m) {
  m.impl("fp8_linear", &fp8_linear);
  m.impl("int4pack_mm", &int4pack_mm);
  m.impl("int8pack_mm", &int8pack_mm);
}
