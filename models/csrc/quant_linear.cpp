// Weight-only int4 / int8 matrix products on CPU with float32 activations: y = x @ W.T.
//
// Built lazily by models/quant_kernels.py through torch.utils.cpp_extension.load. The weights stay
// quantized in memory and are dequantized in registers, exactly (no activation quantization):
//   int4: W[n, k] = d[n, g] * q[n, k] + m[n, g], g = k / 32, q in [0, 15] (llama.cpp's Q4_1),
//         stored as q4 [N, K / 2] uint8, per group of 32 weights 16 bytes whose low nibble of byte
//         i is weight i and high nibble weight i + 16 (block_q4_1's qs, without d and m);
//   int8: W[n, k] = s[n, k / group] * q[n, k], q in [-128, 127] (llama.cpp's Q8_0 when group = 32,
//         per output channel when group = K).
// Dequantizing is one FMA per weight, d * q + m; for Q4_1's float16 d the product d * q is exact in
// float32, so the weight equals the GGUF converter's d * q + m bit for bit.
//
// A GEMV for the few rows of a decode step: each thread takes a range of output channels; per block
// of kChannels channels it dequantizes a 32-weight group into two 16-float vectors and multiplies
// them into up to kRowChunk rows of x at once, so every weight is read from memory once per call
// (llama.cpp's ggml_vec_dot_q4_1_q8_1 walks the same blocks, on int8 activations). Any row count
// works; past a few rows oneDNN's float32 GEMM is faster (models/backends/lean.py has the figures,
// and a tiled variant, dequantizing 128 channels into an L2 buffer for at::mm, lost to it at every
// row count), so the lean backend sends those to float32 weights.
//
// Also the lean step's two RMSNorm calls per layer (rms_norm, and add_rms_norm_ with the residual
// add before it): one call each where torch's F.rms_norm dispatches six ops on CPU.
//
// ISA: the build cache may serve different x86 CPUs, so the compile flags stay at the x86-64
// baseline. The per-ISA code (below the #else) is written once on a 16-float type F16 and compiled
// twice: this file includes itself inside namespace avx512 (F16 one __m512, under
// `#pragma GCC target("avx512f,avx512bw,avx512vl")`) and inside namespace avx2 (F16 two __m256,
// under "avx2,fma"), as Highway's foreach_target does. The caller passes the ISA to use
// (models/quant_kernels.py picks it at load from supported_isas() and the SLUICE_KERNEL_ISA
// switch), so tests run both paths in one process.

#ifndef SLUICE_QUANT_ISA_PASS
#define SLUICE_QUANT_ISA_PASS

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#define SLUICE_INLINE inline __attribute__((always_inline))

namespace {

constexpr int64_t kGroup = 32;          // weights per quantization block (Q4_1, Q8_0)
constexpr int64_t kGrainChannels = 64;  // fewest output channels a GEMV thread takes

enum class Isa : int64_t { kAvx2 = 1, kAvx512 = 2 };

// One int4 weight matrix: q4 [N, K / 2], d and m [N, K / 32].
struct Int4Weights {
  const uint8_t* q;
  const float* d;
  const float* m;
  int64_t k;
};

// One int8 weight matrix: q [N, K], s [N, scales_per_row]; group_shift = log2(group / 32), or -1
// for one scale per row.
struct Int8Weights {
  const int8_t* q;
  const float* s;
  int64_t k, scales_per_row, group_shift;
};

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma")
namespace {
namespace avx512 {

constexpr int kRowChunk = 4;  // rows of x per pass over a block of weight rows
constexpr int kChannels = 4;  // weight rows per block: 16 accumulators of 32 registers

struct F16 {
  __m512 v;
};
SLUICE_INLINE F16 zero16() { return {_mm512_setzero_ps()}; }
SLUICE_INLINE F16 splat16(float a) { return {_mm512_set1_ps(a)}; }
SLUICE_INLINE F16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
SLUICE_INLINE F16 fmadd16(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
SLUICE_INLINE F16 mul16(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
SLUICE_INLINE float hsum16(F16 a) { return _mm512_reduce_add_ps(a.v); }
// 16 bytes of nibbles: lo = the low nibbles, hi = the high ones, as floats.
SLUICE_INLINE void nibbles16(const uint8_t* p, F16& lo, F16& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), mask = _mm_set1_epi8(0x0F);
  lo.v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
  hi.v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
}
// 16 int8 as floats.
SLUICE_INLINE F16 int8x16(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}

#include __FILE__
#define SLUICE_Q8_LEVEL 2
#include "quant_gemm_q8.h"
#undef SLUICE_Q8_LEVEL

}  // namespace avx512
}  // namespace
#pragma GCC pop_options

// The prefill GEMM once more with vpdpbusd: a namespace of its own, since with avx512vnni enabled
// GCC may turn vpmaddwd + vpaddd anywhere in the code into VNNI's vpdpwssd.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")
namespace {
namespace avx512vnni {
#define SLUICE_Q8_LEVEL 3
#include "quant_gemm_q8.h"
#undef SLUICE_Q8_LEVEL
}  // namespace avx512vnni
}  // namespace
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace {
namespace avx2 {

constexpr int kRowChunk = 2;  // 16 ymm registers: 2 rows x 2 channels x 2 halves of accumulators
constexpr int kChannels = 2;

struct F16 {
  __m256 a, b;
};
SLUICE_INLINE F16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
SLUICE_INLINE F16 splat16(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
SLUICE_INLINE F16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
SLUICE_INLINE F16 fmadd16(F16 x, F16 y, F16 z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
SLUICE_INLINE F16 mul16(F16 x, F16 y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
SLUICE_INLINE float hsum16(F16 x) {
  const __m256 s = _mm256_add_ps(x.a, x.b);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_hadd_ps(h, h));
}
SLUICE_INLINE F16 bytes_to_f16(__m128i bytes, bool is_signed) {
  const __m128i high = _mm_srli_si128(bytes, 8);
  if (is_signed) return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(high))};
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high))};
}
SLUICE_INLINE void nibbles16(const uint8_t* p, F16& lo, F16& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), mask = _mm_set1_epi8(0x0F);
  lo = bytes_to_f16(_mm_and_si128(bytes, mask), false);
  hi = bytes_to_f16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), false);
}
SLUICE_INLINE F16 int8x16(const int8_t* p) {
  return bytes_to_f16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), true);
}

#include __FILE__
#define SLUICE_Q8_LEVEL 1
#include "quant_gemm_q8.h"
#undef SLUICE_Q8_LEVEL

}  // namespace avx2
}  // namespace
#pragma GCC pop_options

namespace {

template <typename Weights>
struct Kernels {
  void (*gemv)(const float*, int64_t, int64_t, float*, int64_t, int64_t, const Weights&);
  void (*gemm_q8)(const float*, int64_t, int64_t, float*, const Weights&);
};

Kernels<Int4Weights> int4_kernels(Isa isa, bool vnni = false) {
  if (isa == Isa::kAvx512) return {avx512::int4_gemv, vnni ? avx512vnni::int4_gemm_q8 : avx512::int4_gemm_q8};
  return {avx2::int4_gemv, avx2::int4_gemm_q8};
}

Kernels<Int8Weights> int8_kernels(Isa isa, bool vnni = false) {
  if (isa == Isa::kAvx512) return {avx512::int8_gemv, vnni ? avx512vnni::int8_gemm_q8 : avx512::int8_gemm_q8};
  return {avx2::int8_gemv, avx2::int8_gemm_q8};
}

bool isa_supported(Isa isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == Isa::kAvx512)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  return avx2;
}

bool has_vnni() {
  __builtin_cpu_init();
  return isa_supported(Isa::kAvx512) && __builtin_cpu_supports("avx512vnni");
}

Isa checked_isa(int64_t value) {
  TORCH_CHECK_VALUE(value == 1 || value == 2, "isa must be 1 (avx2) or 2 (avx512), got ", value);
  const Isa isa = static_cast<Isa>(value);
  TORCH_CHECK_VALUE(isa_supported(isa), "this CPU does not support isa ", value);
  return isa;
}

void check_x(const torch::Tensor& x, int64_t k) {
  TORCH_CHECK_TYPE(x.scalar_type() == torch::kFloat32, "x must be float32, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == k, "x must be [rows, in_features=", k, "], got ", x.sizes());
  TORCH_CHECK_VALUE(x.device().is_cpu(), "x must be on the CPU");
}

// y [M, N] = x @ W.T: the GEMV (float32 x, the output channels split over the threads), or with
// is_q8 the int8-activation GEMM (quant_gemm_q8.h, its own tiling and threads).
template <typename Weights>
torch::Tensor run_product(const torch::Tensor& x_in, int64_t n, const Weights& w, const Kernels<Weights>& kernels,
                          bool is_q8 = false) {
  const torch::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0);
  torch::Tensor out = torch::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (is_q8)
    kernels.gemm_q8(xp, rows, n, op, w);
  else
    at::parallel_for(0, n, kGrainChannels, [&](int64_t c0, int64_t c1) { kernels.gemv(xp, rows, n, op, c0, c1, w); });
  return out;
}

// The int4 weights of the Python call, checked against each other and against x.
Int4Weights int4_weights(const torch::Tensor& x, const torch::Tensor& q4, const torch::Tensor& d, const torch::Tensor& m) {
  TORCH_CHECK_TYPE(q4.scalar_type() == torch::kUInt8, "q4 must be uint8, got ", q4.scalar_type());
  TORCH_CHECK_TYPE(d.scalar_type() == torch::kFloat32 && m.scalar_type() == torch::kFloat32, "d and m must be float32");
  TORCH_CHECK_VALUE(q4.dim() == 2 && q4.is_contiguous() && d.is_contiguous() && m.is_contiguous(),
                    "q4 [N, K / 2], d and m [N, K / 32] must be contiguous");
  const int64_t n = q4.size(0), k = q4.size(1) * 2;
  TORCH_CHECK_VALUE(k % kGroup == 0, "in_features must be a multiple of ", kGroup, ", got ", k);
  TORCH_CHECK_VALUE(d.sizes() == m.sizes() && d.dim() == 2 && d.size(0) == n && d.size(1) == k / kGroup,
                    "d and m must be [N=", n, ", K / 32=", k / kGroup, "], got ", d.sizes(), " and ", m.sizes());
  check_x(x, k);
  return Int4Weights{q4.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), k};
}

// The int8 weights of the Python call, checked against each other and against x.
Int8Weights int8_weights(const torch::Tensor& x, const torch::Tensor& q8, const torch::Tensor& s) {
  TORCH_CHECK_TYPE(q8.scalar_type() == torch::kInt8, "q8 must be int8, got ", q8.scalar_type());
  TORCH_CHECK_TYPE(s.scalar_type() == torch::kFloat32, "s must be float32, got ", s.scalar_type());
  TORCH_CHECK_VALUE(q8.dim() == 2 && q8.is_contiguous() && s.dim() == 2 && s.is_contiguous(),
                    "q8 [N, K] and s [N, K / group] must be contiguous");
  const int64_t n = q8.size(0), k = q8.size(1), scales = s.size(1);
  TORCH_CHECK_VALUE(k % kGroup == 0, "in_features must be a multiple of ", kGroup, ", got ", k);
  TORCH_CHECK_VALUE(s.size(0) == n && scales >= 1 && k % scales == 0, "s must be [N=", n, ", K / group], got ", s.sizes());
  const int64_t blocks_per_scale = k / scales / kGroup;
  TORCH_CHECK_VALUE(scales == 1 || (k / scales % kGroup == 0 && (blocks_per_scale & (blocks_per_scale - 1)) == 0),
                    "the group must be in_features or a power-of-two multiple of 32, got ", k / scales);
  check_x(x, k);
  const int64_t shift = scales == 1 ? -1 : __builtin_ctzll(static_cast<uint64_t>(blocks_per_scale));
  return Int8Weights{q8.data_ptr<int8_t>(), s.data_ptr<float>(), k, scales, shift};
}

// The q8 GEMM's path: vnni asks for vpdpbusd (AVX-512 only, where the CPU has it).
bool checked_vnni(Isa isa, bool vnni) {
  TORCH_CHECK_VALUE(!vnni || (isa == Isa::kAvx512 && has_vnni()), "vnni needs isa 2 (avx512) on a CPU with AVX-512 VNNI");
  return vnni;
}

torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& q4, const torch::Tensor& d, const torch::Tensor& m,
                          int64_t isa) {
  const Int4Weights w = int4_weights(x, q4, d, m);
  return run_product(x, q4.size(0), w, int4_kernels(checked_isa(isa)));
}

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& q8, const torch::Tensor& s, int64_t isa) {
  const Int8Weights w = int8_weights(x, q8, s);
  return run_product(x, q8.size(0), w, int8_kernels(checked_isa(isa)));
}

torch::Tensor int4_linear_q8(const torch::Tensor& x, const torch::Tensor& q4, const torch::Tensor& d, const torch::Tensor& m,
                             int64_t isa, bool vnni) {
  const Int4Weights w = int4_weights(x, q4, d, m);
  const Isa level = checked_isa(isa);
  return run_product(x, q4.size(0), w, int4_kernels(level, checked_vnni(level, vnni)), true);
}

torch::Tensor int8_linear_q8(const torch::Tensor& x, const torch::Tensor& q8, const torch::Tensor& s, int64_t isa, bool vnni) {
  const Int8Weights w = int8_weights(x, q8, s);
  const Isa level = checked_isa(isa);
  return run_product(x, q8.size(0), w, int8_kernels(level, checked_vnni(level, vnni)), true);
}

// RMSNorm of one row: out = x / sqrt(mean(x^2) + eps) * w (Hugging Face's LlamaRMSNorm in float32;
// the sum of squares in 8 partial sums, so only its rounding order differs).
void rms_norm_row(const float* x, const float* w, float eps, int64_t n, float* out) {
  float partial[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) partial[j] += x[i + j] * x[i + j];
  for (; i < n; ++i) partial[0] += x[i] * x[i];
  float sum = 0.0f;
  for (const float p : partial) sum += p;
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

void check_norm(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK_TYPE(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32, "x and w must be float32");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.is_contiguous() && w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1),
                    "x must be [rows, hidden] and w [hidden], contiguous, got ", x.sizes(), " and ", w.sizes());
}

// Rows of x [T, H] normalized (the lean step's input norms): one call instead of torch's six ops.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_norm(x, w);
  torch::Tensor out = torch::empty_like(x);
  const int64_t n = x.size(1);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_norm_row(xp + r * n, wp, static_cast<float>(eps), n, op + r * n);
  });
  return out;
}

// x += delta (the residual, in place), then the rows of x normalized: the lean step's
// post-attention residual and norm in one call.
torch::Tensor add_rms_norm_(torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& w, double eps) {
  check_norm(x, w);
  TORCH_CHECK_VALUE(delta.sizes() == x.sizes() && delta.is_contiguous() && delta.scalar_type() == torch::kFloat32,
                    "delta must be float32 and contiguous, the shape of x ", x.sizes(), ", got ", delta.sizes());
  torch::Tensor out = torch::empty_like(x);
  const int64_t n = x.size(1);
  const float *dp = delta.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *xp = x.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t i = 0; i < n; ++i) xp[r * n + i] += dp[r * n + i];
      rms_norm_row(xp + r * n, wp, static_cast<float>(eps), n, op + r * n);
    }
  });
  return out;
}

std::vector<int64_t> supported_isas() {
  std::vector<int64_t> result;
  for (const Isa isa : {Isa::kAvx2, Isa::kAvx512})
    if (isa_supported(isa)) result.push_back(static_cast<int64_t>(isa));
  return result;
}

}  // namespace

// The GIL is released while a product or a norm runs, as torch's own ops and the paged-attention
// kernel do: a decode step is hundreds of these calls, and the server's event loop shares the
// process (it would otherwise wait for the step's next torch op to get the GIL).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  using ReleaseGil = pybind11::call_guard<pybind11::gil_scoped_release>;
  module.def("int4_linear", &int4_linear, "x [M, K] f32 @ (d * q + m).T, q4 [N, K/2] u8, d and m [N, K/32] f32",
             pybind11::arg("x"), pybind11::arg("q4"), pybind11::arg("d"), pybind11::arg("m"), pybind11::arg("isa"), ReleaseGil());
  module.def("int8_linear", &int8_linear, "x [M, K] f32 @ (s * q).T, q8 [N, K] i8, s [N, K/group] f32", pybind11::arg("x"),
             pybind11::arg("q8"), pybind11::arg("s"), pybind11::arg("isa"), ReleaseGil());
  module.def("int4_linear_q8", &int4_linear_q8, "int4_linear with x quantized to int8 per row and group of 32",
             pybind11::arg("x"), pybind11::arg("q4"), pybind11::arg("d"), pybind11::arg("m"), pybind11::arg("isa"),
             pybind11::arg("vnni"), ReleaseGil());
  module.def("int8_linear_q8", &int8_linear_q8, "int8_linear with x quantized to int8 per row and group of 32",
             pybind11::arg("x"), pybind11::arg("q8"), pybind11::arg("s"), pybind11::arg("isa"), pybind11::arg("vnni"),
             ReleaseGil());
  module.def("has_vnni", &has_vnni, "whether this CPU runs the q8 GEMM's AVX-512 VNNI path");
  module.def("rms_norm", &rms_norm, "x [T, H] f32 rows / sqrt(mean(x^2) + eps) * w", pybind11::arg("x"), pybind11::arg("w"),
             pybind11::arg("eps"), ReleaseGil());
  module.def("add_rms_norm_", &add_rms_norm_, "x += delta in place, then rms_norm(x, w, eps)", pybind11::arg("x"),
             pybind11::arg("delta"), pybind11::arg("w"), pybind11::arg("eps"), ReleaseGil());
  module.def("supported_isas", &supported_isas, "the ISA levels this CPU runs: 1 avx2, 2 avx512");
}

#else  // The per-ISA pass, inside namespace avx512 or avx2: F16 and its helpers are defined there.

// The 32 dequantized weights of group g of an int4 row.
struct Int4Row {
  const uint8_t* q;
  const float* d;
  const float* m;
  SLUICE_INLINE void group(int64_t g, F16& lo, F16& hi) const {
    nibbles16(q + g * (kGroup / 2), lo, hi);
    const F16 dv = splat16(d[g]), mv = splat16(m[g]);
    lo = fmadd16(lo, dv, mv);
    hi = fmadd16(hi, dv, mv);
  }
};

// The 32 dequantized weights of group g of an int8 row.
struct Int8Row {
  const int8_t* q;
  const float* s;
  int64_t group_shift;
  SLUICE_INLINE void group(int64_t g, F16& lo, F16& hi) const {
    const F16 sv = splat16(s[group_shift < 0 ? 0 : g >> group_shift]);
    lo = mul16(int8x16(q + g * kGroup), sv);
    hi = mul16(int8x16(q + g * kGroup + 16), sv);
  }
};

SLUICE_INLINE Int4Row row_of(const Int4Weights& w, int64_t c) {
  const int64_t groups = w.k / kGroup;
  return Int4Row{w.q + c * (w.k / 2), w.d + c * groups, w.m + c * groups};
}

SLUICE_INLINE Int8Row row_of(const Int8Weights& w, int64_t c) {
  return Int8Row{w.q + c * w.k, w.s + c * w.scales_per_row, w.group_shift};
}

// out[r, c] for R rows of x [R, k] and C weight rows: each group's weights dequantized once.
template <int R, int C, typename Row>
SLUICE_INLINE void dot_block(const float* x, int64_t k, const Row* rows, float* out, int64_t n) {
  F16 acc[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = zero16();
  for (int64_t g = 0; g < k / kGroup; ++g) {
    for (int c = 0; c < C; ++c) {
      F16 lo, hi;
      rows[c].group(g, lo, hi);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * k + g * kGroup;
        acc[c][r] = fmadd16(hi, load16(xr + 16), fmadd16(lo, load16(xr), acc[c][r]));
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) out[r * n + c] = hsum16(acc[c][r]);
}

// The last rows (fewer than kRowChunk) of x against C weight rows.
template <int R, int C, typename Row>
SLUICE_INLINE void dot_tail(const float* x, int64_t rows, int64_t k, const Row* w, float* out, int64_t n) {
  if constexpr (R > 0) {
    if (rows == R)
      dot_block<R, C>(x, k, w, out, n);
    else
      dot_tail<R - 1, C>(x, rows, k, w, out, n);
  }
}

template <int C, typename Row>
SLUICE_INLINE void dot_rows(const float* x, int64_t rows, int64_t k, const Row* w, float* out, int64_t n) {
  int64_t r = 0;
  for (; r + kRowChunk <= rows; r += kRowChunk) dot_block<kRowChunk, C>(x + r * k, k, w, out + r * n, n);
  dot_tail<kRowChunk - 1, C>(x + r * k, rows - r, k, w, out + r * n, n);
}

// The GEMV of x [rows, K] over output channels [c0, c1) of out [rows, n].
template <typename Weights>
SLUICE_INLINE void gemv_range(const float* x, int64_t rows, int64_t n, float* out, int64_t c0, int64_t c1, const Weights& w) {
  using Row = decltype(row_of(w, 0));
  int64_t c = c0;
  for (; c + kChannels <= c1; c += kChannels) {
    Row block[kChannels];
    for (int i = 0; i < kChannels; ++i) block[i] = row_of(w, c + i);
    dot_rows<kChannels>(x, rows, w.k, block, out + c, n);
  }
  for (; c < c1; ++c) {
    const Row one[1] = {row_of(w, c)};
    dot_rows<1>(x, rows, w.k, one, out + c, n);
  }
}

void int4_gemv(const float* x, int64_t rows, int64_t n, float* out, int64_t c0, int64_t c1, const Int4Weights& w) {
  gemv_range(x, rows, n, out, c0, c1, w);
}
void int8_gemv(const float* x, int64_t rows, int64_t n, float* out, int64_t c0, int64_t c1, const Int8Weights& w) {
  gemv_range(x, rows, n, out, c0, c1, w);
}

#endif
