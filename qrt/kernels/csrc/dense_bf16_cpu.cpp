// qrt's CPU kernel for dense bf16 linears, built with the others by qrt/kernels/native_cpu.py.
//
//   pack_bf16_pairs(weight bf16 [N, K]) -> [N / 64, K / 2, 64, 2]
//     qrt's layout for a dense bf16 weight: element (b, j, d, t) = W[64 b + d, 2 j + t]. A step of
//     the GEMV reads one (b, j): 256 contiguous bytes, the pairs (W[n, 2j], W[n, 2j + 1]) of 64
//     consecutive outputs, which is what vdpbf16ps multiplies with a broadcast pair of x. So the
//     outputs lie across the vector lanes and no horizontal sum is needed; the bytes are those of
//     the weight as stored (the same count), in another order.
//
//   bf16_linear(x [M, K] bf16, packed [N / 64, K / 2, 64, 2], bias [N]?) -> [M, N] bf16
//     Each packed block is read from memory once and then by every tile of kRowsPerTile activation
//     rows (a block of 64 outputs is 128 K bytes, so the later tiles find it in L2). This one loop
//     keeps up with oneDNN's prepacked GEMM at every M measured (bench/cpu_native_options.py:
//     1.4-2.0x at M = 1, 0.84-1.92x from M = 2 to 512), so there is no second route. Exact products
//     summed in fp32 (vdpbf16ps) in a fixed order per output: a row's result does not depend on
//     the other rows of its batch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kOutputs = 64;        // outputs per packed block (4 registers of 16 fp32 sums)
constexpr int kRowsPerTile = 4;         // activation rows per pass over a block: 16 accumulators
constexpr int64_t kPrefetchBytes = 4096;  // read-ahead within a block, as the other GEMVs

void check_packed(const at::Tensor& packed, const char* op) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kOutputs && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              op, ": a contiguous bf16 weight packed as [N / 64, K / 2, 64, 2] expected, got ", packed.sizes(), " ",
              packed.scalar_type());
}

at::Tensor pack_bf16_pairs(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.size(0) % kOutputs == 0 &&
                  weight.size(1) % 2 == 0,
              "qrt_cpu::pack_bf16_pairs: a bf16 weight [N, K] with N a multiple of 64 and K even expected, got ",
              weight.sizes(), " ", weight.scalar_type());
  const int64_t n = weight.size(0), k = weight.size(1);
  // [N, K] -> [N / 64, 64, K / 2, 2] -> [N / 64, K / 2, 64, 2]
  return weight.reshape({n / kOutputs, kOutputs, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// Rows [m0, m0 + Rows) of x against packed block b, written as bf16 (plus the bias) into out.
template <int Rows>
void gemv_block(const uint32_t* x_pairs, int64_t half_k, const uint16_t* block, int64_t b, const float* bias,
                uint16_t* out, int64_t n, int64_t m0) {
  __m512 acc[Rows][4];
  for (int r = 0; r < Rows; ++r) {
    for (int d = 0; d < 4; ++d) acc[r][d] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < half_k; ++j) {
    const uint16_t* step = block + j * kOutputs * 2;
    _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes + 128, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes + 192, _MM_HINT_T0);
    __m512i w[4];
    for (int d = 0; d < 4; ++d) w[d] = _mm512_loadu_si512(step + 32 * d);  // outputs 16 d .. 16 d + 15
    for (int r = 0; r < Rows; ++r) {
      const __m512bh xx = (__m512bh)_mm512_set1_epi32(static_cast<int>(x_pairs[(m0 + r) * half_k + j]));
      for (int d = 0; d < 4; ++d) acc[r][d] = _mm512_dpbf16_ps(acc[r][d], (__m512bh)w[d], xx);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    uint16_t* dst = out + (m0 + r) * n + b * kOutputs;
    for (int d = 0; d < 4; ++d) {
      __m512 v = acc[r][d];
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + b * kOutputs + 16 * d));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * d), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

template <int Rows>
void gemv_rows(const uint32_t* x_pairs, int64_t half_k, const uint16_t* block, int64_t b, const float* bias,
               uint16_t* out, int64_t n, int64_t m0, int64_t rows) {
  if constexpr (Rows > 1) {
    if (rows < Rows) return gemv_rows<Rows - 1>(x_pairs, half_k, block, b, bias, out, n, m0, rows);
  }
  gemv_block<Rows>(x_pairs, half_k, block, b, bias, out, n, m0);
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& packed, const float* bias) {
  const int64_t m_rows = x.size(0), blocks = packed.size(0), half_k = packed.size(1), n = blocks * kOutputs;
  at::Tensor out = at::empty({m_rows, n}, x.options());
  const uint32_t* x_pairs = reinterpret_cast<const uint32_t*>(x.data_ptr());  // (x[m, 2j], x[m, 2j + 1])
  const uint16_t* src = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  // Each thread takes a run of blocks: its weights are read once, front to back, for every row.
  at::parallel_for(0, blocks, 1, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      const uint16_t* block = src + b * half_k * kOutputs * 2;
      for (int64_t m0 = 0; m0 < m_rows; m0 += kRowsPerTile) {
        gemv_rows<kRowsPerTile>(x_pairs, half_k, block, b, bias, dst, n, m0,
                                std::min<int64_t>(kRowsPerTile, m_rows - m0));
      }
    }
  });
  return out;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  check_packed(packed, "qrt_cpu::bf16_linear");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == 2 * packed.size(1) && x.scalar_type() == at::kBFloat16,
              "qrt_cpu::bf16_linear: bf16 x [M, ", 2 * packed.size(1), "] expected, got ", x.sizes(), " ",
              x.scalar_type());
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == packed.size(0) * kOutputs),
              "qrt_cpu::bf16_linear: bias [", packed.size(0) * kOutputs, "] expected");
  const at::Tensor xc = x.contiguous();
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  return gemv(xc, packed, b.defined() ? b.data_ptr<float>() : nullptr);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(qrt_cpu, m) {
  m.def("pack_bf16_pairs(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(qrt_cpu, CPU, m) {
  m.impl("pack_bf16_pairs", &pack_bf16_pairs);
  m.impl("bf16_linear", &bf16_linear);
}
