// linear_gguf: products with GGUF-quantized weights (Q8_0, Q6_K, Q4_K, Q4_1, Q5_1, Q5_K and the
// formats packed as them) read as the file stores them, or nearly; the layouts are in gguf_blocks.h.
#include "gguf_blocks.h"
#include "kernels.h"

namespace {

struct Q4KBlocks {
  static constexpr bool kFifthBits = false;
  static constexpr int64_t kPieceSubs = kQ4KSubs;
  static int64_t piece_subs(int64_t, int64_t) { return kQ4KSubs; }
  static const uint8_t* piece(const uint8_t* wq, int64_t K, int64_t n, int64_t b) { return q4k_block(wq, K, n, b); }
  static void scale_min(const uint8_t* piece, int64_t j, int v, VecF& scale, VecF& min) {
    q4k_scale_min(piece, j, v, scale, min);
  }
  static VecI group_words(const uint8_t* piece, int64_t j, int64_t g, int v) {
    return q4k_group_words(piece, j * kQ4KSub / 4 + g, v);
  }
};

// Q4_1's blocks, and Q5's (Fifth: a block of kQ5BlockBytes, the fifth bits after the nibbles).
template <bool Fifth>
struct Q4_1LikeBlocks {
  static constexpr bool kFifthBits = Fifth;
  static constexpr int64_t kBlockBytes = Fifth ? kQ5BlockBytes : kQ4_1BlockBytes;
  static constexpr int64_t kPieceSubs = kQ4KSubs;
  static int64_t piece_subs(int64_t subs, int64_t b) { return std::min(kPieceSubs, subs - b * kPieceSubs); }
  static const uint8_t* piece(const uint8_t* wq, int64_t K, int64_t n, int64_t b) {
    return q4_1_like_block<Fifth>(wq, K, n, b * kPieceSubs);
  }
  static void scale_min(const uint8_t* piece, int64_t j, int v, VecF& scale, VecF& min) {
    const float* d = block_scales(piece + j * kBlockBytes);
    scale = load_f32(d + v * kLanes);
    min = load_f32(d + kPanelCols + v * kLanes);
  }
  static VecI group_words(const uint8_t* piece, int64_t j, int64_t g, int v) {
    return load_u8_words(piece + j * kBlockBytes + kQ4_1Quants + g * 2 * kPanelCols + v * 2 * kLanes);
  }
  // The low and high nibbles' words of vector v of group g with their fifth bits added (Q5).
  static void add_fifth_bits(const uint8_t* piece, int64_t j, int64_t g, int v, VecI& low, VecI& high) {
    uint64_t bits = q5_fifth_bits(piece + j * kBlockBytes, g);
    // One load into a register, each mask moved from there, not a mask load from memory per mask
    // (the compiler's choice otherwise, and much slower).
    asm("" : "+r"(bits));
    low = with_fifth_bits(low, static_cast<uint32_t>(bits) >> (v * 2 * kLanes));
    high = with_fifth_bits(high, static_cast<uint32_t>(bits >> 32) >> (v * 2 * kLanes));
  }
};
using Q4_1Blocks = Q4_1LikeBlocks<false>;
using Q5Blocks = Q4_1LikeBlocks<true>;

// out.row() of MR rows of a 4-bit weight's P panels, rows given as their widened x (whose offset from
// a.x names them): sum_k x_k (scale q_k - min) over each sub-block of 32 as scale unit (sum_k X_k q_k)
// - min (sum_k x_k), the inner sums exact in 32-bit integers (16-bit multiply-adds of each column's
// pair of q against a pair of X: 7 vector operations per 32 weights, where widening q to float32 takes
// 14); the pieces' sums added in order.
template <typename Q4, int MR, int P, typename Out>
void q4_stream_panels(const WordActivations& a, const float* xm, const uint8_t* wq, int64_t n0, const Out& out) {
  constexpr int V = P * kPanelVecs;
  const int64_t K = a.K, row0 = (xm - a.x) / K, subs = K / kQ4KSub;
  VecF total[MR][V];
  for (int64_t b = 0; b * Q4::kPieceSubs < subs; ++b) {
    VecF c[MR][V];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < V; ++v) c[m][v] = zero();
    const uint8_t* piece[P];
    for (int p = 0; p < P; ++p) piece[p] = Q4::piece(wq, K, n0 + p * kPanelCols, b);
    const int64_t piece_subs = Q4::piece_subs(subs, b);
    for (int64_t j = 0; j < piece_subs; ++j) {
      const int64_t sub = b * Q4::kPieceSubs + j;
      VecI acc[MR][V];
      for (int m = 0; m < MR; ++m)
        for (int v = 0; v < V; ++v) acc[m][v] = zero_i();
      for (int64_t g = 0; g < kQ4KSub / 4; ++g) {
        VecI low[V], high[V];
        for (int p = 0; p < P; ++p)
          for (int v = 0; v < kPanelVecs; ++v) {
            const VecI w = Q4::group_words(piece[p], j, g, v);
            low[p * kPanelVecs + v] = low_nibble_words(w);
            high[p * kPanelVecs + v] = high_nibble_words(w);
            if constexpr (Q4::kFifthBits) Q4::add_fifth_bits(piece[p], j, g, v, low[p * kPanelVecs + v],
                                                             high[p * kPanelVecs + v]);
          }
        const int64_t k = sub * kQ4KSub + 4 * g;
        for (int m = 0; m < MR; ++m) {
          int32_t pairs[2];
          std::memcpy(pairs, a.X + (row0 + m) * K + k, sizeof pairs);
          const VecI x01 = splat_i(pairs[0]), x23 = splat_i(pairs[1]);
          for (int v = 0; v < V; ++v)
            acc[m][v] = add_word_products(add_word_products(acc[m][v], low[v], x01), high[v], x23);
        }
      }
      for (int p = 0; p < P; ++p)
        for (int v = 0; v < kPanelVecs; ++v) {
          VecF scale, min;
          Q4::scale_min(piece[p], j, v, scale, min);
          for (int m = 0; m < MR; ++m) {
            VecF& cv = c[m][p * kPanelVecs + v];
            const VecF dot = mul(to_float_lanes(acc[m][p * kPanelVecs + v]), splat(a.unit[(row0 + m) * subs + sub]));
            cv = fnmadd(min, splat(a.sum[(row0 + m) * subs + sub]), fma(scale, dot, cv));
          }
        }
    }
    add_piece<MR, V>(total, c, b == 0);
  }
  emit_rows<MR, V>(total, n0, out);
}

// Q6_K's and Q5_K's streamed tiles (below kByteMinRows and kQ5KWordMinRows rows) take x as 14-bit integers per block of
// 32, X = round(x 2^(14 - e)), 2^e the power of two just above the block's largest |x| (exact for every bf16 x within
// 2^6 of it, the rest within 2^-14 of it), split in two bytes, X = 128 Xh + Xl (Xh in [-128, 127], Xl in [0, 127]). A
// group's q (bytes, unpacked in place from the byte lanes) meets the 4 Xh and the 4 Xl of its k-rows in one vpdpbusd
// each, 64 products an instruction where the 16-bit tiles' vpmaddwd do 32 and need q widened to words first; per block,
// 128 (sum q Xh) + (sum q Xl) = sum X q exactly (|.| < 2^24), then the block's scale and offset in float32
// (ByteLaneQ6K, ByteLaneQ5K).
struct SplitActivations {
  const float* x = nullptr;       // the widened rows [M, K]
  const int8_t* high = nullptr;   // [M, K]: Xh
  const int8_t* low = nullptr;    // [M, K]: Xl
  const float* unit = nullptr;    // [M, K / 32]: 2^(e - 14)
  const int32_t* X_sum = nullptr; // [M, K / 16]: the sum of X over each block of 16
  int64_t K = 0;

  static SplitActivations of(const float* x, int64_t M, int64_t K) {
    thread_local std::vector<int8_t> high_buffer, low_buffer;
    thread_local std::vector<float> unit_buffer;
    thread_local std::vector<int32_t> sum_buffer;
    const int64_t subs = K / kQ4KSub;
    int8_t* high = scratch(high_buffer, M * K);
    int8_t* low = scratch(low_buffer, M * K);
    float* unit = scratch(unit_buffer, M * subs);
    int32_t* X_sum = scratch(sum_buffer, 2 * M * subs);
    // The workers take the pointers: thread_locals named inside the lambda would be each worker's own.
    at::parallel_for(0, M * subs, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        convert(x + i * kQ4KSub, high + i * kQ4KSub, low + i * kQ4KSub, unit[i], X_sum + 2 * i);
    });
    return {x, high, low, unit, X_sum, K};
  }

  // One block of 32: Xh, Xl, the unit and the sums of X.
  static void convert(const float* xs, int8_t* high, int8_t* low, float& unit, int32_t* X_sum) {
    int16_t X[kQ4KSub];
    float sum;
    unit = to_block_units<14>(xs, X, sum);
    X_sum[0] = X_sum[1] = 0;
    for (int64_t t = 0; t < kQ4KSub; ++t) {
      const int32_t v = std::min<int32_t>(X[t], (1 << 14) - 1);   // |x| < 2^e: v < 2^14 but for rounding up
      high[t] = static_cast<int8_t>(v >> 7);
      low[t] = static_cast<int8_t>(v & 127);
      X_sum[t / kQ6KSub] += v;
    }
  }
};

// The byte-lane formats as the streamed tiles read them: per panel, pieces (super-blocks) of kPiece
// k-rows in blocks of kBlock, each block's q unpacked to bytes 16 k-rows (4 groups) at a time, and the
// block's sum of X q made its share of y with its scale (and offset).
struct ByteLaneQ6K {
  static constexpr int64_t kPiece = kQ6KBlock, kBlock = kQ6KSub;
  // Panels side by side: at one row 4 (faster than 2 or 8, and on the AVX2 build than 1); from 2 rows
  // the int8 tiles' count (faster than 1 panel).
  template <int MR>
  static constexpr int kPanels = MR == 1 ? 4 : kStreamPanels<MR>;
  static const uint8_t* piece(const uint8_t* wq, int64_t K, int64_t n, int64_t b) { return q6k_block(wq, K, n, b); }
  // Groups 0 .. 3 of block j (one h: a block is 16 k-rows), vector v.
  static void unpack(const uint8_t* piece, int64_t j, int, int v, VecI (&q)[4]) {
    const uint8_t* at = piece + kQ6KQuants + j * kQ6KSubBytes + v * 4 * kLanes;
    const VecI n01 = load_bytes(at), n23 = load_bytes(at + 4 * kPanelCols), h = load_bytes(at + 8 * kPanelCols);
    q[0] = with_high_bits<4, 0x30>(low_nibble_bytes(n01), h);
    q[1] = with_high_bits<2, 0x30>(high_nibble_bytes(n01), h);
    q[2] = with_high_bits<0, 0x30>(low_nibble_bytes(n23), h);
    q[3] = with_high_bits<-2, 0x30>(high_nibble_bytes(n23), h);
  }
  struct Scales { VecF scale; };
  static Scales scales(const uint8_t* piece, int64_t j, int v) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(piece + kQ6KScales) + j * kPanelCols + v * kLanes;
    return {mul(load_f32(block_scales(piece) + v * kLanes), load_int8(sc))};   // exact
  }
  // d sc unit (sum X q - 32 sum X) = d sc unit sum X (q - 32), the file's values (|.| <= 16 x 2^14 x 32:
  // exact in float32). X_sum: the block's sum of X.
  static VecF add_block(const Scales& s, VecI qX, const int32_t* X_sum, float unit, VecF c) {
    return fma(s.scale, mul(to_float_lanes(add_lanes(qX, splat_i(-32 * X_sum[0]))), splat(unit)), c);
  }
};

struct ByteLaneQ5K {
  static constexpr int64_t kPiece = kQ5KBlock, kBlock = kQ4KSub;
  // At one row 4 panels side by side, as Q6_K; at 2 rows (from kQ5KWordMinRows the word tiles run), as
  // Q4_K's 16-bit tiles, half Q6_K's count (faster there than Q6_K's).
  template <int MR>
  static constexpr int kPanels = MR == 1 ? 4 : std::max(1, 4 / (MR * kPanelVecs));
  static const uint8_t* piece(const uint8_t* wq, int64_t K, int64_t n, int64_t b) { return q5k_block(wq, K, n, b); }
  // Groups 4h .. 4h + 3 of sub-block j (their fifth bits are bits 4h .. 4h + 3), vector v.
  static void unpack(const uint8_t* piece, int64_t j, int h, int v, VecI (&q)[4]) {
    const uint8_t* at = piece + kQ5KQuants + j * kQ5KSubBytes + v * 4 * kLanes;
    const VecI f = load_bytes(at);
    const VecI n01 = load_bytes(at + kQ5KNibbles + h * 8 * kPanelCols);
    const VecI n23 = load_bytes(at + kQ5KNibbles + (h * 8 + 4) * kPanelCols);
    if (h == 0) {
      q[0] = with_high_bits<4, 0x10>(low_nibble_bytes(n01), f);
      q[1] = with_high_bits<3, 0x10>(high_nibble_bytes(n01), f);
      q[2] = with_high_bits<2, 0x10>(low_nibble_bytes(n23), f);
      q[3] = with_high_bits<1, 0x10>(high_nibble_bytes(n23), f);
    } else {
      q[0] = with_high_bits<0, 0x10>(low_nibble_bytes(n01), f);
      q[1] = with_high_bits<-1, 0x10>(high_nibble_bytes(n01), f);
      q[2] = with_high_bits<-2, 0x10>(low_nibble_bytes(n23), f);
      q[3] = with_high_bits<-3, 0x10>(high_nibble_bytes(n23), f);
    }
  }
  struct Scales { VecF scale, min; };
  static Scales scales(const uint8_t* piece, int64_t j, int v) {
    Scales s;
    q4k_scale_min(piece, j, v, s.scale, s.min);
    return s;
  }
  // d sc unit (sum X q) - dmin m unit (sum X): both sums exact in float32 (< 2^24, < 2^20). X_sum: the
  // sums of X of the block's two halves.
  static VecF add_block(const Scales& s, VecI qX, const int32_t* X_sum, float unit, VecF c) {
    const VecF dot = mul(to_float_lanes(qX), splat(unit));
    return fnmadd(s.min, splat(static_cast<float>(X_sum[0] + X_sum[1]) * unit), fma(s.scale, dot, c));
  }
};

// out.row() of MR rows of a byte-lane weight's P panels (rows given as their widened x, whose offset
// from a.x names them): each block's share of y from its sum of X q, the blocks' shares added in order
// within a piece, the pieces' in order.
template <typename Q, int MR, int P, typename Out>
void byte_lane_stream_panels(const SplitActivations& a, const float* xm, const uint8_t* wq, int64_t n0,
                             const Out& out) {
  constexpr int V = P * kPanelVecs;
  const int64_t K = a.K, row0 = (xm - a.x) / K, subs = K / kQ4KSub;
  VecF total[MR][V];
  for (int64_t b = 0; b < K / Q::kPiece; ++b) {
    VecF c[MR][V];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < V; ++v) c[m][v] = zero();
    const uint8_t* piece[P];
    for (int p = 0; p < P; ++p) piece[p] = Q::piece(wq, K, n0 + p * kPanelCols, b);
    for (int64_t j = 0; j < Q::kPiece / Q::kBlock; ++j) {
      const int64_t k = b * Q::kPiece + j * Q::kBlock;
      VecI high[MR][V], low[MR][V];
      for (int m = 0; m < MR; ++m)
        for (int v = 0; v < V; ++v) high[m][v] = low[m][v] = zero_i();
      for (int h = 0; h < Q::kBlock / 16; ++h)
        for (int p = 0; p < P; ++p)
          for (int v = 0; v < kPanelVecs; ++v) {
            VecI q[4];
            Q::unpack(piece[p], j, h, v, q);
            for (int m = 0; m < MR; ++m) {
              int32_t xh[4], xl[4];
              std::memcpy(xh, a.high + (row0 + m) * K + k + 16 * h, sizeof xh);
              std::memcpy(xl, a.low + (row0 + m) * K + k + 16 * h, sizeof xl);
              VecI& hi = high[m][p * kPanelVecs + v];
              VecI& lo = low[m][p * kPanelVecs + v];
              if constexpr (kFusedByteProducts) {
                for (int g = 0; g < 4; ++g) {
                  hi = add_byte_products(hi, q[g], splat_i(xh[g]));
                  lo = add_byte_products(lo, q[g], splat_i(xl[g]));
                }
              } else {   // two groups' pairs summed in 16 bits (at most 2 x 2 x 63 x 128 = 32256), then widened
                const VecI ones = splat_i(0x00010001);
                for (int g = 0; g < 4; g += 2) {
                  hi = add_lanes(hi, madd_words(add_words(madd_bytes(q[g], splat_i(xh[g])),
                                                          madd_bytes(q[g + 1], splat_i(xh[g + 1]))), ones));
                  lo = add_lanes(lo, madd_words(add_words(madd_bytes(q[g], splat_i(xl[g])),
                                                          madd_bytes(q[g + 1], splat_i(xl[g + 1]))), ones));
                }
              }
            }
          }
      for (int p = 0; p < P; ++p)
        for (int v = 0; v < kPanelVecs; ++v) {
          const typename Q::Scales scales = Q::scales(piece[p], j, v);
          for (int m = 0; m < MR; ++m) {
            const int64_t row = row0 + m;
            const VecI qX = add_lanes(shift_left_lanes(high[m][p * kPanelVecs + v], 7), low[m][p * kPanelVecs + v]);
            VecF& cv = c[m][p * kPanelVecs + v];
            cv = Q::add_block(scales, qX, a.X_sum + row * 2 * subs + k / kQ6KSub, a.unit[row * subs + k / kQ4KSub], cv);
          }
        }
    }
    add_piece<MR, V>(total, c, b == 0);
  }
  emit_rows<MR, V>(total, n0, out);
}

// A format's streamed tiles.
template <typename Q4>
struct Q4Format {
  template <int MR>
  // Fewer panels side by side than the int8 tiles from 2 rows, each panel vector holding a sub-block's
  // sums and the piece's for every row: faster there than the int8 tiles' count, which 1 row keeps
  // (faster at one row).
  static constexpr int kPanels = MR == 1 ? kStreamPanels<1> : std::max(1, 4 / (MR * kPanelVecs));
  const WordActivations* activations;
  template <int MR, int P, typename Out>
  void stream_panels(const float* x, const uint8_t* wq, int64_t, int64_t n0, const Out& out) const {
    q4_stream_panels<Q4, MR, P>(*activations, x, wq, n0, out);
  }
};

template <typename Q>
struct ByteLaneFormat {
  template <int MR>
  static constexpr int kPanels = Q::template kPanels<MR>;
  const SplitActivations* activations;
  template <int MR, int P, typename Out>
  void stream_panels(const float* x, const uint8_t* wq, int64_t, int64_t n0, const Out& out) const {
    byte_lane_stream_panels<Q, MR, P>(*activations, x, wq, n0, out);
  }
};

// row_groups' walk (a group of panels, the rows kPanelRows at a time under it) on a format's stream.
template <typename Format, typename Out>
void quant_row_groups(const Format& format, const float* x, const uint8_t* wq, int64_t M, int64_t K, int64_t n0,
                      int64_t n1, const Out& out) {
  row_groups(x, M, K, n0, n1, out, [&](auto MRc, const float* xm, int64_t n, int64_t n_end, const auto& rows,
                                       bool) {
    constexpr int MR = decltype(MRc)::value;
    constexpr int P = Format::template kPanels<MR>;
    int64_t c = n;
    for (; c + P * kPanelCols <= n_end; c += P * kPanelCols) format.template stream_panels<MR, P>(xm, wq, K, c, rows);
    for (; c < n_end; c += kPanelCols) format.template stream_panels<MR, 1>(xm, wq, K, c, rows);
  });
}

// Columns shifted by n_offset: out.row(m, n_offset + n0, ...).

// ---- Q4_K and Q6_K against 8-bit activations (from kByteMinRows rows); Q8_0, Q4_1 and the Q5s on 16-bit ones ----
//
// llama.cpp's way with its K-quants (their q against activations quantized to 8 bits), with a scale
// per block of 32 activations where its Q8_K has one per 256. Each row's blocks of 32 become int8,
// x ~ s q with s = max|x| / 127 and q = round_half_even(x (127 / max|x|)) (ByteActivations). A
// panel's q (Q4_K's 4-bit as they are, Q6_K's 6-bit + 32: unsigned bytes; BytePanel, made once a
// call) meet four activations at once in vpmaddubsw, whose 16-bit sums cannot saturate: Q4_K adds 8
// of them (a sub-block of 32; at most 8 x 2 x 15 x 127 = 30480), Q6_K 2 (at most 2 x 2 x 63 x 127 =
// 32004). vpmaddwd then sums each column's pair into 32 bits, times Q4_K's integer sub-block scale,
// and the rest is float32: per block of 32 times s (Q6_K: times d sc per 16), per Q4_K super-block
// times d, and last the offsets, minus sum_j offset[c][j] (s sum_j q), offset being Q4_K's dmin m per
// 32 and Q6_K's 32 d sc per 16 (its q are stored + 32). So y is the product of the dequantized
// weights and the dequantized activations, summed in float32 in another order (tests hold it to that
// product in float64). Each vpmaddubsw does 32 multiply-adds where an FMA does 8, which makes these
// tiles faster than the kernels they replace (Q4_K's 16-bit tiles and float panels, Q6_K's float32
// tiles and panels) from 16 rows; at 8 rows they are not, whence kByteMinRows.
//
// Q8_0's signed q would need vpsignb beside each vpmaddubsw (|q| against x with q's signs) and a
// vpmaddwd (two of its sums may overflow 16 bits): 4 instructions per 32 multiply-adds, as many as
// vpmaddwd on 16-bit activations takes (two, each 16). So Q8_0 takes those, WordActivations, exact to
// 2^-15 of each block's largest |x| where 8 bits would be to 2^-8: as fast as the 8-bit form and,
// from 8 rows, faster than the float32 tiles and panels it replaces, and as close to the float32 run
// as the weights dequantized to bf16 (benchmarks/gguf_teacher_forced.py), where the 8-bit form is
// about twice as far.
//
// Q4_1 (the default model's layers) takes the word tiles too, its q unpacked to Q8_0's pairs of int8,
// then minus the offsets times each block's sum of x. The 8-bit form runs batches faster but is
// farther from the float32 run, and flipped the near-tie of the default model's first answer to
// "What is the capital of France?".

constexpr int64_t kByteMinRows = 16;
// Q5_K's word tiles from here: its byte-lane panel unpacks once a call to the word panel, and the word
// tiles reuse each unpacked q for up to kPanelRows rows where the streamed tiles' 14-bit byte products
// hold two sums a row and vector: faster than the streamed tiles from 3 rows.
constexpr int64_t kQ5KWordMinRows = 3;
constexpr int64_t kByteBlock = 32;                 // activations per int8 scale
constexpr int kByteRows = 6 / kPanelVecs;          // a tile's rows: 6 int16 accumulators (AVX2: 3 rows x 2)
constexpr int64_t kByteRowBlockBytes = 128 << 10;  // a thread's rows of int8 x at a time (in L2; as many 16-bit rows)
constexpr int64_t kByteRowsPanelByPanel = 64;      // up to here (or one row block) every row under each panel

// Each row's int8 activations, with what the tiles' float32 steps need.
struct ByteActivations {
  const int8_t* q = nullptr;     // [M, K]
  const float* scale = nullptr;  // [M, K / 32]: s
  const float* sum16 = nullptr;  // [M, K / 16]: s times the sum of q over each 16
  const float* sum32 = nullptr;  // [M, K / 32]: over each 32
  int64_t K = 0;

  static ByteActivations of(const float* x, int64_t M, int64_t K) {
    thread_local std::vector<int8_t> q_buffer;
    thread_local std::vector<float> scale_buffer, sum16_buffer, sum32_buffer;
    const int64_t blocks = K / kByteBlock;
    int8_t* q = scratch(q_buffer, M * K);
    float* scale = scratch(scale_buffer, M * blocks);
    float* sum16 = scratch(sum16_buffer, 2 * M * blocks);
    float* sum32 = scratch(sum32_buffer, M * blocks);
    // The workers take the pointers: thread_locals named inside the lambda would be each worker's own.
    at::parallel_for(0, M * blocks, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        quantize(x + i * kByteBlock, q + i * kByteBlock, scale[i], sum16 + 2 * i, sum32[i]);
    });
    return {q, scale, sum16, sum32, K};
  }

  // One block of 32. A NaN or infinity makes s NaN (q = 0), which reaches every output of its row.
  static void quantize(const float* xs, int8_t* q, float& scale, float* sum16, float& sum32) {
    VecF largest_lanes = zero(), sum_lanes = zero();
    for (int64_t t = 0; t < kByteBlock; t += kLanes) {
      const VecF v = load_f32(xs + t);
      largest_lanes = max(largest_lanes, abs(v));
      sum_lanes = add(sum_lanes, v);   // a NaN that max() drops stays here
    }
    const float largest = hmax(largest_lanes);
    if (!std::isfinite(largest) || !std::isfinite(hsum(sum_lanes)) || largest == 0.f) {
      std::memset(q, 0, kByteBlock);
      scale = sum32 = sum16[0] = sum16[1] = largest == 0.f ? 0.f : std::numeric_limits<float>::quiet_NaN();
      return;
    }
    scale = largest / 127.f;
    const VecF to_q = splat(127.f / largest);
    float sums[2];
    for (int h = 0; h < 2; ++h) {
      VecF s = zero();
      for (int64_t t = 16 * h; t < 16 * (h + 1); t += kLanes) {
        const VecF r = round_nearest(mul(load_f32(xs + t), to_q));   // |r| <= 127
        store_int8_rounded(q + t, r);
        s = add(s, r);
      }
      sums[h] = hsum(s);   // an integer, exact
    }
    sum16[0] = scale * sums[0];
    sum16[1] = scale * sums[1];
    sum32 = scale * (sums[0] + sums[1]);
  }
};

// A panel of kPanelCols columns as the byte tiles read it. q: each group of 4 k-rows 64 bytes, column
// c's four q at 4c (vector v of kLanes columns at 4 kLanes v), unsigned; for Q8_0's word tiles each
// pair of k-rows 32 bytes, column c's two int8 q at 2c. The rest per format (above).
struct BytePanel {
  uint8_t* q;             // [K / 4][16][4] (Q8_0: [K / 2][16][2]; bf16 panels: [K / 2][16][2] bf16)
  int16_t* scale_words;   // Q4_K: [K / 32][16][2], each sub-block's scale twice (vpmaddwd's pairs)
  float* scale;           // Q4_K: d [K / 256][16]; Q6_K: d sc [K / 16][16]; Q8_0, Q4_1, Q5: d [K / 32][16]; Q5_K: d sc
  float* offset;          // Q4_K: dmin m [K / 32][16]; Q6_K: 32 d sc [K / 16][16]; Q4_1, Q5: its offset [K / 32][16]; Q5_K: dmin m
};

// The byte panels of a thread's columns, made once a call.
struct BytePanels {
  std::vector<uint8_t> q;
  std::vector<int16_t> scale_words;
  std::vector<float> scale, offset;
  int64_t K = 0, q_bytes = 1;   // q's bytes a weight: 1, or 2 for bf16 panels
  BytePanel at(int64_t p) {
    return {q.data() + q_bytes * p * K * kPanelCols, scale_words.data() + p * (K / 16) * kPanelCols,
            scale.data() + p * (K / 16) * kPanelCols, offset.data() + p * (K / 16) * kPanelCols};
  }
  void hold(int64_t panels, int64_t k, int64_t bytes = 1) {
    K = k;
    q_bytes = bytes;
    scratch(q, q_bytes * panels * K * kPanelCols);
    scratch(scale_words, panels * (K / 16) * kPanelCols);
    scratch(scale, panels * (K / 16) * kPanelCols);
    scratch(offset, panels * (K / 16) * kPanelCols);
  }
};

// 16 columns' group of 4 k-rows: Q4_K's 32 bytes (byte 2c + t: q of k-row t in the low nibble, of
// k-row 2 + t in the high one) as 64 (bytes 4c .. 4c + 3: k-rows 0 .. 3).
inline void q4k_group_bytes(const uint8_t* src, uint8_t* dst) {
  const __m128i low4 = _mm_set1_epi8(15);
  for (int h = 0; h < 2; ++h) {   // columns 8h .. 8h + 7
    const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * h));
    const __m128i low = _mm_and_si128(w, low4), high = _mm_and_si128(_mm_srli_epi16(w, 4), low4);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32 * h), _mm_unpacklo_epi16(low, high));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32 * h + 16), _mm_unpackhi_epi16(low, high));
  }
}

void q4k_byte_panel(const uint8_t* wq, int64_t K, int64_t n, const BytePanel& p) {
  for (int64_t b = 0; b < K / kQ4KBlock; ++b) {
    const uint8_t* block = q4k_block(wq, K, n, b);
    const float* d = block_scales(block);
    for (int64_t c = 0; c < kPanelCols; ++c) p.scale[b * kPanelCols + c] = d[c];
    for (int64_t j = 0; j < kQ4KSubs; ++j) {
      const int64_t sub = b * kQ4KSubs + j;
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kQ4KMins + j * kPanelCols));
      const __m128i words[2] = {_mm_unpacklo_epi8(sc, _mm_setzero_si128()), _mm_unpackhi_epi8(sc, _mm_setzero_si128())};
      __m128i* scale_words = reinterpret_cast<__m128i*>(p.scale_words + sub * 2 * kPanelCols);
      for (int h = 0; h < 2; ++h) {   // each scale twice: columns 8h .. 8h + 3, then 8h + 4 .. 8h + 7
        _mm_storeu_si128(scale_words + 2 * h, _mm_unpacklo_epi16(words[h], words[h]));
        _mm_storeu_si128(scale_words + 2 * h + 1, _mm_unpackhi_epi16(words[h], words[h]));
      }
      for (int64_t c = 0; c < kPanelCols; c += 4) {   // dmin m: exact, as q4k_scale_min's
        int32_t mins;
        std::memcpy(&mins, block + kQ4KSubMins + j * kPanelCols + c, sizeof mins);
        const __m128 m = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(mins)));
        _mm_storeu_ps(p.offset + sub * kPanelCols + c, _mm_mul_ps(_mm_loadu_ps(d + kPanelCols + c), m));
      }
    }
    for (int64_t g = 0; g < kQ4KBlock / 4; ++g)
      q4k_group_bytes(block + kQ4KQuants + g * 2 * kPanelCols, p.q + (b * kQ4KBlock + 4 * g) * kPanelCols);
  }
}

// Q6_K: q as the unsigned bytes 0 .. 63 (its layout's groups as they are, the high bits put in), d sc
// per block of 16 and 32 d sc as the offset.
void q6k_byte_panel(const uint8_t* wq, int64_t K, int64_t n, const BytePanel& p) {
  const __m128i low4 = _mm_set1_epi8(15), top2 = _mm_set1_epi8(0x30);
  const auto high_bits = [&](__m128i h, int shift) {   // bits 4-5 of each byte from h << shift (>> where negative)
    return _mm_and_si128(shift > 0 ? _mm_slli_epi16(h, shift) : _mm_srli_epi16(h, -shift), top2);
  };
  for (int64_t b = 0; b < K / kQ6KBlock; ++b) {
    const uint8_t* block = q6k_block(wq, K, n, b);
    const float* d = block_scales(block);
    const int8_t* sc = reinterpret_cast<const int8_t*>(block + kQ6KScales);
    for (int64_t j = 0; j < kQ6KSubs; ++j) {
      for (int64_t c = 0; c < kPanelCols; ++c) {
        const float scale = d[c] * static_cast<float>(sc[j * kPanelCols + c]);
        p.scale[(b * kQ6KSubs + j) * kPanelCols + c] = scale;
        p.offset[(b * kQ6KSubs + j) * kPanelCols + c] = 32.f * scale;
      }
      const uint8_t* src = block + kQ6KQuants + j * kQ6KSubBytes;
      uint8_t* dst = p.q + (b * kQ6KBlock + j * kQ6KSub) * kPanelCols;
      for (int64_t i = 0; i < 4 * kPanelCols; i += 16) {
        const auto load = [&](int64_t at) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + at + i)); };
        const __m128i n01 = load(0), n23 = load(4 * kPanelCols), h = load(8 * kPanelCols);
        const __m128i q[4] = {_mm_or_si128(_mm_and_si128(n01, low4), high_bits(h, 4)),
                              _mm_or_si128(_mm_and_si128(_mm_srli_epi16(n01, 4), low4), high_bits(h, 2)),
                              _mm_or_si128(_mm_and_si128(n23, low4), _mm_and_si128(h, top2)),
                              _mm_or_si128(_mm_and_si128(_mm_srli_epi16(n23, 4), low4), high_bits(h, -2))};
        for (int g = 0; g < 4; ++g)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + g * 4 * kPanelCols + i), q[g]);
      }
    }
  }
}

// 16 bits as 16 bytes, 16 where the bit is set, else 0.
inline __m128i fifth_bit_bytes(uint32_t bits) {
  const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(bits & 0xFFFF)),
                                          _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  const __m128i select = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, select), select), _mm_set1_epi8(16));
}

// Q4_1 (and Q5: Fifth) as Q8_0's word panel: a group's low nibbles are its columns' pairs of k-rows
// (4g, 4g + 1), its high ones (4g + 2, 4g + 3), each as an int8 0 .. 15 (Q5: plus 16 where its fifth bit
// is set); d and the offsets as they are.
template <bool Fifth>
void q4_1_like_word_panel(const uint8_t* wq, int64_t K, int64_t n, const BytePanel& p) {
  const __m128i low4 = _mm_set1_epi8(15);
  for (int64_t b = 0; b < K / kQ4KSub; ++b) {
    const uint8_t* block = q4_1_like_block<Fifth>(wq, K, n, b);
    std::memcpy(p.scale + b * kPanelCols, block, kQuantScaleBytes);
    std::memcpy(p.offset + b * kPanelCols, block + kQuantScaleBytes, kQuantScaleBytes);
    for (int64_t g = 0; g < kQ4KSub / 4; ++g) {
      const uint64_t bits = Fifth ? q5_fifth_bits(block, g) : 0;
      for (int h = 0; h < 2; ++h) {   // columns 8h .. 8h + 7
        const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kQ4_1Quants + g * 2 * kPanelCols + 16 * h));
        __m128i low = _mm_and_si128(w, low4), high = _mm_and_si128(_mm_srli_epi16(w, 4), low4);
        if constexpr (Fifth) {
          low = _mm_or_si128(low, fifth_bit_bytes(static_cast<uint32_t>(bits) >> (16 * h)));
          high = _mm_or_si128(high, fifth_bit_bytes(static_cast<uint32_t>(bits >> 32) >> (16 * h)));
        }
        uint8_t* pairs = p.q + (b * kQ4KSub + 4 * g) * kPanelCols + 16 * h;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(pairs), low);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(pairs + 2 * kPanelCols), high);
      }
    }
  }
}

// Q5_K as Q8_0's word panel: each sub-block's d sc and dmin m (q4k_scale_min's: the load's float32
// products), and each group's q (0 .. 31, unpacked as the streamed tiles unpack them) split into its
// columns' pairs of k-rows (4g, 4g + 1) and (4g + 2, 4g + 3).
void q5k_word_panel(const uint8_t* wq, int64_t K, int64_t n, const BytePanel& p) {
  for (int64_t b = 0; b < K / kQ5KBlock; ++b) {
    const uint8_t* block = q5k_block(wq, K, n, b);
    for (int64_t j = 0; j < kQ4KSubs; ++j) {
      const int64_t sub = b * kQ4KSubs + j;
      for (int v = 0; v < kPanelVecs; ++v) {
        VecF scale, min;
        q4k_scale_min(block, j, v, scale, min);
        store(p.scale + sub * kPanelCols + v * kLanes, scale);
        store(p.offset + sub * kPanelCols + v * kLanes, min);
        for (int h = 0; h < 2; ++h) {
          VecI q[4];
          ByteLaneQ5K::unpack(block, j, h, v, q);
          for (int g = 0; g < 4; ++g) {
            uint8_t* pairs = p.q + (sub * kQ4KSub + 4 * (4 * h + g)) * kPanelCols + v * 2 * kLanes;
            store_byte_pairs(q[g], pairs, pairs + 2 * kPanelCols);
          }
        }
      }
    }
  }
}

// The word panel of a Q8_0, Q4_1, Q5 or Q5_K segment.
void word_panel(int64_t format, const uint8_t* wq, int64_t K, int64_t n, const BytePanel& p) {
  if (format == kGgufQ4_1) q4_1_like_word_panel<false>(wq, K, n, p);
  else if (format == kGgufQ5) q4_1_like_word_panel<true>(wq, K, n, p);
  else q5k_word_panel(wq, K, n, p);
}

inline VecI four_activations(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, sizeof v);
  return splat_i(v);
}

// total[m] -= sum_j offset[j] x sums[m][j] over the J offsets (J = K / 32 or K / 16) of the panel.
template <int MR, int V>
void subtract_offsets(VecF (&total)[MR][V], const float* offset, const float* sums, int64_t J) {
  for (int64_t j = 0; j < J; ++j)
    for (int v = 0; v < V; ++v) {
      const VecF o = load_f32(offset + j * kPanelCols + v * kLanes);
      for (int m = 0; m < MR; ++m) total[m][v] = fnmadd(o, splat(sums[m * J + j]), total[m][v]);
    }
}

template <int MR, int V>
void store_tile(const VecF (&total)[MR][V], float (*out)[kPanelCols]) {
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < V; ++v) store(out[m] + v * kLanes, total[m][v]);
}

// out[m][c] for the MR rows from m0 and the panel's 16 columns. Not inlined (nor Q6_K's): inside
// byte_columns the register allocator spilled an accumulator of the inner loop.
template <int MR>
__attribute__((noinline)) void q4k_byte_tile(const ByteActivations& a, int64_t m0, const BytePanel& p, float (*out)[kPanelCols]) {
  constexpr int V = kPanelVecs;
  const int64_t K = a.K, blocks = K / kByteBlock;
  const int8_t* x = a.q + m0 * K;
  const float* s = a.scale + m0 * blocks;
  VecF total[MR][V];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < V; ++v) total[m][v] = zero();
  for (int64_t b = 0; b < K / kQ4KBlock; ++b) {
    VecF in_d[MR][V];   // the super-block's sum in units of d
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < V; ++v) in_d[m][v] = zero();
    for (int64_t j = b * kQ4KSubs; j < (b + 1) * kQ4KSubs; ++j) {
      // The sub-block's products: in 16-bit halves (16 of at most 15 x 127 each) scaled by vpmaddwd,
      // or, with vpdpbusd, whole in 32 bits and scaled by a 32-bit multiply; the same integers.
      VecI acc[MR][V];
      for (int m = 0; m < MR; ++m)
        for (int v = 0; v < V; ++v) acc[m][v] = zero_i();
#pragma GCC unroll 8
      for (int64_t k = j * kQ4KSub; k < (j + 1) * kQ4KSub; k += 4) {
        VecI w[V];
        for (int v = 0; v < V; ++v) w[v] = in_register_i(load_bytes(p.q + k * kPanelCols + v * 4 * kLanes));
        for (int m = 0; m < MR; ++m) {
          const VecI x4 = four_activations(x + m * K + k);
          for (int v = 0; v < V; ++v)
            acc[m][v] = kFusedByteProducts ? add_byte_products(acc[m][v], w[v], x4) : add_words(acc[m][v], madd_bytes(w[v], x4));
        }
        // Without this GCC regroups the sums and spills the accumulators.
        for (int m = 0; m < MR; ++m)
          for (int v = 0; v < V; ++v) keep_in_register(acc[m][v]);
      }
      for (int v = 0; v < V; ++v) {
        const VecI sc = load_bytes(p.scale_words + j * 2 * kPanelCols + v * 2 * kLanes);
        for (int m = 0; m < MR; ++m) {
          const VecI in_units = kFusedByteProducts ? mul_lanes(acc[m][v], low_words(sc)) : madd_words(acc[m][v], sc);
          in_d[m][v] = fma(to_float_lanes(in_units), splat(s[m * blocks + j]), in_d[m][v]);
        }
      }
    }
    for (int v = 0; v < V; ++v) {
      const VecF d = load_f32(p.scale + b * kPanelCols + v * kLanes);
      for (int m = 0; m < MR; ++m) total[m][v] = fma(d, in_d[m][v], total[m][v]);
    }
  }
  subtract_offsets<MR, V>(total, p.offset, a.sum32 + m0 * blocks, blocks);
  store_tile<MR, V>(total, out);
}

template <int MR>
__attribute__((noinline)) void q6k_byte_tile(const ByteActivations& a, int64_t m0, const BytePanel& p, float (*out)[kPanelCols]) {
  constexpr int V = kPanelVecs;
  const int64_t K = a.K, blocks = K / kByteBlock;
  const int8_t* x = a.q + m0 * K;
  const float* s = a.scale + m0 * blocks;
  const VecI ones = splat_i(0x00010001);   // 16-bit ones: vpmaddwd sums each pair
  VecF total[MR][V];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < V; ++v) total[m][v] = zero();
  for (int64_t j = 0; j < K / 16; ++j) {
    VecI acc[MR][V];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < V; ++v) acc[m][v] = zero_i();
    for (int64_t k = 16 * j; k < 16 * (j + 1); k += 8) {
      VecI w0[V], w1[V];
      for (int v = 0; v < V; ++v) {
        w0[v] = in_register_i(load_bytes(p.q + k * kPanelCols + v * 4 * kLanes));
        w1[v] = in_register_i(load_bytes(p.q + (k + 4) * kPanelCols + v * 4 * kLanes));
      }
      for (int m = 0; m < MR; ++m) {
        const VecI x0 = four_activations(x + m * K + k), x1 = four_activations(x + m * K + k + 4);
        for (int v = 0; v < V; ++v)
          if constexpr (kFusedByteProducts)
            acc[m][v] = add_byte_products(add_byte_products(acc[m][v], w0[v], x0), w1[v], x1);
          else
            acc[m][v] = add_lanes(acc[m][v], madd_words(add_words(madd_bytes(w0[v], x0), madd_bytes(w1[v], x1)), ones));
      }
      for (int m = 0; m < MR; ++m)
        for (int v = 0; v < V; ++v) acc[m][v] = in_register_i(acc[m][v]);
    }
    for (int v = 0; v < V; ++v) {
      const VecF scale = load_f32(p.scale + j * kPanelCols + v * kLanes);
      for (int m = 0; m < MR; ++m)
        total[m][v] = fma(to_float_lanes(acc[m][v]), mul(scale, splat(s[m * blocks + j / 2])), total[m][v]);
    }
  }
  subtract_offsets<MR, V>(total, p.offset, a.sum16 + 2 * m0 * blocks, 2 * blocks);
  store_tile<MR, V>(total, out);
}

// Where a word tile reads a panel's weights: a made panel (Q4_1 and Q5: their q unpacked to Q8_0's pairs
// of k-rows), or Q8_0's packed blocks as they are, each pair of k-rows interleaved as it is loaded (no
// panel made a call: at one row, making the default model's head panel by panel cost more than its
// products).
struct MadeWords {
  BytePanel p;
  const int8_t* rows(int64_t j) const { return reinterpret_cast<const int8_t*>(p.q) + j * kByteBlock * kPanelCols; }
  static VecI words(const int8_t* rows, int64_t k, int v) { return load_i8_words(rows + k * kPanelCols + v * 2 * kLanes); }
  const float* d(int64_t j) const { return p.scale + j * kPanelCols; }
  const float* offset(int64_t j) const { return p.offset + j * kPanelCols; }
};

struct Q8_0BlockWords {
  const uint8_t* wq;
  int64_t K, n;   // the panel of column n
  const int8_t* rows(int64_t j) const { return block_int8(int8_block<32>(wq, K, n, j)); }
  static VecI words(const int8_t* rows, int64_t k, int v) {
    return load_i8_pair_words(rows + k * kPanelCols, rows + (k + 1) * kPanelCols, v);
  }
  const float* d(int64_t j) const { return block_scales(int8_block<32>(wq, K, n, j)); }
};

// Q8_0 (and Q4_1, Q5) against the 16-bit activations (WordActivations): each column's pair of q, widened
// to 16 bits, against a pair of X in vpmaddwd, summed exactly in 32 bits over a block (at most 32 x 128
// x 2^15 = 2^27), then in float32: Q8_0 times d unit into the row's total; Q4_1 and Q5 as their streamed
// tiles (q4_stream_panels) sum them, the block's sum times its unit, times d, minus offset x the block's
// sum of x, into a piece of kQ4KSubs blocks, the pieces added in order into `out`. Either way a row's
// result is the same bits at every row count (batch invariance).
// Panels side by side in a word tile, so that each broadcast pair of x serves more columns: 2 with
// AVX-512 (6 rows x 2 panels: 12 integer and 12 float32 accumulators), 1 on AVX2's 16 registers.
constexpr int kWordPanels = kPanelVecs == 1 ? 2 : 1;

template <int64_t Format, int MR, int P, typename Words>
__attribute__((noinline)) void word_tile(const WordActivations& a, int64_t m0, const Words* src,
                                         float (*out)[kPanelCols]) {
  // out: panel p's row m at out[p * kByteRows + m]
  constexpr int V = kPanelVecs, PV = P * V;
  const int64_t K = a.K, blocks = K / kByteBlock;
  const int16_t* x = a.X + m0 * K;
  const float* unit = a.unit + m0 * blocks;
  const float* sum = a.sum + m0 * blocks;
  VecF total[MR][PV];   // Q8_0: the rows' sums; Q4_1 and Q5: the current piece's
  for (int m = 0; m < MR; ++m)
    for (int i = 0; i < PV; ++i) total[m][i] = zero();
  // Integer sums are exact in any order: with one or two rows, A accumulators a row take the k-pairs in
  // turn, so that the multiply-adds do not wait on each other (a decode step's output head at one row).
  constexpr int A = MR == 1 ? 4 / P : MR == 2 ? 2 / P : 1;
  for (int64_t j = 0; j < blocks; ++j) {
    const int8_t* rows[P];
    for (int p = 0; p < P; ++p) rows[p] = src[p].rows(j);
    VecI part[A][MR][PV];
    for (int i = 0; i < A; ++i)
      for (int m = 0; m < MR; ++m)
        for (int c = 0; c < PV; ++c) part[i][m][c] = zero_i();
#pragma GCC unroll 16
    for (int64_t k = 0; k < kByteBlock; k += 2) {
      VecI (&acc)[MR][PV] = part[(k / 2) % A];
      VecI w[PV];
      for (int p = 0; p < P; ++p)
        for (int v = 0; v < V; ++v) w[p * V + v] = in_register_i(Words::words(rows[p], k, v));
      for (int m = 0; m < MR; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * K + j * kByteBlock + k, sizeof pair);
        const VecI x2 = splat_i(pair);
        for (int c = 0; c < PV; ++c) acc[m][c] = add_word_products(acc[m][c], w[c], x2);
      }
      for (int m = 0; m < MR; ++m)
        for (int c = 0; c < PV; ++c) keep_in_register(acc[m][c]);
    }
    VecI (&acc)[MR][PV] = part[0];
    for (int i = 1; i < A; ++i)
      for (int m = 0; m < MR; ++m)
        for (int c = 0; c < PV; ++c) acc[m][c] = add_lanes(acc[m][c], part[i][m][c]);
    for (int p = 0; p < P; ++p) {
      const float* d = src[p].d(j);
      if constexpr (Format == kGgufQ8_0) {
        for (int v = 0; v < V; ++v) {
          const VecF dv = load_f32(d + v * kLanes);
          for (int m = 0; m < MR; ++m) {
            VecF& t = total[m][p * V + v];
            t = fma(to_float_lanes(acc[m][p * V + v]), mul(dv, splat(unit[m * blocks + j])), t);
          }
        }
      } else {
        const float* offset = src[p].offset(j);
        for (int v = 0; v < V; ++v) {
          const VecF dv = load_f32(d + v * kLanes), o = load_f32(offset + v * kLanes);
          for (int m = 0; m < MR; ++m) {
            VecF& t = total[m][p * V + v];
            const VecF dot = mul(to_float_lanes(acc[m][p * V + v]), splat(unit[m * blocks + j]));
            t = fnmadd(o, splat(sum[m * blocks + j]), fma(dv, dot, t));
          }
        }
      }
    }
    if constexpr (Format != kGgufQ8_0) {
      if (j % kQ4KSubs == kQ4KSubs - 1 || j == blocks - 1) {   // the piece ends: into out, in order
        for (int m = 0; m < MR; ++m)
          for (int p = 0; p < P; ++p)
            for (int v = 0; v < V; ++v) {
              float* o = out[p * kByteRows + m] + v * kLanes;
              VecF& t = total[m][p * V + v];
              store(o, j < kQ4KSubs ? t : add(load_f32(o), t));
              t = zero();
            }
      }
    }
  }
  if constexpr (Format == kGgufQ8_0) {
    for (int m = 0; m < MR; ++m)
      for (int p = 0; p < P; ++p)
        for (int v = 0; v < V; ++v) store(out[p * kByteRows + m] + v * kLanes, total[m][p * V + v]);
  }
}

// rows (1 .. kByteRows) rows from m0 on P word panels.
template <int64_t Format, int P, int MR = kByteRows, typename Words>
void word_tile_rows(int rows, const WordActivations& words, int64_t m0, const Words* src, float (*out)[kPanelCols]) {
  if constexpr (MR > 1) {
    if (rows < MR) return word_tile_rows<Format, P, MR - 1>(rows, words, m0, src, out);
  }
  word_tile<Format, MR, P>(words, m0, src, out);
}

// The columns [n0, n1) of a Q8_0 segment (Q8_0 and Q5_0), every row on the word tiles, read straight
// from the packed blocks: kWordPanels panels at a time, kByteRows rows at a time down them.
template <typename Out>
void q8_0_columns(const WordActivations& words, const GgufSegment& s, int64_t M, int64_t n0, int64_t n1,
                  const Out& out) {
  alignas(64) float tile[kWordPanels * kByteRows][kPanelCols];
  const auto run = [&](auto Pc, int64_t n) {
    constexpr int P = decltype(Pc)::value;
    Q8_0BlockWords src[P];
    for (int p = 0; p < P; ++p) src[p] = Q8_0BlockWords{s.data, words.K, n + p * kPanelCols};
    for (int64_t m = 0; m < M; m += kByteRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kByteRows, M - m));
      word_tile_rows<kGgufQ8_0, P>(rows, words, m, src, tile);
      for (int p = 0; p < P; ++p)
        for (int r = 0; r < rows; ++r) out.row(m + r, n + p * kPanelCols, tile[p * kByteRows + r], kPanelCols);
    }
  };
  int64_t n = n0;
  for (; n + kWordPanels * kPanelCols <= n1; n += kWordPanels * kPanelCols) run(std::integral_constant<int, kWordPanels>{}, n);
  for (; n < n1; n += kPanelCols) run(std::integral_constant<int, 1>{}, n);
}

// Whether the format's unpacked panels meet the 16-bit activations (the word tiles), not the 8-bit ones.
inline bool on_words(int64_t format) {
  return format == kGgufQ8_0 || format == kGgufQ4_1 || format == kGgufQ5 || format == kGgufQ5_K;
}

// rows (1 .. kByteRows) rows from m0 on the format's tile of that many rows.
template <int MR = kByteRows>
void byte_tile_rows(int64_t format, int rows, const ByteActivations& a, const WordActivations& words, int64_t m0,
                    const BytePanel& p, float (*out)[kPanelCols]) {
  if constexpr (MR > 1) {
    if (rows < MR) return byte_tile_rows<MR - 1>(format, rows, a, words, m0, p, out);
  }
  if (format == kGgufQ4_K) q4k_byte_tile<MR>(a, m0, p, out);
  else if (format == kGgufQ6_K) q6k_byte_tile<MR>(a, m0, p, out);
  else {   // Q4_1 and the Q5s: one panel, with offsets
    const MadeWords made{p};
    word_tile<kGgufQ4_1, MR, 1>(words, m0, &made, out);
  }
}

// The columns [n0, n1) of a segment on the byte tiles (Q8_0: the word tiles): its panels made once,
// then the rows a block at a time (whose x stays in L2) down every panel.
template <typename Out>
void byte_columns(const ByteActivations& a, const WordActivations& words, const GgufSegment& s, int64_t M, int64_t n0,
                  int64_t n1, const Out& out) {
  const int64_t K = on_words(s.format) ? words.K : a.K, panels = (n1 - n0) / kPanelCols;
  const auto make = [&](int64_t p, const BytePanel& panel) {
    if (s.format == kGgufQ4_K) q4k_byte_panel(s.data, K, n0 + p * kPanelCols, panel);
    else if (s.format == kGgufQ6_K) q6k_byte_panel(s.data, K, n0 + p * kPanelCols, panel);
    else word_panel(s.format, s.data, K, n0 + p * kPanelCols, panel);
  };
  alignas(64) float tile[kByteRows][kPanelCols];
  const auto rows_of = [&](int64_t p, const BytePanel& panel, int64_t m_begin, int64_t m_end) {
    for (int64_t m = m_begin; m < m_end; m += kByteRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kByteRows, m_end - m));
      byte_tile_rows(s.format, rows, a, words, m, panel, tile);
      for (int r = 0; r < rows; ++r) out.row(m + r, n0 + p * kPanelCols, tile[r], kPanelCols);
    }
  };
  thread_local BytePanels made;
  const int64_t row_block = std::max<int64_t>(kByteRows, kByteRowBlockBytes / K / kByteRows * kByteRows);
  if (on_words(s.format) && kWordPanels > 1) {
    // Q4_1 and the Q5s: kWordPanels made panels side by side in each word tile.
    alignas(64) float wtile[kWordPanels * kByteRows][kPanelCols];
    const auto group_rows = [&](auto Pc, int64_t p, int first_made, int64_t m_begin, int64_t m_end) {
      constexpr int P = decltype(Pc)::value;
      MadeWords src[P];
      for (int i = 0; i < P; ++i) src[i] = MadeWords{made.at(first_made + i)};
      for (int64_t m = m_begin; m < m_end; m += kByteRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kByteRows, m_end - m));
        word_tile_rows<kGgufQ4_1, P>(rows, words, m, src, wtile);
        for (int i = 0; i < P; ++i)
          for (int r = 0; r < rows; ++r)
            out.row(m + r, n0 + (p + i) * kPanelCols, wtile[i * kByteRows + r], kPanelCols);
      }
    };
    const bool panel_by_panel = M <= std::max(row_block, kByteRowsPanelByPanel);
    made.hold(panel_by_panel ? kWordPanels : panels, K);
    if (!panel_by_panel)
      for (int64_t p = 0; p < panels; ++p) make(p, made.at(p));
    for (int64_t m1 = 0; m1 < M; m1 += panel_by_panel ? M : row_block) {
      const int64_t m2 = panel_by_panel ? M : std::min(M, m1 + row_block);
      int64_t p = 0;
      for (; p + kWordPanels <= panels; p += kWordPanels) {
        if (panel_by_panel)
          for (int i = 0; i < kWordPanels; ++i) make(p + i, made.at(i));
        group_rows(std::integral_constant<int, kWordPanels>{}, p, panel_by_panel ? 0 : static_cast<int>(p), m1, m2);
      }
      for (; p < panels; ++p) {
        if (panel_by_panel) make(p, made.at(0));
        group_rows(std::integral_constant<int, 1>{}, p, panel_by_panel ? 0 : static_cast<int>(p), m1, m2);
      }
    }
    return;
  }
  if (M <= std::max(row_block, kByteRowsPanelByPanel)) {
    // Few rows (decode steps): each panel made just before its rows run, while it is in L1 and L2,
    // instead of all of them written out to memory and read back.
    made.hold(1, K);
    for (int64_t p = 0; p < panels; ++p) {
      make(p, made.at(0));
      rows_of(p, made.at(0), 0, M);
    }
    return;
  }
  made.hold(panels, K);
  for (int64_t p = 0; p < panels; ++p) make(p, made.at(p));
  for (int64_t m1 = 0; m1 < M; m1 += row_block)
    for (int64_t p = 0; p < panels; ++p) rows_of(p, made.at(p), m1, std::min(M, m1 + row_block));
}

// Whether the format's M rows run on panels unpacked once a call (the byte and word tiles).
bool on_unpacked_panels(int64_t format, int64_t M) {
  return format == kGgufQ8_0 || M >= (format == kGgufQ5_K ? kQ5KWordMinRows : kByteMinRows);
}

template <typename Out>
void gguf_columns(const float* x, const WordActivations* activations, const SplitActivations* split,
                  const ByteActivations* bytes, const GgufSegment& s, int64_t M, int64_t K, int64_t n0, int64_t n1,
                  const Out& out) {
  const ColumnsFrom<Out> shifted{out, s.panel0 * kPanelCols};
  if (s.format == kGgufQ8_0) q8_0_columns(*activations, s, M, n0, n1, shifted);
  else if (on_unpacked_panels(s.format, M)) byte_columns(*bytes, *activations, s, M, n0, n1, shifted);
  else if (s.format == kGgufQ6_K) quant_row_groups(ByteLaneFormat<ByteLaneQ6K>{split}, x, s.data, M, K, n0, n1, shifted);
  else if (s.format == kGgufQ5_K) quant_row_groups(ByteLaneFormat<ByteLaneQ5K>{split}, x, s.data, M, K, n0, n1, shifted);
  else if (s.format == kGgufQ5) quant_row_groups(Q4Format<Q5Blocks>{activations}, x, s.data, M, K, n0, n1, shifted);
  else if (s.format == kGgufQ4_K) quant_row_groups(Q4Format<Q4KBlocks>{activations}, x, s.data, M, K, n0, n1, shifted);
  else quant_row_groups(Q4Format<Q4_1Blocks>{activations}, x, s.data, M, K, n0, n1, shifted);
}

}  // namespace

at::Tensor linear_gguf(at::Tensor x, at::Tensor w, bool float_out) {
  const GgufLayout layout(w);
  const int64_t K = layout.K, N = layout.N;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kBFloat16,
              "linear_gguf: x must be bf16 [M, ", K, "]");
  x = x.contiguous();
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
  const float* xf = widened_x(x);
  const auto any_segment = [&](const auto& pred) { return std::any_of(layout.segments.begin(), layout.segments.end(), pred); };
  // 16-bit activations: the streamed tiles' of Q4_1, Q4_K and Q5, the word tiles' of Q8_0, Q4_1 and the Q5s.
  const bool words_used = any_segment([&](const GgufSegment& s) {
    const bool unpacked = on_unpacked_panels(s.format, M);
    return unpacked ? on_words(s.format)
                    : s.format == kGgufQ4_1 || s.format == kGgufQ4_K || s.format == kGgufQ5;
  });
  const WordActivations activations = words_used ? WordActivations::of(xf, M, K) : WordActivations{};
  const bool split_used = any_segment([&](const GgufSegment& s) {
    return (s.format == kGgufQ6_K || s.format == kGgufQ5_K) && !on_unpacked_panels(s.format, M);
  });
  const SplitActivations split = split_used ? SplitActivations::of(xf, M, K) : SplitActivations{};
  const bool bytes_used = any_segment([&](const GgufSegment& s) { return !on_words(s.format) && on_unpacked_panels(s.format, M); });
  const ByteActivations bytes = bytes_used ? ByteActivations::of(xf, M, K) : ByteActivations{};
  const Bf16Out out{y.data_ptr(), N, float_out};
  at::parallel_for(0, N / kPanelCols, 1, [&](int64_t begin, int64_t end) {
    for (const GgufSegment& s : layout.segments) {
      const int64_t p0 = std::max(begin, s.panel0), p1 = std::min(end, s.panel0 + s.panels);
      if (p0 < p1)
        gguf_columns(xf, &activations, &split, &bytes, s, M, K, (p0 - s.panel0) * kPanelCols,
                     (p1 - s.panel0) * kPanelCols, out);
    }
  });
  return y;
}
