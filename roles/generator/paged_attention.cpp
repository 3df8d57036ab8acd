// Decode attention straight over the paged KV cache, on the CPU, in float32.
//
// One query token per sequence (a decode step) attends over that sequence's keys and values
// where they live: the block pool `[blocks, block_size, kv_heads, head_dim]`, found through its
// block table. Nothing is gathered into a dense copy first. torch has no CPU attention that
// reads a block table, and its fused CPU attention spends most of its time on per-call
// overhead at one query row (see orchestr/roles/generator/_kernels.py for the figures).
//
// Each sequence is one task (or each of its kv heads, when there are fewer sequences than
// threads): its query heads score every key (one pass over the keys, block by block), the
// scores go through a softmax, and the values are summed with those weights (one pass over
// the values). A task's arithmetic is serial and in a fixed
// order, so a sequence's output does not depend on the other sequences in the batch nor on
// how the tasks are split over threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// Query `q`'s dot product with key `k`, both `D` floats (a multiple of the vector width):
// products summed in vector lanes, the lanes then added in a fixed tree.
template <int64_t D>
inline float dot(const float* q, const float* k) {
  constexpr int64_t kWidth = Vec::size(), kParts = D / kWidth;
  Vec acc = Vec::loadu(q) * Vec::loadu(k);
  for (int64_t c = 1; c < kParts; ++c) {
    acc = at::vec::fmadd(Vec::loadu(q + c * kWidth), Vec::loadu(k + c * kWidth), acc);
  }
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
}

// Ask for `n` floats from `at` to be brought into cache (the next block's same position,
// while this block's is worked on: blocks are scattered in the pool, so the hardware's own
// prefetcher, which follows one stream within a page, does not see them coming).
inline void prefetch(const float* at, int64_t n) {
  for (int64_t x = 0; x < n; x += 16) __builtin_prefetch(at + x, 0, 3);
}

struct Problem {
  const float* q;
  const float* k;
  const float* v;
  float* out;
  const int32_t* table;
  const int64_t* length;
  int64_t heads, kv_heads, dim, size, width;
  float scale;
};

// The attention of sequence `i`'s query heads of kv heads `first .. last - 1`: scores over
// its keys block by block (each position's keys of those heads are contiguous, so the reads
// run in order within a block), a softmax per query head, then per query head the values
// summed with its weights in registers. `D`: the head dim, at compile time (a multiple of
// the vector width), or 0 for any other (plain loops).
template <int64_t D>
void attend(const Problem& p, int64_t i, int64_t first, int64_t last, std::vector<float>& scores) {
  const int64_t dim = D > 0 ? D : p.dim, group = p.heads / p.kv_heads, len = p.length[i];
  const int64_t stride = p.kv_heads * dim, rows = (last - first) * group;
  const int32_t* row = p.table + i * p.width;
  const float* query = p.q + (i * p.heads + first * group) * dim;
  scores.resize(rows * len);
  const int64_t span = (last - first) * dim;  // floats a position holds for this task
  for (int64_t t0 = 0; t0 < len; t0 += p.size) {
    const float* keys = p.k + row[t0 / p.size] * p.size * stride + first * dim;
    const float* next = t0 + p.size < len ? p.k + row[t0 / p.size + 1] * p.size * stride + first * dim : nullptr;
    const int64_t m = std::min(p.size, len - t0);
    for (int64_t t = 0; t < m; ++t) {
      if (next != nullptr) prefetch(next + t * stride, span);
      for (int64_t r = 0; r < rows; ++r) {
        const float* key = keys + t * stride + (r / group) * dim;
        const float* q = query + r * dim;
        float s;
        if constexpr (D > 0) {
          s = dot<D>(q, key);
        } else {
          s = 0.f;
          for (int64_t x = 0; x < dim; ++x) s += q[x] * key[x];
        }
        scores[r * len + t0 + t] = s * p.scale;
      }
    }
  }
  float* result = p.out + (i * p.heads + first * group) * dim;
  for (int64_t r = 0; r < rows; ++r) {
    float* w = scores.data() + r * len;
    const float top = *std::max_element(w, w + len);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      w[t] = std::exp(w[t] - top);
      sum += w[t];
    }
    const float inv = 1.f / sum;
    const int64_t offset = (first + r / group) * dim;
    float* out = result + r * dim;
    if constexpr (D > 0) {
      constexpr int64_t kWidth = Vec::size(), kParts = D / kWidth;
      Vec acc[kParts];
      for (int64_t c = 0; c < kParts; ++c) acc[c] = Vec(0.f);
      for (int64_t t0 = 0; t0 < len; t0 += p.size) {
        const float* values = p.v + row[t0 / p.size] * p.size * stride + offset;
        const float* next = t0 + p.size < len ? p.v + row[t0 / p.size + 1] * p.size * stride + offset : nullptr;
        const int64_t m = std::min(p.size, len - t0);
        for (int64_t t = 0; t < m; ++t) {
          if (next != nullptr) prefetch(next + t * stride, dim);
          const Vec weight(w[t0 + t]);
          for (int64_t c = 0; c < kParts; ++c) {
            acc[c] = at::vec::fmadd(weight, Vec::loadu(values + t * stride + c * kWidth), acc[c]);
          }
        }
      }
      for (int64_t c = 0; c < kParts; ++c) (acc[c] * Vec(inv)).store(out + c * kWidth);
    } else {
      std::fill(out, out + dim, 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const float* value = p.v + (row[t / p.size] * p.size + t % p.size) * stride + offset;
        for (int64_t x = 0; x < dim; ++x) out[x] += w[t] * value[x];
      }
      for (int64_t x = 0; x < dim; ++x) out[x] *= inv;
    }
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& tables, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(q.dim() == 3, "q must be [sequences, heads, head_dim], got ", q.sizes());
  TORCH_CHECK(k_pool.dim() == 4, "k_pool must be [blocks, block_size, kv_heads, head_dim], got ",
              k_pool.sizes());
  TORCH_CHECK(v_pool.sizes() == k_pool.sizes(), "v_pool ", v_pool.sizes(), " is not k_pool's shape ",
              k_pool.sizes());
  TORCH_CHECK(tables.dim() == 2, "tables must be [sequences, max_blocks], got ", tables.sizes());
  TORCH_CHECK(lengths.dim() == 1, "lengths must be [sequences], got ", lengths.sizes());
  for (const at::Tensor* t : {&q, &k_pool, &v_pool, &tables, &lengths}) {
    TORCH_CHECK(t->device().is_cpu(), "decode_attention runs on the CPU");
    TORCH_CHECK(t->is_contiguous(), "decode_attention takes contiguous tensors");
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_pool.scalar_type() == at::kFloat &&
                  v_pool.scalar_type() == at::kFloat,
              "decode_attention takes float32 queries, keys and values");
  TORCH_CHECK(tables.scalar_type() == at::kInt, "tables must be int32");
  TORCH_CHECK(lengths.scalar_type() == at::kLong, "lengths must be int64");
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t blocks = k_pool.size(0), size = k_pool.size(1), kv_heads = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == dim, "head_dim ", dim, " of q is not the pool's ", k_pool.size(3));
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, heads, " query heads do not share ", kv_heads,
              " kv heads evenly");
  TORCH_CHECK(tables.size(0) == n && lengths.size(0) == n, "q has ", n,
              " sequences; tables and lengths must too");
  const int64_t width = tables.size(1);
  const int32_t* table = tables.data_ptr<int32_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  // every block a sequence reads must be in the pool: a bad table is an error, never a read
  // outside it
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(length[i] >= 1 && length[i] <= width * size, "sequence ", i, " has length ",
                length[i], "; its table holds ", width * size, " positions");
    const int64_t used = (length[i] + size - 1) / size;
    for (int64_t b = 0; b < used; ++b) {
      const int32_t block = table[i * width + b];
      TORCH_CHECK(block >= 0 && block < blocks, "sequence ", i, " names block ", block, " of ",
                  blocks);
    }
  }
  auto out = at::empty_like(q);
  // A task is one sequence (or one kv head of one, when there are fewer sequences than
  // threads: a head's arithmetic is the same either way).
  const Problem problem{q.data_ptr<float>(),     k_pool.data_ptr<float>(), v_pool.data_ptr<float>(),
                        out.data_ptr<float>(),   table,                    length,
                        heads,                   kv_heads,                 dim,
                        size,                    width,                    static_cast<float>(scale)};
  const int64_t split = n >= at::get_num_threads() ? 1 : kv_heads;
  at::parallel_for(0, n * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / split, first = split == 1 ? 0 : task % split;
      const int64_t last = split == 1 ? kv_heads : first + 1;
      if (dim == 64 && 64 % Vec::size() == 0) {
        attend<64>(problem, i, first, last, scores);
      } else if (dim == 128 && 128 % Vec::size() == 0) {
        attend<128>(problem, i, first, last, scores);
      } else {
        attend<0>(problem, i, first, last, scores);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(orchestr_kernels, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor lengths, "
      "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(orchestr_kernels, CPU, m) { m.impl("decode_attention", &decode_attention); }
