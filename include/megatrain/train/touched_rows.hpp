// The embedding's touched rows: the batch's distinct token ids, sorted, and each token's index
// among them (its compact id). The forward of a host embedding reads only these rows of the fp32
// table (gathered on the host once per step, then uploaded), and without resident gradients only
// they get a gradient from the lookup, gathered into a compact [rows, hidden] buffer so that only
// they cross PCIe at the end of the backward (the other rows' come with embed_rest items: see
// train/trainer.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

namespace megatrain {

class TouchedRows {
 public:
  /// The host memory the rows and the compact ids live in (as many as a batch has tokens each).
  void bind(std::span<std::int32_t> rows, std::span<std::int32_t> compact_ids) {
    rows_ = rows;
    compact_ = compact_ids;
  }
  /// The distinct ids of `ids`, sorted, each token's index among them, and where the padding
  /// row (`padding_id`, or -1: none) is among them.
  void find(std::span<const std::int32_t> ids, std::int32_t padding_id) {
    std::vector<std::int32_t> rows(ids.begin(), ids.end());
    std::sort(rows.begin(), rows.end());
    rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
    std::copy(rows.begin(), rows.end(), rows_.begin());
    count_ = static_cast<std::int64_t>(rows.size());
    for (std::size_t i = 0; i < ids.size(); ++i)
      compact_[i] = static_cast<std::int32_t>(std::lower_bound(rows.begin(), rows.end(), ids[i]) - rows.begin());
    const auto at = std::lower_bound(rows.begin(), rows.end(), padding_id);
    padding_ = padding_id >= 0 && at != rows.end() && *at == padding_id ? static_cast<std::int32_t>(at - rows.begin()) : -1;
  }
  /// The touched rows, sorted.
  std::span<const std::int32_t> rows() const { return std::span<const std::int32_t>(rows_).first(static_cast<std::size_t>(count_)); }
  std::int64_t count() const { return count_; }
  /// Each token's index among the rows (the batch's tokens, in order).
  std::span<const std::int32_t> compact_ids() const { return compact_; }
  /// The padding row's index among the rows, or -1.
  std::int32_t padding() const { return padding_; }

 private:
  std::span<std::int32_t> rows_, compact_;
  std::int64_t count_ = 0;
  std::int32_t padding_ = -1;
};

}  // namespace megatrain
