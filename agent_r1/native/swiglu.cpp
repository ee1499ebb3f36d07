// SwiGLU for a CPU learner, one pass over each row, forward and backward: a row of x is [a, b]
// (the gate and the linear half, I each), y = silu(a) * b with silu(a) = a * s, s = sigmoid(a), so
//   da = dy * b * s * (1 + a * (1 - s))        db = dy * silu(a)
// written as one (rows x 2I) gradient (no cat of the two halves). Arithmetic in float32; with T =
// bf16 every value PyTorch's unfused ops round (silu(a), dy * b, dy * silu(a)) is rounded here
// too, so the results equal Megatron's unfused glu (F.silu(a) * b) in either dtype. PyTorch runs it
// as silu, mul, add (+0.0 offset) forward and mul, mul, silu_backward, cat backward: ~4 ms a layer
// for SmolLM2's 1,436 x 3,072 in bf16, each op a pass converting bf16 in and out.
// Built and loaded by agent_r1/native; called by agent_r1/learner/activation.py.
#include <cmath>
#include <cstdint>

#include "bf16.h"

namespace {

using agent_r1::load;
using agent_r1::round_to;
using agent_r1::store;

template <typename T>
void forward(const T* x, T* y, int M, int I, int threads) {
#pragma omp parallel for num_threads(int64_t(M) * I >= 16384 ? threads : 1) schedule(static)
  for (int m = 0; m < M; m++) {
    const T* a = x + int64_t(m) * 2 * I;
    const T* b = a + I;
    T* o = y + int64_t(m) * I;
    for (int j = 0; j < I; j++) {
      const float v = load(a[j]);
      const float silu = round_to(v / (1.0f + std::exp(-v)), T());
      store(o + j, silu * load(b[j]));
    }
  }
}

template <typename T>
void backward(const T* x, const T* dy, T* dx, int M, int I, int threads) {
#pragma omp parallel for num_threads(int64_t(M) * I >= 16384 ? threads : 1) schedule(static)
  for (int m = 0; m < M; m++) {
    const T* a = x + int64_t(m) * 2 * I;
    const T* b = a + I;
    const T* g = dy + int64_t(m) * I;
    T* da = dx + int64_t(m) * 2 * I;
    T* db = da + I;
    for (int j = 0; j < I; j++) {
      const float v = load(a[j]), gj = load(g[j]);
      const float s = 1.0f / (1.0f + std::exp(-v));
      const float silu = round_to(v * s, T());
      const float gs = round_to(gj * load(b[j]), T());  // the gradient reaching silu's output
      store(da + j, gs * s * (1.0f + v * (1.0f - s)));
      store(db + j, gj * silu);
    }
  }
}

}  // namespace

extern "C" {
void agent_r1_swiglu_forward_f32(const float* x, float* y, int M, int I, int threads) { forward(x, y, M, I, threads); }
void agent_r1_swiglu_forward_bf16(const uint16_t* x, uint16_t* y, int M, int I, int threads) {
  forward(x, y, M, I, threads);
}
void agent_r1_swiglu_backward_f32(const float* x, const float* dy, float* dx, int M, int I, int threads) {
  backward(x, dy, dx, M, I, threads);
}
void agent_r1_swiglu_backward_bf16(const uint16_t* x, const uint16_t* dy, uint16_t* dx, int M, int I, int threads) {
  backward(x, dy, dx, M, I, threads);
}
}
