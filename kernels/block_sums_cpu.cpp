// The KV checksum's per-block sums on the CPU, read in place from the pool on the calling thread
// (block_sums_cpu.py says why one thread). For each listed block: the sum of its words and the
// sum of their squares (int32 words, int64 sums wrapping mod 2**64), over every layer and K/V.
// copy_block_sums also writes each word it reads to a block of another pool: a handoff's copy and
// its verification in one pass.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>

namespace {

// One contiguous run of int32 words: (sum, sum of squares) added into s and q, wrapping; with
// COPY each word also goes to out.
template <bool COPY>
inline void add_words(const int32_t* p, int32_t* out, int64_t n, uint64_t& s, uint64_t& q) {
  // Four lanes of unsigned accumulators: wrapping is defined, and the compiler widens and
  // multiplies them in vector registers.
  uint64_t s4[4] = {0, 0, 0, 0}, q4[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int l = 0; l < 4; ++l) {
      const int32_t w = p[i + l];
      if (COPY) out[i + l] = w;
      const int64_t x = w;
      s4[l] += static_cast<uint64_t>(x);
      q4[l] += static_cast<uint64_t>(x * x);  // |x| <= 2**31: the square fits in int64
    }
  }
  for (; i < n; ++i) {
    const int32_t w = p[i];
    if (COPY) out[i] = w;
    const int64_t x = w;
    s += static_cast<uint64_t>(x);
    q += static_cast<uint64_t>(x * x);
  }
  s += s4[0] + s4[1] + s4[2] + s4[3];
  q += q4[0] + q4[1] + q4[2] + q4[3];
}

struct Pool {
  const int32_t* words;
  int64_t slices, blocks, block_words;
};

Pool words_of(const at::Tensor& pool, const char* name) {
  TORCH_CHECK(pool.device().is_cpu() && pool.is_contiguous() && pool.dim() >= 4, name,
              ": a contiguous CPU tensor [layers, 2, blocks, ...]");
  const int64_t block_bytes = pool.stride(2) * pool.element_size();
  TORCH_CHECK(block_bytes % 4 == 0, name, ": a block's bytes must be a multiple of 4");
  return {static_cast<const int32_t*>(pool.const_data_ptr()), pool.size(0) * pool.size(1),
          pool.size(2), block_bytes / 4};
}

void check_out(const at::Tensor& out, int64_t n) {
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.dim() == 2 &&
              out.size(0) == n && out.size(1) == 2, "out: [n, 2] int64");
}

void block_sums(const at::Tensor& pool,   // [layers, 2, blocks, ...], contiguous, any dtype
                const at::Tensor& index,  // [n] int64 block ids
                at::Tensor& out) {        // [n, 2] int64, written
  const Pool src = words_of(pool, "pool");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1 && index.is_contiguous(),
              "index: [n] int64");
  check_out(out, index.size(0));
  const int64_t* ids = index.const_data_ptr<int64_t>();
  int64_t* sums = out.mutable_data_ptr<int64_t>();
  for (int64_t j = 0; j < index.size(0); ++j) {
    const int64_t id = ids[j];
    TORCH_CHECK(id >= 0 && id < src.blocks, "block id ", id, " outside the pool's ", src.blocks);
    uint64_t s = 0, q = 0;
    for (int64_t slice = 0; slice < src.slices; ++slice) {
      add_words<false>(src.words + (slice * src.blocks + id) * src.block_words, nullptr,
                       src.block_words, s, q);
    }
    sums[2 * j] = static_cast<int64_t>(s);
    sums[2 * j + 1] = static_cast<int64_t>(q);
  }
}

void copy_block_sums(const at::Tensor& src_pool,  // [layers, 2, blocks_src, ...], contiguous
                     at::Tensor& dst_pool,        // [layers, 2, blocks_dst, ...], same dtype
                     const at::Tensor& ids,       // [2, n] int64: source ids, destination ids
                     at::Tensor& out) {           // [n, 2] int64 sums of the copied blocks
  const Pool src = words_of(src_pool, "src");
  const Pool dst = words_of(dst_pool, "dst");
  TORCH_CHECK(src_pool.scalar_type() == dst_pool.scalar_type() && src.slices == dst.slices &&
              src.block_words == dst.block_words, "src and dst differ outside the block axis");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == 2 &&
              ids.is_contiguous(), "ids: [2, n] int64");
  const int64_t n = ids.size(1);
  check_out(out, n);
  const int64_t* src_ids = ids.const_data_ptr<int64_t>();
  const int64_t* dst_ids = src_ids + n;
  auto* dst_words = static_cast<int32_t*>(dst_pool.mutable_data_ptr());
  int64_t* sums = out.mutable_data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) {
    const int64_t s_id = src_ids[j], d_id = dst_ids[j];
    TORCH_CHECK(s_id >= 0 && s_id < src.blocks, "source block id ", s_id, " outside the pool's ",
                src.blocks);
    TORCH_CHECK(d_id >= 0 && d_id < dst.blocks, "destination block id ", d_id,
                " outside the pool's ", dst.blocks);
    uint64_t s = 0, q = 0;
    for (int64_t slice = 0; slice < src.slices; ++slice) {
      add_words<true>(src.words + (slice * src.blocks + s_id) * src.block_words,
                      dst_words + (slice * dst.blocks + d_id) * dst.block_words, src.block_words,
                      s, q);
    }
    sums[2 * j] = static_cast<int64_t>(s);
    sums[2 * j + 1] = static_cast<int64_t>(q);
  }
}

}  // namespace

TORCH_LIBRARY(splitserve_block_sums, m) {
  m.def("block_sums(Tensor pool, Tensor index, Tensor(a!) out) -> ()");
  m.def("copy_block_sums(Tensor src, Tensor(a!) dst, Tensor ids, Tensor(b!) out) -> ()");
}

TORCH_LIBRARY_IMPL(splitserve_block_sums, CPU, m) {
  m.impl("block_sums", block_sums);
  m.impl("copy_block_sums", copy_block_sums);
}
