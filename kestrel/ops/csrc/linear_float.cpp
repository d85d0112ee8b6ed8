// Products summed in float32 on the vector interface: linear_f32 (float32 weights, decode-sized
// batches) and linear_bf16 (bf16 weights widened to float32, for CPUs without AVX512-BF16), and the
// per-thread share of linear_bf16 that the decode plan's layer loop calls.
#include "float_tiles.h"
#include "kernels.h"

// ---- float32 linear layers for decode-sized batches ----
//
// linear_f32(x [M, K], w [N, K]) -> y [M, N] = x w^T, float32, K % 8 == 0 (a last part of K shorter
// than a vector is read through a lane mask). The library GEMM runs decode-sized products (the
// output head most of all) at a fraction of its rate at prefill sizes. Here a tile of 4 rows of x by
// 3 rows of w keeps 12 accumulators in registers (with the 3 w vectors and one x vector, all 16 AVX2
// registers), each summed across its lanes at the end. Threads take tiles of 3 weight rows; each
// keeps its 3 rows in L1 while it walks every 4-row block of x, and K is cut into pieces of at most
// kMaxKPiece so that the block of x being walked stays in L2 (512 KB) at 64-128 rows.

namespace {

constexpr int64_t kMaxKPiece = 768;
constexpr int64_t kMaxStreamRows = 4;  // up to here, gemv_rows; beyond, the register tiles

// y[m, n] (+)= x[m, k0:k1] . w[n, k0:k1] for MR rows of x from `x` (rows xK apart) and NR rows of w
// from `w` (rows wK apart); with `next` given, the same part of the next NR rows of w is prefetched
// along the way (the weights stream from memory, and the hardware prefetcher alone leaves much of its
// latency exposed). Each output is its lanes summed in k order, then across the lanes (hsum), then
// added to y: the same sum for any MR and NR.
template <int MR, int NR>
inline void linear_tile(const float* x, int64_t xK, const float* w, int64_t wK, int64_t k0, int64_t k1, float* y,
                        int64_t N, bool accumulate, const float* next) {
  VecF acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = zero();
  const auto step = [&](int64_t k, const auto& load) {
    if (next != nullptr && k % 16 < kLanes)  // a line of each next row per 16 floats
      for (int n = 0; n < NR; ++n) _mm_prefetch(reinterpret_cast<const char*>(next + n * wK + k), _MM_HINT_T0);
    VecF wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = load(w + n * wK + k);
    for (int m = 0; m < MR; ++m) {
      const VecF xv = load(x + m * xK + k);
      for (int n = 0; n < NR; ++n) acc[m][n] = fma(xv, wv[n], acc[m][n]);
    }
  };
  int64_t k = k0;
  for (; k + kLanes <= k1; k += kLanes) step(k, [](const float* p) { return in_register(load_f32(p)); });
  if (k < k1) step(k, [n = k1 - k](const float* p) { return load_first(p, n); });
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) y[m * N + n] = (accumulate ? y[m * N + n] : 0.f) + hsum(acc[m][n]);
}

// The first row block of x prefetches the next tile's weights (`next`, nullptr at the end).
template <int NR>
void linear_rows(const float* x, const float* w, int64_t M, int64_t K, int64_t k0, int64_t k1, int64_t n0,
                 float* y, int64_t N, const float* next) {
  const bool acc = k0 > 0;
  const float* wn = w + n0 * K;
  int64_t m = 0;
  for (; m + 4 <= M; m += 4, next = nullptr) linear_tile<4, NR>(x + m * K, K, wn, K, k0, k1, y + m * N + n0, N, acc, next);
  switch (M - m) {
    case 3: linear_tile<3, NR>(x + m * K, K, wn, K, k0, k1, y + m * N + n0, N, acc, next); break;
    case 2: linear_tile<2, NR>(x + m * K, K, wn, K, k0, k1, y + m * N + n0, N, acc, next); break;
    case 1: linear_tile<1, NR>(x + m * K, K, wn, K, k0, k1, y + m * N + n0, N, acc, next); break;
    default: break;
  }
}

// out(m, n, x[m] . w[n]) for MR (1-4) rows of x, n in [n0, n1): each weight row is read start to
// end, so that a thread's weights are one sequential stream, the hardware prefetcher's best case
// (interleaving 3 rows as the tiles do is slower at one row). Two accumulators per
// row of x hide the FMA latency. W: float32, or bf16 with K a multiple of kLanes.
template <int MR, typename W, typename Out>
void gemv_rows(const float* x, const W* w, int64_t K, int64_t n0, int64_t n1, const Out& out) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * K;
    VecF a[MR][2];
    for (int m = 0; m < MR; ++m) a[m][0] = a[m][1] = zero();
    int64_t k = 0;
    for (; k + 2 * kLanes <= K; k += 2 * kLanes) {
      const VecF w0 = load_weights(wr + k), w1 = load_weights(wr + k + kLanes);
      for (int m = 0; m < MR; ++m) {
        a[m][0] = fma(load_f32(x + m * K + k), w0, a[m][0]);
        a[m][1] = fma(load_f32(x + m * K + k + kLanes), w1, a[m][1]);
      }
    }
    for (; k < K; k += kLanes) {
      const VecF w0 = load_weights_part(wr, k, K);
      for (int m = 0; m < MR; ++m) a[m][0] = fma(load_part(x + m * K, k, K), w0, a[m][0]);
    }
    for (int m = 0; m < MR; ++m) out(m, n, hsum(add(a[m][0], a[m][1])));
  }
}

// gemv_rows for M in 1..4 rows.
template <typename W, typename Out>
void gemv_rows_of(int64_t M, const float* x, const W* w, int64_t K, int64_t n0, int64_t n1, const Out& out) {
  switch (M) {
    case 1: gemv_rows<1>(x, w, K, n0, n1, out); break;
    case 2: gemv_rows<2>(x, w, K, n0, n1, out); break;
    case 3: gemv_rows<3>(x, w, K, n0, n1, out); break;
    default: gemv_rows<4>(x, w, K, n0, n1, out); break;
  }
}

// K's pieces (kMaxKPiece at most, whole vectors): a function of K alone, so that every product with this
// K sums its pieces at the same places.
inline int64_t k_piece(int64_t K) {
  const int64_t pieces = (K + kMaxKPiece - 1) / kMaxKPiece;
  return ((K + pieces - 1) / pieces + kLanes - 1) / kLanes * kLanes;
}

}  // namespace

at::Tensor linear_f32(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_f32: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "linear_f32: float32 only");
  TORCH_CHECK(x.size(1) % 8 == 0, "linear_f32: K must be a multiple of 8");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M <= kMaxStreamRows) {
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      gemv_rows_of(M, xp, wp, K, begin, end, [&](int64_t m, int64_t n, float v) { yp[m * N + n] = v; });
    });
    return y;
  }
  const int64_t piece = k_piece(K);
  constexpr int NR = 3;
  const int64_t tiles = N / NR, rest = N - tiles * NR;
  at::parallel_for(0, tiles + (rest > 0), 8, [&](int64_t begin, int64_t end) {
    for (int64_t k0 = 0; k0 < K; k0 += piece) {
      const int64_t k1 = std::min(K, k0 + piece);
      for (int64_t t = begin; t < end; ++t) {
        const float* next = t + 1 < tiles ? wp + (t + 1) * NR * K : nullptr;
        if (t < tiles) linear_rows<NR>(xp, wp, M, K, k0, k1, t * NR, yp, N, next);
        else if (rest == 2) linear_rows<2>(xp, wp, M, K, k0, k1, t * NR, yp, N, nullptr);
        else linear_rows<1>(xp, wp, M, K, k0, k1, t * NR, yp, N, nullptr);
      }
    }
  });
  return y;
}

// ---- bf16 linear layers without AVX512-BF16 ----
//
// linear_bf16(x [M, K], w [N, K]) -> y [M, N] = x w^T for bf16 x and w, any M, K % kLanes == 0: the
// products summed in float32 and rounded once to bf16, as torch's bf16 F.linear gives them (to an ulp
// where the order of the float32 sums differs); float_out: y in float32, as summed.
// For CPUs without AVX512-BF16, where torch's bf16 GEMM runs at a fraction of its float32 rate (it
// emulates the bf16 products there). x
// is widened to float32 once per call. At 1..4 rows each weight row streams from memory and is widened
// as it is read (gemv_rows). At 5..47 a thread widens a panel of 3 weight rows by a piece of K into L1
// and walks linear_f32's register tiles down a block of up to kBf16RowBlock rows of x with it, so the
// widening is paid once per block of rows; from 48, the same with transposed panels of 16 columns
// under an outer-product tile (bf16_panels). Every output is summed in an order fixed by M's class
// (1..4, 5..47, or more) and K alone: not by its row's place in the batch, nor by how the columns are
// split between threads, so linear_bf16_slice's shares make the same y as the whole. A model's layers
// and output head pass their weights packed instead (see "packed bf16 weights" below); [N, K] is for
// the shapes that do not pack (N not a multiple of 16).

namespace {

constexpr int64_t kBf16RowBlock = 128;
constexpr int kBf16Tile = 3;  // weight rows per panel (linear_f32's tile)


// acc[m, j] (+)= x[m, k0:k0+len] . panel[j] for the M rows of x (rows xK apart, x at k0) and the nr
// (1..3) rows of a widened panel (rows len apart); acc rows are `stride` apart.
void bf16_panel_rows(const float* x, int64_t xK, int64_t M, const float* panel, int64_t len, int nr, float* acc,
                     int64_t stride, bool accumulate) {
  const auto run = [&](auto NRc) {
    constexpr int NR = decltype(NRc)::value;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) linear_tile<4, NR>(x + m * xK, xK, panel, len, 0, len, acc + m * stride, stride, accumulate, nullptr);
    switch (M - m) {
      case 3: linear_tile<3, NR>(x + m * xK, xK, panel, len, 0, len, acc + m * stride, stride, accumulate, nullptr); break;
      case 2: linear_tile<2, NR>(x + m * xK, xK, panel, len, 0, len, acc + m * stride, stride, accumulate, nullptr); break;
      case 1: linear_tile<1, NR>(x + m * xK, xK, panel, len, 0, len, acc + m * stride, stride, accumulate, nullptr); break;
      default: break;
    }
  };
  if (nr == 3) run(std::integral_constant<int, 3>{});
  else if (nr == 2) run(std::integral_constant<int, 2>{});
  else run(std::integral_constant<int, 1>{});
}

// For each block of up to kBf16RowBlock rows of x: pass(m0, mb, acc, panel) sums the block's rows
// against the columns [n0, n1) into acc [mb, n1 - n0] (float32), with `panel` (panel_floats) to widen
// weights into; then out.row() takes each row of sums.
template <typename Pass, typename Out>
void by_row_blocks(int64_t M, int64_t n0, int64_t n1, int64_t panel_floats, const Pass& pass, const Out& out) {
  const int64_t cols = n1 - n0;
  thread_local std::vector<float> panel_buffer, acc_buffer;  // kept and grown across calls
  float* panel = scratch(panel_buffer, panel_floats);
  float* acc = scratch(acc_buffer, std::min(kBf16RowBlock, M) * cols);
  for (int64_t m0 = 0; m0 < M; m0 += kBf16RowBlock) {
    const int64_t mb = std::min(kBf16RowBlock, M - m0);
    pass(m0, mb, acc, panel);
    for (int64_t m = 0; m < mb; ++m) out.row(m0 + m, n0, acc + m * cols, cols);
  }
}

// out(m, n, y[m, n]) for all M rows of x (widened, [M, K]) and the columns [n0, n1), from 5 rows up.
template <typename Out>
void bf16_tiles(const float* x, const uint16_t* w, int64_t M, int64_t K, int64_t n0, int64_t n1, const Out& out) {
  const int64_t piece = k_piece(K), cols = n1 - n0;
  by_row_blocks(M, n0, n1, kBf16Tile * piece, [&](int64_t m0, int64_t mb, float* acc, float* panel) {
    const float* xb = x + m0 * K;
    // The weights of columns n..n+nr over [k0, k1) into the panel, then down the block of rows. Either
    // loop order sums the same pieces in the same order; pieces outside keeps a piece of the block of
    // x in L2 across the panels where the whole block would not fit, tiles outside reads each weight
    // row start to end where it does.
    const auto panel_pass = [&](int64_t n, int64_t k0) {
      const int64_t k1 = std::min(K, k0 + piece), len = k1 - k0;
      const int nr = static_cast<int>(std::min<int64_t>(kBf16Tile, n1 - n));
      for (int j = 0; j < nr; ++j) widen_bf16(w + (n + j) * K + k0, panel + j * len, len);
      bf16_panel_rows(xb + k0, K, mb, panel, len, nr, acc + (n - n0), cols, k0 > 0);
    };
    if (mb * K * static_cast<int64_t>(sizeof(float)) <= (256 << 10)) {
      for (int64_t n = n0; n < n1; n += kBf16Tile)
        for (int64_t k0 = 0; k0 < K; k0 += piece) panel_pass(n, k0);
    } else {
      for (int64_t k0 = 0; k0 < K; k0 += piece)
        for (int64_t n = n0; n < n1; n += kBf16Tile) panel_pass(n, k0);
    }
  }, out);
}

// out(m, n, y[m, n]) for all M rows of x (widened, [M, K]) and the columns [n0, n1), from kPanelMinRows rows.
template <typename Out>
void bf16_panels(const float* x, const uint16_t* w, int64_t M, int64_t K, int64_t n0, int64_t n1, const Out& out) {
  const int64_t piece = panel_k_piece(K), cols = n1 - n0;
  by_row_blocks(M, n0, n1, kPanelCols * piece, [&](int64_t m0, int64_t mb, float* acc, float* panel) {
    // Pieces outside: a piece of the block of x (128 KB at most) stays in L2 across the panels.
    for (int64_t k0 = 0; k0 < K; k0 += piece) {
      const int64_t len = std::min(K, k0 + piece) - k0;
      for (int64_t n = n0; n < n1; n += kPanelCols) {
        const int nc = static_cast<int>(std::min<int64_t>(kPanelCols, n1 - n));
        widen_transposed(w, K, n, nc, k0, len, panel);
        for (int64_t m = 0; m < mb; m += kPanelRows)
          panel_tile_rows(std::min<int64_t>(kPanelRows, mb - m), x + (m0 + m) * K + k0, K, panel, len,
                          acc + m * cols + (n - n0), cols, nc, k0 > 0);
      }
    }
  }, out);
}

// y's columns [n0, n1) for the widened x [M, K].
template <typename Out>
void linear_bf16_columns(const float* x, const uint16_t* w, int64_t M, int64_t K, int64_t n0, int64_t n1,
                         const Out& out) {
  if (M <= kMaxStreamRows) gemv_rows_of(M, x, w, K, n0, n1, out);
  else if (M < kPanelMinRows) bf16_tiles(x, w, M, K, n0, n1, out);
  else bf16_panels(x, w, M, K, n0, n1, out);
}

// ---- packed bf16 weights ----
//
// A weight packed once at load (kestrel/ops/dispatch.py: pack_bf16_weight) as [N / kPanelCols, K,
// kPanelCols]: panel p holds columns [16p, 16p + 16) with each k a row of 16 values, the layout an
// outer-product tile reads, the row's two halves interleaved (packed[p, k, 2j + h] = w[16p + 8h + j,
// k]) so that each 32-bit word holds two columns 8 apart (load_panel_row). A panel is one contiguous
// stream that the tile widens in registers as it reads it: no transpose per call (which at decode
// sizes costs more than the FMAs themselves) and no
// widened copy, so the one tile serves every row count.
// Every output is one sum down k per piece of K (panel_k_piece), the pieces added in order, whatever M
// is: a row of y does not depend on the batch at all (and from kPanelMinRows rows it is the sum that
// bf16_panels makes on [N, K]).

// The packed panel of columns [n, n + kPanelCols), rows [k0, k0 + len).
inline const uint16_t* packed_panel(const uint16_t* wp, int64_t K, int64_t n, int64_t k0) {
  return wp + (n / kPanelCols) * K * kPanelCols + k0 * kPanelCols;
}


// How far ahead of its reads a row block that streams the panels from memory prefetches them, in k-rows
// of a panel (32 bytes each): 2 KB. It pays at decode sizes and costs nothing from 64 rows; the row
// blocks that read a group from L2 after the first do without (a prefetch there only costs). A
// prefetch past a weight's end is dropped (it never faults).
constexpr int64_t kPanelAheadRows = 64;

// out(m, n, y[m, n]) for MR rows of x (widened, [MR, K]) and the panels of [n0, n0 + P x kPanelCols);
// with Prefetch, the panels' stream is fetched kPanelAheadRows ahead.
template <int MR, int P, bool Prefetch, typename Out>
void packed_stream_panels(const float* x, const uint16_t* wp, int64_t K, int64_t n0, const Out& out) {
  constexpr int V = P * kPanelVecs;
  const int64_t piece = panel_k_piece(K);
  VecF total[MR][V];
  for (int64_t k0 = 0; k0 < K; k0 += piece) {
    const int64_t len = std::min(K, k0 + piece) - k0;
    VecF c[MR][V];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < V; ++v) c[m][v] = zero();
    const uint16_t* panel[P];
    for (int p = 0; p < P; ++p) panel[p] = packed_panel(wp, K, n0 + p * kPanelCols, k0);
    for (int64_t k = 0; k < len; ++k) {
      VecF b[V];
      for (int p = 0; p < P; ++p) {
        if constexpr (Prefetch)
          _mm_prefetch(reinterpret_cast<const char*>(panel[p] + (k + kPanelAheadRows) * kPanelCols), _MM_HINT_T0);
        load_panel_row(panel[p] + k * kPanelCols, b + p * kPanelVecs);
      }
      for (int m = 0; m < MR; ++m) {
        const VecF a = splat(x[m * K + k0 + k]);
        for (int v = 0; v < V; ++v) c[m][v] = fma(a, b[v], c[m][v]);
      }
    }
    add_piece<MR, V>(total, c, k0 == 0);
  }
  emit_rows<MR, V>(total, n0, out);
}

// The columns [n0, n1) (multiples of kPanelCols) for MR rows.
template <int MR, bool Prefetch, typename Out>
void packed_stream(const float* x, const uint16_t* wp, int64_t K, int64_t n0, int64_t n1, const Out& out) {
  constexpr int64_t span = kStreamPanels<MR> * kPanelCols;
  int64_t n = n0;
  for (; n + span <= n1; n += span) packed_stream_panels<MR, kStreamPanels<MR>, Prefetch>(x, wp, K, n, out);
  for (; n < n1; n += kPanelCols) packed_stream_panels<MR, 1, Prefetch>(x, wp, K, n, out);
}

template <typename Out>
void packed_row_groups(const float* x, const uint16_t* wp, int64_t M, int64_t K, int64_t n0, int64_t n1,
                       const Out& out) {
  row_groups(x, M, K, n0, n1, out, [&](auto MRc, const float* xm, int64_t n, int64_t n_end, const auto& rows,
                                       bool from_memory) {
    constexpr int MR = decltype(MRc)::value;
    if (from_memory) packed_stream<MR, true>(xm, wp, K, n, n_end, rows);
    else packed_stream<MR, false>(xm, wp, K, n, n_end, rows);
  });
}

// y's columns [n0, n1) (multiples of kPanelCols) for the widened x [M, K] and the packed w.
template <typename Out>
void linear_bf16_packed_columns(const float* x, const uint16_t* wp, int64_t M, int64_t K, int64_t n0, int64_t n1,
                                const Out& out) {
  packed_row_groups(x, wp, M, K, n0, n1, out);
}

}  // namespace

at::Tensor linear_bf16(at::Tensor x, at::Tensor w, bool float_out) {
  const bool packed = w.dim() == 3;
  TORCH_CHECK(x.dim() == 2 && (w.dim() == 2 || (packed && w.size(2) == kPanelCols)) && x.size(1) == w.size(1),
              "linear_bf16: x [M, K], w [N, K] or packed [N / ", kPanelCols, ", K, ", kPanelCols, "]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "linear_bf16: bf16 only");
  TORCH_CHECK(x.size(1) % kLanes == 0, "linear_bf16: K must be a multiple of ", kLanes);
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = packed ? w.size(0) * kPanelCols : w.size(0);
  auto y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M == 0 || N == 0) return y;
  const float* xf = widened_x(x);
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  const Bf16Out out{y.data_ptr(), N, float_out};
  if (packed) {  // whole panels to each thread
    at::parallel_for(0, N / kPanelCols, 1, [&](int64_t begin, int64_t end) {
      linear_bf16_packed_columns(xf, wp, M, K, begin * kPanelCols, end * kPanelCols, out);
    });
    return y;
  }
  // Whole tiles or panels of columns to each thread; a stream of rows is split finer (16 rows).
  const int64_t unit = M <= kMaxStreamRows ? 1 : M < kPanelMinRows ? kBf16Tile : kPanelCols;
  const int64_t grain = M <= kMaxStreamRows ? 16 : M < kPanelMinRows ? 8 : 2;
  at::parallel_for(0, (N + unit - 1) / unit, grain, [&](int64_t begin, int64_t end) {
    linear_bf16_columns(xf, wp, M, K, begin * unit, std::min(N, end * unit), out);
  });
  return y;
}

// One thread's share of linear_bf16 for 1..15 rows (kestrel_matmul::MatmulSliceFn): the columns
// [n_begin, n_end) of y, x widened by the thread itself; w [N, K], or packed where Packed.
template <bool Packed>
void linear_bf16_slice(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t M, int64_t N, int64_t K,
                       int64_t n_begin, int64_t n_end) {
  thread_local std::vector<float> x_buffer;
  float* xf = scratch(x_buffer, M * K);
  widen_bf16(x, xf, M * K);
  const Bf16Out out{y, N, false};
  if constexpr (Packed) linear_bf16_packed_columns(xf, w, M, K, n_begin, n_end, out);
  else linear_bf16_columns(xf, w, M, K, n_begin, n_end, out);
}


void linear_bf16_slice_plain(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t M, int64_t N, int64_t K,
                             int64_t n_begin, int64_t n_end) {
  linear_bf16_slice<false>(x, w, y, M, N, K, n_begin, n_end);
}

void linear_bf16_slice_packed(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t M, int64_t N, int64_t K,
                              int64_t n_begin, int64_t n_end) {
  linear_bf16_slice<true>(x, w, y, M, N, K, n_begin, n_end);
}
