// qrt's CPU kernel for dense bf16 linears, built with the others by qrt/kernels/native_cpu.py.
//
//   pack_bf16_pairs(weight bf16 [N, K]) -> [N / 64, K / 2, 64, 2]
//     qrt's pair layout for a dense bf16 weight (pair_gemv.h): the bytes of the weight as stored
//     (the same count), in another order.
//
//   bf16_linear(x [M, K] bf16, packed [N / 64, K / 2, 64, 2], bias [N]?) -> [M, N] bf16
//     The loop of pair_gemv.h on the stored pairs. It keeps up with oneDNN's prepacked GEMM at
//     every M measured (bench/probes/cpu_native_options.py: 1.4-2.0x at M = 1, 0.84-1.92x from M = 2 to
//     512), so there is no second route.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "pair_gemv.h"

namespace {

using qrt_pairs::kOutputs;

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

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  check_packed(packed, "qrt_cpu::bf16_linear");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == 2 * packed.size(1) && x.scalar_type() == at::kBFloat16,
              "qrt_cpu::bf16_linear: bf16 x [M, ", 2 * packed.size(1), "] expected, got ", x.sizes(), " ",
              x.scalar_type());
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == packed.size(0) * kOutputs),
              "qrt_cpu::bf16_linear: bias [", packed.size(0) * kOutputs, "] expected");
  const at::Tensor xc = x.contiguous();
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  qrt_pairs::Epilogue epilogue;
  epilogue.bias = b.defined() ? b.data_ptr<float>() : nullptr;
  return qrt_pairs::gemv<qrt_pairs::Bf16Source>(xc, reinterpret_cast<const uint16_t*>(packed.data_ptr()),
                                                packed.size(0), packed.size(1), epilogue, /*widen_once=*/false);
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
