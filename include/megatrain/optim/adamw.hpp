// AdamW on the CPU, exactly torch.optim.AdamW (amsgrad=False, maximize=False).
//
// For a parameter p with gradient g at step t (1-based), learning rate lr, weight decay wd:
//
//     g  <- g * c                       (c: the clipping coefficient, 1 without clipping)
//     p  <- p * (1 - lr * wd)           (decoupled weight decay)
//     m  <- m + (1 - beta1) * (g - m)   (= beta1 m + (1 - beta1) g, PyTorch's lerp)
//     v  <- beta2 * v + (1 - beta2) * g^2
//     p  <- p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//
// eps is added outside the square root, after bias correction, as PyTorch does. The scalars
// (1 - lr wd, the step size and sqrt(1 - beta2^t)) are computed in double and rounded to T,
// as PyTorch rounds its Python-float scalars to the tensor's dtype. In the same pass the bf16
// compute copy of p is written (round to nearest even).
//
// Rounding: the fp32 kernels (scalar, AVX2, AVX-512) evaluate exactly the same operations in
// the same order, with fused multiply-adds at the same places (m update, v update and the
// final p update), so all paths give bit-identical results. Against a float64 evaluation of
// the formula, one fp32 step is off by a few ulp of p; see tests/unit/test_adamw.cpp for the
// tolerance over many steps.
//
// Parameters whose ParamSpec says weight_decay = false (norm weights, biases) get wd = 0.
// The optimizer is stateless: m and v live in the HostParamStore, the step count with the
// caller, so a pipeline can step each unit as soon as its gradient lands.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "megatrain/core/cpu_features.hpp"
#include "megatrain/core/dtype.hpp"
#include "megatrain/core/nvtx.hpp"
#include "megatrain/store/host_param_store.hpp"

namespace megatrain {

struct AdamWConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;

  /// Throws megatrain::Error naming the bad field.
  void validate() const;
};

/// The per-step scalars of the update, in T, derived once per (unit, step).
template <class T>
struct AdamWScalars {
  T decay;          ///< 1 - lr * wd
  T one_minus_b1;   ///< 1 - beta1
  T beta2;
  T one_minus_b2;   ///< 1 - beta2
  T bc2_sqrt;       ///< sqrt(1 - beta2^t)
  T eps;
  T step_size;      ///< lr / (1 - beta1^t)
  T grad_scale;     ///< clipping coefficient

  static AdamWScalars make(const AdamWConfig& cfg, std::int64_t step, double lr, double weight_decay, double grad_scale);
};

namespace detail {
/// One fp32 update over n contiguous elements, on the given vector path; writes bf16(p) to out
/// (null: a store without a bf16 copy).
void adamw_f32(SimdLevel level, const AdamWScalars<float>& s, float* p, float* m, float* v, const float* g,
               bf16* out, std::size_t n);
/// Sum of squares of n floats on the given vector path, accumulated in double.
double sum_squares_f32(SimdLevel level, const float* x, std::size_t n);
}  // namespace detail

/// Applies one AdamW step to every parameter of `unit` from `grad` (laid out like the unit's
/// slabs: unit.numel() elements, the gaps between tensors ignored). `step` is the 1-based count
/// of updates including this one; `lr` the learning rate for this step (a schedule's value);
/// `grad_scale` multiplies the gradient first (the clipping coefficient). Runs in parallel over
/// blocks with oneTBB, on the widest vector path the CPU has (active_simd_level()).
template <class T>
void adamw_step(const typename HostParamStore<T>::Unit& unit, std::span<const T> grad, const AdamWConfig& cfg,
                std::int64_t step, double lr, double grad_scale = 1.0);

/// A stretch of a unit's elements and where its gradient is: elements [offset, offset + size)
/// of the unit's slabs take their gradient from grad[0, size). A null `grad` is a zero gradient
/// (AdamW still decays m and v, applies weight decay and moves the weight, as PyTorch does for
/// a parameter whose gradient is zero).
template <class T>
struct AdamWSegment {
  std::size_t offset = 0, size = 0;
  const T* grad = nullptr;
};

/// adamw_step over some of a unit's elements only (the rest untouched): the same update, so
/// applying it to segments that cover every element once equals one adamw_step. Segments must
/// not overlap and must lie inside the unit; gaps between tensors are skipped. Returns the sum
/// of squares of the (unscaled) gradient over the segments, in double, deterministic at any
/// thread count: each work block is summed just before it is updated, while its gradient is
/// still in cache, so a caller that needs the norm reads the gradient from memory once.
template <class T>
double adamw_segments(const typename HostParamStore<T>::Unit& unit, std::span<const AdamWSegment<T>> segments,
                    const AdamWConfig& cfg, std::int64_t step, double lr, double grad_scale = 1.0);

/// Sum of squared gradient elements of one unit (the gaps count zero, as they hold zeros), in
/// double, deterministic regardless of thread count.
template <class T>
double grad_sum_squares(std::span<const T> grad);

/// dst += src, element by element, in parallel (gradient accumulation over micro-batches).
template <class T>
void accumulate_gradient(std::span<T> dst, std::span<const T> src);

/// torch.nn.utils.clip_grad_norm_'s coefficient: min(1, max_norm / (total_norm + 1e-6)), where
/// total_norm = sqrt(sum over all units of grad_sum_squares). A non-finite norm gives a
/// non-finite coefficient, as in PyTorch (error_if_nonfinite=False): the caller decides.
double clip_coefficient(double total_norm, double max_norm);

/// The result of clip_grad_norm: the global norm and the coefficient to pass to adamw_step as
/// grad_scale.
struct GradClip {
  double total_norm;  ///< sqrt(sum over all gradients of grad_sum_squares)
  double coef;        ///< clip_coefficient(total_norm, max_norm): 1 when the norm is within max_norm
};

/// torch.nn.utils.clip_grad_norm_ (norm_type 2, error_if_nonfinite=False) over several units at
/// once: the 2-norm over all of `grads` together, then one coefficient for all of them. Unlike
/// PyTorch it does not scale the gradients in place: pass `coef` to adamw_step / adamw_segments
/// as grad_scale (the same multiplication, in the same pass as the update). A non-finite norm
/// gives a non-finite `coef` (NaN norm: NaN; infinite norm: 0), as PyTorch would scale by; the
/// caller decides whether to skip the step. Deterministic at any thread count. Throws
/// megatrain::Error if max_norm is not finite and > 0.
template <class T>
GradClip clip_grad_norm(std::span<const std::span<const T>> grads, double max_norm);

}  // namespace megatrain

// ---- implementation ---------------------------------------------------------------------------

#include <oneapi/tbb/parallel_for.h>

#include <cmath>
#include <vector>

namespace megatrain {

namespace detail {
inline constexpr std::size_t kOptimBlock = 1 << 14;  // elements per parallel task

/// Scalar update, any T; for float the compiled detail::adamw_f32 is used instead.
template <class T>
void adamw_generic(const AdamWScalars<T>& s, T* p, T* m, T* v, const T* g, bf16* out, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    const T gi = g[i] * s.grad_scale;
    T pi = p[i] * s.decay;
    const T mi = std::fma(s.one_minus_b1, gi - m[i], m[i]);
    const T vi = std::fma(s.one_minus_b2, gi * gi, v[i] * s.beta2);
    const T denom = std::sqrt(vi) / s.bc2_sqrt + s.eps;
    pi = std::fma(-s.step_size, mi / denom, pi);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if (out != nullptr) out[i] = bf16(static_cast<float>(pi));
  }
}
}  // namespace detail

template <class T>
AdamWScalars<T> AdamWScalars<T>::make(const AdamWConfig& cfg, std::int64_t step, double lr, double weight_decay,
                                      double grad_scale) {
  const double t = static_cast<double>(step);
  return AdamWScalars{static_cast<T>(1.0 - lr * weight_decay),
                      static_cast<T>(1.0 - cfg.beta1),
                      static_cast<T>(cfg.beta2),
                      static_cast<T>(1.0 - cfg.beta2),
                      static_cast<T>(std::sqrt(1.0 - std::pow(cfg.beta2, t))),
                      static_cast<T>(cfg.eps),
                      static_cast<T>(lr / (1.0 - std::pow(cfg.beta1, t))),
                      static_cast<T>(grad_scale)};
}

template <class T>
void adamw_step(const typename HostParamStore<T>::Unit& unit, std::span<const T> grad, const AdamWConfig& cfg,
                std::int64_t step, double lr, double grad_scale) {
  MT_NVTX_RANGE("adamw_step");
  MT_CHECK(static_cast<std::int64_t>(grad.size()) >= unit.numel(),
           "gradient of {} elements is shorter than unit '{}' ({} elements)", grad.size(), unit.name(), unit.numel());
  const AdamWSegment<T> whole{0, static_cast<std::size_t>(unit.numel()), grad.data()};
  adamw_segments<T>(unit, std::span<const AdamWSegment<T>>(&whole, 1), cfg, step, lr, grad_scale);
}

template <class T>
double adamw_segments(const typename HostParamStore<T>::Unit& unit, std::span<const AdamWSegment<T>> segments,
                      const AdamWConfig& cfg, std::int64_t step, double lr, double grad_scale) {
  MT_NVTX_RANGE("adamw_segments");
  cfg.validate();
  MT_CHECK(unit.has_moments(), "unit '{}': the store keeps no optimizer state (StoreOptions::optimizer_state false): it is "
           "read, never stepped", unit.name());
  MT_CHECK(step >= 1, "step must be >= 1 (got {})", step);
  MT_CHECK(std::isfinite(lr) && lr >= 0, "learning rate must be finite and >= 0 (got {})", lr);
  const auto numel = static_cast<std::size_t>(unit.numel());
  for (const auto& sg : segments)
    MT_CHECK(sg.offset <= numel && sg.size <= numel - sg.offset,
             "AdamW segment [{}, {}) is outside unit '{}' ({} elements)", sg.offset, sg.offset + sg.size, unit.name(), numel);
  const AdamWScalars<T> with_wd = AdamWScalars<T>::make(cfg, step, lr, cfg.weight_decay, grad_scale);
  const AdamWScalars<T> no_wd = AdamWScalars<T>::make(cfg, step, lr, 0.0, grad_scale);

  // Work blocks of at most kOptimBlock elements: each segment cut at tensor boundaries (the
  // weight decay differs per tensor; the gaps between tensors are skipped).
  struct Block {
    std::size_t begin, size;
    const T* g;  // null: zero gradient
    const AdamWScalars<T>* s;
  };
  std::vector<Block> blocks;
  for (const auto& sg : segments) {
    for (const auto& p : unit.params()) {
      const auto lo = std::max(sg.offset, static_cast<std::size_t>(p.offset));
      const auto hi = std::min(sg.offset + sg.size, static_cast<std::size_t>(p.offset + p.numel()));
      const auto* s = p.spec.weight_decay ? &with_wd : &no_wd;
      for (std::size_t b = lo; b < hi; b += detail::kOptimBlock)
        blocks.push_back({b, std::min(detail::kOptimBlock, hi - b), sg.grad ? sg.grad + (b - sg.offset) : nullptr, s});
    }
  }
  const SimdLevel level = active_simd_level();
  T* pm = unit.master().data();
  T* mm = unit.adam_m().data();
  T* vm = unit.adam_v().data();
  bf16* out = unit.compute().empty() ? nullptr : unit.compute().data();  // (none: no bf16 copy)
  static const std::vector<T> zeros(detail::kOptimBlock, T(0));
  std::vector<double> sumsq(blocks.size(), 0.0);
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, blocks.size()), [&](const auto& r) {
    for (std::size_t i = r.begin(); i != r.end(); ++i) {
      const Block& b = blocks[i];
      const std::size_t o = b.begin;
      const T* g = b.g ? b.g : zeros.data();
      if constexpr (std::is_same_v<T, float>) {
        if (b.g) sumsq[i] = detail::sum_squares_f32(level, g, b.size);
        detail::adamw_f32(level, *b.s, pm + o, mm + o, vm + o, g, out ? out + o : nullptr, b.size);
      } else {
        if (b.g)
          for (std::size_t k = 0; k < b.size; ++k) sumsq[i] += static_cast<double>(g[k]) * static_cast<double>(g[k]);
        detail::adamw_generic(*b.s, pm + o, mm + o, vm + o, g, out ? out + o : nullptr, b.size);
      }
    }
  });
  double total = 0;
  for (double x : sumsq) total += x;
  return total;
}

template <class T>
double grad_sum_squares(std::span<const T> grad) {
  MT_NVTX_RANGE("grad_sum_squares");
  constexpr std::size_t kBlock = 1 << 16;
  const std::size_t nblocks = (grad.size() + kBlock - 1) / kBlock;
  std::vector<double> partial(nblocks);
  const SimdLevel level = active_simd_level();
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, nblocks), [&](const auto& r) {
    for (std::size_t b = r.begin(); b != r.end(); ++b) {
      const std::size_t begin = b * kBlock, n = std::min(kBlock, grad.size() - begin);
      if constexpr (std::is_same_v<T, float>) {
        partial[b] = detail::sum_squares_f32(level, grad.data() + begin, n);
      } else {
        double acc = 0;
        for (std::size_t i = 0; i < n; ++i) acc += static_cast<double>(grad[begin + i]) * static_cast<double>(grad[begin + i]);
        partial[b] = acc;
      }
    }
  });
  double total = 0;
  for (double x : partial) total += x;  // fixed order: deterministic
  return total;
}

template <class T>
GradClip clip_grad_norm(std::span<const std::span<const T>> grads, double max_norm) {
  MT_NVTX_RANGE("clip_grad_norm");
  double sumsq = 0;
  for (const auto& g : grads) sumsq += grad_sum_squares<T>(g);  // fixed order: deterministic
  const double total_norm = std::sqrt(sumsq);
  return {total_norm, clip_coefficient(total_norm, max_norm)};
}

template <class T>
void accumulate_gradient(std::span<T> dst, std::span<const T> src) {
  MT_NVTX_RANGE("accumulate_gradient");
  MT_CHECK(dst.size() == src.size(), "accumulate_gradient: {} elements into {}", src.size(), dst.size());
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, dst.size(), 1 << 16), [&](const auto& r) {
    for (std::size_t i = r.begin(); i != r.end(); ++i) dst[i] += src[i];
  });
}

}  // namespace megatrain
