// decode_attention and prefill_attention (decode_attention.c) as torch ops: the checks that raise
// before a kernel could read outside the caches, and the call into this CPU's variant.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

#include "checks.h"
#include "variants.h"

namespace {

using namespace sy;

// q: [rows, heads, d], d one of HEAD_DIMS; the caches [blocks, kv heads, block size, d], contiguous, of
// q's dtype, their kv heads shared evenly by q's heads. Returns d's index in HEAD_DIMS.
int check_attention(const at::Tensor &q, const at::Tensor &k_cache, const at::Tensor &v_cache) {
  check_float(q, "q");
  TORCH_CHECK(q.dim() == 3, "q must be [rows, heads, head_dim], got ", q.sizes());
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  int index = 0;
  while (index < 4 && HEAD_DIMS[index] != head_dim) index++;
  TORCH_CHECK(index < 4, "head_dim must be 64, 96, 128 or 256, got ", head_dim);
  for (const auto *t : {&k_cache, &v_cache}) {
    check_cpu(*t, "the caches");
    check_same_dtype(q, *t, "the caches");
    TORCH_CHECK(t->dim() == 4 && t->is_contiguous() && t->size(3) == head_dim,
                "the caches must be contiguous [blocks, kv heads, block size, ", head_dim, "], got ", t->sizes());
  }
  check_shape(v_cache, k_cache.sizes(), "v_cache");
  TORCH_CHECK(k_cache.size(1) > 0 && num_heads % k_cache.size(1) == 0, num_heads, " query heads cannot share ",
              k_cache.size(1), " KV heads");
  return index;
}

// window: a query sees its last `window` keys (0: every key); softcap: its scores s become
// softcap * tanh(s / softcap) (0: not capped)
void check_mask(int64_t window, double softcap) {
  TORCH_CHECK(window >= 0, "window must be 0 (none) or a number of keys, got ", window);
  TORCH_CHECK(softcap >= 0 && std::isfinite(softcap), "softcap must be 0 (none) or positive, got ", softcap);
}

// q: [B, heads, d] (d one of HEAD_DIMS); caches: [blocks, kv heads, block size, d] of q's dtype;
// block_tables: [B, max blocks] int64, every id a block of the caches; context_lens: [B] int64,
// each within its table; window, softcap: as check_mask's
at::Tensor decode_attention(const at::Tensor &q, const at::Tensor &k_cache, const at::Tensor &v_cache,
                            const at::Tensor &block_tables, const at::Tensor &context_lens, double scale,
                            int64_t window, double softcap) {
  const int head = check_attention(q, k_cache, v_cache);
  check_mask(window, softcap);
  const int64_t num_seqs = q.size(0), num_heads = q.size(1);
  const int64_t num_blocks = k_cache.size(0), num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  for (const auto *t : {&block_tables, &context_lens}) {
    check_cpu(*t, "block_tables and context_lens");
    TORCH_CHECK(t->scalar_type() == at::kLong, "block_tables and context_lens must be int64, got ", t->scalar_type());
  }
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs, "block_tables must be [", num_seqs,
              ", max blocks], got ", block_tables.sizes());
  check_shape(context_lens, {num_seqs}, "context_lens");
  const at::Tensor qc = q.contiguous(), tables = block_tables.contiguous(), lens = context_lens.contiguous();
  const int64_t max_blocks = tables.size(1), *table = tables.data_ptr<int64_t>(), *len = lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < num_seqs; s++) {
    TORCH_CHECK(len[s] >= 1 && len[s] <= max_blocks * block_size, "context_lens[", s, "] = ", len[s],
                " does not fit its ", max_blocks, " blocks of ", block_size);
    for (int64_t j = 0; j < (len[s] + block_size - 1) / block_size; j++)
      TORCH_CHECK(table[s * max_blocks + j] >= 0 && table[s * max_blocks + j] < num_blocks, "block_tables[", s,
                  ", ", j, "] = ", table[s * max_blocks + j], " is not one of the ", num_blocks, " blocks");
  }
  at::Tensor out = at::empty_like(qc);
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  int status;
  if (q.scalar_type() == at::kFloat)
    status = current->decode_f32[head](
        data<float>(qc), data<float>(k_cache), data<float>(v_cache), table, len, data<float>(out), num_seqs,
        num_heads, num_kv_heads, block_size, max_blocks, sc, window, cap);
  else
    status = current->decode_bf16[head](
        data<uint16_t>(qc), data<uint16_t>(k_cache), data<uint16_t>(v_cache), table, len, data<uint16_t>(out),
        num_seqs, num_heads, num_kv_heads, block_size, max_blocks, sc, window, cap);
  TORCH_CHECK(status == 0, "decode_attention ran out of memory");
  return out;
}

// q: [rows, heads, d] (d one of HEAD_DIMS), a prefill chunk's queries; caches as decode_attention's;
// block_ids: [blocks] int64, the sequence's, holding num_cached + rows keys; window, softcap: as check_mask's
at::Tensor prefill_attention(const at::Tensor &q, const at::Tensor &k_cache, const at::Tensor &v_cache,
                             const at::Tensor &block_ids, int64_t num_cached, double scale, int64_t window,
                             double softcap) {
  const int head = check_attention(q, k_cache, v_cache);
  check_mask(window, softcap);
  const int64_t num_query = q.size(0), num_heads = q.size(1), num_blocks = k_cache.size(0);
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  check_cpu(block_ids, "block_ids");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.dim() == 1, "block_ids must be [blocks] int64, got ",
              block_ids.scalar_type(), " ", block_ids.sizes());
  const at::Tensor qc = q.contiguous(), ids = block_ids.contiguous();
  const int64_t *table = ids.data_ptr<int64_t>(), context = num_cached + num_query;
  TORCH_CHECK(num_cached >= 0 && context <= ids.size(0) * block_size, num_cached, " cached keys and ", num_query,
              " queries do not fit ", ids.size(0), " blocks of ", block_size);
  for (int64_t j = 0; j < (context + block_size - 1) / block_size; j++)
    TORCH_CHECK(table[j] >= 0 && table[j] < num_blocks, "block_ids[", j, "] = ", table[j], " is not one of the ",
                num_blocks, " blocks");
  at::Tensor out = at::empty_like(qc);
  if (num_query == 0) return out;
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  int status;
  if (q.scalar_type() == at::kFloat)
    status = current->prefill_f32[head](
        data<float>(qc), data<float>(k_cache), data<float>(v_cache), table, num_cached, data<float>(out), num_query,
        num_heads, num_kv_heads, block_size, sc, window, cap);
  else
    status = current->prefill_bf16[head](
        data<uint16_t>(qc), data<uint16_t>(k_cache), data<uint16_t>(v_cache), table, num_cached,
        data<uint16_t>(out), num_query, num_heads, num_kv_heads, block_size, sc, window, cap);
  TORCH_CHECK(status == 0, "prefill_attention ran out of memory");
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale, int window=0, float softcap=0.0) -> Tensor");
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_ids, int num_cached, "
        "float scale, int window=0, float softcap=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("prefill_attention", &prefill_attention);
}
