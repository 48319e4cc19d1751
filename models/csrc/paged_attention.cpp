// Decode-time paged attention on CPU: one query token per sequence over its block-table KV.
//
// The cache holds float32, bfloat16 or int8 K/V (the query float32 or bfloat16). An int8 cache
// comes with a float32 scale per token and kv head (symmetric absmax, x ~= scale * q, written by
// models/kv_cache.py). Other than float32 caches are widened a block at a time into an L1 buffer of
// floats, int8 rows times their scales (each element converted once, not once per query head).
//
// Built lazily by models/paged_attention.py through torch.utils.cpp_extension.load. Threads split
// the (sequence, kv head) pairs into contiguous ranges holding about equal numbers of tokens; a
// thread handles the kv heads it holds of a sequence together, so each K and V row is read from
// memory once per call and in address order within a block (decode attention is bandwidth-bound).
// Softmax is two-pass: scaled scores into a thread-local buffer, then max, exp and sum; the output
// is divided by the sum at the end.
//
// Portability: the build cache may be shared by machines with different x86 CPUs, so the compile
// flags stay at the x86-64 baseline and the hot loops are compiled three times with GCC's target
// attribute (x86-64-v4 = AVX-512, v3 = AVX2+FMA, baseline = SSE2). The best level the running CPU
// supports is picked at load; select_isa() picks a lower one (SLUICE_KERNEL_ISA=avx2 forces the
// AVX2 path on an AVX-512 machine, for tests). Other compilers and CPUs get the baseline only.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "paged_attention_checks.h"
#include "vec16.h"

namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define SLUICE_X86_LEVELS 1
#define SLUICE_AVX512 __attribute__((target("arch=x86-64-v4"), flatten))
#define SLUICE_AVX2 __attribute__((target("arch=x86-64-v3"), flatten))
#endif

using namespace sluice_checks;
using namespace sluice_vec;


// Everything the per-sequence work needs, validated by the launcher. TQ is the query's and the
// output's element type, TKV the cache's; scales are [num_blocks, block_size, num_kv_heads]
// float32 for an int8 cache, null otherwise.
template <typename TQ, typename TKV>
struct Problem {
  const TQ* query;
  const TKV* key_cache;
  const TKV* value_cache;
  const float* key_scales;
  const float* value_scales;
  const int32_t* block_tables;
  const int32_t* context_lens;
  TQ* out;
  int64_t query_seq_stride, query_head_stride, query_dim_stride;
  int64_t max_blocks_per_seq, block_size, num_heads, num_kv_heads, head_dim;
  float scale;
};

// Caches other than float32 are widened block by block into a float buffer (int8 rows times
// their scales) before the dot products and the weighted sums: each element is converted once,
// not once per query head of its kv head, and the arithmetic runs on L1-resident float rows.
template <typename TKV>
constexpr bool kWidened = !std::is_same_v<TKV, float>;

// One thread's share of one sequence: kv heads [kv_begin, kv_end) and their query heads.
struct Share {
  int64_t seq, kv_begin, kv_end;
};

// Thread-local buffers, sized for the most heads and the longest context of a thread's shares.
struct Scratch {
  std::vector<float> query;     // [heads, head_dim], pre-scaled
  std::vector<float> scores;    // [heads, score_stride]: scores, then exp(score - max score)
  std::vector<float> acc;       // [heads, head_dim]
  std::vector<float> inv_sums;  // [heads]
  std::vector<float> block;     // [block_size, kv heads, head_dim]: one block's rows, widened
};

// A share's context rounded up to whole 16-lane vectors, the row length of Scratch::scores.
inline int64_t score_stride(int64_t context_len) { return (context_len + kLanes - 1) / kLanes * kLanes; }

// How many blocks ahead to prefetch. Blocks sit anywhere in the cache, out of reach of the
// hardware prefetcher; two blocks ahead into L2 measured best.
constexpr int64_t kPrefetchBlocks = 2;

// Calls fn(start, count, rows, scales) for every block of the share's sequence: tokens start ..
// start+count, rows pointing at the first token's K or V for kv_begin (the share's kv heads lie
// contiguous from there; the next token is num_kv_heads * head_dim further), scales at its scale
// for kv_begin (next token num_kv_heads further; null for a float cache). The prefetch loop stays
// inline: GCC 12 deemed a helper (or lambda) that only prefetches pure and deleted its calls.
template <typename TQ, typename TKV, typename Fn>
inline void for_each_block(const Problem<TQ, TKV>& p, const Share& share, const TKV* cache, const float* scales,
                           Fn fn) {
  const int64_t context_len = p.context_lens[share.seq];
  const int32_t* blocks = p.block_tables + share.seq * p.max_blocks_per_seq;
  const int64_t num_blocks = (context_len + p.block_size - 1) / p.block_size;
  const int64_t row_stride = p.num_kv_heads * p.head_dim;
  const int64_t block_stride = p.block_size * row_stride;
  const int64_t row_bytes = (share.kv_end - share.kv_begin) * p.head_dim * static_cast<int64_t>(sizeof(TKV));
  const TKV* base = cache + share.kv_begin * p.head_dim;
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int64_t ahead = b == 0 ? 1 : kPrefetchBlocks; ahead <= kPrefetchBlocks && b + ahead < num_blocks; ++ahead) {
      const TKV* rows = base + static_cast<int64_t>(blocks[b + ahead]) * block_stride;
      const int64_t count = std::min(p.block_size, context_len - (b + ahead) * p.block_size);
      for (int64_t i = 0; i < count; ++i) {
        const char* row = reinterpret_cast<const char*>(rows + i * row_stride);
        for (int64_t offset = 0; offset < row_bytes; offset += 64) __builtin_prefetch(row + offset, 0, 1);
      }
    }
    const int64_t start = b * p.block_size;
    const int64_t block = blocks[b];
    const float* block_scales = scales == nullptr ? nullptr : scales + block * p.block_size * p.num_kv_heads + share.kv_begin;
    fn(start, std::min(p.block_size, context_len - start), base + block * block_stride, block_scales);
  }
}

// q[h] = query[seq, head] * scale in float, for the share's query heads.
template <typename TQ, typename TKV>
inline void load_query(const Problem<TQ, TKV>& p, const Share& share, float* q) {
  const int64_t group = p.num_heads / p.num_kv_heads;
  for (int64_t h = 0; h < (share.kv_end - share.kv_begin) * group; ++h) {
    const TQ* src = p.query + share.seq * p.query_seq_stride + (share.kv_begin * group + h) * p.query_head_stride;
    for (int64_t d = 0; d < p.head_dim; ++d) q[h * p.head_dim + d] = to_float(src[d * p.query_dim_stride]) * p.scale;
  }
}

// The share's rows of one block as float: rows of the cache itself for float32 (row_stride
// num_kv_heads * head_dim); else widened into buffer, int8 rows times their scales (row_stride
// (kv_end - kv_begin) * head_dim). Row i of kv head kv starts at result + i * row_stride + kv * head_dim.
template <typename TQ, typename TKV>
inline const float* float_rows(const Problem<TQ, TKV>& p, const Share& share, const TKV* rows, const float* scales,
                               int64_t count, float* buffer, int64_t& row_stride) {
  const int64_t dim = p.head_dim;
  row_stride = p.num_kv_heads * dim;
  if constexpr (!kWidened<TKV>) {
    return rows;
  } else {
    const int64_t num_kv = share.kv_end - share.kv_begin;
    for (int64_t i = 0; i < count; ++i) {
      for (int64_t kv = 0; kv < num_kv; ++kv) {
        const TKV* src = rows + i * row_stride + kv * dim;
        float* dst = buffer + (i * num_kv + kv) * dim;
        const float row_scale = scales == nullptr ? 1.0f : scales[i * p.num_kv_heads + kv];
        for (int64_t d = 0; d < dim; ++d) dst[d] = to_float(src[d]) * row_scale;
      }
    }
    row_stride = num_kv * dim;
    return buffer;
  }
}

// scores[h, t] = q[h] . K[t] for every token; lanes past the context are set to -inf.
template <typename TQ, typename TKV>
inline void score_keys(const Problem<TQ, TKV>& p, const Share& share, const float* q, float* scores, float* buffer) {
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t dim = p.head_dim;
  const int64_t context_len = p.context_lens[share.seq];
  const int64_t stride = score_stride(context_len);
  for_each_block(p, share, p.key_cache, p.key_scales, [&](int64_t start, int64_t count, const TKV* rows, const float* scales) {
    int64_t row_stride;
    const float* keys = float_rows(p, share, rows, scales, count, buffer, row_stride);
    for (int64_t i = 0; i < count; ++i) {
      for (int64_t kv = 0; kv < share.kv_end - share.kv_begin; ++kv) {
        const float* k = keys + i * row_stride + kv * dim;
        for (int64_t h = kv * group; h < (kv + 1) * group; ++h) scores[h * stride + start + i] = dot(q + h * dim, k, dim);
      }
    }
  });
  for (int64_t h = 0; h < (share.kv_end - share.kv_begin) * group; ++h) {
    std::fill(scores + h * stride + context_len, scores + (h + 1) * stride, -std::numeric_limits<float>::infinity());
  }
}

// acc[h] = sum over tokens of weights[h, t] * V[t].
template <typename TQ, typename TKV>
inline void accumulate_values(const Problem<TQ, TKV>& p, const Share& share, const float* weights, float* acc,
                              float* buffer) {
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t dim = p.head_dim;
  const int64_t stride = score_stride(p.context_lens[share.seq]);
  std::fill(acc, acc + (share.kv_end - share.kv_begin) * group * dim, 0.0f);
  for_each_block(p, share, p.value_cache, p.value_scales, [&](int64_t start, int64_t count, const TKV* rows, const float* scales) {
    int64_t row_stride;
    const float* values = float_rows(p, share, rows, scales, count, buffer, row_stride);
    for (int64_t kv = 0; kv < share.kv_end - share.kv_begin; ++kv) {
      for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
        weighted_rows_add(acc + h * dim, weights + h * stride + start, values + kv * dim, row_stride, count, dim);
      }
    }
  });
}

template <typename TQ, typename TKV>
inline void attend_share(const Problem<TQ, TKV>& p, const Share& share, Scratch& s) {
  const int64_t num_heads = (share.kv_end - share.kv_begin) * (p.num_heads / p.num_kv_heads);
  const int64_t stride = score_stride(p.context_lens[share.seq]);
  load_query(p, share, s.query.data());
  score_keys(p, share, s.query.data(), s.scores.data(), s.block.data());
  for (int64_t h = 0; h < num_heads; ++h) s.inv_sums[h] = 1.0f / exp_and_sum(s.scores.data() + h * stride, stride);
  accumulate_values(p, share, s.scores.data(), s.acc.data(), s.block.data());
  const int64_t dim = p.head_dim;
  TQ* out = p.out + (share.seq * p.num_heads + share.kv_begin * (p.num_heads / p.num_kv_heads)) * dim;
  for (int64_t h = 0; h < num_heads; ++h) {
    for (int64_t d = 0; d < dim; ++d) out[h * dim + d] = static_cast<TQ>(s.acc[h * dim + d] * s.inv_sums[h]);
  }
}

// Work items are (seq, kv_head) pairs, numbered seq * num_kv_heads + kv_head; a thread takes a
// contiguous range of them and handles the kv heads it holds of each sequence together.
template <typename TQ, typename TKV>
inline void run_items(const Problem<TQ, TKV>& p, int64_t begin, int64_t end) {
  if (begin >= end) return;
  const int64_t kv_heads = p.num_kv_heads;
  const int64_t heads = std::min(end - begin, kv_heads) * (p.num_heads / kv_heads);
  int64_t max_stride = kLanes;
  for (int64_t seq = begin / kv_heads; seq * kv_heads < end; ++seq) {
    max_stride = std::max(max_stride, score_stride(p.context_lens[seq]));
  }
  Scratch s{std::vector<float>(heads * p.head_dim), std::vector<float>(heads * max_stride),
            std::vector<float>(heads * p.head_dim), std::vector<float>(heads),
            std::vector<float>(kWidened<TKV> ? p.block_size * std::min(end - begin, kv_heads) * p.head_dim : 0)};
  for (int64_t seq = begin / kv_heads; seq * kv_heads < end; ++seq) {
    const int64_t first = std::max(begin, seq * kv_heads) - seq * kv_heads;
    attend_share(p, Share{seq, first, std::min(end, (seq + 1) * kv_heads) - seq * kv_heads}, s);
  }
}

// The instruction-set levels the hot loops are compiled for, best first.
enum class Isa { kAvx512, kAvx2, kBaseline };

Isa g_isa = Isa::kBaseline;  // set at load by select_isa()

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "baseline";
  }
}

bool isa_supported(Isa isa) {
#ifdef SLUICE_X86_LEVELS
  if (isa == Isa::kAvx512) return __builtin_cpu_supports("x86-64-v4");
  if (isa == Isa::kAvx2) return __builtin_cpu_supports("x86-64-v3");
#else
  if (isa != Isa::kBaseline) return false;
#endif
  return true;
}

// run_items of one (query, cache) type pair, once per ISA level, and the call of the selected one.
#ifdef SLUICE_X86_LEVELS
#define SLUICE_DEFINE_RUN(NAME, TQ, TKV)                                                                      \
  SLUICE_AVX512 void NAME##_avx512(const Problem<TQ, TKV>& p, int64_t b, int64_t e) { run_items(p, b, e); } \
  SLUICE_AVX2 void NAME##_avx2(const Problem<TQ, TKV>& p, int64_t b, int64_t e) { run_items(p, b, e); }     \
  __attribute__((flatten)) void NAME##_baseline(const Problem<TQ, TKV>& p, int64_t b, int64_t e) {           \
    run_items(p, b, e);                                                                                        \
  }                                                                                                            \
  void run_selected(const Problem<TQ, TKV>& p, int64_t b, int64_t e) {                                        \
    if (g_isa == Isa::kAvx512) {                                                                               \
      NAME##_avx512(p, b, e);                                                                                  \
    } else if (g_isa == Isa::kAvx2) {                                                                          \
      NAME##_avx2(p, b, e);                                                                                    \
    } else {                                                                                                   \
      NAME##_baseline(p, b, e);                                                                                \
    }                                                                                                          \
  }
#else
#define SLUICE_DEFINE_RUN(NAME, TQ, TKV)                                                                      \
  __attribute__((flatten)) void run_selected(const Problem<TQ, TKV>& p, int64_t b, int64_t e) {              \
    run_items(p, b, e);                                                                                        \
  }
#endif

SLUICE_DEFINE_RUN(run_float_float, float, float)
SLUICE_DEFINE_RUN(run_float_bfloat16, float, c10::BFloat16)
SLUICE_DEFINE_RUN(run_float_int8, float, int8_t)
SLUICE_DEFINE_RUN(run_bfloat16_bfloat16, c10::BFloat16, c10::BFloat16)
SLUICE_DEFINE_RUN(run_bfloat16_int8, c10::BFloat16, int8_t)

// Item boundaries that give each thread about the same number of tokens to read (contexts
// differ by an order of magnitude, so equal item counts would leave threads idle).
std::vector<int64_t> balanced_splits(const int32_t* context_lens, int64_t num_seqs, int64_t num_kv_heads,
                                     int64_t num_parts) {
  const int64_t num_items = num_seqs * num_kv_heads;
  std::vector<int64_t> prefix(num_items + 1, 0);
  for (int64_t item = 0; item < num_items; ++item) {
    prefix[item + 1] = prefix[item] + context_lens[item / num_kv_heads] + 16;  // + a fixed cost per item
  }
  std::vector<int64_t> splits(num_parts + 1, num_items);
  for (int64_t part = 0; part < num_parts; ++part) {
    const int64_t target = prefix[num_items] * part / num_parts;
    splits[part] = std::lower_bound(prefix.begin(), prefix.end(), target) - prefix.begin();
  }
  return splits;
}


template <typename TQ, typename TKV>
void launch(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const c10::optional<at::Tensor>& key_scales, const c10::optional<at::Tensor>& value_scales,
            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const Problem<TQ, TKV> p{query.data_ptr<TQ>(), key_cache.data_ptr<TKV>(), value_cache.data_ptr<TKV>(),
                           key_scales ? key_scales->data_ptr<float>() : nullptr,
                           value_scales ? value_scales->data_ptr<float>() : nullptr,
                           block_tables.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(), out.data_ptr<TQ>(),
                           query.stride(0), query.stride(1), query.stride(2),
                           block_tables.size(1), key_cache.size(1), query.size(1), key_cache.size(2), query.size(2),
                           static_cast<float>(scale)};
  const int64_t num_seqs = query.size(0);
  const int64_t num_items = num_seqs * p.num_kv_heads;
  const int64_t num_parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  const std::vector<int64_t> splits = balanced_splits(p.context_lens, num_seqs, p.num_kv_heads, num_parts);
  at::parallel_for(0, num_parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part) run_selected(p, splits[part], splits[part + 1]);
  });
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables_in,
                                  const at::Tensor& context_lens_in, double scale,
                                  const c10::optional<at::Tensor>& key_scales,
                                  const c10::optional<at::Tensor>& value_scales) {
  check_inputs(query, key_cache, value_cache, block_tables_in, context_lens_in);
  check_scales(key_cache, key_scales, value_scales);
  const at::Tensor block_tables = block_tables_in.contiguous();
  const at::Tensor context_lens = context_lens_in.contiguous();
  check_tables(block_tables.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(), query.size(0),
               block_tables.size(1), key_cache.size(1), key_cache.size(0));
  at::Tensor out = at::empty(query.sizes(), query.options());
  if (query.numel() == 0) return out;
  const bool float_query = query.scalar_type() == at::kFloat;
  const at::Tensor& k = key_cache;
  const at::Tensor& v = value_cache;
  switch (key_cache.scalar_type()) {
    case at::kFloat:
      launch<float, float>(query, k, v, key_scales, value_scales, block_tables, context_lens, scale, out);
      break;
    case at::kBFloat16:
      if (float_query) {
        launch<float, c10::BFloat16>(query, k, v, key_scales, value_scales, block_tables, context_lens, scale, out);
      } else {
        launch<c10::BFloat16, c10::BFloat16>(query, k, v, key_scales, value_scales, block_tables, context_lens, scale,
                                             out);
      }
      break;
    default:  // int8, checked above
      if (float_query) {
        launch<float, int8_t>(query, k, v, key_scales, value_scales, block_tables, context_lens, scale, out);
      } else {
        launch<c10::BFloat16, int8_t>(query, k, v, key_scales, value_scales, block_tables, context_lens, scale, out);
      }
  }
  return out;
}

// Stores a step's new K and V rows in one layer's pool: key_slots and value_slots [num_slots,
// num_kv_heads, head_dim] (contiguous views of the pool), key and value [T, num_kv_heads,
// head_dim] of the pool's dtype whose rows of num_kv_heads * head_dim are contiguous (any token
// stride: slices of the step's fused QKV product), slots [T] int64. One call for what two
// index_copy_ dispatches did. Raises TypeError for a dtype, ValueError for a shape or a slot out
// of range.
void write_kv(at::Tensor key_slots, at::Tensor value_slots, const at::Tensor& slots_in, const at::Tensor& key,
              const at::Tensor& value) {
  TORCH_CHECK_TYPE(key.scalar_type() == key_slots.scalar_type() && value.scalar_type() == key_slots.scalar_type() &&
                       value_slots.scalar_type() == key_slots.scalar_type(),
                   "write_kv: key, value and both pools need one dtype");
  TORCH_CHECK_TYPE(slots_in.scalar_type() == at::kLong, "write_kv: slots must be int64");
  TORCH_CHECK_VALUE(key_slots.dim() == 3 && key_slots.is_contiguous() && value_slots.sizes() == key_slots.sizes() &&
                        value_slots.is_contiguous(),
                    "write_kv: the pools must be contiguous [num_slots, num_kv_heads, head_dim] of one shape");
  const int64_t num_tokens = slots_in.numel();
  const int64_t row = key_slots.size(1) * key_slots.size(2);
  for (const at::Tensor* rows : {&key, &value}) {
    TORCH_CHECK_VALUE(rows->dim() == 3 && rows->size(0) == num_tokens && rows->size(1) == key_slots.size(1) &&
                          rows->size(2) == key_slots.size(2) && rows->stride(2) == 1 && rows->stride(1) == key_slots.size(2),
                      "write_kv: key and value must be [T, num_kv_heads, head_dim] with contiguous rows, T = len(slots)");
  }
  const at::Tensor slots = slots_in.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_slots = key_slots.size(0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK_VALUE(slot[t] >= 0 && slot[t] < num_slots, "write_kv: slot ", slot[t], " outside the pool's ", num_slots);
  }
  const int64_t bytes = row * key.element_size();
  auto* key_pool = static_cast<char*>(key_slots.data_ptr());
  auto* value_pool = static_cast<char*>(value_slots.data_ptr());
  const auto* key_rows = static_cast<const char*>(key.data_ptr());
  const auto* value_rows = static_cast<const char*>(value.data_ptr());
  const int64_t key_stride = key.stride(0) * key.element_size();
  const int64_t value_stride = value.stride(0) * value.element_size();
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::memcpy(key_pool + slot[t] * bytes, key_rows + t * key_stride, bytes);
    std::memcpy(value_pool + slot[t] * bytes, value_rows + t * value_stride, bytes);
  }
}

// RoPE in place on the first num_heads heads of x [T, H, head_dim] float32 (rows of H * head_dim
// contiguous, any token stride: the Q and K heads of the fused QKV product): Hugging Face's
// apply_rotary_pos_emb, x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1), that is
// (x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2) over the halves; cos and sin [T, head_dim] float32
// contiguous (the model's rotary tables of the step's positions). One call for the three ops and
// the copy of the torch formula. Raises TypeError for a dtype, ValueError for a shape.
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
                   "rope_: x, cos and sin must be float32");
  TORCH_CHECK_VALUE(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(2) % 2 == 0,
                    "rope_: x must be [T, H, head_dim] with contiguous rows and an even head_dim");
  const int64_t num_tokens = x.size(0), head_dim = x.size(2), half = head_dim / 2;
  TORCH_CHECK_VALUE(num_heads >= 0 && num_heads <= x.size(1), "rope_: num_heads ", num_heads, " outside [0, ", x.size(1), "]");
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK_VALUE(table->dim() == 2 && table->size(0) == num_tokens && table->size(1) == head_dim && table->is_contiguous(),
                      "rope_: cos and sin must be contiguous [T, head_dim]");
  }
  float* data = x.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* ct = c + t * head_dim;
    const float* st = s + t * head_dim;
    for (int64_t h = 0; h < num_heads; ++h) {
      float* v = data + t * x.stride(0) + h * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * ct[i] - x2 * st[i];
        v[i + half] = x2 * ct[i + half] + x1 * st[i + half];
      }
    }
  }
}

// Selects the ISA level the hot loops run at: "avx512", "avx2", "baseline", or "" for the best the
// CPU supports; returns the one selected. Raises ValueError for an unknown name or a level the CPU
// lacks.
std::string select_isa(const std::string& name) {
  Isa isa = Isa::kBaseline;
  if (name.empty()) {
    for (Isa level : {Isa::kAvx512, Isa::kAvx2}) {
      if (isa_supported(level)) {
        isa = level;
        break;
      }
    }
  } else {
    bool known = false;
    for (Isa level : {Isa::kAvx512, Isa::kAvx2, Isa::kBaseline}) {
      if (name == isa_name(level)) {
        isa = level;
        known = true;
      }
    }
    TORCH_CHECK_VALUE(known, "unknown ISA level '", name, "': expected avx512, avx2 or baseline");
    TORCH_CHECK_VALUE(isa_supported(isa), "this CPU (or build) has no ", name, " path");
  }
  g_isa = isa;
  return isa_name(isa);
}

// The GIL is released while the kernel runs, as torch's own ops do: it takes milliseconds per
// layer, and the server's event loop shares the process.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention of one query per sequence over a block-table KV cache (CPU; float32/bfloat16 query, "
        "float32/bfloat16/int8 cache).",
        pybind11::arg("query"), pybind11::arg("key_cache"), pybind11::arg("value_cache"),
        pybind11::arg("block_tables"), pybind11::arg("context_lens"), pybind11::arg("scale"),
        pybind11::arg("key_scales") = pybind11::none(), pybind11::arg("value_scales") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("write_kv", &write_kv, "Store new K/V rows [T, Hkv, D] at int64 slots of a layer's pools [num_slots, Hkv, D].",
        pybind11::arg("key_slots"), pybind11::arg("value_slots"), pybind11::arg("slots"), pybind11::arg("key"),
        pybind11::arg("value"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rope_", &rope_, "RoPE in place on the first num_heads heads of x [T, H, D] float32; cos, sin [T, D].",
        pybind11::arg("x"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("num_heads"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("select_isa", &select_isa, "Select the ISA level of the hot loops; returns the one selected.",
        pybind11::arg("name"));
  m.def("isa", [] { return std::string(isa_name(g_isa)); }, "The ISA level the hot loops run at.");
}
