// What reading (hf_checkpoint.cpp) and exporting (hf_export.cpp) a Hugging Face folder share.
// Private to src/io.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "megatrain/io/hf_checkpoint.hpp"

namespace megatrain::io::detail {

inline constexpr std::string_view kConfigName = "config.json";

/// A model's shape in one line, for messages.
std::string describe(const ModelConfig& c);

/// Where a parameter lies in a fused checkpoint tensor: that tensor and its part.
struct FusedPlace {
  const FusedTensor* tensor;
  const FusedPart* part;
};
/// The fused tensors' parts by parameter name; each part's shape checked against the model's.
std::map<std::string, FusedPlace, std::less<>> fused_places(const std::vector<FusedTensor>& fused,
                                                            const std::vector<UnitSpec>& units);

/// Checks that `store` holds exactly the parameters of `units` (names and shapes); `what` begins
/// the message.
void check_store_matches(const HostParamStore<float>& store, const std::vector<UnitSpec>& units, std::string_view what);

}  // namespace megatrain::io::detail
