// linear_int8: --quantization int8's products where there is no AMX (AVX512-VNNI or AVX2).
#include "float_tiles.h"
#include "kernels.h"

// What every int8 linear kernel (linear_int8 here, linear_int8_amx) asks of its operands.
void check_int8_linear_operands(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& wscale,
                                const char* kernel) {
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && wscale.dim() == 1, kernel, ": x and qweight 2-D, wscale 1-D");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, kernel, ": x must be bf16");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && wscale.scalar_type() == at::kFloat,
              kernel, ": qweight must be int8 and wscale float32");
  TORCH_CHECK(x.size(1) == qweight.size(1), kernel, ": x and qweight disagree on K");
  TORCH_CHECK(wscale.size(0) == qweight.size(0), kernel, ": wscale needs one scale per row of qweight");
  TORCH_CHECK(qweight.is_contiguous() && wscale.is_contiguous(), kernel, ": qweight and wscale must be contiguous");
}

// ---- int8 linear layers (--quantization int8) without AMX ----
//
// linear_int8(x [M, K] bf16, qweight [N, K] int8, wscale [N] float32) -> y [M, N] bf16, any M, N and K:
// bit for bit kestrel/model/quantization.py's linear_int8_reference (and so linear_bf16_avx512.cpp's
// linear_int8_amx where that runs). Each row of x is rotated by the orthonormal Hadamard transform on
// every block of 64 values where K % 64 == 0 (the butterflies in the reference's order), quantized
// per row (q = round_even(clamp(r * (127 / max|r|), -127, 127)), scale max|r| / 127), the int8
// products summed exactly in int32, and y[m, n] = (acc * wscale[n]) * xscale[m] rounded once to
// bf16. A row of x holding a NaN or an infinity quantizes to zeros with scale NaN, so its y row is
// NaN, as the reference's is.
//
// The exact int8 products: AVX512-VNNI's vpdpbusd multiplies u8 by s8, so each loaded weight vector
// is offset to u8 (w + 128, a xor of the sign bit) and every accumulator starts from -128 * sum(q)
// of its x row. AVX2 feeds |w| (u8) and x with w's sign (vpsignb) to vpmaddubsw, whose pair sums
// (at most 2 * 128 * 127) cannot saturate, then vpmaddwd sums the pairs into int32. An AVX-512 CPU
// without VNNI has no kernel here (int8_linear is false) and runs the reference.
//
// Decode (M of 1..64) streams the weights: a thread takes NR weight rows at a time and walks every
// block of MR rows of x against them while they sit in L1; the MR * NR <= kLanes int32 accumulators
// of a tile are summed across their lanes together into one vector, whose lanes the epilogue scales,
// rounds and stores. NR is kLanes at one row of x, kLanes / 2 at two and kLanes / 4 from three.

namespace {

#if defined(KESTREL_VEC_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KESTREL_INT8_LINEAR 1
constexpr int64_t kQBytes = 64;  // int8 values per vector
using QVec = __m512i;
struct WeightPiece {
  __m512i biased;  // w + 128 as u8
};
inline QVec load_q(const int8_t* p) { return _mm512_loadu_si512(p); }
inline QVec stream_q(const int8_t* p) { return _mm512_stream_load_si512(const_cast<int8_t*>(p)); }  // aligned
// Keeps a loaded vector in a register: folded into each vpdpbusd as a memory operand, x would be
// loaded NR times per step, and the loads, not the products, would set the pace.
inline QVec in_register_q(QVec v) {
  asm("" : "+v"(v));
  return v;
}
inline WeightPiece weight_piece(QVec w) { return {_mm512_xor_si512(w, _mm512_set1_epi8(-128))}; }
// acc += the four u8 x s8 products of each lane. Written as asm: through the intrinsic, GCC copied
// every accumulator to another register and back at each step (seen in GCC 12.2's output).
inline VecI dot_add(VecI acc, const WeightPiece& w, QVec x) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w.biased), "v"(x));
  return acc;
}
inline int32_t accumulator_start(int32_t q_sum) { return -128 * q_sum; }
inline VecI first_lane(int32_t v) { return _mm512_maskz_set1_epi32(1, v); }
inline VecF to_float(VecI v) { return _mm512_cvtepi32_ps(v); }
inline VecF permute_lanes(VecF v, VecI idx) { return _mm512_permutexvar_ps(idx, v); }
inline VecI load_i(const int32_t* p) { return _mm512_loadu_si512(p); }
inline VecI or_i(VecI a, VecI b) { return _mm512_or_si512(a, b); }
// Lanes rounded to int32 (to nearest even) and narrowed to int8 (values within [-127, 127]).
inline void store_int8(int8_t* p, VecF v) { _mm_storeu_si128((__m128i*)p, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v))); }

// One vector whose lane i is the sum of a[i]'s lanes.
__attribute__((always_inline)) inline VecI sum_lanes(const VecI a[kLanes]) {
  VecI t[8], u[4], v[2];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    v[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], 0x88), _mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(v[0], v[1], 0x88), _mm512_shuffle_i32x4(v[0], v[1], 0xDD));
}

// The Hadamard butterflies of strides 1, 2, 4 and 8, inside one register: lane i (bit h clear) and
// lane i + h become v[i] + v[i + h] and v[i] - v[i + h].
inline VecF butterflies_in_register(VecF v) {
  const auto step = [](VecF x, VecF partner, __mmask16 upper) {
    return _mm512_mask_blend_ps(upper, _mm512_add_ps(x, partner), _mm512_sub_ps(partner, x));
  };
  v = step(v, _mm512_permute_ps(v, 0xB1), 0xAAAA);
  v = step(v, _mm512_permute_ps(v, 0x4E), 0xCCCC);
  v = step(v, _mm512_shuffle_f32x4(v, v, 0xB1), 0xF0F0);
  return step(v, _mm512_shuffle_f32x4(v, v, 0x4E), 0xFF00);
}

#elif defined(KESTREL_VEC_AVX2)
#define KESTREL_INT8_LINEAR 1
constexpr int64_t kQBytes = 32;
using QVec = __m256i;
struct WeightPiece {
  __m256i w, magnitude;  // w, and |w| as u8 (|-128| is 128)
};
inline QVec load_q(const int8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline QVec stream_q(const int8_t* p) { return _mm256_stream_load_si256((const __m256i*)p); }  // aligned
inline QVec in_register_q(QVec v) {
  asm("" : "+x"(v));
  return v;
}
inline WeightPiece weight_piece(QVec w) { return {w, _mm256_abs_epi8(w)}; }
inline VecI dot_add(VecI acc, const WeightPiece& w, QVec x) {
  const __m256i pairs = _mm256_maddubs_epi16(w.magnitude, _mm256_sign_epi8(x, w.w));  // |w| * (x * sign w)
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline int32_t accumulator_start(int32_t) { return 0; }
inline VecI first_lane(int32_t v) { return _mm256_setr_epi32(v, 0, 0, 0, 0, 0, 0, 0); }
inline VecF to_float(VecI v) { return _mm256_cvtepi32_ps(v); }
inline VecF permute_lanes(VecF v, VecI idx) { return _mm256_permutevar8x32_ps(v, idx); }
inline VecI load_i(const int32_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline VecI or_i(VecI a, VecI b) { return _mm256_or_si256(a, b); }
inline void store_int8(int8_t* p, VecF v) {
  const __m256i i = _mm256_cvtps_epi32(v);
  const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64((__m128i*)p, _mm_packs_epi16(w16, w16));
}

__attribute__((always_inline)) inline VecI sum_lanes(const VecI a[kLanes]) {
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

inline VecF butterflies_in_register(VecF v) {  // strides 1, 2 and 4
  v = _mm256_blend_ps(_mm256_add_ps(v, _mm256_permute_ps(v, 0xB1)), _mm256_sub_ps(_mm256_permute_ps(v, 0xB1), v), 0xAA);
  v = _mm256_blend_ps(_mm256_add_ps(v, _mm256_permute_ps(v, 0x4E)), _mm256_sub_ps(_mm256_permute_ps(v, 0x4E), v), 0xCC);
  const VecF partner = _mm256_permute2f128_ps(v, v, 0x01);
  return _mm256_blend_ps(_mm256_add_ps(v, partner), _mm256_sub_ps(partner, v), 0xF0);
}

#else
#define KESTREL_INT8_LINEAR 0
#endif

}  // namespace

#if KESTREL_INT8_LINEAR

namespace {

constexpr int kHadamardRegs = 64 / kLanes;

// The Walsh-Hadamard transform / 8 of 64 values in kHadamardRegs registers: strides 1, 2, 4, ...
// inside each register, then the larger ones across registers, in the order of the reference.
inline void hadamard64(VecF v[kHadamardRegs]) {
  for (int i = 0; i < kHadamardRegs; ++i) v[i] = butterflies_in_register(v[i]);
  for (int h = 1; h < kHadamardRegs; h *= 2)
    for (int i = 0; i < kHadamardRegs; ++i)
      if (!(i & h)) {
        const VecF a = v[i], b = v[i + h];
        v[i] = add(a, b);
        v[i + h] = sub(a, b);
      }
  for (int i = 0; i < kHadamardRegs; ++i) v[i] = mul(v[i], splat(0.125f));
}

// q = round_even(clamp(v * inv, -127, 127)), NaN (0 * inf, where max|r| is subnormal) to 0: the
// reference's round().clamp_().to(int8).
inline float quantized_level(float v, float inv) {
  const float s = v * inv;
  return std::isnan(s) ? 0.f : std::nearbyint(std::min(std::max(s, -127.f), 127.f));
}
inline VecF quantized_levels(VecF v, VecF inv) {
  const VecF s = mul(v, inv);
  return select(is_nan(s), zero(), min(max(s, splat(-127.f)), splat(127.f)));
}

// Row x (K bf16 values) as float32 into r, rotated where `rotate`; whether it is all finite, and
// max|r|. (vmaxps drops a NaN operand, so NaNs are looked for on their own.)
inline bool row_to_float(const uint16_t* x, int64_t K, bool rotate, float* r, float* absmax) {
  Mask nan = is_nan(zero());
  VecF amax = zero();
  const auto take = [&](VecF v) {
    nan = either(nan, is_nan(v));
    amax = max(amax, abs(v));
  };
  int64_t k = 0;
  if (rotate) {
    for (; k < K; k += 64) {
      VecF v[kHadamardRegs];
      for (int i = 0; i < kHadamardRegs; ++i) v[i] = load_bf16(x + k + i * kLanes);
      hadamard64(v);
      for (int i = 0; i < kHadamardRegs; ++i) {
        store(r + k + i * kLanes, v[i]);
        take(v[i]);
      }
    }
  } else {
    for (; k + kLanes <= K; k += kLanes) {
      const VecF v = load_bf16(x + k);
      store(r + k, v);
      take(v);
    }
  }
  float m = hmax(amax);
  bool finite = !any(nan);
  for (; k < K; ++k) {
    r[k] = bf16_bits_to_float(x[k]);
    finite = finite && !std::isnan(r[k]);
    m = std::max(m, std::fabs(r[k]));
  }
  *absmax = m;
  return finite && !std::isinf(m);
}

// One row of x rotated (where `rotate`) and quantized into q (kp >= K values, zeros past K); its
// scale, and the sum of its levels into *q_sum. `r`: room for K floats.
inline float quantize_x_row(const uint16_t* x, int64_t K, bool rotate, float* r, int8_t* q, int64_t kp,
                            int32_t* q_sum) {
  float absmax;
  if (!row_to_float(x, K, rotate, r, &absmax)) {
    std::memset(q, 0, kp);
    *q_sum = 0;
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float inv = absmax > 0.f ? 127.f / absmax : 0.f;
  const VecF inv_v = splat(inv);
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) store_int8(q + k, quantized_levels(load_f32(r + k), inv_v));
  for (; k < K; ++k) q[k] = static_cast<int8_t>(quantized_level(r[k], inv));
  std::memset(q + K, 0, kp - K);
  int32_t sum = 0;
  for (int64_t i = 0; i < K; ++i) sum += q[i];
  *q_sum = sum;
  return absmax / 127.f;
}

// x quantized, rows of kp (K rounded up to whole vectors) zero-padded int8 levels, with each row's
// scale and accumulator start. One buffer per calling thread, kept and grown: an allocation per call
// would cost about as much as a small product. Rows start on 64-byte lines: a vector load across two
// lines costs two.
struct QuantizedX {
  int8_t* q;
  float* scale;
  int32_t* start;
  int64_t kp;
  QuantizedX(const uint16_t* x, int64_t M, int64_t K) : kp((K + kQBytes - 1) / kQBytes * kQBytes) {
    thread_local std::vector<int8_t> levels;
    thread_local std::vector<float> scales;
    thread_local std::vector<int32_t> starts;
    if ((int64_t)levels.size() < M * kp + 64) levels.resize(M * kp + 64);
    if ((int64_t)scales.size() < M) scales.resize(M), starts.resize(M);
    q = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(levels.data()) + 63) & ~uintptr_t(63));
    scale = scales.data();
    start = starts.data();
    const bool rotate = K % 64 == 0;
    at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
      std::vector<float> rotated(K);
      for (int64_t m = begin; m < end; ++m) {
        int32_t sum;
        scale[m] = quantize_x_row(x + m * K, K, rotate, rotated.data(), q + m * kp, kp, &sum);
        start[m] = accumulator_start(sum);
      }
    });
  }
};

struct Int8Operands {
  const QuantizedX& x;
  const int8_t* w;
  const float* wscale;
  uint16_t* y;
  int64_t M, N, K;
};

// Lane i of a tile's vector holds (x row i / NR, weight row i % NR): the lanes' rows and columns.
struct TileLanes {
  VecI row, col;
  explicit TileLanes(int nr) {
    alignas(64) int32_t r[kLanes], c[kLanes];
    for (int i = 0; i < kLanes; ++i) r[i] = i / nr, c[i] = i % nr;
    row = load_i(r);
    col = load_i(c);
  }
};

// The MR x NR tile of y at rows m0.., columns n0.. (rows and columns past M and N are computed
// from clamped rows and not stored). `wscale_lanes`: wscale of each lane's column.
// The weight rows of a tile: where K is not whole vectors, `tail` holds each row's last part,
// zero-padded to a vector (read in place of the row's end, which a vector load would overrun).
template <int NR>
struct WeightRows {
  const int8_t* row[NR];
  const int8_t* tail[NR];
  alignas(64) int8_t tail_values[NR][kQBytes];
  WeightRows(const Int8Operands& op, int64_t n0) {
    const int64_t whole = op.K / kQBytes * kQBytes;
    for (int n = 0; n < NR; ++n) {
      row[n] = op.w + std::min(n0 + n, op.N - 1) * op.K;
      tail[n] = tail_values[n];
      if (whole < op.K) {
        std::memset(tail_values[n], 0, kQBytes);
        std::memcpy(tail_values[n], row[n] + whole, op.K - whole);
      }
    }
  }
};

// How far ahead of the weight row being read (two rows of x, or one where the weights are not aligned
// for non-temporal loads) its stream is fetched into L2.
// One sequential stream a thread reads faster than NR strided ones (64 bytes of each of a tile's NR
// rows in turn, nothing fetched ahead).
constexpr int64_t kInt8StreamAheadBytes = 2048;

// Stream (one row of x, the weights aligned and K a multiple of kQBytes): the weights read by
// non-temporal loads, as linear_bf16_avx512.cpp's load_weights, which leave the caches to the rest of the step.
template <int MR, int NR, bool Stream = false>
inline void int8_tile(const Int8Operands& op, const TileLanes& lanes, const WeightRows<NR>& w_rows, int64_t m0,
                      int64_t n0, VecF wscale_lanes) {
  static_assert(MR * NR <= kLanes, "one vector of sums per tile");
  static_assert(MR <= 2 || !Stream, "more rows read several weight rows side by side");
  const int64_t kp = op.x.kp, K = op.K;
  const int8_t* x_rows[MR];
  VecI acc[MR][NR];
  for (int m = 0; m < MR; ++m) {
    const int64_t row = std::min(m0 + m, op.M - 1);
    x_rows[m] = op.x.q + row * kp;
    for (int n = 0; n < NR; ++n) acc[m][n] = first_lane(op.x.start[row]);
  }
  if constexpr (MR <= 2) {
    // One or two rows of x: each weight row read to its end before the next, so that a thread's weights
    // are one sequential stream (int32 sums: the order changes nothing). See kInt8StreamAheadBytes.
    for (int n = 0; n < NR; ++n)
      for (int64_t k = 0; k < kp; k += kQBytes) {
        QVec wq;
        if constexpr (Stream) {
          wq = stream_q(w_rows.row[n] + k);  // no tail: K is a multiple of kQBytes
        } else {
          const bool tail = k + kQBytes > K;
          const int8_t* w = tail ? w_rows.tail[n] : w_rows.row[n] + k;
          if (!tail) _mm_prefetch(reinterpret_cast<const char*>(w + kInt8StreamAheadBytes), _MM_HINT_T1);
          wq = load_q(w);
        }
        const WeightPiece piece = weight_piece(wq);
        for (int m = 0; m < MR; ++m) acc[m][n] = dot_add(acc[m][n], piece, load_q(x_rows[m] + k));
      }
  } else {
    for (int64_t k = 0; k < kp; k += kQBytes) {  // x is zero-padded to kp
      const int8_t* const* w = w_rows.row;
      int64_t wk = k;
      if (k + kQBytes > K) w = w_rows.tail, wk = 0;
      // The first block of x rows fetches the same piece of the next NR weight rows (they follow these
      // in memory; past the last, a prefetch is dropped harmlessly).
      if (m0 == 0 && wk == k)
        for (int n = 0; n < NR; ++n)
          _mm_prefetch(reinterpret_cast<const char*>(w_rows.row[n] + NR * K + k), _MM_HINT_T1);
      QVec xv[MR];
      for (int m = 0; m < MR; ++m) xv[m] = in_register_q(load_q(x_rows[m] + k));
      for (int n = 0; n < NR; ++n) {
        const WeightPiece piece = weight_piece(load_q(w[n] + wk));
        for (int m = 0; m < MR; ++m) acc[m][n] = dot_add(acc[m][n], piece, xv[m]);
      }
    }
  }
  VecI sums[kLanes];
  for (int i = 0; i < kLanes; ++i) sums[i] = i < MR * NR ? acc[i / NR][i % NR] : splat_i(0);
  const VecF xscale_lanes = permute_lanes(load_first(op.x.scale + m0, op.M - m0), lanes.row);
  const VecF v = mul(mul(to_float(sum_lanes(sums)), wscale_lanes), xscale_lanes);  // two roundings, as the reference
  // bf16 to nearest even; a NaN stays a quiet NaN
  const VecI nan_bits = or_i(bits(v), splat_i(0x00400000));
  alignas(64) int32_t out[kLanes];
  store_i(out, select_i(is_nan(v), nan_bits, round_to_bf16_upper(v)));
  const int rows = (int)std::min<int64_t>(MR, op.M - m0), cols = (int)std::min<int64_t>(NR, op.N - n0);
  for (int m = 0; m < rows; ++m)
    for (int n = 0; n < cols; ++n) op.y[(m0 + m) * op.N + n0 + n] = static_cast<uint16_t>(out[m * NR + n] >> 16);
}

// Every row of x against weight rows n0 .. n0 + NR: blocks of MR = kLanes / NR rows, then the rest.
template <int NR, bool Stream = false>
inline void int8_columns(const Int8Operands& op, const TileLanes& lanes, int64_t n0) {
  constexpr int MR = kLanes / NR;
  const WeightRows<NR> w_rows(op, n0);
  const VecF wscale_lanes = permute_lanes(load_first(op.wscale + n0, op.N - n0), lanes.col);
  int64_t m0 = 0;
  for (; m0 + MR <= op.M; m0 += MR) int8_tile<MR, NR, Stream>(op, lanes, w_rows, m0, n0, wscale_lanes);
  if constexpr (MR >= 4) {
    if (op.M - m0 == 3) int8_tile<3, NR>(op, lanes, w_rows, m0, n0, wscale_lanes);
  }
  if constexpr (MR >= 3) {
    if (op.M - m0 == 2) int8_tile<2, NR>(op, lanes, w_rows, m0, n0, wscale_lanes);
  }
  if constexpr (MR >= 2) {
    if (op.M - m0 == 1) int8_tile<1, NR>(op, lanes, w_rows, m0, n0, wscale_lanes);
  }
}

template <int NR, bool Stream = false>
void int8_run(const Int8Operands& op) {
  const int64_t groups = (op.N + NR - 1) / NR;
  // Grain: about 32 KB of weights per task.
  const int64_t grain = std::max<int64_t>(1, 32768 / (NR * std::max<int64_t>(op.K, 1)));
  const TileLanes lanes(NR);
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) int8_columns<NR, Stream>(op, lanes, g * NR);
  });
}

}  // namespace

at::Tensor linear_int8(at::Tensor x, at::Tensor qweight, at::Tensor wscale) {
  check_int8_linear_operands(x, qweight, wscale, "linear_int8");
  TORCH_CHECK(x.size(1) >= 1 && x.size(1) <= std::numeric_limits<int32_t>::max() / (127 * 127),
              "linear_int8: K must be 1 .. 2^31 / 127^2 (int32 sums)");
  x = x.contiguous();
  const int64_t M = x.size(0), N = qweight.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const QuantizedX xq(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K);
  const Int8Operands op{xq, qweight.data_ptr<int8_t>(), wscale.data_ptr<float>(),
                        reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), M, N, K};
  // One row reads each weight row once, to its end: by non-temporal loads where every row is aligned
  // for them. (Two rows keep ordinary loads: there non-temporal ones are slower.)
  const bool stream = reinterpret_cast<uintptr_t>(op.w) % kQBytes == 0 && K % kQBytes == 0;
  if (M == 1) stream ? int8_run<kLanes, true>(op) : int8_run<kLanes>(op);
  else if (M == 2) int8_run<kLanes / 2>(op);
  else int8_run<kLanes / 4>(op);
  return y;
}

#else
at::Tensor linear_int8(at::Tensor, at::Tensor, at::Tensor) {
  TORCH_CHECK(false, "linear_int8: this build has no int8 kernel (AVX-512 without VNNI)");
}
#endif
