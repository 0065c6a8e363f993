// qrt's CPU kernel for the LoRA product of each batch row (qrt/kernels/lora_cpu.py), built with
// the others by qrt/kernels/native_cpu.py.
//
//   lora_add(y [B, ..., N], x [B, ..., K], a [S, W, K], b [S, W, N], rows [R >= B] int64) -> [B, ..., N]
//     y, the base layer's output, plus each row's product: row i's tokens get
//     (x @ a[rows[i]]ᵀ) @ b[rows[i]] (b holds B transposed), the shrink rounded to x's dtype before
//     the expand (as PEFT's two Linears round), each product summed in fp32 and rounded to the
//     dtype, then added to y and rounded again (as y + delta would). bf16 or fp32 throughout. Slot
//     0 holds no adapter: its rows are y, and the slot is not read.
//
// At decode a call has a few tokens, and the work is reading each row's pair once: ATen's batched
// GEMM on the gathered pairs spends 20 µs a product on bf16 shapes this small, and a Python
// custom op adds about 28 µs a call; the sum with y is done here too, which saves the graph a
// kernel and a tensor per adapted layer. Here the graph's C++ wrapper calls the kernel directly, and a
// token's shrink is W dot products over the slot's rows of a, in place; its expand streams the W
// rows of b into fp32 sums (no horizontal sums); rows with the same adapter share the reading. From kFewTokens tokens on
// (prefill), the pairs are gathered once per row and ATen's batched GEMM runs, where the tokens
// amortize it.

#include <ATen/ATen.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "fp8_codes.h"

namespace {

constexpr int64_t kFewTokens = 16;  // tokens in all, up to which the dot-product loop runs

using qrt_fp8::mask16;

// 16 values of T (bf16 or fp32) from p, up to `mask`, as fp32: fp8_codes.h's activation loader,
// its dtype known when compiled.
template <typename T>
inline __m512 load16(const T* p, __mmask16 mask) {
  return qrt_fp8::load_activations(p, std::is_same_v<T, at::BFloat16>, 0, mask);
}

// sum_j u[j] * v[j] over n values, u in T, v in fp32.
template <typename T>
inline float dot(const T* u, const float* v, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mask = mask16(n - j);
    acc = _mm512_fmadd_ps(load16(u + j, mask), load16(v + j, mask), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// One thread: a decode call's work is a few microseconds of reading, which a parallel region's
// start and join would cost as much as it saves (measured: 31 µs a layer on one thread against 43
// on two, the default model's four adapted layers at batch 1; at batch 8, splitting the expand
// over two threads took 290 µs a layer against 160). The tokens of every row with the
// same adapter are done together, so that a slot's pair is read from memory once per call however
// many rows use it; each token's sums run in the same order either way, so a row's result does not
// depend on the others.
template <typename T>
void few_tokens(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                const int64_t* slots, int64_t batch, at::Tensor& out) {
  const int64_t k = a.size(2), width = a.size(1), n = b.size(2);
  const int64_t tokens = x.numel() / (batch * k);
  const T* xs = x.data_ptr<T>();
  const T* ys = y.data_ptr<T>();
  const T* as = a.data_ptr<T>();
  const T* bs = b.data_ptr<T>();
  T* os = out.data_ptr<T>();
  std::vector<int64_t> group;  // the tokens of the rows that use one slot
  std::vector<float> xf, shrunk, sums;
  std::vector<bool> done(batch, false);
  for (int64_t first = 0; first < batch; ++first) {
    if (done[first]) continue;
    const int64_t slot = slots[first];
    group.clear();
    for (int64_t row = first; row < batch; ++row) {
      if (slots[row] != slot) continue;
      done[row] = true;
      for (int64_t t = 0; t < tokens; ++t) group.push_back(row * tokens + t);
    }
    if (slot == 0) {  // no adapter: the base's output
      for (const int64_t token : group) std::copy(ys + token * n, ys + (token + 1) * n, os + token * n);
      continue;
    }
    const int64_t count = static_cast<int64_t>(group.size());
    const T* a_slot = as + slot * width * k;  // [W, K]
    const T* b_slot = bs + slot * width * n;  // [W, N]
    xf.resize(count * k);
    shrunk.resize(count * width);
    sums.assign(count * n, 0.0f);
    for (int64_t g = 0; g < count; ++g) {
      for (int64_t j = 0; j < k; ++j) xf[g * k + j] = static_cast<float>(xs[group[g] * k + j]);
    }
    // Shrink: each row of a against every token, while it is in cache.
    for (int64_t w = 0; w < width; ++w) {
      for (int64_t g = 0; g < count; ++g) shrunk[g * width + w] = round_to<T>(dot(a_slot + w * k, xf.data() + g * k, k));
    }
    // Expand: each row of b, streamed once, into every token's fp32 sums, 16 outputs at a time
    // for up to four tokens at once (each vector of b widened once for them).
    const auto expand = [&](int64_t begin, int64_t end) {
      for (int64_t w = 0; w < width; ++w) {
        const T* row = b_slot + w * n;
        for (int64_t g0 = 0; g0 < count; g0 += 4) {
          const int64_t some = std::min<int64_t>(4, count - g0);
          __m512 scale[4];
          for (int64_t g = 0; g < some; ++g) scale[g] = _mm512_set1_ps(shrunk[(g0 + g) * width + w]);
          for (int64_t j = begin; j < end; j += 16) {
            const __mmask16 mask = mask16(end - j);
            const __m512 value = load16(row + j, mask);
            for (int64_t g = 0; g < some; ++g) {
              float* sum = sums.data() + (g0 + g) * n + j;
              _mm512_mask_storeu_ps(sum, mask, _mm512_fmadd_ps(scale[g], value, _mm512_maskz_loadu_ps(mask, sum)));
            }
          }
        }
      }
    };
    expand(0, n);
    for (int64_t g = 0; g < count; ++g) {
      const int64_t token = group[g];
      for (int64_t j = 0; j < n; ++j) {
        os[token * n + j] = static_cast<T>(static_cast<float>(ys[token * n + j]) + round_to<T>(sums[g * n + j]));
      }
    }
  }
}

at::Tensor lora_add(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                    const at::Tensor& rows) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(1) == b.size(1) &&
                  x.size(-1) == a.size(2) && a.scalar_type() == x.scalar_type() &&
                  b.scalar_type() == x.scalar_type() && a.is_contiguous() && b.is_contiguous(),
              "qrt_cpu::lora_add: x [B, ..., K], contiguous a [S, W, K] and b [S, W, N] of x's dtype expected, got ",
              x.sizes(), " ", a.sizes(), " ", b.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "qrt_cpu::lora_add: bf16 or fp32 expected, got ", x.scalar_type());
  const int64_t batch = x.size(0), k = x.size(-1), n = b.size(2);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  TORCH_CHECK(y.sizes() == at::IntArrayRef(out_shape) && y.scalar_type() == x.scalar_type(),
              "qrt_cpu::lora_add: y ", at::IntArrayRef(out_shape), " of x's dtype expected, got ", y.sizes());
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) >= batch && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "qrt_cpu::lora_add: rows [R >= ", batch, "] int64 expected, got ", rows.sizes());
  const int64_t* slots = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < batch; ++i) {
    TORCH_CHECK(slots[i] >= 0 && slots[i] < a.size(0), "qrt_cpu::lora_add: adapter slot ", slots[i], " of row ", i,
                " is outside the ", a.size(0), " slots");
  }
  const at::Tensor xc = x.contiguous(), yc = y.contiguous();
  if (x.numel() / k > kFewTokens) {
    const at::Tensor slot = rows.narrow(0, 0, batch);
    const at::Tensor flat = xc.reshape({batch, -1, k});                                // [B, T, K]
    const at::Tensor shrunk = at::bmm(flat, a.index_select(0, slot).transpose(1, 2));  // [B, T, W]
    return yc + at::bmm(shrunk, b.index_select(0, slot)).reshape(out_shape);
  }
  at::Tensor out = at::empty(out_shape, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    few_tokens<at::BFloat16>(yc, xc, a, b, slots, batch, out);
  } else {
    few_tokens<float>(yc, xc, a, b, slots, batch, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(qrt_cpu, m) { m.def("lora_add(Tensor y, Tensor x, Tensor a, Tensor b, Tensor rows) -> Tensor"); }

TORCH_LIBRARY_IMPL(qrt_cpu, CPU, m) { m.impl("lora_add", &lora_add); }
