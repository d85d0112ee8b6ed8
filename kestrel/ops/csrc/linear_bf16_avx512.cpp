// bf16 products on bf16 instructions: linear_bf16_avx512 (AVX512-BF16 dot products, any rows on
// packed weights) and, where the build has AMX, linear_bf16_amx and linear_int8_amx on AMX tiles.
// Built where the compiler targets AVX512-BF16 (the AVX-512 build on such a CPU); empty elsewhere.
#include "isa.h"
#if defined(KESTREL_HAS_AVX512_BF16)
// Kestrel CPU kernels: bf16 linear layers for small batches (decode), where the library GEMM reads
// the weights at a fraction of memory bandwidth.
//
// linear_bf16_avx512(x [M, K], w [N, K]) -> y [M, N], M <= 128, K % 32 == 0 (AVX512-BF16, for CPUs
// without AMX); y bf16, or float32 as summed (the output head's logits). Up to 15 rows: dot products along
// K of blocks of rows of x and of w, each 64-byte piece of a weight row loaded once per block of x rows;
// from 16 rows: x repacked into pairs along K, 16 rows to a vector, against broadcast pairs of w (see
// below for both).
//
// linear_bf16_amx(x [M, K], w [N, K]) -> y [M, N], M <= 128, K % 32 == 0, N % 16 == 0 (AMX-BF16);
// y bf16, or float32 as summed (the output head: logits are never rounded to bf16).
// The weights, unpacked, are the A operand: 16 of their rows by 32 of K make one tile, loaded
// straight from w. x is the B operand, repacked once per call into the VNNI pair layout; the
// result tiles are y transposed, turned back on the way out. Tile loads wait out cache misses, so
// the next rows of w are prefetched while the current ones compute.
//
// linear_int8_amx(x [M, K] bf16, qweight [N, K] int8, wscale [N] float32) -> y [M, N] bf16, any M,
// K % 64 == 0, N % 16 == 0 (AMX-INT8; --quantization int8). Each row of x is rotated by the
// orthonormal Hadamard transform on every block of 64 values (qweight holds weights rotated the same
// way, so the product is unchanged) and quantized to int8 with its own scale (max / 127); the products
// run as int8 quads summed exactly into int32, then y[m, n] = (acc * wscale[n]) * xscale[m], rounded
// once to bf16. Same tiles and loops as the bf16 path.
//
// The bf16 kernels accumulate in float32 throughout and round each output once to bf16 (to nearest even), as
// torch rounds a float32 result; only the order of the float32 sums differs from torch's.
#include "torch_api.h"
#include "kernels.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include "amx.h"
#include "matmul_fn.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {


// ---- linear_bf16_avx512: AVX512-BF16 products of 1..128 rows, without AMX -------------------------
//
// Blocks of MB rows of x by R rows of w, MB * R = 16 float32 accumulators (dot products along K, 16
// lanes each), reduced by one fixed tree into the 16 results. Every output is one row of x against one
// row of w summed in the same order whatever the block it falls in (tails run the same tree with zero
// accumulators), so a row's result does not depend on the other rows of the batch. The weight block
// (R rows) stays in L1 while every block of x streams past it from L2.

// Sums of 16 accumulators: lane i of the result is the sum of the lanes of a[i], by the same tree for
// every i (pairs of lanes two apart, then pairs of 64-bit halves, then 128-bit quarters).
inline __m512 reduce16(const __m512 a[16]) {
  __m512 s[8], t[4], u[2];
  for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(s[2 * i]), _mm512_castps_pd(s[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(s[2 * i]), _mm512_castps_pd(s[2 * i + 1]));
    t[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  for (int i = 0; i < 2; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
}

// Where the results go: y[m, n] rounded to bf16, or the float32 sum as it is (the output head's logits).
template <typename Out>
struct DpSink {
  Out* y;
  int64_t N;
  // `sums` lane mi * R + r is y[m0 + mi, n0 + r]; mb rows and r_valid columns of the block are real.
  template <int R>
  void store(__m512 sums, int64_t m0, int mb, int64_t n0, int r_valid) const {
    alignas(64) uint32_t bits[16];
    if constexpr (std::is_same_v<Out, float>) _mm512_store_ps(reinterpret_cast<float*>(bits), sums);
    else _mm512_store_si512(bits, kestrel_simd::round_to_bf16_bits(sums));
    for (int mi = 0; mi < mb; ++mi)
      for (int r = 0; r < r_valid; ++r) {
        const uint32_t b = bits[mi * R + r];
        Out* out = y + (m0 + mi) * N + n0 + r;
        if constexpr (std::is_same_v<Out, float>) std::memcpy(out, &b, 4);
        else *out = static_cast<uint16_t>(b);
      }
  }
};

// Into L2, as asm so that the compiler keeps it.
inline void prefetch_l2(const uint16_t* p) { asm volatile("prefetcht1 (%0)" : : "r"(p)); }

// 64 bytes of a weight row. Stream: a non-temporal load (vmovntdqa; the weights 64-byte aligned). A
// decode step reads every weight once, ~270 MB a token for the default model in bf16: by ordinary
// loads each line passes through L2 (and L3) and pushes out what the engine's Python, the API server
// and the client use between two steps. With one or two rows, where each thread reads its weights as
// one sequential stream, non-temporal loads read as fast as ordinary ones and leave the caches to the
// rest of the step. With more rows the 4 x 4 blocks read four weight rows side by side, and four
// non-temporal streams are slower than ordinary loads: those keep ordinary loads and the prefetch.
// (On Intel, vmovntdqa from write-back memory is an ordinary load.)
template <bool Stream>
inline __m512bh load_weights(const uint16_t* p) {
  if constexpr (Stream) return (__m512bh)_mm512_stream_load_si512(const_cast<uint16_t*>(p));
  else return (__m512bh)_mm512_loadu_si512(p);
}

inline bool line_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 64 == 0; }

// One block: rows m0.. (mb of them, mb <= MB) of x against rows n0.. (r_valid <= R) of w.
//
// With one or two rows of x, the R weight rows are read one after another, each along K to its end:
// the block lies in one piece in memory, so a thread reads its share of w as one sequential stream,
// by non-temporal loads (load_weights), or where w is not aligned for them fetched kStreamAheadBytes
// ahead into L2: one stream reads faster than R strided ones (64 bytes of each of the R rows in turn),
// however the next block is prefetched. With more rows of x, that order reloads each piece of x once
// per weight row, and the loads then limit it, so there each 64-byte piece of the R rows is loaded
// once for all MB rows of x, and the next block is fetched while this one computes (the hardware
// prefetcher alone does not keep the stream at the memory's rate). Either way each sum runs
// over K in the same order, so the two orders give the same results.
constexpr int64_t kStreamAheadBytes = 2048;

template <int MB, int R, bool Stream, typename Sink>
inline void dp_block(const uint16_t* x, const uint16_t* w, int64_t K, int64_t m0, int mb, int64_t n0,
                     int r_valid, const uint16_t* next, const Sink& sink) {
  static_assert(MB * R == 16 && (MB <= 2 || !Stream));
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const uint16_t* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = w + (n0 + std::min(r, r_valid - 1)) * K;  // past N: repeat a row, unstored
  const uint16_t* xr[MB];
  for (int mi = 0; mi < MB; ++mi) xr[mi] = x + (m0 + std::min(mi, mb - 1)) * K;
  if constexpr (MB <= 2) {
    for (int r = 0; r < R; ++r)
      for (int64_t k = 0; k < K; k += 32) {
        const __m512bh wv = load_weights<Stream>(wr[r] + k);
        if constexpr (!Stream) prefetch_l2(wr[r] + k + kStreamAheadBytes / 2);
        for (int mi = 0; mi < MB; ++mi)
          acc[mi * R + r] = _mm512_dpbf16_ps(acc[mi * R + r], wv, (__m512bh)_mm512_loadu_si512(xr[mi] + k));
      }
  } else {
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh wv[R];
      for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(wr[r] + k);
      if (next != nullptr)
        for (int r = 0; r < R; ++r) prefetch_l2(next + r * K + k);
      for (int mi = 0; mi < MB; ++mi) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr[mi] + k);
        for (int r = 0; r < R; ++r) acc[mi * R + r] = _mm512_dpbf16_ps(acc[mi * R + r], wv[r], xv);
      }
    }
  }
  sink.template store<R>(reduce16(acc), m0, mb, n0, r_valid);
}

// All rows of x against weight rows [n_begin, n_end), R at a time.
template <int MB, int R, bool Stream, typename Sink>
void dp_rows(const uint16_t* x, const uint16_t* w, int64_t M, int64_t K, int64_t n_begin, int64_t n_end,
             const Sink& sink) {
  for (int64_t n0 = n_begin; n0 < n_end; n0 += R) {
    const int r_valid = static_cast<int>(std::min<int64_t>(R, n_end - n0));
    // The next block's rows, where it has R of them (fetched along with the first block of x).
    const uint16_t* next = n0 + 2 * R <= n_end ? w + (n0 + R) * K : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += MB)
      dp_block<MB, R, Stream>(x, w, K, m0, static_cast<int>(std::min<int64_t>(MB, M - m0)), n0, r_valid,
                      m0 == 0 ? next : nullptr, sink);
  }
}

// Weight rows [n_begin, n_end) for 1..15 rows of x, on the calling thread.
template <bool Stream, typename Sink>
void dp_share_as(const uint16_t* x, const uint16_t* w, int64_t M, int64_t K, int64_t n_begin, int64_t n_end,
                 const Sink& sink) {
  if (M == 1) dp_rows<1, 16, Stream>(x, w, M, K, n_begin, n_end, sink);
  else if (M == 2) dp_rows<2, 8, Stream>(x, w, M, K, n_begin, n_end, sink);
  else dp_rows<4, 4, false>(x, w, M, K, n_begin, n_end, sink);
}

// One or two rows stream the weights past the cache where they are aligned for it (K is a multiple of
// 32, so every row is aligned when w is): the same products either way.
template <typename Sink>
void dp_share(const uint16_t* x, const uint16_t* w, int64_t M, int64_t K, int64_t n_begin, int64_t n_end,
              const Sink& sink) {
  if (line_aligned(w)) dp_share_as<true>(x, w, M, K, n_begin, n_end, sink);
  else dp_share_as<false>(x, w, M, K, n_begin, n_end, sink);
}

// One x row: 16 weight rows a block; two: 8; more: 4 by 4.
template <typename Sink>
void dp_run(const uint16_t* x, const uint16_t* w, int64_t M, int64_t N, int64_t K, const Sink& sink) {
  // Tasks of whole blocks of 16 weight rows, so that a block never straddles two threads.
  at::parallel_for(0, (N + 15) / 16, 8, [&](int64_t begin, int64_t end) {
    dp_share(x, w, M, K, begin * 16, std::min(N, end * 16), sink);
  });
}

// ---- linear_bf16_avx512 from 16 rows: the rows of x in the lanes ----------------------------------
//
// x is repacked once per call into pairs along K ([K/2][Mp] dwords, Mp = M rounded up to 16, rows past M
// zero), so that one vector holds one pair of K for 16 rows; each pair of a weight row is broadcast
// from w as it is stored. An accumulator is then 16 rows of one output column, summed over K one pair
// at a time: no horizontal sum, and 12-24 accumulators per block keep the dot-product unit busy. Every
// output is the sum of its row's pairs in K order whatever the batch, so from 16 rows up a row's result
// does not depend on the other rows either (it does differ in the last bits from the 1-15 row path's).
constexpr int kLaneRowsMin = 16;  // fewer rows: most lanes would be empty (dp_run)
constexpr int64_t kUnit = 48;     // output columns per task (every block width R below divides it)
constexpr int kGroupRows = 64;    // rows of x per pass over a task's weight rows (at most 4 vectors)

// x [M, K] → xp [K/2][Mp] dwords (the pair k, k + 1 of row m at xp[k / 2 * Mp + m]).
void pack_x_pairs(const uint16_t* x, int64_t M, int64_t K, int64_t Mp, uint32_t* xp) {
  for (int64_t m0 = 0; m0 < Mp; m0 += 16)
    for (int64_t k = 0; k < K; k += 32) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = m0 + i < M ? _mm512_loadu_si512(x + (m0 + i) * K + k) : _mm512_setzero_si512();
      kestrel_simd::transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_store_si512(xp + (k / 2 + j) * Mp + m0, r[j]);
    }
}

// MV vectors of rows (from `xp`, Mp apart per pair) against R weight rows from `w` (r_valid of them
// real; past them the last is repeated); column r's sums go to ct[r * kGroupRows ...]. `next`: the
// weight rows to fetch into L2 meanwhile (R of them, a line of each per 16 pairs), or nullptr.
template <int MV, int R>
inline void lanes_block(const uint32_t* xp, int64_t Mp, const uint32_t* w, int64_t K2, int r_valid,
                        const uint32_t* next, float* ct) {
  __m512 acc[MV * R];
  for (int i = 0; i < MV * R; ++i) acc[i] = _mm512_setzero_ps();
  const uint32_t* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = w + std::min(r, r_valid - 1) * K2;
  for (int64_t p0 = 0; p0 < K2; p0 += 16) {
    if (next != nullptr)
      for (int r = 0; r < R; ++r) prefetch_l2(reinterpret_cast<const uint16_t*>(next + r * K2 + p0));
    for (int64_t p = p0; p < p0 + 16; ++p) {
      __m512bh xv[MV];
      for (int v = 0; v < MV; ++v) xv[v] = (__m512bh)_mm512_load_si512(xp + p * Mp + 16 * v);
      for (int r = 0; r < R; ++r) {
        const __m512bh wb = (__m512bh)_mm512_set1_epi32(static_cast<int>(wr[r][p]));
        for (int v = 0; v < MV; ++v) acc[v * R + r] = _mm512_dpbf16_ps(acc[v * R + r], xv[v], wb);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < MV; ++v) _mm512_store_ps(ct + r * kGroupRows + 16 * v, acc[v * R + r]);
}

// Columns [0, cols) of a task (weight rows from w); `rows_after`: the weight rows after them, to prefetch.
template <int MV, int R>
void lanes_columns(const uint32_t* xp, int64_t Mp, const uint32_t* w, int64_t K2, int64_t cols,
                   int64_t rows_after, float* ct) {
  static_assert(kUnit % R == 0);
  for (int64_t c = 0; c < cols; c += R) {
    const uint32_t* next = c + R + R <= cols + rows_after ? w + (c + R) * K2 : nullptr;
    lanes_block<MV, R>(xp, Mp, w + c * K2, K2, static_cast<int>(std::min<int64_t>(R, cols - c)), next,
                       ct + c * kGroupRows);
  }
}

// ct [cols][kGroupRows] (y transposed) → y rows m0 .. m0 + rows, columns n0 .. n0 + cols, rounded to bf16
// (or float32 as summed).
template <typename Out>
void store_transposed(const float* ct, int64_t rows, int64_t cols, Out* y, int64_t N, int64_t m0, int64_t n0) {
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(16, cols - c)) - 1);
    for (int64_t v = 0; v * 16 < rows; ++v) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(ct + (c + i) * kGroupRows + 16 * v);
      kestrel_simd::transpose16(r);
      for (int j = 0; j < 16 && v * 16 + j < rows; ++j) {
        Out* out = y + (m0 + v * 16 + j) * N + n0 + c;
        if constexpr (std::is_same_v<Out, float>) {
          _mm512_mask_storeu_epi32(out, valid, r[j]);
        } else {
          const __m512i bits = kestrel_simd::round_to_bf16_bits(_mm512_castsi512_ps(r[j]));
          _mm256_mask_storeu_epi16(out, valid, _mm512_cvtepi32_epi16(bits));
        }
      }
    }
  }
}

template <typename Out>
void lanes_run(const uint16_t* x, const uint16_t* w, int64_t M, int64_t N, int64_t K, Out* y) {
  const int64_t Mp = (M + 15) / 16 * 16, K2 = K / 2;
  thread_local std::vector<uint32_t> buffer;  // kept and grown: an allocation per call costs as much as a small product
  if ((int64_t)buffer.size() < K2 * Mp + 16) buffer.resize(K2 * Mp + 16);
  uint32_t* xp = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t(63));
  pack_x_pairs(x, M, K, Mp, xp);
  const auto* w32 = reinterpret_cast<const uint32_t*>(w);
  at::parallel_for(0, (N + kUnit - 1) / kUnit, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float ct[kUnit * kGroupRows];
    for (int64_t u = begin; u < end; ++u) {
      const int64_t n0 = u * kUnit, cols = std::min(kUnit, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kGroupRows) {
        const int64_t rows = std::min<int64_t>(kGroupRows, M - m0);
        const uint32_t* xg = xp + m0;
        const uint32_t* wu = w32 + n0 * K2;
        // The next task's weights are fetched during this one's last pass over its own.
        const int64_t after = m0 + kGroupRows >= M ? std::min(kUnit, N - n0 - cols) : 0;
        // One vector: 12 weight rows, not 24 (24 row pointers spill out of the registers).
        switch ((rows + 15) / 16) {
          case 1: lanes_columns<1, 12>(xg, Mp, wu, K2, cols, after, ct); break;
          case 2: lanes_columns<2, 12>(xg, Mp, wu, K2, cols, after, ct); break;
          case 3: lanes_columns<3, 8>(xg, Mp, wu, K2, cols, after, ct); break;
          default: lanes_columns<4, 6>(xg, Mp, wu, K2, cols, after, ct); break;
        }
        store_transposed(ct, rows, cols, y, N, m0, n0);
      }
    }
  });
}

// ---- linear_bf16_avx512 on packed weights: one order for every row count --------------------------
//
// A model's layers and output head are packed once after loading (dispatch.pack_bf16_weight, the AVX2
// build's layout: [N / 16, K, 16], k-row by k-row, columns j and j + 8 side by side). Every output is
// then its row's pairs along K summed one pair at a time in K order into one float32 lane by vdpbf16ps,
// at 1 row as at 1000: the order of the rows-in-lanes path above, so the same bits as that path gives
// from 16 rows, and a row's result never depends on how many rows share its product (batch invariance:
// a prompt's rows in one chunk or several, a decode row alone or among 64). The lanes hold 16 output
// columns: a 64-byte load is two k-rows of a panel, one vpermw puts each column's pair in its dword (in
// column order), and each row of x broadcasts its pair. Tiles of MR rows (up to 6) by P panels (up to
// 4): 24 accumulators, 4 weight vectors and x's pair.
constexpr int kPackedPanel = 16;
constexpr int kPackedTileRows = 6;
constexpr int kPackedTilePanels = 4;

// vpermw's index: word 2c from position p(c) of the first k-row, word 2c + 1 from the second's, p(c) =
// 2 (c % 8) + c / 8 the place pack_bf16_weight gives column c.
inline __m512i packed_pair_index() {
  alignas(64) uint16_t idx[32];
  for (int c = 0; c < 16; ++c) {
    const int p = 2 * (c % 8) + c / 8;
    idx[2 * c] = static_cast<uint16_t>(p);
    idx[2 * c + 1] = static_cast<uint16_t>(16 + p);
  }
  return _mm512_load_si512(idx);
}

// y[m0 .. m0 + MR, 16 (p0 .. p0 + P)) for panels from `w` (each K * 16 values).
template <int MR, int P, typename Out>
inline void packed_tile(const uint16_t* x, const uint16_t* w, int64_t K, int64_t m0, int64_t p0, Out* y,
                        int64_t N, __m512i index) {
  __m512 acc[MR][P];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < P; ++p) acc[m][p] = _mm512_setzero_ps();
  const uint16_t* panel[P];
  for (int p = 0; p < P; ++p) panel[p] = w + (p0 + p) * K * kPackedPanel;
  const uint32_t* xr[MR];
  for (int m = 0; m < MR; ++m) xr[m] = reinterpret_cast<const uint32_t*>(x + (m0 + m) * K);
  for (int64_t k = 0; k < K; k += 2) {
    __m512bh wv[P];
    for (int p = 0; p < P; ++p) {
      const uint16_t* at = panel[p] + k * kPackedPanel;
      if (k % 32 == 0) prefetch_l2(at + kStreamAheadBytes / 2);
      wv[p] = (__m512bh)_mm512_permutexvar_epi16(index, _mm512_loadu_si512(at));
    }
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[m][k / 2]));
      for (int p = 0; p < P; ++p) acc[m][p] = _mm512_dpbf16_ps(acc[m][p], xv, wv[p]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < P; ++p) {
      Out* out = y + (m0 + m) * N + (p0 + p) * kPackedPanel;
      if constexpr (std::is_same_v<Out, float>) {
        _mm512_storeu_ps(out, acc[m][p]);
      } else {
        const __m512i bits = kestrel_simd::round_to_bf16_bits(acc[m][p]);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(bits));
      }
    }
}

template <int P, int MR = kPackedTileRows, typename Out>
inline void packed_tile_rows(int rows, const uint16_t* x, const uint16_t* w, int64_t K, int64_t m0, int64_t p0,
                             Out* y, int64_t N, __m512i index) {
  if constexpr (MR > 1) {
    if (rows < MR) return packed_tile_rows<P, MR - 1>(rows, x, w, K, m0, p0, y, N, index);
  }
  packed_tile<MR, P>(x, w, K, m0, p0, y, N, index);
}

// Panels [pb, pe) for all M rows of x, on the calling thread: a group of P panels at a time, every block
// of rows down it (the group, 4 x 16 columns x K, stays in L2).
template <typename Out>
void packed_panels(const uint16_t* x, const uint16_t* w, int64_t M, int64_t K, int64_t pb, int64_t pe, Out* y,
                   int64_t N) {
  const __m512i index = packed_pair_index();
  int64_t p = pb;
  const auto rows_down = [&](auto Pc) {
    constexpr int P = decltype(Pc)::value;
    for (int64_t m = 0; m < M; m += kPackedTileRows)
      packed_tile_rows<P>(static_cast<int>(std::min<int64_t>(kPackedTileRows, M - m)), x, w, K, m, p, y, N, index);
    p += P;
  };
  while (p + kPackedTilePanels <= pe) rows_down(std::integral_constant<int, kPackedTilePanels>{});
  while (p < pe) rows_down(std::integral_constant<int, 1>{});
}

template <typename Out>
void packed_run(const uint16_t* x, const uint16_t* w, int64_t M, int64_t N, int64_t K, Out* y) {
  const int64_t panels = N / kPackedPanel;
  at::parallel_for(0, (panels + kPackedTilePanels - 1) / kPackedTilePanels, 1, [&](int64_t begin, int64_t end) {
    packed_panels(x, w, M, K, begin * kPackedTilePanels, std::min(panels, end * kPackedTilePanels), y, N);
  });
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#define KESTREL_AMX 1

using kestrel_amx::amx_usable;
using kestrel_amx::TileConfig;
using kestrel_amx::kReg;
using kestrel_amx::tile_load;
using kestrel_simd::round_to_bf16_bits;
using kestrel_simd::transpose16;

// A prefetch the compiler must keep: GCC deletes a loop of _mm_prefetch calls as a loop without
// side effects. Into L2 (prefetcht2), not L1: prefetcht0 fills L1 ahead of the tiles still being
// read from it.
inline void prefetch_line(const char* p) { asm volatile("prefetcht2 (%0)" : : "r"(p)); }

// The two kinds of product: bf16 pairs summed into float32, or int8 quads summed into int32. Either
// way a tile row is 64 bytes of K, and a packed x tile is 16 rows of 16 dwords (1 KiB). (GCC's tile
// intrinsics paste their register numbers into the instruction text, so a template parameter cannot
// name one; the instruction is written here with the numbers as immediates.)
struct Bf16Tiles {
  using Elem = uint16_t;
  static constexpr int64_t kStep = 32;  // K per tile step
  template <int C, int A, int B> static void dot() {
    kestrel_amx::tile_dot_bf16<C, A, B>();
  }
};
struct Int8Tiles {
  using Elem = int8_t;
  static constexpr int64_t kStep = 64;
  template <int C, int A, int B> static void dot() {
    asm volatile("tdpbssd %%tmm%c2, %%tmm%c1, %%tmm%c0" : : "i"(C), "i"(A), "i"(B));
  }
};
constexpr int64_t kTileBytes = 1024;

// x [M, K] bf16 → B tiles: [mb][kt][16 pairs][16 rows of x][2], rows past M zero.
void pack_x(const uint16_t* x, int64_t M, int64_t K, char* xb) {
  const int64_t KT = K / 32, MB = (M + 15) / 16;
  for (int64_t mb = 0; mb < MB; ++mb)
    for (int64_t kt = 0; kt < KT; ++kt) {
      __m512i r[16];
      for (int m = 0; m < 16; ++m) {
        const int64_t row = mb * 16 + m;
        r[m] = row < M ? _mm512_loadu_si512(x + row * K + kt * 32) : _mm512_setzero_si512();
      }
      transpose16(r);
      char* tile = xb + (mb * KT + kt) * kTileBytes;
      for (int p = 0; p < 16; ++p) _mm512_store_si512(tile + p * 64, r[p]);
    }
}

inline __m512 bf16_to_float(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// One step of the Walsh-Hadamard butterfly inside a register: lanes i and i + h (bit h of i clear)
// become (v[i] + v[i + h], v[i] - v[i + h]). `partner` holds each lane's v[i ^ h].
inline __m512 butterfly(__m512 v, __m512 partner, __mmask16 upper) {
  return _mm512_mask_blend_ps(upper, _mm512_add_ps(v, partner), _mm512_sub_ps(partner, v));
}

// The Walsh-Hadamard transform of 64 values in four registers, scaled by 1/8 (orthonormal): stages
// h = 1, 2, 4, 8 inside each register, then 16 and 32 across them, in that order (the float sums must
// follow kestrel/model/quantization.py's hadamard64 exactly).
inline void hadamard64(__m512 v[4]) {
  for (int i = 0; i < 4; ++i) {
    v[i] = butterfly(v[i], _mm512_permute_ps(v[i], 0xB1), 0xAAAA);                  // h = 1
    v[i] = butterfly(v[i], _mm512_permute_ps(v[i], 0x4E), 0xCCCC);                  // h = 2
    v[i] = butterfly(v[i], _mm512_shuffle_f32x4(v[i], v[i], 0xB1), 0xF0F0);        // h = 4
    v[i] = butterfly(v[i], _mm512_shuffle_f32x4(v[i], v[i], 0x4E), 0xFF00);        // h = 8
  }
  for (int h = 1; h <= 2; h *= 2)                                                   // h = 16, 32
    for (int i = 0; i < 4; ++i)
      if (!(i & h)) {
        const __m512 a = v[i], b = v[i + h];
        v[i] = _mm512_add_ps(a, b);
        v[i + h] = _mm512_sub_ps(a, b);
      }
  for (int i = 0; i < 4; ++i) v[i] = _mm512_mul_ps(v[i], _mm512_set1_ps(0.125f));
}

// One row of x, rotated by the Hadamard transform on each block of 64 (spreading an outlier over its
// block) and quantized: q = round_even(r * (127 / max|r|)), scale = max|r| / 127 (0 for a zero row).
// `rotated` is room for the K rotated values.
inline float quantize_row(const uint16_t* x, int64_t K, int8_t* q, float* rotated) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 64) {
    __m512 v[4];
    for (int i = 0; i < 4; ++i) v[i] = bf16_to_float(x + k + 16 * i);
    hadamard64(v);
    for (int i = 0; i < 4; ++i) {
      _mm512_storeu_ps(rotated + k + 16 * i, v[i]);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
    }
  }
  const float absmax = _mm512_reduce_max_ps(amax);
  const __m512 inv = _mm512_set1_ps(absmax > 0.f ? 127.f / absmax : 0.f);
  for (int64_t k = 0; k < K; k += 16)
    _mm_storeu_si128((__m128i*)(q + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(rotated + k), inv))));
  return absmax / 127.f;
}

// x [M, K] bf16 → rotated, per-row int8 quantization, packed as B tiles [mb][kt][16 quads][16 rows][4], rows
// past M zero; xscale[m] the scale of row m.
void quantize_pack_x(const uint16_t* x, int64_t M, int64_t K, char* xb, float* xscale) {
  const int64_t KT = K / 64, MB = (M + 15) / 16;
  at::parallel_for(0, MB, 4, [&](int64_t begin, int64_t end) {
    std::vector<int8_t> rows(16 * K);
    std::vector<float> rotated(K);
    for (int64_t mb = begin; mb < end; ++mb) {
      for (int m = 0; m < 16; ++m) {
        const int64_t row = mb * 16 + m;
        if (row < M) xscale[row] = quantize_row(x + row * K, K, rows.data() + m * K, rotated.data());
        else std::memset(rows.data() + m * K, 0, K);
      }
      for (int64_t kt = 0; kt < KT; ++kt) {
        __m512i r[16];
        for (int m = 0; m < 16; ++m) r[m] = _mm512_loadu_si512(rows.data() + m * K + kt * 64);
        transpose16(r);
        char* tile = xb + (mb * KT + kt) * kTileBytes;
        for (int p = 0; p < 16; ++p) _mm512_store_si512(tile + p * 64, r[p]);
      }
    }
  });
}

// Where the C tiles go. Each takes one tile, C^T [16 n][16 m] as stored, for x rows m0 .. m0 + rows
// and weight rows n0 .. n0 + 15, and writes y[m, n] rounded to bf16 (to nearest even), or as float32
// sums (logits).
template <typename Y>
struct FloatSink {
  Y* y;
  int64_t N;
  void operator()(const uint32_t* buf, int rows, int64_t m0, int64_t n0) const {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(buf + i * 16);
    transpose16(r);
    for (int m = 0; m < rows; ++m) {
      Y* out = y + (m0 + m) * N + n0;
      if constexpr (std::is_same_v<Y, float>) {
        _mm512_storeu_si512(out, r[m]);
      } else {
        const __m512i bits = round_to_bf16_bits(_mm512_castsi512_ps(r[m]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(bits));
      }
    }
  }
};

// int8 products: y[m, n] = (float(acc) * wscale[n]) * xscale[m], in that order, then bf16.
struct ScaledSink {
  uint16_t* y;
  int64_t N;
  const float* wscale;
  const float* xscale;
  void operator()(const uint32_t* buf, int rows, int64_t m0, int64_t n0) const {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(buf + i * 16);
    transpose16(r);
    const __m512 ws = _mm512_loadu_ps(wscale + n0);
    for (int m = 0; m < rows; ++m) {
      const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(r[m]), ws), _mm512_set1_ps(xscale[m0 + m]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + m) * N + n0),
                          _mm512_cvtepi32_epi16(round_to_bf16_bits(v)));
    }
  }
};

// Prefetches `lines` cache lines from p, spread evenly over the K steps of a block.
struct Prefetch {
  const char* p;
  int64_t lines, per_step;
  Prefetch(const char* p_, int64_t lines_, int64_t steps) : p(p_), lines(lines_), per_step((lines_ + steps - 1) / steps) {}
  void step(int64_t kt) const {
    for (int64_t i = kt * per_step; i < std::min(lines, (kt + 1) * per_step); ++i) prefetch_line(p + i * 64);
  }
};

// The K steps of a block: even and odd steps alternate between two sets of tile registers.
template <typename Even, typename Odd>
inline void k_steps(int64_t KT, Even even, Odd odd) {
  int64_t kt = 0;
  for (; kt + 2 <= KT; kt += 2) {
    even(kt);
    odd(kt + 1);
  }
  if (kt < KT) even(kt);
}

// The C tiles tmm0 .. tmm(MB - 1) (y^T for x blocks mb .. mb + MB - 1, weight block nb) into the sink.
template <int MB, typename Sink>
inline void store_c_tiles(int64_t M, int64_t mb, int64_t nb, const Sink& sink) {
  alignas(64) uint32_t buf[MB][256];
  _tile_stored(0, buf[0], 64);
  if constexpr (MB > 1) _tile_stored(1, buf[1], 64);
  if constexpr (MB > 2) _tile_stored(2, buf[2], 64);
  if constexpr (MB > 3) _tile_stored(3, buf[3], 64);
  for (int m = 0; m < MB; ++m)
    sink(buf[m], (int)std::min<int64_t>(16, M - (mb + m) * 16), (mb + m) * 16, nb * 16);
}

// What every block reads: the weights (16 rows of K each), the packed x tiles and their shape.
template <typename T>
struct Operands {
  const typename T::Elem* w;
  const char* xb;
  int64_t M, N, K;
  int64_t steps() const { return K / T::kStep; }
  int64_t row_bytes() const { return K * (int64_t)sizeof(typename T::Elem); }
  const typename T::Elem* w_block(int64_t nb) const { return w + nb * 16 * K; }
  const char* x_block(int64_t mb) const { return xb + mb * steps() * kTileBytes; }
};

// One block of 16 weight rows against MB (1 or 2) blocks of 16 x rows, over all of K. A tile load
// into a register must wait until the products reading it are done (tiles are not renamed), so
// successive steps of K alternate between two sets of A and B registers: C(m) in tmm(m), A in
// tmm2 / tmm3, B(m) in tmm(4 + m) / tmm(6 + m). (The tile intrinsics take literal register numbers.)
template <typename T, int MB, typename Sink>
inline void tile_block(const Operands<T>& op, int64_t nb, int64_t mb, const Sink& sink, const Prefetch& pf) {
  static_assert(MB == 1 || MB == 2, "one or two blocks of x rows");
  const auto* wn = op.w_block(nb);
  const char* x0 = op.x_block(mb);
  const char* x1 = op.x_block(mb + 1);
  const int64_t stride = op.row_bytes();
  // One K step with the weights in tmm(A) and x block m's tile in tmm(B + m).
  auto step = [&](int64_t kt, auto a, auto b) {
    constexpr int A = decltype(a)::value, B = decltype(b)::value;
    pf.step(kt);
    tile_load<A>(wn + kt * T::kStep, stride);
    tile_load<B>(x0 + kt * kTileBytes, 64);
    if constexpr (MB == 2) tile_load<B + 1>(x1 + kt * kTileBytes, 64);
    T::template dot<0, A, B>();
    if constexpr (MB == 2) T::template dot<1, A, B + 1>();
  };
  auto even = [&](int64_t kt) { step(kt, kReg<2>, kReg<4>); };
  auto odd = [&](int64_t kt) { step(kt, kReg<3>, kReg<6>); };
  _tile_zero(0);
  if constexpr (MB == 2) _tile_zero(1);
  k_steps(op.steps(), even, odd);
  store_c_tiles<MB>(op.M, mb, nb, sink);
}

// One block of 16 weight rows against MB (3 or 4) blocks of 16 x rows in one pass: C(m) in tmm(m),
// A in tmm4 / tmm5 by turns over K, B alternating between tmm6 and tmm7 over the x blocks.
template <typename T, int MB, typename Sink>
inline void tile_block_wide(const Operands<T>& op, int64_t nb, int64_t mb, const Sink& sink, const Prefetch& pf) {
  static_assert(MB == 3 || MB == 4, "three or four blocks of x rows");
  const auto* wn = op.w_block(nb);
  const char* x0 = op.x_block(mb);
  const int64_t KT = op.steps(), stride = op.row_bytes();
  auto x_tile = [&](int m, int64_t kt) { return x0 + (m * KT + kt) * kTileBytes; };
  // One K step with the weights in tmm(A), x tiles in tmm6 / tmm7 by turns.
  auto step = [&](int64_t kt, auto a) {
    constexpr int A = decltype(a)::value;
    pf.step(kt);
    tile_load<A>(wn + kt * T::kStep, stride);
    tile_load<6>(x_tile(0, kt), 64);  T::template dot<0, A, 6>();
    tile_load<7>(x_tile(1, kt), 64);  T::template dot<1, A, 7>();
    tile_load<6>(x_tile(2, kt), 64);  T::template dot<2, A, 6>();
    if constexpr (MB == 4) { tile_load<7>(x_tile(3, kt), 64); T::template dot<3, A, 7>(); }
  };
  auto even = [&](int64_t kt) { step(kt, kReg<4>); };
  auto odd = [&](int64_t kt) { step(kt, kReg<5>); };
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  if constexpr (MB == 4) _tile_zero(3);
  k_steps(KT, even, odd);
  store_c_tiles<MB>(op.M, mb, nb, sink);
}

// Two blocks of 16 weight rows (nb, nb + 1) against two blocks of x rows (mb, mb + 1): C(w, m) in
// tmm(2 w + m), A in tmm4 / tmm5, B in tmm6 / tmm7. Each x tile feeds two products, where the wide
// blocks above reload every x tile (from L2) for each block of weight rows.
template <typename T, typename Sink>
inline void tile_block_pair(const Operands<T>& op, int64_t nb, int64_t mb, const Sink& sink, const Prefetch& pf) {
  const auto* w0 = op.w_block(nb);
  const auto* w1 = op.w_block(nb + 1);
  const char* x0 = op.x_block(mb);
  const char* x1 = op.x_block(mb + 1);
  const int64_t stride = op.row_bytes(), KT = op.steps();  // once: the tile asm may read memory, so
  _tile_zero(0);                                              // op.K would be reloaded (and divided)
  _tile_zero(1);                                              // at every step
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kt = 0; kt < KT; ++kt) {
    pf.step(kt);
    _tile_loadd(4, w0 + kt * T::kStep, stride);
    _tile_loadd(6, x0 + kt * kTileBytes, 64);
    T::template dot<0, 4, 6>();
    _tile_loadd(7, x1 + kt * kTileBytes, 64);
    T::template dot<1, 4, 7>();
    _tile_loadd(5, w1 + kt * T::kStep, stride);
    T::template dot<2, 5, 6>();
    T::template dot<3, 5, 7>();
  }
  alignas(64) uint32_t buf[4][256];
  _tile_stored(0, buf[0], 64);
  _tile_stored(1, buf[1], 64);
  _tile_stored(2, buf[2], 64);
  _tile_stored(3, buf[3], 64);
  for (int wb = 0; wb < 2; ++wb)
    for (int m = 0; m < 2; ++m)
      sink(buf[2 * wb + m], (int)std::min<int64_t>(16, op.M - (mb + m) * 16), (mb + m) * 16, (nb + wb) * 16);
}

// The next `blocks` weight blocks after nb, prefetched in equal shares over `passes` passes.
template <typename T>
struct NextWeights {
  const char* p;
  int64_t lines, per_pass, steps;
  NextWeights(const Operands<T>& op, int64_t nb, int64_t blocks, int64_t passes)
      : p(reinterpret_cast<const char*>(op.w_block(nb + blocks))),
        lines(nb + blocks < op.N / 16 ? blocks * 16 * op.row_bytes() / 64 : 0),
        per_pass((lines + passes - 1) / passes), steps(op.steps()) {}
  Prefetch pass(int64_t i) const {
    return Prefetch(p + i * per_pass * 64, std::max<int64_t>(0, std::min(per_pass, lines - i * per_pass)), steps);
  }
};

// All x rows (an even number of 16-row blocks) against weight rows [16 nb, 16 nb + 32), two x blocks
// a pass; the next pair's weight rows are prefetched over the passes.
template <typename T, typename Sink>
inline void n_block_pair(const Operands<T>& op, int64_t nb, const Sink& sink) {
  const int64_t passes = (op.M + 15) / 16 / 2;
  const NextWeights<T> next(op, nb, 2, passes);
  for (int64_t p = 0; p < passes; ++p) tile_block_pair(op, nb, 2 * p, sink, next.pass(p));
}

// All x rows against weight rows [16 nb, 16 nb + 16), in passes of up to four blocks of x rows;
// the next block's weight rows are prefetched over the passes (tile loads wait out each cache miss).
template <typename T, typename Sink>
inline void n_block(const Operands<T>& op, int64_t nb, const Sink& sink) {
  const int64_t MBS = (op.M + 15) / 16;
  const NextWeights<T> next(op, nb, 1, (MBS + 3) / 4);
  for (int64_t mb = 0, p = 0; mb < MBS; ++p) {
    const Prefetch pf = next.pass(p);
    const int64_t left = MBS - mb;
    if (left >= 4) { tile_block_wide<T, 4>(op, nb, mb, sink, pf); mb += 4; }
    else if (left == 3) { tile_block_wide<T, 3>(op, nb, mb, sink, pf); mb += 3; }
    else if (left == 2) { tile_block<T, 2>(op, nb, mb, sink, pf); mb += 2; }
    else { tile_block<T, 1>(op, nb, mb, sink, pf); mb += 1; }
  }
}

// Pairs of weight blocks against pairs of x blocks where both counts are even (each x tile then feeds
// two products; with an odd x block left over, pairs do not pay), else one weight block against up to
// four x blocks.
template <typename T, typename Sink>
void run(const Operands<T>& op, const Sink& sink) {
  const bool pairs = ((op.M + 15) / 16) % 2 == 0 && (op.N / 16) % 2 == 0;
  at::parallel_for(0, pairs ? op.N / 32 : op.N / 16, 1, [&](int64_t begin, int64_t end) {
    TileConfig cfg;
    for (int i = 0; i < 8; ++i) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }
    _tile_loadconfig(&cfg);
    for (int64_t i = begin; i < end; ++i) {
      if (pairs) n_block_pair(op, 2 * i, sink);
      else n_block(op, i, sink);
    }
    _tile_release();
  });
}

// Room for the packed x tiles of M rows (and, for int8, their scales), aligned to 64 bytes: one buffer
// per calling thread, kept and grown, because an allocation per call costs as much as a small product.
struct PackedX {
  char* data;
  float* scales;
  PackedX(int64_t M, int64_t K_bytes) {
    thread_local std::vector<char> buffer;
    const int64_t tiles = (M + 15) / 16 * 16 * K_bytes, need = tiles + M * (int64_t)sizeof(float) + 64;
    if ((int64_t)buffer.size() < need) buffer.resize(need);
    data = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t(63));
    scales = reinterpret_cast<float*>(data + tiles);
  }
};

#endif  // AMX

}  // namespace

// x [M, K] against w packed as [N / 16, K, 16] (any M).
at::Tensor linear_bf16_avx512_packed(const at::Tensor& x_in, const at::Tensor& w, bool float_out) {
  TORCH_CHECK(w.size(2) == kPackedPanel && w.is_contiguous(), "a packed weight is [N / 16, K, 16], contiguous");
  TORCH_CHECK(x_in.size(1) == w.size(1), "x and w disagree on K");
  TORCH_CHECK(x_in.size(1) % 2 == 0, "K must be even");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), N = w.size(0) * kPackedPanel, K = x.size(1);
  auto y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  if (float_out) packed_run(xp, wp, M, N, K, y.data_ptr<float>());
  else packed_run(xp, wp, M, N, K, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  return y;
}

at::Tensor linear_bf16_avx512(at::Tensor x, at::Tensor w, bool float_out) {
  TORCH_CHECK(x.dim() == 2 && (w.dim() == 2 || w.dim() == 3), "x must be 2-D, w 2-D (or packed, 3-D)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 only");
  if (w.dim() == 3) return linear_bf16_avx512_packed(x, w, float_out);
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x and w must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.size(1) == w.size(1), "x and w disagree on K");
  TORCH_CHECK(x.size(1) % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 128, "M must be 1..128");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  if (M >= kLaneRowsMin) {
    if (float_out) lanes_run(xp, wp, M, N, K, y.data_ptr<float>());
    else lanes_run(xp, wp, M, N, K, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  } else if (float_out) {
    dp_run(xp, wp, M, N, K, DpSink<float>{y.data_ptr<float>(), N});
  } else {
    dp_run(xp, wp, M, N, K, DpSink<uint16_t>{reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), N});
  }
  return y;
}

#if KESTREL_AMX
at::Tensor linear_bf16_amx(at::Tensor x, at::Tensor w, bool float_out) {
  TORCH_CHECK(amx_usable(), "this CPU or kernel does not allow AMX");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x and w must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.size(1) == w.size(1), "x and w disagree on K");
  TORCH_CHECK(x.size(1) % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(w.size(0) % 16 == 0, "N must be a multiple of 16");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 128, "M must be 1..128");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  PackedX xb(M, K * 2);
  pack_x(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, xb.data);
  const Operands<Bf16Tiles> op{reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), xb.data, M, N, K};
  if (float_out) run(op, FloatSink<float>{y.data_ptr<float>(), N});
  else run(op, FloatSink<uint16_t>{reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), N});
  return y;
}

at::Tensor linear_int8_amx(at::Tensor x, at::Tensor qweight, at::Tensor wscale) {
  TORCH_CHECK(amx_usable(), "this CPU or kernel does not allow AMX");
  check_int8_linear_operands(x, qweight, wscale, "linear_int8_amx");
  TORCH_CHECK(x.size(1) % 64 == 0, "K must be a multiple of 64");
  TORCH_CHECK(qweight.size(0) % 16 == 0, "N must be a multiple of 16");
  TORCH_CHECK(x.size(0) >= 1, "x has no rows");
  x = x.contiguous();
  const int64_t M = x.size(0), N = qweight.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options());
  PackedX xb(M, K);
  quantize_pack_x(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, xb.data, xb.scales);
  const Operands<Int8Tiles> op{qweight.data_ptr<int8_t>(), xb.data, M, N, K};
  run(op, ScaledSink{reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), N, wscale.data_ptr<float>(),
                     xb.scales});
  return y;
}

bool linear_amx_usable() { return amx_usable(); }

#else
at::Tensor linear_bf16_amx(at::Tensor, at::Tensor, bool) { TORCH_CHECK(false, "built without AMX"); }
at::Tensor linear_int8_amx(at::Tensor, at::Tensor, at::Tensor) { TORCH_CHECK(false, "built without AMX"); }
bool linear_amx_usable() { return false; }
#endif

// linear_bf16_avx512's share for one thread (matmul_fn.h's MatmulSliceFn): its 1..15-row path, whose
// blocks of 16 weight rows give every output the same sum whichever thread computes it.
void linear_bf16_avx512_slice_plain(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t M, int64_t N, int64_t K,
                         int64_t n_begin, int64_t n_end) {
  static_assert(kestrel_matmul::kSliceMaxRows == kLaneRowsMin && kestrel_matmul::kSliceColumns == 16);
  dp_share(x, w, M, K, n_begin, n_end, DpSink<uint16_t>{y, N});
}

// The same on packed weights (N columns in panels of 16: [n_begin, n_end) whole panels but the last).
void linear_bf16_avx512_slice_packed(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t M, int64_t N, int64_t K,
                                int64_t n_begin, int64_t n_end) {
  static_assert(kestrel_matmul::kSliceColumns == kPackedPanel);
  packed_panels(x, w, M, K, n_begin / kPackedPanel, (n_end + kPackedPanel - 1) / kPackedPanel, y, N);
}
#endif  // KESTREL_HAS_AVX512_BF16
