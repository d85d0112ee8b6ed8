// Kestrel CPU kernel: bf16 matrix-vector products for small batches (decode at low concurrency).
//
// linear_bf16_small(x [M, K], w [N, K]) -> y [M, N], all bf16, M <= 8, K % 32 == 0.
// At M of 1..8 a linear layer is a stream over its weights: the library GEMM reads them at a
// fraction of memory bandwidth there, while here each 64-byte piece of a weight row is loaded once
// and multiplied into every row of x with AVX512-BF16 dot products (pairs of bf16 products summed
// into float32 lanes). Accumulation is float32 throughout; each output is rounded once to bf16
// (round to nearest even), as torch rounds a float32 result.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16_small", &linear_bf16_small, "y = x w^T for bf16 x of 1..8 rows (CPU, AVX512-BF16)");
}
