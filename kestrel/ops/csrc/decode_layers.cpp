// DecodeLayers: the decode plan's layer loop in C++, over the matmul the plan binds (matmul_fn.h).
#include "kernel.h"
#include "kernels.h"
#include "matmul_fn.h"

#include <omp.h>

#include <atomic>
#include <exception>

namespace {

// The matmul DecodeLayers calls (any of bindings.cpp's matmul_address) and, for a bf16 batch of
// 1..15 rows, its per-thread share.
using kestrel_matmul::MatmulFn;
using kestrel_matmul::MatmulSliceFn;

// A projection's output features: w [N, K], or a packed bf16 weight [N / 16, K, 16].
inline int64_t out_features(const at::Tensor& w) { return w.dim() == 3 ? w.size(0) * w.size(2) : w.size(0); }

// The first error of a region's threads.
struct RegionError {
  std::atomic<bool> raised{false};
  std::exception_ptr error;
};

// The threads of one parallel region, walking a layer's phases in step: a matmul phase gives each
// thread its share of the output columns, a serial phase runs on thread 0 (the small row-wise kernels,
// whose own at::parallel_for runs inline inside a region); a barrier ends each phase. A serial phase
// that throws stops the work of every later phase (the barriers still meet) and the error is
// rethrown once the region has ended: nothing may leave an OpenMP region by an exception.
class Team {
 public:
  Team(int thread, int threads, RegionError& error) : thread_(thread), threads_(threads), error_(error) {}

  template <typename F>
  void serial(const F& f) {
    if (thread_ == 0) guarded(f);
#pragma omp barrier
  }

  // y = x w^T by the slice matmul.
  void matmul(MatmulSliceFn slice, const at::Tensor& x, const at::Tensor& w, const at::Tensor& y) {
    guarded([&] {
      const int64_t N = out_features(w);
      const auto [begin, end] = share(N);
      if (begin < end) slice(bits(x), bits(w), bits(y), x.size(0), N, w.size(1), begin, end);
    });
#pragma omp barrier
  }

 private:
  template <typename F>
  void guarded(const F& f) {
    if (error_.raised.load()) return;
    try {
      f();
    } catch (...) {
#pragma omp critical(kestrel_region_error)
      if (!error_.raised.exchange(true)) error_.error = std::current_exception();
    }
  }

  static uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<c10::BFloat16>()); }

  // This thread's output columns of N: whole blocks of kSliceColumns, as even as they go.
  std::pair<int64_t, int64_t> share(int64_t N) const {
    const int64_t blocks = (N + kestrel_matmul::kSliceColumns - 1) / kestrel_matmul::kSliceColumns;
    const int64_t b0 = blocks * thread_ / threads_, b1 = blocks * (thread_ + 1) / threads_;
    return {b0 * kestrel_matmul::kSliceColumns, std::min(N, b1 * kestrel_matmul::kSliceColumns)};
  }

  int thread_, threads_;
  RegionError& error_;
};

// f(team) on every thread of one OpenMP region (the same threads as at::parallel_for's).
template <typename F>
void in_one_region(const F& f) {
  RegionError error;
  const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads)
  {
    Team team(omp_get_thread_num(), omp_get_num_threads(), error);
    f(team);
  }
  if (error.raised.load()) std::rethrow_exception(error.error);
}

// The layer loop of kestrel/model/decode_plan.py for a Llama-family model without q/k norms or biases,
// on the model-dtype cache, in C++: the same kernels in the same order on the same tensors (the matmul
// the plan binds, by its address), so its hidden states are bit-identical to the Python loop's (and so
// to the model's forward). What it saves is the Python between the ~300 kernel calls of a step.
//
// With a slice matmul (bf16, 1..15 rows) a layer runs in three parallel regions instead of ~6: the
// attention's two (its own kernel, as in the loop above), and one from the o projection through the
// next layer's qkv projection and rotary write, in which each thread computes its share of each
// projection and the small kernels run on thread 0 between barriers: the threads no longer fork and
// join around every kernel. The serial phases call the same kernels, and the shares sum every output
// as the whole matmul does, so the results stay bit-identical. (The start of each thread's next
// share is not prefetched across the barrier: that gained nothing.)
class DecodeLayers {
 public:
  // weights: 6 per layer (input norm, qkv, o, post-attention norm, gate_up, down), the norms in the
  // model's dtype, the projections in one dtype (the model's, or uint8: packed GGUF blocks); caches: k, v
  // per layer, each [num_slots, kv_heads, head_dim]; matmul_address: a MatmulFn for the projections;
  // slice_address: its MatmulSliceFn for 1..15 rows (bf16 only; for packed weights, the packed one), or 0.
  // The projections are all [N, K] or all packed ([N / 16, K, 16] bf16, or linear_gguf's layout).
  DecodeLayers(std::vector<at::Tensor> weights, std::vector<at::Tensor> caches, int64_t heads,
               double eps, double scale, int64_t matmul_address, int64_t slice_address)
      : weights_(std::move(weights)), caches_(std::move(caches)), heads_(heads), eps_(eps), scale_(scale),
        matmul_(reinterpret_cast<MatmulFn>(matmul_address)), slice_(reinterpret_cast<MatmulSliceFn>(slice_address)) {
    TORCH_CHECK(weights_.size() % 6 == 0 && caches_.size() * 3 == weights_.size(),
                "DecodeLayers: 6 weights and 2 caches per layer");
    TORCH_CHECK(matmul_ != nullptr, "DecodeLayers: no matmul");
    for (size_t i = 0; i < weights_.size(); ++i)  // the norms in one dtype, the projections in one
      TORCH_CHECK(weights_[i].scalar_type() == weights_[i % 6 == 0 || i % 6 == 3 ? 0 : 1].scalar_type() &&
                  weights_[i].is_contiguous(), "DecodeLayers: contiguous norms of one dtype, projections of one");
    TORCH_CHECK(slice_ == nullptr || weights_.empty() || weights_[1].scalar_type() == at::kBFloat16,
                "DecodeLayers: a slice matmul takes bf16 weights");
    for (size_t i = 0; i < weights_.size(); ++i)
      TORCH_CHECK(i % 6 == 0 || i % 6 == 3 || weights_[i].dim() == weights_[1].dim(),
                  "DecodeLayers: the projections are all packed or none is");
  }

  // x [n, hidden]: the embedded tokens. Returns the hidden states before the final norm.
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                     at::Tensor table, at::Tensor seq_lens, int64_t block_size) const {
    if (slice_ != nullptr && x.size(0) < kestrel_matmul::kSliceMaxRows && !caches_.empty())
      return forward_in_regions(x, cos, sin, slots, table, seq_lens, block_size);
    const int64_t n = x.size(0), layers = static_cast<int64_t>(caches_.size() / 2);
    at::Tensor residual, h;
    for (int64_t l = 0; l < layers; ++l) {
      const at::Tensor* w = weights_.data() + 6 * l;
      const at::Tensor &k_cache = caches_[2 * l], &v_cache = caches_[2 * l + 1];
      if (!residual.defined()) {
        residual = x;
        h = rms_norm(x, c10::nullopt, w[0], eps_);
      } else {
        h = rms_norm(x, residual, w[0], eps_);  // residual += x, in place
      }
      const int64_t head_dim = k_cache.size(2), kv_heads = k_cache.size(1);
      at::Tensor qkv = matmul_(h, w[1]).view({n, heads_ + 2 * kv_heads, head_dim});
      rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slots, heads_);
      at::Tensor out = paged_decode_attention(qkv.slice(1, 0, heads_), k_cache, v_cache, table, seq_lens,
                                              block_size, scale_, true, 0);
      h = rms_norm(matmul_(out.view({n, heads_ * head_dim}), w[2]), residual, w[3], eps_);
      x = matmul_(silu_and_mul(matmul_(h, w[4])), w[5]);
    }
    return at::add(x, residual);
  }

 private:
  // The loop above for 1..15 rows on the slice matmul, a layer in three parallel regions (see the class).
  at::Tensor forward_in_regions(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                const at::Tensor& slots, const at::Tensor& table,
                                const at::Tensor& seq_lens, int64_t block_size) const {
    const int64_t n = x.size(0), layers = static_cast<int64_t>(caches_.size() / 2);
    const int64_t head_dim = caches_[0].size(2), kv_heads = caches_[0].size(1);
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.dim() == 2 &&
                x.size(1) == weights_[1].size(1), "DecodeLayers: x must be contiguous bf16 [n, hidden]");
    const auto w = [&](int64_t l, int i) -> const at::Tensor& { return weights_[6 * l + i]; };
    at::Tensor residual = x, h, act;
    at::Tensor qkv = at::empty({n, out_features(w(0, 1))}, x.options());
    at::Tensor o = at::empty({n, out_features(w(0, 2))}, x.options());
    at::Tensor gate_up = at::empty({n, out_features(w(0, 4))}, x.options());
    at::Tensor down = at::empty({n, out_features(w(0, 5))}, x.options());
    const auto qkv_heads = qkv.view({n, heads_ + 2 * kv_heads, head_dim});
    // The first layer's input norm, qkv projection and rotary write; each region below ends with the
    // next layer's.
    const auto into_qkv = [&](Team& team, int64_t l) {
      team.matmul(slice_, h, w(l, 1), qkv);
      team.serial([&] { rotary_write_kv(qkv_heads, cos, sin, caches_[2 * l], caches_[2 * l + 1], slots, heads_); });
    };
    in_one_region([&](Team& team) {
      team.serial([&] { h = rms_norm(x, c10::nullopt, w(0, 0), eps_); });
      into_qkv(team, 0);
    });
    for (int64_t l = 0; l < layers; ++l) {
      const at::Tensor out = paged_decode_attention(qkv_heads.slice(1, 0, heads_), caches_[2 * l],
                                                    caches_[2 * l + 1], table, seq_lens, block_size, scale_, true, 0)
                                    .view({n, heads_ * head_dim});
      const bool last = l + 1 == layers;
      in_one_region([&](Team& team) {
        team.matmul(slice_, out, w(l, 2), o);
        team.serial([&] { h = rms_norm(o, residual, w(l, 3), eps_); });  // residual += o, in place
        team.matmul(slice_, h, w(l, 4), gate_up);
        team.serial([&] { act = silu_and_mul(gate_up); });
        team.matmul(slice_, act, w(l, 5), down);
        if (!last) {
          team.serial([&] { h = rms_norm(down, residual, w(l + 1, 0), eps_); });  // residual += down
          into_qkv(team, l + 1);
        }
      });
    }
    return at::add(down, residual);
  }

  std::vector<at::Tensor> weights_, caches_;
  int64_t heads_;
  double eps_, scale_;
  MatmulFn matmul_;
  MatmulSliceFn slice_;
};

}  // namespace

void bind_decode_layers(py::module& m) {
  py::class_<DecodeLayers>(m, "DecodeLayers")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, double, double, int64_t,
                    int64_t>(),
           py::arg("weights"), py::arg("caches"), py::arg("heads"), py::arg("eps"), py::arg("scale"),
           py::arg("matmul_address"), py::arg("slice_address") = 0)
      .def("__call__", &DecodeLayers::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("slots"),
           py::arg("table"), py::arg("seq_lens"), py::arg("block_size"));
}
