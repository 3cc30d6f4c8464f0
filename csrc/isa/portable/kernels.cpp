// The portable table: plain C++ built for the baseline ISA. Runs anywhere; the reference for the others.
#include "isa/generic.inc"

namespace kt {

const Kernels& kernels_portable() {
  static const Kernels k{"portable",          gemm_block_generic,     gemm_block_pair_generic, lora_a_bf16_generic,
                         lora_a_f32_generic,  lora_b_add_generic,     outer_acc_bf16_generic,
                         outer_acc_f32_generic, swiglu_generic,       swiglu_backward_generic, qgemm_block_generic,
                         qgemm_block_pair_generic, decode_rows_generic, decode_transposed_generic<decode_rows_generic>, quantize_rows_generic, gemm_block_scaled_generic<gemm_block_generic>, kNeverDecode,
                         attn_scores_generic, exp_shifted_generic, attn_values_generic,
                         gdn_scan_columns_generic};
  return k;
}

}  // namespace kt
