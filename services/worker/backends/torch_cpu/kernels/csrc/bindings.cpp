// The C kernels as torch ops (`torch.ops.switchyard_cpu.*`): their schemas, the argument checks
// that raise before a kernel could read or write out of bounds, and the instruction-set variant
// this CPU runs, picked when the library loads (use_variant switches it, for the tests). The
// attention ops are in attention_ops.cpp, write_kv_ in kv_write.cpp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "checks.h"
#include "variants.h"

namespace {

using namespace sy;
#define SY_ENTRY(V, RUNS)                                                                            \
  Variant {                                                                                          \
    #V, RUNS, quant_linear_f32_##V, quant_linear_q8_##V, add_rms_norm_f32_##V, add_rms_norm_bf16_##V, rotary_f32_##V,     \
        rotary_bf16_##V, silu_and_mul_f32_##V, silu_and_mul_bf16_##V, lora_add_f32_##V,             \
        lora_add_bf16_##V,                                                                           \
        {decode_attention_f32_64_##V, decode_attention_f32_96_##V, decode_attention_f32_128_##V,        \
         decode_attention_f32_256_##V},                                                               \
        {decode_attention_bf16_64_##V, decode_attention_bf16_96_##V, decode_attention_bf16_128_##V,     \
         decode_attention_bf16_256_##V},                                                              \
        {prefill_attention_f32_64_##V, prefill_attention_f32_96_##V, prefill_attention_f32_128_##V,     \
         prefill_attention_f32_256_##V},                                                              \
        {prefill_attention_bf16_64_##V, prefill_attention_bf16_96_##V, prefill_attention_bf16_128_##V,  \
         prefill_attention_bf16_256_##V}                                                              \
  }

#if defined(__x86_64__)
bool runs_avx512_vnni() { return __builtin_cpu_supports("x86-64-v4") && __builtin_cpu_supports("avx512vnni"); }
bool runs_avx512() { return __builtin_cpu_supports("x86-64-v4"); }
bool runs_avx2() { return __builtin_cpu_supports("x86-64-v3"); }
#endif
bool runs_anywhere() { return true; }

// the best first
const Variant VARIANTS[] = {
#if defined(__x86_64__)
    SY_ENTRY(avx512_vnni, runs_avx512_vnni),
    SY_ENTRY(avx512, runs_avx512),
    SY_ENTRY(avx2, runs_avx2),
#endif
    SY_ENTRY(portable, runs_anywhere),
};

const Variant *best_variant() {
  for (const Variant &v : VARIANTS)
    if (v.runs_here()) return &v;
  return &VARIANTS[std::size(VARIANTS) - 1];
}

}  // namespace

const sy::Variant *sy::current = best_variant();

namespace {

std::string variant() { return current->name; }

std::vector<std::string> variants() {
  std::vector<std::string> names;
  for (const Variant &v : VARIANTS)
    if (v.runs_here()) names.emplace_back(v.name);
  return names;
}

std::string use_variant(const std::string &name) {
  for (const Variant &v : VARIANTS) {
    if (name == v.name) {
      TORCH_CHECK(v.runs_here(), "this CPU cannot run the ", name, " kernels");
      std::string previous = current->name;
      current = &v;
      return previous;
    }
  }
  TORCH_CHECK(false, "no kernel variant named ", name);
}

constexpr int64_t PANEL = 16;

// x: [..., k] float32 or bfloat16; qweight: 4 bits [n / 16, k / 2, 16] uint8, 5 bits [n / 16, k / 2 + k / 8, 16]
// uint8 (the nibbles, then the fifth bits), 6 bits [n / 16, k / 2 + k / 4, 16] (value + 32, then the
// sixth bits too), 8 bits [n / 16, k, 16]
// int8 (or float8_e4m3fn: float codes, float32 scales, no lows); scales (and lows):
// [n / 16, k / group, 16], float16 or float32 (the group is k over their middle size: 16, 32, 64
// or 128), or int8 in two levels with supers [n / 16, k / 256, S, 16]
// float16 (S: 2 with lows, else 1; groups of 16 or 32); 4 bits have lows, or a codebook: [16] int8,
// the values the 4-bit indices stand for (IQ4's); bias: [n] float32. int8_activations: 4 to 6 bits in
// the same shapes, their bytes in quant_dot.c's order (QuantLinear.use_int8_rows()).
at::Tensor quant_linear(const at::Tensor &x, const at::Tensor &qweight, const at::Tensor &scales,
                        const std::optional<at::Tensor> &lows, int64_t bits, const std::optional<at::Tensor> &bias,
                        const std::optional<at::Tensor> &supers, const std::optional<at::Tensor> &codebook,
                        bool int8_activations) {
  check_float(x, "x");
  check_cpu(qweight, "qweight");
  check_cpu(scales, "scales");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "bits must be 4, 5, 6 or 8, got ", bits);
  TORCH_CHECK(x.dim() >= 1, "x must have an input dimension");
  TORCH_CHECK(qweight.dim() == 3 && qweight.is_contiguous(), "qweight must be a contiguous [n / 16, ..., 16] tensor");
  TORCH_CHECK(scales.dim() == 3 && scales.size(1) > 0, "scales must be [n / 16, k / group, 16], got ", scales.sizes());
  const int64_t k = x.size(-1), n = qweight.size(0) * PANEL, group = k / scales.size(1);
  TORCH_CHECK((group == 16 || group == 32 || group == 64 || group == 128) && k == group * scales.size(1),
              "the input size must be 16, 32, 64 or 128 times scales.size(1), got ", k, " inputs and ", scales.size(1),
              " groups");
  const bool e4m3 = qweight.scalar_type() == at::kFloat8_e4m3fn;  // 8-bit float codes, not integers
  TORCH_CHECK(qweight.scalar_type() == (bits == 8 ? at::kChar : at::kByte) || (bits == 8 && e4m3), "qweight must be ",
              bits == 8 ? "int8 or float8_e4m3fn" : "uint8", " for ", bits, " bits, got ", qweight.scalar_type());
  if (bits == 4)
    check_shape(qweight, {n / PANEL, k / 2, PANEL}, "qweight");
  else if (bits == 5 || bits == 6)  // the nibbles, then the fifth (and sixth) bits (quant_linear.c)
    check_shape(qweight, {n / PANEL, k / 2 + (bits - 4) * k / 8, PANEL}, "qweight");
  else
    check_shape(qweight, {n / PANEL, k, PANEL}, "qweight");
  const auto scale_type = scales.scalar_type();
  TORCH_CHECK(scale_type == at::kHalf || scale_type == at::kFloat || scale_type == at::kChar,
              "scales must be float16, float32 or int8 (with supers), got ", scale_type);
  TORCH_CHECK((scale_type == at::kChar) == supers.has_value(), "int8 scales come with supers, and only they");
  if (supers) {
    check_cpu(*supers, "supers");
    TORCH_CHECK(supers->scalar_type() == at::kHalf && supers->is_contiguous(), "supers must be contiguous float16");
    TORCH_CHECK(k % 256 == 0, "two-level scales need inputs in super-blocks of 256, got ", k);
    check_shape(*supers, {n / PANEL, k / 256, lows ? 2 : 1, PANEL}, "supers");
  }
  for (const auto *t : {&scales, lows ? &*lows : nullptr}) {
    if (t == nullptr) continue;
    check_cpu(*t, "scales and lows");
    TORCH_CHECK(t->scalar_type() == scale_type && t->is_contiguous(), "scales and lows must be contiguous, of one dtype");
    check_shape(*t, {n / PANEL, k / group, PANEL}, "scales and lows");
  }
  if (codebook) {  // 4-bit indices into 16 int8 values (IQ4's), no lows
    check_cpu(*codebook, "codebook");
    TORCH_CHECK(codebook->scalar_type() == at::kChar && codebook->is_contiguous(), "codebook must be contiguous int8");
    check_shape(*codebook, {16}, "codebook");
    TORCH_CHECK(bits == 4 && !lows, "a codebook takes 4-bit indices and no lows");
  }
  TORCH_CHECK((bits != 4 && bits != 5) || lows.has_value() || codebook.has_value(), "4 and 5 bits need lows");
  if (bias) {
    check_cpu(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous(), "bias must be contiguous float32");
    check_shape(*bias, {n}, "bias");
  }
  const at::Tensor rows = x.to(at::kFloat).contiguous();
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options().dtype(at::kFloat));
  const int scale_bits = scale_type == at::kHalf ? 16 : scale_type == at::kChar ? 8 : 32;
  if (int8_activations) {  // quant_dot.c (QuantLinear.takes_int8_rows names its formats)
    const int status = e4m3 || codebook ? -1 : current->quant_linear_q8(
        rows.data_ptr<float>(), rows.numel() / k, k, qweight.data_ptr(), bits, group, scales.data_ptr(),
        lows ? lows->data_ptr() : nullptr, supers ? supers->data_ptr() : nullptr, scale_bits,
        bias ? bias->data_ptr<float>() : nullptr, n, out.data_ptr<float>());
    TORCH_CHECK(status != -2, "quant_linear ran out of memory");
    TORCH_CHECK(status == 0, "quant_linear has no int8-activation kernel for ", bits,
                e4m3 ? "-bit float codes" : codebook ? "-bit codebook indices" : " bits", " in groups of ", group,
                " with ", scale_type, " scales", lows ? " and lows" : "", " over ", k, " inputs");
    return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
  }
  const int status = current->quant_linear_f32(
      rows.data_ptr<float>(), rows.numel() / k, k, qweight.data_ptr(), bits, group, scales.data_ptr(),
      lows ? lows->data_ptr() : nullptr, supers ? supers->data_ptr() : nullptr,
      scale_bits, e4m3 ? 1 : 0,
      codebook ? codebook->data_ptr<int8_t>() : nullptr, bias ? bias->data_ptr<float>() : nullptr,
      n, out.data_ptr<float>());
  TORCH_CHECK(status == 0, "quant_linear has no kernel for ", bits,
              e4m3 ? "-bit float codes" : codebook ? "-bit codebook indices" : " bits",
              " in groups of ", group, " with ", scale_type, " scales", lows ? " and lows" : "");
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// (weight * rms_norm(x + residual), x + residual) over the last dimension
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor &x, const at::Tensor &residual,
                                                const at::Tensor &weight, double eps) {
  check_float(x, "x");
  check_same_dtype(x, residual, "residual");
  check_same_dtype(x, weight, "weight");
  check_cpu(residual, "residual");
  check_cpu(weight, "weight");
  check_shape(residual, x.sizes(), "residual");
  const int64_t dim = x.size(-1);
  check_shape(weight, {dim}, "weight");
  const at::Tensor xc = x.contiguous(), rc = residual.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc), summed = at::empty_like(xc);
  const int64_t rows = dim ? xc.numel() / dim : 0;
  if (x.scalar_type() == at::kFloat)
    current->add_rms_norm_f32(data<float>(xc), data<float>(rc), data<float>(wc), data<float>(out),
                              data<float>(summed), rows, dim, static_cast<float>(eps));
  else
    current->add_rms_norm_bf16(data<uint16_t>(xc), data<uint16_t>(rc), data<uint16_t>(wc), data<uint16_t>(out),
                               data<uint16_t>(summed), rows, dim, static_cast<float>(eps));
  return {out, summed};
}

// x: [T, heads, d], each row's heads contiguous (a row stride of its own: a view of the fused
// projection); cos, sin: [T, d] float32, the half-split layout -> [T, heads, d], contiguous
at::Tensor rotary(const at::Tensor &x, const at::Tensor &cos, const at::Tensor &sin) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 3, "x must be [tokens, heads, head_dim], got ", x.sizes());
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even, got ", head_dim);
  const at::Tensor xs = (x.stride(2) == 1 && x.stride(1) == head_dim) ? x : x.contiguous();
  for (const auto *t : {&cos, &sin}) {
    check_cpu(*t, "cos and sin");
    TORCH_CHECK(t->scalar_type() == at::kFloat, "cos and sin must be float32, got ", t->scalar_type());
    check_shape(*t, {tokens, head_dim}, "cos and sin");
  }
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor out = at::empty({tokens, heads, head_dim}, x.options());
  if (x.scalar_type() == at::kFloat)
    current->rotary_f32(data<float>(xs), xs.stride(0), data<float>(c), data<float>(s), data<float>(out), tokens,
                        heads, head_dim);
  else
    current->rotary_bf16(data<uint16_t>(xs), xs.stride(0), data<float>(c), data<float>(s), data<uint16_t>(out),
                         tokens, heads, head_dim);
  return out;
}

// [..., 2 * width] (gate, then up) -> [..., width] = silu(gate) * up
at::Tensor silu_and_mul(const at::Tensor &gate_up) {
  check_float(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "gate_up's last dimension must be even");
  const at::Tensor g = gate_up.contiguous();
  const int64_t width = g.size(-1) / 2;
  std::vector<int64_t> shape = g.sizes().vec();
  shape.back() = width;
  at::Tensor out = at::empty(shape, g.options());
  const int64_t rows = width ? g.numel() / (2 * width) : 0;
  if (g.scalar_type() == at::kFloat)
    current->silu_and_mul_f32(data<float>(g), data<float>(out), rows, width);
  else
    current->silu_and_mul_bf16(data<uint16_t>(g), data<uint16_t>(out), rows, width);
  return out;
}

// y [T, out] += b[s] @ a[s] @ x[t] for each token t of slot s = slots[t] >= 0, in place: x [T, in],
// a [S, width, in], b [S, out, width] of y's dtype, contiguous; slots [T] int64, each -1 or a slot;
// out_sizes: b's output slices, each reading its own width / len(out_sizes) columns (zero elsewhere)
void lora_add_(at::Tensor &y, const at::Tensor &x, const at::Tensor &a, const at::Tensor &b,
               const at::Tensor &slots, at::IntArrayRef out_sizes) {
  check_float(y, "y");
  for (const auto *t : {&x, &a, &b}) {
    check_same_dtype(y, *t, "x, a and b");
    TORCH_CHECK(t->is_contiguous(), "x, a and b must be contiguous");
  }
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous(), "y must be a contiguous [tokens, out], got ", y.sizes());
  TORCH_CHECK(x.dim() == 2 && a.dim() == 3, "x must be [tokens, in] and a [slots, width, in]");
  const int64_t tokens = y.size(0), out = y.size(1), in = x.size(1), num_slots = a.size(0), width = a.size(1);
  check_shape(x, {tokens, in}, "x");
  check_shape(a, {num_slots, width, in}, "a");
  check_shape(b, {num_slots, out, width}, "b");
  TORCH_CHECK(width > 0 && width <= 4096, "a slot's width must be 1..4096, got ", width);
  const int64_t num_slices = static_cast<int64_t>(out_sizes.size());
  TORCH_CHECK(num_slices > 0 && width % num_slices == 0, "the width ", width, " must split into ", num_slices,
              " slices");
  std::vector<int64_t> offsets{0};
  for (int64_t size : out_sizes) {
    TORCH_CHECK(size >= 0, "out_sizes must not be negative");
    offsets.push_back(offsets.back() + size);
  }
  TORCH_CHECK(offsets.back() == out, "out_sizes must sum to ", out, ", got ", offsets.back());
  check_cpu(slots, "slots");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots must be contiguous int64");
  check_shape(slots, {tokens}, "slots");
  const int64_t *slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; t++)
    TORCH_CHECK(slot[t] >= -1 && slot[t] < num_slots, "slots[", t, "] = ", slot[t], " is not -1 or one of the ",
                num_slots, " slots");
  int status;
  if (y.scalar_type() == at::kFloat)
    status = current->lora_add_f32(data<float>(x), data<float>(y), data<float>(a), data<float>(b), slot, tokens, in,
                                   out, width, num_slots, offsets.data(), num_slices);
  else
    status = current->lora_add_bf16(data<uint16_t>(x), data<uint16_t>(y), data<uint16_t>(a), data<uint16_t>(b),
                                    slot, tokens, in, out, width, num_slots, offsets.data(), num_slices);
  TORCH_CHECK(status == 0, "lora_add ran out of memory");
}

}  // namespace

TORCH_LIBRARY(switchyard_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? lows, int bits, Tensor? bias, "
        "Tensor? supers=None, Tensor? codebook=None, bool int8_activations=False) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor slots, int[] out_sizes) -> ()");
  m.def("variant() -> str", &variant);
  m.def("variants() -> str[]", &variants);
  m.def("use_variant(str name) -> str", &use_variant);
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("lora_add_", &lora_add_);
}
