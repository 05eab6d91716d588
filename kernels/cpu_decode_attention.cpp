// Paged decode attention on the CPU: one query token per sequence attends to its whole context,
// read in place from the paged pool (no gathered copy), in float32 whatever the pool's dtype.
// Built and called by kernels/cpu_decode_attention.py, which also holds the torch reference.
//
// One task per (sequence, KV head), and in it the query heads that share the KV head together
// (see attend): the keys are scored 16 positions at a time, the scores (float32) softmaxed, and
// the values summed with those weights; 16 lanes at a time (head_dim 32, 64, 96, 128 or 256).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// 16 float lanes: AVX-512 registers where the CPU has them (GCC's vector extension; it splits
// them on a narrower CPU).
typedef float vfloat __attribute__((vector_size(64)));
typedef int32_t vint __attribute__((vector_size(64)));
typedef uint32_t vuint __attribute__((vector_size(64)));
typedef uint16_t vushort __attribute__((vector_size(32)));
constexpr int64_t LANES = 16;

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vfloat load(const c10::BFloat16* p) {  // bf16 is a float's upper half
  vushort h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<vfloat>(__builtin_convertvector(h, vuint) << 16);
}

inline float hsum(vfloat v) {
  float s = 0;
  for (int l = 0; l < LANES; ++l) s += v[l];
  return s;
}

// exp of 16 lanes at once (Cephes' expf: range reduction by ln 2, a degree-6 polynomial; about
// 1 ulp), for x <= 0 as softmax's (x - max) is; below -87 it is ~1e-38 rather than 0.
inline vfloat vexp(vfloat x) {
  const vfloat lo = vfloat{} - 87.0f;
  x = x < lo ? lo : x;
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

template <typename T>
inline void store(T* dst, vfloat v) {
  for (int l = 0; l < LANES; ++l) dst[l] = static_cast<T>(v[l]);
}

// The lane sums of 16 vectors, as the lanes of one: out[i] = sum(a[i]). Each level folds every
// vector's partial sums to half as many lanes and packs two vectors' into one (45 shuffles and
// adds where 16 separate sums take ~240 scalar steps).
inline vfloat sum16(const vfloat* a) {
  vfloat b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19,
                                   20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                   23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                   23, 26, 27, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}

// Rows are read from blocks scattered over the pool, a KV head's D values of each slot (a third
// of its bytes for SmolLM2), which the hardware's prefetchers do not foresee: each key row is
// asked for PREFETCH_KEYS positions before it is scored, into L1, and each value row while its
// chunk's keys are scored, into L2 (the value pass comes after the whole context's keys).
// Batch 32, SmolLM2's 30 layers, a pool of 4096 blocks, 2 threads (thirteenth session's Zen 4
// box, median of 10), ms with / without, blocks in order and shuffled: 160 positions fp32
// 18.0 / 18.3 and 21.4 / 23.7, bf16 13.3 / 13.5 and 16.8 / 23.1; 450 positions fp32 53.6 /
// 55.1 and 64.0 / 70.9. The same results bit for bit.
constexpr int64_t PREFETCH_KEYS = 64;

template <typename T, int64_t D>
inline void prefetch_row(const T* row, int locality) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t line = 0; line < D * static_cast<int64_t>(sizeof(T)); line += 64) {
    if (locality == 3) __builtin_prefetch(p + line, 0, 3);
    else __builtin_prefetch(p + line, 0, 2);
  }
}

// One sequence's query heads h * group + g0 .. + G - 1 against KV head h of its context;
// NV = head_dim / LANES. scores: room for G x round_up(len, LANES) floats; rows: for
// round_up(len, LANES) offsets (located by the caller). The G heads run together: each key and
// value row is loaded (and widened) once for all of them, the G queries and outputs stay in
// registers. Batch 32 at 160 positions, 9 heads on 3 KV heads, 1 thread (AVX-512 box), the
// pool's blocks shuffled, minimum of 20: 244 / 341 us a layer (fp32 / bf16) one head at a time,
// 174-211 / 202-258 us together (119 / 163 with the context in cache).
template <typename T, int NV, int G>
void attend(const T* q, const T* k_cache, const T* v_cache, int64_t len, int64_t h,
            int64_t group, int64_t g0, float scale, T* out, float* scores, const int64_t* rows) {
  constexpr int64_t D = NV * LANES;
  const int64_t width = (len + LANES - 1) / LANES * LANES;
  vfloat qv[G][NV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) qv[g][j] = load(q + (h * group + g0 + g) * D + j * LANES) * scale;
  for (int64_t p = 0; p < std::min(PREFETCH_KEYS, len); ++p) prefetch_row<T, D>(k_cache + rows[p], 3);
  for (int64_t p0 = 0; p0 < len; p0 += LANES) {
    for (int64_t l = 0; l < LANES; ++l) {  // the keys PREFETCH_KEYS on, this chunk's values
      if (p0 + PREFETCH_KEYS + l < len)
        prefetch_row<T, D>(k_cache + rows[p0 + PREFETCH_KEYS + l], 3);
      prefetch_row<T, D>(v_cache + rows[p0 + l], 2);
    }
    vfloat s[G][LANES];
    for (int64_t l = 0; l < LANES; ++l) {
      const T* k = k_cache + rows[p0 + l];
      vfloat kv[NV];
      for (int j = 0; j < NV; ++j) kv[j] = load(k + j * LANES);
      for (int g = 0; g < G; ++g) {
        vfloat a = qv[g][0] * kv[0];
        for (int j = 1; j < NV; ++j) a += qv[g][j] * kv[j];
        s[g][l] = a;
      }
    }
    for (int g = 0; g < G; ++g) {
      const vfloat sums = sum16(s[g]);
      std::memcpy(scores + g * width + p0, &sums, sizeof sums);
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) {
    float* sc = scores + g * width;
    const float m = *std::max_element(sc, sc + len);
    vfloat total{};
    for (int64_t p = 0; p < width; p += LANES) {
      vfloat e = vexp(load(sc + p) - m);
      for (int64_t l = std::max<int64_t>(len - p, 0); l < LANES; ++l) e[l] = 0;
      std::memcpy(sc + p, &e, sizeof e);
      total += e;
    }
    inv[g] = 1.0f / hsum(total);
  }
  vfloat acc[G][NV] = {};
  for (int64_t p = 0; p < len; ++p) {
    const T* v = v_cache + rows[p];
    vfloat vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load(v + j * LANES);
    for (int g = 0; g < G; ++g) {
      const float w = scores[g * width + p];
      for (int j = 0; j < NV; ++j) acc[g][j] += w * vv[j];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j)
      store(out + (h * group + g0 + g) * D + j * LANES, acc[g][j] * inv[g]);
}

// The offsets of a context's rows for KV head h, in either cache (no division per position);
// positions len .. round_up(len, LANES) - 1 repeat the last (scored, then dropped).
inline void locate_rows(const int32_t* table, int64_t len, int64_t bs, int64_t slot_stride,
                        int64_t h, int64_t d, int64_t* rows) {
  const int64_t block_stride = bs * slot_stride, width = (len + LANES - 1) / LANES * LANES;
  for (int64_t p0 = 0; p0 < len; p0 += bs) {
    const int64_t base = table[p0 / bs] * block_stride + h * d, n = std::min(bs, len - p0);
    for (int64_t i = 0; i < n; ++i) rows[p0 + i] = base + i * slot_stride;
  }
  for (int64_t p = len; p < width; ++p) rows[p] = rows[len - 1];
}

// A group's heads in passes of up to 12 / NV (at most 4): a pass keeps G x NV query and as
// many output vectors in registers (32 of them with AVX-512).
template <typename T, int NV>
void attend_group(const T* q, const T* k_cache, const T* v_cache, int64_t len, int64_t h,
                  int64_t group, float scale, T* out, float* scores, const int64_t* rows) {
  constexpr int64_t PASS = std::max(1, std::min(4, 12 / NV));
  for (int64_t g0 = 0; g0 < group; g0 += PASS) {
    switch (std::min<int64_t>(PASS, group - g0)) {
      case 4: attend<T, NV, 4>(q, k_cache, v_cache, len, h, group, g0, scale, out, scores, rows); break;
      case 3: attend<T, NV, 3>(q, k_cache, v_cache, len, h, group, g0, scale, out, scores, rows); break;
      case 2: attend<T, NV, 2>(q, k_cache, v_cache, len, h, group, g0, scale, out, scores, rows); break;
      default: attend<T, NV, 1>(q, k_cache, v_cache, len, h, group, g0, scale, out, scores, rows); break;
    }
  }
}

template <typename T, int NV>
void decode(const at::Tensor& q,             // [n, heads, d]
            const at::Tensor& k_cache,       // [num_blocks, block_size, kv_heads, d]
            const at::Tensor& v_cache,       // [num_blocks, block_size, kv_heads, d]
            const at::Tensor& block_tables,  // [n, max_blocks] int32
            const at::Tensor& seq_lens,      // [n] int32
            double scale, at::Tensor& out) { // [n, heads, d]
  const int64_t n = q.size(0), heads = q.size(1);
  const int64_t bs = k_cache.size(1), kvh = k_cache.size(2), group = heads / kvh;
  const int64_t slot_stride = kvh * NV * LANES, table_stride = block_tables.stride(0);
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k_cache.const_data_ptr<T>();
  const T* vp = v_cache.const_data_ptr<T>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t max_len = n ? *std::max_element(lens, lens + n) : 0;
  at::parallel_for(0, n * kvh, 1, [&](int64_t begin, int64_t end) {
    const int64_t width = (max_len + LANES - 1) / LANES * LANES;
    std::vector<float> scores(4 * width);
    std::vector<int64_t> rows(width);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kvh, h = task % kvh;
      locate_rows(tables + b * table_stride, lens[b], bs, slot_stride, h, NV * LANES,
                  rows.data());
      attend_group<T, NV>(qp + b * q.stride(0), kp, vp, lens[b], h, group,
                          static_cast<float>(scale), op + b * out.stride(0), scores.data(),
                          rows.data());
    }
  });
}

template <typename T>
void dispatch(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
              at::Tensor& out) {
  switch (q.size(2) / LANES) {
    case 2: return decode<T, 2>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
    case 4: return decode<T, 4>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
    case 6: return decode<T, 6>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
    case 8: return decode<T, 8>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
    case 16: return decode<T, 16>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
    default: TORCH_CHECK(false, "head_dim must be 32, 64, 96, 128 or 256");
  }
}

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.size(2) == k_cache.size(3), "shapes");
  // q and out may be row slices (q of the qkv projection's output): heads and lanes dense.
  for (const at::Tensor* t : {&q, static_cast<const at::Tensor*>(&out)})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "dense [heads, d] rows");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && seq_lens.is_contiguous() &&
              block_tables.stride(1) == 1 && out.sizes() == q.sizes(), "contiguous tensors");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type()
              && out.scalar_type() == q.scalar_type(), "one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "int32 block tables and lengths");
  if (q.scalar_type() == at::kFloat) {
    dispatch<float>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    dispatch<c10::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  } else {
    TORCH_CHECK(false, "float32 or bfloat16 only");
  }
}

// ---- extend (prefill) rows -------------------------------------------------------------------
// A sequence's q_len new tokens (the last of its ctx positions) attend causally to its whole
// context, read in place from the pool: token i of the chunk sees positions <= ctx - q_len + i.
// One task per (sequence, KV head, tile of up to TILE_TOKENS tokens): the tile's tokens x the
// group's query heads ("pairs", float32 in a scratch buffer) run against the context 16 keys at a
// time, with an online softmax (running max and sum per pair, output rescaled when the max
// grows). Each 16-key chunk is transposed once per task (kt [D][16]: a key's d-th values as one
// vector), so a pair's 16 scores are D broadcast FMAs with no lane sums, and the chunk's values
// widened once (vt [16][D], zero past the context's end: the pool's unwritten slots may hold
// NaN); every pair of the tile then reuses both from L1. Positions past a token's limit get no
// weight (selected to zero, never multiplied). Tasks are taken in order of their work, longest
// first, from a shared counter (threads that get less CPU take fewer), so a descheduled thread
// delays no fixed share. The first ShareGPT-like prefill step of bench/cpu_throughput.py (15
// prompts, 2048 tokens; 1.78M query x key pairs a head group), one layer, 1 thread (AVX-512):
// 11.8 ms (38 GFLOP/s) against 27.9 for the gathered SDPA path.
constexpr int64_t TILE_TOKENS = 16;
constexpr int PAIR_BLOCK = 8;  // pairs scored together: 8 chains of FMAs on one key vector

struct ExtendScratch {
  std::vector<float> q, o, kt, vt, m, l;
  // q has room for the pairs rounded up to PAIR_BLOCK, the rows past them zero
  ExtendScratch(int64_t pairs, int64_t d)
      : q((pairs + PAIR_BLOCK - 1) / PAIR_BLOCK * PAIR_BLOCK * d), o(pairs * d), kt(d * LANES),
        vt(LANES * d), m(pairs), l(pairs) {}
};

inline float hmax(vfloat v) {
  float m = v[0];
  for (int l = 1; l < LANES; ++l) m = std::max(m, v[l]);
  return m;
}

template <typename T, int NV>
void extend_tile(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,
                 const int32_t* table, int64_t ctx, int64_t q_len, int64_t r0, int64_t rows,
                 int64_t bs, int64_t slot_stride, int64_t h, int64_t group, float scale, T* out,
                 int64_t out_stride, ExtendScratch& s) {
  constexpr int64_t D = NV * LANES;
  const int64_t pairs = rows * group, block_stride = bs * slot_stride;
  const int64_t first_limit = ctx - q_len + r0;  // the tile's first token sees up to here
  for (int64_t i = 0; i < pairs; ++i) {
    const T* src = q + (r0 + i / group) * q_stride + (h * group + i % group) * D;
    for (int j = 0; j < NV; ++j) {
      const vfloat v = load(src + j * LANES) * scale;
      std::memcpy(&s.q[i * D + j * LANES], &v, sizeof v);
    }
  }
  std::fill(s.q.begin() + pairs * D, s.q.end(), 0.0f);  // a last block's unused pairs
  std::fill(s.o.begin(), s.o.begin() + pairs * D, 0.0f);
  std::fill(s.m.begin(), s.m.begin() + pairs, -std::numeric_limits<float>::infinity());
  std::fill(s.l.begin(), s.l.begin() + pairs, 0.0f);
  const int64_t last = first_limit + rows - 1;
  vint lane;
  for (int l = 0; l < LANES; ++l) lane[l] = l;
  for (int64_t p0 = 0; p0 <= last; p0 += LANES) {
    const int64_t n = std::min<int64_t>(LANES, ctx - p0);
    for (int64_t j = 0; j < LANES; ++j) {
      float* vj = &s.vt[j * D];
      if (j >= n) {
        for (int64_t d = 0; d < D; ++d) s.kt[d * LANES + j] = 0.0f;
        std::fill(vj, vj + D, 0.0f);
        continue;
      }
      const int64_t pos = p0 + j;
      const int64_t off = table[pos / bs] * block_stride + (pos % bs) * slot_stride + h * D;
      const T* k = k_cache + off;
      const T* v = v_cache + off;
      for (int c = 0; c < NV; ++c) {
        const vfloat kv = load(k + c * LANES), vv = load(v + c * LANES);
        for (int l = 0; l < LANES; ++l) s.kt[(c * LANES + l) * LANES + j] = kv[l];
        std::memcpy(vj + c * LANES, &vv, sizeof vv);
      }
    }
    for (int64_t i0 = 0; i0 < pairs; i0 += PAIR_BLOCK) {
      const int nb = static_cast<int>(std::min<int64_t>(PAIR_BLOCK, pairs - i0));
      vfloat sc[PAIR_BLOCK] = {};
      for (int64_t d = 0; d < D; ++d) {
        const vfloat kd = load(&s.kt[d * LANES]);
        for (int b = 0; b < PAIR_BLOCK; ++b) sc[b] += s.q[(i0 + b) * D + d] * kd;
      }
      for (int b = 0; b < nb; ++b) {
        const int64_t i = i0 + b, limit = first_limit + i / group;
        if (p0 > limit) continue;
        const vint visible = lane <= static_cast<int32_t>(std::min<int64_t>(limit - p0, n - 1));
        const vfloat neg = vfloat{} - std::numeric_limits<float>::infinity();
        const vfloat x = visible ? sc[b] : neg;
        const float mx = std::max(s.m[i], hmax(x));
        const float alpha = s.m[i] == -std::numeric_limits<float>::infinity()
                                ? 0.0f : std::exp(s.m[i] - mx);
        vfloat p = vexp(x - mx);
        p = visible ? p : vfloat{};
        s.m[i] = mx;
        s.l[i] = s.l[i] * alpha + hsum(p);
        float* o = &s.o[i * D];
        vfloat acc[NV];
        for (int c = 0; c < NV; ++c) acc[c] = load(o + c * LANES) * alpha;
        for (int64_t j = 0; j < n; ++j)
          for (int c = 0; c < NV; ++c) acc[c] += p[j] * load(&s.vt[j * D + c * LANES]);
        for (int c = 0; c < NV; ++c) std::memcpy(o + c * LANES, &acc[c], sizeof acc[c]);
      }
    }
  }
  for (int64_t i = 0; i < pairs; ++i) {
    T* dst = out + (r0 + i / group) * out_stride + (h * group + i % group) * D;
    const float inv = 1.0f / s.l[i];
    for (int c = 0; c < NV; ++c) store(dst + c * LANES, load(&s.o[i * D + c * LANES]) * inv);
  }
}

struct ExtendTask {
  int64_t work, b, h, r0;
};

template <typename T, int NV>
void extend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& query_start_loc,
            const at::Tensor& seq_lens, int64_t first_seq, double scale, at::Tensor& out) {
  const int64_t n = seq_lens.size(0), heads = q.size(1);
  const int64_t bs = k_cache.size(1), kvh = k_cache.size(2), group = heads / kvh;
  const int64_t slot_stride = kvh * NV * LANES, table_stride = block_tables.stride(0);
  const int32_t* qsl = query_start_loc.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  std::vector<ExtendTask> tasks;
  for (int64_t b = first_seq; b < n; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b], ctx = lens[b];
    TORCH_CHECK(q_len <= ctx, "a sequence has more new tokens than context");
    for (int64_t r0 = 0; r0 < q_len; r0 += TILE_TOKENS) {
      const int64_t rows = std::min(TILE_TOKENS, q_len - r0);
      for (int64_t h = 0; h < kvh; ++h) tasks.push_back({rows * (ctx - q_len + r0 + rows), b, h, r0});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const ExtendTask& a, const ExtendTask& b) { return a.work > b.work; });
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k_cache.const_data_ptr<T>();
  const T* vp = v_cache.const_data_ptr<T>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  std::atomic<int64_t> next{0};
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_tasks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    ExtendScratch scratch(TILE_TOKENS * group, NV * LANES);
    for (int64_t t = next++; t < num_tasks; t = next++) {
      const ExtendTask& task = tasks[t];
      const int64_t q_len = qsl[task.b + 1] - qsl[task.b];
      extend_tile<T, NV>(qp + qsl[task.b] * q.stride(0), q.stride(0), kp, vp,
                         tables + task.b * table_stride, lens[task.b], q_len, task.r0,
                         std::min(TILE_TOKENS, q_len - task.r0), bs, slot_stride, task.h, group,
                         static_cast<float>(scale), op + qsl[task.b] * out.stride(0),
                         out.stride(0), scratch);
    }
  });
}

void paged_extend_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                            int64_t first_seq, double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.size(2) == k_cache.size(3), "shapes");
  for (const at::Tensor* t : {&q, static_cast<const at::Tensor*>(&out)})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "dense [heads, d] rows");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && seq_lens.is_contiguous() &&
              query_start_loc.is_contiguous() && block_tables.stride(1) == 1 &&
              out.sizes() == q.sizes(), "contiguous tensors");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type()
              && out.scalar_type() == q.scalar_type(), "one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              query_start_loc.scalar_type() == at::kInt &&
              query_start_loc.size(0) == seq_lens.size(0) + 1, "int32 tables, offsets, lengths");
  TORCH_CHECK(0 <= first_seq && first_seq <= seq_lens.size(0), "first_seq out of range");
  auto run = [&](auto tag) {
    using T = decltype(tag);
    switch (q.size(2) / LANES) {
      case 2: return extend<T, 2>(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                  first_seq, scale, out);
      case 4: return extend<T, 4>(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                  first_seq, scale, out);
      case 6: return extend<T, 6>(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                  first_seq, scale, out);
      case 8: return extend<T, 8>(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                  first_seq, scale, out);
      case 16: return extend<T, 16>(q, k_cache, v_cache, block_tables, query_start_loc,
                                    seq_lens, first_seq, scale, out);
      default: TORCH_CHECK(false, "head_dim must be 32, 64, 96, 128 or 256");
    }
  };
  if (q.scalar_type() == at::kFloat) run(float{});
  else if (q.scalar_type() == at::kBFloat16) run(c10::BFloat16{});
  else TORCH_CHECK(false, "float32 or bfloat16 only");
}

}  // namespace

TORCH_LIBRARY(splitserve_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
  m.def("paged_extend_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, int first_seq, float scale, Tensor(a!) out) "
        "-> ()");
}

TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) {
  m.impl("paged_decode_attention", paged_decode_attention);
  m.impl("paged_extend_attention", paged_extend_attention);
}
