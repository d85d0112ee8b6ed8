// GGUF weights as linear_gguf reads them: the packed blocks' layouts, the 16-bit activations, and
// a packed weight's header of segments. Internal to linear_gguf.cpp.
#pragma once

#include "float_tiles.h"

// ---- GGUF quantized weights ----
//
// linear_gguf(x [M, K] bf16, w) -> y [M, N] = x w^T, bf16 (or its float32 values), for a weight kept
// as a GGUF file stores it: llama.cpp's Q8_0 (Q5_0), Q6_K, Q4_K, Q4_1 (Q4_0), Q5 (Q5_1) or Q5_K
// blocks, packed at load (kestrel/ops/gguf_blocks.py: pack_gguf_weight) into panels of 16 columns (w's rows). w is one uint8
// tensor: a header of int64 (K, N, the number of segments, then for each segment its format, rows and
// byte offset), then the segments, each a run of whole panels in one format. A fused projection whose
// parts the file stores in different types (Q4_K_M's q and k in Q4_K, v in Q6_K) is one weight of
// several segments. Per panel of 16 columns and block along K:
//   Q8_0 (blocks of 32): 16 float32 scales, then the block's k-rows of 16 int8 (1.125 bytes a weight);
//   Q6_K (super-blocks of 256 in 16 blocks of 16): 16 float32 d, the blocks' int8 scales, then each
//     block's 6-bit q as nibbles and high bits in byte lanes (kQ6KQuants): 0.83 bytes a weight, against
//     0.82 in the file;
//   Q4_K (super-blocks of 256 in 8 sub-blocks of 32): 16 float32 d, 16 float32 dmin, the sub-blocks'
//     6-bit scales and mins as 8 x 16 bytes each, then 64 groups of 4 k-rows, 32 bytes each
//     (q4k_group_words): 0.59 bytes a weight, against 0.5625 in the file;
//   Q4_1 (blocks of 32; Q4_0 packed as Q4_1 with offset 8 d): 16 float32 d, 16 float32 offsets (-m),
//     then 8 groups of 4 k-rows as Q4_K's: 0.75 bytes a weight, against 0.625 in the file;
//   Q5 (Q5_1's blocks of 32; Q5_0 is packed as Q8_0, its q - 16 the int8): Q4_1's block of the q's
//     low 4 bits, then each group's fifth bits as two 32-bit words (bit i of the first: byte i's low
//     nibble's; of the second: its high nibble's), run on Q4_1's tiles with the bits added in: 0.875
//     bytes a weight, against 0.75 in the file;
//   Q5_K (Q4_K's super-blocks with 5-bit q): Q4_K's d, dmin, scales and mins, then each sub-block's q
//     in byte lanes as Q6_K's (kQ5KQuants): 0.72 bytes a weight, against 0.69 in the file.
//
// Q8_0 (and Q5_0, packed as it) runs its word tiles at every row count: each thread unpacks its panels once a call and
// sums each block of 32 in integers against x held as 16-bit integers per block (WordActivations: exact for every bf16
// x within 2^7 of the block's largest, the rest within 2^-15 of it), times d and the block's unit. Few rows (decode
// steps of a few requests: below kQ5KWordMinRows for Q5_K, kByteMinRows for the others) stream the packed panels
// through registers: Q6_K's and Q5_K's sum each block (of 16, of 32) in integers against x held as 14-bit integers
// split in two bytes (SplitActivations); Q4_K's, Q4_1's and the Q5s' sum each block of 32 as scale (sum x q) - min
// (sum x), the inner sums in 32-bit integers on the same 16-bit activations (fewer instructions a weight than float
// sums, or than each weight dequantized: see q4_stream_panels in linear_gguf.cpp). From those
// row counts each thread unpacks its panels once a call: Q4_1's and the Q5s' q against the same 16-bit activations,
// summed in the streamed tiles' order (word_tile), so that Q8_0, Q4_0, Q4_1 and the Q5s give a row the same bits at
// every row count (batch invariance); Q4_K's and Q6_K's against x quantized to 8 bits, as
// llama.cpp runs its K-quants (see "against 8-bit activations" below).

namespace {

enum GgufFormat : int64_t { kGgufQ8_0 = 0, kGgufQ6_K = 1, kGgufQ4_K = 2, kGgufQ4_1 = 3, kGgufQ5 = 4, kGgufQ5_K = 5 };  // gguf_blocks.py's GGUF_FORMATS codes

constexpr int64_t kQuantScaleBytes = kPanelCols * sizeof(float);

// The int8 formats: blocks of B along K, a float32 scale per column and block.
template <int64_t B>
constexpr int64_t kInt8BlockBytes = kQuantScaleBytes + B * kPanelCols;
static_assert(kPanelK % 32 == 0, "panel pieces hold whole blocks where K allows");

template <int64_t B>
inline const uint8_t* int8_block(const uint8_t* wq, int64_t K, int64_t n, int64_t b) {
  return wq + ((n / kPanelCols) * (K / B) + b) * kInt8BlockBytes<B>;
}
inline const float* block_scales(const uint8_t* block) { return reinterpret_cast<const float*>(block); }
inline const int8_t* block_int8(const uint8_t* block) { return reinterpret_cast<const int8_t*>(block + kQuantScaleBytes); }

// Q4_K: super-blocks of 256 along K.
constexpr int64_t kQ4KBlock = 256, kQ4KSub = 32, kQ4KSubs = kQ4KBlock / kQ4KSub;
constexpr int64_t kQ4KMins = 2 * kQuantScaleBytes;                 // d at 0, dmin at 64
constexpr int64_t kQ4KSubMins = kQ4KMins + kQ4KSubs * kPanelCols;  // scales at 128, mins at 256
constexpr int64_t kQ4KQuants = kQ4KSubMins + kQ4KSubs * kPanelCols;
constexpr int64_t kQ4KBlockBytes = kQ4KQuants + kQ4KBlock / 2 * kPanelCols;
static_assert(kPanelK == kQ4KBlock, "a Q4_K super-block is one panel piece (K % 256 == 0)");

inline const uint8_t* q4k_block(const uint8_t* wq, int64_t K, int64_t n, int64_t b) {
  return wq + ((n / kPanelCols) * (K / kQ4KBlock) + b) * kQ4KBlockBytes;
}

// Q4_1 (and Q4_0, packed as Q4_1): blocks of 32 along K, each 16 float32 d, 16 float32 offsets, then 8
// groups of 4 k-rows as Q4_K's (q4k_group_words); values d q - offset.
constexpr int64_t kQ4_1Quants = 2 * kQuantScaleBytes;
constexpr int64_t kQ4_1BlockBytes = kQ4_1Quants + kQ4KSub / 2 * kPanelCols;

// Q5_1 (packed as Q5): Q4_1's blocks of the low 4 bits, each followed by its 8 groups' fifth bits (two
// 32-bit words a group); values d q - offset.
constexpr int64_t kQ5FifthBits = kQ4_1BlockBytes;
constexpr int64_t kQ5BlockBytes = kQ5FifthBits + kQ4KSub / 4 * sizeof(uint64_t);

// Group g's fifth bits in a Q5 block: bits 0-31 of its low nibbles, 32-63 of its high ones.
inline uint64_t q5_fifth_bits(const uint8_t* block, int64_t g) {
  uint64_t bits;
  std::memcpy(&bits, block + kQ5FifthBits + g * sizeof bits, sizeof bits);
  return bits;
}

// Q6_K: super-blocks of 256 along K, in 16 blocks of 16 with an int8 scale each. Per panel and
// super-block: 16 float32 d, the blocks' scales (16 x 16 int8), then each block's q (the file's 0 .. 63;
// values d sc (q - 32)) in 192 bytes, byte 4c + t of each 64 holding column c's k-row t of a group of 4:
// the low nibbles of groups 0 and 1 (low and high nibble), of groups 2 and 3, then the high 2 bits of
// groups 0 .. 3 (bits 0-1, 2-3, 4-5, 6-7). Masks and shifts make each group's 64 q as bytes in place,
// 4 k-rows a 32-bit lane as the byte tiles take them. 0.83 bytes a weight, against 0.82 in the file.
constexpr int64_t kQ6KBlock = 256, kQ6KSub = 16, kQ6KSubs = kQ6KBlock / kQ6KSub;
constexpr int64_t kQ6KScales = kQuantScaleBytes;
constexpr int64_t kQ6KQuants = kQ6KScales + kQ6KSubs * kPanelCols;
constexpr int64_t kQ6KSubBytes = 3 * 4 * kPanelCols;
constexpr int64_t kQ6KBlockBytes = kQ6KQuants + kQ6KSubs * kQ6KSubBytes;
static_assert(kPanelK == kQ6KBlock, "a Q6_K super-block is one panel piece (K % 256 == 0)");

inline const uint8_t* q6k_block(const uint8_t* wq, int64_t K, int64_t n, int64_t b) {
  return wq + ((n / kPanelCols) * (K / kQ6KBlock) + b) * kQ6KBlockBytes;
}

// Q5_K: Q4_K's super-blocks of 256 in 8 sub-blocks of 32, with 5-bit q (values d sc q - dmin m). Per panel and
// super-block: Q4_K's d, dmin, scales and mins (so q4k_scale_min reads them), then each sub-block's q (0 .. 31) in 320
// bytes, byte 4c + t of each 64 holding column c's k-row t of a group of 4: the fifth bits of groups 0 .. 7 (bit g),
// then the low 4 bits of groups 0 and 1 (low and high nibble), 2 and 3, 4 and 5, 6 and 7. (In that order the tile reads
// a sub-block front to back; with the fifth bits last it would go back to the nibbles of groups 4 .. 7 after them, a
// slower walk from memory.) 0.72 bytes a weight, against 0.69 in the file, where Q4_1's blocks with the fifth bits beside (Q5) took
// 0.875 and twice the instructions of Q4_1 a weight.
constexpr int64_t kQ5KBlock = 256;
constexpr int64_t kQ5KQuants = kQ4KQuants;
constexpr int64_t kQ5KNibbles = 4 * kPanelCols;   // within a sub-block's q, after the fifth bits
constexpr int64_t kQ5KSubBytes = kQ5KNibbles + 4 * 4 * kPanelCols;
constexpr int64_t kQ5KBlockBytes = kQ5KQuants + kQ4KSubs * kQ5KSubBytes;
static_assert(kPanelK == kQ5KBlock, "a Q5_K super-block is one panel piece (K % 256 == 0)");

inline const uint8_t* q5k_block(const uint8_t* wq, int64_t K, int64_t n, int64_t b) {
  return wq + ((n / kPanelCols) * (K / kQ5KBlock) + b) * kQ5KBlockBytes;
}

// Block b of the panel of column n: Q4_1's, or Q5's (Fifth).
template <bool Fifth>
inline const uint8_t* q4_1_like_block(const uint8_t* wq, int64_t K, int64_t n, int64_t b) {
  return wq + ((n / kPanelCols) * (K / kQ4KSub) + b) * (Fifth ? kQ5BlockBytes : kQ4_1BlockBytes);
}

// Sub-block j's scale d * sc and min dmin * m of a panel's vector v: both products exact in float32.
inline void q4k_scale_min(const uint8_t* block, int64_t j, int v, VecF& scale, VecF& min) {
  const float* d = block_scales(block);
  const uint8_t* sc = block + kQ4KMins + j * kPanelCols + v * kLanes;
  scale = mul(load_f32(d + v * kLanes), load_uint8(sc));
  min = mul(load_f32(d + kPanelCols + v * kLanes), load_uint8(sc + kQ4KSubs * kPanelCols));
}

// A super-block's 4-bit q: 64 groups of 4 k-rows, each 32 bytes, byte 2c + t holding column c's q of
// k-row 4g + t in its low nibble and of k-row 4g + 2 + t in its high one. Widened to 16-bit lanes, the
// low nibbles are each column's pair of k-rows (4g, 4g + 1), the high ones (4g + 2, 4g + 3): the
// operands of a 16-bit multiply-add against the pair of activations. Vector v (kLanes columns) of group g:
inline VecI q4k_group_words(const uint8_t* block, int64_t g, int v) {
  return load_u8_words(block + kQ4KQuants + g * 2 * kPanelCols + v * 2 * kLanes);
}

// A block of 32 x as integers X = round(x 2^(Bits - e)), 2^e the power of two just above its largest
// |x| (|X| < 2^Bits); returns the unit 2^(e - Bits), and sum the block's sum of x. Zeros give X = 0. A
// NaN or infinity gives X = 0 (not an undefined cast) and a NaN unit, which reaches every output of its
// row.
template <int Bits>
inline float to_block_units(const float* xs, int16_t* X, float& sum) {
  VecF largest_lanes = zero(), sum_lanes = zero();
  for (int64_t t = 0; t < kQ4KSub; t += kLanes) {
    const VecF v = load_f32(xs + t);
    largest_lanes = max(largest_lanes, abs(v));
    sum_lanes = add(sum_lanes, v);
  }
  const float largest = hmax(largest_lanes);
  sum = hsum(sum_lanes);
  int e = 0;
  std::frexp(largest, &e);   // largest < 2^e
  const bool finite = std::isfinite(largest) && std::isfinite(sum);
  const bool scaled = largest > 0.f && finite;
  if (scaled && e - Bits >= -100) {   // 2^(Bits - e) a float: one exact multiply a lane
    const VecF to_units = splat(std::ldexp(1.f, Bits - e));
    for (int64_t t = 0; t < kQ4KSub; t += kLanes) store_int16_rounded(X + t, mul(load_f32(xs + t), to_units));
  } else {
    for (int64_t t = 0; t < kQ4KSub; ++t)
      X[t] = scaled ? static_cast<int16_t>(std::nearbyint(std::ldexp(xs[t], Bits - e))) : 0;
  }
  return scaled ? std::ldexp(1.f, e - Bits) : finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
}

// 16-bit activations, for Q4_K's streamed tiles and Q8_0's word tiles: each row's blocks of 32 as
// 16-bit integers X = round(x 2^-e) with 2^e = unit, the power of two that puts the block's largest
// |x| in [2^14, 2^15), and each block's sum of x. A bf16 x at most 2^7 below that largest is exact in
// X; a smaller one is off by at most unit / 2 (2^-15 of the largest), far below the bf16 rounding of y.
struct WordActivations {
  const float* x = nullptr;      // the widened rows [M, K], whose row m the streamed tiles are given as x + m K
  const int16_t* X = nullptr;    // [M, K]
  const float* unit = nullptr;   // [M, K / 32]
  const float* sum = nullptr;    // [M, K / 32]
  int64_t K = 0;

  static WordActivations of(const float* x, int64_t M, int64_t K) {
    thread_local std::vector<int16_t> X_buffer;
    thread_local std::vector<float> unit_buffer, sum_buffer;
    const int64_t subs = K / kQ4KSub;
    float* unit = scratch(unit_buffer, M * subs);
    float* sum = scratch(sum_buffer, M * subs);
    int16_t* X = scratch(X_buffer, M * K);
    // The workers take the pointers: thread_locals named inside the lambda would be each worker's own.
    at::parallel_for(0, M * subs, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) convert(x + i * kQ4KSub, X + i * kQ4KSub, unit[i], sum[i]);
    });
    return {x, X, unit, sum, K};
  }

  // One sub-block of 32: X, its unit and the sum of x.
  static void convert(const float* xs, int16_t* X, float& unit, float& sum) { unit = to_block_units<15>(xs, X, sum); }
};

// The two 4-bit formats (and Q5) as the streamed tiles read them: pieces of up to 8 sub-blocks of 32
// (Q4_K's super-block; Q4_1's and Q5's blocks, 8 at a time), sub-block j's scale and min (its values
// scale q - min) and its 8 groups of 4 k-rows, each as q4k_group_words (Q5: and their fifth bits).

template <typename Out>
struct ColumnsFrom {
  const Out& out;
  int64_t n_offset;
  void row(int64_t m, int64_t n0, const float* v, int64_t cols) const { out.row(m, n_offset + n0, v, cols); }
};

struct GgufSegment {
  int64_t format, panel0, panels;  // its first panel in w's columns, and how many
  const uint8_t* data;
};

// A packed weight's header, checked against its size.
struct GgufLayout {
  int64_t K = 0, N = 0;
  std::vector<GgufSegment> segments;

  explicit GgufLayout(const at::Tensor& w) {
    TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() >= 24,
                "linear_gguf: w must be a packed GGUF weight (contiguous uint8, dispatch.py: pack_gguf_weight)");
    const uint8_t* base = w.data_ptr<uint8_t>();
    const auto header = [&](int64_t i) {
      int64_t v;
      std::memcpy(&v, base + 8 * i, sizeof v);
      return v;
    };
    K = header(0), N = header(1);
    const int64_t count = header(2);
    TORCH_CHECK(K > 0 && N > 0 && count > 0 && w.numel() >= 8 * (3 + 3 * count), "linear_gguf: bad header");
    int64_t panel = 0;
    for (int64_t s = 0; s < count; ++s) {
      const int64_t format = header(3 + 3 * s), rows = header(4 + 3 * s), offset = header(5 + 3 * s);
      TORCH_CHECK(rows > 0 && rows % kPanelCols == 0, "linear_gguf: a segment of whole panels");
      const int64_t bytes = format == kGgufQ8_0 ? K / 32 * kInt8BlockBytes<32>
                            : format == kGgufQ6_K ? K / kQ6KBlock * kQ6KBlockBytes
                            : format == kGgufQ4_K ? K / kQ4KBlock * kQ4KBlockBytes
                            : format == kGgufQ4_1 ? K / kQ4KSub * kQ4_1BlockBytes
                            : format == kGgufQ5 ? K / 32 * kQ5BlockBytes
                            : format == kGgufQ5_K ? K / kQ5KBlock * kQ5KBlockBytes : -1;
      const int64_t block = format == kGgufQ6_K || format == kGgufQ4_K || format == kGgufQ5_K ? 256 : 32;
      TORCH_CHECK(bytes > 0 && K % block == 0, "linear_gguf: format ", format, " with K = ", K);
      TORCH_CHECK(offset >= 0 && offset + rows / kPanelCols * bytes <= w.numel(), "linear_gguf: a segment past the end");
      segments.push_back({format, panel, rows / kPanelCols, base + offset});
      panel += rows / kPanelCols;
    }
    TORCH_CHECK(panel * kPanelCols == N, "linear_gguf: the segments' rows are not N");
  }
};


}  // namespace
