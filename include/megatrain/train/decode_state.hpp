// What Trainer::decode_logits keeps between its calls (train/decoding.hpp): each block's cache,
// the rows' positions, and whether the items running now decode (one token a row).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "megatrain/backend/backend.hpp"

namespace megatrain {

template <class B>
struct DecodeState {
  std::vector<typename B::template Buffer<std::byte>> caches;  // a block's cache (its token mixer's)
  typename B::template Buffer<std::int32_t> positions_dev;    // [rows]: each row's token's position
  std::vector<std::int32_t> positions_host;
  std::int64_t rows = 0, capacity = 0;  // the caches' shape (0: none made)
  std::int64_t base = 0;                // the running micro-batch's first row
  bool running = false;                 // the compute stage's items decode now

  /// Block b's view of its cache for the micro-batch's rows [first, first + n).
  DecodeRows layer(std::size_t b, std::int64_t first, std::int64_t n) {
    first += base;
    const auto at = static_cast<std::size_t>(first), len = static_cast<std::size_t>(n);
    return {View<const std::int32_t>(std::span<const std::int32_t>(positions_dev.span()).subspan(at, len), Shape{n}),
            std::span<const std::int32_t>(positions_host).subspan(at, len), caches[b].span(), rows, first, capacity};
  }
};

}  // namespace megatrain
