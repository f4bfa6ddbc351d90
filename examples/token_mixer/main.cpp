// example-token-mixer: a user-defined token mixer (cumulative_mean.hpp) in a megatrain block,
// beside the shipped ones (docs/layers.md#mixers).
//
// The block is a ComposedBlock whose token mixers are the example's CumulativeMean and megatrain's
// SelfAttention, and whose channel mixers are the shipped ones: each layer takes the first token
// mixer that builds it (the mean on the odd layers, attention on the even ones). The program
// builds a DecoderModel of such blocks, prints each layer's mixers, then runs a block of each
// kind forward and backward on random data in double with the CPU reference backend, the loss
// L = sum(r * y) for a fixed random r, and checks a few gradients against finite differences;
// it exits with status 1 if one disagrees.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "../common/block_check.hpp"
#include "cumulative_mean.hpp"
#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/layers/decoder_model.hpp"
#include "megatrain/store/host_param_store.hpp"

using namespace megatrain;
using example::CumulativeMean;
using example::Probe;

/// Even layers attend; odd layers take the cumulative mean (the first token mixer that builds them).
using MeanBlock = ComposedBlock<std::variant<CumulativeMean, SelfAttention>, ChannelMixers>;

namespace {

std::mt19937_64 rng(42);  // uniform draws from its raw bits: the same values on every platform
double uniform(double lo, double hi) { return lo + (hi - lo) * static_cast<double>(rng() >> 11) * 0x1p-53; }

// Block `b`'s forward and backward with L = sum(r * y) on random x, and a finite-difference check
// of the gradients of x and of one tensor of each part. Returns the worst relative error.
double check_block(const DecoderModel<MeanBlock>& model, HostParamStore<double>& store, std::size_t b,
                   const std::vector<std::string>& tensors) {
  const auto& block = model.block(b);
  auto& unit = store.unit(b + 1);
  for (const auto& p : unit.params())  // (random values everywhere: ones and zeros would hide mistakes)
    for (double& v : unit.tensor(unit.master(), p).span()) v = p.spec.shape.rank() == 2 ? uniform(-0.4, 0.4) : uniform(0.8, 1.2);
  example::BlockCheck check(block, unit.master(), ChunkShape{2, 9}, model.config().hidden_size, uniform);  // two sequences of 9 tokens
  (void)check.loss();
  check.backward();
  std::vector<Probe> probes;
  for (const std::string& name : tensors) {
    const auto& p = unit.param(name);
    probes.push_back(check.weight(name, p.offset, p.numel() / 3));  // (some element inside)
  }
  probes.push_back(check.input(static_cast<std::size_t>(2 * model.config().hidden_size + 3)));
  return example::worst_finite_difference(probes, [&] { return check.loss(); });
}

}  // namespace

int main() try {
  const auto cfg = ModelConfig::from_json(nlohmann::json::parse(R"({
      "architectures": ["LlamaForCausalLM"], "hidden_size": 24, "num_attention_heads": 4, "num_key_value_heads": 2,
      "intermediate_size": 40, "num_hidden_layers": 4, "vocab_size": 64})"),
                                          "example config");
  const DecoderModel<MeanBlock> model(cfg);
  for (std::size_t l = 0; l < model.num_blocks(); ++l)
    std::printf("layer %zu: %s, %s\n", l,
                std::holds_alternative<CumulativeMean>(model.block(l).op().token_mixer()) ? "cumulative mean" : "attention",
                std::holds_alternative<SwiGluMlp>(model.block(l).op().channel_mixer()) ? "dense MLP" : "experts");
  StoreOptions options;
  options.seed = 7;
  options.pinning = Pinning::never;
  HostParamStore<double> store(model.units(), options);
  std::printf("attention block (layer 0):\n");
  double worst = check_block(model, store, 0,
                             {"model.layers.0.self_attn.v_proj.weight", "model.layers.0.input_layernorm.weight",
                              "model.layers.0.mlp.up_proj.weight"});
  std::printf("cumulative mean block (layer 1):\n");
  worst = std::max(worst, check_block(model, store, 1,
                                      {"model.layers.1.mean_mixer.v_proj.weight", "model.layers.1.mean_mixer.o_proj.weight",
                                       "model.layers.1.post_attention_layernorm.weight", "model.layers.1.mlp.gate_proj.weight"}));
  const bool ok = worst < 1e-6;
  std::printf("%s (worst relative error %.1e)\n", ok ? "gradients agree" : "GRADIENTS DISAGREE", worst);
  return ok ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "example-token-mixer: %s\n", e.what());
  return 1;
}
