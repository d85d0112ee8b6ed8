// Paged decode attention: one query token per sequence, grouped-query heads, read straight from the
// paged KV cache (float32 or bf16) with no gathered copy. The AVX-512 build sends a bf16 cache to its
// block-major kernel (decode_bf16_avx512.h: AMX or AVX512-BF16 scores where the build has them).
// Its PyTorch reference: kestrel/attention/torch_sdpa.py's decode_attention, over the cache layout of
// kestrel/attention/kv_cache.py.
#include "kernel.h"
#include "kernels.h"
#if defined(KESTREL_VEC_AVX512)
#include "decode_bf16_avx512.h"
#endif

namespace {

// ---- paged decode attention ----
//
// Work is cut into (sequence, KV head, segment) items, a segment being up to kSegmentTokens keys, so
// that a batch of one still spreads over the threads; each item reads its K and V rows once for all
// the G query heads that share them (scores, softmax, then the V rows, in registers), and the items
// of a sequence cut into segments are merged after the parallel loop (running max, sum of
// exponentials, unnormalised output).

constexpr int64_t kSegmentTokens = 256;  // keys per work item: a batch of one still fills the threads

template <int D, int G>
struct Partial {
  float m[G], l[G];
  float acc[G][D];  // unnormalised
};

// Query heads scored together: up to 3, so that their accumulators for 4 keys (12) and the 4 key
// vectors fit 16 registers; G is split evenly into such chunks.
template <int G>
constexpr int kHeadChunk = G % 3 == 0 ? 3 : (G % 2 == 0 ? 2 : 1);

// scores[j][i] = q_j . row_i for JC query heads and 4 keys. Summing 4 keys' products in one
// reduction instead of one reduction per key is what keeps the score loop on the FMA units.
template <typename T, int D, int JC>
inline void score_4_keys(const float* q, const T* const rows[4], __m128 out[JC]) {
  constexpr int C = D / kLanes;
  VecF acc[JC][4];
  for (int j = 0; j < JC; ++j)
    for (int i = 0; i < 4; ++i) acc[j][i] = zero();
  for (int c = 0; c < C; ++c) {
    VecF kr[4];
    for (int i = 0; i < 4; ++i) kr[i] = load_chunk(rows[i] + c * kLanes);
    for (int j = 0; j < JC; ++j) {
      const VecF qv = load_f32(q + j * D + c * kLanes);
      for (int i = 0; i < 4; ++i) acc[j][i] = fma(qv, kr[i], acc[j][i]);
    }
  }
  for (int j = 0; j < JC; ++j) out[j] = hsum4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
}

// Keys run in blocks of 16 tokens scattered over the pool, so the hardware prefetcher, which follows
// a stride, loses the stream at every block edge, and left to it the cache is read far below the
// streaming rate. The score loop therefore prefetches the K and V rows kPrefetchKeys keys ahead (V is
// read by the P V pass right after, from L2).
constexpr int64_t kPrefetchKeys = 16;

template <typename T>
inline void prefetch_rows(const T* kp, const T* vp, const std::vector<int64_t>& rows, int64_t from, int64_t to,
                          size_t row_bytes) {
  for (int64_t t = from; t < to; ++t)
    for (size_t b = 0; b < row_bytes; b += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(kp + rows[t]) + b, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(vp + rows[t]) + b, _MM_HINT_T1);
    }
}

// The K and V rows of the item a thread takes next, fetched into L2 while it computes this one: its
// K rows during this item's score loop, its V rows during the P V loop. With the in-item prefetch
// alone the memory sits idle through softmax and P V, and an item takes the sum of its compute and
// its reads; fetching the next item's rows keeps the memory busy through them, so the two overlap.
template <typename T, int D>
struct NextItem {
  const T* k = nullptr;  // the item's KV head in the K and V caches
  const T* v = nullptr;
  const int64_t* rows = nullptr;
  int64_t n = 0;  // 0: no next item on this thread

  // Callers test the bounds themselves: GCC 12 dropped the prefetch from the P V loop when the test
  // sat in a member function here (found in the disassembly; the score loop's call had survived).
  static void prefetch_row(const T* row) {
    const char* p = reinterpret_cast<const char*>(row);
    [&]<size_t... L>(std::index_sequence<L...>) {
      (_mm_prefetch(p + 64 * L, _MM_HINT_T1), ...);
    }(std::make_index_sequence<(D * sizeof(T) + 63) / 64>{});
  }
};

// Item (s, h, segment [t0, t1)) → its partial result. q rows float32, pre-scaled by the caller;
// `rows` holds the segment's cache row offsets (token slot × stride).
template <typename T, int D, int G>
void attend_segment(const float* q, const T* kp, const T* vp, const std::vector<int64_t>& rows, int64_t n,
                    std::vector<float>& scores, Partial<D, G>& out, const NextItem<T, D>& next) {
  constexpr int C = D / kLanes, JC = kHeadChunk<G>, CC = C < 4 ? C : 4;
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  scores.resize(G * padded);
  for (int j0 = 0; j0 < G; j0 += JC) {
    __m128 mx4[JC];
    for (int j = 0; j < JC; ++j) mx4[j] = _mm_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
      if (j0 == 0) {
        prefetch_rows(kp, vp, rows, t + kPrefetchKeys, std::min(n, t + kPrefetchKeys + 4), D * sizeof(T));
        for (int64_t u = t; u < std::min(next.n, t + 4); ++u) next.prefetch_row(next.k + next.rows[u]);
      }
      const T* const keys[4] = {kp + rows[t], kp + rows[t + 1], kp + rows[t + 2], kp + rows[t + 3]};
      __m128 sc[JC];
      score_4_keys<T, D, JC>(q + j0 * D, keys, sc);
      for (int j = 0; j < JC; ++j) {
        _mm_storeu_ps(scores.data() + (j0 + j) * padded + t, sc[j]);
        mx4[j] = _mm_max_ps(mx4[j], sc[j]);
      }
    }
    for (int j = 0; j < JC; ++j) {
      alignas(16) float m4[4];
      _mm_store_ps(m4, mx4[j]);
      float mx = std::max(std::max(m4[0], m4[1]), std::max(m4[2], m4[3]));
      for (int64_t u = t; u < n; ++u) {  // the last 0-3 keys, one at a time
        const T* row = kp + rows[u];
        VecF acc = mul(load_f32(q + (j0 + j) * D), load_chunk(row));
        for (int c = 1; c < C; ++c) acc = fma(load_f32(q + (j0 + j) * D + c * kLanes), load_chunk(row + c * kLanes), acc);
        const float sc = hsum(acc);
        scores[(j0 + j) * padded + u] = sc;
        mx = std::max(mx, sc);
      }
      out.m[j0 + j] = mx;
    }
  }
  for (int j = 0; j < G; ++j) {
    float* sj = scores.data() + j * padded;
    const VecF m = splat(out.m[j]);
    VecF sum = zero();
    for (int64_t i = 0; i < padded; i += kLanes) {
      // Lanes past the segment's end are zeroed: they hold no score.
      const VecF e = keep(lanes_below(n - i), exp_clamped(sub(load_f32(sj + i), m)));
      store(sj + i, e);
      sum = add(sum, e);
    }
    out.l[j] = hsum(sum);
  }
  // P V in register blocks of JC heads × CC vectors of the head dimension (at most 12 accumulators):
  // each pass reads its own part of every V row, so V still comes from memory once.
  for (int j0 = 0; j0 < G; j0 += JC)
    for (int c0 = 0; c0 < C; c0 += CC) {
      VecF acc[JC][CC];
      for (int j = 0; j < JC; ++j)
        for (int c = 0; c < CC; ++c) acc[j][c] = zero();
      for (int64_t t = 0; t < n; ++t) {
        const T* row = vp + rows[t] + c0 * kLanes;
        if (j0 == 0 && c0 == 0 && t < next.n) next.prefetch_row(next.v + next.rows[t]);
        VecF p[JC];
        for (int j = 0; j < JC; ++j) p[j] = splat(scores[(j0 + j) * padded + t]);
        for (int c = 0; c < CC; ++c) {
          const VecF v = load_chunk(row + c * kLanes);
          for (int j = 0; j < JC; ++j) acc[j][c] = fma(p[j], v, acc[j][c]);
        }
      }
      for (int j = 0; j < JC; ++j)
        for (int c = 0; c < CC; ++c) store(out.acc[j0 + j] + (c0 + c) * kLanes, acc[j][c]);
    }
}

template <typename T, int D, int G>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out,
         int64_t block_size, float scale, int64_t window) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), kv_heads = k_cache.size(1);
  const int64_t max_blocks = block_tables.size(1), stride = kv_heads * D;
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  // Items in (sequence, segment, KV head) order; first_item[s] is sequence s's first. Sequence s reads
  // keys [first_key[s], lens[s]).
  std::vector<int64_t> first_item(num_seqs + 1, 0), first_key(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) {
    first_key[s] = first_visible_key(lens[s], window);
    const int64_t keys = lens[s] - first_key[s];
    const int64_t segments = keys > 0 ? (keys + kSegmentTokens - 1) / kSegmentTokens : 0;
    first_item[s + 1] = first_item[s] + segments * kv_heads;
    if (lens[s] <= 0) std::memset(op + s * num_heads * D, 0, sizeof(float) * num_heads * D);
  }
  const int64_t total = first_item[num_seqs];
  std::vector<Partial<D, G>> parts(total);
  // An item's sequence, KV head and keys (their cache row offsets into `rows`).
  struct Segment {
    int64_t s, h, n;
  };
  auto segment_rows = [&](int64_t item, int64_t s, std::vector<int64_t>& rows) {
    while (item >= first_item[s + 1]) ++s;
    const int64_t local = item - first_item[s], seg = local / kv_heads;
    const int64_t t0 = first_key[s] + seg * kSegmentTokens, t1 = std::min(lens[s], t0 + kSegmentTokens);
    const int64_t* table = tables + s * max_blocks;
    // Row offsets walk the block table without a division per key (an integer division is dear next to
    // a key's few FMAs).
    for (int64_t t = t0, b = t0 / block_size, off = t0 % block_size; t < t1; ++t) {
      rows[t - t0] = (table[b] * block_size + off) * stride;
      if (++off == block_size) off = 0, ++b;
    }
    return Segment{s, local % kv_heads, t1 - t0};
  };
  at::parallel_for(0, total, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> rows(kSegmentTokens), next_rows(kSegmentTokens);
    alignas(64) float qs[G * D];
    const int64_t first_s = std::upper_bound(first_item.begin(), first_item.end(), begin) - first_item.begin() - 1;
    Segment cur = segment_rows(begin, first_s, rows);
    for (int64_t item = begin; item < end; ++item) {
      const Segment nxt = item + 1 < end ? segment_rows(item + 1, cur.s, next_rows) : Segment{cur.s, 0, 0};
      const float* qrow = qp + (cur.s * num_heads + cur.h * G) * D;
      for (int i = 0; i < G * D; i += kLanes) store(qs + i, mul(load_f32(qrow + i), splat(scale)));
      const NextItem<T, D> next{kp + nxt.h * D, vp + nxt.h * D, next_rows.data(), nxt.n};
      attend_segment<T, D, G>(qs, kp + cur.h * D, vp + cur.h * D, rows, cur.n, scores, parts[item], next);
      std::swap(rows, next_rows);
      cur = nxt;
    }
  });
  // Merge each (sequence, KV head)'s segments: rescale to the largest running max, sum, normalise.
  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t s = pair / kv_heads, h = pair % kv_heads;
      const int64_t segments = (first_item[s + 1] - first_item[s]) / kv_heads;
      if (segments == 0) continue;
      for (int j = 0; j < G; ++j) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t g = 0; g < segments; ++g) mx = std::max(mx, parts[first_item[s] + g * kv_heads + h].m[j]);
        float sum = 0.f;
        VecF acc[D / kLanes];
        for (int c = 0; c < D / kLanes; ++c) acc[c] = zero();
        for (int64_t g = 0; g < segments; ++g) {
          const Partial<D, G>& p = parts[first_item[s] + g * kv_heads + h];
          const float w = std::exp(p.m[j] - mx);
          sum += p.l[j] * w;
          for (int c = 0; c < D / kLanes; ++c) acc[c] = fma(splat(w), load_f32(p.acc[j] + c * kLanes), acc[c]);
        }
        float* dst = op + (s * num_heads + h * G + j) * D;
        for (int c = 0; c < D / kLanes; ++c) store(dst + c * kLanes, mul(acc[c], splat(1.f / sum)));
      }
    }
  });
}


// Where the bf16 cache goes to the AVX-512 build's own kernel: AMX scores need q exactly in bf16 (it
// is, in a bf16 model) and whole 16-row tiles in memory; the AVX-512 scores take the rest.
bool bf16_decode(at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out,
                 int64_t block_size, float scale, int64_t window) {
#if defined(KESTREL_VEC_AVX512)
  namespace bd = kestrel_bf16_decode;
  if (k_cache.scalar_type() != at::kBFloat16) return false;
  bool amx = false;
#ifdef KESTREL_AMX
  // A window's first key need not start a tile: AMX loads whole tiles from their first row.
  amx = q.scalar_type() == at::kBFloat16 && block_size % 16 == 0 && window == 0 && q.size(2) <= 128 &&
        bd::amx_usable();
#endif
  bool dot = false;
#ifdef KESTREL_BF16_DOT
  dot = !amx && q.scalar_type() == at::kBFloat16;
#endif
  q = amx || dot ? q.contiguous() : q.to(at::kFloat).contiguous();
  return with_head_shape(q.size(2), q.size(1) / k_cache.size(1), [&](auto d, auto g) {
    constexpr int D = decltype(d)::value, G = decltype(g)::value;
    if constexpr (D <= 128) {  // the AMX scores' tiles hold head_dim 64 or 128
      if (amx) return bd::run_bf16<D, G, true, false>(q, k_cache, v_cache, block_tables, seq_lens, out, block_size,
                                                      scale, 0);
    }
#ifdef KESTREL_BF16_DOT
    if (dot) return bd::run_bf16<D, G, false, true>(q, k_cache, v_cache, block_tables, seq_lens, out, block_size,
                                                    scale, window);
#endif
    bd::run_bf16<D, G, false, false>(q, k_cache, v_cache, block_tables, seq_lens, out, block_size, scale, window);
  });
#else
  return false;
#endif
}

}  // namespace

// q [num_seqs, num_heads, head_dim] float32 or bfloat16; k_cache, v_cache [num_slots, kv_heads, head_dim] float32 or
// bfloat16; block_tables [num_seqs, max_blocks] int64; seq_lens [num_seqs] int64 (keys 0..len-1 visible, or
// with a `window` W > 0 keys len-W..len-1 only: a sliding-window layer).
// Returns [num_seqs, num_heads, head_dim]: float32, or with `in_q_dtype` q's dtype (see in_dtype).
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens,
                                  int64_t block_size, double scale, bool in_q_dtype, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "bad ranks");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V dtypes differ");
  const bool bf16 = k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || k_cache.scalar_type() == at::kFloat, "the KV cache must be float32 or bfloat16");
  const auto q_dtype = q.scalar_type();
  auto out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  block_tables = block_tables.to(at::kLong).contiguous();
  seq_lens = seq_lens.to(at::kLong).contiguous();
  const float sc = static_cast<float>(scale);
  const int64_t d = q.size(2), g = q.size(1) / k_cache.size(1);
  TORCH_CHECK(window >= 0, "the window must be 0 (none) or positive");
  const bool done = bf16_decode(q, k_cache, v_cache, block_tables, seq_lens, out, block_size, sc, window) ||
                    with_head_shape(d, g, [&](auto dd, auto gg) {
    constexpr int D = decltype(dd)::value, G = decltype(gg)::value;
    q = q.to(at::kFloat).contiguous();
    if (bf16) run<c10::BFloat16, D, G>(q, k_cache, v_cache, block_tables, seq_lens, out, block_size, sc, window);
    else run<float, D, G>(q, k_cache, v_cache, block_tables, seq_lens, out, block_size, sc, window);
  });
  TORCH_CHECK(done, "no kernel for head_dim ", d, " with ", g, " query heads per KV head");
  return in_q_dtype ? in_dtype(out, q_dtype) : out;
}

bool supports(int64_t head_dim, int64_t group) {
  return with_head_shape(head_dim, group, [](auto, auto) {});
}
