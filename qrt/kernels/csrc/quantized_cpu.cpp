// qrt's own CPU kernels for quantized weights, built on first use by qrt/kernels/native_cpu.py
// (AVX-512 with BF16 and VBMI; the loader checks the CPU before building).
//
// Ops, in the `qrt_cpu` namespace, each choosing its route by the number of rows M at run time
// (inside the op, so that a compiled graph with a dynamic M needs no guard on it):
//
//   fp8_gemm(xq [M, K], x_scale [M, Kb], weight e4m3 [N, K], weight_scale [Nb, Kb], block_n, block_k,
//            min_rows_dequantized) -> fp32 [M, N]
//     out[m, n] = sum over K-blocks kb of x_scale[m, kb] * weight_scale[n / block_n, kb]
//                 * sum_{k in kb} xq[m, k] * weight[n, k]
//     xq holds fp8 values (exact in any float dtype). M < min_rows_dequantized: a GEMV that reads
//     the fp8 bytes once per tile of 8 rows and widens them in registers. Otherwise the weight is
//     dequantized into xq's dtype and one dense GEMM (oneDNN for bf16) runs.
//
//   int4pack_mm(x [M, K], packed, group_size, scale_offsets, min_rows_dequantized) -> [M, N]
//     ATen's CPU int4 pack. Few rows: ATen's own kernel. Many: the pack dequantized to bf16 here,
//     then one bf16 GEMM, which at large M is faster than ATen's kernel (docs/cpu-kernels.md).
//
//   int8pack_mm(x [M, K], weight int8 [N, K], scales [N], min_rows_dequantized) -> [M, N]
//     The same choice for ATen's int8 weight-only kernel; the int8 codes are exact in bf16.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int64_t kChunk = 64;  // fp8 codes widened per step of the GEMV
constexpr int kMaxTileRows = 8;  // activation rows sharing one read of the weights
#ifndef QRT_L1
#define QRT_L1 40960
#endif
#ifndef QRT_PREFETCH
#define QRT_PREFETCH 4096
#endif
constexpr int64_t kPrefetchBytes = QRT_PREFETCH;
constexpr int64_t kL1ActivationBytes = QRT_L1;
constexpr int64_t kTileBytes = 4 << 20;  // dequantized weights per GEMM of the dequantized routes

// e4m3 -> bf16 by table lookup: vpermi2b looks up the high and the low byte of the bf16 bits of
// each code's magnitude (128 entries, two registers each); the sign bit is or-ed in after.
struct Fp8Tables {
  __m512i hi0, hi1, lo0, lo1;
};

Fp8Tables make_fp8_tables() {
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

const Fp8Tables& fp8_tables() {
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

inline int64_t chunked_width(int64_t width) { return (width + kChunk - 1) / kChunk * kChunk; }

inline __mmask64 chunk_mask(int64_t remaining) {
  return remaining >= kChunk ? ~0ULL : ((1ULL << remaining) - 1);
}

// xq [M, K] -> bf16 bits [M, K'] in the GEMV's order: each K-block padded with zeros to whole chunks
// of 64, each chunk's 32 `a` slots then its 32 `b` slots (see widen_fp8x64).
at::Tensor permuted_activations(const at::Tensor& xq, int64_t block_k) {
  const int64_t m_rows = xq.size(0), k = xq.size(1);
  const int64_t blocks = (k + block_k - 1) / block_k;
  const int64_t padded = (blocks - 1) * chunked_width(block_k) + chunked_width(k - (blocks - 1) * block_k);
  at::Tensor x16 = xq.to(at::kBFloat16).contiguous();  // exact: the values are fp8 values
  at::Tensor out = at::zeros({m_rows, padded}, xq.options().dtype(at::kShort));
  const uint16_t* src = reinterpret_cast<const uint16_t*>(x16.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  for (int64_t m = 0; m < m_rows; ++m) {
    int64_t offset = 0;
    for (int64_t k0 = 0; k0 < k; k0 += block_k) {
      const int64_t width = std::min(block_k, k - k0);
      for (int64_t c = 0; c < width; ++c) {
        const int64_t chunk = c / kChunk, j = c % kChunk;
        const int64_t lane = j / 16, within = j % 16;
        const int64_t slot = within < 8 ? lane * 8 + within : 32 + lane * 8 + within - 8;
        dst[m * padded + offset + chunk * kChunk + slot] = src[m * k + k0 + c];
      }
      offset += chunked_width(width);
    }
  }
  return out;
}

struct Fp8GemvArgs {
  const uint8_t* weight;  // [N, K] e4m3 codes
  const uint16_t* xp;     // [M, padded] bf16 bits, permuted
  const float* x_scale;   // [M, Kb]
  const float* w_scale;   // [Nb, Kb]
  float* out;             // [M, N]
  int64_t n, k, padded, k_blocks, block_n, block_k;
};

// Activation rows [m0, m0 + Rows) against weight rows [n_begin, n_end), over the loop blocks
// [lb0, lb1) of `loop_k` columns each: the scale blocks, or for one scale block slices of K that keep
// the activations in L1. Adds into `out` when `accumulate` (a later slice), else stores.
template <int Rows, bool OneBlock>
void fp8_gemv_slice(const Fp8GemvArgs& p, int64_t m0, int64_t n_begin, int64_t n_end, int64_t lb0, int64_t lb1,
                    int64_t loop_k, bool accumulate) {
  const Fp8Tables& t = fp8_tables();
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
        widen_fp8x64(_mm512_maskz_loadu_epi8(chunk_mask(width - c), codes), t, a, b);
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

template <int Rows, bool OneBlock>
void fp8_gemv_sliced(const Fp8GemvArgs& p, int64_t m0, int64_t n_begin, int64_t n_end) {
  // Activation columns per slice: Rows rows of bf16 in about half of a 48 KiB L1.
  const int64_t budget = std::max<int64_t>(kChunk, kL1ActivationBytes / (2 * Rows) / kChunk * kChunk);
  const int64_t loop_k = OneBlock ? (p.k <= budget ? p.k : budget) : p.block_k;
  const int64_t loop_blocks = (p.k + loop_k - 1) / loop_k;
  const int64_t per_slice = OneBlock ? 1 : std::max<int64_t>(1, budget / chunked_width(p.block_k));
  for (int64_t lb = 0; lb < loop_blocks; lb += per_slice) {
    fp8_gemv_slice<Rows, OneBlock>(p, m0, n_begin, n_end, lb, std::min(loop_blocks, lb + per_slice), loop_k, lb > 0);
  }
}

template <int Rows>
void fp8_gemv_rows(const Fp8GemvArgs& p, int64_t m0, int64_t rows, int64_t n_begin, int64_t n_end) {
  if constexpr (Rows > 1) {
    if (rows < Rows) return fp8_gemv_rows<Rows - 1>(p, m0, rows, n_begin, n_end);
  }
  if (p.k_blocks == 1) {
    fp8_gemv_sliced<Rows, true>(p, m0, n_begin, n_end);
  } else {
    fp8_gemv_sliced<Rows, false>(p, m0, n_begin, n_end);
  }
}

at::Tensor fp8_gemv(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& weight,
                    const at::Tensor& weight_scale, int64_t block_n, int64_t block_k) {
  const int64_t m_rows = xq.size(0), k = xq.size(1), n = weight.size(0);
  at::Tensor xp = permuted_activations(xq, block_k);
  at::Tensor out = at::empty({m_rows, n}, xq.options().dtype(at::kFloat));
  Fp8GemvArgs p{reinterpret_cast<const uint8_t*>(weight.data_ptr()),
                reinterpret_cast<const uint16_t*>(xp.data_ptr()),
                x_scale.data_ptr<float>(), weight_scale.data_ptr<float>(), out.data_ptr<float>(),
                n, k, xp.size(1), weight_scale.size(1), block_n, block_k};
  // Each thread takes a run of output channels: its weight rows are read once, front to back.
  at::parallel_for(0, n, 16, [&](int64_t n_begin, int64_t n_end) {
    for (int64_t m0 = 0; m0 < m_rows; m0 += kMaxTileRows) {
      fp8_gemv_rows<kMaxTileRows>(p, m0, std::min<int64_t>(kMaxTileRows, m_rows - m0), n_begin, n_end);
    }
  });
  return out;
}

// The dequantized routes run tile by tile over output channels, each tile's bf16 weights (about
// kTileBytes) written into one buffer and read by the GEMM while still in the last-level cache. A
// whole dequantized weight of tens of MiB would be a fresh allocation that page-faults on every call
// (19 ms of a 20 ms call for 11264 x 2048).
int64_t tile_rows(int64_t k, int64_t align) {
  return std::max(align, kTileBytes / (2 * k) / align * align);
}

// Output [M, N] fp32 = GEMM(x, tile) over tiles of `tile` output channels; fill(n0, rows) returns
// the tile's weight as [rows, K] (transposed = false) or [K, rows] (true) in x's dtype.
template <typename Fill>
at::Tensor tiled_mm(const at::Tensor& x, int64_t n, int64_t tile, bool transposed, Fill fill) {
  at::Tensor out = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
  for (int64_t n0 = 0; n0 < n; n0 += tile) {
    const int64_t rows = std::min(tile, n - n0);
    at::Tensor w = fill(n0, rows);
    out.narrow(1, n0, rows).copy_(at::mm(x, transposed ? w : w.t()));
  }
  return out;
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
          const __mmask16 mask = k1 - c >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (k1 - c)) - 1);
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

at::Tensor fp8_gemm_dequantized(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& weight,
                                const at::Tensor& weight_scale, int64_t block_n, int64_t block_k) {
  const int64_t n = weight.size(0), k = weight.size(1), k_blocks = weight_scale.size(1);
  const bool one_block = k_blocks == 1;
  const auto dtype = xq.scalar_type();
  // One K-block: exact fp8 values on both sides, the scales applied once to the GEMM's output.
  // Blocks: both sides dequantized, rounded once to the activations' dtype.
  at::Tensor x = one_block ? xq : (xq.to(at::kFloat) * x_scale.repeat_interleave(block_k, 1).narrow(1, 0, k)).to(dtype);
  at::Tensor out;
  if (dtype == at::kBFloat16) {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(weight.data_ptr());
    const int64_t tile = tile_rows(k, 16);
    at::Tensor buffer = at::empty({std::min(tile, n), k}, xq.options());
    out = tiled_mm(x, n, tile, false, [&](int64_t n0, int64_t rows) {
      dequantize_fp8_rows_bf16(src, k, n0, rows, weight_scale.data_ptr<float>(), block_n, block_k, k_blocks,
                               !one_block, reinterpret_cast<uint16_t*>(buffer.data_ptr()));
      return buffer.narrow(0, 0, rows);
    });
  } else {  // fp32 / fp16 models: plain ATen, at once
    at::Tensor w = weight.to(at::kFloat);  // [N, K]
    if (!one_block) w = w * rows_of_scales(weight_scale, block_n, n).repeat_interleave(block_k, 1).narrow(1, 0, k);
    out = at::mm(x, w.to(dtype).t()).to(at::kFloat);
  }
  return one_block ? out * x_scale * rows_of_scales(weight_scale, block_n, n).t() : out;
}

void check_fp8_args(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& weight,
                    const at::Tensor& weight_scale, int64_t block_n, int64_t block_k) {
  TORCH_CHECK(xq.dim() == 2 && weight.dim() == 2 && xq.size(1) == weight.size(1),
              "qrt_cpu::fp8_gemm: xq [M, K] and weight [N, K] expected, got ", xq.sizes(), " and ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat8_e4m3fn, "qrt_cpu::fp8_gemm: e4m3 weight expected, got ",
              weight.scalar_type());
  TORCH_CHECK(block_n > 0 && block_k > 0, "qrt_cpu::fp8_gemm: block sizes must be positive");
  const int64_t k_blocks = (weight.size(1) + block_k - 1) / block_k;
  TORCH_CHECK(weight_scale.dim() == 2 && weight_scale.size(0) == (weight.size(0) + block_n - 1) / block_n &&
                  weight_scale.size(1) == k_blocks && weight_scale.scalar_type() == at::kFloat,
              "qrt_cpu::fp8_gemm: fp32 weight_scale [ceil(N / block_n), ceil(K / block_k)] expected, got ",
              weight_scale.sizes(), " ", weight_scale.scalar_type());
  TORCH_CHECK(x_scale.dim() == 2 && x_scale.size(0) == xq.size(0) && x_scale.size(1) == k_blocks &&
                  x_scale.scalar_type() == at::kFloat,
              "qrt_cpu::fp8_gemm: fp32 x_scale [M, ceil(K / block_k)] expected, got ", x_scale.sizes());
}

at::Tensor fp8_gemm(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& weight,
                    const at::Tensor& weight_scale, int64_t block_n, int64_t block_k, int64_t min_rows_dequantized) {
  check_fp8_args(xq, x_scale, weight, weight_scale, block_n, block_k);
  at::Tensor xs = x_scale.contiguous(), w = weight.contiguous(), ws = weight_scale.contiguous();
  if (xq.size(0) >= min_rows_dequantized) return fp8_gemm_dequantized(xq.contiguous(), xs, w, ws, block_n, block_k);
  return fp8_gemv(xq, xs, w, ws, block_n, block_k);
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

at::Tensor int4pack_mm(const at::Tensor& x, const at::Tensor& packed, int64_t group_size,
                       const at::Tensor& scale_offsets, int64_t min_rows_dequantized) {
  const bool dequantize = x.size(0) >= min_rows_dequantized && x.scalar_type() == at::kBFloat16 &&
                          packed.size(0) % 64 == 0 && packed.is_contiguous();
  if (!dequantize) return at::_weight_int4pack_mm_for_cpu(x, packed, group_size, scale_offsets);
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  at::Tensor scales = scale_offsets.select(2, 0).to(at::kFloat).contiguous();   // [K / group, N]
  at::Tensor offsets = scale_offsets.select(2, 1).to(at::kFloat).contiguous();  // [K / group, N]
  const int64_t tile = tile_rows(k, 64);
  at::Tensor buffer = at::empty({k, std::min(tile, n)}, x.options());
  at::Tensor xc = x.contiguous();
  return tiled_mm(xc, n, tile, true, [&](int64_t n0, int64_t rows) {
    at::Tensor w = rows == buffer.size(1) ? buffer : at::empty({k, rows}, x.options());
    dequantize_int4pack_bf16(packed.data_ptr<uint8_t>(), k, n, group_size, scales.data_ptr<float>(),
                             offsets.data_ptr<float>(), n0, rows, reinterpret_cast<uint16_t*>(w.data_ptr()));
    return w;
  }).to(at::kBFloat16);
}

at::Tensor int8pack_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       int64_t min_rows_dequantized) {
  if (x.size(0) < min_rows_dequantized || x.scalar_type() != at::kBFloat16) {
    return at::_weight_int8pack_mm(x, weight, scales);
  }
  // The codes are exact in bf16; the per-channel scale is applied to the GEMM's output.
  at::Tensor out = tiled_mm(x, weight.size(0), tile_rows(weight.size(1), 16), false, [&](int64_t n0, int64_t rows) {
    return weight.narrow(0, n0, rows).to(at::kBFloat16);
  });
  return (out * scales.to(at::kFloat)).to(at::kBFloat16);
}

}  // namespace

TORCH_LIBRARY(qrt_cpu, m) {
  m.def("fp8_gemm(Tensor xq, Tensor x_scale, Tensor weight, Tensor weight_scale, int block_n, int block_k, "
        "int min_rows_dequantized) -> Tensor");
  m.def("int4pack_mm(Tensor x, Tensor packed, int group_size, Tensor scale_offsets, int min_rows_dequantized) -> Tensor");
  m.def("int8pack_mm(Tensor x, Tensor weight, Tensor scales, int min_rows_dequantized) -> Tensor");
}

TORCH_LIBRARY_IMPL(qrt_cpu, CPU, m) {
  m.impl("fp8_gemm", &fp8_gemm);
  m.impl("int4pack_mm", &int4pack_mm);
  m.impl("int8pack_mm", &int8pack_mm);
}
