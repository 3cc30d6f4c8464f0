// Python bindings. Tensors cross as raw addresses (torch's data_ptr()): the extension never links libtorch,
// so one build serves every torch version. kt_serve/kernel.py validates dtypes, shapes and contiguity first.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common/checksum.h"
#include "common/thread_pool.h"
#include "isa/kernels.h"
#include "moe/dropout.h"
#include "moe/experts.h"
#include "moe/router.h"
#include "ops/activation.h"
#include "ops/attention.h"
#include "ops/decode_stack.h"
#include "ops/gdn.h"
#include "ops/linear.h"
#include "ops/lora_segments.h"
#include "ops/norm.h"
#include "ops/rotary.h"

namespace py = pybind11;
using kt::bf16;

namespace {
template <typename T>
T* ptr(uintptr_t a) {
  return reinterpret_cast<T*>(a);
}
}  // namespace

PYBIND11_MODULE(_kernel, m) {
  m.doc() = "kt_serve CPU MoE-LoRA kernel (routed SwiGLU experts with per-expert LoRA, several adapters)";

  py::class_<kt::MoEExperts>(m, "MoEExperts")
      .def(py::init([](int E, int H, int I, uintptr_t gate, int64_t gate_es, uintptr_t up, int64_t up_es,
                       uintptr_t down, int64_t down_es, int max_tokens, int max_slots, const std::string& isa,
                       const std::string& format, int group, bool fp8, uintptr_t gate_s, int64_t gate_ses,
                       uintptr_t up_s, int64_t up_ses, uintptr_t down_s, int64_t down_ses, int block_n, int block_k) {
             const kt::Kernels& k = kt::select_kernels(isa.c_str());
             const kt::Format f = kt::parse_format(format);
             kt::ExpertWeights w;
             w.fp8 = fp8;
             w.gate = ptr<const void>(gate), w.up = ptr<const void>(up), w.down = ptr<const void>(down);
             w.gate_estride = gate_es, w.up_estride = up_es, w.down_estride = down_es;
             w.gate_scale = ptr<const float>(gate_s), w.up_scale = ptr<const float>(up_s);
             w.down_scale = ptr<const float>(down_s);
             w.gate_sstride = gate_ses, w.up_sstride = up_ses, w.down_sstride = down_ses;
             w.block_n = block_n, w.block_k = block_k;
             py::gil_scoped_release nogil;
             return new kt::MoEExperts(E, H, I, w, f, group, max_tokens, max_slots, k);
           }),
           py::arg("num_experts"), py::arg("hidden"), py::arg("intermediate"), py::arg("gate"), py::arg("gate_estride"),
           py::arg("up"), py::arg("up_estride"), py::arg("down"), py::arg("down_estride"), py::arg("max_tokens"),
           py::arg("max_slots"), py::arg("isa") = "auto", py::arg("format") = "bf16", py::arg("group") = 128,
           py::arg("fp8") = false, py::arg("gate_scale") = 0, py::arg("gate_sstride") = 0, py::arg("up_scale") = 0,
           py::arg("up_sstride") = 0, py::arg("down_scale") = 0, py::arg("down_sstride") = 0, py::arg("block_n") = 128,
           py::arg("block_k") = 128)
      .def(py::init([](int E, int H, int I, int max_tokens, int max_slots, const std::string& isa,
                       const std::string& format, int group) {
             const kt::Kernels& k = kt::select_kernels(isa.c_str());
             return new kt::MoEExperts(E, H, I, kt::parse_format(format), group, max_tokens, max_slots, k);
           }),
           py::arg("num_experts"), py::arg("hidden"), py::arg("intermediate"), py::arg("max_tokens"),
           py::arg("max_slots"), py::arg("isa"), py::arg("format"), py::arg("group"),
           "Empty packed weights, filled through packed_regions (a packed-weight cache)")
      .def_property_readonly("format", [](const kt::MoEExperts& s) { return std::string(kt::format_name(s.format())); })
      .def_property_readonly("weight_bytes", &kt::MoEExperts::weight_bytes)
      .def_property_readonly("group", &kt::MoEExperts::group)
      .def("packed_regions",
           [](kt::MoEExperts& s) {
             std::vector<std::pair<uintptr_t, size_t>> out;
             for (auto [p, n] : s.packed_regions()) out.emplace_back(reinterpret_cast<uintptr_t>(p), n);
             return out;
           })
      .def("dequantize",
           [](const kt::MoEExperts& s, int proj, uintptr_t out) {
             py::gil_scoped_release nogil;
             s.dequantize(proj, ptr<float>(out));
           })
      .def_property_readonly("isa", &kt::MoEExperts::isa)
      .def_property_readonly("num_experts", &kt::MoEExperts::num_experts)
      .def_property_readonly("hidden", &kt::MoEExperts::hidden)
      .def_property_readonly("intermediate", &kt::MoEExperts::intermediate)
      .def_property_readonly("max_slots", &kt::MoEExperts::max_slots)
      .def("set_adapter",
           [](kt::MoEExperts& s, int slot, int rank, float alpha, uintptr_t ga, uintptr_t gb, uintptr_t ua, uintptr_t ub,
              uintptr_t da, uintptr_t db) {
             py::gil_scoped_release nogil;
             s.set_adapter(slot, rank, alpha, ptr<const bf16>(ga), ptr<const bf16>(gb), ptr<const bf16>(ua),
                           ptr<const bf16>(ub), ptr<const bf16>(da), ptr<const bf16>(db));
           })
      .def("remove_adapter", &kt::MoEExperts::remove_adapter)
      .def("has_adapter", &kt::MoEExperts::has_adapter)
      .def("set_grad_buffers",
           [](kt::MoEExperts& s, int slot, uintptr_t ga, uintptr_t gb, uintptr_t ua, uintptr_t ub, uintptr_t da,
              uintptr_t db) {
             s.set_grad_buffers(slot, kt::GradBuffers{ptr<float>(ga), ptr<float>(gb), ptr<float>(ua), ptr<float>(ub),
                                                      ptr<float>(da), ptr<float>(db)});
           })
      .def("forward",
           [](kt::MoEExperts& s, int T, int k, uintptr_t x, uintptr_t ids, bool ids64, uintptr_t w, uintptr_t slots,
              int uniform_slot, uintptr_t out, bool save, double dropout, uint64_t dropout_seed) {
             py::gil_scoped_release nogil;
             s.forward(T, k, ptr<const bf16>(x), ptr<const void>(ids), ids64, ptr<const float>(w),
                       ptr<const int32_t>(slots), uniform_slot, ptr<bf16>(out), save, kt::Dropout{dropout, dropout_seed});
           })
      .def("backward", [](kt::MoEExperts& s, uintptr_t grad_out, uintptr_t grad_x, uintptr_t grad_w) {
        py::gil_scoped_release nogil;
        s.backward(ptr<const bf16>(grad_out), ptr<bf16>(grad_x), ptr<float>(grad_w));
      })
      .def("release_saved", &kt::MoEExperts::release_saved);

  auto segments = [](int n, int adapters, uintptr_t seg_lens, uintptr_t weight_indices, uintptr_t ranks,
                     uintptr_t scalings) {
    return kt::LoRASegments{n, adapters, ptr<const int32_t>(seg_lens), ptr<const int32_t>(weight_indices),
                            ptr<const int32_t>(ranks), ptr<const float>(scalings)};
  };
  m.def(
      "lora_shrink",
      [segments](int n, int adapters, uintptr_t seg_lens, uintptr_t weight_indices, uintptr_t ranks,
                        uintptr_t scalings, int T, int K, uintptr_t x, int64_t ldx, uintptr_t w, int w_rows,
                        int slices, uintptr_t out, int64_t ldo, const std::string& isa) {
        const kt::Kernels& k = kt::select_kernels(isa.c_str());
        py::gil_scoped_release nogil;
        kt::lora_shrink(k, segments(n, adapters, seg_lens, weight_indices, ranks, scalings), T, K, ptr<const bf16>(x),
                        ldx, ptr<const bf16>(w), w_rows, slices, ptr<bf16>(out), ldo);
      },
      "Segmented LoRA shrink of SGLang's LoRA batch (csrc/ops/lora_segments.h).");
  m.def(
      "lora_expand",
      [segments](int n, int adapters, uintptr_t seg_lens, uintptr_t weight_indices, uintptr_t ranks, int T,
                        uintptr_t a, int64_t lda, uintptr_t w, int64_t w_rows, int max_rank, uintptr_t offsets,
                        int slices, uintptr_t y, int64_t ldy, const std::string& isa) {
        const kt::Kernels& k = kt::select_kernels(isa.c_str());
        py::gil_scoped_release nogil;
        kt::lora_expand(k, segments(n, adapters, seg_lens, weight_indices, ranks, 0), T, ptr<const bf16>(a), lda,
                        ptr<const bf16>(w), w_rows, max_rank, ptr<const int32_t>(offsets), slices, ptr<bf16>(y), ldy);
      },
      "Segmented LoRA expand, added to y in place (csrc/ops/lora_segments.h).");
  m.def(
      "route_and_forward",
      [](const kt::PackedLinear& gate, kt::MoEExperts& experts, int T, int k, bool renormalize, uintptr_t x,
         uintptr_t slots, int uniform_slot, uintptr_t out) {
        py::gil_scoped_release nogil;
        kt::route_and_forward(gate, experts, T, k, renormalize, ptr<const bf16>(x), ptr<const int32_t>(slots),
                              uniform_slot, ptr<bf16>(out));
      },
      "A MoE block: the experts routed by softmax top-k of the gate's logits (csrc/moe/router.h).");
  m.def(
      "route_logits_and_forward",
      [](kt::MoEExperts& experts, int T, int k, bool renormalize, uintptr_t x, uintptr_t logits, int64_t ld,
         uintptr_t slots, int uniform_slot, uintptr_t out) {
        py::gil_scoped_release nogil;
        kt::route_logits_and_forward(experts, T, k, renormalize, ptr<const bf16>(x), ptr<const bf16>(logits), ld,
                                     ptr<const int32_t>(slots), uniform_slot, ptr<bf16>(out));
      },
      "A MoE block routed by softmax top-k of given bf16 gate logits (csrc/moe/router.h).");
  m.def(
      "softmax_topk",
      [](int T, int E, uintptr_t logits, int64_t ld, int k, bool renormalize, uintptr_t ids, uintptr_t weights) {
        py::gil_scoped_release nogil;
        kt::softmax_topk(T, E, ptr<const bf16>(logits), ld, k, renormalize, ptr<int32_t>(ids), ptr<float>(weights));
      },
      "Softmax top-k routing of T rows of bf16 logits (csrc/moe/router.h).");
  m.def(
      "dropout_keep_mask",
      [](uint64_t seed, int proj, int64_t rows, int cols, double p, uintptr_t out) {
        py::gil_scoped_release nogil;
        kt::dropout_keep_mask(seed, proj, rows, cols, p, ptr<uint8_t>(out));
      },
      py::arg("seed"), py::arg("proj"), py::arg("rows"), py::arg("cols"), py::arg("p"), py::arg("out"),
      "Writes the LoRA dropout keep mask (csrc/moe/dropout.h) of rows t*k + j < rows as 0/1 bytes [rows, cols].");
  py::class_<kt::PackedLinear>(m, "PackedLinear")
      .def(py::init([](int N, int K, uintptr_t w, int64_t ldw, const std::string& format, int group,
                       const std::string& isa) {
             const kt::Kernels& k = kt::select_kernels(isa.c_str());
             const kt::Format f = kt::parse_format(format);
             py::gil_scoped_release nogil;
             return new kt::PackedLinear(N, K, ptr<const bf16>(w), ldw, f, group, k);
           }),
           py::arg("out_features"), py::arg("in_features"), py::arg("weight"), py::arg("ldw"),
           py::arg("format") = "bf16", py::arg("group") = 128, py::arg("isa") = "auto")
      .def("forward",
           [](const kt::PackedLinear& s, int M, uintptr_t x, int64_t ldx, uintptr_t bias, uintptr_t y, int64_t ldy,
              bool y_fp32) {
             py::gil_scoped_release nogil;
             s.forward(M, ptr<const bf16>(x), ldx, ptr<const float>(bias), ptr<void>(y), ldy, y_fp32);
           })
      .def("at", &kt::PackedLinear::at)
      .def_property_readonly("out_features", &kt::PackedLinear::out_features)
      .def_property_readonly("in_features", &kt::PackedLinear::in_features)
      .def_property_readonly("format", [](const kt::PackedLinear& s) { return std::string(kt::format_name(s.format())); })
      .def_property_readonly("weight_bytes", &kt::PackedLinear::weight_bytes)
      .def_property_readonly("isa", &kt::PackedLinear::isa);

  m.def(
      "rms_norm",
      [](int M, int H, uintptr_t x, uintptr_t residual, int64_t ld, uintptr_t w, float eps, uintptr_t y,
         uintptr_t residual_out) {
        py::gil_scoped_release nogil;
        kt::rms_norm(M, H, ptr<const bf16>(x), ptr<const bf16>(residual), ld, ptr<const bf16>(w), eps, ptr<bf16>(y),
                     ptr<bf16>(residual_out));
      },
      "RMSNorm of M bf16 rows (optionally after adding a residual); see csrc/ops/norm.h");
  m.def(
      "rms_norm_gemma",
      [](int M, int H, uintptr_t x, uintptr_t residual, int64_t ld, uintptr_t w1, float eps, uintptr_t y,
         uintptr_t residual_out) {
        py::gil_scoped_release nogil;
        kt::rms_norm_gemma(M, H, ptr<const bf16>(x), ptr<const bf16>(residual), ld, ptr<const float>(w1), eps,
                           ptr<bf16>(y), ptr<bf16>(residual_out));
      },
      "Gemma's RMSNorm of M bf16 rows (weight 1 + w in fp32; the residual added in bf16); see csrc/ops/norm.h");
  m.def(
      "rms_norm_gated",
      [](int M, int N, int group, uintptr_t x, uintptr_t z, uintptr_t w, uintptr_t b, float eps, bool sigmoid_gate,
         uintptr_t out, const std::string& isa) {
        const kt::Kernels& kern = kt::select_kernels(isa.c_str());
        py::gil_scoped_release nogil;
        kt::rms_norm_gated(M, N, group, ptr<const bf16>(x), ptr<const bf16>(z), ptr<const float>(w),
                           ptr<const float>(b), eps, sigmoid_gate, ptr<bf16>(out), kern);
      },
      "fla's gated RMSNorm (norm before the gate, SiLU or sigmoid gate) of M bf16 rows; see csrc/ops/norm.h");
  m.def(
      "qk_norm_rope",
      [](int T, uintptr_t qkv, int64_t ld, int q_heads, int kv_heads, int D, uintptr_t q_w, uintptr_t k_w, double q_eps,
         double k_eps, uintptr_t positions, uintptr_t cos_sin, int64_t max_position, int rotary_dim, bool neox) {
        py::gil_scoped_release nogil;
        bf16* q = ptr<bf16>(qkv);
        bf16* k = q + static_cast<int64_t>(q_heads) * D;
        kt::rms_norm_heads(T, q_heads, D, q, ld, ptr<const bf16>(q_w), static_cast<float>(q_eps));
        kt::rms_norm_heads(T, kv_heads, D, k, ld, ptr<const bf16>(k_w), static_cast<float>(k_eps));
        kt::rotary_embedding(T, ptr<const int64_t>(positions), ptr<const float>(cos_sin), max_position, rotary_dim, D,
                             neox, {q, ld, q_heads}, {k, ld, kv_heads});
      },
      "Qwen3 attention's q / k RMSNorm per head then rotary embedding, in place in qkv rows (csrc/ops/norm.h, "
      "csrc/ops/rotary.h)");
  m.def(
      "rotary_embedding",
      [](int T, uintptr_t positions, uintptr_t cos_sin, int64_t max_position, int rotary_dim, int head_size, bool neox,
         uintptr_t q, int64_t q_ld, int q_heads, uintptr_t k, int64_t k_ld, int k_heads) {
        py::gil_scoped_release nogil;
        kt::rotary_embedding(T, ptr<const int64_t>(positions), ptr<const float>(cos_sin), max_position, rotary_dim,
                             head_size, neox, {ptr<bf16>(q), q_ld, q_heads}, {ptr<bf16>(k), k_ld, k_heads});
      },
      "Rotary position embedding of bf16 q and k heads in place, from an fp32 cos/sin cache; see csrc/ops/rotary.h");
  m.def(
      "decode_attention",
      [](int B, int Hq, int Hkv, int D, int Dv, uintptr_t q, int64_t ldq, uintptr_t k, int64_t ldk, uintptr_t v,
         int64_t ldv, int64_t slots, uintptr_t req_to_token, int64_t ld_req, uintptr_t req_pool_indices,
         uintptr_t seq_lens, float scale, uintptr_t out, int64_t ldo, uintptr_t new_k, int64_t ld_new_k,
         uintptr_t new_v, int64_t ld_new_v, uintptr_t cache_loc, const std::string& isa) {
        const kt::Kernels& kern = kt::select_kernels(isa.c_str());
        const kt::PagedKV kv{ptr<bf16>(k), ldk, ptr<bf16>(v), ldv, slots, ptr<const int32_t>(req_to_token), ld_req};
        const kt::NewKV fresh{ptr<const bf16>(new_k), ld_new_k, ptr<const bf16>(new_v), ld_new_v,
                              ptr<const int64_t>(cache_loc)};
        py::gil_scoped_release nogil;
        kt::decode_attention(B, Hq, Hkv, D, Dv, ptr<const bf16>(q), ldq, kv, cache_loc ? &fresh : nullptr,
                             ptr<const int64_t>(req_pool_indices), ptr<const int64_t>(seq_lens), scale, ptr<bf16>(out),
                             ldo, kern);
      },
      "Decode attention of B requests over a paged bf16 KV cache; see csrc/ops/attention.h");
  m.def(
      "gdn_conv_update",
      [](int B, int dim, int K, uintptr_t x, int64_t ldx, uintptr_t states, int64_t slots, int64_t slot_stride,
         int64_t dim_stride, int64_t tap_stride, uintptr_t indices, uintptr_t w, uintptr_t bias, bool silu,
         uintptr_t out, int64_t ldo, const std::string& isa) {
        const kt::GdnConvStates st{ptr<bf16>(states), slots, slot_stride, dim_stride, tap_stride};
        const kt::Kernels& kern = kt::select_kernels(isa.c_str());
        py::gil_scoped_release nogil;
        kt::gdn_conv_update(B, dim, K, ptr<const bf16>(x), ldx, st, ptr<const int32_t>(indices), ptr<const bf16>(w),
                            ptr<const bf16>(bias), silu, ptr<bf16>(out), ldo, kern);
      },
      "Gated DeltaNet causal conv1d of one token per request, conv states updated in place; see csrc/ops/gdn.h");
  m.def(
      "gdn_conv_prefill",
      [](int N, uintptr_t cu_seqlens, int dim, int K, uintptr_t x, int64_t ldx, uintptr_t states, int64_t slots,
         int64_t slot_stride, int64_t dim_stride, int64_t tap_stride, uintptr_t indices, uintptr_t has_initial,
         uintptr_t w, uintptr_t bias, bool silu, uintptr_t out, int64_t ldo, const std::string& isa) {
        const kt::GdnConvStates st{ptr<bf16>(states), slots, slot_stride, dim_stride, tap_stride};
        const kt::Kernels& kern = kt::select_kernels(isa.c_str());
        py::gil_scoped_release nogil;
        kt::gdn_conv_prefill(N, ptr<const int64_t>(cu_seqlens), dim, K, ptr<const bf16>(x), ldx, st,
                             ptr<const int32_t>(indices), ptr<const uint8_t>(has_initial), ptr<const bf16>(w),
                             ptr<const bf16>(bias), silu, ptr<bf16>(out), ldo, kern);
      },
      "Gated DeltaNet causal conv1d over packed sequences (prefill), conv states read and written; see csrc/ops/gdn.h");
  m.def(
      "gdn_recurrent_step",
      [](int B, int Hk, int Hv, int Dk, int Dv, uintptr_t q, int64_t ldq, uintptr_t k, int64_t ldk, uintptr_t v,
         int64_t ldv, uintptr_t a, int64_t lda, uintptr_t b, int64_t ldb, uintptr_t A_log, bool A_log_bf16,
         uintptr_t dt_bias, bool dt_bias_bf16,
         uintptr_t states, int64_t slots, int64_t slot_stride, int64_t head_stride, int64_t k_stride,
         int64_t v_stride, uintptr_t indices, bool l2norm, float softplus_beta, float softplus_threshold,
         uintptr_t out) {
        const kt::GdnStepInputs in{ptr<const bf16>(q), ptr<const bf16>(k), ptr<const bf16>(v), ptr<const bf16>(a),
                                   ptr<const bf16>(b), ldq, ldk, ldv, lda, ldb,
                                   kt::HeadParam{ptr<const void>(A_log), A_log_bf16},
                                   kt::HeadParam{ptr<const void>(dt_bias), dt_bias_bf16}};
        const kt::GdnStates st{ptr<float>(states), slots, slot_stride, head_stride, k_stride, v_stride};
        py::gil_scoped_release nogil;
        kt::gdn_recurrent_step(B, Hk, Hv, Dk, Dv, in, st, ptr<const int32_t>(indices), l2norm, softplus_beta,
                               softplus_threshold, ptr<bf16>(out));
      },
      "One recurrent gated delta-rule step per request, states updated in place; see csrc/ops/gdn.h");
  m.def(
      "gdn_scan",
      [](int N, uintptr_t cu_seqlens, int Hk, int Hv, int Dk, int Dv, uintptr_t q, int64_t ldq, uintptr_t k,
         int64_t ldk, uintptr_t v, int64_t ldv, uintptr_t g, int64_t ldg, uintptr_t beta, bool beta_bf16,
         int64_t ldbeta, uintptr_t states, int64_t slots, int64_t slot_stride, int64_t head_stride, int64_t k_stride,
         int64_t v_stride, uintptr_t indices, bool l2norm, float eps, uintptr_t final, uintptr_t out,
         const std::string& isa) {
        const kt::GdnScanInputs in{ptr<const bf16>(q), ptr<const bf16>(k), ptr<const bf16>(v), ldq, ldk, ldv,
                                   ptr<const float>(g), ldg, ptr<const void>(beta), beta_bf16, ldbeta};
        const kt::GdnStates st{ptr<float>(states), slots, slot_stride, head_stride, k_stride, v_stride};
        const kt::Kernels& kern = kt::select_kernels(isa.c_str());
        py::gil_scoped_release nogil;
        kt::gdn_scan(N, ptr<const int64_t>(cu_seqlens), Hk, Hv, Dk, Dv, in, st, ptr<const int32_t>(indices), l2norm,
                     eps, ptr<float>(final), ptr<bf16>(out), kern);
      },
      "Gated delta rule over packed sequences (prefill), states read and written in the pool; see csrc/ops/gdn.h");
  m.def(
      "rms_norm_heads",
      [](int T, int heads, int D, uintptr_t x, int64_t ld, uintptr_t w, bool gemma, float eps) {
        py::gil_scoped_release nogil;
        if (gemma)
          kt::rms_norm_heads_gemma(T, heads, D, ptr<bf16>(x), ld, ptr<const float>(w), eps);
        else
          kt::rms_norm_heads(T, heads, D, ptr<bf16>(x), ld, ptr<const bf16>(w), eps);
      },
      "RMSNorm of every head in place, w bf16 or (gemma) fp32 1 + w; see csrc/ops/norm.h");
  m.def(
      "sigmoid_mul",
      [](int64_t n, uintptr_t x, uintptr_t gate) {
        py::gil_scoped_release nogil;
        kt::sigmoid_mul(n, ptr<bf16>(x), ptr<const bf16>(gate));
      },
      "x *= sigmoid(gate) in place, fp32; see csrc/ops/activation.h");
  m.def(
      "silu_mul",
      [](int M, int I, uintptr_t gu, int64_t ldg, uintptr_t out, int64_t ldo, const std::string& isa) {
        const kt::Kernels& k = kt::select_kernels(isa.c_str());
        py::gil_scoped_release nogil;
        kt::silu_mul(M, I, ptr<const bf16>(gu), ldg, ptr<bf16>(out), ldo, k);
      },
      "SiluAndMul, fp32; see csrc/ops/activation.h");
  m.def(
      "shared_expert_gate_add",
      [](int M, int H, uintptr_t x, uintptr_t w, uintptr_t delta, uintptr_t shared, uintptr_t out) {
        py::gil_scoped_release nogil;
        kt::shared_expert_gate_add(M, H, ptr<const bf16>(x), ptr<const bf16>(w), ptr<const float>(delta),
                                   ptr<const bf16>(shared), ptr<bf16>(out));
      },
      "out += sigmoid(x . w + delta) * shared; see csrc/ops/activation.h");
  // DecodeStack's parts: plain values holding raw pointers; kt_serve/kernel/decode_stack.py keeps their tensors
  // and packed layers alive as long as the stack.
  py::class_<kt::NormWeight>(m, "NormWeight")
      .def(py::init([](uintptr_t w, uintptr_t w1, float eps) {
             return kt::NormWeight{ptr<const bf16>(w), ptr<const float>(w1), eps};
           }),
           py::arg("w"), py::arg("w1"), py::arg("eps"));
  py::class_<kt::Projection>(m, "Projection")
      .def(py::init([](const kt::PackedLinear* w, uintptr_t bias) {
             return kt::Projection{w, ptr<const float>(bias), {}};
           }),
           py::arg("w"), py::arg("bias") = 0);
  py::class_<kt::MoEBlock>(m, "MoEBlock")
      .def(py::init([](const kt::PackedLinear& gate, kt::MoEExperts& experts, int top_k, bool renormalize,
                       const kt::Projection* shared_gate_up, const kt::Projection* shared_down,
                       uintptr_t shared_expert_gate) {
             kt::MoEBlock b{&gate, &experts, top_k, renormalize, {}, {}, ptr<const bf16>(shared_expert_gate)};
             if (shared_gate_up) b.shared_gate_up = *shared_gate_up;
             if (shared_down) b.shared_down = *shared_down;
             return b;
           }),
           py::arg("gate"), py::arg("experts"), py::arg("top_k"), py::arg("renormalize"),
           py::arg("shared_gate_up") = nullptr, py::arg("shared_down") = nullptr, py::arg("shared_expert_gate") = 0);
  py::class_<kt::DecodeStack>(m, "DecodeStack")
      .def(py::init([](int H, const kt::NormWeight& final_norm, const std::string& isa) {
             return new kt::DecodeStack(H, final_norm, kt::select_kernels(isa.c_str()));
           }),
           py::arg("hidden"), py::arg("final_norm"), py::arg("isa") = "auto")
      .def("add_attention_layer",
           [](kt::DecodeStack& s, const kt::NormWeight& input_norm, const kt::NormWeight& post_norm,
              const kt::Projection& qkv, const kt::Projection& o, int Hq, int Hkv, int D, bool output_gate,
              const kt::NormWeight& q_norm, const kt::NormWeight& k_norm, uintptr_t cos_sin, int64_t max_position,
              int rotary_dim, bool neox, uintptr_t k_cache, int64_t ldk, uintptr_t v_cache, int64_t ldv,
              int64_t cache_slots, float scale, const kt::MoEBlock& moe) {
             kt::AttentionMixer a;
             a.qkv = qkv;
             a.o = o;
             a.Hq = Hq, a.Hkv = Hkv, a.D = D, a.output_gate = output_gate;
             a.q_norm = q_norm, a.k_norm = k_norm;
             a.cos_sin = ptr<const float>(cos_sin), a.max_position = max_position, a.rotary_dim = rotary_dim;
             a.neox = neox;
             a.k_cache = ptr<bf16>(k_cache), a.ldk = ldk, a.v_cache = ptr<bf16>(v_cache), a.ldv = ldv;
             a.cache_slots = cache_slots, a.scale = scale;
             s.add_attention_layer(input_norm, post_norm, a, moe);
           })
      .def("add_gdn_layer",
           [](kt::DecodeStack& s, const kt::NormWeight& input_norm, const kt::NormWeight& post_norm,
              const kt::Projection& qkvz, const kt::Projection& ba, const kt::Projection& out, int Hk, int Hv, int Dk,
              int Dv, int conv_kernel, uintptr_t conv_w, uintptr_t conv_bias, bool conv_silu, uintptr_t conv_states,
              const std::vector<int64_t>& conv_shape_strides, uintptr_t ssm_states,
              const std::vector<int64_t>& ssm_shape_strides, uintptr_t A_log, bool A_log_bf16, uintptr_t dt_bias,
              bool dt_bias_bf16, uintptr_t norm_w, float norm_eps, bool sigmoid_gate, const kt::MoEBlock& moe) {
             if (conv_shape_strides.size() != 4 || ssm_shape_strides.size() != 5)
               throw std::invalid_argument("add_gdn_layer: conv states (slots + 3 strides), ssm states (slots + 4)");
             kt::GdnMixer g;
             g.qkvz = qkvz, g.ba = ba, g.out = out;
             g.Hk = Hk, g.Hv = Hv, g.Dk = Dk, g.Dv = Dv, g.conv_kernel = conv_kernel;
             g.conv_w = ptr<const bf16>(conv_w), g.conv_bias = ptr<const bf16>(conv_bias), g.conv_silu = conv_silu;
             const auto& c = conv_shape_strides;
             g.conv = kt::GdnConvStates{ptr<bf16>(conv_states), c[0], c[1], c[2], c[3]};
             const auto& t = ssm_shape_strides;
             g.ssm = kt::GdnStates{ptr<float>(ssm_states), t[0], t[1], t[2], t[3], t[4]};
             g.A_log = kt::HeadParam{ptr<const void>(A_log), A_log_bf16};
             g.dt_bias = kt::HeadParam{ptr<const void>(dt_bias), dt_bias_bf16};
             g.norm_w = ptr<const float>(norm_w), g.norm_eps = norm_eps, g.sigmoid_gate = sigmoid_gate;
             s.add_gdn_layer(input_norm, post_norm, g, moe);
           })
      .def("set_lora",
           [](kt::DecodeStack& s, int i, const std::string& name, uintptr_t a, int a_rows, uintptr_t b,
              int64_t b_rows, int max_rank, int adapters, const std::vector<int32_t>& off) {
             if (off.size() < 2 || off.size() > kt::kMaxLoRASlices + 1)
               throw std::invalid_argument("DecodeStack.set_lora: 1 to " + std::to_string(kt::kMaxLoRASlices) +
                                           " LoRA slices");
             kt::DenseLoRA l{ptr<const bf16>(a), a_rows, ptr<const bf16>(b), b_rows, max_rank, adapters,
                             static_cast<int>(off.size()) - 1, {}};
             std::copy(off.begin(), off.end(), l.off);
             s.set_lora(i, name, l);
           })
      .def_property_readonly("num_layers", &kt::DecodeStack::num_layers)
      .def_property_readonly("has_gdn", &kt::DecodeStack::has_gdn)
      .def("forward",
           [](const kt::DecodeStack& s, int B, uintptr_t x, uintptr_t positions, uintptr_t req_to_token,
              int64_t req_rows, int64_t ld_req, uintptr_t req_pool_indices, uintptr_t seq_lens, uintptr_t cache_loc,
              uintptr_t state_slots, uintptr_t slots, int uniform_slot, int lora_segments, int lora_adapters,
              uintptr_t seg_lens, uintptr_t weight_indices, uintptr_t ranks, uintptr_t scalings) {
             const kt::LoRASegments lora{lora_segments, lora_adapters, ptr<const int32_t>(seg_lens),
                                         ptr<const int32_t>(weight_indices), ptr<const int32_t>(ranks),
                                         ptr<const float>(scalings)};
             py::gil_scoped_release nogil;
             s.forward(B, ptr<bf16>(x), ptr<const int64_t>(positions), ptr<const int32_t>(req_to_token), req_rows,
                       ld_req, ptr<const int64_t>(req_pool_indices), ptr<const int64_t>(seq_lens),
                       ptr<const int64_t>(cache_loc), ptr<const int32_t>(state_slots), ptr<const int32_t>(slots),
                       uniform_slot, seg_lens ? &lora : nullptr);
           },
           "A MoE decoder stack's decode step in one call (csrc/ops/decode_stack.h).");
  m.def(
      "checksum",
      [](uintptr_t p, size_t n) {
        py::gil_scoped_release nogil;
        return kt::checksum(ptr<const uint8_t>(p), n);
      },
      py::arg("address"), py::arg("nbytes"), "64-bit checksum of a byte range (common/checksum.h)");
  m.def(
      "fp8_to_bf16",
      [](uintptr_t w, int64_t N, int64_t K, uintptr_t scale_inv, int bn, int bk, uintptr_t out) {
        py::gil_scoped_release nogil;
        kt::fp8_to_bf16(ptr<const uint8_t>(w), N, K, ptr<const float>(scale_inv), bn, bk, ptr<bf16>(out));
      },
      py::arg("w"), py::arg("n"), py::arg("k"), py::arg("scale_inv"), py::arg("block_n"), py::arg("block_k"),
      py::arg("out"), "An FP8 block-scaled matrix dequantized to bf16 (weights/packed_weights.h)");
  m.def(
      "prefault",
      [](uintptr_t p, size_t n) {
        py::gil_scoped_release nogil;
        kt::prefault(ptr<uint8_t>(p), n);
      },
      py::arg("address"), py::arg("nbytes"), "Zeros written over a byte range by the worker pool (common/checksum.h)");
  m.def("set_num_threads", &kt::set_num_threads, py::arg("n"), py::arg("cpus") = std::vector<int>{},
        "Size of the global worker pool (caller included); n < 1 means the default (physical cores, or one per "
        "listed CPU). cpus: pin worker i to cpus[i % len(cpus)] (the caller stays where it is).");
  m.def("num_threads", [] { return kt::global_pool()->num_threads(); });
  m.def("set_idle_spin_us", &kt::set_idle_spin_us, py::arg("us"),
        "How long workers poll for the next call before they sleep, in microseconds (0: at once).");
  m.def("idle_spin_us", &kt::idle_spin_us);
  m.def("default_num_threads", &kt::default_num_threads);
  m.def("cpu_isa", [] { return std::string(kt::select_kernels("auto").name); },
        "The kernel table chosen for this CPU (honours KT_SERVE_ISA).");
  m.def("has_avx2", [] { return kt::cpu_has_avx2_fma() && kt::kernels_avx2() != nullptr; });
  m.def("has_avx512_bf16", [] { return kt::cpu_has_avx512_bf16() && kt::kernels_avx512_bf16() != nullptr; });
  m.def("has_amx_bf16", [] { return kt::cpu_has_amx_bf16() && kt::kernels_amx_bf16() != nullptr; });
}
