// qrt's CPU kernel for int8 weight-only linears with one scale per output channel, built with the
// others by qrt/kernels/native_cpu.py.
//
//   int8_pairs_linear(x [M, K] bf16, packed int8 [N / 64, K / 2, 64, 2], scales [N] bf16 or fp32,
//                     bias [N]?) -> [M, N] bf16
//     The loop of pair_gemv.h on int8 codes in the pair layout (128 bytes a step): each step's
//     codes are widened in registers to bf16 (exact: |q| <= 128), and each output's fp32 sum is
//     multiplied by its channel's scale once, as it is written. From more rows than one tile,
//     each block is widened once into a bf16 block that every tile then reads from L2.
//     out[m, n] = scales[n] * sum_k x[m, k] * q[n, k] (+ bias[n]).

#include <ATen/ATen.h>
#include <torch/library.h>

#include "pair_gemv.h"

namespace {

using qrt_pairs::Int8Source;
using qrt_pairs::kOutputs;

at::Tensor int8_pairs_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                             const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kOutputs && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kChar && packed.is_contiguous(),
              "qrt_cpu::int8_pairs_linear: a contiguous int8 weight packed as [N / 64, K / 2, 64, 2] expected, got ",
              packed.sizes(), " ", packed.scalar_type());
  const int64_t n = packed.size(0) * kOutputs, k = 2 * packed.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kBFloat16,
              "qrt_cpu::int8_pairs_linear: bf16 x [M, ", k, "] expected, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == n && scales.is_contiguous() &&
                  (scales.scalar_type() == at::kBFloat16 || scales.scalar_type() == at::kFloat),
              "qrt_cpu::int8_pairs_linear: contiguous bf16 or fp32 scales [", n, "] expected, got ", scales.sizes(),
              " ", scales.scalar_type());
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n),
              "qrt_cpu::int8_pairs_linear: bias [", n, "] expected");
  const at::Tensor xc = x.contiguous();
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  qrt_pairs::Epilogue epilogue;
  if (scales.scalar_type() == at::kBFloat16) {
    epilogue.bf16_scales = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  } else {
    epilogue.fp32_scales = scales.data_ptr<float>();
  }
  epilogue.bias = b.defined() ? b.data_ptr<float>() : nullptr;
  const bool widen_once = x.size(0) > qrt_pairs::kRowsPerTile;
  return qrt_pairs::gemv<Int8Source>(xc, packed.data_ptr<int8_t>(), packed.size(0), packed.size(1), epilogue,
                                     widen_once);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(qrt_cpu, m) {
  m.def("int8_pairs_linear(Tensor x, Tensor packed, Tensor scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(qrt_cpu, CPU, m) {
  m.impl("int8_pairs_linear", &int8_pairs_linear);
}
