// The kernels one extension exports, one declaration each, grouped by the source that defines them.
// bindings.cpp binds them to Python; decode_layers.cpp calls the layer's kernels directly.
// docs/kernels.md maps the sources to their PyTorch references and tests, and keeps the measurements
// behind their design.
#pragma once

#include "torch_api.h"
#include "isa.h"

#include <cstdint>

// decode_attention.cpp
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                  at::Tensor seq_lens, int64_t block_size, double scale, bool in_q_dtype,
                                  int64_t window);
bool supports(int64_t head_dim, int64_t group);

// elementwise.cpp
at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps);
at::Tensor silu_and_mul(at::Tensor x);
at::Tensor gelu_tanh_and_mul(at::Tensor x);
void rotary_write_kv(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache,
                     c10::optional<at::Tensor> slot_mapping, int64_t num_heads);
at::Tensor argmax_rows(at::Tensor x);

// int8_kv.cpp
void rotary_write_kv_int8(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor k_t, at::Tensor k_scale,
                          at::Tensor v, at::Tensor v_scale, at::Tensor slot_mapping, int64_t num_heads);
at::Tensor paged_decode_attention_int8(at::Tensor q, at::Tensor k_t, at::Tensor k_scale, at::Tensor v,
                                       at::Tensor v_scale, at::Tensor block_tables, at::Tensor seq_lens,
                                       int64_t block_size, double scale, bool in_q_dtype);

// linear_float.cpp; the slices are kestrel_matmul::MatmulSliceFn (matmul_fn.h) on [N, K] and packed weights.
at::Tensor linear_f32(at::Tensor x, at::Tensor w);
at::Tensor linear_bf16(at::Tensor x, at::Tensor w, bool float_out);
void linear_bf16_slice_plain(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t M, int64_t N, int64_t K,
                             int64_t n_begin, int64_t n_end);
void linear_bf16_slice_packed(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t M, int64_t N, int64_t K,
                              int64_t n_begin, int64_t n_end);

// linear_gguf.cpp
at::Tensor linear_gguf(at::Tensor x, at::Tensor w, bool float_out);

// linear_int8.cpp (linear_int8 in KESTREL_HAS_INT8_LINEAR builds only; the check in every build, for
// linear_int8_amx too)
at::Tensor linear_int8(at::Tensor x, at::Tensor qweight, at::Tensor wscale);
void check_int8_linear_operands(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& wscale,
                                const char* kernel);

// decode_layers.cpp: the class DecodeLayers, bound into the module.
void bind_decode_layers(py::module& m);

// prefill_attention.cpp
at::Tensor prefill_attention(at::Tensor q, at::Tensor k, at::Tensor v, double scale);

#if defined(KESTREL_HAS_AVX512_BF16)
// prefill_attention.cpp
at::Tensor prefill_attention_avx512(at::Tensor q, at::Tensor k, at::Tensor v, double scale);
at::Tensor prefill_attention_amx(at::Tensor q, at::Tensor k, at::Tensor v, double scale);
bool prefill_amx_usable();

// linear_bf16_avx512.cpp
at::Tensor linear_bf16_avx512(at::Tensor x, at::Tensor w, bool float_out);
at::Tensor linear_bf16_amx(at::Tensor x, at::Tensor w, bool float_out);
at::Tensor linear_int8_amx(at::Tensor x, at::Tensor qweight, at::Tensor wscale);
bool linear_amx_usable();
void linear_bf16_avx512_slice_plain(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t M, int64_t N,
                                    int64_t K, int64_t n_begin, int64_t n_end);
void linear_bf16_avx512_slice_packed(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t M, int64_t N,
                                     int64_t K, int64_t n_begin, int64_t n_end);
#endif
