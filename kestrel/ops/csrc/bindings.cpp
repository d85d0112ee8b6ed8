// The Python face of one extension (one per instruction set, kestrel/ops/build.py): every kernel of
// kernels.h, the attributes that say what this build has, and the addresses of the matmuls that the
// decode plan's layer loop (decode_layers.cpp) calls as plain functions (matmul_fn.h).
#include "kernels.h"
#include "matmul_fn.h"

#include <string>

namespace {

using kestrel_matmul::MatmulFn;
using kestrel_matmul::MatmulSliceFn;

at::Tensor linear_f32_matmul(const at::Tensor& x, const at::Tensor& w) { return linear_f32(x, w); }
at::Tensor linear_bf16_matmul(const at::Tensor& x, const at::Tensor& w) { return linear_bf16(x, w, false); }
at::Tensor linear_gguf_matmul(const at::Tensor& x, const at::Tensor& w) { return linear_gguf(x, w, false); }
#if defined(KESTREL_HAS_AVX512_BF16)
at::Tensor avx512_matmul(const at::Tensor& x, const at::Tensor& w) { return linear_bf16_avx512(x, w, false); }
at::Tensor amx_matmul(const at::Tensor& x, const at::Tensor& w) { return linear_bf16_amx(x, w, false); }
#endif

// A matmul of this extension as a MatmulFn, by the name of its kernel; nullptr where there is none.
MatmulFn matmul_named(const std::string& name) {
  if (name == "linear_f32") return &linear_f32_matmul;
  if (name == "linear_bf16") return &linear_bf16_matmul;
  if (name == "linear_gguf") return &linear_gguf_matmul;
#if defined(KESTREL_HAS_AVX512_BF16)
  if (name == "linear_bf16_avx512") return &avx512_matmul;
  if (name == "linear_bf16_amx") return &amx_matmul;
#endif
  return nullptr;
}

// One thread's share of a matmul (1..15 rows) as a MatmulSliceFn; "_packed": on a packed weight.
MatmulSliceFn slice_named(const std::string& name) {
  if (name == "linear_bf16") return &linear_bf16_slice_plain;
  if (name == "linear_bf16_packed") return &linear_bf16_slice_packed;
#if defined(KESTREL_HAS_AVX512_BF16)
  if (name == "linear_bf16_avx512") return &linear_bf16_avx512_slice_plain;
  if (name == "linear_bf16_avx512_packed") return &linear_bf16_avx512_slice_packed;
#endif
  return nullptr;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("lanes") = kestrel_vec::kLanes;  // the vector width this build was compiled for (16: AVX-512, 8: AVX2)
  m.attr("panel_columns") = 16;            // the columns of a packed bf16 weight's panel
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=-1) for float32 [rows, n] (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally fused with the residual add (CPU)",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up (CPU)");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "GELU-tanh(gate) * up (CPU)");
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("block_size"), py::arg("scale"), py::arg("in_q_dtype") = false, py::arg("window") = 0);
  m.def("rotary_write_kv", &rotary_write_kv, "rotary embedding in place, fused with the KV-cache write (CPU)",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slot_mapping"), py::arg("num_heads"));
  m.def("rotary_write_kv_int8", &rotary_write_kv_int8, "rotary_write_kv into the int8 KV cache (CPU)",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k_t"), py::arg("k_scale"), py::arg("v"),
        py::arg("v_scale"), py::arg("slot_mapping"), py::arg("num_heads"));
  m.def("paged_decode_attention_int8", &paged_decode_attention_int8, "decode attention over the int8 KV cache (CPU)",
        py::arg("q"), py::arg("k_t"), py::arg("k_scale"), py::arg("v"), py::arg("v_scale"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("block_size"), py::arg("scale"), py::arg("in_q_dtype") = false);
  m.def("prefill_attention", &prefill_attention,
        "causal attention of a chunk of queries (the last Lq positions) over its keys, float32 or bf16 (CPU)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"));
  m.def("supports", &supports, "whether a (head_dim, group) pair has a kernel");
  m.def("linear_f32", &linear_f32, "x w^T in float32 for decode-sized batches (CPU)");
#if defined(KESTREL_HAS_INT8_LINEAR)
  m.attr("int8_linear") = true;  // whether linear_int8 runs in this build
  m.def("linear_int8", &linear_int8,
        "y = x w^T, bf16 x quantized per row to int8, w int8 with a float32 scale per row; y bf16 (CPU, "
        "AVX512-VNNI or AVX2)", py::arg("x"), py::arg("qweight"), py::arg("wscale"));
#else
  m.attr("int8_linear") = false;
#endif
  m.def("linear_bf16", &linear_bf16,
        "y = x w^T for bf16 x and w ([N, K], or packed [N / 16, K, 16]), any rows (CPU, without AVX512-BF16); "
        "float_out: y in float32, unrounded",
        py::arg("x"), py::arg("w"), py::arg("float_out") = false);
  m.def("linear_gguf", &linear_gguf,
        "y = x w^T for bf16 x and GGUF Q8_0 / Q6_K / Q4_K / Q4_1 / Q5 weights packed by gguf_blocks.py's pack_gguf_weight, "
        "any rows (CPU); float_out: y in float32, unrounded",
        py::arg("x"), py::arg("w"), py::arg("float_out") = false);
#if defined(KESTREL_HAS_AVX512_BF16)
  m.attr("avx512_bf16") = true;  // whether the AVX512-BF16 kernels (and the AMX ones) are in this build
  m.def("linear_bf16_avx512", &linear_bf16_avx512,
        "y = x w^T for bf16 x of 1..128 rows, or any rows on w packed [N / 16, K, 16] (CPU, AVX512-BF16); "
        "float_out: y in float32, unrounded",
        py::arg("x"), py::arg("w"), py::arg("float_out") = false);
  m.def("linear_bf16_amx", &linear_bf16_amx,
        "y = x w^T for bf16 x of 1..128 rows (CPU, AMX-BF16); float_out: y in float32, unrounded",
        py::arg("x"), py::arg("w"), py::arg("float_out") = false);
  m.def("linear_int8_amx", &linear_int8_amx,
        "y = x w^T, bf16 x quantized per row to int8, w int8 with a float32 scale per row; y bf16 (CPU, AMX-INT8)",
        py::arg("x"), py::arg("qweight"), py::arg("wscale"));
  m.def("amx_usable", [] { return linear_amx_usable() && prefill_amx_usable(); },
        "whether the AMX kernels run here (built with AMX, and granted to this process)");
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  m.def("prefill_attention_amx", &prefill_attention_amx, "causal prefill attention on AMX tiles (bf16, CPU)");
#endif
  m.def("prefill_attention_avx512", &prefill_attention_avx512, "causal prefill attention by vdpbf16ps (bf16, CPU)");
#else
  m.attr("avx512_bf16") = false;
#endif
  m.def("matmul_address", [](const std::string& name) -> int64_t {
    const MatmulFn fn = matmul_named(name);
    TORCH_CHECK(fn != nullptr, "matmul_address: no matmul ", name);
    return reinterpret_cast<int64_t>(fn);
  }, "the address of a matmul as a MatmulFn (matmul_fn.h), for DecodeLayers", py::arg("name"));
  m.def("matmul_slice_address", [](const std::string& name) -> int64_t {
    const MatmulSliceFn fn = slice_named(name);
    TORCH_CHECK(fn != nullptr, "matmul_slice_address: no slice of ", name);
    return reinterpret_cast<int64_t>(fn);
  }, "the address of one thread's share of a matmul (1..15 rows) as a MatmulSliceFn, for DecodeLayers",
        py::arg("name"));
  bind_decode_layers(m);
}
