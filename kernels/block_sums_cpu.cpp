// The KV checksum's per-block sums on the CPU, read in place from the pool on the calling thread
// (block_sums_cpu.py says why one thread). For each listed block: the sum of its words and the
// sum of their squares (int32 words, int64 sums wrapping mod 2**64), over every layer and K/V.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>

namespace {

// One contiguous run of int32 words: (sum, sum of squares) added into s and q, wrapping.
inline void add_words(const int32_t* p, int64_t n, uint64_t& s, uint64_t& q) {
  // Four lanes of unsigned accumulators: wrapping is defined, and the compiler widens and
  // multiplies them in vector registers.
  uint64_t s4[4] = {0, 0, 0, 0}, q4[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int l = 0; l < 4; ++l) {
      const int64_t x = p[i + l];
      s4[l] += static_cast<uint64_t>(x);
      q4[l] += static_cast<uint64_t>(x * x);  // |x| < 2**31: the square fits in int64
    }
  }
  for (; i < n; ++i) {
    const int64_t x = p[i];
    s += static_cast<uint64_t>(x);
    q += static_cast<uint64_t>(x * x);
  }
  s += s4[0] + s4[1] + s4[2] + s4[3];
  q += q4[0] + q4[1] + q4[2] + q4[3];
}

void block_sums(const at::Tensor& pool,   // [layers, 2, blocks, ...], contiguous, any dtype
                const at::Tensor& index,  // [n] int64 block ids
                at::Tensor& out) {        // [n, 2] int64, written
  TORCH_CHECK(pool.device().is_cpu() && pool.is_contiguous() && pool.dim() >= 4,
              "pool: a contiguous CPU tensor [layers, 2, blocks, ...]");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1 && index.is_contiguous(),
              "index: [n] int64");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.dim() == 2 &&
              out.size(0) == index.size(0) && out.size(1) == 2, "out: [n, 2] int64");
  const int64_t slices = pool.size(0) * pool.size(1);
  const int64_t blocks = pool.size(2);
  const int64_t block_bytes = pool.stride(2) * pool.element_size();
  TORCH_CHECK(block_bytes % 4 == 0, "a block's bytes must be a multiple of 4");
  const int64_t words = block_bytes / 4;
  const auto* base = static_cast<const int32_t*>(pool.const_data_ptr());
  const int64_t* ids = index.const_data_ptr<int64_t>();
  int64_t* sums = out.mutable_data_ptr<int64_t>();
  for (int64_t j = 0; j < index.size(0); ++j) {
    const int64_t id = ids[j];
    TORCH_CHECK(id >= 0 && id < blocks, "block id ", id, " outside the pool's ", blocks);
    uint64_t s = 0, q = 0;
    for (int64_t slice = 0; slice < slices; ++slice) {
      add_words(base + (slice * blocks + id) * words, words, s, q);
    }
    sums[2 * j] = static_cast<int64_t>(s);
    sums[2 * j + 1] = static_cast<int64_t>(q);
  }
}

}  // namespace

TORCH_LIBRARY(splitserve_block_sums, m) {
  m.def("block_sums(Tensor pool, Tensor index, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(splitserve_block_sums, CPU, m) {
  m.impl("block_sums", block_sums);
}
