// example-gpt2-block: a user-defined layer op (a GPT-2 block, gpt2_block.hpp) in a megatrain model.
//
// Builds a DecoderModel whose blocks are Gpt2Blocks (through the block factory), lays its units
// out in a HostParamStore, and runs one block forward and backward on random data with the CPU
// reference backend. The loss is L = sum(r * y) for a fixed random r (so dL/dy = r). It prints
// the unit layout, the gradient norms, and a finite-difference spot check of a few gradients; it
// exits with status 1 if a check disagrees.
//
// Everything runs in double so the finite differences are accurate to ~1e-9; a training run
// would use HostParamStore<float> and CpuBackend<float> (or the CUDA backend) with the same op.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../common/block_check.hpp"
#include "gpt2_block.hpp"
#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/layers/decoder_model.hpp"
#include "megatrain/store/host_param_store.hpp"

using namespace megatrain;
using example::Gpt2Block;
using example::Probe;
using example::worst_finite_difference;

namespace {

// The store's units and the tensors of each.
void print_layout(const HostParamStore<double>& store) {
  std::printf("GPT-2 blocks in a DecoderModel: %zu units, %lld parameters\n", store.num_units(),
              static_cast<long long>(store.param_count()));
  for (const auto& unit : store.units()) {
    std::printf("  unit %-9s %8lld parameters:", unit.name().c_str(), static_cast<long long>(unit.param_count()));
    for (const auto& p : unit.params()) std::printf(" %s", p.spec.name.c_str());
    std::printf("\n");
  }
}

}  // namespace

int main() try {
  // The block reads hidden_size, num_attention_heads, intermediate_size and initializer_range.
  // (The model's embedding and head stay megatrain's own: token embedding, RMSNorm, LM head.)
  const auto cfg = ModelConfig::from_json(nlohmann::json::parse(R"({
      "architectures": ["LlamaForCausalLM"], "hidden_size": 96, "num_attention_heads": 4,
      "intermediate_size": 384, "num_hidden_layers": 2, "vocab_size": 512})"),
                                          "example config");
  const DecoderModel<Gpt2Block> model(cfg, [](const ModelConfig& c, std::int64_t layer) {
    return Gpt2Block(c, layer, {.layer_norm_epsilon = 1e-5});
  });

  StoreOptions options;
  options.seed = 7;
  options.pinning = Pinning::never;
  HostParamStore<double> store(model.units(), options);
  print_layout(store);

  // Block 0 lives in unit 1. Give every tensor random values (the store initialises LayerNorm
  // weights to ones and biases to zeros, which would hide mistakes in their gradients).
  const auto& block = model.block(0);
  auto& unit = store.unit(1);
  std::mt19937_64 rng(42);  // uniform draws from its raw bits: the same values on every platform
  const auto uniform = [&rng](double lo, double hi) { return lo + (hi - lo) * static_cast<double>(rng() >> 11) * 0x1p-53; };
  for (const auto& p : unit.params()) {
    const double a = p.spec.shape.rank() == 2 ? std::sqrt(3.0 / static_cast<double>(p.spec.shape[1])) : 0.0;
    for (double& v : unit.tensor(unit.master(), p).span())
      v = p.spec.shape.rank() == 2 ? uniform(-a, a)  // unit variance out of every matrix product
                                   : (p.spec.init == ParamInit::ones ? 1.0 : 0.0) + uniform(-0.2, 0.2);
  }

  example::BlockCheck check(block, unit.master(), ChunkShape{2, 33}, cfg.hidden_size, uniform);  // two sequences of 33 tokens
  std::printf("scratch for a chunk of %d tokens: %zu bytes\n", 2 * 33, check.scratch_bytes());

  // Forward and backward (the weight gradients from zero).
  const double l0 = check.loss();
  check.backward();
  const auto norm = [](std::span<const double> s) {
    double n = 0;
    for (double v : s) n += v * v;
    return std::sqrt(n);
  };
  std::printf("loss sum(r*y) = %.6f   |dL/dx| = %.6f   |dL/dw| = %.6f\n", l0, norm(check.dx), norm(check.grad));
  for (const auto& p : unit.params())
    std::printf("  |grad %-28s| = %.6f\n", p.spec.name.c_str(),
                norm(unit.tensor(std::span<const double>(check.grad), p).span()));

  // Finite differences: (L(w + h) - L(w - h)) / 2h against the analytic gradient.
  std::vector<Probe> probes;
  for (const char* name : {"h.0.ln_1.weight", "h.0.ln_1.bias", "h.0.attn.c_attn.weight", "h.0.attn.c_proj.bias",
                           "h.0.ln_2.bias", "h.0.mlp.c_fc.weight", "h.0.mlp.c_proj.weight"}) {
    const auto& p = unit.param(name);
    probes.push_back(check.weight(name, p.offset, p.numel() / 3));  // (some element inside)
  }
  probes.push_back(check.input(5));
  const double worst = worst_finite_difference(probes, [&] { return check.loss(); });
  const bool ok = worst < 1e-6;
  std::printf("%s (worst relative error %.1e)\n", ok ? "gradients agree" : "GRADIENTS DISAGREE", worst);
  return ok ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "example-gpt2-block: %s\n", e.what());
  return 1;
}
