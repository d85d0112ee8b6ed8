// Kestrel's CPU kernels (AVX-512; float32 or bf16 storage, float32 math). Their PyTorch references
// live in kestrel/model/attention.py and kestrel/model/layers.py; tests/test_cpu_kernels.py compares.
//
// paged_decode_attention: one query token per sequence, grouped-query heads, read straight from the
// paged KV cache with no gathered copy; each K and V row is read once, for all the GROUP query
// heads that share it. bf16 cache: one pass (online softmax) over chunks of blocks, scores by AMX
// where available (see "bf16 KV cache" below). float32 cache: one work item per (sequence, KV head),
// scores of all its K rows, then the V rows (weighted sums kept in registers).
// rms_norm (optionally fused with the residual add) and silu_and_mul: one pass over each row.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include "amx.h"
#include "int8_kv.h"
#include "parallel.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using VecF = __m512;
inline VecF load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline VecF load_f32(const float* p) { return _mm512_loadu_ps(p); }
inline VecF fma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecF zero() { return _mm512_setzero_ps(); }
inline VecF splat(float x) { return _mm512_set1_ps(x); }
inline float hsum(VecF v) { return _mm512_reduce_add_ps(v); }
inline void store(float* p, VecF v) { _mm512_storeu_ps(p, v); }

using kestrel_simd::exp_clamped;
#else
#error "this kernel needs AVX-512; kestrel falls back to the PyTorch path elsewhere"
#endif

using kestrel_parallel::parallel_for_by_cost;

template <bool BF16>
inline VecF load_row_chunk(const void* base, int64_t offset) {
  if constexpr (BF16) return load_bf16(static_cast<const uint16_t*>(base) + offset);
  else return load_f32(static_cast<const float*>(base) + offset);
}

template <bool BF16, int D, int G>
void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& block_tables, const torch::Tensor& seq_lens, torch::Tensor& out,
         int64_t block_size, float scale) {
  constexpr int C = D / kLanes;  // vector chunks per row
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), kv_heads = k_cache.size(1);
  const int64_t max_blocks = block_tables.size(1), slot_stride = kv_heads * D;
  const int64_t elem = BF16 ? 2 : 4;
  const char* kp = static_cast<const char*>(k_cache.data_ptr());
  const char* vp = static_cast<const char*>(v_cache.data_ptr());
  const float* qf_all = q.data_ptr<float>();   // q arrives as float32
  float* op = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();

  const auto cost = [&](int64_t item) { return 1 + std::max<int64_t>(0, lens[item / kv_heads]) / block_size; };
  parallel_for_by_cost(num_seqs * kv_heads, cost, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kv_heads, h = item % kv_heads;
      const int64_t len = lens[s];
      const int64_t* table = tables + s * max_blocks;
      VecF qv[G][C];
      for (int j = 0; j < G; ++j)
        for (int c = 0; c < C; ++c)
          qv[j][c] = _mm512_mul_ps(load_f32(qf_all + (s * num_heads + h * G + j) * D + c * kLanes), splat(scale));
      scores.resize(G * len);
      float mx[G];
      for (int j = 0; j < G; ++j) mx[j] = -std::numeric_limits<float>::infinity();
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const char* kb = kp + ((table[t0 / block_size] * block_size) * slot_stride + h * D) * elem;
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t o = 0; o < n; ++o) {
          const void* row = kb + o * slot_stride * elem;
          VecF kr[C];
          for (int c = 0; c < C; ++c) kr[c] = load_row_chunk<BF16>(row, c * kLanes);
          for (int j = 0; j < G; ++j) {
            VecF acc = _mm512_mul_ps(qv[j][0], kr[0]);
            for (int c = 1; c < C; ++c) acc = fma(qv[j][c], kr[c], acc);
            const float sc = hsum(acc);
            scores[j * len + t0 + o] = sc;
            mx[j] = std::max(mx[j], sc);
          }
        }
      }
      float inv[G];
      for (int j = 0; j < G; ++j) {
        float* sj = scores.data() + j * len;
        const VecF m = splat(mx[j]);
        VecF sum = zero();
        for (int64_t t = 0; t < len; t += kLanes) {
          const __mmask16 lanes = len - t >= kLanes ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - t)) - 1);
          const VecF e = exp_clamped(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, sj + t), m));
          _mm512_mask_storeu_ps(sj + t, lanes, e);
          sum = _mm512_mask_add_ps(sum, lanes, sum, e);
        }
        inv[j] = 1.f / hsum(sum);
      }
      VecF acc[G][C];
      for (int j = 0; j < G; ++j)
        for (int c = 0; c < C; ++c) acc[j][c] = zero();
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const char* vb = vp + ((table[t0 / block_size] * block_size) * slot_stride + h * D) * elem;
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t o = 0; o < n; ++o) {
          const void* row = vb + o * slot_stride * elem;
          VecF vr[C];
          for (int c = 0; c < C; ++c) vr[c] = load_row_chunk<BF16>(row, c * kLanes);
          for (int j = 0; j < G; ++j) {
            const VecF p = splat(scores[j * len + t0 + o]);
            for (int c = 0; c < C; ++c) acc[j][c] = fma(p, vr[c], acc[j][c]);
          }
        }
      }
      for (int j = 0; j < G; ++j) {
        float* dst = op + (s * num_heads + h * G + j) * D;
        for (int c = 0; c < C; ++c) store(dst + c * kLanes, _mm512_mul_ps(acc[j][c], splat(inv[j])));
      }
    }
  });
}


// ---- bf16 KV cache: block-major walk, online softmax over chunks of up to 64 tokens ----
//
// Work is cut into units of one block of one sequence (all its KV heads), in (sequence, block)
// order, and each thread takes an equal share of units, so a long sequence (or a batch of one) is
// split across threads; a sequence cut by a share boundary leaves partial results per (sequence,
// KV head) (running max, sum, unnormalised output) that are merged after the parallel loop.
// A thread walks its share chunk by chunk (up to kChunkTiles tiles of 16 rows), and within a chunk
// KV head by KV head, so that a block's K and V rows of all heads are read close together, and it
// prefetches the next chunk's blocks whole (this pays when the cache is in DRAM).
// Per (chunk, KV head): the scores of the G query heads, one online-softmax update, then the V
// rows. Scores: with AMX (a bf16 q, as in a bf16 model) C[16 rows][G] = K · q^T by tdpbf16ps
// (products of bf16 numbers are exact in float32, sums in float32), started one unit ahead so that
// they overlap the previous unit's V work; otherwise in AVX-512 float32, the 16 rows' lane-wise
// products reduced together by a transpose-and-add tree into one vector of 16 scores.
// bf16 → float32 by the even/odd trick: a 32-bit lane of a 512-bit load of 32 bf16 holds two of
// them, << 16 gives the even one as a float32, & 0xFFFF0000 the odd one; q is split into matching
// even/odd vectors once, and the output is accumulated (in float32) in even/odd order, interleaved
// back at the end. The running max is raised only when a chunk's max exceeds it by kMaxSlack, so
// that the exponentials do not wait on it (exp(s - m) <= e^kMaxSlack, far from overflow).

constexpr int kChunkTiles = 4;
constexpr float kMaxSlack = 8.f;

inline VecF bf16_even(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
inline VecF bf16_odd(__m512i x) { return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(0xFFFF0000))); }

constexpr int kPrefetchChunks = 1;  // how far ahead (in chunks) whole blocks are prefetched

template <int D, int G>
struct PairState {
  static constexpr int C2 = D / 32;
  VecF qe[G][C2], qo[G][C2];    // query heads of the pair, scaled: even and odd elements of each 32-chunk
  float m[G];                   // running max (within kMaxSlack) of the scores
  VecF l[G];                    // running sums of exp, lane-wise
  alignas(64) float acc[G][D];  // chunk c: [32c, 32c+16) the even elements, [32c+16, 32c+32) the odd ones
};

struct TileRef {
  const uint16_t* k;
  const uint16_t* v;
  int n;  // rows, 1..16
};

// Scores of one tile's rows (scaled q · k) for the G query heads; lanes >= n are left at 0.
template <int D, int G, bool FULL>
__attribute__((always_inline)) inline void tile_scores(const PairState<D, G>& st, const uint16_t* kb, int64_t stride,
                                                       int n, VecF* s) {
  constexpr int C2 = D / 32;
  VecF c4[G][4];
#pragma GCC unroll 4
  for (int g4 = 0; g4 < 4; ++g4) {
    VecF b2[G][2];
#pragma GCC unroll 2
    for (int pr = 0; pr < 2; ++pr) {
      VecF a[G][2];
#pragma GCC unroll 2
      for (int rr = 0; rr < 2; ++rr) {
        const int r = g4 * 4 + pr * 2 + rr;
        for (int j = 0; j < G; ++j) a[j][rr] = zero();
        if (!FULL && r >= n) continue;
        const uint16_t* row = kb + r * stride;
#pragma GCC unroll 4
        for (int c = 0; c < C2; ++c) {
          const __m512i x = _mm512_loadu_si512(row + 32 * c);
          const VecF ke = bf16_even(x), ko = bf16_odd(x);
#pragma GCC unroll 8
          for (int j = 0; j < G; ++j) {
            a[j][rr] = fma(st.qe[j][c], ke, a[j][rr]);
            a[j][rr] = fma(st.qo[j][c], ko, a[j][rr]);
          }
        }
      }
#pragma GCC unroll 8
      for (int j = 0; j < G; ++j)
        b2[j][pr] = _mm512_add_ps(_mm512_unpacklo_ps(a[j][0], a[j][1]), _mm512_unpackhi_ps(a[j][0], a[j][1]));
    }
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j)
      c4[j][g4] = _mm512_add_ps(_mm512_shuffle_ps(b2[j][0], b2[j][1], _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm512_shuffle_ps(b2[j][0], b2[j][1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
#pragma GCC unroll 8
  for (int j = 0; j < G; ++j) {
    const VecF d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c4[j][0], c4[j][1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c4[j][0], c4[j][1], _MM_SHUFFLE(3, 1, 3, 1)));
    const VecF d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c4[j][2], c4[j][3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c4[j][2], c4[j][3], _MM_SHUFFLE(3, 1, 3, 1)));
    s[j] = _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
  }
}

// out += p · V over the chunk's rows, in float32; p of row r of tile t for head j at
// p[t * TS + r * RS + j * JS].
template <int D, int G, int TS, int RS, int JS>
__attribute__((always_inline)) inline void chunk_pv(PairState<D, G>& st, const TileRef* tiles, int nt, int64_t stride,
                                                    const float* p) {
  constexpr int C2 = D / 32;
#pragma GCC unroll 4
  for (int c = 0; c < C2; ++c) {
    // With few heads, two accumulator sets (even and odd rows) halve the dependency chains.
    constexpr int NS = G <= 4 ? 2 : 1;
    VecF ae[NS][G], ao[NS][G];
    for (int j = 0; j < G; ++j) {
      ae[0][j] = load_f32(st.acc[j] + 32 * c);
      ao[0][j] = load_f32(st.acc[j] + 32 * c + 16);
      if constexpr (NS == 2) ae[1][j] = ao[1][j] = zero();
    }
    for (int t = 0; t < nt; ++t) {
      const uint16_t* vb = tiles[t].v + 32 * c;
      const float* pt = p + TS * t;
      const int n = tiles[t].n;
      auto row = [&](int r, int set) __attribute__((always_inline)) {
        const __m512i x = _mm512_loadu_si512(vb + r * stride);
        const VecF ve = bf16_even(x), vo = bf16_odd(x);
#pragma GCC unroll 8
        for (int j = 0; j < G; ++j) {
          const VecF pj = splat(pt[j * JS + r * RS]);
          ae[set][j] = fma(pj, ve, ae[set][j]);
          ao[set][j] = fma(pj, vo, ao[set][j]);
        }
      };
      if (n == 16) {
#pragma GCC unroll 16
        for (int r = 0; r < 16; r += 2) { row(r, 0); row(r + 1, NS - 1); }
      } else {
        for (int r = 0; r < n; ++r) row(r, 0);
      }
    }
    for (int j = 0; j < G; ++j) {
      if constexpr (NS == 2) {
        ae[0][j] = _mm512_add_ps(ae[0][j], ae[1][j]);
        ao[0][j] = _mm512_add_ps(ao[0][j], ao[1][j]);
      }
      store(st.acc[j] + 32 * c, ae[0][j]);
      store(st.acc[j] + 32 * c + 16, ao[0][j]);
    }
  }
}

template <int D, int G>
__attribute__((always_inline)) inline void chunk_avx(PairState<D, G>& st, const TileRef* tiles, int nt, int64_t stride) {
  alignas(64) float p[G][kChunkTiles * 16];
  const VecF ninf = splat(-std::numeric_limits<float>::infinity());
  VecF mx[G];
  for (int j = 0; j < G; ++j) mx[j] = ninf;
  for (int t = 0; t < nt; ++t) {
    VecF s[G];
    const int n = tiles[t].n;
    if (n == 16) {
      tile_scores<D, G, true>(st, tiles[t].k, stride, 16, s);
    } else {
      tile_scores<D, G, false>(st, tiles[t].k, stride, n, s);
      for (int j = 0; j < G; ++j) s[j] = _mm512_mask_mov_ps(ninf, (__mmask16)((1u << n) - 1), s[j]);
    }
    for (int j = 0; j < G; ++j) {
      store(p[j] + 16 * t, s[j]);
      mx[j] = _mm512_max_ps(mx[j], s[j]);
    }
  }
  for (int j = 0; j < G; ++j) {
    const float mt = _mm512_reduce_max_ps(mx[j]);
    if (__builtin_expect(mt > st.m[j] + kMaxSlack, 0)) {  // always on the first chunk (m = -inf)
      const VecF alpha = splat(std::exp(st.m[j] - mt));  // 0 on the first chunk
      st.m[j] = mt;
      st.l[j] = _mm512_mul_ps(st.l[j], alpha);
      for (int c = 0; c < D / kLanes; ++c)
        store(st.acc[j] + c * kLanes, _mm512_mul_ps(load_f32(st.acc[j] + c * kLanes), alpha));
    }
    const VecF m = splat(st.m[j]);
    for (int t = 0; t < nt; ++t) {
      // exp(-inf - m) is not 0 after the clamp: masked lanes are zeroed.
      VecF e = exp_clamped(_mm512_sub_ps(load_f32(p[j] + 16 * t), m));
      if (tiles[t].n != 16) e = _mm512_maskz_mov_ps((__mmask16)((1u << tiles[t].n) - 1), e);
      store(p[j] + 16 * t, e);
      st.l[j] = _mm512_add_ps(st.l[j], e);
    }
  }
  chunk_pv<D, G, 16, 1, kChunkTiles * 16>(st, tiles, nt, stride, &p[0][0]);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KESTREL_AMX 1
// AMX scores need a bf16 q and whole 16-row tiles in memory (block_size % 16 == 0): K is loaded
// straight from the cache as A tiles (16 rows of 32 bf16, row stride = the slot stride), q^T of
// the G heads in the VNNI layout as B tiles (one per 32 elements of head_dim), C = 16 rows x G.
// The scores stay in C's [row][head] order; the softmax works lane-wise in that order (lane i of
// vector v is head (16 v + i) % G of row (16 v + i) / G).

using kestrel_amx::amx_usable;
using kestrel_amx::TileConfig;

template <int D, int G>
TileConfig amx_config() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.rows[i] = 16;
  cfg.colsb[0] = G * 4;                                           // C: 16 rows x G heads
  for (int c = 0; c < D / 32; ++c) cfg.colsb[4 + c] = G * 4;      // B (q^T): 16 pairs x G heads
  if (D == 64) {
    cfg.colsb[1] = G * 4;                                         // C
    cfg.colsb[2] = cfg.colsb[3] = cfg.colsb[6] = cfg.colsb[7] = 64;  // A: 16 rows of 32 bf16
  } else {
    cfg.colsb[1] = cfg.colsb[2] = cfg.colsb[3] = 64;              // A
  }
  return cfg;
}

// The scores of one tile into out[16 * G] ([row][head]). D = 64: C in tmm0 (even tiles, A in
// tmm2/tmm3) or tmm1 (odd tiles, A in tmm6/tmm7), q^T in tmm4/tmm5. D = 128: C in tmm0, A rotating
// through tmm1..tmm3 (RS: which rotation), q^T in tmm4..tmm7.
template <int D, int G, int RS>
__attribute__((always_inline)) inline void amx_tile_scores(const uint16_t* k, int64_t stride_bytes, float* out) {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  if constexpr (D == 128) {
    // Tiles rotate A through (1,2,3,1), (2,3,1,2), (3,1,2,3), so that a load need not wait for the
    // previous product to have read its register.
    _tile_zero(0);
    if constexpr (RS == 0) {
      _tile_loadd(1, k, stride_bytes);      _tile_dpbf16ps(0, 1, 4);
      _tile_loadd(2, k + 32, stride_bytes); _tile_dpbf16ps(0, 2, 5);
      _tile_loadd(3, k + 64, stride_bytes); _tile_dpbf16ps(0, 3, 6);
      _tile_loadd(1, k + 96, stride_bytes); _tile_dpbf16ps(0, 1, 7);
    } else if constexpr (RS == 1) {
      _tile_loadd(2, k, stride_bytes);      _tile_dpbf16ps(0, 2, 4);
      _tile_loadd(3, k + 32, stride_bytes); _tile_dpbf16ps(0, 3, 5);
      _tile_loadd(1, k + 64, stride_bytes); _tile_dpbf16ps(0, 1, 6);
      _tile_loadd(2, k + 96, stride_bytes); _tile_dpbf16ps(0, 2, 7);
    } else {
      _tile_loadd(3, k, stride_bytes);      _tile_dpbf16ps(0, 3, 4);
      _tile_loadd(1, k + 32, stride_bytes); _tile_dpbf16ps(0, 1, 5);
      _tile_loadd(2, k + 64, stride_bytes); _tile_dpbf16ps(0, 2, 6);
      _tile_loadd(3, k + 96, stride_bytes); _tile_dpbf16ps(0, 3, 7);
    }
    _tile_stored(0, out, G * 4);
  } else if constexpr (RS == 0) {
    _tile_zero(0);
    _tile_loadd(2, k, stride_bytes);
    _tile_dpbf16ps(0, 2, 4);
    _tile_loadd(3, k + 32, stride_bytes);
    _tile_dpbf16ps(0, 3, 5);
    _tile_stored(0, out, G * 4);
  } else {
    _tile_zero(1);
    _tile_loadd(6, k, stride_bytes);
    _tile_dpbf16ps(1, 6, 4);
    _tile_loadd(7, k + 32, stride_bytes);
    _tile_dpbf16ps(1, 7, 5);
    _tile_stored(1, out, G * 4);
  }
}

// The scores' [row][head] order in G vectors: lane i of vector v is head (16 v + i) % G of row
// (16 v + i) / G. Index tables to move between that order and one vector per head.
template <int G>
struct HeadOrder {
  static constexpr int P = (G + 1) / 2;  // vector pairs
  alignas(64) int32_t lane_head[G][16];  // for permutexvar of a [head] vector into vector v
  alignas(64) int32_t gather[G][P][16];  // head j from vectors (2k, 2k+1) by permutex2var ...
  uint16_t gather_mask[G][P];            // ... into these lanes
  constexpr HeadOrder() : lane_head{}, gather{}, gather_mask{} {
    for (int v = 0; v < G; ++v)
      for (int i = 0; i < 16; ++i) lane_head[v][i] = (16 * v + i) % G;
    for (int j = 0; j < G; ++j)
      for (int r = 0; r < 16; ++r) {
        const int flat = r * G + j, v = flat / 16, lane = flat % 16;
        gather[j][v / 2][r] = lane + 16 * (v % 2);
        gather_mask[j][v / 2] |= static_cast<uint16_t>(1u << r);
      }
  }
};

// One vector per head (lane r: row r) from the [row][head] order.
template <int G>
__attribute__((always_inline)) inline void to_heads(const VecF* x, VecF* h) {
  static constexpr HeadOrder<G> T{};
  for (int j = 0; j < G; ++j) {
    h[j] = zero();
    for (int k = 0; k < T.P; ++k) {
      const VecF hi = 2 * k + 1 < G ? x[2 * k + 1] : x[2 * k];
      h[j] = _mm512_mask_mov_ps(h[j], T.gather_mask[j][k],
                                _mm512_permutex2var_ps(x[2 * k], _mm512_load_si512(T.gather[j][k]), hi));
    }
  }
}

// Vector v of the [row][head] order from per-head values m[16] (lanes >= G unused).
template <int G>
__attribute__((always_inline)) inline VecF head_lanes(VecF m, int v) {
  static constexpr HeadOrder<G> T{};
  return _mm512_permutexvar_ps(_mm512_load_si512(T.lane_head[v]), m);
}

// Starts the AMX score tiles of a chunk (raw q · k, [tile][row][head]); the driver issues the
// next chunk's before it finishes this one, so that they overlap.
template <int D, int G>
__attribute__((always_inline)) inline void amx_chunk_scores(const TileRef* tiles, int nt, int64_t stride, float* p) {
  static_assert(kChunkTiles == 4, "unrolled for 4 tiles");
  constexpr int R = D == 64 ? 2 : 3;  // tile register sets (see amx_tile_scores)
  if (nt > 0) amx_tile_scores<D, G, 0 % R>(tiles[0].k, stride * 2, p);
  if (nt > 1) amx_tile_scores<D, G, 1 % R>(tiles[1].k, stride * 2, p + 16 * G);
  if (nt > 2) amx_tile_scores<D, G, 2 % R>(tiles[2].k, stride * 2, p + 32 * G);
  if (nt > 3) amx_tile_scores<D, G, 3 % R>(tiles[3].k, stride * 2, p + 48 * G);
}

template <int D, int G>
__attribute__((always_inline)) inline void chunk_amx(PairState<D, G>& st, VecF* lv, const TileRef* tiles, int nt,
                                                     int64_t stride, float scale, float (*p)[16 * G]) {
  const VecF ninf = splat(-std::numeric_limits<float>::infinity());
  // Scale; rows past a tile's end to -inf; lane-wise max over the chunk.
  VecF mx[G];
  for (int v = 0; v < G; ++v) mx[v] = ninf;
  for (int t = 0; t < nt; ++t) {
    const int valid = tiles[t].n * G;
    for (int v = 0; v < G; ++v) {
      VecF s = _mm512_mul_ps(load_f32(p[t] + 16 * v), splat(scale));
      if (valid < 16 * (v + 1)) {
        const int cnt = std::max(0, valid - 16 * v);
        s = _mm512_mask_mov_ps(ninf, (__mmask16)((1u << cnt) - 1), s);
      }
      store(p[t] + 16 * v, s);
      mx[v] = _mm512_max_ps(mx[v], s);
    }
  }
  VecF hm[G];
  to_heads<G>(mx, hm);
  bool raised = false;
  alignas(64) float alpha[16], mcur[16];
  for (int j = 0; j < G; ++j) {
    const float mt = _mm512_reduce_max_ps(hm[j]);
    alpha[j] = 1.f;
    if (__builtin_expect(mt > st.m[j] + kMaxSlack, 0)) {  // always on the first chunk (m = -inf)
      alpha[j] = std::exp(st.m[j] - mt);  // 0 on the first chunk
      st.m[j] = mt;
      raised = true;
      for (int c = 0; c < D / kLanes; ++c)
        store(st.acc[j] + c * kLanes, _mm512_mul_ps(load_f32(st.acc[j] + c * kLanes), splat(alpha[j])));
    }
    mcur[j] = st.m[j];
  }
  if (__builtin_expect(raised, 0)) {
    const VecF al = _mm512_maskz_loadu_ps((__mmask16)((1u << G) - 1), alpha);
    for (int v = 0; v < G; ++v) lv[v] = _mm512_mul_ps(lv[v], head_lanes<G>(al, v));
  }
  const VecF mvec = _mm512_maskz_loadu_ps((__mmask16)((1u << G) - 1), mcur);
  VecF m[G];
  for (int v = 0; v < G; ++v) m[v] = head_lanes<G>(mvec, v);
  for (int t = 0; t < nt; ++t) {
    const int valid = tiles[t].n * G;
    for (int v = 0; v < G; ++v) {
      VecF e = exp_clamped(_mm512_sub_ps(load_f32(p[t] + 16 * v), m[v]));
      if (valid < 16 * (v + 1)) {
        const int cnt = std::max(0, valid - 16 * v);
        e = _mm512_maskz_mov_ps((__mmask16)((1u << cnt) - 1), e);  // exp(-inf - m) is not 0 after the clamp
      }
      store(p[t] + 16 * v, e);
      lv[v] = _mm512_add_ps(lv[v], e);
    }
  }
  chunk_pv<D, G, 16 * G, G, 1>(st, tiles, nt, stride, &p[0][0]);
}
#endif

// Even/odd halves of a 32-float chunk back to natural order, times mul.
inline void store_interleaved(float* dst, VecF e, VecF o, VecF mul) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  store(dst, _mm512_mul_ps(_mm512_permutex2var_ps(e, lo, o), mul));
  store(dst + 16, _mm512_mul_ps(_mm512_permutex2var_ps(e, hi, o), mul));
}

template <int D, int G>
struct Partial {
  int64_t pair = -1;
  float m[G], l[G];
  float acc[G][D];  // natural order, unnormalised
};

// The state of one (sequence, KV head) while a thread walks a segment of the sequence.
template <int D, int G>
struct alignas(64) HeadState {
  PairState<D, G> st;
  VecF lv[G];                              // AMX: running sums of exp in the scores' [row][head] order
  alignas(64) uint32_t qt[D / 32][16][G];  // AMX: q^T in the VNNI layout
};

// q [num_seqs, num_heads, D]: bf16 with AMX, else float32. See the comment at the top of this part.
template <int D, int G, bool AMX>
void run_bf16(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
              const torch::Tensor& block_tables, const torch::Tensor& seq_lens, torch::Tensor& out,
              int64_t block_size, float scale) {
  constexpr int C2 = D / 32;
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), kv_heads = k_cache.size(1);
  const int64_t max_blocks = block_tables.size(1), stride = kv_heads * D;  // elements between rows
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  const void* qp = q.data_ptr();
  float* op = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  std::vector<int64_t> cum(num_seqs + 1, 0);  // units (blocks) before each sequence
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = lens[s];
    cum[s + 1] = cum[s] + (len > 0 ? (len + block_size - 1) / block_size : 0);
    if (len <= 0) std::memset(op + s * num_heads * D, 0, sizeof(float) * num_heads * D);
  }
  const int64_t total = cum[num_seqs];
  if (total == 0) return;
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total));
  // Two per thread (its first and last segment) per KV head.
  std::vector<Partial<D, G>> partials(2 * nthreads * kv_heads);
  const int64_t block_bytes = block_size * stride * 2;
  std::vector<int64_t> pf_from(kv_heads + 1);  // the part of a block each head's unit prefetches
  for (int64_t h = 0; h <= kv_heads; ++h) pf_from[h] = (block_bytes * h / kv_heads) & ~int64_t{63};

  auto work = [&](int64_t t) {
#ifdef KESTREL_AMX
    if constexpr (AMX) {
      static const TileConfig cfg = amx_config<D, G>();
      _tile_loadconfig(&cfg);
    }
#endif
    std::vector<HeadState<D, G>> hs(kv_heads);
    const int64_t lo = total * t / nthreads, hi = total * (t + 1) / nthreads;
    int64_t s = std::upper_bound(cum.begin(), cum.end(), lo) - cum.begin() - 1;
    bool first = true;
    for (; s < num_seqs && cum[s] < hi; ++s) {
      const int64_t nb = cum[s + 1] - cum[s];
      if (nb == 0) continue;
      // This thread's segment of sequence s: blocks [b0, b1).
      const int64_t b0 = std::max<int64_t>(lo - cum[s], 0), b1 = std::min<int64_t>(hi - cum[s], nb);
      const int64_t len = lens[s];
      const int64_t* table = tables + s * max_blocks;
      for (int64_t h = 0; h < kv_heads; ++h) {
        PairState<D, G>& st = hs[h].st;
        for (int j = 0; j < G; ++j) {
          st.m[j] = -std::numeric_limits<float>::infinity();
          st.l[j] = zero();
          hs[h].lv[j] = zero();
          for (int c = 0; c < D / kLanes; ++c) store(st.acc[j] + c * kLanes, zero());
        }
        if constexpr (AMX) {
          const uint32_t* qd = static_cast<const uint32_t*>(qp) + (s * num_heads + h * G) * D / 2;
          for (int j = 0; j < G; ++j)
            for (int c = 0; c < C2; ++c)
              for (int i = 0; i < 16; ++i) hs[h].qt[c][i][j] = qd[j * (D / 2) + 16 * c + i];
        } else {
          const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
          const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
          for (int j = 0; j < G; ++j) {
            const float* qf = static_cast<const float*>(qp) + (s * num_heads + h * G + j) * D;
            for (int c = 0; c < C2; ++c) {
              const VecF lo16 = _mm512_mul_ps(load_f32(qf + 32 * c), splat(scale));
              const VecF hi16 = _mm512_mul_ps(load_f32(qf + 32 * c + 16), splat(scale));
              st.qe[j][c] = _mm512_permutex2var_ps(lo16, ev, hi16);
              st.qo[j][c] = _mm512_permutex2var_ps(lo16, od, hi16);
            }
          }
        }
      }
      asm volatile("" ::: "memory");  // the AMX tile loads below read qt

      // The next chunk of the segment (tiles for head 0) from cursor (block b, row o); the blocks
      // it starts go to blocks[0, nblk).
      auto next_chunk = [&](TileRef* tl, int64_t& b, int64_t& o, int64_t* blocks, int& nblk) {
        int nt = 0;
        nblk = 0;
        while (nt < kChunkTiles && b < b1) {
          const int64_t off = table[b] * block_size * stride + o * stride;
          const int64_t ntok = std::min(block_size, len - b * block_size);
          if (o == 0) blocks[nblk++] = table[b];
          tl[nt++] = {kp + off, vp + off, static_cast<int>(std::min<int64_t>(16, ntok - o))};
          o += 16;
          if (o >= ntok) { ++b; o = 0; }
        }
        return nt;
      };
      // Prefetch cursor kPrefetchChunks chunks ahead: each (chunk, head) unit prefetches a
      // kv_heads-th of the blocks of that chunk, all heads' rows (whole blocks, contiguous).
      int64_t pf_b = b0, pf_o = 0, pf_blocks[kChunkTiles];
      int pf_n = 0;
      TileRef scratch[kChunkTiles];
      for (int d = 0; d <= kPrefetchChunks; ++d) next_chunk(scratch, pf_b, pf_o, pf_blocks, pf_n);
      auto prefetch_part = [&](int64_t h) {
        for (int i = 0; i < pf_n; ++i) {
          const char* kb = reinterpret_cast<const char*>(kp + pf_blocks[i] * block_size * stride);
          const char* vb = reinterpret_cast<const char*>(vp + pf_blocks[i] * block_size * stride);
          for (int64_t o = pf_from[h]; o < pf_from[h + 1]; o += 64) {
            _mm_prefetch(kb + o, _MM_HINT_T0);
            _mm_prefetch(vb + o, _MM_HINT_T0);
          }
        }
        if (h == kv_heads - 1) next_chunk(scratch, pf_b, pf_o, pf_blocks, pf_n);
      };

      // Units (chunk, head) in order, two in flight: with AMX the next unit's scores are started
      // before this one's softmax and V rows.
      int64_t cb = b0, co = 0, unused_blocks[kChunkTiles];
      int unused_n;
      TileRef base[kChunkTiles], tl[2][kChunkTiles];
      int nbase = next_chunk(base, cb, co, unused_blocks, unused_n);
      auto head_tiles = [&](int64_t h, TileRef* dst) {
        for (int i = 0; i < nbase; ++i) dst[i] = {base[i].k + h * D, base[i].v + h * D, base[i].n};
        return nbase;
      };
      alignas(64) float pbuf[2][kChunkTiles][16 * G];
#ifdef KESTREL_AMX
      auto start_scores = [&](const TileRef* tiles, int nt, int64_t h, float* p) {
        _tile_loadd(4, hs[h].qt[0], G * 4);
        _tile_loadd(5, hs[h].qt[1], G * 4);
        if constexpr (D == 128) {
          _tile_loadd(6, hs[h].qt[2], G * 4);
          _tile_loadd(7, hs[h].qt[3], G * 4);
        }
        amx_chunk_scores<D, G>(tiles, nt, stride, p);
      };
#endif
      int cur = 0, ntl[2];
      int64_t uh = 0;  // the current unit's head
      ntl[0] = head_tiles(0, tl[0]);
#ifdef KESTREL_AMX
      if constexpr (AMX) start_scores(tl[0], ntl[0], 0, &pbuf[0][0][0]);
#endif
      while (ntl[cur] > 0) {
        int64_t nh = uh + 1;  // the next unit: the next head, or head 0 of the next chunk
        if (nh == kv_heads) {
          nh = 0;
          nbase = next_chunk(base, cb, co, unused_blocks, unused_n);
        }
        ntl[cur ^ 1] = head_tiles(nh, tl[cur ^ 1]);
        prefetch_part(uh);
#ifdef KESTREL_AMX
        if constexpr (AMX) {
          if (ntl[cur ^ 1] > 0) start_scores(tl[cur ^ 1], ntl[cur ^ 1], nh, &pbuf[cur ^ 1][0][0]);
          chunk_amx<D, G>(hs[uh].st, hs[uh].lv, tl[cur], ntl[cur], stride, scale, pbuf[cur]);
        }
#endif
        if constexpr (!AMX) chunk_avx<D, G>(hs[uh].st, tl[cur], ntl[cur], stride);
        cur ^= 1;
        uh = nh;
      }

      const bool whole = b0 == 0 && b1 == nb;
      for (int64_t h = 0; h < kv_heads; ++h) {
        PairState<D, G>& st = hs[h].st;
        float lsum[G];
        if constexpr (AMX) {
          alignas(64) float lb[16 * G];
          for (int v = 0; v < G; ++v) store(lb + 16 * v, hs[h].lv[v]);
          for (int j = 0; j < G; ++j) {
            lsum[j] = 0.f;
            for (int r = 0; r < 16; ++r) lsum[j] += lb[r * G + j];
          }
        } else {
          for (int j = 0; j < G; ++j) lsum[j] = hsum(st.l[j]);
        }
        if (whole) {
          for (int j = 0; j < G; ++j) {
            const VecF inv = splat(1.f / lsum[j]);
            float* dst = op + (s * num_heads + h * G + j) * D;
            for (int c = 0; c < C2; ++c)
              store_interleaved(dst + 32 * c, load_f32(st.acc[j] + 32 * c), load_f32(st.acc[j] + 32 * c + 16), inv);
          }
        } else {
          Partial<D, G>& part = partials[(2 * t + (first ? 0 : 1)) * kv_heads + h];
          part.pair = s * kv_heads + h;
          for (int j = 0; j < G; ++j) {
            part.m[j] = st.m[j];
            part.l[j] = lsum[j];
            for (int c = 0; c < C2; ++c)
              store_interleaved(part.acc[j] + 32 * c, load_f32(st.acc[j] + 32 * c), load_f32(st.acc[j] + 32 * c + 16),
                                splat(1.f));
          }
        }
      }
      first = false;
    }
#ifdef KESTREL_AMX
    if constexpr (AMX) _tile_release();
#endif
  };
  at::parallel_for(0, nthreads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) work(t);
  });
  // Merge the partial results of the (sequence, KV head) pairs cut by share boundaries.
  for (size_t a = 0; a < partials.size(); ++a) {
    const int64_t pair = partials[a].pair;
    if (pair < 0) continue;
    bool seen = false;
    for (size_t b = 0; b < a; ++b) seen |= partials[b].pair == pair;
    if (seen) continue;
    const int64_t s = pair / kv_heads, h = pair % kv_heads;
    for (int j = 0; j < G; ++j) {
      float mx = -std::numeric_limits<float>::infinity();
      for (size_t b = a; b < partials.size(); ++b)
        if (partials[b].pair == pair) mx = std::max(mx, partials[b].m[j]);
      float sum = 0.f;
      float acc[D] = {};
      for (size_t b = a; b < partials.size(); ++b) {
        if (partials[b].pair != pair) continue;
        const float w = std::exp(partials[b].m[j] - mx);
        sum += partials[b].l[j] * w;
        for (int d = 0; d < D; ++d) acc[d] += partials[b].acc[j][d] * w;
      }
      float* dst = op + (s * num_heads + h * G + j) * D;
      for (int d = 0; d < D; ++d) dst[d] = acc[d] / sum;
    }
  }
}

}  // namespace

torch::Tensor paged_decode_attention_f32(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                         torch::Tensor block_tables, torch::Tensor seq_lens,
                                         int64_t block_size, double scale);

// A decode kernel's float32 result, rounded once to `dtype` (bf16, round to nearest even, as .to()
// rounds) or returned as is. Here, not through .to(): on so small a tensor .to() costs ~10 µs of
// dispatch, 30 times a decode step.
torch::Tensor in_dtype(const torch::Tensor& out, c10::ScalarType dtype) {
  if (dtype == torch::kFloat32) return out;
  TORCH_CHECK(dtype == torch::kBFloat16, "q must be float32 or bfloat16");
  auto rounded = torch::empty(out.sizes(), out.options().dtype(torch::kBFloat16));
  const float* src = out.data_ptr<float>();
  c10::BFloat16* dst = rounded.data_ptr<c10::BFloat16>();
  for (int64_t i = 0, n = out.numel(); i < n; ++i) dst[i] = c10::BFloat16(src[i]);
  return rounded;
}

// q [num_seqs, num_heads, head_dim] float32 or bfloat16; k_cache, v_cache [num_slots, kv_heads, head_dim] float32 or
// bfloat16; block_tables [num_seqs, max_blocks] int64; seq_lens [num_seqs] int64 (keys 0..len-1 visible).
// Returns [num_seqs, num_heads, head_dim]: float32, or with `in_q_dtype` q's dtype (see in_dtype).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens,
                                     int64_t block_size, double scale, bool in_q_dtype) {
  torch::Tensor out = paged_decode_attention_f32(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale);
  return in_q_dtype ? in_dtype(out, q.scalar_type()) : out;
}

torch::Tensor paged_decode_attention_f32(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                         torch::Tensor block_tables, torch::Tensor seq_lens,
                                         int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "bad ranks");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V dtypes differ");
  const bool bf16 = k_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || k_cache.scalar_type() == torch::kFloat32, "the KV cache must be float32 or bfloat16");
  // AMX scores need q exactly in bf16 (it is, in a bf16 model) and whole 16-row tiles in memory.
  bool amx = false;
#ifdef KESTREL_AMX
  amx = bf16 && q.scalar_type() == torch::kBFloat16 && block_size % 16 == 0 && amx_usable();
#endif
  auto out = torch::empty(q.sizes(), q.options().dtype(torch::kFloat32));
  q = amx ? q.contiguous() : q.to(torch::kFloat32).contiguous();
  block_tables = block_tables.to(torch::kInt64).contiguous();
  seq_lens = seq_lens.to(torch::kInt64).contiguous();
  const int64_t d = q.size(2), g = q.size(1) / k_cache.size(1);
  const float sc = static_cast<float>(scale);
#define KESTREL_CASE(D, G)                                                                    \
  if (d == D && g == G) {                                                                     \
    if (amx) run_bf16<D, G, true>(q, k_cache, v_cache, block_tables, seq_lens, out, block_size, sc);   \
    else if (bf16) run_bf16<D, G, false>(q, k_cache, v_cache, block_tables, seq_lens, out, block_size, sc); \
    else run<false, D, G>(q, k_cache, v_cache, block_tables, seq_lens, out, block_size, sc);      \
    return out;                                                                               \
  }
  KESTREL_CASE(64, 1) KESTREL_CASE(64, 2) KESTREL_CASE(64, 3) KESTREL_CASE(64, 4)
  KESTREL_CASE(64, 5) KESTREL_CASE(64, 8)
  KESTREL_CASE(128, 1) KESTREL_CASE(128, 2) KESTREL_CASE(128, 4) KESTREL_CASE(128, 8)
#undef KESTREL_CASE
  TORCH_CHECK(false, "no kernel for head_dim ", d, " with ", g, " query heads per KV head");
  return out;
}

bool supports(int64_t head_dim, int64_t group) {
  const int64_t ok[][2] = {{64, 1}, {64, 2}, {64, 3}, {64, 4}, {64, 5}, {64, 8}, {128, 1}, {128, 2}, {128, 4}, {128, 8}};
  for (const auto& c : ok)
    if (c[0] == head_dim && c[1] == group) return true;
  return false;
}

// ---- elementwise kernels for the layer: RMSNorm (with the residual add fused) and SiLU-and-mul ----

namespace {

// float → bf16 with round-to-nearest-even, as torch's .to(torch.bfloat16) does: the bf16 value sits
// in the upper 16 bits of each lane of the result.
inline __m512i round_to_bf16_bits(VecF v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
}
inline void store_row_chunk(float* p, VecF v) { _mm512_storeu_ps(p, v); }
inline void store_row_chunk(c10::BFloat16* p, VecF v) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_to_bf16_bits(v), 16)));
}
inline VecF load_chunk(const float* p) { return _mm512_loadu_ps(p); }
inline VecF load_chunk(const c10::BFloat16* p) { return load_bf16(reinterpret_cast<const uint16_t*>(p)); }

template <typename T>
void rms_norm_impl(const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& weight,
                   torch::Tensor& out, double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const T* xp = x.data_ptr<T>();
  T* rp = residual.defined() ? residual.data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    for (int64_t r = begin; r < end; ++r) {
      VecF ss = zero();
      for (int64_t i = 0; i < hidden; i += kLanes) {
        VecF v = load_chunk(xp + r * hidden + i);
        if (rp != nullptr) {
          // residual += x, rounded to the model dtype as an unfused add would be; normalise that.
          store_row_chunk(rp + r * hidden + i, _mm512_add_ps(v, load_chunk(rp + r * hidden + i)));
          v = load_chunk(rp + r * hidden + i);
        }
        _mm512_storeu_ps(row.data() + i, v);
        ss = fma(v, v, ss);
      }
      const VecF scale = splat(1.f / std::sqrt(hsum(ss) / hidden + static_cast<float>(eps)));
      for (int64_t i = 0; i < hidden; i += kLanes)
        store_row_chunk(op + r * hidden + i,
                        _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(row.data() + i), scale), load_chunk(wp + i)));
    }
  });
}

template <typename T>
void silu_and_mul_impl(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t rows = x.size(0), d = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * 2 * d;
      const T* up = gate + d;
      for (int64_t i = 0; i < d; i += kLanes) {
        const VecF g = load_chunk(gate + i);
        const VecF silu = _mm512_div_ps(g, _mm512_add_ps(splat(1.f), exp_clamped(_mm512_sub_ps(zero(), g))));
        store_row_chunk(op + r * d + i, _mm512_mul_ps(silu, load_chunk(up + i)));
      }
    }
  });
}

}  // namespace

// out = rms_norm(x) * weight, or with `residual` given: residual += x, out = rms_norm(residual) * weight.
// x, residual, out [rows, hidden] contiguous, hidden % 16 == 0; float32 or bfloat16, all one dtype.
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % kLanes == 0, "rms_norm: bad input");
  torch::Tensor res = residual.has_value() ? residual.value() : torch::Tensor();
  if (res.defined()) TORCH_CHECK(res.is_contiguous() && res.sizes() == x.sizes(), "rms_norm: bad residual");
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  if (x.scalar_type() == torch::kBFloat16) rms_norm_impl<c10::BFloat16>(x, res, weight, out, eps);
  else if (x.scalar_type() == torch::kFloat32) rms_norm_impl<float>(x, res, weight, out, eps);
  else TORCH_CHECK(false, "rms_norm: float32 or bfloat16 only");
  return out;
}

// x [rows, 2 d] = gate | up → silu(gate) * up [rows, d]; d % 16 == 0.
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % (2 * kLanes) == 0, "silu_and_mul: bad input");
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == torch::kBFloat16) silu_and_mul_impl<c10::BFloat16>(x, out);
  else if (x.scalar_type() == torch::kFloat32) silu_and_mul_impl<float>(x, out);
  else TORCH_CHECK(false, "silu_and_mul: float32 or bfloat16 only");
  return out;
}


// ---- rotary embedding fused with the KV-cache write ----

namespace {

inline VecF round_to(VecF v, float*) { return v; }
inline VecF round_to(VecF v, c10::BFloat16*) {  // float → bf16 → float
  return _mm512_castsi512_ps(_mm512_and_si512(round_to_bf16_bits(v), _mm512_set1_epi32(0xFFFF0000)));
}
// Rounded multiply and add: the _round_ forms are never contracted into an FMA, so the result
// rounds exactly as torch's separate `x * cos + rotate_half(x) * sin` does.
inline VecF mul_exact(VecF a, VecF b) { return _mm512_mul_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline VecF add_exact(VecF a, VecF b) { return _mm512_add_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

inline VecF negate(VecF v) {  // exactly torch's neg, signed zeros included
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x80000000)));
}

template <typename T>
void rotate_row(T* x, const T* cos, const T* sin, int64_t half) {
  T* tag = nullptr;
  for (int64_t i = 0; i < half; i += kLanes) {
    const VecF lo = load_chunk(x + i), hi = load_chunk(x + half + i);
    // rotate_half(x) = (-hi, lo)
    const VecF new_lo = add_exact(round_to(mul_exact(lo, load_chunk(cos + i)), tag),
                                  round_to(mul_exact(negate(hi), load_chunk(sin + i)), tag));
    const VecF new_hi = add_exact(round_to(mul_exact(hi, load_chunk(cos + half + i)), tag),
                                  round_to(mul_exact(lo, load_chunk(sin + half + i)), tag));
    store_row_chunk(x + i, new_lo);
    store_row_chunk(x + half + i, new_hi);
  }
}

// Rotates the q and k heads of every token of qkv in place, then hands the token's row to
// write(t, row) (the cache write, in whichever layout), in parallel over tokens.
template <typename T, typename Write>
void rotate_tokens(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t num_heads,
                   int64_t grain, const Write& write) {
  const int64_t n = qkv.size(0), all_heads = qkv.size(1), d = qkv.size(2);
  const int64_t rotated = num_heads + (all_heads - num_heads) / 2, half = d / 2;
  T* xp = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = xp + t * all_heads * d;
      for (int64_t h = 0; h < rotated; ++h) rotate_row(row + h * d, cp + t * d, sp + t * d, half);
      write(t, row);
    }
  });
}

template <typename T>
void rotary_write_kv_impl(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                          torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots,
                          int64_t num_heads) {
  const int64_t d = qkv.size(2), kv_heads = (qkv.size(1) - num_heads) / 2, kv_row = kv_heads * d;
  T* kp = k_cache.data_ptr<T>();
  T* vp = v_cache.data_ptr<T>();
  const int64_t* slot = slots.defined() ? slots.data_ptr<int64_t>() : nullptr;
  rotate_tokens<T>(qkv, cos, sin, num_heads, 64, [&](int64_t t, const T* row) {
    if (slot == nullptr) return;
    std::memcpy(kp + slot[t] * kv_row, row + num_heads * d, kv_row * sizeof(T));
    std::memcpy(vp + slot[t] * kv_row, row + (num_heads + kv_heads) * d, kv_row * sizeof(T));
  });
}

}  // namespace

// qkv [tokens, num_heads + 2 kv_heads, head_dim] contiguous: rotates the q and k heads in place
// (Hugging Face's rotate_half layout; cos, sin [tokens, head_dim] in qkv's dtype) and, with
// slot_mapping given, writes each token's k and v heads to slot_mapping[t] of the
// [num_slots, kv_heads, head_dim] caches. head_dim % 32 == 0; float32 or bfloat16, one dtype.
void rotary_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                     torch::Tensor v_cache, c10::optional<torch::Tensor> slot_mapping, int64_t num_heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous() && qkv.size(2) % (2 * kLanes) == 0, "rotary_write_kv: bad qkv");
  TORCH_CHECK((qkv.size(1) - num_heads) % 2 == 0 && qkv.size(1) > num_heads, "rotary_write_kv: bad head count");
  cos = cos.reshape({qkv.size(0), qkv.size(2)}).contiguous();
  sin = sin.reshape({qkv.size(0), qkv.size(2)}).contiguous();
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "rotary_write_kv: dtypes differ");
  torch::Tensor slots;
  if (slot_mapping.has_value()) {
    slots = slot_mapping.value().to(torch::kInt64).contiguous();
    const int64_t kv_heads = (qkv.size(1) - num_heads) / 2;
    TORCH_CHECK(slots.numel() == qkv.size(0), "rotary_write_kv: one slot per token");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                k_cache.size(1) == kv_heads && k_cache.size(2) == qkv.size(2) &&
                k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == qkv.scalar_type() &&
                v_cache.scalar_type() == qkv.scalar_type(), "rotary_write_kv: bad cache");
    const int64_t* sp = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < slots.numel(); ++t)
      TORCH_CHECK(sp[t] >= 0 && sp[t] < k_cache.size(0), "rotary_write_kv: slot out of range");
  }
  if (qkv.scalar_type() == torch::kBFloat16)
    rotary_write_kv_impl<c10::BFloat16>(qkv, cos, sin, k_cache, v_cache, slots, num_heads);
  else if (qkv.scalar_type() == torch::kFloat32)
    rotary_write_kv_impl<float>(qkv, cos, sin, k_cache, v_cache, slots, num_heads);
  else TORCH_CHECK(false, "rotary_write_kv: float32 or bfloat16 only");
}



// ---- int8 KV cache (--kv-cache-dtype int8) ----
//
// Each (token, KV head) row of head_dim values is stored as int8 with one float32 scale:
// x ≈ q * scale, scale = max|x| / 127, q = round-half-even(x / scale) (0 and scale 0 for a zero row).
// K is transposed within each block of 16 tokens, so that a block's 16 scores come out of one
// vector per dimension; the layout, the argument checks and a decode item's order of reading are in
// int8_kv.h, shared with the AVX2 build. The PyTorch reference is in kestrel/model/attention.py
// (write_kv, gather_kv).

namespace {

constexpr int64_t kInt8Block = kestrel_int8_kv::kBlock;

// Quantize one row of d floats (d % 16 == 0); returns the scale.
inline float quantize_row(const float* x, int64_t d, int8_t* q, int64_t q_stride) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += kLanes) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  const float m = _mm512_reduce_max_ps(amax);
  if (m == 0.f) {
    for (int64_t i = 0; i < d; ++i) q[i * q_stride] = 0;
    return 0.f;
  }
  const float scale = m / 127.f;
  const __m512 sv = _mm512_set1_ps(scale);
  alignas(64) int32_t qi[16];
  for (int64_t i = 0; i < d; i += kLanes) {
    // true division, then round half to even (the default rounding mode), as torch.round(x / scale)
    const __m512i r = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(x + i), sv));
    _mm512_store_si512(qi, r);
    for (int j = 0; j < kLanes; ++j) q[(i + j) * q_stride] = static_cast<int8_t>(qi[j]);
  }
  return scale;
}

template <typename T>
void to_float_row(const T* x, float* out, int64_t d) {
  for (int64_t i = 0; i < d; i += kLanes) _mm512_storeu_ps(out + i, load_chunk(x + i));
}

template <typename T>
void rotary_write_kv_int8_impl(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                               torch::Tensor& k_t, torch::Tensor& k_scale, torch::Tensor& v, torch::Tensor& v_scale,
                               const torch::Tensor& slots, int64_t num_heads) {
  const int64_t d = qkv.size(2), kv_heads = (qkv.size(1) - num_heads) / 2;
  int8_t* ktp = k_t.data_ptr<int8_t>();
  float* ksp = k_scale.data_ptr<float>();
  int8_t* vp = v.data_ptr<int8_t>();
  float* vsp = v_scale.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  rotate_tokens<T>(qkv, cos, sin, num_heads, 16, [&](int64_t t, const T* row) {
    float row_f[256];  // head_dim <= 256
    const int64_t blk = slot[t] / kInt8Block, off = slot[t] % kInt8Block;
    for (int64_t h = 0; h < kv_heads; ++h) {
      to_float_row(row + (num_heads + h) * d, row_f, d);
      ksp[(blk * kv_heads + h) * kInt8Block + off] =
          quantize_row(row_f, d, ktp + (blk * kv_heads + h) * d * kInt8Block + off, kInt8Block);
      to_float_row(row + (num_heads + kv_heads + h) * d, row_f, d);
      vsp[slot[t] * kv_heads + h] = quantize_row(row_f, d, vp + (slot[t] * kv_heads + h) * d, 1);
    }
  });
}

// One (sequence, KV head) per work item: the scores of a block's 16 keys at once from the
// transposed K, a softmax over them all (each exponential stored times its V row's scale), then the
// V rows weighted by those. Items go to threads by cost (parallel_for_by_cost).
// The K pass keeps kKPartials partial sums per head, so that G * kKPartials FMA chains are in flight
// rather than G chains each waiting on the latency of the one before. Prefetch: while a block (K or
// V) is computed, the one kPrefetchUnits ahead (in the item's order of reading, running on into the
// next item) is prefetched a line at a time, spread over the computation rather than in a burst.
// Measured on W1-like batches (52 sequences of 100-700 tokens, 2 cores with AMX, 2026-12-01): 1.5x
// the kernel with one chain per head, equal-count threads and a burst one block ahead; 5 blocks ahead
// was 1.06x over 2 and 1.01x over 3.
constexpr int kKPartials = 4;
constexpr int64_t kPrefetchUnits = 5;

template <int D, int G>
void run_int8(const torch::Tensor& q, const torch::Tensor& k_t, const torch::Tensor& k_scale,
              const torch::Tensor& v, const torch::Tensor& v_scale, const torch::Tensor& block_tables,
              const torch::Tensor& seq_lens, torch::Tensor& out, float scale) {
  constexpr int C = D / kLanes;
  constexpr int P = kKPartials;
  constexpr int64_t BS = kInt8Block;
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), kv_heads = v.size(1);
  const int64_t max_blocks = block_tables.size(1);
  const float* qf = q.data_ptr<float>();
  const int8_t* ktp = k_t.data_ptr<int8_t>();
  const float* ksp = k_scale.data_ptr<float>();
  const int8_t* vp = v.data_ptr<int8_t>();
  const float* vsp = v_scale.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float neg_inf = -std::numeric_limits<float>::infinity();

  const int64_t items = num_seqs * kv_heads;
  const kestrel_int8_kv::ReadOrder<D> order{ktp, vp, tables, lens, kv_heads, max_blocks, items};
  using Rows = typename kestrel_int8_kv::ReadOrder<D>::Rows;

  auto one_item = [&](int64_t item, std::vector<float>& scores, std::vector<float>& vscales) {
    const int64_t s = item / kv_heads, h = item % kv_heads, len = lens[s];
    float* dst = op + (s * num_heads + h * G) * D;
    if (len <= 0) {
      std::memset(dst, 0, sizeof(float) * G * D);
      return;
    }
    const int64_t* table = tables + s * max_blocks;
    const int64_t nb = (len + BS - 1) / BS;
    alignas(64) float qs[D][G];  // scaled q by dimension: a dimension's G broadcasts side by side
    for (int j = 0; j < G; ++j)
      for (int dd = 0; dd < D; ++dd) qs[dd][j] = qf[(s * num_heads + h * G + j) * D + dd] * scale;
    scores.resize(G * nb * BS);
    VecF mx[G];
    for (int j = 0; j < G; ++j) mx[j] = splat(neg_inf);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t blk = table[b];
      const int8_t* kb = ktp + (blk * kv_heads + h) * D * BS;
      const Rows ahead = order.unit(item, b + kPrefetchUnits);
      VecF acc[G][P];
      for (int j = 0; j < G; ++j)
        for (int p = 0; p < P; ++p) acc[j][p] = zero();
      static_assert(P == 4, "one line of the unit ahead per step of 4 dimensions");
      for (int dd = 0; dd < D; dd += P) {
        ahead.prefetch(dd / P);
        for (int p = 0; p < P; ++p) {
          const VecF kd = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(kb + (dd + p) * BS))));
          for (int j = 0; j < G; ++j) acc[j][p] = fma(splat(qs[dd + p][j]), kd, acc[j][p]);
        }
      }
      const VecF sk = load_f32(ksp + (blk * kv_heads + h) * BS);
      const int64_t n = std::min<int64_t>(BS, len - b * BS);
      const __mmask16 valid = n == BS ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
      for (int j = 0; j < G; ++j) {
        VecF sum = acc[j][0];
        for (int p = 1; p < P; ++p) sum = _mm512_add_ps(sum, acc[j][p]);
        const VecF sc = _mm512_mask_blend_ps(valid, splat(neg_inf), _mm512_mul_ps(sum, sk));
        store(scores.data() + (j * nb + b) * BS, sc);
        mx[j] = _mm512_max_ps(mx[j], sc);
      }
    }
    // The V rows' scales in the order of the scores (16 at a stride of kv_heads per block).
    vscales.resize(nb * BS);
    const __m512i vs_index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32(static_cast<int>(kv_heads)));
    for (int64_t b = 0; b < nb; ++b)
      store(vscales.data() + b * BS, _mm512_i32gather_ps(vs_index, vsp + table[b] * BS * kv_heads + h, 4));
    // Each score becomes its exponential times its V row's scale; the sum is of the exponentials.
    float inv[G];
    for (int j = 0; j < G; ++j) {
      const VecF m = splat(_mm512_reduce_max_ps(mx[j]));
      float* sj = scores.data() + j * nb * BS;
      VecF sum = zero();
      for (int64_t t = 0; t < nb * BS; t += kLanes) {
        const __mmask16 lanes = len - t >= kLanes ? (__mmask16)0xFFFF
                              : len > t ? (__mmask16)((1u << (len - t)) - 1) : (__mmask16)0;
        const VecF e = _mm512_maskz_mov_ps(lanes, exp_clamped(_mm512_sub_ps(load_f32(sj + t), m)));
        store(sj + t, _mm512_mul_ps(e, load_f32(vscales.data() + t)));
        sum = _mm512_add_ps(sum, e);
      }
      inv[j] = 1.f / hsum(sum);
    }
    VecF acc[G][C];
    for (int j = 0; j < G; ++j)
      for (int c = 0; c < C; ++c) acc[j][c] = zero();
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t base = table[b] * BS, n = std::min<int64_t>(BS, len - b * BS);
      const Rows ahead = order.unit(item, nb + b + kPrefetchUnits);
      const float* pb = scores.data() + b * BS;
      for (int64_t o = 0; o < n; ++o) {
        for (int i = 0; i < D / 64; ++i) ahead.prefetch(o * (D / 64) + i);
        const int64_t slot = base + o;
        const int8_t* row = vp + (slot * kv_heads + h) * D;
        VecF vr[C];
        for (int c = 0; c < C; ++c)
          vr[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + kLanes * c))));
        for (int j = 0; j < G; ++j) {
          const VecF p = splat(pb[j * nb * BS + o]);
          for (int c = 0; c < C; ++c) acc[j][c] = fma(p, vr[c], acc[j][c]);
        }
      }
    }
    for (int j = 0; j < G; ++j)
      for (int c = 0; c < C; ++c) store(dst + j * D + c * kLanes, _mm512_mul_ps(acc[j][c], splat(inv[j])));
  };

  parallel_for_by_cost(items, [&](int64_t item) { return 1 + order.blocks_of(item); }, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, vscales;
    for (int64_t item = begin; item < end; ++item) one_item(item, scores, vscales);
  });
}

}  // namespace

// rotary_write_kv for the int8 cache: rotates q and k in place and writes k, v quantized.
void rotary_write_kv_int8(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_t,
                          torch::Tensor k_scale, torch::Tensor v, torch::Tensor v_scale, torch::Tensor slot_mapping,
                          int64_t num_heads) {
  const auto slots = kestrel_int8_kv::checked_write_args(qkv, cos, sin, k_t, k_scale, v, v_scale, slot_mapping,
                                                        num_heads, kLanes);
  if (qkv.scalar_type() == torch::kBFloat16)
    rotary_write_kv_int8_impl<c10::BFloat16>(qkv, cos, sin, k_t, k_scale, v, v_scale, slots, num_heads);
  else if (qkv.scalar_type() == torch::kFloat32)
    rotary_write_kv_int8_impl<float>(qkv, cos, sin, k_t, k_scale, v, v_scale, slots, num_heads);
  else TORCH_CHECK(false, "rotary_write_kv_int8: float32 or bfloat16 only");
}

// Decode attention over the int8 cache (layout above; block_size 16). Returns float32, or with
// `in_q_dtype` q's dtype.
torch::Tensor paged_decode_attention_int8(torch::Tensor q, torch::Tensor k_t, torch::Tensor k_scale, torch::Tensor v,
                                          torch::Tensor v_scale, torch::Tensor block_tables, torch::Tensor seq_lens,
                                          int64_t block_size, double scale, bool in_q_dtype) {
  kestrel_int8_kv::check_decode_args(q, k_t, k_scale, v, v_scale, block_size);
  const auto out_dtype = q.scalar_type();
  auto qf = q.to(torch::kFloat32).contiguous();
  auto out = torch::empty(qf.sizes(), qf.options());
  block_tables = block_tables.to(torch::kInt64).contiguous();
  seq_lens = seq_lens.to(torch::kInt64).contiguous();
  const int64_t d = q.size(2), g = q.size(1) / v.size(1);
  const float sc = static_cast<float>(scale);
  bool done = false;
#define KESTREL_CASE(D, G) \
  if (!done && d == D && g == G) { run_int8<D, G>(qf, k_t, k_scale, v, v_scale, block_tables, seq_lens, out, sc); done = true; }
  KESTREL_CASE(64, 1) KESTREL_CASE(64, 2) KESTREL_CASE(64, 3) KESTREL_CASE(64, 4)
  KESTREL_CASE(64, 5) KESTREL_CASE(64, 8)
  KESTREL_CASE(128, 1) KESTREL_CASE(128, 2) KESTREL_CASE(128, 4) KESTREL_CASE(128, 8)
#undef KESTREL_CASE
  TORCH_CHECK(done, "no kernel for head_dim ", d, " with ", g, " query heads per KV head");
  return in_q_dtype ? in_dtype(out, out_dtype) : out;
}

// ---- argmax over the rows of float32 logits ----

namespace {

// The first index of the row's maximum, NaN counting as above everything (torch.argmax's rule).
int64_t argmax_row(const float* x, int64_t n) {
  const int64_t full = n / kLanes * kLanes;
  __m512i best_i = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  VecF best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i idx = best_i;
  const __m512i step = _mm512_set1_epi32(kLanes);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < full; i += kLanes) {
    const VecF v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strictly: each lane keeps its first
    best = _mm512_mask_mov_ps(best, gt, v);
    best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  if (full < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - full)) - 1);
    const VecF v = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), tail, x + full);
    nan |= _mm512_mask_cmp_ps_mask(tail, v, v, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
  }
  if (nan)
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(x[i])) return i;
  const float m = _mm512_reduce_max_ps(best);
  // Among the lanes holding the maximum, the smallest index (lanes only ever hold -inf or values
  // seen, and an all -inf row has index 0 in lane 0).
  const __mmask16 at_max = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(at_max, best_i);
}

}  // namespace

// x [rows, n] float32 contiguous (n < 2^31) → int64 [rows]: torch.argmax(x, dim=-1).
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32 && x.size(1) > 0 &&
              x.size(1) < (int64_t(1) << 31), "argmax_rows: float32 [rows, n] contiguous");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows}, x.options().dtype(torch::kInt64));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=-1) for float32 [rows, n] (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally fused with the residual add (CPU)",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up (CPU)");
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("block_size"), py::arg("scale"), py::arg("in_q_dtype") = false);
  m.def("rotary_write_kv", &rotary_write_kv, "rotary embedding in place, fused with the KV-cache write (CPU)",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slot_mapping"), py::arg("num_heads"));
  m.def("rotary_write_kv_int8", &rotary_write_kv_int8, "rotary_write_kv into the int8 KV cache (CPU)",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k_t"), py::arg("k_scale"), py::arg("v"),
        py::arg("v_scale"), py::arg("slot_mapping"), py::arg("num_heads"));
  m.def("paged_decode_attention_int8", &paged_decode_attention_int8, "decode attention over the int8 KV cache (CPU)",
        py::arg("q"), py::arg("k_t"), py::arg("k_scale"), py::arg("v"), py::arg("v_scale"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("block_size"), py::arg("scale"), py::arg("in_q_dtype") = false);
  m.def("supports", &supports, "whether a (head_dim, group) pair has a kernel");
}
