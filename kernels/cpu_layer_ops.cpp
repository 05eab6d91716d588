// A decoder layer's element-wise ops on the CPU, each one pass over its rows: the residual add
// with the RMS norm, silu(gate) * up, and rotary on q and k with the K/V store into the paged
// pool. Built and called by kernels/cpu_layer_ops.py, whose references are kernels.torch_ops'
// rms_norm, silu_and_mul, apply_rotary and store_kv (the same roundings: float32 math, the
// result rounded once to the tensors' dtype where the reference rounds it).
//
// Loads, stores and the roundings to bf16 run 16 lanes at a time (bf16 rounded to nearest even
// in integer lanes, as c10::BFloat16): 1 thread, AVX-512 box, [2048, 576] add + norm 0.36-0.56 ms
// against 1.9 (bf16) and 6.2 (fp32) with a conversion per element; silu * up of [2048, 2 x 1536]
// 2.3-2.7 ms against 2.8 (fp32) and 5.7 (bf16); at 32 rows (bf16) 15 / 42 us against 36 / 89.
//
// Rows are split among threads only where there are many of them (a prefill's), so that a
// decode step's few rows take no OpenMP region (on a busy box a region waits for a thread that
// is not running).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <climits>
#include <tuple>

namespace {

// Rows per task: a task is about this many elements.
constexpr int64_t GRAIN_ELEMENTS = 1 << 16;

int64_t grain(int64_t row_elements) {
  return std::max<int64_t>(1, GRAIN_ELEMENTS / std::max<int64_t>(1, row_elements));
}

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }

// 16 float lanes (GCC's vector extension), and exp over them: the Cephes expf of
// cpu_decode_attention.cpp, its input clamped to [-87, 88] (silu's exp(-x) then saturates
// to ~1e38 instead of inf, and x / (1 + that) is ~x * 1e-38 instead of -0).
typedef float vfloat __attribute__((vector_size(64)));
typedef int32_t vint __attribute__((vector_size(64)));
constexpr int64_t LANES = 16;

inline vfloat vexp(vfloat x) {
  const vfloat lo = vfloat{} - 87.0f, hi = vfloat{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vfloat n = __builtin_convertvector(
      __builtin_convertvector(x * 1.44269504088896341f + (x < 0 ? -0.5f : 0.5f), vint), vfloat);
  const vfloat r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vfloat p = vfloat{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vint scale = (__builtin_convertvector(n, vint) + 127) << 23;
  return p * reinterpret_cast<vfloat>(scale);
}

typedef uint32_t vuint __attribute__((vector_size(64)));
typedef uint16_t vushort __attribute__((vector_size(32)));

// 16 values widened to float32, and float32 lanes rounded to T and stored: bf16 is a float's
// upper half, rounded to nearest even with NaN as 0x7FC0, as c10::BFloat16's conversion.
inline vfloat loadv(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vfloat loadv(const c10::BFloat16* p) {
  vushort h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<vfloat>(__builtin_convertvector(h, vuint) << 16);
}
inline vuint bf16_bits(vfloat v) {  // the rounded bf16 in each lane's upper half
  const vuint b = reinterpret_cast<vuint>(v);
  const vuint r = (b + (((b >> 16) & 1) + 0x7FFF)) & 0xFFFF0000u;
  return v != v ? vuint{} + 0x7FC00000u : r;
}
inline void storev(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }
inline void storev(c10::BFloat16* p, vfloat v) {
  const vushort h = __builtin_convertvector(bf16_bits(v) >> 16, vushort);
  std::memcpy(p, &h, sizeof h);
}
// v rounded to T and widened back (static_cast<T> then to float, 16 lanes at once)
inline vfloat roundv(vfloat v, float) { return v; }
inline vfloat roundv(vfloat v, c10::BFloat16) { return reinterpret_cast<vfloat>(bf16_bits(v)); }

// (x [T, H] (+ residual [T, H])) -> normed [T, H], new residual [T, H]; as torch_ops.rms_norm.
template <typename T, typename W>
void add_rms_norm(const T* x, const T* res, const W* w, float eps, T* normed, T* new_res,
                  int64_t rows, int64_t h, int64_t x_stride, int64_t res_stride) {
  at::parallel_for(0, rows, grain(h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* sr = new_res + r * h;
      const T* rr = res ? res + r * res_stride : nullptr;
      vfloat acc{};
      int64_t i = 0;
      for (; i + LANES <= h; i += LANES) {  // the add in T, as the reference's x + residual
        const vfloat f = roundv(rr ? loadv(xr + i) + loadv(rr + i) : loadv(xr + i), T{});
        storev(sr + i, f);
        acc += f * f;
      }
      float ss = 0.f;
      for (int l = 0; l < LANES; ++l) ss += acc[l];
      for (; i < h; ++i) {
        sr[i] = rr ? static_cast<T>(to_f(xr[i]) + to_f(rr[i])) : xr[i];
        ss += to_f(sr[i]) * to_f(sr[i]);
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
      T* nr = normed + r * h;
      for (i = 0; i + LANES <= h; i += LANES) {
        const vfloat n = loadv(sr + i) * inv;
        if constexpr (std::is_same_v<T, W>) {
          storev(nr + i, roundv(n, T{}) * loadv(w + i));  // rounded, then * w
        } else {
          storev(nr + i, loadv(w + i) * n);
        }
      }
      for (; i < h; ++i) {
        const float n = to_f(sr[i]) * inv;
        if constexpr (std::is_same_v<T, W>) {
          nr[i] = static_cast<T>(to_f(static_cast<T>(n)) * to_f(w[i]));
        } else {
          nr[i] = static_cast<T>(to_f(w[i]) * n);
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x,
                                            const c10::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous() &&
              weight.size(0) == x.size(1), "x [T, H] rows dense, weight [H]");
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res)
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(1) == 1 &&
                residual->scalar_type() == x.scalar_type(), "residual like x");
  const int64_t rows = x.size(0), h = x.size(1);
  at::Tensor normed = at::empty({rows, h}, x.options());
  at::Tensor new_res = at::empty({rows, h}, x.options());
  const float e = static_cast<float>(eps);
  auto run = [&](auto tag_t, auto tag_w) {
    using T = decltype(tag_t);
    using W = decltype(tag_w);
    add_rms_norm<T, W>(x.const_data_ptr<T>(), has_res ? residual->const_data_ptr<T>() : nullptr,
                       weight.const_data_ptr<W>(), e, normed.data_ptr<T>(), new_res.data_ptr<T>(),
                       rows, h, x.stride(0), has_res ? residual->stride(0) : 0);
  };
  const auto xt = x.scalar_type(), wt = weight.scalar_type();
  if (xt == at::kFloat && wt == at::kFloat) run(float{}, float{});
  else if (xt == at::kBFloat16 && wt == at::kBFloat16) run(c10::BFloat16{}, c10::BFloat16{});
  else if (xt == at::kBFloat16 && wt == at::kFloat) run(c10::BFloat16{}, float{});
  else TORCH_CHECK(false, "rms_norm: float32 or bfloat16");
  return {normed, new_res};
}

// gate_up [T, 2n] -> silu(gate) * up [T, n]; silu rounded to T first, as the reference.
template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t n, int64_t x_stride) {
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * x_stride;
      const T* u = g + n;
      T* o = out + r * n;
      int64_t i = 0;
      for (; i + LANES <= n; i += LANES) {
        const vfloat a = loadv(g + i), e = vexp(-a), b = loadv(u + i);
        storev(o + i, roundv(a / (1.0f + e), T{}) * b);
      }
      for (; i < n; ++i) {
        const float a = to_f(g[i]);
        const T s = static_cast<T>(a / (1.0f + std::exp(-a)));
        o[i] = static_cast<T>(to_f(s) * to_f(u[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "x [T, 2n] rows dense");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, x.options());
  if (x.scalar_type() == at::kFloat) {
    silu_mul_rows<float>(x.const_data_ptr<float>(), out.data_ptr<float>(), rows, n, x.stride(0));
  } else if (x.scalar_type() == at::kBFloat16) {
    silu_mul_rows<c10::BFloat16>(x.const_data_ptr<c10::BFloat16>(),
                                 out.data_ptr<c10::BFloat16>(), rows, n, x.stride(0));
  } else {
    TORCH_CHECK(false, "silu_and_mul: float32 or bfloat16");
  }
  return out;
}

// Neox rotary of one head's d values (x1 = first half, x2 = second), written to dst:
// x1 cos - x2 sin | x2 cos + x1 sin, each product rounded before the sum as the reference's.
template <typename T>
inline void rotate(const T* src, T* dst, const float* cs, int64_t half) {
  const float* cos = cs;
  const float* sin = cs + half;
  int64_t i = 0;
  for (; i + LANES <= half; i += LANES) {
    const vfloat x1 = loadv(src + i), x2 = loadv(src + i + half);
    const vfloat c = loadv(cos + i), sn = loadv(sin + i);
    storev(dst + i, x1 * c - x2 * sn);  // no FMA contraction in this build: as the reference
    storev(dst + i + half, x2 * c + x1 * sn);
  }
  for (; i < half; ++i) {
    const float x1 = to_f(src[i]), x2 = to_f(src[i + half]);
    const float a = x1 * cos[i], b = x2 * sin[i], c = x2 * cos[i], e = x1 * sin[i];
    dst[i] = static_cast<T>(a - b);
    dst[i + half] = static_cast<T>(c + e);
  }
}

// qkv [T, (heads + 2 kv_heads) d] -> rotated q [T, heads, d]; rotated k and v into the caches
// [num_blocks, block_size, kv_heads, d] at slot_mapping (negative: not stored).
template <typename T>
void rotary_store_rows(const T* qkv, int64_t qkv_stride, const int64_t* positions,
                       const float* cos_sin, int64_t cs_stride, T* k_cache, T* v_cache,
                       const int64_t* slots, T* q_out, int64_t rows, int64_t heads, int64_t kvh,
                       int64_t d) {
  const int64_t half = d / 2, slot_elems = kvh * d;
  at::parallel_for(0, rows, grain((heads + 2 * kvh) * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* q = qkv + r * qkv_stride;
      const T* k = q + heads * d;
      const T* v = k + kvh * d;
      const float* cs = cos_sin + positions[r] * cs_stride;
      for (int64_t hd = 0; hd < heads; ++hd)
        rotate(q + hd * d, q_out + (r * heads + hd) * d, cs, half);
      const int64_t slot = slots[r];
      if (slot < 0) continue;
      T* kd = k_cache + slot * slot_elems;
      for (int64_t hd = 0; hd < kvh; ++hd) rotate(k + hd * d, kd + hd * d, cs, half);
      T* vd = v_cache + slot * slot_elems;
      for (int64_t i = 0; i < slot_elems; ++i) vd[i] = v[i];
    }
  });
}

at::Tensor rotary_store(const at::Tensor& qkv, int64_t heads, int64_t kv_heads,
                        const at::Tensor& positions, const at::Tensor& cos_sin,
                        at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4, "caches [num_blocks, block_size, kv_heads, d]");
  const int64_t d = k_cache.size(3), rows = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (heads + 2 * kv_heads) * d &&
              k_cache.size(2) == kv_heads && d % 2 == 0, "qkv [T, (heads + 2 kv_heads) d]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.sizes() == v_cache.sizes(), "contiguous caches of one shape");
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() &&
              v_cache.scalar_type() == qkv.scalar_type(), "caches in qkv's dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
              slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              positions.size(0) == rows && slot_mapping.size(0) == rows, "int64 [T] indices");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.stride(1) == 1 &&
              cos_sin.size(1) == d, "cos_sin [max_pos, d] float32");
  at::Tensor q = at::empty({rows, heads, d}, qkv.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    rotary_store_rows<T>(qkv.const_data_ptr<T>(), qkv.stride(0),
                         positions.const_data_ptr<int64_t>(), cos_sin.const_data_ptr<float>(),
                         cos_sin.stride(0), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                         slot_mapping.const_data_ptr<int64_t>(), q.data_ptr<T>(), rows, heads,
                         kv_heads, d);
  };
  if (qkv.scalar_type() == at::kFloat) run(float{});
  else if (qkv.scalar_type() == at::kBFloat16) run(c10::BFloat16{});
  else TORCH_CHECK(false, "rotary_store: float32 or bfloat16");
  return q;
}

// x [M, K] @ w [N, K] -> [M, N], float32 or bf16 operands (one dtype), the products summed in
// float32 and the sum rounded once to the output's dtype (float32, or the operands'): as
// oneDNN's GEMM but for the order of the sum. K a multiple of 32. Two builds:
// - AVX-512 (the eighth session's kernel): at most 8 rows, four rows a pass over the weights;
//   bf16 by AVX-512 BF16's dot of pairs (exact products), float32 by FMAs. For a decode step's
//   few rows, which read every weight once: oneDNN's GEMM on weights packed for 64 rows
//   streamed SmolLM2's projections at 4-6 GB/s at 1-8 rows, this at 12-33 GB/s.
// - AVX2 + FMA: any number of rows, in blocks of ROW_BLOCK rows (the block's x, widened to
//   float32, stays in cache while the weights stream past it once); each task takes two weight
//   rows against four x rows (eight float32 accumulators); a bf16 weight is widened in
//   registers (its products are exact in float32). On AVX2 oneDNN has no bf16 kernels, and
//   F.linear runs bf16 at a quarter of its float32 rate.
#if defined(__AVX512F__)
constexpr int64_t MAX_ROWS = 8;

inline __m512 dot_step(__m512 acc, const float* x, const float* w) {
  return _mm512_fmadd_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(w), acc);
}

#ifdef __AVX512BF16__
inline __m512 dot_step(__m512 acc, const c10::BFloat16* x, const c10::BFloat16* w) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x), (__m512bh)_mm512_loadu_si512(w));
}
#endif

template <typename T>
constexpr int64_t kStep = 64 / sizeof(T);  // elements of K per step: 16 floats, 32 bf16

template <int M, typename T, typename O>
void dot_rows(const T* x, int64_t x_stride, const T* w, int64_t n_rows, int64_t k, O* out,
              int64_t out_stride) {
  at::parallel_for(0, n_rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const T* wn = w + n * k;
      __m512 acc[M];
      for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
      for (int64_t i = 0; i < k; i += kStep<T>)
        for (int m = 0; m < M; ++m) acc[m] = dot_step(acc[m], x + m * x_stride + i, wn + i);
      for (int m = 0; m < M; ++m) out[m * out_stride + n] = static_cast<O>(_mm512_reduce_add_ps(acc[m]));
    }
  });
}

template <typename T, typename O>
void dot_all(const T* x, int64_t x_stride, const T* w, int64_t m, int64_t n, int64_t k, O* out) {
  for (int64_t r = 0; r < m; r += 4) {  // four rows a pass: the weights are read once per pass
    const int64_t rows = std::min<int64_t>(4, m - r);
    const T* xr = x + r * x_stride;
    O* o = out + r * n;
    if (rows == 4) dot_rows<4>(xr, x_stride, w, n, k, o, n);
    else if (rows == 3) dot_rows<3>(xr, x_stride, w, n, k, o, n);
    else if (rows == 2) dot_rows<2>(xr, x_stride, w, n, k, o, n);
    else dot_rows<1>(xr, x_stride, w, n, k, o, n);
  }
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, bool float32_out) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.stride(1) == 1 &&
              w.is_contiguous() && x.scalar_type() == w.scalar_type(), "x [M, K], w [N, K]");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(m <= MAX_ROWS && k % 32 == 0, "at most 8 rows, K a multiple of 32");
  const auto out_type = float32_out ? at::kFloat : x.scalar_type();
  at::Tensor out = at::empty({m, n}, x.options().dtype(out_type));
  if (x.scalar_type() == at::kFloat) {
    dot_all(x.const_data_ptr<float>(), x.stride(0), w.const_data_ptr<float>(), m, n, k,
            out.data_ptr<float>());
    return out;
  }
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "small_linear: float32 or bfloat16");
#ifdef __AVX512BF16__
  const auto* xp = x.const_data_ptr<c10::BFloat16>();
  const auto* wp = w.const_data_ptr<c10::BFloat16>();
  if (float32_out) dot_all(xp, x.stride(0), wp, m, n, k, out.data_ptr<float>());
  else dot_all(xp, x.stride(0), wp, m, n, k, out.data_ptr<c10::BFloat16>());
#else
  TORCH_CHECK(false, "small_linear: bf16 needs AVX-512 BF16");
#endif
  return out;
}

bool has_bf16_dot() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t MAX_ROWS = INT64_MAX;
constexpr int64_t ROW_BLOCK = 64;
constexpr int64_t VL = 8;  // float32 lanes of a __m256

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 -> float32: the bits shifted up
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline float sum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// out[m, j] = x[m] . w[j] for MR rows of x (float32) and NR rows of w.
template <int MR, int NR, typename T, typename O>
inline void dot_tile(const float* x, int64_t xs, const T* w, int64_t k, O* out, int64_t os) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += VL) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load8(w + j * k + i);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * xs + i);
      for (int j = 0; j < NR; ++j) acc[m][j] = _mm256_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) out[m * os + j] = static_cast<O>(sum8(acc[m][j]));
}

template <int NR, typename T, typename O>
inline void dot_rows(const float* x, int64_t xs, int64_t rows, const T* w, int64_t k, O* out,
                     int64_t os) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) dot_tile<4, NR>(x + r * xs, xs, w, k, out + r * os, os);
  switch (rows - r) {
    case 3: dot_tile<3, NR>(x + r * xs, xs, w, k, out + r * os, os); break;
    case 2: dot_tile<2, NR>(x + r * xs, xs, w, k, out + r * os, os); break;
    case 1: dot_tile<1, NR>(x + r * xs, xs, w, k, out + r * os, os); break;
    default: break;
  }
}

template <typename T, typename O>
void dot_all(const float* x, int64_t xs, const T* w, int64_t m, int64_t n, int64_t k, O* out) {
  constexpr int64_t NR = 3;  // weight rows a task: 4 x 3 accumulators hide the FMAs' latency
  const int64_t groups = (n + NR - 1) / NR;
  for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK) {
    const int64_t rows = std::min(ROW_BLOCK, m - r0);
    const float* xr = x + r0 * xs;
    at::parallel_for(0, groups, 8, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t j = NR * g;
        O* o = out + r0 * n + j;
        switch (std::min(NR, n - j)) {
          case 3: dot_rows<3>(xr, xs, rows, w + j * k, k, o, n); break;
          case 2: dot_rows<2>(xr, xs, rows, w + j * k, k, o, n); break;
          default: dot_rows<1>(xr, xs, rows, w + j * k, k, o, n); break;
        }
      }
    });
  }
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, bool float32_out) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.stride(1) == 1 &&
              w.is_contiguous() && x.scalar_type() == w.scalar_type(), "x [M, K], w [N, K]");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(k % 32 == 0, "K a multiple of 32");
  const auto out_type = float32_out ? at::kFloat : x.scalar_type();
  at::Tensor out = at::empty({m, n}, x.options().dtype(out_type));
  if (x.scalar_type() == at::kFloat) {
    dot_all(x.const_data_ptr<float>(), x.stride(0), w.const_data_ptr<float>(), m, n, k,
            out.data_ptr<float>());
    return out;
  }
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "small_linear: float32 or bfloat16");
  const at::Tensor xf = x.to(at::kFloat);  // exact; widened once, not once per weight row
  const auto* wp = w.const_data_ptr<c10::BFloat16>();
  if (float32_out) dot_all(xf.const_data_ptr<float>(), xf.stride(0), wp, m, n, k,
                           out.data_ptr<float>());
  else dot_all(xf.const_data_ptr<float>(), xf.stride(0), wp, m, n, k,
               out.data_ptr<c10::BFloat16>());
  return out;
}

bool has_bf16_dot() { return true; }  // widened in registers

#else
constexpr int64_t MAX_ROWS = 0;

at::Tensor small_linear(const at::Tensor&, const at::Tensor&, bool) {
  TORCH_CHECK(false, "small_linear needs AVX-512 or AVX2 with FMA");
}

bool has_bf16_dot() { return false; }
#endif

int64_t small_linear_max_rows() { return MAX_ROWS; }

// x [M, K] float32 @ w -> [M, N] float32, w held as oneDNN packs a float32 weight [N, K] for 64
// rows (its layout here, AVX2 and AVX-512 alike): [ceil(N / 64), KP, 64], KP = K rounded up to
// 16, 64 output columns a block and K-major inside it, zero padded. Each task takes one block
// and runs the rows of x against it one at a time (each k: the 64 weights times x[k]
// broadcast, eight float32 accumulators, the weights prefetched 8 k ahead), so a block is read
// as one stream from memory for the first row and from cache for the others. The products
// summed in k's order, as F.linear's but for FMA rounding. Lets the packed copy be the only
// one: decode steps read it here, prefills through oneDNN.
//
// The twelfth session's AVX2 box (Zen 3, 2 threads, SmolLM2's 30 layers, median of 15): 22.9 /
// 31.0 / 40.9 ms at 1 / 4 / 8 rows, where the earlier tiles of 32 columns x 3 rows (each task
// half a block, two lines of every four read) took 26.3 / 37.7 / 55.9 and oneDNN 30.9 / 34.0 /
// 42.7 (ops_onednn.PACKED_LINEAR_ROWS); the same sums in the same order.
#if defined(__AVX2__) && defined(__FMA__)
constexpr int64_t PACK_COLS = 64, PREFETCH_K = 8;

// out[c] = x . w[c] for the (up to 64) columns of the block at wt.
inline void packed_row(const float* x, const float* wt, int64_t k, float* out, int64_t cols) {
  constexpr int NV = PACK_COLS / 8;
  __m256 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const float* ahead = wt + (i + PREFETCH_K) * PACK_COLS;  // past the block: harmless
    for (int line = 0; line < 4; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + 16 * line), _MM_HINT_T0);
    const __m256 xb = _mm256_broadcast_ss(x + i);
    for (int v = 0; v < NV; ++v)
      acc[v] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(wt + i * PACK_COLS + 8 * v), acc[v]);
  }
  float tmp[PACK_COLS];
  float* o = cols == PACK_COLS ? out : tmp;
  for (int v = 0; v < NV; ++v) _mm256_storeu_ps(o + 8 * v, acc[v]);
  if (o == tmp) std::memcpy(out, tmp, cols * sizeof(float));
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& wp, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
              "x [M, K] float32, rows dense");
  TORCH_CHECK(wp.dim() == 3 && wp.is_contiguous() && wp.scalar_type() == at::kFloat &&
              wp.size(2) == PACK_COLS && wp.size(0) * PACK_COLS >= n &&
              wp.size(0) * PACK_COLS < n + PACK_COLS && wp.size(1) >= x.size(1),
              "wp [ceil(N / 64), KP >= K, 64] float32");
  const int64_t m = x.size(0), k = x.size(1), xs = x.stride(0);
  at::Tensor out = at::empty({m, n}, x.options());
  const float* xp = x.const_data_ptr<float>();
  const float* w = wp.const_data_ptr<float>();
  const int64_t kp = wp.size(1), blocks = wp.size(0);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t c0 = b * PACK_COLS, cols = std::min(PACK_COLS, n - c0);
      for (int64_t r = 0; r < m; ++r)
        packed_row(xp + r * xs, w + b * kp * PACK_COLS, k, op + r * n + c0, cols);
    }
  });
  return out;
}

bool has_packed_linear() { return true; }
#else
at::Tensor packed_linear(const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "packed_linear needs AVX2 with FMA");
}

bool has_packed_linear() { return false; }
#endif

// numel float32s at address ptr, the storage of owner (an opaque oneDNN tensor), as a plain
// tensor that keeps owner alive.
at::Tensor alias_storage(const at::Tensor& owner, int64_t ptr, int64_t numel) {
  return at::from_blob(reinterpret_cast<void*>(ptr), {numel}, [owner](void*) {},
                       at::TensorOptions().dtype(at::kFloat));
}

}  // namespace

TORCH_LIBRARY(splitserve_cpu_layer, m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("small_linear(Tensor x, Tensor w, bool float32_out) -> Tensor");
  m.def("has_bf16_dot() -> bool", has_bf16_dot);
  m.def("small_linear_max_rows() -> int", small_linear_max_rows);
  m.def("packed_linear(Tensor x, Tensor wp, int n) -> Tensor");
  m.def("has_packed_linear() -> bool", has_packed_linear);
  m.def("alias_storage(Tensor owner, int ptr, int numel) -> Tensor", alias_storage);
  m.def("rotary_store(Tensor qkv, int heads, int kv_heads, Tensor positions, Tensor cos_sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve_cpu_layer, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("silu_and_mul", silu_and_mul);
  m.impl("small_linear", small_linear);
  m.impl("packed_linear", packed_linear);
  m.impl("rotary_store", rotary_store);
}
