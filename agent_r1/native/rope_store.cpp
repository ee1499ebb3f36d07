// One decode step's attention inputs from the fused q|k|v projection (N, (H + 2 KV) * D), per row:
// Qwen3's per-head RMSNorm of q and k where the model has it (float32, then the weight), the
// rotary embedding of q and k (x * cos + roll(x, D/2) * signed_sin: HF's rotate_half form) in
// float32, q written to q_out (N, H, D) and k, v straight into the cache at (slot[n], head,
// pos[n]). Replaces the step's split, norm, rotation, concatenation and two indexed cache writes.
// Built and loaded by agent_r1/native; called by agent_r1/rollout/slot_model.py.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"

namespace {

using agent_r1::load;
using agent_r1::store;
using agent_r1::round_to;

template <typename T>
void rope_store(const T* qkv, int64_t row, int N, int H, int KV, int D, const T* cos, const T* sin,
                const T* q_norm, const T* k_norm, float q_eps, float k_eps, T* q_out, T* K, T* V, int64_t cS,
                int64_t cH, int64_t cT, const int64_t* slot, const int64_t* pos, int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> x(D);
#pragma omp for schedule(static)
    for (int n = 0; n < N; n++) {
      const T* src = qkv + int64_t(n) * row;
      const T* c = cos + int64_t(n) * D;
      const T* s = sin + int64_t(n) * D;
      const int64_t at = slot[n] * cS + pos[n] * cT;
      for (int h = 0; h < H + KV; h++) {
        const T* in = src + int64_t(h) * D;
        for (int d = 0; d < D; d++) x[d] = load(in[d]);
        const T* w = h < H ? q_norm : k_norm;
        if (w != nullptr) {  // as HF: normalise in float32, back to the model's dtype, times the weight
          float ss = 0.0f;
          for (int d = 0; d < D; d++) ss += x[d] * x[d];
          const float r = 1.0f / std::sqrt(ss / D + (h < H ? q_eps : k_eps));
          for (int d = 0; d < D; d++) x[d] = round_to(round_to(x[d] * r, T()) * load(w[d]), T());
        }
        T* out = h < H ? q_out + (int64_t(n) * H + h) * D : K + at + int64_t(h - H) * cH;
        const int half = D / 2;
        for (int d = 0; d < D; d++) {
          const float rolled = x[d < half ? d + half : d - half];
          store(out + d, x[d] * load(c[d]) + rolled * load(s[d]));
        }
      }
      for (int h = 0; h < KV; h++) {
        const T* in = src + int64_t(H + KV + h) * D;
        T* out = V + at + int64_t(h) * cH;
        std::memcpy(out, in, sizeof(T) * D);
      }
    }
  }
}

}  // namespace

extern "C" {
void agent_r1_rope_store_f32(const float* qkv, int64_t row, int N, int H, int KV, int D, const float* cos,
                             const float* sin, const float* q_norm, const float* k_norm, float q_eps, float k_eps,
                             float* q_out, float* K, float* V, int64_t cS, int64_t cH, int64_t cT,
                             const int64_t* slot, const int64_t* pos, int threads) {
  rope_store(qkv, row, N, H, KV, D, cos, sin, q_norm, k_norm, q_eps, k_eps, q_out, K, V, cS, cH, cT, slot, pos,
             threads);
}
void agent_r1_rope_store_bf16(const uint16_t* qkv, int64_t row, int N, int H, int KV, int D, const uint16_t* cos,
                              const uint16_t* sin, const uint16_t* q_norm, const uint16_t* k_norm, float q_eps,
                              float k_eps, uint16_t* q_out, uint16_t* K, uint16_t* V, int64_t cS, int64_t cH,
                              int64_t cT, const int64_t* slot, const int64_t* pos, int threads) {
  rope_store(qkv, row, N, H, KV, D, cos, sin, q_norm, k_norm, q_eps, k_eps, q_out, K, V, cS, cH, cT, slot, pos,
             threads);
}
}
