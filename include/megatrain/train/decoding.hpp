// Trainer::decode_logits() and decodes() (train/trainer.hpp): decoding with caches, for sampling
// (generate/generator.hpp). Each call runs one token of every row, a micro-batch at a time, through
// the units as evaluate() does (each unit's weights streamed once for the micro-batch's rows), with
// the blocks' token mixers reading and extending their layer's cache (ChunkShape::decode):
// attention its keys and values, linear attention its state. Then the head makes each row's logits. So a completion
// costs one short forward a token instead of its whole prefix again.
//
// The caches live in backend memory beside the trainer's buffers (the plan does not count them):
// per attention layer 2 x rows x capacity x kv_dim activations; per linear-attention layer its
// convolution taps and fp32 state. They are made at the first call, again when the shape changes,
// and freed by end_decoding() (generate::generate() calls it when it ends).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <vector>

#include "megatrain/train/trainer.hpp"

namespace megatrain {

template <class B, class Block, class... U>
bool Trainer<B, Block, U...>::decodes() const {
  if constexpr (requires(const Block& b) { b.template decodes<B>(); }) {
    for (std::size_t i = 0; i < ctx_.model.num_blocks(); ++i)
      if (!ctx_.model.block(i).op().template decodes<B>()) return false;
    return true;
  } else {
    return false;
  }
}

template <class B, class Block, class... U>
std::vector<float> Trainer<B, Block, U...>::decode_logits(std::span<const std::int32_t> ids,
                                                          std::span<const std::int32_t> positions, std::int64_t capacity) {
  MT_NVTX_RANGE("Trainer::decode_logits");
  const std::int64_t rows = static_cast<std::int64_t>(ids.size()), R = ctx_.opt.micro_rows(), V = ctx_.vocab();
  MT_CHECK(decodes(), "decode_logits: this model's layers do not decode with a cache on this backend (decodes() is "
           "false); next_logits() recomputes each prefix instead");
  MT_CHECK(rows > 0 && rows % R == 0 && positions.size() == ids.size(),
           "decode_logits: {} ids and {} positions: one token a row, a positive multiple of the {} rows of a micro-batch",
           ids.size(), positions.size(), R);
  MT_CHECK(capacity >= 1, "decode_logits: a cache of {} tokens a row", capacity);
  for (std::size_t r = 0; r < ids.size(); ++r) {
    MT_CHECK(ids[r] >= 0 && ids[r] < V, "decode_logits: row {}'s id {} is outside the vocabulary of {} ids", r, ids[r], V);
    MT_CHECK(positions[r] >= 0 && positions[r] < capacity, "decode_logits: row {}'s position {} is outside its cache of {} "
             "tokens", r, positions[r], capacity);
  }
  DecodeState<B>& d = ctx_.decode;
  if constexpr (requires(const Block& b) { b.template decode_cache_bytes<B>(R, capacity); }) {
    if (d.rows != rows || d.capacity != capacity) {  // (the caches of this shape, made once)
      d.rows = d.capacity = 0;  // (none, until every one is made)
      d.caches.clear();
      for (std::size_t i = 0; i < ctx_.model.num_blocks(); ++i)
        d.caches.push_back(ctx_.be.template alloc<std::byte>(ctx_.model.block(i).op().template decode_cache_bytes<B>(rows, capacity)));
      d.positions_dev = ctx_.be.template alloc<std::int32_t>(static_cast<std::size_t>(rows));
      d.rows = rows;
      d.capacity = capacity;
    }
  }
  d.positions_host.assign(positions.begin(), positions.end());
  load_device_units();
  if (ctx_.logits_dev.size() < static_cast<std::size_t>(R * V))  // (the micro-batch's rows' logits at once)
    ctx_.logits_dev = ctx_.be.template alloc<typename B::Act>(static_cast<std::size_t>(R * V));
  std::vector<float> out(static_cast<std::size_t>(rows * V));
  for (std::int64_t first = 0; first < rows; first += R) {  // (a micro-batch's rows at a time)
    const auto mine = ids.subspan(static_cast<std::size_t>(first), static_cast<std::size_t>(R));
    std::copy(mine.begin(), mine.end(), ctx_.batch.ids_host.begin());
    std::fill_n(ctx_.batch.labels_host.begin(), R, kIgnoreIndex);
    if (!ctx_.devices.holds(0)) ctx_.touched.find(mine, ctx_.model.embedding().op().padding_id());
    ctx_.logits_host.assign(static_cast<std::size_t>(R * V), typename B::Act{});
    ctx_.state.micro_rows = R;
    ctx_.logits_at.assign(static_cast<std::size_t>(R), 0);  // (each row's one token)
    d.base = first;
    std::vector<TrainItem> items;
    for (std::size_t u = 0; u <= ctx_.model.num_blocks(); ++u) items.push_back({Kind::forward, u, 0, 1});  // (1: keeps nothing)
    items.push_back({Kind::head_eval, ctx_.model.head_unit(), 0});
    // (the compute stage decodes until the items are through; where one threw, the failed
    // pipeline runs nothing more, and a stage still at work keeps the state it started with)
    struct Running {
      Ctx& t;
      int unwinding = std::uncaught_exceptions();
      explicit Running(Ctx& c) : t(c) { t.decode.running = true; }
      ~Running() {
        if (std::uncaught_exceptions() > unwinding) return;
        t.decode.running = false;
        t.logits_at.clear();
      }
    };
    {
      const Running running(ctx_);
      pipeline_->submit(items);
      pipeline_->drain();
    }
    settle();
    std::transform(ctx_.logits_host.begin(), ctx_.logits_host.end(), out.begin() + first * V,
                   [](auto x) { return static_cast<float>(x); });
  }
  return out;
}

}  // namespace megatrain
