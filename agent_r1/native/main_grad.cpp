// A bf16 parameter's gradient added into its float32 main gradient (Megatron-Core's DDP buffer),
// in one pass: main[i] += float(grad[i]). PyTorch's main_grad.add_(grad) on a CPU first converts
// the whole gradient into a new float32 tensor and then adds it (a third of a SmolLM2 update's
// elementwise copies). The sum is the same float32 addition either way, so the result is equal
// bit for bit. Built and loaded by agent_r1/native; called by agent_r1/learner/main_grad.py.
#include <cstdint>

#include "bf16.h"

extern "C" void agent_r1_main_grad_add_bf16(float* main, const uint16_t* grad, int64_t n, int threads) {
#pragma omp parallel for num_threads(n >= 65536 ? threads : 1) schedule(static)
  for (int64_t i = 0; i < n; i++) main[i] += agent_r1::load(grad[i]);
}
