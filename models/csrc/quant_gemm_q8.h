// The prefill GEMM of models/csrc/quant_linear.cpp: int8 activations against int4 (Q4_1) or int8
// (Q8_0 / per-channel) weights, integer dot products exact within each group of 32.
//
// No include guard: quant_linear.cpp includes this file once per ISA namespace (avx2, avx512,
// avx512vnni) with SLUICE_Q8_LEVEL 1, 2 or 3 and the matching target pragma, as it includes
// itself for the GEMV.
//
// Activations: each row of x [M, K] quantized per group of 32 input channels, symmetric, as
// llama.cpp's quantize_row_q8_1 (ggml-quants.c): d = max|x| / 127, q = rint(x / d) in
// [-127, 127] (computed as x * (1 / d), 0 where d = 0), s = d * sum(q) (block_q8_1.s, kept in
// float32 here). Per group, not per row: one outlier channel then costs only its own group's
// resolution (per row it would flatten every other channel of the row), and the group matches
// the weights' group, so each group's integer product is scaled once.
//
// Products, per output channel c, row r, group g (llama.cpp's ggml_vec_dot_q4_1_q8_1 and
// ggml_vec_dot_q8_0_q8_0, arch/x86/quants.c):
//   Q4_1: y += dw[c,g] * dx[r,g] * sum_j qw[c,j] * qx[r,j] + m[c,g] * s[r,g]
//         (qw unsigned in [0, 15], qx signed: u8 x s8, vpdpbusd's operands as they are);
//   int8: y += dw[c,g] * dx[r,g] * sum_j |qw[c,j]| * (sign(qw[c,j]) * qx[r,j])
//         (llama.cpp's sign trick: |qw| in [0, 128] unsigned, sign(qw) * qx in [-127, 127]).
// The sum over j is int32 and exact: vpdpbusd (AVX-512 VNNI) adds four u8 x s8 products per
// lane into int32; without VNNI, vpmaddubsw adds two into int16 (at most 2 * 128 * 127 = 32512
// for int8 weights, 2 * 15 * 127 for int4: never saturates), then vpmaddwd adds pairs into int32.
// The scaling and the sum over groups are float32 (16 lanes: lanes 0-7 one group, 8-15 the next),
// so results differ from a float64 product of the same integers by float32 rounding only.
//
// Tiling: x is quantized once per call (rows in parallel). The output channels are then split
// over the threads in blocks of kQ8BlockChannels; each block's weights are unpacked once per
// call into a small buffer (nibbles to bytes, or |q| and q, scales expanded per group of 32) that
// stays in L1/L2 while every row tile (kQ8Rows rows x kQ8Channels channels of float32
// accumulators) passes over it. K is padded to a multiple of 64 with zeros in both buffers.
//
// Which wins where: ms per product, SmolLM2-135M's shapes, random weights, median of 7 runs
// interleaved with the others (step_split.time_products, `python -m bench.decode_split`), 2
// threads, 2-vCPU AMD EPYC (avx2 fma avx512f/bw/dq/vl/vnni/bf16), load 1.2-1.5 from other
// work; oneDNN's float32 runs AVX-512 on it; "GEMV" the float32-activation int4 kernel:
//   product [N, K]    rows  float32  int4q8 VNNI  int4q8 512  int4q8 AVX2  int8q8 VNNI  int4 GEMV
//   qkv [960, 576]      16    0.121     0.101       0.118       0.153        0.113       0.115
//                       64    0.364     0.309       0.382       0.466        0.350       0.446
//                      512    2.659     2.351       2.938       3.678        2.614       3.703
//   o [576, 576]        16    0.082     0.061       0.071       0.086        0.068       0.071
//                       64    0.227     0.191       0.234       0.291        0.216       0.268
//                      512    1.690     1.453       1.827       2.357        1.627       2.215
//   gate_up [3072, 576] 16    0.371     0.287       0.342       0.443        0.336       0.366
//                       64    1.184     0.987       1.226       1.711        1.116       1.433
//                      512    8.323     7.454       9.299      12.160        8.378      11.855
//   down [576, 1536]    16    0.185     0.148       0.176       0.229        0.166       0.174
//                       64    0.590     0.465       0.579       0.704        0.530       0.692
//                      512    4.167     3.557       4.534       5.266        4.066       5.623
// So on AVX-512 with VNNI the int4 GEMM beats oneDNN's float32 at every prefill size, 1.12-1.29x
// (more at 16-64 rows than at 512), and the int4 GEMV from 16 rows on; int8 weights gain less
// (1.0-1.2x: the sign trick costs an op per product and twice the weight bytes). Without VNNI
// (vpmaddubsw + vpmaddwd: one op more per 64 products) it is on a par with float32 at 16 rows and
// 0.88-0.97x beyond; the AVX2 path loses to AVX-512 float32 here (an AVX2-only CPU, where oneDNN
// runs AVX2 too, was not measured). The bound: per 64 multiply-adds the GEMM issues vpdpbusd,
// vcvtdq2ps, vmulps (the two groups' scales) and vfmadd231ps where float32 issues four FMAs,
// so about 1.33x at best on a CPU whose 512-bit integer and float products share the FMA pipes.
// The lean backend measures at build from which row count it pays (row_crossover.py).

namespace q8 {

#if SLUICE_Q8_LEVEL >= 2
constexpr int kQ8Rows = 4;      // 16 accumulators of 32 zmm registers
constexpr int kQ8Channels = 4;

struct V {
  __m512 v;
};
struct I {
  __m512i v;
};
SLUICE_INLINE V vzero() { return {_mm512_setzero_ps()}; }
SLUICE_INLINE V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
SLUICE_INLINE V vmul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
SLUICE_INLINE V vfmadd(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
SLUICE_INLINE float vhsum(V a) { return _mm512_reduce_add_ps(a.v); }
SLUICE_INLINE I iload(const void* p) { return {_mm512_loadu_si512(p)}; }
// Per int32 lane, the sum of four u8 x s8 products, as floats.
SLUICE_INLINE V dot_us(I u, I s) {
#if SLUICE_Q8_LEVEL == 3
  return {_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u.v, s.v))};
#else
  return {_mm512_cvtepi32_ps(_mm512_madd_epi16(_mm512_maddubs_epi16(u.v, s.v), _mm512_set1_epi16(1)))};
#endif
}
// x negated where w < 0 (where w = 0 the product is 0 anyway).
SLUICE_INLINE I sign_like(I x, I w) { return {_mm512_mask_sub_epi8(x.v, _mm512_movepi8_mask(w.v), _mm512_setzero_si512(), x.v)}; }

// One group of 32 floats to int8 (see the header); returns d, sets *sum to sum(q).
SLUICE_INLINE float quantize_group(const float* x, int8_t* q, int32_t* sum) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  const __m512 scale = _mm512_set1_ps(id);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, scale)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, scale));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  return d;
}
#else
constexpr int kQ8Rows = 2;  // 16 ymm registers: 2 x 2 accumulators of two halves, the rest operands
constexpr int kQ8Channels = 2;

struct V {
  __m256 a, b;
};
struct I {
  __m256i a, b;
};
SLUICE_INLINE V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
SLUICE_INLINE V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
SLUICE_INLINE V vmul(V x, V y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
SLUICE_INLINE V vfmadd(V x, V y, V z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
SLUICE_INLINE float vhsum(V x) {
  const __m256 s = _mm256_add_ps(x.a, x.b);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_hadd_ps(h, h));
}
SLUICE_INLINE I iload(const void* p) {
  const __m256i* q = reinterpret_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
SLUICE_INLINE __m256 dot_us32(__m256i u, __m256i s) {
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
SLUICE_INLINE V dot_us(I u, I s) { return {dot_us32(u.a, s.a), dot_us32(u.b, s.b)}; }
SLUICE_INLINE I sign_like(I x, I w) { return {_mm256_sign_epi8(x.a, w.a), _mm256_sign_epi8(x.b, w.b)}; }

SLUICE_INLINE float quantize_group(const float* x, int8_t* q, int32_t* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float d = _mm_cvtss_f32(m4) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  const __m256 scale = _mm256_set1_ps(id);
  __m256i i32[4];
  for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], scale));
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  *sum = _mm_cvtsi128_si32(t);
  // packs works per 128-bit lane: the permute puts the 4-byte runs back in order (as llama.cpp).
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return d;
}
#endif

constexpr int64_t kQ8Chunk = 64;          // bytes of K per step: two groups
constexpr int64_t kQ8BlockChannels = 32;  // output channels unpacked together

SLUICE_INLINE int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// x quantized: q [M, kp] int8, d [M, kp / 4] and s [M, gm] float32, padded with zeros. d holds
// each group's scale 8 times, beside the 8 int32 lanes of its integer product (spread16).
struct Acts {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  int64_t kp, gm;
};

// Group g's scale into the 16-lane pairs of d (lanes 0-7 of pair g / 2 for an even g, 8-15 odd).
SLUICE_INLINE void spread16(float* d, int64_t g, float value) {
  for (int i = 0; i < 8; ++i) d[g * 8 + i] = value;
}

// A block of weight rows unpacked: u [C, kp] the unsigned operand (int4 q, or |q| of int8), w
// [C, kp] the signs (int8 only), d [C, kp / 4] the scale of each group of 32 (spread16), m [C, gm]
// (int4).
struct Block {
  std::vector<uint8_t> u;
  std::vector<int8_t> w;
  std::vector<float> d, m;
};

Acts quantize_rows(const float* x, int64_t rows, int64_t k) {
  Acts a;
  a.kp = round_up(k, kQ8Chunk);
  a.gm = round_up(k / kGroup, 16);
  a.q.assign(rows * a.kp, 0);
  a.d.assign(rows * a.kp / 4, 0.0f);
  a.s.assign(rows * a.gm, 0.0f);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < k / kGroup; ++g) {
        int32_t sum = 0;
        const float d = quantize_group(x + r * k + g * kGroup, a.q.data() + r * a.kp + g * kGroup, &sum);
        spread16(a.d.data() + r * a.kp / 4, g, d);
        a.s[r * a.gm + g] = d * static_cast<float>(sum);
      }
  });
  return a;
}

void unpack(const Int4Weights& w, int64_t c0, int64_t count, const Acts& a, Block& b) {
  const int64_t groups = w.k / kGroup;
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t c = 0; c < count; ++c) {
    const uint8_t* src = w.q + (c0 + c) * (w.k / 2);
    uint8_t* dst = b.u.data() + c * a.kp;
    for (int64_t g = 0; g < groups; ++g) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + g * kGroup / 2));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + g * kGroup), _mm_and_si128(bytes, mask));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + g * kGroup + 16), _mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
      spread16(b.d.data() + c * a.kp / 4, g, w.d[(c0 + c) * groups + g]);
      b.m[c * a.gm + g] = w.m[(c0 + c) * groups + g];
    }
  }
}

void unpack(const Int8Weights& w, int64_t c0, int64_t count, const Acts& a, Block& b) {
  for (int64_t c = 0; c < count; ++c) {
    const int8_t* src = w.q + (c0 + c) * w.k;
    for (int64_t g = 0; g < w.k / kGroup; ++g) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + g * kGroup));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.w.data() + c * a.kp + g * kGroup), q);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.u.data() + c * a.kp + g * kGroup), _mm256_abs_epi8(q));
      spread16(b.d.data() + c * a.kp / 4, g, w.s[(c0 + c) * w.scales_per_row + (w.group_shift < 0 ? 0 : g >> w.group_shift)]);
    }
  }
}

// out[r, c] for R rows from r0 and C channels of the block from c (out already offset to c0).
template <int R, int C, bool kSigned>
SLUICE_INLINE void tile(const Acts& a, int64_t r0, const Block& b, int64_t c, float* out, int64_t n) {
  V acc[R][C];
  const int8_t* xq[R];
  const float* xd[R];
  const uint8_t* wu[C];
  const int8_t* ws[C];
  const float* wd[C];
  for (int i = 0; i < R; ++i) {
    xq[i] = a.q.data() + (r0 + i) * a.kp;
    xd[i] = a.d.data() + (r0 + i) * a.kp / 4;
    for (int j = 0; j < C; ++j) acc[i][j] = vzero();
  }
  for (int j = 0; j < C; ++j) {
    wu[j] = b.u.data() + (c + j) * a.kp;
    ws[j] = kSigned ? b.w.data() + (c + j) * a.kp : nullptr;
    wd[j] = b.d.data() + (c + j) * a.kp / 4;
  }
  // Per 64 bytes of K: the scales of its two groups are 16 floats (spread16), so the float index
  // is a quarter of the byte index.
  for (int64_t k = 0; k < a.kp; k += kQ8Chunk) {
    I x[R];
    V xs[R];
    for (int i = 0; i < R; ++i) {
      x[i] = iload(xq[i] + k);
      xs[i] = vload(xd[i] + k / 4);
    }
    for (int j = 0; j < C; ++j) {
      const I u = iload(wu[j] + k);
      const V ds = vload(wd[j] + k / 4);
      if constexpr (kSigned) {
        const I w = iload(ws[j] + k);
        for (int i = 0; i < R; ++i) acc[i][j] = vfmadd(dot_us(u, sign_like(x[i], w)), vmul(xs[i], ds), acc[i][j]);
      } else {
        for (int i = 0; i < R; ++i) acc[i][j] = vfmadd(dot_us(u, x[i]), vmul(xs[i], ds), acc[i][j]);
      }
    }
  }
  if constexpr (!kSigned)  // Q4_1's minimum: sum over groups of m[c, g] * s[r, g]
    for (int64_t g = 0; g < a.gm; g += 16)
      for (int j = 0; j < C; ++j)
        for (int i = 0; i < R; ++i)
          acc[i][j] = vfmadd(vload(b.m.data() + (c + j) * a.gm + g), vload(a.s.data() + (r0 + i) * a.gm + g), acc[i][j]);
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) out[(r0 + i) * n + c + j] = vhsum(acc[i][j]);
}

template <int R, bool kSigned>
SLUICE_INLINE void row_tile(const Acts& a, int64_t r0, const Block& b, int64_t count, float* out, int64_t n) {
  int64_t c = 0;
  for (; c + kQ8Channels <= count; c += kQ8Channels) tile<R, kQ8Channels, kSigned>(a, r0, b, c, out, n);
  for (; c < count; ++c) tile<R, 1, kSigned>(a, r0, b, c, out, n);
}

// The last rows (fewer than kQ8Rows).
template <int R, bool kSigned>
SLUICE_INLINE void row_tail(const Acts& a, int64_t r0, int64_t rows, const Block& b, int64_t count, float* out, int64_t n) {
  if constexpr (R > 0) {
    if (rows == R)
      row_tile<R, kSigned>(a, r0, b, count, out, n);
    else
      row_tail<R - 1, kSigned>(a, r0, rows, b, count, out, n);
  }
}

template <typename Weights>
void gemm(const float* x, int64_t rows, int64_t n, float* out, const Weights& w) {
  constexpr bool kSigned = std::is_same_v<Weights, Int8Weights>;
  const Acts a = quantize_rows(x, rows, w.k);
  const int64_t blocks = (n + kQ8BlockChannels - 1) / kQ8BlockChannels;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    Block b;
    b.u.assign(kQ8BlockChannels * a.kp, 0);
    b.d.assign(kQ8BlockChannels * a.kp / 4, 0.0f);
    if constexpr (kSigned)
      b.w.assign(kQ8BlockChannels * a.kp, 0);
    else
      b.m.assign(kQ8BlockChannels * a.gm, 0.0f);
    for (int64_t block = b0; block < b1; ++block) {
      const int64_t c0 = block * kQ8BlockChannels, count = std::min(kQ8BlockChannels, n - c0);
      unpack(w, c0, count, a, b);
      int64_t r = 0;
      for (; r + kQ8Rows <= rows; r += kQ8Rows) row_tile<kQ8Rows, kSigned>(a, r, b, count, out + c0, n);
      row_tail<kQ8Rows - 1, kSigned>(a, r, rows - r, b, count, out + c0, n);
    }
  });
}

}  // namespace q8

void int4_gemm_q8(const float* x, int64_t rows, int64_t n, float* out, const Int4Weights& w) { q8::gemm(x, rows, n, out, w); }
void int8_gemm_q8(const float* x, int64_t rows, int64_t n, float* out, const Int8Weights& w) { q8::gemm(x, rows, n, out, w); }
