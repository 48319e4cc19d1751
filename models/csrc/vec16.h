// 16-float vector primitives of the paged-attention kernel (paged_attention.cpp): loads that
// widen bfloat16 and int8 to float, dot products, weighted row sums and a vectorized exp. Header
// only, included once; every function is inline so each ISA-level copy of the kernel inlines its own.

#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace sluice_vec {

inline float to_float(float x) { return x; }

inline float to_float(int8_t x) { return static_cast<float>(x); }

inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Loops over head_dim use 16-float vectors (GCC vector extensions): one AVX-512 register, two
// AVX2 or four SSE ones, whichever clone runs. A head_dim that is not a multiple of 16 ends in a
// scalar tail.
constexpr int64_t kLanes = 16;
typedef float vec16 __attribute__((vector_size(64)));
typedef float vec8 __attribute__((vector_size(32)));
typedef float vec4 __attribute__((vector_size(16)));

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vec16 load16(const c10::BFloat16* p) {
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  u16x16 half;
  std::memcpy(&half, p, sizeof(half));
  const u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
  vec16 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// A loop, not __builtin_convertvector: GCC 12 converts an int8 vector lane by lane in scalar
// code, but vectorizes this (sign extensions and vcvtdq2ps).
inline vec16 load16(const int8_t* p) {
  float lanes[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) lanes[i] = static_cast<float>(p[i]);
  vec16 v;
  std::memcpy(&v, lanes, sizeof(v));
  return v;
}

inline void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof(v)); }

// Horizontal sum by halves, in registers.
inline float reduce_add(vec16 v) {
  vec8 lo8, hi8;
  std::memcpy(&lo8, &v, sizeof(lo8));
  std::memcpy(&hi8, reinterpret_cast<const char*>(&v) + sizeof(lo8), sizeof(hi8));
  const vec8 s8 = lo8 + hi8;
  vec4 lo4, hi4;
  std::memcpy(&lo4, &s8, sizeof(lo4));
  std::memcpy(&hi4, reinterpret_cast<const char*>(&s8) + sizeof(lo4), sizeof(hi4));
  const vec4 s4 = lo4 + hi4;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  vec16 a0 = {}, a1 = {}, a2 = {}, a3 = {};  // independent FMA chains
  int64_t d = 0;
  for (; d + 4 * kLanes <= n; d += 4 * kLanes) {
    a0 += load16(q + d) * load16(k + d);
    a1 += load16(q + d + kLanes) * load16(k + d + kLanes);
    a2 += load16(q + d + 2 * kLanes) * load16(k + d + 2 * kLanes);
    a3 += load16(q + d + 3 * kLanes) * load16(k + d + 3 * kLanes);
  }
  for (; d + kLanes <= n; d += kLanes) a0 += load16(q + d) * load16(k + d);
  float sum = reduce_add((a0 + a1) + (a2 + a3));
  for (; d < n; ++d) sum += q[d] * to_float(k[d]);
  return sum;
}

// out[0..n) += sum over i < count of p[i] * rows[i * row_stride + 0..n). The output stays in
// registers across the rows, 64 floats (four independent FMA chains) at a time.
template <typename T>
inline void weighted_rows_add(float* out, const float* p, const T* rows, int64_t row_stride, int64_t count,
                              int64_t n) {
  int64_t d = 0;
  for (; d + 4 * kLanes <= n; d += 4 * kLanes) {
    vec16 a0 = load16(out + d), a1 = load16(out + d + kLanes);
    vec16 a2 = load16(out + d + 2 * kLanes), a3 = load16(out + d + 3 * kLanes);
    for (int64_t i = 0; i < count; ++i) {
      const T* row = rows + i * row_stride + d;
      a0 += p[i] * load16(row);
      a1 += p[i] * load16(row + kLanes);
      a2 += p[i] * load16(row + 2 * kLanes);
      a3 += p[i] * load16(row + 3 * kLanes);
    }
    store16(out + d, a0);
    store16(out + d + kLanes, a1);
    store16(out + d + 2 * kLanes, a2);
    store16(out + d + 3 * kLanes, a3);
  }
  for (; d + kLanes <= n; d += kLanes) {
    vec16 acc = load16(out + d);
    for (int64_t i = 0; i < count; ++i) acc += p[i] * load16(rows + i * row_stride + d);
    store16(out + d, acc);
  }
  for (; d < n; ++d) {
    for (int64_t i = 0; i < count; ++i) out[d] += p[i] * to_float(rows[i * row_stride + d]);
  }
}

// exp(x) for x <= 0 (Cephes expf: range reduction by ln 2, degree-6 polynomial, about 1 ulp),
// 16 lanes at a time; std::exp would stay scalar.
inline vec16 exp_nonpositive(vec16 x) {
  typedef int32_t vec16i __attribute__((vector_size(64)));
  const vec16 lowest = vec16{} - 87.0f;  // e^-87 is below float precision next to the max term (e^0 = 1)
  x = x < lowest ? lowest : x;
  const vec16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  const vec16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vec16 p = vec16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vec16i bits = (__builtin_convertvector(n, vec16i) + 127) << 23;  // 2^n
  vec16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// scores[0..n) <- exp(scores - max(scores)); returns their sum. n is a multiple of 16 (padding
// lanes hold -inf and come out as e^-87, nothing next to the max term's 1).
inline float exp_and_sum(float* scores, int64_t n) {
  vec16 lane_max = load16(scores);
  for (int64_t t = kLanes; t < n; t += kLanes) {
    const vec16 v = load16(scores + t);
    lane_max = v > lane_max ? v : lane_max;
  }
  float max = lane_max[0];
  for (int64_t j = 1; j < kLanes; ++j) max = std::max(max, lane_max[j]);
  vec16 sum = {};
  for (int64_t t = 0; t < n; t += kLanes) {
    const vec16 e = exp_nonpositive(load16(scores + t) - max);
    store16(scores + t, e);
    sum += e;
  }
  return reduce_add(sum);
}

}  // namespace sluice_vec
