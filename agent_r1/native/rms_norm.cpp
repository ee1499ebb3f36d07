// RMSNorm for a CPU learner, one pass over each row, forward and backward: y = x * r * w with
// r = 1 / sqrt(mean(x^2) + eps), so with g = dy * w
//   dx = r * g - x * r^3 * mean(g * x)        dw = sum over rows of dy * x * r
// in float32 whatever the activations' dtype T (float32 or bf16); y and dx rounded once to T, the
// weight and dw in float32 (the caller converts a bf16 weight; Megatron's torch norms keep theirs
// in float32 in a bf16 model). PyTorch's CPU autograd runs a norm with a weight of another dtype
// as ~8 separate ops forward and ~10 backward, each a pass over (rows x hidden) with conversions:
// ~4 ms a norm against ~0.5 for SmolLM2's 1,436 x 576.
// Built and loaded by agent_r1/native; called by agent_r1/learner/norm.py.
#include <cmath>
#include <cstdint>
#include <vector>

#include <omp.h>

#include "bf16.h"

namespace {

using agent_r1::load;
using agent_r1::store;

template <typename T>
void forward(const T* x, const float* w, float eps, T* y, int M, int H, int threads) {
#pragma omp parallel for num_threads(int64_t(M) * H >= 16384 ? threads : 1) schedule(static)
  for (int m = 0; m < M; m++) {
    const T* xr = x + int64_t(m) * H;
    float ss = 0.0f;
    for (int d = 0; d < H; d++) ss += load(xr[d]) * load(xr[d]);
    const float r = 1.0f / std::sqrt(ss / H + eps);
    T* o = y + int64_t(m) * H;
    for (int d = 0; d < H; d++) store(o + d, load(xr[d]) * r * w[d]);
  }
}

template <typename T>
void backward(const T* x, const T* dy, const float* w, float eps, T* dx, float* dw, int M, int H, int threads) {
  const int nt = int64_t(M) * H >= 16384 ? threads : 1;
  std::vector<float> part(size_t(nt) * H, 0.0f);  // each thread's dw
#pragma omp parallel num_threads(nt)
  {
    float* acc = part.data() + size_t(omp_get_thread_num()) * H;
    std::vector<float> xf(H), gf(H);
#pragma omp for schedule(static)
    for (int m = 0; m < M; m++) {
      const T* xr = x + int64_t(m) * H;
      const T* dr = dy + int64_t(m) * H;
      float ss = 0.0f, gx = 0.0f;
      for (int d = 0; d < H; d++) {
        const float a = load(xr[d]), g = load(dr[d]) * w[d];
        xf[d] = a, gf[d] = g;
        ss += a * a, gx += g * a;
      }
      const float r = 1.0f / std::sqrt(ss / H + eps), c = r * r * r * gx / H;
      T* o = dx + int64_t(m) * H;
      for (int d = 0; d < H; d++) {
        store(o + d, r * gf[d] - c * xf[d]);
        acc[d] += load(dr[d]) * xf[d] * r;
      }
    }
  }
  for (int d = 0; d < H; d++) {
    float s = 0.0f;
    for (int t = 0; t < nt; t++) s += part[size_t(t) * H + d];
    dw[d] = s;
  }
}

}  // namespace

extern "C" {
void agent_r1_rms_norm_forward_f32(const float* x, const float* w, float eps, float* y, int M, int H, int threads) {
  forward(x, w, eps, y, M, H, threads);
}
void agent_r1_rms_norm_forward_bf16(const uint16_t* x, const float* w, float eps, uint16_t* y, int M, int H,
                                    int threads) {
  forward(x, w, eps, y, M, H, threads);
}
void agent_r1_rms_norm_backward_f32(const float* x, const float* dy, const float* w, float eps, float* dx, float* dw,
                                    int M, int H, int threads) {
  backward(x, dy, w, eps, dx, dw, M, H, threads);
}
void agent_r1_rms_norm_backward_bf16(const uint16_t* x, const uint16_t* dy, const float* w, float eps, uint16_t* dx,
                                     float* dw, int M, int H, int threads) {
  backward(x, dy, w, eps, dx, dw, M, H, threads);
}
}
