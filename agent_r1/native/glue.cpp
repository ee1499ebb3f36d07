// The elementwise work between a decoder layer's matmuls, one pass over each row, in HF's numerics
// (Llama/Qwen: RMSNorm in float32, back to the model's dtype, times the weight; SwiGLU's silu
// rounded to the model's dtype before the product):
// - add_rms_norm: x += y (the residual stream, in place, rounded as the model's dtype adds), then
//   out = RMSNorm(x) * w; y may be null (the first norm of the first layer).
// - silu_mul: out = silu(gate) * up from the fused gate|up projection (M, 2I).
// Replaces the ~6 small PyTorch ops a layer runs between its matmuls (each bf16 RMSNorm converted
// to float32 and back). Built and loaded by agent_r1/native; called by agent_r1/rollout/slot_model.py.
#include <cmath>
#include <cstdint>
#include <vector>

#include "bf16.h"

namespace {

using agent_r1::load;
using agent_r1::round_to;
using agent_r1::store;

template <typename T>
void add_rms_norm(T* x, int64_t xs, const T* y, int64_t ys, const T* w, float eps, T* out, int64_t os, int M,
                  int H, int threads) {
#pragma omp parallel num_threads(M * H >= 16384 ? threads : 1)
  {
    std::vector<float> v(H);
#pragma omp for schedule(static)
    for (int m = 0; m < M; m++) {
      T* xr = x + int64_t(m) * xs;
      float ss = 0.0f;
      for (int d = 0; d < H; d++) {
        float a = load(xr[d]);
        if (y != nullptr) {
          a = round_to(a + load(y[int64_t(m) * ys + d]), T());
          store(xr + d, a);
        }
        v[d] = a;
        ss += a * a;
      }
      const float r = 1.0f / std::sqrt(ss / H + eps);
      T* o = out + int64_t(m) * os;
      for (int d = 0; d < H; d++) store(o + d, round_to(v[d] * r, T()) * load(w[d]));
    }
  }
}

template <typename T>
void silu_mul(const T* gu, int64_t gs, T* out, int M, int I, int threads) {
#pragma omp parallel for num_threads(int64_t(M) * I >= 16384 ? threads : 1) schedule(static)
  for (int m = 0; m < M; m++) {
    const T* g = gu + int64_t(m) * gs;
    const T* u = g + I;
    T* o = out + int64_t(m) * I;
    for (int i = 0; i < I; i++) {
      const float a = load(g[i]);
      store(o + i, round_to(a / (1.0f + std::exp(-a)), T()) * load(u[i]));
    }
  }
}

}  // namespace

extern "C" {
void agent_r1_add_rms_norm_f32(float* x, int64_t xs, const float* y, int64_t ys, const float* w, float eps, float* out,
                               int64_t os, int M, int H, int threads) {
  add_rms_norm(x, xs, y, ys, w, eps, out, os, M, H, threads);
}
void agent_r1_add_rms_norm_bf16(uint16_t* x, int64_t xs, const uint16_t* y, int64_t ys, const uint16_t* w, float eps,
                                uint16_t* out, int64_t os, int M, int H, int threads) {
  add_rms_norm(x, xs, y, ys, w, eps, out, os, M, H, threads);
}
void agent_r1_silu_mul_f32(const float* gu, int64_t gs, float* out, int M, int I, int threads) {
  silu_mul(gu, gs, out, M, I, threads);
}
void agent_r1_silu_mul_bf16(const uint16_t* gu, int64_t gs, uint16_t* out, int M, int I, int threads) {
  silu_mul(gu, gs, out, M, I, threads);
}
}
