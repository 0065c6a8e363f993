// qrt's decode attention on the CPU (AVX-512), built with quantized_cpu.cpp by
// qrt/kernels/native_cpu.py into the `qrt_cpu` namespace:
//
//   decode_attention(q [B, H, hd], k_cache [N, KVH, S, hd], v_cache [N, KVH, S, hd], slots [B],
//                    first [B], last [B], scale, softcap, k_scale?, v_scale?, sinks? [H]) -> [B, H, hd]
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
// weighted sum of V rows, in entry order. The thread that finishes the last chunk of a (row, KV
// head) merges its chunks, in chunk order, so one parallel region does the whole call. The
// reduction order depends only on the row's own first and last entry: never on the other rows of
// the batch, on their lengths, on the number of threads or on which thread merges.
//
// Two ways through a chunk:
// - bf16 queries over a bf16 cache with head_dim 64, 128 or 256 (every bf16 model qrt runs but
//   Phi-3's 96): K rows multiplied as bf16 pairs by vdpbf16ps straight from the cache (products
//   exact in fp32, summed in fp32), V rows widened in registers, the weighted V sums of up to four
//   heads kept in registers across the chunk;
// - everything else: the chunk's K and V widened to fp32 into a per-thread buffer first.
// Both take the dot products of 16 entries together and sum their lanes by one shuffle tree, in
// place of 16 horizontal sums.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

// Cache entries per unit of work: small enough that a row's units spread evenly over the threads
// (3 KV heads at 600 entries make 15 units), large enough that the per-unit work (its queries,
// its partial sums and their merge) stays small beside the chunk's.
constexpr int64_t kChunkEntries = 128;
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

// How a cache row is read: `count` consecutive rows of hd values, widened to fp32 into out
// [count, hd] (the model dtype as stored, or e4m3 bytes dequantized to it).
template <class Model>
struct PlainCache {
  using type = typename Model::type;
  static void widen(const type* rows, int64_t count, int64_t hd, float /*scale*/, float* out) {
    for (int64_t j = 0; j < count * hd; j += 16) _mm512_storeu_ps(out + j, Model::load(rows + j));
  }
};

template <class Model>
struct Fp8Cache {
  using type = uint8_t;
  static void widen(const uint8_t* rows, int64_t count, int64_t hd, float scale, float* out) {
    const float* table = fp8_values();
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t j = 0; j < count * hd; j += 16) {
      const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + j)));
      _mm512_storeu_ps(out + j, Model::round(_mm512_mul_ps(_mm512_i32gather_ps(codes, table, 4), s)));
    }
  }
};

inline __m512 add_unpacked(__m512 a, __m512 b) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}

inline __m512 add_unpacked_pairs(__m512 a, __m512 b) {  // per 128-bit lane: [a0+a2, a1+a3, b0+b2, b1+b3]
  const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

inline __m512 add_quarters(__m512 a, __m512 b) {  // 128-bit lanes [a0+a1, a2+a3, b0+b1, b2+b3]
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}

// Lane e of the result: the sum of the 16 lanes of v[e], by a fixed tree of lane shuffles (about
// 45 instructions for the 16 sums, where 16 horizontal sums take about 10 each).
inline __m512 sum_lanes16(const __m512* v) {
  __m512 pairs[8], quads[4], octets[2];
  for (int i = 0; i < 8; ++i) pairs[i] = add_unpacked(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 4; ++i) quads[i] = add_unpacked_pairs(pairs[2 * i], pairs[2 * i + 1]);
  for (int i = 0; i < 2; ++i) octets[i] = add_quarters(quads[2 * i], quads[2 * i + 1]);
  return add_quarters(octets[0], octets[1]);
}

// The dot products of one query head q [hd] with 16 consecutive rows k [16, hd], all fp32.
inline __m512 dot16(const float* q, const float* k, int64_t hd) {
  __m512 acc[16];
  const __m512 q0 = _mm512_loadu_ps(q);
#pragma GCC unroll 16
  for (int e = 0; e < 16; ++e) acc[e] = _mm512_mul_ps(q0, _mm512_loadu_ps(k + e * hd));
  for (int64_t j = 16; j < hd; j += 16) {
    const __m512 qj = _mm512_loadu_ps(q + j);
#pragma GCC unroll 16
    for (int e = 0; e < 16; ++e) acc[e] = _mm512_fmadd_ps(qj, _mm512_loadu_ps(k + e * hd + j), acc[e]);
  }
  return sum_lanes16(acc);
}

// out[p] (P vectors of 16) = sum over t < count of w[t] * v[t, p], v rows of hd fp32, t in order.
template <int P>
void weighted_rows(const float* w, const float* v, int64_t count, int64_t hd, float* out) {
  __m512 acc[P];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) acc[p] = _mm512_setzero_ps();
  for (int64_t t = 0; t < count; ++t) {
    const __m512 wt = _mm512_set1_ps(w[t]);
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) acc[p] = _mm512_fmadd_ps(wt, _mm512_loadu_ps(v + t * hd + 16 * p), acc[p]);
  }
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) _mm512_storeu_ps(out + 16 * p, acc[p]);
}

void weighted_sum(const float* w, const float* v, int64_t count, int64_t hd, float* out) {
  for (int64_t j = 0; j < hd; j += 128) {  // up to 8 accumulators at a time, kept in registers
    switch (std::min<int64_t>(8, (hd - j) / 16)) {
      case 8: weighted_rows<8>(w, v + j, count, hd, out + j); break;
      case 7: weighted_rows<7>(w, v + j, count, hd, out + j); break;
      case 6: weighted_rows<6>(w, v + j, count, hd, out + j); break;
      case 5: weighted_rows<5>(w, v + j, count, hd, out + j); break;
      case 4: weighted_rows<4>(w, v + j, count, hd, out + j); break;
      case 3: weighted_rows<3>(w, v + j, count, hd, out + j); break;
      case 2: weighted_rows<2>(w, v + j, count, hd, out + j); break;
      default: weighted_rows<1>(w, v + j, count, hd, out + j); break;
    }
  }
}

struct Shape {
  int64_t rows, heads, kv_heads, group, length, hd;
};

// One unit: G query heads (q32 [G, hd], fp32) over cache entries lo .. hi-1 of one (slot, KV
// head), with scratch for the chunk's K and V widened to fp32 ([2, kChunkEntries, hd]). Writes
// [G, 2 + hd]: the chunk's max score, the sum of its weights, the weighted V sum.
template <class Cache>
void attend_chunk(const float* q32, const typename Cache::type* k_rows, const typename Cache::type* v_rows,
                  int64_t lo, int64_t hi, const Shape& s, float scale, float softcap, float k_scale, float v_scale,
                  float* scratch, float* partial) {
  const int64_t count = hi - lo, hd = s.hd, padded = (count + 15) / 16 * 16;
  float* k32 = scratch;
  float* v32 = scratch + kChunkEntries * hd;
  Cache::widen(k_rows + lo * hd, count, hd, k_scale, k32);  // each K row read once for the G heads
  std::fill(k32 + count * hd, k32 + padded * hd, 0.0f);
  alignas(64) float scores[kMaxGroup][kChunkEntries];
  for (int64_t g = 0; g < s.group; ++g) {
    float* out = partial + g * (2 + hd);
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < padded; t += 16) {
      const __mmask16 m = lanes(count - t);
      __m512 v = _mm512_mul_ps(dot16(q32 + g * hd, k32 + t * hd, hd), _mm512_set1_ps(scale));
      if (softcap > 0) v = softcap_ps(v, softcap);
      _mm512_storeu_ps(scores[g] + t, v);
      vmax = _mm512_mask_max_ps(vmax, m, vmax, v);
    }
    const float chunk_max = _mm512_reduce_max_ps(vmax);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < padded; t += 16) {
      const __mmask16 m = lanes(count - t);
      const __m512 w = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(scores[g] + t),
                                                                   _mm512_set1_ps(chunk_max))));
      _mm512_storeu_ps(scores[g] + t, w);
      sum = _mm512_add_ps(sum, w);
    }
    out[0] = chunk_max;
    out[1] = _mm512_reduce_add_ps(sum);
  }
  Cache::widen(v_rows + lo * hd, count, hd, v_scale, v32);  // each V row read once for the G heads
  for (int64_t g = 0; g < s.group; ++g) weighted_sum(scores[g], v32, count, hd, partial + g * (2 + hd) + 2);
}

// ---- bf16 queries over a bf16 cache, head_dim 64, 128 or 256: no widened copies --------------
// K rows are multiplied in bf16 pairs with vdpbf16ps (each product exact in fp32, summed in fp32),
// and V rows are widened in registers by interleaving their 16-bit words with zeros: that yields
// the fp32 values of each 128-bit lane's words 0-3 in one register and 4-7 in another, so the
// accumulators hold the head's values in that order, put back in order once per chunk.

// Lane e: the dot product of q (HD bf16 values, as HD / 32 registers of pairs) with row e of k
// (16 consecutive rows of HD bf16; rows at or past `valid` count as zero).
template <int HD>
inline __m512 dot16_bf16(const __m512bh* q, const c10::BFloat16* k, int64_t valid) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int e = 0; e < 16; ++e) acc[e] = _mm512_setzero_ps();
  if (valid >= 16) {
#pragma GCC unroll 8
    for (int j = 0; j < HD / 32; ++j) {
#pragma GCC unroll 16
      for (int e = 0; e < 16; ++e)
        acc[e] = _mm512_dpbf16_ps(acc[e], (__m512bh)_mm512_loadu_si512(k + e * HD + 32 * j), q[j]);
    }
  } else {
    for (int64_t e = 0; e < valid; ++e)
      for (int j = 0; j < HD / 32; ++j)
        acc[e] = _mm512_dpbf16_ps(acc[e], (__m512bh)_mm512_loadu_si512(k + e * HD + 32 * j), q[j]);
  }
  return sum_lanes16(acc);
}

// The 32 values of an (lo, hi) pair of unpacked registers, back in order.
inline void store_unpacked(float* out, __m512 lo, __m512 hi) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  _mm512_storeu_ps(out, _mm512_permutex2var_ps(lo, first, hi));
  _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(lo, second, hi));
}

// out[g] (g < heads <= NG; each HD fp32 at out + g * out_stride) = sum over t < count of
// w[g][t] * v[t], the rows of v widened in registers, t in order.
template <int HD, int NG>
void weighted_rows_bf16(const float (*w)[kChunkEntries], int heads, const c10::BFloat16* v, int64_t count,
                        float* out, int64_t out_stride) {
  constexpr int kPairs = HD / 32;  // 32 values a register of bf16, two of fp32 (lo, hi)
  __m512 lo[NG][kPairs], hi[NG][kPairs];
#pragma GCC unroll 4
  for (int g = 0; g < NG; ++g)
#pragma GCC unroll 8
    for (int j = 0; j < kPairs; ++j) lo[g][j] = hi[g][j] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t t = 0; t < count; ++t) {
    __m512 vlo[kPairs], vhi[kPairs];
#pragma GCC unroll 8
    for (int j = 0; j < kPairs; ++j) {
      const __m512i x = _mm512_loadu_si512(v + t * HD + 32 * j);
      vlo[j] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, x));
      vhi[j] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, x));
    }
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g) {
      if (g >= heads) break;
      const __m512 wt = _mm512_set1_ps(w[g][t]);
#pragma GCC unroll 8
      for (int j = 0; j < kPairs; ++j) {
        lo[g][j] = _mm512_fmadd_ps(wt, vlo[j], lo[g][j]);
        hi[g][j] = _mm512_fmadd_ps(wt, vhi[j], hi[g][j]);
      }
    }
  }
  for (int g = 0; g < heads; ++g)
    for (int j = 0; j < kPairs; ++j) store_unpacked(out + g * out_stride + 32 * j, lo[g][j], hi[g][j]);
}

template <int HD>
void attend_chunk_bf16(const c10::BFloat16* q_rows, const c10::BFloat16* k_rows, const c10::BFloat16* v_rows,
                       int64_t lo, int64_t hi, const Shape& s, float scale, float softcap, float* partial) {
  constexpr int kHeadsPerPass = HD == 64 ? 4 : HD == 128 ? 2 : 1;  // 16 accumulator pairs at most
  const int64_t count = hi - lo;
  alignas(64) float scores[kMaxGroup][kChunkEntries];
  for (int64_t g = 0; g < s.group; ++g) {
    __m512bh q[HD / 32];
    for (int j = 0; j < HD / 32; ++j) q[j] = (__m512bh)_mm512_loadu_si512(q_rows + g * HD + 32 * j);
    float* out = partial + g * (2 + HD);
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < count; t += 16) {
      const __mmask16 m = lanes(count - t);
      __m512 v = _mm512_mul_ps(dot16_bf16<HD>(q, k_rows + (lo + t) * HD, count - t), _mm512_set1_ps(scale));
      if (softcap > 0) v = softcap_ps(v, softcap);
      _mm512_storeu_ps(scores[g] + t, v);
      vmax = _mm512_mask_max_ps(vmax, m, vmax, v);
    }
    const float chunk_max = _mm512_reduce_max_ps(vmax);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < count; t += 16) {
      const __mmask16 m = lanes(count - t);
      const __m512 w = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(scores[g] + t),
                                                                   _mm512_set1_ps(chunk_max))));
      _mm512_storeu_ps(scores[g] + t, w);
      sum = _mm512_add_ps(sum, w);
    }
    out[0] = chunk_max;
    out[1] = _mm512_reduce_add_ps(sum);
  }
  for (int64_t g = 0; g < s.group; g += kHeadsPerPass)
    weighted_rows_bf16<HD, kHeadsPerPass>(scores + g, static_cast<int>(std::min<int64_t>(kHeadsPerPass, s.group - g)),
                                          v_rows + lo * HD, count, partial + g * (2 + HD) + 2, 2 + HD);
}

// One unit by the bf16 route; false where it does not apply (other dtypes, other head dims).
template <class QT, class CT>
bool attend_chunk_in_pairs(const QT* q_rows, const CT* k_rows, const CT* v_rows, int64_t lo, int64_t hi,
                           const Shape& s, float scale, float softcap, float* partial) {
  if constexpr (std::is_same_v<QT, c10::BFloat16> && std::is_same_v<CT, c10::BFloat16>) {
    switch (s.hd) {
      case 64: attend_chunk_bf16<64>(q_rows, k_rows, v_rows, lo, hi, s, scale, softcap, partial); return true;
      case 128: attend_chunk_bf16<128>(q_rows, k_rows, v_rows, lo, hi, s, scale, softcap, partial); return true;
      case 256: attend_chunk_bf16<256>(q_rows, k_rows, v_rows, lo, hi, s, scale, softcap, partial); return true;
      default: break;
    }
  }
  return false;
}

// The chunks' partials of one (row, KV head) [chunks, G, 2 + hd], merged in chunk order into its
// G output heads of the model dtype. sinks: the G heads' sink logits (gpt-oss), or null: each joins
// the softmax's max and denominator, and weighs no V row.
template <class Model>
void merge_chunks(const float* unit, int64_t chunks, int64_t stride, const Shape& s, const float* sinks,
                  typename Model::type* dst) {
  alignas(64) float merged[kMaxHeadDim];
  for (int64_t g = 0; g < s.group; ++g) {
    float top = sinks ? sinks[g] : -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < chunks; ++c) top = std::max(top, unit[c * stride + g * (2 + s.hd)]);
    float total = sinks ? std::exp(sinks[g] - top) : 0.0f;
    std::fill(merged, merged + s.hd, 0.0f);
    for (int64_t c = 0; c < chunks; ++c) {
      const float* p = unit + c * stride + g * (2 + s.hd);
      const float weight = std::exp(p[0] - top);
      total += p[1] * weight;
      const __m512 w = _mm512_set1_ps(weight);
      for (int64_t j = 0; j < s.hd; j += 16)
        _mm512_storeu_ps(merged + j, _mm512_fmadd_ps(_mm512_loadu_ps(p + 2 + j), w, _mm512_loadu_ps(merged + j)));
    }
    const __m512 inverse = _mm512_set1_ps(1.0f / total);
    for (int64_t j = 0; j < s.hd; j += 16)
      Model::store(dst + g * s.hd + j, _mm512_mul_ps(_mm512_loadu_ps(merged + j), inverse));
  }
}

template <class Model, class Cache>
void decode_attention_typed(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const int64_t* slots, const int64_t* first, const int64_t* last, const Shape& s,
                            float scale, float softcap, float k_scale, float v_scale, const float* sinks,
                            at::Tensor& out) {
  using QT = typename Model::type;
  using CT = typename Cache::type;
  const QT* q_data = q.data_ptr<QT>();
  const CT* k_data = static_cast<const CT*>(k_cache.data_ptr());
  const CT* v_data = static_cast<const CT*>(v_cache.data_ptr());
  QT* out_data = out.data_ptr<QT>();
  // Units: (row, KV head, chunk), numbered row-major; unit_start[r] = the first unit of row r.
  // remaining[r * KVH + h]: chunks of (row r, KV head h) not done yet; the thread that finishes
  // the last one merges them, so one parallel region does everything.
  std::vector<int64_t> unit_start(s.rows + 1, 0);
  std::unique_ptr<std::atomic<int64_t>[]> remaining(new std::atomic<int64_t>[s.rows * s.kv_heads]);
  for (int64_t r = 0; r < s.rows; ++r) {
    const int64_t chunks = (last[r] - first[r] + kChunkEntries) / kChunkEntries;
    unit_start[r + 1] = unit_start[r] + s.kv_heads * chunks;
    for (int64_t h = 0; h < s.kv_heads; ++h) remaining[r * s.kv_heads + h].store(chunks, std::memory_order_relaxed);
  }
  const int64_t units = unit_start[s.rows], stride = s.group * (2 + s.hd);
  at::Tensor partials = at::empty({units, stride}, q.options().dtype(at::kFloat));
  float* part = partials.data_ptr<float>();
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t r = std::upper_bound(unit_start.begin(), unit_start.end(), u) - unit_start.begin() - 1;
      const int64_t chunks = (unit_start[r + 1] - unit_start[r]) / s.kv_heads;
      const int64_t h = (u - unit_start[r]) / chunks, c = (u - unit_start[r]) % chunks;
      const QT* q_row = q_data + (r * s.heads + h * s.group) * s.hd;  // this KV head's G query heads
      const int64_t base = (slots[r] * s.kv_heads + h) * s.length * s.hd;
      const int64_t lo = first[r] + c * kChunkEntries, hi = std::min(lo + kChunkEntries, last[r] + 1);
      float* partial = part + u * stride;
      if (!attend_chunk_in_pairs(q_row, k_data + base, v_data + base, lo, hi, s, scale, softcap, partial)) {
        alignas(64) float q32[kMaxGroup * kMaxHeadDim];
        static thread_local std::vector<float> scratch(2 * kChunkEntries * kMaxHeadDim);
        for (int64_t j = 0; j < s.group * s.hd; j += 16) _mm512_storeu_ps(q32 + j, Model::load(q_row + j));
        attend_chunk<Cache>(q32, k_data + base, v_data + base, lo, hi, s, scale, softcap, k_scale, v_scale,
                            scratch.data(), partial);
      }
      if (remaining[r * s.kv_heads + h].fetch_sub(1, std::memory_order_acq_rel) == 1)
        merge_chunks<Model>(part + (unit_start[r] + h * chunks) * stride, chunks, stride, s,
                            sinks ? sinks + h * s.group : nullptr, out_data + (r * s.heads + h * s.group) * s.hd);
    }
  });
}

float scale_value(const c10::optional<at::Tensor>& scale) {
  return scale.has_value() ? scale->to(at::kFloat).item<float>() : 1.0f;
}

template <class Model>
void dispatch_cache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* slots,
                    const int64_t* first, const int64_t* last, const Shape& s, double scale, double softcap,
                    const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                    const float* sinks, at::Tensor& out) {
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {
    decode_attention_typed<Model, Fp8Cache<Model>>(q, k_cache, v_cache, slots, first, last, s, scale, softcap,
                                                   scale_value(k_scale), scale_value(v_scale), sinks, out);
  } else {
    TORCH_CHECK(k_cache.scalar_type() == q.scalar_type(), "decode_attention: a cache of ", k_cache.scalar_type(),
                " for queries of ", q.scalar_type());
    decode_attention_typed<Model, PlainCache<Model>>(q, k_cache, v_cache, slots, first, last, s, scale, softcap,
                                                     1.0f, 1.0f, sinks, out);
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& first, const at::Tensor& last, double scale,
                            double softcap, const c10::optional<at::Tensor>& k_scale,
                            const c10::optional<at::Tensor>& v_scale, const c10::optional<at::Tensor>& sinks) {
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
  TORCH_CHECK(!sinks.has_value() || sinks->numel() == s.heads, "decode_attention: ", s.heads,
              " query heads need one sink each");
  at::Tensor sink_logits = sinks.has_value() ? sinks->to(at::kFloat).contiguous() : at::Tensor();  // [H] fp32
  const float* sk = sinks.has_value() ? sink_logits.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty_like(qc);
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_cache<F32>(qc, k_cache, v_cache, sl, lo, hi, s, scale, softcap, k_scale, v_scale, sk, out); break;
    case at::kBFloat16: dispatch_cache<BF16>(qc, k_cache, v_cache, sl, lo, hi, s, scale, softcap, k_scale, v_scale, sk, out); break;
    case at::kHalf: dispatch_cache<F16>(qc, k_cache, v_cache, sl, lo, hi, s, scale, softcap, k_scale, v_scale, sk, out); break;
    default: TORCH_CHECK(false, "decode_attention: queries of ", q.scalar_type(), " are not supported");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(qrt_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor first, Tensor last, "
        "float scale, float softcap, Tensor? k_scale, Tensor? v_scale, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(qrt_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
