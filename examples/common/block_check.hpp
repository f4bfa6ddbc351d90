// The examples' block check: one block's forward and backward, in double on the CPU reference
// backend, on random inputs x with the loss L = sum(r * y) for a fixed random r (so dL/dy = r).
// Its loss() and gradients feed worst_finite_difference (finite_difference.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "finite_difference.hpp"
#include "megatrain/backend/arena.hpp"
#include "megatrain/backend/cpu/cpu_backend.hpp"

namespace example {

template <class Tmpl>
class BlockCheck {
 public:
  /// Block `block` over `chunk` with its weights in `weights` (its unit's masters, laid out as
  /// the block binds them); x and r drawn from `uniform(lo, hi)` in [-1, 1].
  template <class Uniform>
  BlockCheck(const Tmpl& block, std::span<double> weights, megatrain::ChunkShape chunk, std::int64_t hidden,
             Uniform&& uniform)
      : block_(block), w_(weights), chunk_(chunk), d_(hidden), x(size()), y(size()), dx(size()), r(size()),
        grad(weights.size()),
        scratch_(block.op().template scratch_bytes<megatrain::CpuBackend<double>>(chunk)), arena_(std::span<std::byte>(scratch_)) {
    for (double& v : x) v = uniform(-1, 1);
    for (double& v : r) v = uniform(-1, 1);
  }

  /// L = sum(r * y) of the forward from x (y kept).
  double loss() {
    block_.op().forward(be_, chunk_, block_.bind(std::span<const double>(w_)), view(x), view(y), arena_);
    double l = 0;
    for (std::size_t i = 0; i < y.size(); ++i) l += r[i] * y[i];
    return l;
  }
  /// dx and the weights' gradient (from zero) of L.
  void backward() {
    std::fill(grad.begin(), grad.end(), 0.0);
    block_.op().backward(be_, chunk_, block_.bind(std::span<const double>(w_)), view(x), view(r), view(dx),
                         block_.bind(std::span<double>(grad)), arena_);
  }
  /// A probe of element i of the weight at `offset`, and one of x[i].
  Probe weight(const std::string& name, std::int64_t offset, std::int64_t i) {
    const auto at = static_cast<std::size_t>(offset + i);
    return {name + "[" + std::to_string(i) + "]", &w_[at], grad[at]};
  }
  Probe input(std::size_t i) { return {"x[" + std::to_string(i) + "]", &x[i], dx[i]}; }
  std::size_t scratch_bytes() const { return scratch_.size(); }

 private:
  std::size_t size() const { return static_cast<std::size_t>(chunk_.tokens() * d_); }
  megatrain::View<double> view(std::vector<double>& v) const {
    return megatrain::View<double>(std::span<double>(v), megatrain::Shape{chunk_.tokens(), d_});
  }

  const Tmpl& block_;
  std::span<double> w_;
  megatrain::ChunkShape chunk_;
  std::int64_t d_;

 public:
  std::vector<double> x, y, dx, r, grad;

 private:
  megatrain::CpuBackend<double> be_;
  std::vector<std::byte> scratch_;
  megatrain::Arena arena_;
};

}  // namespace example
