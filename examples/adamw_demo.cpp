// megatrain-demo: the host parameter store and the CPU AdamW on their own.
//
// Builds a store for a small decoder-shaped model (embedding, 4 blocks, head; Hugging Face
// names), then fits every master tensor to a fixed random target by minimising
// 0.5 * ||w - target||^2 with AdamW, one unit at a time as a pipeline would, with global-norm
// clipping. Prints the store's memory, the SIMD path, and the loss as it falls.
#include <oneapi/tbb/parallel_for.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "megatrain/optim/adamw.hpp"
#include "megatrain/store/host_param_store.hpp"

using namespace megatrain;

int main() {
  const std::int64_t hidden = 256, ffn = 688, vocab = 1000, layers = 4;
  std::vector<UnitSpec> units{{"embed", {ParamSpec::matrix("model.embed_tokens.weight", Shape{vocab, hidden})}}};
  for (std::int64_t l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    units.push_back({"layers." + std::to_string(l),
                     {ParamSpec::norm(p + "input_layernorm.weight", hidden),
                      ParamSpec::matrix(p + "self_attn.q_proj.weight", Shape{hidden, hidden}),
                      ParamSpec::matrix(p + "self_attn.o_proj.weight", Shape{hidden, hidden}),
                      ParamSpec::norm(p + "post_attention_layernorm.weight", hidden),
                      ParamSpec::matrix(p + "mlp.up_proj.weight", Shape{ffn, hidden}),
                      ParamSpec::matrix(p + "mlp.down_proj.weight", Shape{hidden, ffn})}});
  }
  units.push_back({"head", {ParamSpec::norm("model.norm.weight", hidden), ParamSpec::matrix("lm_head.weight", Shape{vocab, hidden})}});

  StoreOptions opt;
  opt.seed = 1;
  opt.grad_ring_slots = units.size();  // all gradients resident: exact global-norm clipping
  HostParamStore<float> store(std::move(units), opt);
  const auto& f = store.footprint();
  std::printf("store: %lld parameters in %zu units, %s (master %s, m+v %s, bf16 copy %s, gradient ring %s), %s\n",
              static_cast<long long>(store.param_count()), store.num_units(), format_bytes(store.bytes()).c_str(),
              format_bytes(f.master_bytes).c_str(), format_bytes(f.adam_bytes).c_str(),
              format_bytes(f.compute_bytes).c_str(), format_bytes(f.grad_ring_bytes).c_str(),
              store.pinned() ? "pinned" : "pageable");
  std::printf("AdamW path: %s\n", std::string(simd_level_name(active_simd_level())).c_str());

  // Targets: a second store initialised from another seed.
  StoreOptions topt = opt;
  topt.seed = 2;
  topt.grad_ring_slots = 1;
  topt.pinning = Pinning::never;
  std::vector<UnitSpec> same;
  for (const auto& u : store.units()) {
    UnitSpec s{u.name(), {}};
    for (const auto& p : u.params()) s.params.push_back(p.spec);
    same.push_back(std::move(s));
  }
  HostParamStore<float> target(std::move(same), topt);

  AdamWConfig cfg;
  cfg.weight_decay = 0.0;
  const double max_norm = 20.0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int step = 1; step <= 200; ++step) {
    double loss = 0, sumsq = 0;
    for (const auto& u : store.units()) {  // "backward": gradient of 0.5||w - t||^2 is w - t
      auto g = store.grad_slot(u.index());
      const auto w = u.master(), t = target.unit(u.index()).master();
      for (std::size_t i = 0; i < w.size(); ++i) {
        g[i] = w[i] - t[i];
        loss += 0.5 * static_cast<double>(g[i]) * g[i];
      }
      sumsq += grad_sum_squares<float>(g);
    }
    const double norm = std::sqrt(sumsq), coef = clip_coefficient(norm, max_norm);
    for (const auto& u : store.units())
      adamw_step<float>(u, std::span<const float>(store.grad_slot(u.index())), cfg, step, 2e-3, coef);
    if (step == 1 || step % 25 == 0)
      std::printf("step %3d  loss %10.4f  grad norm %8.3f  clip %.3f\n", step, loss, norm, coef);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("200 steps in %.2f s\n", secs);
  return 0;
}
