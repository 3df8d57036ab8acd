// orchestr's CPU kernels for the paged runner, in float32 (see _kernels.py for how they are
// built and where they are used instead of torch's ops).
//
// decode_attention: one query token per sequence (a decode step) attends over that sequence's
// keys and values where they live, the block pool `[blocks, block_size, kv_heads,
// head_dim]`, found through its block table; nothing is gathered into a dense copy first.
// Each sequence is one task (or each of its kv heads, when there are fewer sequences than
// threads): its query heads score every key (one pass over the keys, block by block), the
// scores go through a softmax, and the values are summed with those weights (one pass over
// the values). A task's arithmetic is serial and in a fixed order, so a sequence's output
// does not depend on the other sequences in the batch nor on how tasks split over threads.
//
// rope_and_cache, silu_and_mul, add_rms_norm: the elementwise work around the products, one
// pass each where torch's ops take several.

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

// Ask for `n` floats from `at` to be brought into the core's second-level cache (blocks are
// scattered in the pool, so the hardware's own prefetcher, which follows one stream within a
// page, does not see them coming). Asking for the first level measured slower here.
inline void prefetch(const float* at, int64_t n) {
  for (int64_t x = 0; x < n; x += 16) __builtin_prefetch(at + x, 0, 1);
}

// w[t] = exp(w[t] - max(w)) for t < n, with torch's vectorised exp (the tail with std::exp),
// in place; returns their sum (lanes summed in a fixed order, then the tail).
inline float softmax_numerators(float* w, int64_t n) {
  const float top = *std::max_element(w, w + n);
  const Vec shift(top);
  Vec lanes(0.f);
  int64_t t = 0;
  for (; t + Vec::size() <= n; t += Vec::size()) {
    const Vec e = (Vec::loadu(w + t) - shift).exp();
    e.store(w + t);
    lanes = lanes + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, lanes);
  for (; t < n; ++t) {
    w[t] = std::exp(w[t] - top);
    sum += w[t];
  }
  return sum;
}

struct Problem {
  const float* q;
  int64_t q_stride;  // floats from one sequence's queries to the next
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
// summed with its weights in registers. While the keys are scored, the next block's keys and
// this block's values are prefetched, so the value pass, one walk per query head, reads from
// cache (a sequence's values, a few hundred KB, fit in one core's second-level cache):
// measured here at batch 32 with 128-256 positions, 0.43 ms a layer against 0.62-0.68 ms
// when each value walk prefetched its own next block. `D`: the head dim, at compile time (a
// multiple of the vector width), or 0 for any other (plain loops).
template <int64_t D>
void attend(const Problem& p, int64_t i, int64_t first, int64_t last, std::vector<float>& scores) {
  const int64_t dim = D > 0 ? D : p.dim, group = p.heads / p.kv_heads, len = p.length[i];
  const int64_t stride = p.kv_heads * dim, rows = (last - first) * group;
  const int32_t* row = p.table + i * p.width;
  const float* query = p.q + i * p.q_stride + first * group * dim;
  scores.resize(rows * len);
  const int64_t span = (last - first) * dim;  // floats a position holds for this task
  for (int64_t t0 = 0; t0 < len; t0 += p.size) {
    const float* keys = p.k + row[t0 / p.size] * p.size * stride + first * dim;
    const float* next = t0 + p.size < len ? p.k + row[t0 / p.size + 1] * p.size * stride + first * dim : nullptr;
    const float* values = p.v + row[t0 / p.size] * p.size * stride + first * dim;
    const int64_t m = std::min(p.size, len - t0);
    for (int64_t t = 0; t < m; ++t) {
      if (next != nullptr) prefetch(next + t * stride, span);
      prefetch(values + t * stride, span);
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
    const float inv = 1.f / softmax_numerators(w, len);
    const int64_t offset = (first + r / group) * dim;
    float* out = result + r * dim;
    if constexpr (D > 0) {
      constexpr int64_t kWidth = Vec::size(), kParts = D / kWidth;
      Vec acc[kParts];
      for (int64_t c = 0; c < kParts; ++c) acc[c] = Vec(0.f);
      for (int64_t t0 = 0; t0 < len; t0 += p.size) {
        const float* values = p.v + row[t0 / p.size] * p.size * stride + offset;
        const int64_t m = std::min(p.size, len - t0);
        for (int64_t t = 0; t < m; ++t) {
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
  }
  for (const at::Tensor* t : {&k_pool, &v_pool, &tables, &lengths}) {
    TORCH_CHECK(t->is_contiguous(), "decode_attention takes contiguous pools, tables and lengths");
  }
  // a sequence's queries are contiguous; sequences may sit further apart (rows of a fused
  // q/k/v product)
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && q.stride(0) >= q.size(1) * q.size(2),
              "each sequence's queries must be contiguous [heads, head_dim]");
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
  auto out = at::empty({n, heads, dim}, q.options());
  // A task is one sequence (or one kv head of one, when there are fewer sequences than
  // threads: a head's arithmetic is the same either way).
  const Problem problem{q.data_ptr<float>(),     q.stride(0),              k_pool.data_ptr<float>(),
                        v_pool.data_ptr<float>(),
                        out.data_ptr<float>(),   table,                    length,
                        heads,                   kv_heads,                 dim,
                        size,                    width,                    static_cast<float>(scale)};
  const int64_t split = n >= at::get_num_threads() ? 1 : kv_heads;
  at::parallel_for(0, n * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / split, first = split == 1 ? 0 : task % split;
      const int64_t last = split == 1 ? kv_heads : first + 1;
      if (dim == 32 && 32 % Vec::size() == 0) {
        attend<32>(problem, i, first, last, scores);
      } else if (dim == 64 && 64 % Vec::size() == 0) {
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

// Causal attention of a prefill chunk: queries at positions `start .. start + n - 1` (rows of
// `q`, `[n, heads, dim]` with any row stride) over the sequence's keys and values at positions
// `0 .. start + n - 1` in the pool, through its block table; query at position p sees keys at
// positions <= p. A task is one kv head's query heads at a tile of `kRows` positions; it
// walks the keys in tiles of two vector widths: the tile's keys are transposed into a small
// buffer once, then every query row scores the tile with broadcast multiply-adds (no
// per-key horizontal sums), keeps a running maximum and sum (online softmax), and adds the
// weighted values into its accumulator, four rows at a time (each value loaded once for the
// four). A row's arithmetic runs over its keys in order, so its result does not depend on
// the tiles, the tasks, the rows beside it or the threads.
template <int64_t D>
void prefill_task(const float* q, int64_t q_stride, const float* k, const float* v,
                  const int32_t* table, int64_t size, int64_t kv_heads, int64_t heads,
                  int64_t dim_rt, int64_t start, int64_t first, int64_t count, int64_t h,
                  float scale, float* out) {
  constexpr int64_t W = Vec::size();
  constexpr int64_t T = 2 * W;  // keys per tile: two vectors
  const int64_t dim = D > 0 ? D : dim_rt, group = heads / kv_heads, rows = count * group;
  const int64_t stride = kv_heads * dim;
  std::vector<float> kt(dim * T), qs(rows * dim), acc(rows * dim, 0.f), top(rows), sum(rows, 0.f);
  std::vector<const float*> values(T);  // the tile's value rows
  std::vector<float> tile_scores(rows * T), probs(rows * T), rescales(rows);
  std::vector<int64_t> seen_by(rows);
  for (int64_t r = 0; r < rows; ++r) {  // row r: position first + r / group, head h*group + r % group
    const float* src = q + (first + r / group) * q_stride + (h * group + r % group) * dim;
    for (int64_t x = 0; x < dim; ++x) qs[r * dim + x] = src[x] * scale;
    top[r] = -std::numeric_limits<float>::infinity();
  }
  const int64_t end = start + first + count;  // keys this tile's last row sees
  for (int64_t t0 = 0; t0 < end; t0 += T) {
    const int64_t m = std::min(T, end - t0);
    for (int64_t t = 0; t < T; ++t) {  // transpose the keys of this tile (zeros past the end)
      if (t < m) {
        const int64_t pos = t0 + t;
        const int64_t at = (table[pos / size] * size + pos % size) * stride + h * dim;
        values[t] = v + at;
        const float* key = k + at;
        for (int64_t x = 0; x < dim; ++x) kt[x * T + t] = key[x];
      } else {
        for (int64_t x = 0; x < dim; ++x) kt[x * T + t] = 0.f;
      }
    }
    // every row's scores of this tile first, four rows at a time (eight independent chains
    // of multiply-adds, two per row: the tile's transposed keys are loaded once per four rows)
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
      const float* q0 = qs.data() + r * dim;
      Vec a0(0.f), a1(0.f), b0(0.f), b1(0.f), c0(0.f), c1(0.f), d0(0.f), d1(0.f);
      for (int64_t x = 0; x < dim; ++x) {
        const Vec k0 = Vec::loadu(kt.data() + x * T), k1 = Vec::loadu(kt.data() + x * T + W);
        const Vec qa(q0[x]), qb(q0[dim + x]), qc(q0[2 * dim + x]), qd(q0[3 * dim + x]);
        a0 = at::vec::fmadd(qa, k0, a0);
        a1 = at::vec::fmadd(qa, k1, a1);
        b0 = at::vec::fmadd(qb, k0, b0);
        b1 = at::vec::fmadd(qb, k1, b1);
        c0 = at::vec::fmadd(qc, k0, c0);
        c1 = at::vec::fmadd(qc, k1, c1);
        d0 = at::vec::fmadd(qd, k0, d0);
        d1 = at::vec::fmadd(qd, k1, d1);
      }
      float* ts = tile_scores.data() + r * T;
      a0.store(ts);
      a1.store(ts + W);
      b0.store(ts + T);
      b1.store(ts + T + W);
      c0.store(ts + 2 * T);
      c1.store(ts + 2 * T + W);
      d0.store(ts + 3 * T);
      d1.store(ts + 3 * T + W);
    }
    for (; r < rows; ++r) {
      const float* qr = qs.data() + r * dim;
      Vec s0(0.f), s1(0.f);
      for (int64_t x = 0; x < dim; ++x) {
        const Vec qx(qr[x]);
        s0 = at::vec::fmadd(qx, Vec::loadu(kt.data() + x * T), s0);
        s1 = at::vec::fmadd(qx, Vec::loadu(kt.data() + x * T + W), s1);
      }
      s0.store(tile_scores.data() + r * T);
      s1.store(tile_scores.data() + r * T + W);
    }
    // each row's softmax over the tile: its weights (zero for keys it does not see), the
    // factor that rescales what it summed so far, and how many keys it sees
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = start + first + r / group;  // this row's position
      float* w = probs.data() + r * T;
      if (t0 > pos) {  // every key of the tile is ahead of it
        Vec(0.f).store(w);
        Vec(0.f).store(w + W);
        rescales[r] = 1.f;
        seen_by[r] = 0;
        continue;
      }
      const int64_t seen = std::min(m, pos - t0 + 1);  // keys of the tile it sees
      const Vec none(-std::numeric_limits<float>::infinity());
      Vec s0 = Vec::loadu(tile_scores.data() + r * T), s1 = Vec::loadu(tile_scores.data() + r * T + W);
      if (seen <= W) {  // keys ahead of the row (or past the end) weigh nothing
        s1 = none;
        if (seen < W) s0 = Vec::set(none, s0, seen);
      } else if (seen < T) {
        s1 = Vec::set(none, s1, seen - W);
      }
      const float best = std::max(
          top[r], at::vec::vec_reduce_all<float>(
                      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); },
                      at::vec::maximum(s0, s1)));
      const float rescale = std::exp(top[r] - best);  // exp(-inf) = 0 at the first tile
      const Vec w0 = (s0 - Vec(best)).exp(), w1 = (s1 - Vec(best)).exp();
      w0.store(w);
      w1.store(w + W);
      top[r] = best;
      sum[r] = sum[r] * rescale +
               at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, w0 + w1);
      rescales[r] = rescale;
      seen_by[r] = seen;
    }
    // the weighted values into each row's accumulator. With a vector-sized head dim, four
    // rows at a time, each value vector loaded once for the four; a row that sees fewer keys
    // than its neighbours adds their values times an exact zero, which changes nothing, so a
    // row's sums are the same whichever rows share its four
    int64_t r4 = 0;
    if constexpr (D > 0) {
      constexpr int64_t kParts = D / W;
      for (; r4 + 4 <= rows; r4 += 4) {
        const int64_t seen = std::max(std::max(seen_by[r4], seen_by[r4 + 1]),
                                      std::max(seen_by[r4 + 2], seen_by[r4 + 3]));
        if (seen == 0) continue;  // rescales of 1 and no keys: nothing changes
        const float* p0 = probs.data() + r4 * T;
        const float* p1 = p0 + T;
        const float* p2 = p1 + T;
        const float* p3 = p2 + T;
        float* a0 = acc.data() + r4 * dim;
        for (int64_t c = 0; c < kParts; ++c) {
          // even and odd keys into separate accumulators: twice the independent chains
          Vec o0 = Vec::loadu(a0 + c * W) * Vec(rescales[r4]);
          Vec o1 = Vec::loadu(a0 + dim + c * W) * Vec(rescales[r4 + 1]);
          Vec o2 = Vec::loadu(a0 + 2 * dim + c * W) * Vec(rescales[r4 + 2]);
          Vec o3 = Vec::loadu(a0 + 3 * dim + c * W) * Vec(rescales[r4 + 3]);
          Vec e0(0.f), e1(0.f), e2(0.f), e3(0.f);
          int64_t t = 0;
          for (; t + 1 < seen; t += 2) {
            const Vec v0 = Vec::loadu(values[t] + c * W), v1 = Vec::loadu(values[t + 1] + c * W);
            o0 = at::vec::fmadd(Vec(p0[t]), v0, o0);
            e0 = at::vec::fmadd(Vec(p0[t + 1]), v1, e0);
            o1 = at::vec::fmadd(Vec(p1[t]), v0, o1);
            e1 = at::vec::fmadd(Vec(p1[t + 1]), v1, e1);
            o2 = at::vec::fmadd(Vec(p2[t]), v0, o2);
            e2 = at::vec::fmadd(Vec(p2[t + 1]), v1, e2);
            o3 = at::vec::fmadd(Vec(p3[t]), v0, o3);
            e3 = at::vec::fmadd(Vec(p3[t + 1]), v1, e3);
          }
          if (t < seen) {
            const Vec v0 = Vec::loadu(values[t] + c * W);
            o0 = at::vec::fmadd(Vec(p0[t]), v0, o0);
            o1 = at::vec::fmadd(Vec(p1[t]), v0, o1);
            o2 = at::vec::fmadd(Vec(p2[t]), v0, o2);
            o3 = at::vec::fmadd(Vec(p3[t]), v0, o3);
          }
          (o0 + e0).store(a0 + c * W);
          (o1 + e1).store(a0 + dim + c * W);
          (o2 + e2).store(a0 + 2 * dim + c * W);
          (o3 + e3).store(a0 + 3 * dim + c * W);
        }
      }
    }
    for (int64_t r = r4; r < rows; ++r) {  // the rest one row at a time, as the four do
      const int64_t seen = seen_by[r];
      if (seen == 0) continue;
      const float* w = probs.data() + r * T;
      float* a = acc.data() + r * dim;
      const float rescale = rescales[r];
      if constexpr (D > 0) {
        constexpr int64_t kParts = D / W;
        Vec o[kParts], e[kParts];
        for (int64_t c = 0; c < kParts; ++c) {
          o[c] = Vec::loadu(a + c * W) * Vec(rescale);
          e[c] = Vec(0.f);
        }
        int64_t t = 0;
        for (; t + 1 < seen; t += 2) {
          const Vec w0(w[t]), w1(w[t + 1]);
          for (int64_t c = 0; c < kParts; ++c) {
            o[c] = at::vec::fmadd(w0, Vec::loadu(values[t] + c * W), o[c]);
            e[c] = at::vec::fmadd(w1, Vec::loadu(values[t + 1] + c * W), e[c]);
          }
        }
        if (t < seen) {
          const Vec w0(w[t]);
          for (int64_t c = 0; c < kParts; ++c) {
            o[c] = at::vec::fmadd(w0, Vec::loadu(values[t] + c * W), o[c]);
          }
        }
        for (int64_t c = 0; c < kParts; ++c) (o[c] + e[c]).store(a + c * W);
      } else {
        for (int64_t y = 0; y < dim; ++y) a[y] *= rescale;
        for (int64_t t = 0; t < seen; ++t) {
          const float* value = values[t];
          for (int64_t y = 0; y < dim; ++y) a[y] += w[t] * value[y];
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = out + ((first + r / group) * heads + h * group + r % group) * dim;
    const float inv = 1.f / sum[r];
    for (int64_t x = 0; x < dim; ++x) dst[x] = acc[r * dim + x] * inv;
  }
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_pool,
                             const at::Tensor& v_pool, const at::Tensor& table, int64_t start,
                             double scale) {
  TORCH_CHECK(q.dim() == 3 && q.device().is_cpu() && q.scalar_type() == at::kFloat,
              "q must be a float32 CPU tensor [tokens, heads, head_dim], got ", q.sizes());
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && q.stride(0) >= q.size(1) * q.size(2),
              "each token's queries must be contiguous [heads, head_dim]");
  for (const at::Tensor* t : {&k_pool, &v_pool}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "the pools must be contiguous float32 CPU tensors");
  }
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(),
              "k_pool and v_pool must be [blocks, block_size, kv_heads, head_dim] alike");
  TORCH_CHECK(table.device().is_cpu() && table.scalar_type() == at::kInt && table.dim() == 1 &&
                  table.is_contiguous(),
              "table must be int32 [blocks]");
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t blocks = k_pool.size(0), size = k_pool.size(1), kv_heads = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == dim, "head_dim ", dim, " of q is not the pool's ", k_pool.size(3));
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, heads, " query heads do not share ", kv_heads,
              " kv heads evenly");
  TORCH_CHECK(start >= 0 && n >= 1, "a chunk of ", n, " tokens from position ", start);
  const int64_t used = (start + n + size - 1) / size;
  TORCH_CHECK(table.size(0) >= used, "the chunk reaches position ", start + n - 1,
              "; its table holds ", table.size(0) * size, " positions");
  const int32_t* tab = table.data_ptr<int32_t>();
  for (int64_t b = 0; b < used; ++b) {
    TORCH_CHECK(tab[b] >= 0 && tab[b] < blocks, "the table names block ", tab[b], " of ", blocks);
  }
  auto out = at::empty({n, heads, dim}, q.options());
  constexpr int64_t kRows = 32;  // positions per task
  const int64_t tiles = (n + kRows - 1) / kRows, tasks = tiles * kv_heads;
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      // tiles in the order 0, last, 1, last - 1, ...: later tiles see more keys, and any
      // contiguous run of tasks (what a thread gets) mixes light and heavy ones
      const int64_t j = task / kv_heads, h = task % kv_heads;
      const int64_t tile = j % 2 == 0 ? j / 2 : tiles - 1 - j / 2;
      const int64_t first = tile * kRows, count = std::min(kRows, n - first);
      if (dim == 32 && 32 % Vec::size() == 0) {
        prefill_task<32>(qp, q.stride(0), kp, vp, tab, size, kv_heads, heads, dim, start, first,
                         count, h, fscale, op);
      } else if (dim == 64 && 64 % Vec::size() == 0) {
        prefill_task<64>(qp, q.stride(0), kp, vp, tab, size, kv_heads, heads, dim, start, first,
                         count, h, fscale, op);
      } else if (dim == 128 && 128 % Vec::size() == 0) {
        prefill_task<128>(qp, q.stride(0), kp, vp, tab, size, kv_heads, heads, dim, start, first,
                          count, h, fscale, op);
      } else {
        prefill_task<0>(qp, q.stride(0), kp, vp, tab, size, kv_heads, heads, dim, start, first,
                        count, h, fscale, op);
      }
    }
  });
  return out;
}

void check_cpu_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, what,
              " must be a float32 CPU tensor");
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
}

// Rotary positions applied in place to the queries and keys of `qkv` (each token's row:
// `heads` query heads, then kv heads of keys, then of values, each `head_dim` wide), in the
// "rotate half" layout Llama and Qwen2 use; then each token's keys and values written to its
// slot (`block * block_size + offset`) of the pools. `cos`/`sin`: `[positions, head_dim / 2]`.
// Per element as torch computes `x * cos + rotate_half(x) * sin` (products and sum rounded
// one at a time, no fused multiply-add), so both paths rotate to the same bits.
void rope_and_cache(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos,
                    const at::Tensor& sin, at::Tensor k_pool, at::Tensor v_pool,
                    const at::Tensor& slots, int64_t heads) {
  check_cpu_float(qkv, "qkv");
  check_cpu_float(cos, "cos");
  check_cpu_float(sin, "sin");
  check_cpu_float(k_pool, "k_pool");
  check_cpu_float(v_pool, "v_pool");
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(),
              "k_pool and v_pool must be [blocks, block_size, kv_heads, head_dim] alike");
  const int64_t kv_heads = k_pool.size(2), dim = k_pool.size(3), half = dim / 2;
  const int64_t width = (heads + 2 * kv_heads) * dim;
  TORCH_CHECK(dim % 2 == 0, "head_dim must be even, got ", dim);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == width, "qkv must be [tokens, ", width, "], got ",
              qkv.sizes());
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == half && sin.sizes() == cos.sizes(),
              "cos and sin must be [positions, ", half, "]");
  const int64_t n = qkv.size(0), slots_max = k_pool.size(0) * k_pool.size(1);
  for (const at::Tensor* t : {&positions, &slots}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->dim() == 1 &&
                    t->size(0) == n && t->is_contiguous(),
                "positions and slots must be int64 [", n, "]");
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(pos[i] >= 0 && pos[i] < cos.size(0), "position ", pos[i], " is past the ",
                cos.size(0), " rotations given");
    TORCH_CHECK(slot[i] >= 0 && slot[i] < slots_max, "slot ", slot[i], " is outside the pool of ",
                slots_max);
  }
  float* rows = qkv.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  float* kp = k_pool.data_ptr<float>();
  float* vp = v_pool.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = rows + i * width;
      const float* c = cs + pos[i] * half;
      const float* s = sn + pos[i] * half;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        float* x = row + h * dim;
        for (int64_t j = 0; j < half; ++j) {
          const float a = x[j], b = x[j + half];
          const float a_cos = a * c[j], b_sin = -b * s[j], b_cos = b * c[j], a_sin = a * s[j];
          x[j] = a_cos + b_sin;
          x[j + half] = b_cos + a_sin;
        }
      }
      const int64_t span = kv_heads * dim;
      std::copy(row + heads * dim, row + heads * dim + span, kp + slot[i] * span);
      std::copy(row + heads * dim + span, row + width, vp + slot[i] * span);
    }
  });
}

// `silu(gate) * up` of `x = [.., gate | up]` (the fused gate/up product), as torch computes
// `F.silu(gate) * up`: `gate / (1 + exp(-gate))` with torch's vectorised exp, then the product.
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_cpu_float(x, "x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "x's last dim must be even, got ", x.sizes());
  const int64_t w = x.size(-1) / 2, n = x.numel() / std::max<int64_t>(x.size(-1), 1);
  auto shape = x.sizes().vec();
  shape.back() = w;
  auto out = at::empty(shape, x.options());
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    const Vec one(1.f);
    for (int64_t i = begin; i < end; ++i) {
      const float* gate = in + i * 2 * w;
      const float* up = gate + w;
      float* dst = o + i * w;
      int64_t j = 0;
      for (; j + Vec::size() <= w; j += Vec::size()) {
        const Vec g = Vec::loadu(gate + j);
        ((g / (one + g.neg().exp())) * Vec::loadu(up + j)).store(dst + j);
      }
      for (; j < w; ++j) dst[j] = (gate[j] / (1.f + std::exp(-gate[j]))) * up[j];
    }
  });
  return out;
}

// RMSNorm of each row of `hidden` after `hidden += delta` (in place; `delta` may be
// undefined: no add): `x * (1 / sqrt(mean(x^2) + eps)) * weight`.
at::Tensor add_rms_norm(at::Tensor hidden, const c10::optional<at::Tensor>& delta,
                        const at::Tensor& weight, double eps) {
  check_cpu_float(hidden, "hidden");
  check_cpu_float(weight, "weight");
  const int64_t d = hidden.size(-1), n = hidden.numel() / std::max<int64_t>(d, 1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == d, "weight must be [", d, "]");
  const bool add = delta.has_value() && delta->defined();
  if (add) {
    check_cpu_float(*delta, "delta");
    TORCH_CHECK(delta->sizes() == hidden.sizes(), "delta ", delta->sizes(), " is not hidden's ",
                hidden.sizes());
  }
  auto out = at::empty_like(hidden);
  float* h = hidden.data_ptr<float>();
  const float* dl = add ? delta->data_ptr<float>() : nullptr;
  const float* wt = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* x = h + i * d;
      if (add) {
        const float* y = dl + i * d;
        int64_t j = 0;
        for (; j + Vec::size() <= d; j += Vec::size()) {
          (Vec::loadu(x + j) + Vec::loadu(y + j)).store(x + j);
        }
        for (; j < d; ++j) x[j] += y[j];
      }
      Vec squares(0.f);
      int64_t j = 0;
      for (; j + Vec::size() <= d; j += Vec::size()) {
        const Vec v = Vec::loadu(x + j);
        squares = at::vec::fmadd(v, v, squares);
      }
      float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, squares);
      for (; j < d; ++j) sum += x[j] * x[j];
      const float r = 1.f / std::sqrt(sum / static_cast<float>(d) + feps);
      float* y = o + i * d;
      j = 0;
      for (; j + Vec::size() <= d; j += Vec::size()) {
        (Vec::loadu(x + j) * Vec(r) * Vec::loadu(wt + j)).store(y + j);
      }
      for (; j < d; ++j) y[j] = x[j] * r * wt[j];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(orchestr_kernels, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor lengths, "
      "float scale) -> Tensor");
  m.def(
      "rope_and_cache(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, "
      "Tensor(b!) k_pool, Tensor(c!) v_pool, Tensor slots, int heads) -> ()");
  m.def(
      "prefill_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor table, int start, "
      "float scale) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) hidden, Tensor? delta, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(orchestr_kernels, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("rope_and_cache", &rope_and_cache);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("add_rms_norm", &add_rms_norm);
}
