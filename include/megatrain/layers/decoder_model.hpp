// A decoder-only language model as units: the embedding, one block per layer, the head.
// Each unit is a LayerTemplate over a stateless op; the units' specs go to HostParamStore,
// and a trainer binds each op to wherever that unit's weights are at the moment.
//
// The block type is a parameter: DecoderBlock (Llama, Mistral, Qwen2) by default, or any op
// satisfying LayerOp, built per layer by a factory.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/layers/layer_template.hpp"
#include "megatrain/layers/ops/decoder_block.hpp"
#include "megatrain/layers/ops/embedding.hpp"
#include "megatrain/layers/ops/lm_head.hpp"
#include "megatrain/model/config.hpp"

namespace megatrain {

template <class Block = DecoderBlock>
class DecoderModel {
 public:
  using BlockFactory = std::function<Block(const ModelConfig&, std::int64_t layer)>;

  explicit DecoderModel(const ModelConfig& cfg)
    requires std::is_constructible_v<Block, const ModelConfig&, std::int64_t>
      : DecoderModel(cfg, [](const ModelConfig& c, std::int64_t l) { return Block(c, l); }) {}

  DecoderModel(const ModelConfig& cfg, const BlockFactory& make_block)
      : cfg_(cfg), embedding_(Embedding(cfg)), head_(LmHead(cfg)) {
    cfg_.validate();
    MT_CHECK(static_cast<bool>(make_block), "DecoderModel: the block factory is empty");
    blocks_.reserve(static_cast<std::size_t>(cfg.num_hidden_layers));
    for (std::int64_t l = 0; l < cfg.num_hidden_layers; ++l) blocks_.emplace_back(make_block(cfg, l));
  }

  const ModelConfig& config() const { return cfg_; }
  std::size_t num_blocks() const { return blocks_.size(); }
  /// Units in store order: 0 = embedding, 1..num_blocks() = blocks, num_blocks() + 1 = head.
  std::size_t num_units() const { return blocks_.size() + 2; }
  std::size_t head_unit() const { return blocks_.size() + 1; }

  const LayerTemplate<Embedding>& embedding() const { return embedding_; }
  /// Block `i`, 0-based (unit i + 1); throws megatrain::Error if i >= num_blocks().
  const LayerTemplate<Block>& block(std::size_t i) const {
    MT_CHECK(i < blocks_.size(), "block {} out of range (the model has {} blocks: 0 to {})", i, blocks_.size(),
             blocks_.size() - 1);
    return blocks_[i];
  }
  const LayerTemplate<LmHead>& head() const { return head_; }

  /// The units' parameter specs, for HostParamStore.
  std::vector<UnitSpec> units() const {
    std::vector<UnitSpec> u;
    u.push_back(embedding_.unit_spec("embed"));
    for (std::size_t l = 0; l < blocks_.size(); ++l) u.push_back(blocks_[l].unit_spec("layers." + std::to_string(l)));
    u.push_back(head_.unit_spec("head"));
    return u;
  }

 private:
  ModelConfig cfg_;
  LayerTemplate<Embedding> embedding_;
  std::vector<LayerTemplate<Block>> blocks_;
  LayerTemplate<LmHead> head_;
};

}  // namespace megatrain
