// The examples' gradient spot check: central differences of a loss against analytic gradients.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace example {

/// A value the loss depends on, and its analytic gradient.
struct Probe {
  std::string what;
  double* value;
  double analytic;
};

/// The worst relative error of (L(v + h) - L(v - h)) / 2h against each probe's analytic gradient,
/// each printed.
template <class Loss>
double worst_finite_difference(const std::vector<Probe>& probes, Loss&& loss) {
  const double h = 1e-5;
  double worst = 0;
  std::printf("finite-difference spot check (h = %g):\n", h);
  for (const auto& pr : probes) {
    const double saved = *pr.value;
    *pr.value = saved + h;
    const double lp = loss();
    *pr.value = saved - h;
    const double lm = loss();
    *pr.value = saved;
    const double numeric = (lp - lm) / (2 * h);
    const double err = std::abs(numeric - pr.analytic) / std::max(1e-8, std::abs(numeric) + std::abs(pr.analytic));
    worst = std::max(worst, err);
    std::printf("  %-44s analytic % .9e   numeric % .9e   rel. error %.1e\n", pr.what.c_str(), pr.analytic, numeric, err);
  }
  return worst;
}

}  // namespace example
