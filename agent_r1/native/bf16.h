// float32 <-> bfloat16 (its bits in a uint16_t) for the kernels of this folder, which take either.
#pragma once
#include <cstdint>
#include <cstring>

namespace agent_r1 {

inline float load(float x) { return x; }
inline float load(uint16_t x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {  // round to nearest even; NaN stays NaN (a select, no
  uint32_t u;                               // branch: loops over rows stay vectorised)
  std::memcpy(&u, &x, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  *p = uint16_t((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}
inline float round_to(float x, float) { return x; }
inline float round_to(float x, uint16_t) {  // the value x takes in bfloat16
  uint16_t b;
  store(&b, x);
  return load(b);
}

}  // namespace agent_r1
