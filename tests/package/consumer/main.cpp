// Builds a two-unit store, takes a few AdamW steps on a quadratic loss, and checks that the
// loss fell: proof that the packaged headers, library and dependencies work together.
#include <megatrain/optim/adamw.hpp>
#include <megatrain/store/host_param_store.hpp>

#include <cstdio>
#include <vector>

int main() {
  using namespace megatrain;
  StoreOptions opt;
  opt.seed = 1;
  opt.pinning = Pinning::never;
  HostParamStore<float> store({{"a", {ParamSpec::matrix("a.w", Shape{33, 17}, 0.5f)}},
                               {"b", {ParamSpec::matrix("b.w", Shape{9, 5}, 0.5f), ParamSpec::norm("b.n", 5)}}},
                              opt);
  auto loss = [&] {  // 0.5 * sum(w^2)
    double l = 0;
    for (const auto& u : store.units())
      for (float w : u.master()) l += 0.5 * w * w;
    return l;
  };
  const double before = loss();
  AdamWConfig cfg;
  for (int t = 1; t <= 20; ++t) {
    for (const auto& u : store.units()) {
      auto g = store.grad_slot(0).first(static_cast<std::size_t>(u.numel()));
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = u.master()[i];  // d loss / d w = w
      adamw_step<float>(u, std::span<const float>(g), cfg, t, 1e-2);
    }
  }
  const double after = loss();
  std::printf("megatrain consumer: loss %.4f -> %.4f\n", before, after);
  return after < before ? 0 : 1;
}
