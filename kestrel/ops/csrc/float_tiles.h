// The float32 register tiles that the float32 and bf16 products (linear_float.cpp), the GGUF
// products (linear_gguf.cpp) and prefill attention (prefill_attention.cpp) share: bf16 widened to
// float32, the outer-product panel tile, the streamed tiles' sums and where their outputs go.
// Internal to each source that includes it (an unnamed namespace).
#pragma once

#include "kernel.h"

namespace {

// Lanes [k, k + kLanes) of a row, or its last k1 - k < kLanes values and zeros.
inline VecF load_part(const float* row, int64_t k, int64_t k1) {
  return k + kLanes <= k1 ? load_f32(row + k) : load_first(row + k, k1 - k);
}

// Weights as float32 vectors: float32 as they are, bf16 widened (exactly).
inline VecF load_weights(const float* p) { return in_register(load_f32(p)); }
inline VecF load_weights(const uint16_t* p) { return load_bf16(p); }
inline VecF load_weights_part(const float* row, int64_t k, int64_t k1) { return load_part(row, k, k1); }
inline VecF load_weights_part(const uint16_t* row, int64_t k, int64_t) { return load_bf16(row + k); }  // K % kLanes == 0


inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// n bf16 values widened into dst.
inline void widen_bf16(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(dst + i, load_bf16(src + i));
  for (; i < n; ++i) dst[i] = bf16_bits_to_float(src[i]);
}

// A scratch buffer of at least n floats that only ever grows: resizing a std::vector back up after a
// smaller call zero-fills the difference, and the calls alternate between sizes (a layer's K is the
// hidden size or the MLP's, prefill chunks vary).
template <typename T>
inline T* scratch(std::vector<T>& buffer, int64_t n) {
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// Where linear_bf16 puts y[m, n]: rounded to bf16, or the float32 sum as it is (the output head's
// logits, which are never rounded to bf16: two close candidates would tie). Rounded as c10::BFloat16
// rounds: to nearest even, every NaN to the one quiet NaN 0x7FC0.
struct Bf16Out {
  void* y;
  int64_t N;
  bool float_out;
  void operator()(int64_t m, int64_t n, float v) const {
    if (float_out) static_cast<float*>(y)[m * N + n] = v;
    else static_cast<c10::BFloat16*>(y)[m * N + n] = c10::BFloat16(v);
  }
  // y[m, n0 + c] for c < cols from v[c], a vector at a time: at prefill sizes the outputs are as many
  // as a few percent of the FMAs, too many to round one by one.
  void row(int64_t m, int64_t n0, const float* v, int64_t cols) const {
    const VecF nan = splat(std::numeric_limits<float>::quiet_NaN());  // 0x7FC00000, c10's NaN widened
    int64_t c = 0;
    for (; c + kLanes <= cols; c += kLanes) {
      const VecF x = load_f32(v + c);
      if (float_out) store(static_cast<float*>(y) + m * N + n0 + c, x);
      else store_bf16(static_cast<uint16_t*>(y) + m * N + n0 + c, select(is_nan(x), nan, x));
    }
    for (; c < cols; ++c) (*this)(m, n0 + c, v[c]);
  }
};

// From kPanelMinRows rows: an outer-product register tile. A panel holds kPanelCols columns of w by a
// piece of K (at most kPanelK: 16 KB, in L1), widened and transposed so that each k is a row of
// kPanelCols floats; kPanelRows rows of x at a time are each broadcast one value per k against the
// panel's row, into kPanelRows x kPanelVecs accumulators (12 of the 16 AVX2 registers). Per k: 2 panel loads
// and 6 broadcasts feed 12 FMAs, where the dot-product tiles above load 7 vectors for 12 and stream
// x from L2; each output is a single sum down k in its lane, with no horizontal sums.
constexpr int64_t kPanelMinRows = 48;
constexpr int kPanelCols = 16;
constexpr int kPanelVecs = kPanelCols / kLanes;
constexpr int kPanelRows = std::min(12, (kRegisters - kPanelVecs - 1) / kPanelVecs);  // AVX2: 6; AVX-512: 12
constexpr int64_t kPanelK = 256;

// K's pieces for the panels (kPanelK at most, whole vectors): a function of K alone.
inline int64_t panel_k_piece(int64_t K) {
  const int64_t pieces = (K + kPanelK - 1) / kPanelK;
  return ((K + pieces - 1) / pieces + kLanes - 1) / kLanes * kLanes;
}

// panel[k][c] = w[n + c][k0 + k] widened (rows of w K apart), for c < cols (zeros beyond, up to
// kPanelCols), k < len (a multiple of kLanes). W: bf16 (uint16_t) or float32.
template <typename W>
inline void widen_transposed(const W* w, int64_t K, int64_t n, int cols, int64_t k0, int64_t len, float* panel) {
  for (int64_t k = 0; k < len; k += kLanes)
    for (int c0 = 0; c0 < kPanelCols; c0 += kLanes) {
      VecF r[kLanes];
      for (int j = 0; j < kLanes; ++j) r[j] = c0 + j < cols ? load_weights(w + (n + c0 + j) * K + k0 + k) : zero();
      transpose_lanes(r);
      for (int i = 0; i < kLanes; ++i) store(panel + (k + i) * kPanelCols + c0, r[i]);
    }
}

// acc[m, c] (+)= x[m, 0:len] . panel[0:len, c] for MR rows of x (rows xK apart) and the panel's first
// `cols` columns; acc rows are `stride` apart, the panel's rows (kPanelCols floats) `panel_stride`.
template <int MR>
void panel_tile(const float* x, int64_t xK, const float* panel, int64_t len, float* acc, int64_t stride, int cols,
                bool accumulate, int64_t panel_stride = kPanelCols) {
  VecF c[MR][kPanelVecs];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kPanelVecs; ++v) c[m][v] = zero();
  for (int64_t k = 0; k < len; ++k) {
    VecF b[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v) b[v] = load_f32(panel + k * panel_stride + v * kLanes);
    for (int m = 0; m < MR; ++m) {
      const VecF a = splat(x[m * xK + k]);
      for (int v = 0; v < kPanelVecs; ++v) c[m][v] = fma(a, b[v], c[m][v]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    float* row = acc + m * stride;
    if (cols == kPanelCols) {
      for (int v = 0; v < kPanelVecs; ++v)
        store(row + v * kLanes, accumulate ? add(load_f32(row + v * kLanes), c[m][v]) : c[m][v]);
    } else {
      float part[kPanelCols];
      for (int v = 0; v < kPanelVecs; ++v) store(part + v * kLanes, c[m][v]);
      for (int j = 0; j < cols; ++j) row[j] = accumulate ? row[j] + part[j] : part[j];
    }
  }
}

template <int MR = kPanelRows>
void panel_tile_rows(int64_t rows, const float* x, int64_t xK, const float* panel, int64_t len, float* acc,
                     int64_t stride, int cols, bool accumulate, int64_t panel_stride = kPanelCols) {
  if constexpr (MR >= 1) {
    if (rows == MR) panel_tile<MR>(x, xK, panel, len, acc, stride, cols, accumulate, panel_stride);
    else panel_tile_rows<MR - 1>(rows, x, xK, panel, len, acc, stride, cols, accumulate, panel_stride);
  }
}


// Panels widened in registers as they are read, for up to kPanelRows rows of x: P panels side by
// side, so that one row still has 2 x kPanelVecs x P independent sums (the FMA latency hidden).
template <int MR>
constexpr int kStreamPanels = std::max(1, 8 / (MR * kPanelVecs));

// The streamed tiles' sums: total (+)= a piece's sums c (the first piece sets it), in the pieces' order.
template <int MR, int V>
__attribute__((always_inline)) inline void add_piece(VecF (&total)[MR][V], const VecF (&c)[MR][V], bool first) {
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < V; ++v) total[m][v] = first ? c[m][v] : add(total[m][v], c[m][v]);
}

// out.row(m, n0, ...) of MR rows of V vectors of sums.
template <int MR, int V, typename Out>
__attribute__((always_inline)) inline void emit_rows(const VecF (&total)[MR][V], int64_t n0, const Out& out) {
  alignas(64) float row[V * kLanes];
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < V; ++v) store(row + v * kLanes, total[m][v]);
    out.row(m, n0, row, V * kLanes);
  }
}

// Rows shifted by m0: out.row(m0 + m, ...).
template <typename Out>
struct RowsFrom {
  const Out& out;
  int64_t m0;
  void row(int64_t m, int64_t n0, const float* v, int64_t cols) const { out.row(m0 + m, n0, v, cols); }
};

// f(std::integral_constant<int, MR>{}) for MR = min(rows, kPanelRows): a tile's rows as a constant.
template <typename F>
inline void with_panel_rows(int64_t rows, const F& f) {
  switch (std::min<int64_t>(kPanelRows, rows)) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
#if defined(KESTREL_VEC_AVX512)
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 9: f(std::integral_constant<int, 9>{}); break;
    case 10: f(std::integral_constant<int, 10>{}); break;
    case 11: f(std::integral_constant<int, 11>{}); break;
#endif
    default: f(std::integral_constant<int, kPanelRows>{}); break;
  }
}

// A group of panels at a time (as many as one row streams side by side: 64 columns on AVX2), and under
// it the rows kPanelRows at a time, so that the group comes from memory once and from L2 after:
// stream(MRc, x's rows, n, n_end, their out, from_memory) runs one row group over the group's panels;
// from_memory: it is the group's first, the one that reads the panels from memory. Each row
// group converts the panels in registers as it reads them, which is faster at every row count than
// widening each panel piece into L1 once for all the rows (bf16_panels).
template <typename Out, typename Stream>
void row_groups(const float* x, int64_t M, int64_t K, int64_t n0, int64_t n1, const Out& out, const Stream& stream) {
  constexpr int64_t group = kStreamPanels<1> * kPanelCols;
  for (int64_t n = n0; n < n1; n += group) {
    const int64_t n_end = std::min(n1, n + group);
    for (int64_t m = 0; m < M; m += kPanelRows) {
      const RowsFrom<Out> rows_out{out, m};
      with_panel_rows(M - m, [&](auto MRc) { stream(MRc, x + m * K, n, n_end, rows_out, m == 0); });
    }
  }
}

// x [M, K] bf16 widened into this thread's buffer, kept and grown across calls (no allocation nor
// zeroing per call); large ones by all the threads.
inline const float* widened_x(const at::Tensor& x) {
  thread_local std::vector<float> x_buffer;
  const int64_t n = x.numel();
  float* xf = scratch(x_buffer, n);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  // The workers take the pointer: a thread_local named inside the lambda would be each worker's own.
  at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) { widen_bf16(xp + begin, xf + begin, end - begin); });
  return xf;
}

}  // namespace
