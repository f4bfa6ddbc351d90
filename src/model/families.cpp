// The table of families: one entry per file of src/model/families/ (family.hpp).
#include "megatrain/model/family.hpp"

#include "megatrain/core/error.hpp"

namespace megatrain {
namespace model_families {
extern const Family kLlama, kMistral, kQwen2, kQwen3, kPhi3, kGemma3, kQwen3Moe, kMixtral, kOlmoe, kGptOss, kSmolLM3, kQwen3_5,
    kQwen3_5Moe, kQwen3Next;
}  // namespace model_families

namespace {
constexpr const Family* kFamilies[] = {
    &model_families::kLlama,  &model_families::kMistral, &model_families::kQwen2, &model_families::kQwen3,  &model_families::kPhi3,    &model_families::kGemma3,
    &model_families::kQwen3Moe, &model_families::kMixtral, &model_families::kOlmoe, &model_families::kGptOss, &model_families::kSmolLM3,
    &model_families::kQwen3_5, &model_families::kQwen3_5Moe, &model_families::kQwen3Next,
};
}  // namespace

std::span<const Family* const> families() { return kFamilies; }

const Family& family(Architecture arch) {
  for (const Family* f : kFamilies)
    if (f->arch == arch) return *f;
  MT_FAIL("unknown architecture {}", static_cast<int>(arch));
}

}  // namespace megatrain
