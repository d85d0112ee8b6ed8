// Causal prefill attention of a chunk of queries over its keys: prefill_attention on the vector
// interface (float32 or bf16, any CPU with a build), and where the build has AVX512-BF16 the bf16
// kernels on AMX tiles (prefill_attention_amx) or AVX512-BF16 dot products (prefill_attention_avx512).
#include "float_tiles.h"
#include "kernels.h"

// ---- prefill attention ----
//
// prefill_attention(q [Lq, H, D], k and v [Lk, KV, D], scale) -> [Lq, H, D] in q's dtype, float32 or
// bf16 (any row and head strides, the last dim contiguous; D % 16 == 0, Lk >= Lq): causal attention of
// a chunk of queries over its keys, the queries being the last Lq (query i sits at position
// Lk - Lq + i and sees keys 0 .. Lk - Lq + i), query head h reading KV head h / (H / KV). The contract
// of prefill_attention_amx and prefill_attention_avx512 (below), for CPUs without AVX512-BF16 and for
// float32 models, where it runs faster than SDPA's CPU flash attention (on the AVX2 build, which
// takes it: kestrel.ops.prefill_attention_preferred). Its PyTorch reference is SDPA (kestrel/attention/torch_sdpa.py:
// prefill_attention), whose arithmetic it keeps: scores and sums in float32, the softmax in float32,
// and in a bf16 model the weights rounded to bf16 before they multiply V.
//
// Both products run on the bf16 linear layers' outer-product register tile (panel_tile). K is packed
// once per call as panels of 16 keys (each d a row of 16 keys, widened to float32) and V widened as it
// is. A work item is one KV head and a block of queries whose rows are (query, query head of the
// group) pairs, so that the G heads sharing K and V read them together. It walks its keys kKeyChunk
// at a time, up to its last query's position: the chunk's scores S = Q K^T, then each row's online
// softmax (running max and sum; the row's output rescaled when the max rises), then O += P V. A row's
// result depends on nothing but its own query, so any block or thread count gives the same output.

namespace {

constexpr int64_t kKeyChunk = 256;                   // keys per step: a block's scores stay in L1/L2
constexpr int64_t kAttentionRows = 4 * kPanelRows;   // rows per work item (24 on AVX2, 48 on AVX-512)

struct PrefillShape {
  int64_t lq, lk, heads, kv_heads, d, group;
  int64_t lk_pad;          // keys rounded up to whole panels
  int64_t block_queries;   // queries per work item
};

// A row of the model dtype as widen_transposed reads it (bf16 as its bits).
inline const uint16_t* raw(const c10::BFloat16* p) { return reinterpret_cast<const uint16_t*>(p); }
inline const float* raw(const float* p) { return p; }

// K of every KV head as panels of kPanelCols keys, kp [KV][lk_pad / 16][D][16], and V as vp
// [KV][lk_pad][D], both float32, keys past Lk zero.
template <typename T>
void pack_keys_and_values(const at::Tensor& k, const at::Tensor& v, const PrefillShape& s, float* kp,
                          float* vp) {
  const T* kd = k.data_ptr<T>();
  const T* vd = v.data_ptr<T>();
  const int64_t panels = s.lk_pad / kPanelCols, d = s.d;
  at::parallel_for(0, s.kv_heads * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / panels, n = (i % panels) * kPanelCols;
      const int keys = static_cast<int>(std::min<int64_t>(kPanelCols, s.lk - n));
      float* panel = kp + (h * panels + n / kPanelCols) * d * kPanelCols;
      widen_transposed(raw(kd + h * k.stride(1)), k.stride(0), n, keys, 0, d, panel);
      for (int64_t key = n; key < n + kPanelCols; ++key) {
        float* row = vp + (h * s.lk_pad + key) * d;
        const T* src = vd + key * v.stride(0) + h * v.stride(1);
        for (int64_t j = 0; j < d; j += kLanes) store(row + j, key < s.lk ? load_chunk(src + j) : zero());
      }
    }
  });
}

// One row's scores s[0:width) for a chunk of keys, of which the first `visible` may be seen (none
// where visible <= 0): s becomes the weights exp(s * scale - max), bf16-rounded where RoundP and zero
// past `visible`; the running max and sum of weights take the chunk in, and the row's output o [D]
// is rescaled by how far the max rose.
template <bool RoundP>
void softmax_chunk_row(float* s, int64_t width, int64_t visible, float scale, float& running_max, float& sum,
                       float* o, int64_t d) {
  const float inf = std::numeric_limits<float>::infinity();
  VecF top = splat(-inf);
  for (int64_t n = 0; n < visible; n += kLanes) {
    const VecF t = mul(load_f32(s + n), splat(scale));
    store(s + n, t);
    top = max(top, select(lanes_below(visible - n), t, splat(-inf)));
  }
  const float chunk_max = visible > 0 ? hmax(top) : -inf;
  if (chunk_max > running_max) {
    if (sum != 0.f) {
      const float rescale = std::exp(running_max - chunk_max);
      sum *= rescale;
      for (int64_t j = 0; j < d; j += kLanes) store(o + j, mul(load_f32(o + j), splat(rescale)));
    }
    running_max = chunk_max;
  }
  const VecF m = splat(running_max);
  VecF total = zero();
  for (int64_t n = 0; n < width; n += kLanes) {
    if (n >= visible) {
      store(s + n, zero());
      continue;
    }
    const VecF p = keep(lanes_below(visible - n), exp_clamped(sub(load_f32(s + n), m)));
    total = add(total, p);
    store(s + n, RoundP ? bf16_round_trip(p) : p);
  }
  sum += hsum(total);
}

// Work item (KV head h, block of queries): the block's rows of out.
template <typename T>
void attend_query_block(const at::Tensor& q, const PrefillShape& s, const float* kp, const float* vp, int64_t h,
                        int64_t block, float scale, T* out) {
  thread_local std::vector<float> q_buffer, s_buffer, o_buffer, stats_buffer;
  const int64_t d = s.d, g = s.group, q0 = block * s.block_queries;
  const int64_t queries = std::min(s.block_queries, s.lq - q0), rows = queries * g;
  float* qr = scratch(q_buffer, rows * d);
  float* sr = scratch(s_buffer, rows * kKeyChunk);
  float* o = scratch(o_buffer, rows * d);
  float* running_max = scratch(stats_buffer, 2 * rows);
  float* sum = running_max + rows;
  const T* qd = q.data_ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {  // row r: query q0 + r / g, head h g + r % g
    const T* src = qd + (q0 + r / g) * q.stride(0) + (h * g + r % g) * q.stride(1);
    for (int64_t j = 0; j < d; j += kLanes) {
      store(qr + r * d + j, load_chunk(src + j));
      store(o + r * d + j, zero());
    }
    running_max[r] = -std::numeric_limits<float>::infinity();
    sum[r] = 0.f;
  }
  const int64_t first_pos = s.lk - s.lq + q0, keys = first_pos + queries;
  const int64_t panels = s.lk_pad / kPanelCols;
  for (int64_t c0 = 0; c0 < keys; c0 += kKeyChunk) {
    const int64_t width = (std::min(kKeyChunk, keys - c0) + kPanelCols - 1) / kPanelCols * kPanelCols;
    for (int64_t n = 0; n < width; n += kPanelCols) {
      const float* panel = kp + (h * panels + (c0 + n) / kPanelCols) * d * kPanelCols;
      for (int64_t r = 0; r < rows; r += kPanelRows)
        panel_tile_rows(std::min<int64_t>(kPanelRows, rows - r), qr + r * d, d, panel, d, sr + r * kKeyChunk + n,
                        kKeyChunk, kPanelCols, false);
    }
    for (int64_t r = 0; r < rows; ++r)
      softmax_chunk_row<std::is_same_v<T, c10::BFloat16>>(sr + r * kKeyChunk, width,
                                                           std::min(width, first_pos + r / g + 1 - c0), scale,
                                                           running_max[r], sum[r], o + r * d, d);
    const float* values = vp + (h * s.lk_pad + c0) * d;
    for (int64_t j = 0; j < d; j += kPanelCols)
      for (int64_t r = 0; r < rows; r += kPanelRows)
        panel_tile_rows(std::min<int64_t>(kPanelRows, rows - r), sr + r * kKeyChunk, kKeyChunk, values + j, width,
                        o + r * d + j, d, kPanelCols, true, d);
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + ((q0 + r / g) * s.heads + h * g + r % g) * d;
    const VecF inv = splat(1.f / sum[r]);
    for (int64_t j = 0; j < d; j += kLanes) store_row_chunk(dst + j, mul(load_f32(o + r * d + j), inv));
  }
}

}  // namespace

at::Tensor prefill_attention(at::Tensor q, at::Tensor k, at::Tensor v, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && q.size(2) == k.size(2),
              "prefill_attention: q [Lq, H, D], k and v [Lk, KV, D]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "prefill_attention: q, k and v all float32 or all bfloat16");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "prefill_attention: head_dim must be contiguous");
  TORCH_CHECK(q.size(2) % kPanelCols == 0 && q.size(2) > 0, "prefill_attention: head_dim must be a multiple of ", kPanelCols);
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "prefill_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(k.size(0) >= q.size(0), "prefill_attention: fewer keys than queries");
  PrefillShape s{q.size(0), k.size(0), q.size(1), k.size(1), q.size(2), q.size(1) / k.size(1), 0, 0};
  s.lk_pad = (s.lk + kPanelCols - 1) / kPanelCols * kPanelCols;
  s.block_queries = std::max<int64_t>(1, kAttentionRows / s.group);
  auto out = at::empty({s.lq, s.heads, s.d}, q.options());
  if (s.lq == 0) return out;
  // Not zeroed: every float is written by the packing.
  auto kp = at::empty({s.kv_heads, s.lk_pad, s.d}, q.options().dtype(at::kFloat));
  auto vp = at::empty({s.kv_heads, s.lk_pad, s.d}, q.options().dtype(at::kFloat));
  const int64_t blocks = (s.lq + s.block_queries - 1) / s.block_queries;
  const auto keys_of = [&](int64_t item) { return s.lk - s.lq + std::min(s.lq, (item % blocks + 1) * s.block_queries); };
  with_float_dtype(q.scalar_type(), "prefill_attention", [&](auto tag) {
    using T = decltype(tag);
    pack_keys_and_values<T>(k, v, s, kp.data_ptr<float>(), vp.data_ptr<float>());
    kestrel_parallel::parallel_for_by_cost(s.kv_heads * blocks, keys_of, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        attend_query_block<T>(q, s, kp.data_ptr<float>(), vp.data_ptr<float>(), i / blocks, i % blocks,
                              static_cast<float>(scale), out.data_ptr<T>());
    });
  });
  return out;
}


#if defined(KESTREL_HAS_AVX512_BF16)
// Rows are finally divided by their sums of weights and transposed back.
#include "torch_api.h"
#include <ATen/Parallel.h>

#include <immintrin.h>

#include "amx.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if !(defined(__AVX512F__) && defined(__AVX512BF16__))
#error "this kernel needs AVX512-BF16; kestrel uses SDPA elsewhere"
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KESTREL_PREFILL_AMX 1
#endif

namespace {

#ifdef KESTREL_PREFILL_AMX
using kestrel_amx::TileConfig;
#endif
using kestrel_simd::round_to_bf16_bits;
using kestrel_simd::transpose16;

constexpr int kRows = 16;        // queries per block: a tile's rows
constexpr int kChunk = 32;       // keys per step: the K dimension of the P V product
constexpr int kMaxD = 256;
constexpr int kTileElems = 512;  // bf16 in one 16 x 64-byte tile
constexpr float kMaxSlack2 = 12.f;  // in log2 units: weights stay below 2^12

// K rows [Lk, D] (row stride in elements) → A tiles of K, [lk_pad / 16][D / 32][16 keys][32 of D]
// (a plain copy); keys past lk are zero.
void pack_k(const uint16_t* k, int64_t stride, int64_t lk, int64_t lk_pad, int d, uint16_t* out) {
  const int dt_n = d / 32;
  for (int64_t key = 0; key < lk_pad; ++key)
    for (int dt = 0; dt < dt_n; ++dt) {
      uint16_t* row = out + ((key / 16) * dt_n + dt) * kTileElems + (key % 16) * 32;
      _mm512_store_si512(row, key < lk ? _mm512_loadu_si512(k + key * stride + dt * 32) : _mm512_setzero_si512());
    }
}

// V rows [Lk, D] → A tiles of V^T, [D / 16][lk_pad / 32][16 of D][32 keys]; keys past lk are zero.
// Built as 16 x 16 matrices of key pairs (row j: lanes d hold V[2j][d] | V[2j+1][d] << 16), transposed.
void pack_vt(const uint16_t* v, int64_t stride, int64_t lk, int64_t lk_pad, int d, uint16_t* out) {
  const int64_t chunks = lk_pad / kChunk;
  auto row16 = [&](int64_t key, int db) {
    return key < lk ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + key * stride + db * 16)))
                    : _mm512_setzero_si512();
  };
  for (int db = 0; db < d / 16; ++db)
    for (int64_t c = 0; c < chunks; ++c) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) {
        const int64_t key = c * kChunk + 2 * j;
        r[j] = _mm512_or_si512(row16(key, db), _mm512_slli_epi32(row16(key + 1, db), 16));
      }
      transpose16(r);
      uint16_t* tile = out + (db * chunks + c) * kTileElems;
      for (int i = 0; i < 16; ++i) _mm512_store_si512(tile + i * 32, r[i]);
    }
}

// One block's state, kept transposed (lane q of a vector is query row q of the block): Q^T as B
// tiles, the unnormalised O^T [D][16], and per row the running max and sum.
struct alignas(64) Block {
  uint16_t qt[kMaxD / 32][kTileElems];  // [D / 32][16 pairs of D][16 rows][2]
  float ot[kMaxD * kRows];              // O^T: [d][row]
  float st[kChunk * kRows];             // this chunk's raw scores S^T: [key][row]
  uint32_t pt[kChunk / 2 * kRows];      // this chunk's weights P^T as a B tile: [key pair][row], bf16 pairs
  __m512 m, l;                          // per row: running max x scale x log2(e) (within kMaxSlack2), sum of weights
  __m512i last;                         // per row: the last visible key (-1: a padding row)
};

// Q rows → Q^T B tiles (pairs along D), rows past `rows` zero.
void load_q(Block& b, const uint16_t* q, int64_t q_stride, int rows, int d) {
  for (int dt = 0; dt < d / 32; ++dt) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = i < rows ? _mm512_loadu_si512(q + i * q_stride + dt * 32) : _mm512_setzero_si512();
    transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_store_si512(b.qt[dt] + p * 32, r[p]);
  }
}

#ifdef KESTREL_PREFILL_AMX
// S^T = K Q^T for chunk c into b.st: two C tiles (keys 0-15, 16-31), K as A tiles (tmm4/tmm5), Q^T
// as B tiles (tmm2/tmm3 by the parity of the D step).
void scores_chunk(Block& b, const uint16_t* kt, int64_t c, int d) {
  const int dt_n = d / 32;
  _tile_zero(0);
  _tile_zero(1);
  for (int dt = 0; dt < dt_n; ++dt) {
    _tile_loadd(4, kt + ((2 * c) * dt_n + dt) * kTileElems, 64);
    _tile_loadd(5, kt + ((2 * c + 1) * dt_n + dt) * kTileElems, 64);
    if (dt % 2 == 0) {
      _tile_loadd(2, b.qt[dt], 64);
      _tile_dpbf16ps(0, 4, 2);
      _tile_dpbf16ps(1, 5, 2);
    } else {
      _tile_loadd(3, b.qt[dt], 64);
      _tile_dpbf16ps(0, 4, 3);
      _tile_dpbf16ps(1, 5, 3);
    }
  }
  _tile_stored(0, b.st, 64);
  _tile_stored(1, b.st + 16 * kRows, 64);
}
#endif

// C += A B as tdpbf16ps computes it, C's 16 rows in vectors: A a tile of 16 rows x 16 bf16 pairs,
// B a tile of 16 pairs x 16 columns (a vector each). Row m of A, pair k, broadcast to every lane.
inline void dot_tile(__m512 (&c)[16], const uint16_t* a, const uint16_t* b) {
  for (int k = 0; k < 16; ++k) {
    const __m512bh bk = (__m512bh)_mm512_loadu_si512(b + 32 * k);
#pragma GCC unroll 16
    for (int m = 0; m < 16; ++m) {
      uint32_t pair;
      std::memcpy(&pair, a + 32 * m + 2 * k, sizeof(pair));
      c[m] = _mm512_dpbf16_ps(c[m], bk, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)));
    }
  }
}

// scores_chunk without AMX: the same K and Q^T tiles through dot_tile.
void scores_chunk_dot(Block& b, const uint16_t* kt, int64_t c, int d) {
  const int dt_n = d / 32;
  for (int half = 0; half < 2; ++half) {
    __m512 acc[16];
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (int dt = 0; dt < dt_n; ++dt) dot_tile(acc, kt + ((2 * c + half) * dt_n + dt) * kTileElems, b.qt[dt]);
    for (int m = 0; m < 16; ++m) _mm512_store_ps(b.st + (16 * half + m) * kRows, acc[m]);
  }
}

// 2^x for x <= kMaxSlack2, to the accuracy the weights keep (they are rounded to bf16): 2^n * 2^f,
// f in [-0.5, 0.5], 2^f by a degree-4 Taylor polynomial (relative error < 5e-5, bf16's half-ulp is
// 2e-3). No clamp: a large negative x gives 0 through the scalef; -inf and NaN lanes are masked by
// the caller.
inline __m512 exp2_for_bf16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(0.0096181291f);                // ln2^4 / 24
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0555041087f));  // ln2^3 / 6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265070f));  // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471806f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Lane q: (bf16(lo[q]), bf16(hi[q])) as one 32-bit pair, rounded to nearest even.
inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
}

// Scores of chunk c → weights P^T in b.pt (bf16 pairs), updating b.m, b.l and rescaling b.ot where
// a row's max rises. Key j of the chunk is visible to row q when c * kChunk + j <= last[q]. Maxes
// are kept in the exponent's domain, raw score x scale x log2(e), so that each weight costs one FMA
// before the exponential.
void softmax_chunk(Block& b, int64_t c, int d, float scale) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 k = _mm512_set1_ps(scale * 1.44269504088896341f);
  // Whole chunk visible to every row (the usual case, off the diagonal): no masks.
  const bool all_visible = _mm512_cmpge_epi32_mask(b.last, _mm512_set1_epi32(static_cast<int32_t>(c * kChunk + kChunk - 1))) == 0xFFFF;
  __mmask16 vis[kChunk];
  __m512 s[kChunk];
  __m512 cmax0 = ninf, cmax1 = ninf;
  for (int j = 0; j < kChunk; j += 2) {
    s[j] = _mm512_load_ps(b.st + j * kRows);
    s[j + 1] = _mm512_load_ps(b.st + (j + 1) * kRows);
    if (!all_visible) {
      vis[j] = _mm512_cmpge_epi32_mask(b.last, _mm512_set1_epi32(static_cast<int32_t>(c * kChunk + j)));
      vis[j + 1] = _mm512_cmpge_epi32_mask(b.last, _mm512_set1_epi32(static_cast<int32_t>(c * kChunk + j + 1)));
      s[j] = _mm512_mask_mov_ps(ninf, vis[j], s[j]);
      s[j + 1] = _mm512_mask_mov_ps(ninf, vis[j + 1], s[j + 1]);
    }
    cmax0 = _mm512_max_ps(cmax0, s[j]);
    cmax1 = _mm512_max_ps(cmax1, s[j + 1]);
  }
  const __m512 cmax = _mm512_mul_ps(_mm512_max_ps(cmax0, cmax1), k);
  // Rows whose chunk max exceeds their running max by the slack: always on a row's first chunk.
  const __mmask16 raise = _mm512_cmp_ps_mask(cmax, _mm512_add_ps(b.m, _mm512_set1_ps(kMaxSlack2)), _CMP_GT_OQ);
  if (__builtin_expect(raise != 0, 0)) {
    // alpha = 2^(m_old - m_new), 0 where m_old = -inf.
    const __mmask16 had = _mm512_cmp_ps_mask(b.m, ninf, _CMP_NEQ_OQ);
    const __m512 alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.f), raise,
                                            _mm512_maskz_mov_ps(had, exp2_for_bf16(_mm512_sub_ps(b.m, cmax))));
    b.m = _mm512_mask_mov_ps(b.m, raise, cmax);
    b.l = _mm512_mul_ps(b.l, alpha);
    for (int i = 0; i < d; ++i) _mm512_store_ps(b.ot + i * kRows, _mm512_mul_ps(_mm512_load_ps(b.ot + i * kRows), alpha));
  }
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  for (int j = 0; j < kChunk; j += 2) {
    __m512 e0 = exp2_for_bf16(_mm512_fmsub_ps(s[j], k, b.m));
    __m512 e1 = exp2_for_bf16(_mm512_fmsub_ps(s[j + 1], k, b.m));
    if (!all_visible) {  // -inf - m gives NaN: invisible lanes are zeroed
      e0 = _mm512_maskz_mov_ps(vis[j], e0);
      e1 = _mm512_maskz_mov_ps(vis[j + 1], e1);
    }
    sum0 = _mm512_add_ps(sum0, e0);
    sum1 = _mm512_add_ps(sum1, e1);
    _mm512_store_si512(b.pt + (j / 2) * kRows, bf16_pairs(e0, e1));
  }
  b.l = _mm512_add_ps(b.l, _mm512_add_ps(sum0, sum1));
}

#ifdef KESTREL_PREFILL_AMX
// O^T += V^T P^T for chunk c: each 16-row slice of V^T (tmm4/tmm5) times P^T (tmm6), accumulated
// in C tiles (tmm0/tmm1) loaded from and stored back to b.ot.
void pv_chunk(Block& b, const uint16_t* vt, int64_t c, int64_t chunks, int d) {
  _tile_loadd(6, b.pt, 64);
  for (int db = 0; db < d / 16; ++db) {
    const uint16_t* vtile = vt + (db * chunks + c) * kTileElems;
    float* o = b.ot + db * 16 * kRows;
    if (db % 2 == 0) {
      _tile_loadd(0, o, 64);
      _tile_loadd(4, vtile, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_stored(0, o, 64);
    } else {
      _tile_loadd(1, o, 64);
      _tile_loadd(5, vtile, 64);
      _tile_dpbf16ps(1, 5, 6);
      _tile_stored(1, o, 64);
    }
  }
}
#endif

// pv_chunk without AMX: the same V^T and P^T tiles through dot_tile, 16 rows of O^T at a time.
void pv_chunk_dot(Block& b, const uint16_t* vt, int64_t c, int64_t chunks, int d) {
  for (int db = 0; db < d / 16; ++db) {
    float* o = b.ot + db * 16 * kRows;
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_load_ps(o + i * kRows);
    dot_tile(acc, vt + (db * chunks + c) * kTileElems, reinterpret_cast<const uint16_t*>(b.pt));
    for (int i = 0; i < 16; ++i) _mm512_store_ps(o + i * kRows, acc[i]);
  }
}

// The two products of a chunk on the path the caller runs: AMX tiles, or dot_tile.
template <bool AMX>
inline void scores(Block& b, const uint16_t* kt, int64_t c, int d) {
#ifdef KESTREL_PREFILL_AMX
  if constexpr (AMX) return scores_chunk(b, kt, c, d);
#endif
  scores_chunk_dot(b, kt, c, d);
}
template <bool AMX>
inline void pv(Block& b, const uint16_t* vt, int64_t c, int64_t chunks, int d) {
#ifdef KESTREL_PREFILL_AMX
  if constexpr (AMX) return pv_chunk(b, vt, c, chunks, d);
#endif
  pv_chunk_dot(b, vt, c, chunks, d);
}

// One block of `rows` queries (positions first_pos..) of one head, over that head's packed K/V^T.
template <bool AMX>
void attend_block(Block& b, const uint16_t* kt, const uint16_t* vt, int64_t chunks_all, const uint16_t* q,
                  int64_t q_stride, int rows, int64_t first_pos, int64_t lk, int d, float scale, uint16_t* out,
                  int64_t out_stride) {
  load_q(b, q, q_stride, rows, d);
  std::memset(b.ot, 0, sizeof(float) * kRows * d);
  b.m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  b.l = _mm512_setzero_ps();
  const __m512i row = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  b.last = _mm512_mask_min_epi32(_mm512_set1_epi32(-1), _mm512_cmplt_epi32_mask(row, _mm512_set1_epi32(rows)),
                                 _mm512_add_epi32(row, _mm512_set1_epi32(static_cast<int32_t>(first_pos))),
                                 _mm512_set1_epi32(static_cast<int32_t>(lk - 1)));
  const int64_t chunks = std::min(first_pos + rows - 1, lk - 1) / kChunk + 1;
  for (int64_t c = 0; c < chunks; ++c) {
    scores<AMX>(b, kt, c, d);
    softmax_chunk(b, c, d, scale);
    pv<AMX>(b, vt, c, chunks_all, d);
  }
  // O^T / l, back to rows: 16 x 16 transposes.
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), b.l);
  for (int db = 0; db < d / 16; ++db) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i)
      r[i] = round_to_bf16_bits(_mm512_mul_ps(_mm512_load_ps(b.ot + (db * 16 + i) * kRows), inv));
    transpose16(r);
    for (int q = 0; q < rows; ++q)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + q * out_stride + db * 16), _mm512_cvtepi32_epi16(r[q]));
  }
}

#ifdef KESTREL_PREFILL_AMX
TileConfig tile_config() {
  TileConfig cfg;
  for (int i = 0; i < 7; ++i) {  // every tile used is 16 rows of 64 bytes
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  return cfg;
}
#endif

// Whether the AMX path is built and this CPU and process may use it.
bool amx_usable() {
#ifdef KESTREL_PREFILL_AMX
  return kestrel_amx::amx_usable();
#else
  return false;
#endif
}

}  // namespace

namespace {

// Causal attention of q [Lq, H, D] over k, v [Lk, KV, D] (bf16, last dim contiguous, Lk >= Lq, the
// queries being the last Lq positions) → bf16 [Lq, H, D] contiguous. D % 32 == 0, D <= 256.
template <bool AMX>
at::Tensor prefill_attention_bf16(at::Tensor q, at::Tensor k, at::Tensor v, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes(), "prefill_attention: bad ranks or K/V shapes");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
              v.scalar_type() == at::kBFloat16, "prefill_attention: bfloat16 only");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "prefill_attention: the last dim must be contiguous");
  const int64_t lq = q.size(0), heads = q.size(1), d = q.size(2), lk = k.size(0), kv_heads = k.size(1);
  TORCH_CHECK(k.size(2) == d && d % 32 == 0 && d <= kMaxD, "prefill_attention: head_dim must be a multiple of 32, at most 256");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "prefill_attention: heads must be a multiple of KV heads");
  TORCH_CHECK(lq >= 1 && lk >= lq, "prefill_attention: need 1 <= Lq <= Lk");
  auto out = at::empty({lq, heads, d}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t group = heads / kv_heads, lk_pad = (lk + kChunk - 1) / kChunk * kChunk, per_head = lk_pad * d;
  auto kt = at::empty({kv_heads, per_head}, k.options());
  auto vt = at::empty({kv_heads, per_head}, v.options());
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr());
  auto* ktp = reinterpret_cast<uint16_t*>(kt.data_ptr());
  auto* vtp = reinterpret_cast<uint16_t*>(vt.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, 2 * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / 2;
      if (i % 2 == 0) pack_k(kp + h * k.stride(1), k.stride(0), lk, lk_pad, d, ktp + h * per_head);
      else pack_vt(vp + h * v.stride(1), v.stride(0), lk, lk_pad, d, vtp + h * per_head);
    }
  });

  // Work items (query block, head), heads fastest so that neighbouring items share K/V in cache;
  // each thread takes a contiguous run of about equal cost (chunks walked), as causal blocks grow.
  const int64_t blocks = (lq + kRows - 1) / kRows, first_pos0 = lk - lq, items = blocks * heads;
  std::vector<int64_t> cost_before(items + 1, 0);
  for (int64_t i = 0; i < items; ++i) {
    const int64_t qb = i / heads, rows = std::min<int64_t>(kRows, lq - qb * kRows);
    cost_before[i + 1] = cost_before[i] + 1 + (first_pos0 + qb * kRows + rows - 1) / kChunk + 1;
  }
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, nthreads, 1, [&](int64_t tb, int64_t te) {
#ifdef KESTREL_PREFILL_AMX
    static const TileConfig cfg = tile_config();
    if constexpr (AMX) _tile_loadconfig(&cfg);
#endif
    auto block = std::make_unique<Block>();
    for (int64_t t = tb; t < te; ++t) {
      const int64_t lo = std::lower_bound(cost_before.begin(), cost_before.end(), cost_before[items] * t / nthreads) - cost_before.begin();
      const int64_t hi = std::lower_bound(cost_before.begin(), cost_before.end(), cost_before[items] * (t + 1) / nthreads) - cost_before.begin();
      for (int64_t i = lo; i < std::min(hi, items); ++i) {
        const int64_t qb = i / heads, h = i % heads, kvh = h / group;
        const int rows = static_cast<int>(std::min<int64_t>(kRows, lq - qb * kRows));
        attend_block<AMX>(*block, ktp + kvh * per_head, vtp + kvh * per_head, lk_pad / kChunk, qp + qb * kRows * q.stride(0) + h * q.stride(1),
                     q.stride(0), rows, first_pos0 + qb * kRows, lk, static_cast<int>(d), sc,
                     op + (qb * kRows * heads + h) * d, heads * d);
      }
    }
#ifdef KESTREL_PREFILL_AMX
    if constexpr (AMX) _tile_release();
#endif
  });
  return out;
}

}  // namespace


at::Tensor prefill_attention_avx512(at::Tensor q, at::Tensor k, at::Tensor v, double scale) {
  return prefill_attention_bf16<false>(q, k, v, scale);
}

bool prefill_amx_usable() { return amx_usable(); }

#if defined(KESTREL_PREFILL_AMX)
at::Tensor prefill_attention_amx(at::Tensor q, at::Tensor k, at::Tensor v, double scale) {
  TORCH_CHECK(amx_usable(), "prefill_attention_amx: AMX is not usable in this process");
  return prefill_attention_bf16<true>(q, k, v, scale);
}
#else
at::Tensor prefill_attention_amx(at::Tensor, at::Tensor, at::Tensor, double) {
  TORCH_CHECK(false, "prefill_attention_amx: built without AMX");
}
#endif
#endif  // KESTREL_HAS_AVX512_BF16
