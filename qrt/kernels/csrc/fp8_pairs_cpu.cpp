// qrt's CPU kernel for fp8 (e4m3) linears with one weight scale per output channel and the
// activations quantized per token (or with a static scale), built with the others by
// qrt/kernels/native_cpu.py.
//
//   fp8_pairs_linear(x [M, K] bf16, packed e4m3 [N / 64, K / 2, 64, 2], weight_scale fp32 [N],
//                    bias [N]?, input_scale [1]?) -> [M, N] bf16
//     x is quantized to e4m3 exactly as the reference ops do (fp8_codes.h): per row, or with the
//     static input_scale. Then the loop of pair_gemv.h on the codes, widened in registers by table
//     lookup (exact in bf16), and out[m, n] = x_scale[m] * weight_scale[n] * sum_k xq[m, k] * w[n, k]
//     (+ bias[n]), both scales applied once to the fp32 sum. From more rows than one tile, each
//     block is widened once into a bf16 block that every tile then reads from L2.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "fp8_codes.h"
#include "pair_gemv.h"

namespace {

using qrt_pairs::kOutputs;

// e4m3 codes, 128 bytes a step in the order the byte unpack of widen_fp8x64 produces (see
// pack_weight in fp8_pairs_cpu.py): within each 64-byte half h and 128-bit lane L, bytes 0-7 are
// the pairs of outputs 32 h + 4 L + (0..3) and bytes 8-15 those of outputs 32 h + 16 + 4 L + (0..3).
struct Fp8Source {
  using Element = uint8_t;
  static void load(const Element* step, __m512i w[4]) {
    const qrt_fp8::Fp8Tables& t = qrt_fp8::fp8_tables();
    for (int h = 0; h < 2; ++h) {
      // unpacklo: outputs 32 h + 0..15; unpackhi: outputs 32 h + 16..31
      qrt_fp8::widen_fp8x64(_mm512_loadu_si512(step + 64 * h), t, w[2 * h], w[2 * h + 1]);
    }
  }
};

at::Tensor fp8_pairs_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& weight_scale,
                            const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& input_scale) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kOutputs && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kFloat8_e4m3fn && packed.is_contiguous(),
              "qrt_cpu::fp8_pairs_linear: a contiguous e4m3 weight packed as [N / 64, K / 2, 64, 2] expected, got ",
              packed.sizes(), " ", packed.scalar_type());
  const int64_t n = packed.size(0) * kOutputs, k = 2 * packed.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kBFloat16,
              "qrt_cpu::fp8_pairs_linear: bf16 x [M, ", k, "] expected, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(weight_scale.dim() == 1 && weight_scale.size(0) == n && weight_scale.scalar_type() == at::kFloat &&
                  weight_scale.is_contiguous(),
              "qrt_cpu::fp8_pairs_linear: contiguous fp32 weight_scale [", n, "] expected, got ", weight_scale.sizes(),
              " ", weight_scale.scalar_type());
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n),
              "qrt_cpu::fp8_pairs_linear: bias [", n, "] expected");
  at::Tensor q, x_scale;  // [M, K] bf16 holding e4m3 values, [M, 1] fp32
  qrt_fp8::quantize_activations(x.contiguous(), k, input_scale.value_or(at::Tensor()), q, x_scale);
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  qrt_pairs::Epilogue epilogue;
  epilogue.row_scales = x_scale.data_ptr<float>();
  epilogue.fp32_scales = weight_scale.data_ptr<float>();
  epilogue.bias = b.defined() ? b.data_ptr<float>() : nullptr;
  const bool widen_once = x.size(0) > qrt_pairs::kRowsPerTile;
  return qrt_pairs::gemv<Fp8Source>(q, reinterpret_cast<const uint8_t*>(packed.data_ptr()), packed.size(0),
                                    packed.size(1), epilogue, widen_once);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(qrt_cpu, m) {
  m.def("fp8_pairs_linear(Tensor x, Tensor packed, Tensor weight_scale, Tensor? bias, Tensor? input_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(qrt_cpu, CPU, m) {
  m.impl("fp8_pairs_linear", &fp8_pairs_linear);
}
