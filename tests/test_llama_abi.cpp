// kvcheck's own declarations of llama.cpp's structures (tools/llamacpp/llama_api.h,
// namespace declared), against the real llama.h of the build they describe: the shipped
// build's source, which tools/setup/llamacpp.sh unpacks. Offsets and sizes on the right
// come from the compiler reading that header: an independent path to the same facts.
#include <llama.h>

#include <cstddef>

#include <gtest/gtest.h>

#include "tools/llamacpp/llama_api.h"

namespace kvcheck::llamacpp {
namespace {

void expect_field(Field declared_field, std::size_t offset, std::size_t size, const char* name) {
  EXPECT_EQ(declared_field.offset, offset) << name << ": offset";
  EXPECT_EQ(declared_field.size, size) << name << ": size";
}
#define EXPECT_FIELD(ns, type, member) \
  expect_field(declared::ns::member, offsetof(type, member), sizeof(static_cast<type*>(nullptr)->member), #member)

TEST(LlamaAbi, StructSizesAreTheHeaders) {
  EXPECT_EQ(declared::context_params_size, sizeof(llama_context_params));
  EXPECT_EQ(declared::model_params_size, sizeof(llama_model_params));
  EXPECT_EQ(declared::tensor_size, sizeof(ggml_tensor));
  EXPECT_EQ(sizeof(declared::Batch), sizeof(llama_batch));
  EXPECT_EQ(offsetof(declared::Batch, logits), offsetof(llama_batch, logits));
  EXPECT_EQ(offsetof(declared::Batch, seq_id), offsetof(llama_batch, seq_id));
  EXPECT_EQ(offsetof(declared::Batch, pos), offsetof(llama_batch, pos));
}

TEST(LlamaAbi, ContextParamsFieldsAreTheHeaders) {
  EXPECT_FIELD(context_field, llama_context_params, n_ctx);
  EXPECT_FIELD(context_field, llama_context_params, n_batch);
  EXPECT_FIELD(context_field, llama_context_params, n_ubatch);
  EXPECT_FIELD(context_field, llama_context_params, n_seq_max);
  EXPECT_FIELD(context_field, llama_context_params, n_threads);
  EXPECT_FIELD(context_field, llama_context_params, n_threads_batch);
  EXPECT_FIELD(context_field, llama_context_params, flash_attn_type);
  EXPECT_FIELD(context_field, llama_context_params, yarn_ext_factor);
  EXPECT_FIELD(context_field, llama_context_params, cb_eval);
  EXPECT_FIELD(context_field, llama_context_params, cb_eval_user_data);
  EXPECT_FIELD(context_field, llama_context_params, type_k);
  EXPECT_FIELD(context_field, llama_context_params, type_v);
  EXPECT_FIELD(context_field, llama_context_params, offload_kqv);
  EXPECT_FIELD(context_field, llama_context_params, swa_full);
  EXPECT_FIELD(context_field, llama_context_params, kv_unified);
}

TEST(LlamaAbi, TensorFieldsAreTheHeaders) {
  EXPECT_FIELD(tensor_field, ggml_tensor, type);
  EXPECT_FIELD(tensor_field, ggml_tensor, ne);
  EXPECT_FIELD(tensor_field, ggml_tensor, nb);
  EXPECT_FIELD(tensor_field, ggml_tensor, op);
  EXPECT_FIELD(tensor_field, ggml_tensor, name);
  expect_field(declared::tensor_field::src, offsetof(ggml_tensor, src), sizeof(ggml_tensor*), "src[0]");
}

TEST(LlamaAbi, GgmlTypeNumbersAreTheHeaders) {
  EXPECT_EQ(static_cast<int>(GgmlType::f32), GGML_TYPE_F32);
  EXPECT_EQ(static_cast<int>(GgmlType::f16), GGML_TYPE_F16);
  EXPECT_EQ(static_cast<int>(GgmlType::q4_0), GGML_TYPE_Q4_0);
  EXPECT_EQ(static_cast<int>(GgmlType::q8_0), GGML_TYPE_Q8_0);
  EXPECT_EQ(static_cast<int>(GgmlType::bf16), GGML_TYPE_BF16);
}

// The compile-time check the header-built engine applies to each function it resolves.
TEST(LlamaAbi, SameSignatureAcceptsHandlesAsVoidPointersAndRefusesOtherShapes) {
  EXPECT_TRUE((same_signature<void (*)(void*, bool), decltype(&::llama_memory_clear)>::value));
  EXPECT_TRUE((same_signature<std::int32_t (*)(void*, std::int32_t), decltype(&::llama_memory_seq_pos_max)>::value));
  EXPECT_TRUE((same_signature<const char* (*)(std::int32_t), decltype(&::ggml_op_name)>::value));  // enum ggml_op
  // Another arity, an integer of another size, a struct passed where a pointer is taken.
  EXPECT_FALSE((same_signature<void (*)(void*), decltype(&::llama_memory_clear)>::value));
  EXPECT_FALSE((same_signature<std::int64_t (*)(void*, std::int32_t), decltype(&::llama_memory_seq_pos_max)>::value));
  EXPECT_FALSE((same_signature<std::int32_t (*)(void*, void*), decltype(&::llama_decode)>::value));
  EXPECT_FALSE((same_signature<float (*)(std::uint32_t), decltype(&::ggml_fp16_to_fp32)>::value));
  // A float where an integer of its size is taken, a byte where a bool is, a signedness flip.
  EXPECT_FALSE((same_signature<float (*)(float), decltype(&::ggml_fp16_to_fp32)>::value));
  EXPECT_FALSE((same_signature<void (*)(void*, std::int8_t), decltype(&::llama_memory_clear)>::value));
  EXPECT_FALSE((same_signature<std::int32_t (*)(void*, std::uint32_t), decltype(&::llama_memory_seq_pos_max)>::value));
  // Callbacks are compared as signatures, not as any pointer.
  EXPECT_TRUE((same_signature<EvalCallback, decltype(llama_context_params::cb_eval)>::value));
  EXPECT_TRUE((same_signature<void (*)(LogCallback, void*), decltype(&::llama_log_set)>::value));
  EXPECT_FALSE((same_signature<void (*)(void (*)(const char*, void*), void*), decltype(&::llama_log_set)>::value));
  EXPECT_FALSE((same_signature<void (*)(void*, void*), decltype(&::llama_log_set)>::value));
}

}  // namespace
}  // namespace kvcheck::llamacpp
