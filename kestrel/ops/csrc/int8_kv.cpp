// The int8 KV cache (--kv-cache-dtype int8): rotary_write_kv_int8 and its decode attention.
#include "kernel.h"
#include "kernels.h"
#include "int8_kv.h"
#include "rotary.h"

// ---- int8 KV cache (--kv-cache-dtype int8) ----
//
// Each (token, KV head) row of head_dim values is stored as int8 with one float32 scale:
// x ≈ q * scale, scale = max|x| / 127, q = round-half-even(x / scale) (0 and scale 0 for a zero row).
// K is transposed within each block of 16 tokens, so that a block's 16 scores come out of 16 / kLanes
// vectors per dimension; the layout, the argument checks and a decode item's order of reading are in
// int8_kv.h. The PyTorch reference is in kestrel/attention/kv_cache.py (write_kv, gather_kv).

namespace {

constexpr int64_t kInt8Block = kestrel_int8_kv::kBlock;
constexpr int kHalves = kInt8Block / kLanes;  // vectors per block of 16 scores
static_assert(kInt8Block % kLanes == 0, "whole vectors per block");

// Quantize one row of d floats (d % kLanes == 0); returns the scale. Bit for bit the same in both builds.
inline float quantize_row(const float* x, int64_t d, int8_t* q, int64_t q_stride) {
  VecF amax = zero();
  for (int64_t i = 0; i < d; i += kLanes) amax = max(amax, abs(load_f32(x + i)));
  const float m = hmax(amax);
  if (m == 0.f) {
    for (int64_t i = 0; i < d; ++i) q[i * q_stride] = 0;
    return 0.f;
  }
  const float scale = m / 127.f;
  const VecF sv = splat(scale);
  alignas(64) int32_t qi[kLanes];
  for (int64_t i = 0; i < d; i += kLanes) {
    // true division, then round half to even (the default rounding mode), as torch.round(x / scale)
    store_rounded(qi, div(load_f32(x + i), sv));
    for (int j = 0; j < kLanes; ++j) q[(i + j) * q_stride] = static_cast<int8_t>(qi[j]);
  }
  return scale;
}

template <typename T>
void rotary_write_kv_int8_impl(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                               at::Tensor& k_t, at::Tensor& k_scale, at::Tensor& v, at::Tensor& v_scale,
                               const at::Tensor& slots, int64_t num_heads) {
  const int64_t d = qkv.size(2), kv_heads = (qkv.size(1) - num_heads) / 2;
  int8_t* ktp = k_t.data_ptr<int8_t>();
  float* ksp = k_scale.data_ptr<float>();
  int8_t* vp = v.data_ptr<int8_t>();
  float* vsp = v_scale.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  rotate_tokens<T>(qkv, cos, sin, num_heads, 16, [&](int64_t t, const T* row) {
    float row_f[256];  // head_dim <= 256
    const auto to_float = [&](const T* x) {
      for (int64_t i = 0; i < d; i += kLanes) store(row_f + i, load_chunk(x + i));
    };
    const int64_t blk = slot[t] / kInt8Block, off = slot[t] % kInt8Block;
    for (int64_t h = 0; h < kv_heads; ++h) {
      to_float(row + (num_heads + h) * d);
      ksp[(blk * kv_heads + h) * kInt8Block + off] =
          quantize_row(row_f, d, ktp + (blk * kv_heads + h) * d * kInt8Block + off, kInt8Block);
      to_float(row + (num_heads + kv_heads + h) * d);
      vsp[slot[t] * kv_heads + h] = quantize_row(row_f, d, vp + (slot[t] * kv_heads + h) * d, 1);
    }
  });
}

// Decode attention over the int8 cache: one (sequence, KV head) per work item, items to threads by
// cost (parallel_for_by_cost); the scores of a block's 16 keys (kHalves vectors) from the transposed
// K, kInt8HeadChunk<G> query heads at a time, each with kInt8Partials<G> partial sums, so that many
// FMA chains are in flight rather than one per head waiting on the latency of the one before; a
// softmax over each head's scores, each exponential stored times its V row's scale; then the V rows
// weighted, kInt8VChunk<G, C> vectors of dimensions at a time (the item's V rows, read again for
// each, are in L2 by then). While a block (K or V) is computed, the block kInt8PrefetchUnits ahead
// in the item's order of reading (K blocks, then V blocks, then the next item's) is prefetched a
// line at a time, spread over the computation rather than in a burst.
// The chunks are sized by the registers: 32 (AVX-512) hold every head's 4 partial sums and a whole
// V row per head; 16 (AVX2) take heads 3 or 4 at a time. Together the several chains, the shares by
// cost and the spread prefetch outrun one chain per head, equal-count shares and a burst one block
// ahead; kInt8PrefetchUnits = 5 gains a little over 2 or 3.
template <int G>
constexpr int kInt8HeadChunk = kRegisters >= 32 ? G : (G % 3 == 0 ? 3 : (G % 4 == 0 ? 4 : (G % 2 == 0 ? 2 : 1)));
template <int G>
constexpr int kInt8Partials = kRegisters >= 32 ? 4 : (2 * kInt8HeadChunk<G> >= 8 ? 1 : 2);
template <int G, int C>
constexpr int kInt8VChunk = kRegisters >= 32 ? C : (G <= 2 ? 4 : (G <= 5 ? 2 : 1));
constexpr int64_t kInt8PrefetchUnits = 5;

template <int D, int G>
void run_int8(const at::Tensor& q, const at::Tensor& k_t, const at::Tensor& k_scale,
              const at::Tensor& v, const at::Tensor& v_scale, const at::Tensor& block_tables,
              const at::Tensor& seq_lens, at::Tensor& out, float scale) {
  constexpr int C = D / kLanes, JC = kInt8HeadChunk<G>, P = kInt8Partials<G>, VC = kInt8VChunk<G, C>;
  static_assert(C % VC == 0 && G % JC == 0 && 4 % P == 0, "whole chunks of heads and of dimensions");
  constexpr int64_t BS = kInt8Block;
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), kv_heads = v.size(1);
  const int64_t max_blocks = block_tables.size(1);
  const float* qf = q.data_ptr<float>();
  const int8_t* ktp = k_t.data_ptr<int8_t>();
  const float* ksp = k_scale.data_ptr<float>();
  const int8_t* vp = v.data_ptr<int8_t>();
  const float* vsp = v_scale.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t items = num_seqs * kv_heads;
  const kestrel_int8_kv::ReadOrder<D> order{ktp, vp, tables, lens, kv_heads, max_blocks, items};
  using Rows = typename kestrel_int8_kv::ReadOrder<D>::Rows;

  auto one_item = [&](int64_t item, std::vector<float>& scores, std::vector<float>& vscales) {
    const int64_t s = item / kv_heads, h = item % kv_heads, len = lens[s];
    float* dst = op + (s * num_heads + h * G) * D;
    if (len <= 0) {
      std::memset(dst, 0, sizeof(float) * G * D);
      return;
    }
    const int64_t* table = tables + s * max_blocks;
    const int64_t nb = (len + BS - 1) / BS, span = nb * BS;
    alignas(64) float qs[D][G];  // scaled q by dimension: a dimension's G broadcasts side by side
    for (int j = 0; j < G; ++j)
      for (int dd = 0; dd < D; ++dd) qs[dd][j] = qf[(s * num_heads + h * G + j) * D + dd] * scale;
    scores.resize(G * span);
    vscales.resize(span);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t blk = table[b];
      const int8_t* kb = ktp + (blk * kv_heads + h) * D * BS;
      const Rows ahead = order.unit(item, b + kInt8PrefetchUnits);
      const int64_t n = std::min<int64_t>(BS, len - b * BS);
      for (int j0 = 0; j0 < G; j0 += JC) {
        VecF acc[JC][kHalves][P];
        for (int j = 0; j < JC; ++j)
          for (int half = 0; half < kHalves; ++half)
            for (int p = 0; p < P; ++p) acc[j][half][p] = zero();
        for (int dd = 0; dd < D; dd += 4) {
          if (j0 == 0) ahead.prefetch(dd / 4);  // D / 4 lines: the unit's 16 * D / 64
          for (int i = 0; i < 4; ++i) {
            VecF kd[kHalves];
            for (int half = 0; half < kHalves; ++half) kd[half] = load_int8(kb + (dd + i) * BS + half * kLanes);
            for (int j = 0; j < JC; ++j) {
              const VecF qv = splat(qs[dd + i][j0 + j]);
              for (int half = 0; half < kHalves; ++half) acc[j][half][i % P] = fma(qv, kd[half], acc[j][half][i % P]);
            }
          }
        }
        for (int j = 0; j < JC; ++j)
          for (int half = 0; half < kHalves; ++half) {
            VecF sum = acc[j][half][0];
            for (int p = 1; p < P; ++p) sum = add(sum, acc[j][half][p]);
            const VecF sk = load_f32(ksp + (blk * kv_heads + h) * BS + half * kLanes);
            store(scores.data() + (j0 + j) * span + b * BS + half * kLanes,
                  select(lanes_below(n - half * kLanes), mul(sum, sk), splat(neg_inf)));
          }
      }
      // The block's V row scales, in the order of the scores (16 at a stride of kv_heads).
      for (int half = 0; half < kHalves; ++half)
        store(vscales.data() + b * BS + half * kLanes,
              gather_strided(vsp + (blk * BS + half * kLanes) * kv_heads + h, kv_heads));
    }
    // Each score becomes its exponential times its V row's scale; the sum is of the exponentials.
    float inv[G];
    for (int j = 0; j < G; ++j) {
      float* sj = scores.data() + j * span;
      VecF mv = splat(neg_inf);
      for (int64_t t = 0; t < span; t += kLanes) mv = max(mv, load_f32(sj + t));
      const VecF m = splat(hmax(mv));
      VecF sum = zero();
      for (int64_t t = 0; t < span; t += kLanes) {
        const VecF e = keep(lanes_below(len - t), exp_clamped(sub(load_f32(sj + t), m)));
        store(sj + t, mul(e, load_f32(vscales.data() + t)));
        sum = add(sum, e);
      }
      inv[j] = 1.f / hsum(sum);
    }
    for (int c0 = 0; c0 < C; c0 += VC) {
      VecF acc[G][VC];
      for (int j = 0; j < G; ++j)
        for (int c = 0; c < VC; ++c) acc[j][c] = zero();
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t base = table[b] * BS, n = std::min<int64_t>(BS, len - b * BS);
        const Rows ahead = c0 == 0 ? order.unit(item, nb + b + kInt8PrefetchUnits) : Rows{};
        const float* pb = scores.data() + b * BS;
        for (int64_t o = 0; o < n; ++o) {
          for (int i = 0; i < D / 64; ++i) ahead.prefetch(o * (D / 64) + i);
          const int8_t* row = vp + ((base + o) * kv_heads + h) * D + c0 * kLanes;
          VecF vr[VC];
          for (int c = 0; c < VC; ++c) vr[c] = load_int8(row + c * kLanes);
          for (int j = 0; j < G; ++j) {
            const VecF p = splat(pb[j * span + o]);
            for (int c = 0; c < VC; ++c) acc[j][c] = fma(p, vr[c], acc[j][c]);
          }
        }
      }
      for (int j = 0; j < G; ++j)
        for (int c = 0; c < VC; ++c) store(dst + j * D + (c0 + c) * kLanes, mul(acc[j][c], splat(inv[j])));
    }
  };

  parallel_for_by_cost(items, [&](int64_t item) { return 1 + order.blocks_of(item); }, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, vscales;
    for (int64_t item = begin; item < end; ++item) one_item(item, scores, vscales);
  });
}

}  // namespace

// rotary_write_kv for the int8 cache: rotates q and k in place and writes k, v quantized.
void rotary_write_kv_int8(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor k_t,
                          at::Tensor k_scale, at::Tensor v, at::Tensor v_scale, at::Tensor slot_mapping,
                          int64_t num_heads) {
  const auto slots = kestrel_int8_kv::checked_write_args(qkv, cos, sin, k_t, k_scale, v, v_scale, slot_mapping,
                                                        num_heads, kLanes);
  with_float_dtype(qkv.scalar_type(), "rotary_write_kv_int8", [&](auto t) {
    rotary_write_kv_int8_impl<decltype(t)>(qkv, cos, sin, k_t, k_scale, v, v_scale, slots, num_heads);
  });
}

// Decode attention over the int8 cache (layout above; block_size 16). Returns float32, or with
// `in_q_dtype` q's dtype.
at::Tensor paged_decode_attention_int8(at::Tensor q, at::Tensor k_t, at::Tensor k_scale, at::Tensor v,
                                       at::Tensor v_scale, at::Tensor block_tables, at::Tensor seq_lens,
                                       int64_t block_size, double scale, bool in_q_dtype) {
  kestrel_int8_kv::check_decode_args(q, k_t, k_scale, v, v_scale, block_size);
  const auto out_dtype = q.scalar_type();
  auto qf = q.to(at::kFloat).contiguous();
  auto out = at::empty(qf.sizes(), qf.options());
  block_tables = block_tables.to(at::kLong).contiguous();
  seq_lens = seq_lens.to(at::kLong).contiguous();
  const int64_t d = q.size(2), g = q.size(1) / v.size(1);
  const float sc = static_cast<float>(scale);
  const bool done = with_head_shape(d, g, [&](auto dd, auto gg) {
    run_int8<decltype(dd)::value, decltype(gg)::value>(qf, k_t, k_scale, v, v_scale, block_tables, seq_lens, out, sc);
  });
  TORCH_CHECK(done, "no kernel for head_dim ", d, " with ", g, " query heads per KV head");
  return in_q_dtype ? in_dtype(out, out_dtype) : out;
}
