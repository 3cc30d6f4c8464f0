// Decode attention over SGLang's paged KV pool: one new query token per request, all requests of a decode batch
// in one call (what SGLang's torch_native backend does with a Python loop of gathers and SDPA calls). For request b
// and query head h, with KV head h / (Hq / Hkv) (GQA / MQA),
//     out[b][h] = Σ_j softmax_j(scale · q[b][h] · K[t_j]) · V[t_j],   t_j = req_to_token[r_b][j],  j < len_b
// where r_b = req_pool_indices[b] and len_b = seq_lens[b]. All arithmetic fp32; q, K, V, out bf16.
#pragma once
#include <cstdint>

#include "isa/kernels.h"

namespace kt {

// The KV cache of one layer: K [slots][Hkv][D], V [slots][Hkv][Dv] (heads contiguous, ldk / ldv values between
// slots; `slots` of them), and the request-to-slot table, int32 rows ld_req apart. Written only by a call's new rows.
struct PagedKV {
  bf16* k;
  int64_t ldk;
  bf16* v;
  int64_t ldv;
  int64_t slots;
  const int32_t* req_to_token;
  int64_t ld_req;
};

// The decode step's own K and V rows, one per request ([B][Hkv][D] and [B][Hkv][Dv], heads contiguous, ldk / ldv
// values between requests), stored at cache slots loc[b] before anyone attends: the KV write SGLang's pool would
// otherwise do from Python, two indexed copies per layer that took longer than the attention itself at decode.
struct NewKV {
  const bf16* k;
  int64_t ldk;
  const bf16* v;
  int64_t ldv;
  const int64_t* loc;
};

// q [B][Hq][D] and out [B][Hq][Dv], rows ldq / ldo values apart between requests. A request of length 0 gets zeros.
// With fresh (may be null), its rows are stored first (a slot outside [0, slots) throws, nothing stored). Work is
// split over (request, slice of the context), every head at once (a slot's K and V rows are contiguous), so one
// long request still uses every thread.
void decode_attention(int B, int Hq, int Hkv, int D, int Dv, const bf16* q, int64_t ldq, const PagedKV& kv,
                      const NewKV* fresh, const int64_t* req_pool_indices, const int64_t* seq_lens, float scale,
                      bf16* out, int64_t ldo, const Kernels& k);

}  // namespace kt
