// Kestrel CPU kernels: bf16 linear layers for small batches (decode), where the library GEMM reads
// the weights at a fraction of memory bandwidth.
//
// linear_bf16_small(x [M, K], w [N, K]) -> y [M, N], all bf16, M <= 8, K % 32 == 0.
// At M of 1..8 a linear layer is a stream over its weights: each 64-byte piece of a weight row is
// loaded once and multiplied into every row of x with AVX512-BF16 dot products (pairs of bf16
// products summed into float32 lanes).
//
// linear_bf16_amx(x [M, K], w [N, K]) -> y [M, N], M <= 128, K % 32 == 0, N % 16 == 0 (AMX-BF16);
// y bf16, or float32 holding the bf16-rounded values (the output head: logits go on in float32).
// The weights, unpacked, are the A operand: 16 of their rows by 32 of K make one tile, loaded
// straight from w. x is the B operand, repacked once per call into the VNNI pair layout; the
// result tiles are y transposed, turned back on the way out. Tile loads wait out cache misses, so
// the next rows of w are prefetched while the current ones compute.
//
// Both accumulate in float32 throughout and round each output once to bf16 (to nearest even), as
// torch rounds a float32 result; only the order of the float32 sums differs from torch's.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include "amx.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

#if !defined(__AVX512BF16__)
#error "this kernel needs AVX512-BF16; kestrel uses torch's linear elsewhere"
#endif

inline uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7F800000u) == 0x7F800000u && (b & 0x007FFFFFu)) return static_cast<uint16_t>((b >> 16) | 0x40);  // NaN
  b += 0x7FFFu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

// ROWS weight rows at a time against all M rows of x: ROWS * M accumulators in registers.
template <int M, int ROWS>
inline void rows_dot(const uint16_t* x, const uint16_t* w, int64_t K, int64_t n0, int64_t N, uint16_t* y) {
  __m512 acc[ROWS][M];
  for (int r = 0; r < ROWS; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * K + k);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (n0 + r) * K + k);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int m = 0; m < M; ++m) y[m * N + n0 + r] = to_bf16(_mm512_reduce_add_ps(acc[r][m]));
}

template <int M>
void run(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t N, int64_t K) {
  constexpr int ROWS = M <= 2 ? 4 : (M <= 4 ? 2 : 1);
  // Grain: enough rows per task that the two cores each stream long runs of the weights.
  at::parallel_for(0, N, 256, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
    for (; n + ROWS <= end; n += ROWS) rows_dot<M, ROWS>(x, w, K, n, N, y);
    for (; n < end; ++n) rows_dot<M, 1>(x, w, K, n, N, y);
  });
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KESTREL_AMX 1

using kestrel_amx::amx_usable;
using kestrel_amx::TileConfig;
using kestrel_simd::round_to_bf16_bits;
using kestrel_simd::transpose16;

// A prefetch the compiler must keep: GCC deletes a loop of _mm_prefetch calls as a loop without
// side effects.
inline void prefetch_line(const char* p) { asm volatile("prefetcht0 (%0)" : : "r"(p)); }

// x [M, K] → VNNI B tiles: [mb][kt][16 pairs][16 rows of x][2], rows past M zero.
void pack_x(const uint16_t* x, int64_t M, int64_t K, uint16_t* xb) {
  const int64_t KT = K / 32, MB = (M + 15) / 16;
  for (int64_t mb = 0; mb < MB; ++mb)
    for (int64_t kt = 0; kt < KT; ++kt) {
      __m512i r[16];
      for (int m = 0; m < 16; ++m) {
        const int64_t row = mb * 16 + m;
        r[m] = row < M ? _mm512_loadu_si512(x + row * K + kt * 32) : _mm512_setzero_si512();
      }
      transpose16(r);
      uint16_t* tile = xb + (mb * KT + kt) * 512;
      for (int p = 0; p < 16; ++p) _mm512_store_si512(tile + p * 32, r[p]);
    }
}

// C^T tile [16 n][16 m] in buf → y[m, n0..n0+15] for the rows m < rows.
// y is bf16 (uint16_t) or, for logits, float32 holding the same bf16-rounded values.
template <typename Y>
inline void store_transposed(const float* buf, int rows, Y* y, int64_t N) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(buf + i * 16);
  transpose16(r);
  for (int m = 0; m < rows; ++m) {
    const __m512i bits = round_to_bf16_bits(_mm512_castsi512_ps(r[m]));
    if constexpr (std::is_same_v<Y, float>)
      _mm512_storeu_si512(y + m * N, _mm512_slli_epi32(bits, 16));
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N), _mm512_cvtepi32_epi16(bits));
  }
}

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

// The C tiles tmm0 .. tmm(MB - 1) (y^T for x blocks mb .. mb + MB - 1, weight block nb) into y.
template <int MB, typename Y>
inline void store_c_tiles(int64_t M, int64_t mb, int64_t nb, Y* y, int64_t N) {
  alignas(64) float buf[MB][256];
  _tile_stored(0, buf[0], 64);
  if constexpr (MB > 1) _tile_stored(1, buf[1], 64);
  if constexpr (MB > 2) _tile_stored(2, buf[2], 64);
  if constexpr (MB > 3) _tile_stored(3, buf[3], 64);
  for (int m = 0; m < MB; ++m) {
    const int rows = (int)std::min<int64_t>(16, M - (mb + m) * 16);
    store_transposed(buf[m], rows, y + (mb + m) * 16 * N + nb * 16, N);
  }
}

// One block of 16 weight rows against MB (1 or 2) blocks of 16 x rows, over all of K. A tile load
// into a register must wait until the products reading it are done (tiles are not renamed), so
// successive steps of K alternate between two sets of A and B registers: C(m) in tmm(m), A in
// tmm2 / tmm3, B(m) in tmm(4 + m) / tmm(6 + m). (GCC's tile intrinsics take literal register numbers.)
template <int MB, typename Y>
inline void tile_block(const uint16_t* w, const uint16_t* xb, int64_t K, int64_t nb, int64_t mb, int64_t M,
                       Y* y, int64_t N, const Prefetch& pf) {
  static_assert(MB == 1 || MB == 2, "one or two blocks of x rows");
  const int64_t KT = K / 32, stride = K * 2;
  const uint16_t* wn = w + nb * 16 * K;
  const uint16_t* x0 = xb + mb * KT * 512;
  const uint16_t* x1 = x0 + KT * 512;
  auto even = [&](int64_t kt) {
    pf.step(kt);
    _tile_loadd(2, wn + kt * 32, stride);
    _tile_loadd(4, x0 + kt * 512, 64);
    if constexpr (MB == 2) _tile_loadd(5, x1 + kt * 512, 64);
    _tile_dpbf16ps(0, 2, 4);
    if constexpr (MB == 2) _tile_dpbf16ps(1, 2, 5);
  };
  auto odd = [&](int64_t kt) {
    pf.step(kt);
    _tile_loadd(3, wn + kt * 32, stride);
    _tile_loadd(6, x0 + kt * 512, 64);
    if constexpr (MB == 2) _tile_loadd(7, x1 + kt * 512, 64);
    _tile_dpbf16ps(0, 3, 6);
    if constexpr (MB == 2) _tile_dpbf16ps(1, 3, 7);
  };
  _tile_zero(0);
  if constexpr (MB == 2) _tile_zero(1);
  k_steps(KT, even, odd);
  store_c_tiles<MB>(M, mb, nb, y, N);
}

// One block of 16 weight rows against MB (3 or 4) blocks of 16 x rows in one pass: C(m) in tmm(m),
// A in tmm4 / tmm5 by turns over K, B alternating between tmm6 and tmm7 over the x blocks.
template <int MB, typename Y>
inline void tile_block_wide(const uint16_t* w, const uint16_t* xb, int64_t K, int64_t nb, int64_t mb, int64_t M,
                            Y* y, int64_t N, const Prefetch& pf) {
  static_assert(MB == 3 || MB == 4, "three or four blocks of x rows");
  const int64_t KT = K / 32, stride = K * 2;
  const uint16_t* wn = w + nb * 16 * K;
  const uint16_t* x0 = xb + mb * KT * 512;
  auto even = [&](int64_t kt) {
    pf.step(kt);
    _tile_loadd(4, wn + kt * 32, stride);
    _tile_loadd(6, x0 + kt * 512, 64);                _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, x0 + (KT + kt) * 512, 64);         _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(6, x0 + (2 * KT + kt) * 512, 64);     _tile_dpbf16ps(2, 4, 6);
    if constexpr (MB == 4) { _tile_loadd(7, x0 + (3 * KT + kt) * 512, 64); _tile_dpbf16ps(3, 4, 7); }
  };
  auto odd = [&](int64_t kt) {
    pf.step(kt);
    _tile_loadd(5, wn + kt * 32, stride);
    _tile_loadd(6, x0 + kt * 512, 64);                _tile_dpbf16ps(0, 5, 6);
    _tile_loadd(7, x0 + (KT + kt) * 512, 64);         _tile_dpbf16ps(1, 5, 7);
    _tile_loadd(6, x0 + (2 * KT + kt) * 512, 64);     _tile_dpbf16ps(2, 5, 6);
    if constexpr (MB == 4) { _tile_loadd(7, x0 + (3 * KT + kt) * 512, 64); _tile_dpbf16ps(3, 5, 7); }
  };
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  if constexpr (MB == 4) _tile_zero(3);
  k_steps(KT, even, odd);
  store_c_tiles<MB>(M, mb, nb, y, N);
}

// Two blocks of 16 weight rows (nb, nb + 1) against two blocks of x rows (mb, mb + 1): C(w, m) in
// tmm(2 w + m), A in tmm4 / tmm5, B in tmm6 / tmm7. Each x tile feeds two products, where the wide
// blocks above reload every x tile (from L2) for each block of weight rows.
template <typename Y>
inline void tile_block_pair(const uint16_t* w, const uint16_t* xb, int64_t K, int64_t nb, int64_t mb, int64_t M,
                            Y* y, int64_t N, const Prefetch& pf) {
  const int64_t KT = K / 32, stride = K * 2;
  const uint16_t* w0 = w + nb * 16 * K;
  const uint16_t* w1 = w0 + 16 * K;
  const uint16_t* x0 = xb + mb * KT * 512;
  const uint16_t* x1 = x0 + KT * 512;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kt = 0; kt < KT; ++kt) {
    pf.step(kt);
    _tile_loadd(4, w0 + kt * 32, stride);
    _tile_loadd(6, x0 + kt * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, x1 + kt * 512, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, w1 + kt * 32, stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float buf[4][256];
  _tile_stored(0, buf[0], 64);
  _tile_stored(1, buf[1], 64);
  _tile_stored(2, buf[2], 64);
  _tile_stored(3, buf[3], 64);
  for (int wb = 0; wb < 2; ++wb)
    for (int m = 0; m < 2; ++m) {
      const int rows = (int)std::min<int64_t>(16, M - (mb + m) * 16);
      store_transposed(buf[2 * wb + m], rows, y + (mb + m) * 16 * N + (nb + wb) * 16, N);
    }
}

// All x rows (an even number of 16-row blocks) against weight rows [16 nb, 16 nb + 32), two x blocks
// a pass; the next pair's weight rows are prefetched over the passes.
template <typename Y>
inline void n_block_pair(const uint16_t* w, const uint16_t* xb, int64_t K, int64_t nb, int64_t M, Y* y, int64_t N) {
  const int64_t MBS = (M + 15) / 16, passes = MBS / 2;
  const char* pf = reinterpret_cast<const char*>(w + (nb + 2) * 16 * K);
  const int64_t pf_lines = nb + 2 < N / 16 ? 2 * 16 * K * 2 / 64 : 0;
  const int64_t per_pass = (pf_lines + passes - 1) / passes;
  for (int64_t p = 0; p < passes; ++p) {
    const Prefetch pass_pf(pf + p * per_pass * 64, std::max<int64_t>(0, std::min(per_pass, pf_lines - p * per_pass)),
                           K / 32);
    tile_block_pair<Y>(w, xb, K, nb, 2 * p, M, y, N, pass_pf);
  }
}

// All x rows against weight rows [16 nb, 16 nb + 16), in passes of up to four blocks of x rows;
// the next block's weight rows are prefetched over the passes (tile loads wait out each cache miss).
template <typename Y>
inline void n_block(const uint16_t* w, const uint16_t* xb, int64_t K, int64_t nb, int64_t M, Y* y, int64_t N) {
  const int64_t MBS = (M + 15) / 16;
  const int64_t passes = (MBS + 3) / 4;
  const char* pf = reinterpret_cast<const char*>(w + (nb + 1) * 16 * K);
  const int64_t pf_lines = nb + 1 < N / 16 ? 16 * K * 2 / 64 : 0;
  const int64_t per_pass = (pf_lines + passes - 1) / passes;
  for (int64_t mb = 0, p = 0; mb < MBS; ++p) {
    const Prefetch pass_pf(pf + p * per_pass * 64, std::max<int64_t>(0, std::min(per_pass, pf_lines - p * per_pass)),
                           K / 32);
    const int64_t left = MBS - mb;
    if (left >= 4) { tile_block_wide<4, Y>(w, xb, K, nb, mb, M, y, N, pass_pf); mb += 4; continue; }
    if (left == 3) { tile_block_wide<3, Y>(w, xb, K, nb, mb, M, y, N, pass_pf); mb += 3; continue; }
    if (left >= 2) { tile_block<2, Y>(w, xb, K, nb, mb, M, y, N, pass_pf); mb += 2; }
    else { tile_block<1, Y>(w, xb, K, nb, mb, M, y, N, pass_pf); mb += 1; }
  }
}

// Pairs of weight blocks against pairs of x blocks where both counts are even (measured: 7-18% faster
// at 17-32 and 65-128 rows, even at 49-64; an odd x block left over made it slower), else one weight
// block against up to four x blocks.
template <typename Y>
void run(const uint16_t* w, const uint16_t* xb, Y* y, int64_t M, int64_t N, int64_t K) {
  const bool pairs = ((M + 15) / 16) % 2 == 0 && (N / 16) % 2 == 0;
  at::parallel_for(0, pairs ? N / 32 : N / 16, 1, [&](int64_t begin, int64_t end) {
    TileConfig cfg;
    for (int i = 0; i < 8; ++i) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }
    _tile_loadconfig(&cfg);
    for (int64_t i = begin; i < end; ++i) {
      if (pairs) n_block_pair(w, xb, K, 2 * i, M, y, N);
      else n_block(w, xb, K, i, M, y, N);
    }
    _tile_release();
  });
}

#endif  // AMX

}  // namespace

torch::Tensor linear_bf16_small(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x and w must be 2-D");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16, "bf16 only");
  TORCH_CHECK(x.size(1) == w.size(1), "x and w disagree on K");
  TORCH_CHECK(x.size(1) % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, "M must be 1..8");
  x = x.contiguous();
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  auto y = torch::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  switch (M) {
    case 1: run<1>(xp, wp, yp, N, K); break;
    case 2: run<2>(xp, wp, yp, N, K); break;
    case 3: run<3>(xp, wp, yp, N, K); break;
    case 4: run<4>(xp, wp, yp, N, K); break;
    case 5: run<5>(xp, wp, yp, N, K); break;
    case 6: run<6>(xp, wp, yp, N, K); break;
    case 7: run<7>(xp, wp, yp, N, K); break;
    default: run<8>(xp, wp, yp, N, K); break;
  }
  return y;
}

#if KESTREL_AMX
torch::Tensor linear_bf16_amx(torch::Tensor x, torch::Tensor w, bool float_out) {
  TORCH_CHECK(amx_usable(), "this CPU or kernel does not allow AMX");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x and w must be 2-D");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16, "bf16 only");
  TORCH_CHECK(x.size(1) == w.size(1), "x and w disagree on K");
  TORCH_CHECK(x.size(1) % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(w.size(0) % 16 == 0, "N must be a multiple of 16");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 128, "M must be 1..128");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  auto y = torch::empty({M, N}, x.options().dtype(float_out ? torch::kFloat32 : torch::kBFloat16));
  const int64_t MB = (M + 15) / 16;
  auto xb = torch::empty({MB * 16 * K + 32}, x.options());  // + room to align to 64 bytes
  auto* xbp = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(xb.data_ptr<at::BFloat16>()) + 63) & ~uintptr_t(63));
  pack_x(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, xbp);
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  if (float_out) run(wp, xbp, y.data_ptr<float>(), M, N, K);
  else run(wp, xbp, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), M, N, K);
  return y;
}

#else
torch::Tensor linear_bf16_amx(torch::Tensor, torch::Tensor, bool) { TORCH_CHECK(false, "built without AMX"); }
bool amx_usable() { return false; }
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16_small", &linear_bf16_small, "y = x w^T for bf16 x of 1..8 rows (CPU, AVX512-BF16)");
  m.def("linear_bf16_amx", &linear_bf16_amx,
        "y = x w^T for bf16 x of 1..128 rows (CPU, AMX-BF16); float_out: y in float32, rounded as bf16",
        py::arg("x"), py::arg("w"), py::arg("float_out") = false);
  m.def("amx_usable", [] { return amx_usable(); }, "whether linear_bf16_amx can run here");
}
