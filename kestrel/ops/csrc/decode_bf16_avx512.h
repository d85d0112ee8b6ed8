// The AVX-512 build's own decode attention over a bf16 KV cache (decode_attention.cpp includes it under
// KESTREL_VEC_AVX512 only): a block-major walk with an online softmax, scores by AMX where present,
// else by an AVX-512 transpose-and-add tree; both lean on 16-lane permutes that have no 8-lane
// counterpart worth keeping (the AVX2 build reads a bf16 cache through the shared float kernel,
// widening each row as it loads it). Part of each kernel's build key.
#pragma once

#include "torch_api.h"
#include <ATen/Parallel.h>

#include <immintrin.h>

#include "amx.h"
#include "vec_avx512.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace kestrel_bf16_decode {

using namespace kestrel_vec;

// ---- bf16 KV cache: block-major walk, online softmax over chunks of up to 64 tokens ----
//
// Work is cut into segments of up to kSegmentBlocks blocks of one sequence (all its KV heads), in
// (sequence, segment) order, and each thread takes the segments that start in its equal share of the
// step's blocks, so a long sequence (or a batch of one) is split across threads. Where the segments
// fall depends on the sequence's length alone, never on the batch or the thread count: a sequence of
// several segments leaves partial results per (segment, KV head) (running max, sum, unnormalised
// output), merged after the parallel loop in segment order, so a row's attention is the same bits
// whatever else the step holds (batch invariance).
// A thread walks its share chunk by chunk (up to kChunkTiles tiles of 16 rows with AMX, kAvxChunkTiles
// without), and within a chunk KV head by KV head, so that a block's K and V rows of all heads are read close together, and it
// prefetches the next chunk's blocks whole (this pays when the cache is in DRAM: a decode step's
// cache is far larger than L3). With AMX each unit prefetches its share at once into L1; without,
// into L2, spread over the unit's tiles.
// Per (chunk, KV head): the scores of the G query heads, one online-softmax update, then the V
// rows. Scores: with AMX (a bf16 q, as in a bf16 model) C[16 rows][G] = K · q^T by tdpbf16ps
// (products of bf16 numbers are exact in float32, sums in float32), started one unit ahead so that
// they overlap the previous unit's V work; otherwise the 16 rows' lane-wise products, reduced
// together by a transpose-and-add tree into one vector of 16 scores: by vdpbf16ps on the bf16 q
// where the CPU has AVX512-BF16 (pairs of exact products summed in float32, then scaled), else in
// float32 on the scaled q.
// bf16 → float32 by the even/odd trick: a 32-bit lane of a 512-bit load of 32 bf16 holds two of
// them, << 16 gives the even one as a float32, & 0xFFFF0000 the odd one; q is split into matching
// even/odd vectors once, and the output is accumulated (in float32) in even/odd order, interleaved
// back at the end. The running max is raised only when a chunk's max exceeds it by kMaxSlack, so
// that the exponentials do not wait on it (exp(s - m) <= e^kMaxSlack, far from overflow).

constexpr int kChunkTiles = 4;
// Without AMX a chunk is one tile: the next chunk, prefetched whole, is then 12 KiB of K and V (at the
// default model's shape) instead of 48, and no longer evicts the chunk being read from L1.
constexpr int kAvxChunkTiles = 1;
constexpr float kMaxSlack = 8.f;

inline VecF bf16_even(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
inline VecF bf16_odd(__m512i x) { return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(0xFFFF0000))); }

constexpr int64_t kSegmentBlocks = 4;  // blocks of a sequence one thread walks in one piece
constexpr int kPrefetchChunks = 1;  // how far ahead (in chunks) whole blocks are prefetched
#if defined(__AVX512BF16__)
#define KESTREL_BF16_DOT 1  // vdpbf16ps: the scores of a bf16 q without widening K
#endif

template <int D, int G>
struct PairState {
  static constexpr int C2 = D / 32;
  VecF qe[G][C2], qo[G][C2];    // query heads of the pair, scaled: even and odd elements of each 32-chunk
#ifdef KESTREL_BF16_DOT
  __m512bh qb[G][C2];           // bf16 q: the query heads as they are, 32 elements per vector (unscaled)
#endif
  float scale;
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
template <int D, int G, bool FULL, bool DOT>
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
#ifdef KESTREL_BF16_DOT
          if constexpr (DOT) {
#pragma GCC unroll 8
            for (int j = 0; j < G; ++j) a[j][rr] = _mm512_dpbf16_ps(a[j][rr], (__m512bh)x, st.qb[j][c]);
            continue;
          }
#endif
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
    if constexpr (DOT) s[j] = _mm512_mul_ps(s[j], splat(st.scale));
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

template <int D, int G, bool DOT>
__attribute__((always_inline)) inline void chunk_avx(PairState<D, G>& st, const TileRef* tiles, int nt, int64_t stride,
                                                     const char* const* pf, int npf) {
  alignas(64) float p[G][kAvxChunkTiles * 16];
  const VecF ninf = splat(-std::numeric_limits<float>::infinity());
  VecF mx[G];
  for (int j = 0; j < G; ++j) mx[j] = ninf;
  for (int t = 0; t < nt; ++t) {
    VecF s[G];
    const int n = tiles[t].n;
    if (n == 16) {
      tile_scores<D, G, true, DOT>(st, tiles[t].k, stride, 16, s);
    } else {
      tile_scores<D, G, false, DOT>(st, tiles[t].k, stride, n, s);
      for (int j = 0; j < G; ++j) s[j] = _mm512_mask_mov_ps(ninf, (__mmask16)((1u << n) - 1), s[j]);
    }
    for (int j = 0; j < G; ++j) {
      store(p[j] + 16 * t, s[j]);
      mx[j] = _mm512_max_ps(mx[j], s[j]);
    }
    // The next chunk's lines, into L2, a share after each tile: a burst of them all at once
    // fills the miss queues and stalls this chunk's own loads.
    for (int i = npf * t / nt, e = npf * (t + 1) / nt; i < e; ++i) _mm_prefetch(pf[i], _MM_HINT_T1);
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
  chunk_pv<D, G, 16, 1, kAvxChunkTiles * 16>(st, tiles, nt, stride, &p[0][0]);
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
  } else {
    using kestrel_amx::kReg;
    const auto scores = [&](auto c, auto a0, auto a1) {  // C in tmm(c), A in tmm(a0) and tmm(a1)
      constexpr int C = decltype(c)::value, A0 = decltype(a0)::value, A1 = decltype(a1)::value;
      kestrel_amx::tile_zero<C>();
      kestrel_amx::tile_load<A0>(k, stride_bytes);
      kestrel_amx::tile_dot_bf16<C, A0, 4>();
      kestrel_amx::tile_load<A1>(k + 32, stride_bytes);
      kestrel_amx::tile_dot_bf16<C, A1, 5>();
      kestrel_amx::tile_store<C>(out, G * 4);
    };
    if constexpr (RS == 0) scores(kReg<0>, kReg<2>, kReg<3>);
    else scores(kReg<1>, kReg<6>, kReg<7>);
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

// Lanes of vector v of a tile's scores in [row][head] order that hold one of its `valid` (rows x G).
inline __mmask16 valid_lanes(int valid, int v) {
  return static_cast<__mmask16>((1u << std::min(16, std::max(0, valid - 16 * v))) - 1);
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
  for (int t = 0; t < nt; ++t)
    for (int v = 0; v < G; ++v) {
      const VecF s = _mm512_mask_mov_ps(ninf, valid_lanes(tiles[t].n * G, v), _mm512_mul_ps(load_f32(p[t] + 16 * v), splat(scale)));
      store(p[t] + 16 * v, s);
      mx[v] = _mm512_max_ps(mx[v], s);
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
  for (int t = 0; t < nt; ++t)
    for (int v = 0; v < G; ++v) {
      // exp(-inf - m) is not 0 after the clamp: lanes past the tile's rows are zeroed.
      const VecF e = _mm512_maskz_mov_ps(valid_lanes(tiles[t].n * G, v),
                                         exp_clamped(_mm512_sub_ps(load_f32(p[t] + 16 * v), m[v])));
      store(p[t] + 16 * v, e);
      lv[v] = _mm512_add_ps(lv[v], e);
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

// q [num_seqs, num_heads, D]: bf16 with AMX or DOT (vdpbf16ps scores), else float32 (see the top of this part).
template <int D, int G, bool AMX, bool DOT>
void run_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out,
              int64_t block_size, float scale, int64_t window) {
  constexpr int C2 = D / 32;
  constexpr int CT = AMX ? kChunkTiles : kAvxChunkTiles;  // tiles per chunk
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), kv_heads = k_cache.size(1);
  const int64_t max_blocks = block_tables.size(1), stride = kv_heads * D;  // elements between rows
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  const void* qp = q.data_ptr();
  float* op = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  // Sequence s reads keys [first_key, len): blocks from first_block[s] (a sliding window's first block,
  // else 0), from row first_key % block_size of that block. AMX tiles start at row 0: no window there.
  std::vector<int64_t> cum(num_seqs + 1, 0);  // units (blocks) before each sequence
  std::vector<int64_t> first_block(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = lens[s];
    first_block[s] = first_visible_key(len, window) / block_size;
    const int64_t keys = len - first_block[s] * block_size;
    cum[s + 1] = cum[s] + (len > 0 ? (keys + block_size - 1) / block_size : 0);
    if (len <= 0) std::memset(op + s * num_heads * D, 0, sizeof(float) * num_heads * D);
  }
  const int64_t total = cum[num_seqs];
  if (total == 0) return;
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total));
  std::vector<int64_t> seg_cum(num_seqs + 1, 0);  // segments before each sequence
  for (int64_t s = 0; s < num_seqs; ++s)
    seg_cum[s + 1] = seg_cum[s] + (cum[s + 1] - cum[s] + kSegmentBlocks - 1) / kSegmentBlocks;
  // One per (segment, KV head); used by the sequences of more than one segment.
  std::vector<Partial<D, G>> partials(seg_cum[num_seqs] * kv_heads);
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
    for (; s < num_seqs && cum[s] < hi; ++s) {
      const int64_t nb = cum[s + 1] - cum[s], nseg = seg_cum[s + 1] - seg_cum[s];
      for (int64_t seg = 0; seg < nseg; ++seg) {
        if (cum[s] + seg * kSegmentBlocks < lo || cum[s] + seg * kSegmentBlocks >= hi) continue;  // another thread's
        // Segment seg of sequence s: blocks [b0, b1) counted from its first block, whose keys are
        // counted from there too (len) and begin at row first_row.
        const int64_t b0 = seg * kSegmentBlocks, b1 = std::min(nb, b0 + kSegmentBlocks);
        const int64_t len = lens[s] - first_block[s] * block_size;
        const int64_t first_row = b0 == 0 ? first_visible_key(lens[s], window) % block_size : 0;
        const int64_t* table = tables + s * max_blocks + first_block[s];
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
          } else if constexpr (DOT) {
#ifdef KESTREL_BF16_DOT
            st.scale = scale;
            for (int j = 0; j < G; ++j) {
              const uint16_t* qb = static_cast<const uint16_t*>(qp) + (s * num_heads + h * G + j) * D;
              for (int c = 0; c < C2; ++c) st.qb[j][c] = (__m512bh)_mm512_loadu_si512(qb + 32 * c);
            }
#endif
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
          while (nt < CT && b < b1) {
            const int64_t off = table[b] * block_size * stride + o * stride;
            const int64_t ntok = std::min(block_size, len - b * block_size);
            if (o == 0 || (b == b0 && o == first_row)) blocks[nblk++] = table[b];
            tl[nt++] = {kp + off, vp + off, static_cast<int>(std::min<int64_t>(16, ntok - o))};
            o += 16;
            if (o >= ntok) { ++b; o = 0; }
          }
          return nt;
        };
        // Prefetch cursor kPrefetchChunks chunks ahead: each (chunk, head) unit prefetches a
        // kv_heads-th of the blocks of that chunk, all heads' rows (whole blocks, contiguous).
        int64_t pf_b = b0, pf_o = first_row, pf_blocks[CT];
        int pf_n = 0;
        TileRef scratch[CT];
        for (int d = 0; d <= kPrefetchChunks; ++d) next_chunk(scratch, pf_b, pf_o, pf_blocks, pf_n);
        std::vector<const char*> pf_list;  // without AMX: the lines chunk_avx prefetches as it goes
        auto prefetch_part = [&](int64_t h) {
          pf_list.clear();
          for (int i = 0; i < pf_n; ++i) {
            const char* kb = reinterpret_cast<const char*>(kp + pf_blocks[i] * block_size * stride);
            const char* vb = reinterpret_cast<const char*>(vp + pf_blocks[i] * block_size * stride);
            for (int64_t o = pf_from[h]; o < pf_from[h + 1]; o += 64) {
              if constexpr (AMX) {
                _mm_prefetch(kb + o, _MM_HINT_T0);
                _mm_prefetch(vb + o, _MM_HINT_T0);
              } else {
                pf_list.push_back(kb + o);
                pf_list.push_back(vb + o);
              }
            }
          }
          if (h == kv_heads - 1) next_chunk(scratch, pf_b, pf_o, pf_blocks, pf_n);
        };

        // Units (chunk, head) in order, two in flight: with AMX the next unit's scores are started
        // before this one's softmax and V rows.
        int64_t cb = b0, co = first_row, unused_blocks[CT];
        int unused_n;
        TileRef base[CT], tl[2][CT];
        int nbase = next_chunk(base, cb, co, unused_blocks, unused_n);
        auto head_tiles = [&](int64_t h, TileRef* dst) {
          for (int i = 0; i < nbase; ++i) dst[i] = {base[i].k + h * D, base[i].v + h * D, base[i].n};
          return nbase;
        };
        alignas(64) float pbuf[2][CT][16 * G];
#ifdef KESTREL_AMX
        auto start_scores = [&](const TileRef* tiles, int nt, int64_t h, float* p) {
          if constexpr (AMX) {   // (head_dim 64 or 128: bf16_decode takes no AMX for others)
            _tile_loadd(4, hs[h].qt[0], G * 4);
            _tile_loadd(5, hs[h].qt[1], G * 4);
            if constexpr (D == 128) {
              _tile_loadd(6, hs[h].qt[2], G * 4);
              _tile_loadd(7, hs[h].qt[3], G * 4);
            }
            amx_chunk_scores<D, G>(tiles, nt, stride, p);
          }
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
          if constexpr (!AMX) chunk_avx<D, G, DOT>(hs[uh].st, tl[cur], ntl[cur], stride, pf_list.data(), (int)pf_list.size());
          cur ^= 1;
          uh = nh;
        }

        const bool whole = nseg == 1;
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
            Partial<D, G>& part = partials[(seg_cum[s] + seg) * kv_heads + h];
            for (int j = 0; j < G; ++j) {
              part.m[j] = st.m[j];
              part.l[j] = lsum[j];
              for (int c = 0; c < C2; ++c)
                store_interleaved(part.acc[j] + 32 * c, load_f32(st.acc[j] + 32 * c), load_f32(st.acc[j] + 32 * c + 16),
                                  splat(1.f));
            }
          }
        }
      }
    }
#ifdef KESTREL_AMX
    if constexpr (AMX) _tile_release();
#endif
  };
  at::parallel_for(0, nthreads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) work(t);
  });
  // Merge the segments of each (sequence, KV head) of more than one, in segment order.
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t first = seg_cum[s], nseg = seg_cum[s + 1] - first;
    if (nseg < 2) continue;
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int j = 0; j < G; ++j) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t g = first; g < first + nseg; ++g) mx = std::max(mx, partials[g * kv_heads + h].m[j]);
        float sum = 0.f;
        float acc[D] = {};
        for (int64_t g = first; g < first + nseg; ++g) {
          const Partial<D, G>& part = partials[g * kv_heads + h];
          const float w = std::exp(part.m[j] - mx);
          sum += part.l[j] * w;
          for (int d = 0; d < D; ++d) acc[d] += part.acc[j][d] * w;
        }
        float* dst = op + (s * num_heads + h * G + j) * D;
        for (int d = 0; d < D; ++d) dst[d] = acc[d] / sum;
      }
  }
}


}  // namespace kestrel_bf16_decode
