// Argument checks of the paged-attention kernel (paged_attention.cpp), raising the ValueError /
// TypeError messages models/paged_attention.py's torch fallback raises too. Header only.

#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace sluice_checks {

void check_inputs(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& block_tables, const at::Tensor& context_lens) {
  TORCH_CHECK_VALUE(query.dim() == 3, "query must be [num_seqs, num_heads, head_dim], got shape ", query.sizes());
  TORCH_CHECK_VALUE(key_cache.dim() == 4, "key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], ",
                    "got shape ", key_cache.sizes());
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), "value_cache shape ", value_cache.sizes(),
                    " differs from key_cache shape ", key_cache.sizes());
  TORCH_CHECK_TYPE(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
                   "query dtype must be float32 or bfloat16, got ", query.scalar_type());
  const at::ScalarType cache_type = key_cache.scalar_type();
  TORCH_CHECK_TYPE(value_cache.scalar_type() == cache_type &&
                       (cache_type == query.scalar_type() || cache_type == at::kChar ||
                        (query.scalar_type() == at::kFloat && cache_type == at::kBFloat16)),
                   "key_cache and value_cache dtypes must match query (", query.scalar_type(),
                   ") or be int8, or bfloat16 under a float32 query, got ", key_cache.scalar_type(), " and ",
                   value_cache.scalar_type());
  TORCH_CHECK_TYPE(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
                   "block_tables and context_lens must be int32, got ", block_tables.scalar_type(), " and ",
                   context_lens.scalar_type());
  for (const at::Tensor* t : {&query, &key_cache, &value_cache, &block_tables, &context_lens}) {
    TORCH_CHECK_VALUE(t->device().is_cpu(), "paged attention kernel runs on CPU tensors, got ", t->device());
  }
  TORCH_CHECK_VALUE(key_cache.is_contiguous() && value_cache.is_contiguous(),
                    "key_cache and value_cache must be contiguous");
  const int64_t num_seqs = query.size(0);
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK_VALUE(query.size(2) == key_cache.size(3), "query head_dim ", query.size(2),
                    " differs from the cache's head_dim ", key_cache.size(3));
  TORCH_CHECK_VALUE(num_kv_heads > 0 && query.size(1) % num_kv_heads == 0, "num_heads ", query.size(1),
                    " is not a multiple of num_kv_heads ", num_kv_heads);
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
                    "block_tables must be [num_seqs=", num_seqs, ", max_blocks_per_seq], got shape ",
                    block_tables.sizes());
  TORCH_CHECK_VALUE(context_lens.dim() == 1 && context_lens.size(0) == num_seqs,
                    "context_lens must be [num_seqs=", num_seqs, "], got shape ", context_lens.sizes());
}

// An int8 cache needs both scale tensors, [num_blocks, block_size, num_kv_heads] float32
// contiguous; a float cache takes none.
void check_scales(const at::Tensor& key_cache, const c10::optional<at::Tensor>& key_scales,
                  const c10::optional<at::Tensor>& value_scales) {
  const bool quantized = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK_VALUE(key_scales.has_value() == quantized && value_scales.has_value() == quantized,
                    quantized ? "an int8 cache needs key_scales and value_scales"
                              : "key_scales and value_scales go with an int8 cache only");
  if (!quantized) return;
  const auto expected = key_cache.sizes().slice(0, 3);
  for (const at::Tensor* t : {&*key_scales, &*value_scales}) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, "scales must be float32, got ", t->scalar_type());
    TORCH_CHECK_VALUE(t->sizes() == expected && t->is_contiguous() && t->device().is_cpu(),
                      "scales must be contiguous CPU tensors of shape ", expected, ", got ", t->sizes());
  }
}

// Reads the int32 tables once: a bad entry would otherwise read outside the cache.
void check_tables(const int32_t* block_tables, const int32_t* context_lens, int64_t num_seqs,
                  int64_t max_blocks_per_seq, int64_t block_size, int64_t num_blocks) {
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t context_len = context_lens[seq];
    TORCH_CHECK_VALUE(context_len >= 1 && context_len <= max_blocks_per_seq * block_size, "context_lens[", seq,
                      "] = ", context_len, " is outside [1, max_blocks_per_seq * block_size = ",
                      max_blocks_per_seq * block_size, "]");
    const int64_t used_blocks = (context_len + block_size - 1) / block_size;
    for (int64_t b = 0; b < used_blocks; ++b) {
      const int64_t block = block_tables[seq * max_blocks_per_seq + b];
      TORCH_CHECK_VALUE(block >= 0 && block < num_blocks, "block_tables[", seq, ", ", b, "] = ", block,
                        " is outside [0, num_blocks = ", num_blocks, ")");
    }
  }
}

}  // namespace sluice_checks
