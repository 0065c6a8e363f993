// qrt's decode attention on the CPU (AVX-512), built with quantized_cpu.cpp by
// qrt/kernels/native_cpu.py into the `qrt_cpu` namespace:
//
//   decode_attention(q [B, H, hd], k_cache [N, KVH, S, hd], v_cache [N, KVH, S, hd], slots [B],
//                    first [B], last [B], scale, softcap, k_scale?, v_scale?) -> [B, H, hd]
//
// Batch row b attends, with its query heads grouped by KV head (G = H / KVH query heads share one
// read of each K and V row), over entries first[b] .. last[b] (inclusive) of cache row slots[b],
// in place: no copy of the attended part of the cache is made. The cache is bf16, fp16, fp32 (the
// q dtype) or e4m3 read as bytes, each value times k_scale (v_scale) and rounded to q's dtype as
// qrt.decode_attention (decode_attention_reference.py) dequantizes it.
//
// The entries are cut into chunks of kChunkEntries counted from first[b]; each (row, KV head,
// chunk) is one unit of work, done by one thread: scores in fp32 (times scale, then softcap *
// tanh(score / softcap) when softcap > 0), the chunk's max, exp, the sum of the weights and the
// weighted sum of V rows, in entry order. The chunks are then merged in chunk order. So the
// reduction order depends only on the row's own first and last entry: never on the other rows of
// the batch, on their lengths or on the number of threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kChunkEntries = 256;  // cache entries per unit of work
constexpr int64_t kMaxGroup = 16;       // query heads per KV head
constexpr int64_t kMaxHeadDim = 512;

// e^x in fp32 (Cephes' expf polynomial on x - n ln 2, scaled by 2^n): within 2 ulp of expf.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));  // e^-104 is below the smallest fp32: 0
  x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// cap * tanh(s / cap), with tanh(y) = 1 - 2 / (e^{2y} + 1).
inline __m512 softcap_ps(__m512 s, float cap) {
  const __m512 e = exp_ps(_mm512_mul_ps(s, _mm512_set1_ps(2.0f / cap)));
  const __m512 t = _mm512_sub_ps(_mm512_set1_ps(1.0f),
                                 _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
  return _mm512_mul_ps(t, _mm512_set1_ps(cap));
}

inline __mmask16 lanes(int64_t remaining) {
  return remaining >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << remaining) - 1);
}

// The model dtypes: 16 values loaded as fp32, fp32 rounded to the dtype and back, and stored.
struct F32 {
  using type = float;
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 round(__m512 v) { return v; }
  static void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
};

struct BF16 {
  using type = c10::BFloat16;
  static __m512 load(const c10::BFloat16* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static __m256i narrow(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }  // round to nearest even
  static __m512 round(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow(v)), 16));
  }
  static void store(c10::BFloat16* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow(v)); }
};

struct F16 {
  using type = c10::Half;
  static __m512 load(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m256i narrow(__m512 v) { return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static __m512 round(__m512 v) { return _mm512_cvtph_ps(narrow(v)); }
  static void store(c10::Half* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow(v)); }
};

// e4m3 code -> fp32, all 256 codes (NaN codes read as NaN).
const float* fp8_values() {
  static const auto table = [] {
    std::array<float, 256> values{};
    for (int code = 0; code < 256; ++code)
      values[code] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(code), c10::Float8_e4m3fn::from_bits()));
    return values;
  }();
  return table.data();
}

// How a cache row is read: the model dtype as stored, or e4m3 bytes dequantized to it.
template <class Model>
struct PlainCache {
  using type = typename Model::type;
  static void widen(const type* row, int64_t hd, float /*scale*/, float* out) {
    for (int64_t j = 0; j < hd; j += 16) _mm512_storeu_ps(out + j, Model::load(row + j));
  }
};

template <class Model>
struct Fp8Cache {
  using type = uint8_t;
  static void widen(const uint8_t* row, int64_t hd, float scale, float* out) {
    const float* table = fp8_values();
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t j = 0; j < hd; j += 16) {
      const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + j)));
      _mm512_storeu_ps(out + j, Model::round(_mm512_mul_ps(_mm512_i32gather_ps(codes, table, 4), s)));
    }
  }
};

inline float dot(const float* a, const float* b, int64_t hd) {
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
  for (int64_t j = 16; j < hd; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), acc);
  return _mm512_reduce_add_ps(acc);
}

struct Shape {
  int64_t rows, heads, kv_heads, group, length, hd;
};

// One unit: G query heads (q32 [G, hd], fp32) over cache entries lo .. hi-1 of one (slot, KV
// head). Writes [G, 2 + hd]: the chunk's max score, the sum of its weights, the weighted V sum.
template <class Cache>
void attend_chunk(const float* q32, const typename Cache::type* k_rows, const typename Cache::type* v_rows,
                  int64_t lo, int64_t hi, const Shape& s, float scale, float softcap, float k_scale, float v_scale,
                  float* partial) {
  const int64_t count = hi - lo, hd = s.hd, g_count = s.group;
  alignas(64) float scores[kMaxGroup][kChunkEntries];
  alignas(64) float row[kMaxHeadDim];
  for (int64_t t = 0; t < count; ++t) {  // each K row read once for the G heads
    Cache::widen(k_rows + (lo + t) * hd, hd, k_scale, row);
    for (int64_t g = 0; g < g_count; ++g) scores[g][t] = dot(q32 + g * hd, row, hd) * scale;
  }
  for (int64_t g = 0; g < g_count; ++g) {
    float* out = partial + g * (2 + hd);
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < count; t += 16) {
      const __mmask16 m = lanes(count - t);
      __m512 v = _mm512_maskz_loadu_ps(m, scores[g] + t);
      if (softcap > 0) v = softcap_ps(v, softcap);
      _mm512_mask_storeu_ps(scores[g] + t, m, v);
      vmax = _mm512_mask_max_ps(vmax, m, vmax, v);
    }
    const float chunk_max = _mm512_reduce_max_ps(vmax);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < count; t += 16) {
      const __mmask16 m = lanes(count - t);
      const __m512 w = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores[g] + t),
                                                                   _mm512_set1_ps(chunk_max))));
      _mm512_mask_storeu_ps(scores[g] + t, m, w);
      sum = _mm512_add_ps(sum, w);
    }
    out[0] = chunk_max;
    out[1] = _mm512_reduce_add_ps(sum);
    std::memset(out + 2, 0, hd * sizeof(float));
  }
  for (int64_t t = 0; t < count; ++t) {  // each V row read once for the G heads
    Cache::widen(v_rows + (lo + t) * hd, hd, v_scale, row);
    for (int64_t g = 0; g < g_count; ++g) {
      float* acc = partial + g * (2 + hd) + 2;
      const __m512 w = _mm512_set1_ps(scores[g][t]);
      for (int64_t j = 0; j < hd; j += 16)
        _mm512_storeu_ps(acc + j, _mm512_fmadd_ps(w, _mm512_loadu_ps(row + j), _mm512_loadu_ps(acc + j)));
    }
  }
}

template <class Model, class Cache>
void decode_attention_typed(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const int64_t* slots, const int64_t* first, const int64_t* last, const Shape& s,
                            float scale, float softcap, float k_scale, float v_scale, at::Tensor& out) {
  using QT = typename Model::type;
  using CT = typename Cache::type;
  const QT* q_data = q.data_ptr<QT>();
  const CT* k_data = static_cast<const CT*>(k_cache.data_ptr());
  const CT* v_data = static_cast<const CT*>(v_cache.data_ptr());
  QT* out_data = out.data_ptr<QT>();
  // Units: (row, KV head, chunk), numbered row-major; unit_start[r] = the first unit of row r.
  std::vector<int64_t> unit_start(s.rows + 1, 0);
  for (int64_t r = 0; r < s.rows; ++r) {
    const int64_t chunks = (last[r] - first[r] + kChunkEntries) / kChunkEntries;
    unit_start[r + 1] = unit_start[r] + s.kv_heads * chunks;
  }
  const int64_t units = unit_start[s.rows], stride = s.group * (2 + s.hd);
  at::Tensor partials = at::empty({units, stride}, q.options().dtype(at::kFloat));
  float* part = partials.data_ptr<float>();
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float q32[kMaxGroup * kMaxHeadDim];
    for (int64_t u = begin; u < end; ++u) {
      const int64_t r = std::upper_bound(unit_start.begin(), unit_start.end(), u) - unit_start.begin() - 1;
      const int64_t chunks = (unit_start[r + 1] - unit_start[r]) / s.kv_heads;
      const int64_t h = (u - unit_start[r]) / chunks, c = (u - unit_start[r]) % chunks;
      const QT* q_row = q_data + (r * s.heads + h * s.group) * s.hd;  // this KV head's G query heads
      for (int64_t j = 0; j < s.group * s.hd; j += 16) _mm512_storeu_ps(q32 + j, Model::load(q_row + j));
      const int64_t base = (slots[r] * s.kv_heads + h) * s.length * s.hd;
      const int64_t lo = first[r] + c * kChunkEntries, hi = std::min(lo + kChunkEntries, last[r] + 1);
      attend_chunk<Cache>(q32, k_data + base, v_data + base, lo, hi, s, scale, softcap, k_scale, v_scale,
                          part + u * stride);
    }
  });
  // Merge each (row, KV head)'s chunks in chunk order.
  at::parallel_for(0, s.rows * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float merged[kMaxHeadDim];
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / s.kv_heads, h = rh % s.kv_heads;
      const int64_t chunks = (unit_start[r + 1] - unit_start[r]) / s.kv_heads;
      const float* unit = part + (unit_start[r] + h * chunks) * stride;
      for (int64_t g = 0; g < s.group; ++g) {
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < chunks; ++c) top = std::max(top, unit[c * stride + g * (2 + s.hd)]);
        float total = 0.0f;
        std::fill(merged, merged + s.hd, 0.0f);
        for (int64_t c = 0; c < chunks; ++c) {
          const float* p = unit + c * stride + g * (2 + s.hd);
          const float weight = std::exp(p[0] - top);
          total += p[1] * weight;
          for (int64_t j = 0; j < s.hd; ++j) merged[j] += p[2 + j] * weight;
        }
        QT* dst = out_data + (r * s.heads + h * s.group + g) * s.hd;
        const __m512 inverse = _mm512_set1_ps(1.0f / total);
        for (int64_t j = 0; j < s.hd; j += 16) Model::store(dst + j, _mm512_mul_ps(_mm512_loadu_ps(merged + j), inverse));
      }
    }
  });
}

float scale_value(const c10::optional<at::Tensor>& scale) {
  return scale.has_value() ? scale->to(at::kFloat).item<float>() : 1.0f;
}

template <class Model>
void dispatch_cache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* slots,
                    const int64_t* first, const int64_t* last, const Shape& s, double scale, double softcap,
                    const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale, at::Tensor& out) {
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {
    decode_attention_typed<Model, Fp8Cache<Model>>(q, k_cache, v_cache, slots, first, last, s, scale, softcap,
                                                   scale_value(k_scale), scale_value(v_scale), out);
  } else {
    TORCH_CHECK(k_cache.scalar_type() == q.scalar_type(), "decode_attention: a cache of ", k_cache.scalar_type(),
                " for queries of ", q.scalar_type());
    decode_attention_typed<Model, PlainCache<Model>>(q, k_cache, v_cache, slots, first, last, s, scale, softcap,
                                                     1.0f, 1.0f, out);
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& first, const at::Tensor& last, double scale,
                            double softcap, const c10::optional<at::Tensor>& k_scale,
                            const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "decode_attention: q [B, H, hd] and caches [N, KVH, S, hd] expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "decode_attention: K and V caches differ in dtype");
  const Shape s{q.size(0), q.size(1), k_cache.size(1), q.size(1) / k_cache.size(1), k_cache.size(2), q.size(2)};
  TORCH_CHECK(s.hd == k_cache.size(3) && s.hd % 16 == 0 && s.hd <= kMaxHeadDim,
              "decode_attention: head_dim must be a multiple of 16, at most ", kMaxHeadDim, "; got ", s.hd);
  TORCH_CHECK(s.heads % s.kv_heads == 0 && s.group <= kMaxGroup, "decode_attention: ", s.heads,
              " query heads over ", s.kv_heads, " KV heads (at most ", kMaxGroup, " per KV head)");
  at::Tensor qc = q.contiguous();
  at::Tensor slot_rows = slots.to(at::kLong).contiguous(), first_rows = first.to(at::kLong).contiguous(),
             last_rows = last.to(at::kLong).contiguous();
  const int64_t* sl = slot_rows.data_ptr<int64_t>();
  const int64_t* lo = first_rows.data_ptr<int64_t>();
  const int64_t* hi = last_rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < s.rows; ++r)
    TORCH_CHECK(sl[r] >= 0 && sl[r] < k_cache.size(0) && lo[r] >= 0 && lo[r] <= hi[r] && hi[r] < s.length,
                "decode_attention: row ", r, " attends entries ", lo[r], "..", hi[r], " of cache row ", sl[r],
                "; the cache holds ", k_cache.size(0), " rows of ", s.length, " entries");
  at::Tensor out = at::empty_like(qc);
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_cache<F32>(qc, k_cache, v_cache, sl, lo, hi, s, scale, softcap, k_scale, v_scale, out); break;
    case at::kBFloat16: dispatch_cache<BF16>(qc, k_cache, v_cache, sl, lo, hi, s, scale, softcap, k_scale, v_scale, out); break;
    case at::kHalf: dispatch_cache<F16>(qc, k_cache, v_cache, sl, lo, hi, s, scale, softcap, k_scale, v_scale, out); break;
    default: TORCH_CHECK(false, "decode_attention: queries of ", q.scalar_type(), " are not supported");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(qrt_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor first, Tensor last, "
        "float scale, float softcap, Tensor? k_scale, Tensor? v_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(qrt_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
