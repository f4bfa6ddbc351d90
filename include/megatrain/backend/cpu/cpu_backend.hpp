// The CPU reference backend: every primitive a decoder layer needs, in plain precision T
// (float by default, double for gradient checks), with Eigen for matrix products and oneTBB
// for parallel loops. It is the ground truth the CUDA backend is tested against, and it runs
// the same layer templates and pipeline, so the whole trainer is testable without a GPU.
//
// Conventions shared by all backends (see backend/backend.hpp):
//   - activations are row-major [tokens, features]; a chunk is `rows` whole sequences of `seq`
//     tokens, token t at position t % seq of its sequence;
//   - linear layers follow nn.Linear: y = x W^T + b with W of shape [out, in];
//   - `*_backward` functions accumulate (+=) into weight gradients, and overwrite input
//     gradients unless `accumulate` says to add;
//   - sums over tokens are computed in a fixed order (fixed row blocks, added in sequence), so
//     results do not depend on the number of threads.
#pragma once

#include <oneapi/tbb/parallel_for.h>

#include <Eigen/Core>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

#include "megatrain/backend/backend.hpp"
#include "megatrain/backend/cpu/attention_decode.hpp"
#include "megatrain/backend/cpu/gated_deltanet_decode.hpp"
#include "megatrain/backend/cpu/gated_deltanet_mix.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/core/tensor.hpp"
#include "megatrain/optim/adamw.hpp"
#include "megatrain/pipeline/executor.hpp"

namespace megatrain {

template <class T = float>
class CpuBackend {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "CpuBackend<T>: T must be float (the fp32 reference) or double (gradient checks)");

 public:
  using Act = T;     ///< activations
  using Weight = T;  ///< weights as the ops read them
  using Acc = T;     ///< gradient accumulators, norms' saved statistics, losses
  using Res = T;     ///< the residual stream and its gradient
  static constexpr bool kDevice = false;

  /// Tokens per block when the LM head computes logits (bounds the [block, vocab] scratch).
  std::int64_t logits_block = 256;

  // ---- memory and executors (what a trainer's pipeline stages use) ----------------------------
  // "Device" memory is host memory here, and every stage runs on its own host thread.
  using Executor = HostExecutor;
  enum class Role { upload, compute, download };
  Executor make_executor(Role) { return HostExecutor{}; }

  /// The most bytes alloc() may hand out in all (none: no cap), as the CUDA backend's memory cap:
  /// a trainer on this backend then keeps some activation checkpoints in host memory of its own,
  /// as it does on a GPU, which lets tests exercise that path and the memory plan's decisions.
  std::optional<std::size_t> memory_limit;

  /// An owning, zeroed array in backend memory, counted in allocated_bytes() while it lives
  /// (n * sizeof(E) bytes, as the memory plan counts it).
  template <class E>
  class Buffer {
   public:
    Buffer() = default;
    Buffer(std::size_t n, std::shared_ptr<std::atomic<std::size_t>> counter) : v_(n, E{}), counter_(std::move(counter)) {
      if (counter_) *counter_ += n * sizeof(E);
    }
    Buffer(Buffer&& o) noexcept : v_(std::move(o.v_)), counter_(std::move(o.counter_)) { o.v_.clear(); }
    Buffer& operator=(Buffer&& o) noexcept {
      if (this != &o) {
        release();
        v_ = std::move(o.v_);
        counter_ = std::move(o.counter_);
        o.v_.clear();
      }
      return *this;
    }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    ~Buffer() { release(); }
    std::span<E> span() { return v_; }
    std::span<const E> span() const { return v_; }
    std::size_t size() const { return v_.size(); }

   private:
    void release() {
      if (counter_) *counter_ -= v_.size() * sizeof(E);
      counter_.reset();
    }
    std::vector<E> v_;
    std::shared_ptr<std::atomic<std::size_t>> counter_;
  };
  template <class E>
  Buffer<E> alloc(std::size_t n) {
    const std::size_t bytes = n * sizeof(E), used = *allocated_;
    MT_CHECK(!memory_limit || (bytes <= *memory_limit && used <= *memory_limit - bytes),
             "backend memory: {} more would exceed the cap of {} ({} already allocated)", format_bytes(bytes),
             format_bytes(memory_limit.value_or(0)), format_bytes(used));
    return Buffer<E>(n, allocated_);
  }
  /// Bytes of the buffers alloc() handed out that are still alive.
  std::size_t allocated_bytes() const { return *allocated_; }
  /// Bytes alloc() can still hand out (none: no cap).
  std::optional<std::size_t> memory_available() const {
    if (!memory_limit) return std::nullopt;
    return *memory_limit > *allocated_ ? *memory_limit - *allocated_ : 0;
  }
  /// Host -> backend memory (converting the element type if they differ).
  template <class S, class D>
  void upload(Executor&, std::span<const S> src, std::span<D> dst) {
    MT_CHECK(src.size() == dst.size(), "upload of {} elements into {}", src.size(), dst.size());
    std::transform(src.begin(), src.end(), dst.begin(), [](S x) { return static_cast<D>(x); });
  }
  /// Backend -> host memory.
  template <class S, class D>
  void download(Executor& e, std::span<const S> src, std::span<D> dst) {
    upload(e, src, dst);
  }
  template <class E>
  void zero(Executor&, std::span<E> dst) {
    std::fill(dst.begin(), dst.end(), E{});
  }

  // ---- elementwise ---------------------------------------------------------------------------
  template <class E>
  void copy(View<const E> src, View<E> dst) {
    check_same(src.shape(), dst.shape(), "copy");
    auto s = src.span();
    std::copy(s.begin(), s.end(), dst.span().begin());
  }
  template <class E>
  void fill(View<E> dst, E value) {
    auto d = dst.span();
    std::fill(d.begin(), d.end(), value);
  }
  /// y += x
  void add(View<const Act> x, View<Act> y) {
    check_same(x.shape(), y.shape(), "add");
    auto xs = x.span();
    auto ys = y.span();
    parallel_rows(static_cast<std::int64_t>(ys.size()), 1 << 14, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) ys[i] += xs[i];
    });
  }
  /// y = r + x: the residual stream plus activations (y may be r).
  void residual_add(View<const Res> r, View<const Act> x, View<Res> y) {
    check_same(r.shape(), y.shape(), "residual_add");
    check_same(x.shape(), y.shape(), "residual_add");
    auto rs = r.span();
    auto xs = x.span();
    auto ys = y.span();
    parallel_rows(static_cast<std::int64_t>(ys.size()), 1 << 14, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) ys[i] = rs[i] + xs[i];
    });
  }

  // ---- an output gate (gated attention: Qwen3.5's and Qwen3-Next's q_proj) ------------------------
  /// A projection [tokens, heads * 2 dim] whose heads each hold dim values then dim gate inputs,
  /// split into x and gate ([tokens, heads * dim] each).
  void split_halves(View<const Act> both, std::int64_t dim, View<Act> x, View<Act> gate) {
    check_same(x.shape(), gate.shape(), "split_halves");
    MT_CHECK(both.numel() == 2 * x.numel() && dim > 0 && x.numel() % dim == 0, "split_halves: {} into {} by {}",
             both.shape().str(), x.shape().str(), dim);
    const Act* b = both.data();
    parallel_rows(x.numel() / dim, 256, [&](std::int64_t h0, std::int64_t h1) {
      for (std::int64_t h = h0; h < h1; ++h) {
        std::copy_n(b + 2 * h * dim, dim, x.data() + h * dim);
        std::copy_n(b + (2 * h + 1) * dim, dim, gate.data() + h * dim);
      }
    });
  }
  /// The inverse of split_halves: both from dx and dgate.
  void merge_halves(View<const Act> dx, View<const Act> dgate, std::int64_t dim, View<Act> both) {
    check_same(dx.shape(), dgate.shape(), "merge_halves");
    MT_CHECK(both.numel() == 2 * dx.numel() && dim > 0 && dx.numel() % dim == 0, "merge_halves: {} from {} by {}",
             both.shape().str(), dx.shape().str(), dim);
    Act* b = both.data();
    parallel_rows(dx.numel() / dim, 256, [&](std::int64_t h0, std::int64_t h1) {
      for (std::int64_t h = h0; h < h1; ++h) {
        std::copy_n(dx.data() + h * dim, dim, b + 2 * h * dim);
        std::copy_n(dgate.data() + h * dim, dim, b + (2 * h + 1) * dim);
      }
    });
  }
  /// sigmoid_gate takes a gate per group of features (SharedExpertBackend).
  static constexpr bool kSigmoidGatePerGroup = true;
  /// y = x * sigmoid(gate): gate [rows, G] over x [rows, D] (D a multiple of G), each gate
  /// element scaling D / G consecutive features of its row (G == D: element-wise; G == 1: a row's
  /// one gate, as the shared expert's).
  void sigmoid_gate(View<const Act> x, View<const Act> gate, View<Act> y) {
    check_same(x.shape(), y.shape(), "sigmoid_gate");
    const std::int64_t group = gate_group(x, gate, "sigmoid_gate");
    parallel_rows(x.numel(), 1 << 14, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) y.data()[i] = x.data()[i] * sigmoid(gate.data()[i / group]);
    });
  }
  /// dx = dy * sigmoid(gate) (overwritten); dgate (overwritten) = s (1 - s) times the sum of
  /// dy * x over the features the gate element scales.
  void sigmoid_gate_backward(View<const Act> x, View<const Act> gate, View<const Act> dy, View<Act> dx, View<Act> dgate) {
    check_same(dy.shape(), dx.shape(), "sigmoid_gate_backward");
    check_same(x.shape(), dx.shape(), "sigmoid_gate_backward");
    check_same(gate.shape(), dgate.shape(), "sigmoid_gate_backward");
    const std::int64_t group = gate_group(x, gate, "sigmoid_gate_backward");
    parallel_rows(gate.numel(), std::max<std::int64_t>(1, (1 << 14) / group), [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t gi = b; gi < e; ++gi) {
        const T s = sigmoid(gate.data()[gi]);
        T dot = 0;
        for (std::int64_t i = gi * group; i < (gi + 1) * group; ++i) {
          dx.data()[i] = dy.data()[i] * s;
          dot += dy.data()[i] * x.data()[i];
        }
        dgate.data()[gi] = dot * s * (T(1) - s);
      }
    });
  }

  // ---- linear --------------------------------------------------------------------------------
  /// y[M,N] = x[M,K] w[N,K]^T (+ bias[N] unless bias is null)
  void linear(View<const Act> x, View<const Weight> w, View<const Weight> bias, View<Act> y) {
    const LinearDims dims = linear_dims(x, w, y, bias);
    const std::int64_t M = dims.M, K = dims.K, N = dims.N;  // (clang 14 cannot capture structured bindings)
    auto X = mat(x, M, K);
    auto W = mat(w, N, K);
    auto Y = mat(y, M, N);
    parallel_rows(M, 256, [&](std::int64_t b, std::int64_t e) {
      Y.middleRows(b, e - b).noalias() = X.middleRows(b, e - b) * W.transpose();
      if (!bias.is_null()) Y.middleRows(b, e - b).rowwise() += vec(bias, N).transpose();
    });
  }
  /// y = r + (x[M,K] w[N,K]^T + bias[N], unless bias is null): a product added to the residual
  /// stream (y may be r).
  void linear_add(View<const Act> x, View<const Weight> w, View<const Weight> bias, View<const Res> r, View<Res> y) {
    const LinearDims dims = linear_dims(x, w, y, bias);
    const std::int64_t M = dims.M, K = dims.K, N = dims.N;
    check_same(r.shape(), y.shape(), "linear_add");
    auto X = mat(x, M, K);
    auto W = mat(w, N, K);
    auto R = mat(r, M, N);
    auto Y = mat(y, M, N);
    parallel_rows(M, 256, [&](std::int64_t b, std::int64_t e) {
      Matrix P = X.middleRows(b, e - b) * W.transpose();  // (the product first: y may alias r)
      if (!bias.is_null()) P.rowwise() += vec(bias, N).transpose();
      Y.middleRows(b, e - b) = R.middleRows(b, e - b) + P;
    });
  }
  /// dx = dy w (or dx += ... if accumulate_dx; skipped if dx is null); dw += dy^T x (skipped if
  /// dw is null: then db must be too, and x is read for its shape only); db += column sums of dy
  /// (unless db is null). Null views (View{}) stand for absent tensors.
  void linear_backward(View<const Act> x, View<const Weight> w, View<const Act> dy, View<Act> dx, bool accumulate_dx,
                       View<Acc> dw, View<Acc> db) {
    const LinearDims dims = linear_dims(x, w, dy, View<const Weight>{});
    const std::int64_t M = dims.M, K = dims.K, N = dims.N;
    auto X = mat(x, M, K);
    auto W = mat(w, N, K);
    auto DY = mat(dy, M, N);
    if (!dx.is_null()) {
      check_same(dx.shape(), x.shape(), "linear_backward dx");
      auto DX = mat(dx, M, K);
      parallel_rows(M, 256, [&](std::int64_t b, std::int64_t e) {
        if (accumulate_dx) DX.middleRows(b, e - b).noalias() += DY.middleRows(b, e - b) * W;
        else DX.middleRows(b, e - b).noalias() = DY.middleRows(b, e - b) * W;
      });
    }
    if (dw.is_null()) {  // (the input gradient alone)
      MT_CHECK(db.is_null(), "linear_backward: a bias gradient without the weight's");
      return;
    }
    check_same(dw.shape(), w.shape(), "linear_backward dw");
    auto DW = mat(dw, N, K);
    parallel_rows(N, 64, [&](std::int64_t b, std::int64_t e) {
      DW.middleRows(b, e - b).noalias() += DY.middleCols(b, e - b).transpose() * X;
    });
    if (!db.is_null()) {
      MT_CHECK(db.numel() == N, "bias gradient has {} elements, expected {}", db.numel(), N);
      column_sums(DY, db.span());
    }
  }

  // ---- RMSNorm -------------------------------------------------------------------------------
  /// y = x / sqrt(mean(x^2) + eps) * (w + offset), row by row (offset 1: Gemma's (1 + w) norms);
  /// rstd[M] keeps 1/sqrt(mean(x^2) + eps).
  void rmsnorm(View<const Act> x, View<const Weight> w, double eps, View<Act> y, View<Acc> rstd, double offset = 0.0) {
    const std::int64_t M = x.size(0), d = x.size(1);
    check_same(x.shape(), y.shape(), "rmsnorm");
    MT_CHECK(w.numel() == d && rstd.numel() == M, "rmsnorm: weight {} / rstd {} do not match x {}", w.shape().str(),
             rstd.shape().str(), x.shape().str());
    const T* xs = x.data();
    const T* ws = w.data();
    T* ys = y.data();
    T* rs = rstd.data();
    const T off = static_cast<T>(offset);
    parallel_rows(M, 16, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t r = b; r < e; ++r) {
        const T* xr = xs + r * d;
        double ss = 0;
        for (std::int64_t i = 0; i < d; ++i) ss += static_cast<double>(xr[i]) * static_cast<double>(xr[i]);
        const T inv = static_cast<T>(1.0 / std::sqrt(ss / static_cast<double>(d) + eps));
        rs[r] = inv;
        for (std::int64_t i = 0; i < d; ++i) ys[r * d + i] = xr[i] * inv * (ws[i] + off);
      }
    });
  }
  /// dx = residual + (rmsnorm's input gradient) (no residual: null view; it may be dx itself),
  /// dx_act = dx as activations (unless null), dw += the gain's gradient; from the saved rstd.
  void rmsnorm_backward(View<const Res> x, View<const Weight> w, View<const Acc> rstd, View<const Act> dy,
                        View<const Res> residual, View<Res> dx, View<Act> dx_act, View<Acc> dw, double offset = 0.0) {
    const std::int64_t M = x.size(0), d = x.size(1);
    const T off = static_cast<T>(offset);
    check_same(x.shape(), dy.shape(), "rmsnorm_backward dy");
    check_same(x.shape(), dx.shape(), "rmsnorm_backward dx");
    if (!residual.is_null()) check_same(x.shape(), residual.shape(), "rmsnorm_backward residual");
    if (!dx_act.is_null()) check_same(x.shape(), dx_act.shape(), "rmsnorm_backward dx_act");
    const bool accumulate_dx = !residual.is_null();
    const T* xs = x.data();
    const T* ws = w.data();
    const T* rs = rstd.data();
    const T* dys = dy.data();
    const T* res = residual.data();
    T* dxs = dx.data();
    T* dxa = dx_act.data();
    parallel_rows(M, 16, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t r = b; r < e; ++r) {
        const T* xr = xs + r * d;
        const T* gr = dys + r * d;
        double dot = 0;  // sum_i (dy_i w_i) * xhat_i
        for (std::int64_t i = 0; i < d; ++i) dot += static_cast<double>(gr[i] * (ws[i] + off)) * static_cast<double>(xr[i] * rs[r]);
        const T mean = static_cast<T>(dot / static_cast<double>(d));
        for (std::int64_t i = 0; i < d; ++i) {
          const T xhat = xr[i] * rs[r];
          const T v = rs[r] * (gr[i] * (ws[i] + off) - xhat * mean);
          dxs[r * d + i] = accumulate_dx ? res[r * d + i] + v : v;
          if (dxa != nullptr) dxa[r * d + i] = dxs[r * d + i];
        }
      }
    });
    // dw_i += sum_r dy[r,i] x[r,i] rstd[r]
    column_sums_weighted(mat(dy, M, d), mat(x, M, d), rstd.data(), dw.span());
  }

  /// RMSNorm of activations, row by row: y = x * rstd * w over rows of x[M, d] (Qwen3's q_norm
  /// and k_norm, with x the projection viewed as [tokens * heads, head_dim]); rstd saved.
  void head_rmsnorm(View<const Act> x, View<const Weight> w, double eps, View<Act> y, View<Acc> rstd, double offset = 0.0) {
    rmsnorm(x, w, eps, y, rstd, offset);
  }
  /// Its backward: dx (overwritten) from dy, dw += the gain's gradient; from the saved rstd.
  void head_rmsnorm_backward(View<const Act> x, View<const Weight> w, View<const Acc> rstd, View<const Act> dy, View<Act> dx,
                             View<Acc> dw, double offset = 0.0) {
    rmsnorm_backward(x, w, rstd, dy, View<const Res>{}, dx, View<Act>{}, dw, offset);
  }

  /// y = x: residual-stream values as activations (a copy here; a rounding where they differ).
  void convert(View<const Res> x, View<Act> y) { copy(x, y); }

  // ---- rotary position embedding -----------------------------------------------------------
  /// Rotates each head of x[M, heads*head_dim] in place, Hugging Face's rotate-half convention over
  /// the first D = 2 * inv_freq.size() dimensions of a head (all of them unless the rotary is
  /// partial; the others pass through):
  /// for i < D/2, (x_i, x_{i+D/2}) -> (x_i c - x_{i+D/2} s, x_{i+D/2} c + x_i s), angle p * inv_freq[i]
  /// at position p = token % seq, or p = positions[token] where positions are given (packed rows);
  /// cos and sin times `scale` (yarn's attention factor; 1 otherwise).
  void rope(View<Act> x, std::int64_t heads, std::int64_t seq, std::span<const double> inv_freq,
            View<const std::int32_t> positions = {}, double scale = 1.0) {
    rotate(x, heads, seq, inv_freq, positions, +1, scale);
  }
  /// The transpose of that (scaled) rotation, applied to a gradient in place.
  void rope_backward(View<Act> dx, std::int64_t heads, std::int64_t seq, std::span<const double> inv_freq,
                     View<const std::int32_t> positions = {}, double scale = 1.0) {
    rotate(dx, heads, seq, inv_freq, positions, -1, scale);
  }

  // ---- attention -----------------------------------------------------------------------------
  /// Causal grouped-query attention over a chunk. q, out: [M, H*D]; k, v: [M, Hkv*D];
  /// lse: [rows, H, seq] keeps the log-sum-exp of each query's scaled scores. Query head h reads
  /// key/value head h / (H / Hkv). Scores and probabilities are formed for blocks of kQueryBlock
  /// queries against the keys they see ([block, keys] matrices), so memory grows linearly with
  /// the sequence: a reference, not a fast kernel. Packed rows (s.packed): query i sees keys
  /// i - positions[i] .. i, those of its own sequence; a window (s.window) keeps the last
  /// s.window of them. Scores are scaled by s.softmax_scale(). `sinks` (GPT-OSS; else null): one
  /// logit per query head, unscaled, that joins every query's softmax and carries no value (its
  /// probability is left out of the output; lse counts it).
  void attention(View<const Act> q, View<const Act> k, View<const Act> v, View<Act> out, View<Acc> lse,
                 const AttentionShape& s, View<const Acc> sinks = {}) {
    check_attention(q, k, v, out, lse, s);
    check_sinks(sinks, s, "attention");
    const std::int64_t H = s.heads, G = s.heads / s.kv_heads, S = s.seq;
    const std::int64_t blocks = (S + kQueryBlock - 1) / kQueryBlock;
    const T scale = static_cast<T>(s.softmax_scale());
    tbb::parallel_for(tbb::blocked_range<std::int64_t>(0, s.rows * H * blocks), [&](const auto& r) {
      Matrix P;
      for (std::int64_t task = r.begin(); task != r.end(); ++task) {
        const std::int64_t row = task / (H * blocks), h = task / blocks % H, b = task % blocks, kh = h / G;
        const std::int64_t i0 = b * kQueryBlock, n = std::min(kQueryBlock, S - i0), j0 = first_key(s, row, i0);
        const std::int64_t keys = i0 + n - j0;  // the keys any query of the block sees
        const auto Q = head(q, row, h, s, H).middleRows(i0, n);
        const auto K = head(k, row, kh, s, s.kv_heads).middleRows(j0, keys);
        const auto V = head(v, row, kh, s, s.kv_heads).middleRows(j0, keys);
        P.noalias() = (Q * K.transpose()) * scale;
        T* l = lse.data() + (row * H + h) * S;
        for (std::int64_t qi = 0; qi < n; ++qi) {
          const std::int64_t i = i0 + qi, lo = first_key(s, row, i) - j0, hi = i - j0;  // [lo, hi] of P's columns
          T mx = P.row(qi).segment(lo, hi + 1 - lo).maxCoeff();
          if (!sinks.is_null()) mx = std::max(mx, sinks.data()[h]);
          double sum = sinks.is_null() ? 0.0 : static_cast<double>(std::exp(sinks.data()[h] - mx));
          for (std::int64_t j = lo; j <= hi; ++j) sum += (P(qi, j) = std::exp(P(qi, j) - mx));
          for (std::int64_t j = lo; j <= hi; ++j) P(qi, j) = static_cast<T>(P(qi, j) / sum);
          P.row(qi).head(lo).setZero();                // another sequence of the row
          P.row(qi).tail(keys - hi - 1).setZero();     // causal mask
          l[i] = static_cast<T>(static_cast<double>(mx) + std::log(sum));
        }
        head(out, row, h, s, H).middleRows(i0, n).noalias() = P * V;
      }
    });
  }
  /// Gradients of attention: dq (overwritten), dk and dv (overwritten; each key/value head
  /// sums over its group of query heads, in head order, and over query blocks in order). With
  /// sinks, their gradient is added to dsinks: -sum over queries of p_sink * rowsum(dout * out),
  /// summed per sequence, then over sequences in order.
  void attention_backward(View<const Act> q, View<const Act> k, View<const Act> v, View<const Act> out,
                          View<const Acc> lse, View<const Act> dout, View<Act> dq, View<Act> dk, View<Act> dv,
                          const AttentionShape& s, View<const Acc> sinks = {}, View<Acc> dsinks = {}) {
    check_attention(q, k, v, out, lse, s);
    check_sinks(sinks, s, "attention_backward");
    MT_CHECK(sinks.is_null() == dsinks.is_null() && (dsinks.is_null() || dsinks.numel() == s.heads),
             "attention_backward: sinks and their gradient come together ([{}] each)", s.heads);
    // (each sequence's and head's share of the sinks' gradient, summed in order afterwards)
    std::vector<double> dsink_parts(sinks.is_null() ? 0 : static_cast<std::size_t>(s.rows * s.heads), 0.0);
    check_same(dq.shape(), q.shape(), "attention_backward dq");
    check_same(dk.shape(), k.shape(), "attention_backward dk");
    check_same(dv.shape(), v.shape(), "attention_backward dv");
    const std::int64_t H = s.heads, G = s.heads / s.kv_heads, S = s.seq;
    const T scale = static_cast<T>(s.softmax_scale());
    // One task per (sequence, kv head): it owns dk and dv of that head, so nothing races.
    tbb::parallel_for(tbb::blocked_range<std::int64_t>(0, s.rows * s.kv_heads), [&](const auto& r) {
      Matrix P, dP;
      Eigen::Matrix<T, Eigen::Dynamic, 1> delta;
      for (std::int64_t rk = r.begin(); rk != r.end(); ++rk) {
        const std::int64_t row = rk / s.kv_heads, kh = rk % s.kv_heads;
        const auto K = head(k, row, kh, s, s.kv_heads), V = head(v, row, kh, s, s.kv_heads);
        auto dK = head(dk, row, kh, s, s.kv_heads);
        auto dV = head(dv, row, kh, s, s.kv_heads);
        dK.setZero();
        dV.setZero();
        for (std::int64_t h = kh * G; h < (kh + 1) * G; ++h) {
          const T* l = lse.data() + (row * H + h) * S;
          for (std::int64_t i0 = 0; i0 < S; i0 += kQueryBlock) {
            const std::int64_t n = std::min(kQueryBlock, S - i0), j0 = first_key(s, row, i0), keys = i0 + n - j0;
            const auto Q = head(q, row, h, s, H).middleRows(i0, n), O = head(out, row, h, s, H).middleRows(i0, n),
                       dO = head(dout, row, h, s, H).middleRows(i0, n);
            const auto Kb = K.middleRows(j0, keys), Vb = V.middleRows(j0, keys);
            P.noalias() = (Q * Kb.transpose()) * scale;  // recompute probabilities from the saved lse
            for (std::int64_t qi = 0; qi < n; ++qi) {
              const std::int64_t i = i0 + qi, lo = first_key(s, row, i) - j0, hi = i - j0;
              for (std::int64_t j = lo; j <= hi; ++j) P(qi, j) = std::exp(P(qi, j) - l[i]);
              P.row(qi).head(lo).setZero();
              P.row(qi).tail(keys - hi - 1).setZero();
            }
            delta.noalias() = (dO.cwiseProduct(O)).rowwise().sum();  // rowsum(dO * O)
            if (!sinks.is_null()) {  // d sink = sum_i p_sink(i) * (0 - delta_i): it carries no value
              double& part = dsink_parts[static_cast<std::size_t>(row * H + h)];
              for (std::int64_t qi = 0; qi < n; ++qi)
                part -= static_cast<double>(std::exp(sinks.data()[h] - l[i0 + qi])) * static_cast<double>(delta(qi));
            }
            dV.middleRows(j0, keys).noalias() += P.transpose() * dO;
            dP.noalias() = dO * Vb.transpose();
            dP = (P.array() * (dP.colwise() - delta).array()).matrix() * scale;  // dS, scaled
            head(dq, row, h, s, H).middleRows(i0, n).noalias() = dP * Kb;
            dK.middleRows(j0, keys).noalias() += dP.transpose() * Q;
          }
        }
      }
    });
    for (std::int64_t h = 0; h < s.heads && !sinks.is_null(); ++h) {
      double sum = 0;
      for (std::int64_t row = 0; row < s.rows; ++row) sum += dsink_parts[static_cast<std::size_t>(row * H + h)];
      dsinks.data()[h] += static_cast<Acc>(sum);
    }
  }

  /// Attention of one new token a row over its cache (ChunkShape::decode; cpu/attention_decode.hpp).
  void attention_decode(View<const Act> q, View<const Act> k, View<const Act> v, View<Act> kcache, View<Act> vcache,
                        const DecodeRows& d, View<Act> out, const AttentionShape& s, View<const Acc> sinks = {}) {
    cpu::attention_decode<T, T>(q, k, v, kcache, vcache, d, out, s, sinks);
  }

  // ---- SwiGLU and GeGLU --------------------------------------------------------------------
  /// m = act(g) * u: silu(g) (SwiGLU), or GELU's tanh approximation (GeGLU, Gemma's
  /// gelu_pytorch_tanh: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))))
  void swiglu(View<const Act> g, View<const Act> u, View<Act> m, Activation act = Activation::silu) {
    check_same(g.shape(), u.shape(), "swiglu");
    check_same(g.shape(), m.shape(), "swiglu");
    auto gs = g.span();
    auto us = u.span();
    auto ms = m.span();
    parallel_rows(static_cast<std::int64_t>(gs.size()), 1 << 14, [&](std::int64_t b, std::int64_t e) {
      if (act == Activation::gelu_tanh)
        for (std::int64_t i = b; i < e; ++i) ms[i] = gelu_tanh(gs[i]) * us[i];
      else if (act == Activation::clamped_swiglu)
        for (std::int64_t i = b; i < e; ++i) ms[i] = clamped_swiglu(gs[i], us[i]);
      else
        for (std::int64_t i = b; i < e; ++i) ms[i] = gs[i] * sigmoid(gs[i]) * us[i];
    });
  }
  /// dg and du from dm; with `m` (else null), also the forward's m = act(g) * u, the same bits as
  /// swiglu() (the backward of a kept or recomputed MLP makes it here instead of in a pass of its own).
  void swiglu_backward(View<const Act> g, View<const Act> u, View<const Act> dm, View<Act> dg, View<Act> du,
                       Activation act = Activation::silu, View<Act> m = {}) {
    check_same(g.shape(), dm.shape(), "swiglu_backward");
    if (!m.is_null()) check_same(g.shape(), m.shape(), "swiglu_backward m");
    auto gs = g.span();
    auto us = u.span();
    auto dms = dm.span();
    auto dgs = dg.span();
    auto dus = du.span();
    T* ms = m.is_null() ? nullptr : m.data();
    const bool gelu = act == Activation::gelu_tanh;
    parallel_rows(static_cast<std::int64_t>(gs.size()), 1 << 14, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) {
        if (act == Activation::clamped_swiglu) {  // m = (u' + 1) g' sigmoid(alpha g'), clamps as transformers'
          const T lim = static_cast<T>(kClampedSwigluLimit), alpha = static_cast<T>(kClampedSwigluAlpha);
          const T gc = std::min(gs[i], lim), uc = std::clamp(us[i], -lim, lim);
          const T sg = sigmoid(alpha * gc), glu = gc * sg;
          if (ms) ms[i] = (uc + T(1)) * glu;
          dus[i] = us[i] >= -lim && us[i] <= lim ? dms[i] * glu : T(0);
          dgs[i] = gs[i] <= lim ? dms[i] * (uc + T(1)) * sg * (T(1) + alpha * gc * (T(1) - sg)) : T(0);
          continue;
        }
        if (gelu) {  // du = dm act(g), dg = dm u act'(g)
          const T a = gelu_tanh(gs[i]);
          if (ms) ms[i] = a * us[i];
          dus[i] = dms[i] * a;
          dgs[i] = dms[i] * us[i] * gelu_tanh_grad(gs[i]);
          continue;
        }
        const T sg = sigmoid(gs[i]);
        if (ms) ms[i] = gs[i] * sg * us[i];
        dus[i] = dms[i] * gs[i] * sg;
        dgs[i] = dms[i] * us[i] * sg * (T(1) + gs[i] * (T(1) - sg));
      }
    });
  }

  // ---- linear attention (GatedDeltaNet) -------------------------------------------------------
  /// Gated DeltaNet's mixing and its backward (cpu/gated_deltanet_mix.hpp states them).
  void gated_deltanet_mix(const cpu::GatedDeltaNetMix<T>& m, T* o, T* rstd, T* y) { cpu::gated_deltanet_mix(m, o, rstd, y); }
  void gated_deltanet_mix_backward(const cpu::GatedDeltaNetMix<T>& m, const T* o, const T* rstd, const T* dy,
                                   const cpu::GatedDeltaNetMixGrads<T>& g) {
    cpu::gated_deltanet_mix_backward(m, o, rstd, dy, g);
  }
  /// Its step for one new token a row, over the rows' caches (cpu/gated_deltanet_decode.hpp).
  void gated_deltanet_decode(const cpu::GatedDeltaNetMix<T>& m, const DecodeRows& d, T* taps, T* state, T* y) {
    cpu::gated_deltanet_decode(m, d.host_positions, d.first, taps, state, y);
  }

  // ---- mixture of experts (MoeMlp) -----------------------------------------------------------
  /// The routing of M tokens over E experts: probs = softmax(logits) by row (in Acc); experts[t]
  /// the k most probable, in descending order (the lower index first among equals, as a stable
  /// top-k), weights[t] their probabilities, divided by their sum where `renormalize`. The M * k
  /// assignments (a = t * k + j) grouped by expert, stably: order[r] is row r's assignment and
  /// slot[a] its row; expert e's rows are [offsets[e], offsets[e + 1]).
  void moe_route(View<const Act> logits, std::int64_t k, bool renormalize, View<Acc> probs, View<std::int32_t> experts,
                 View<Acc> weights, View<std::int32_t> order, View<std::int32_t> slot, View<std::int64_t> offsets) {
    MT_CHECK(logits.rank() == 2, "moe_route: logits {} must be [tokens, experts]", logits.shape().str());
    const std::int64_t M = logits.size(0), E = logits.size(1), N = M * k;
    MT_CHECK(k >= 1 && k <= E && probs.shape() == logits.shape() && experts.numel() == N && weights.numel() == N &&
                 order.numel() == N && slot.numel() == N && offsets.numel() == E + 1,
             "moe_route: {} tokens over {} experts, top {}: buffers probs {}, experts {}, weights {}, order {}, slot {}, "
             "offsets {}", M, E, k, probs.shape().str(), experts.shape().str(), weights.shape().str(),
             order.shape().str(), slot.shape().str(), offsets.shape().str());
    const Act* lg = logits.data();
    Acc* p = probs.data();
    std::int32_t* ex = experts.data();
    Acc* w = weights.data();
    parallel_rows(M, 64, [&](std::int64_t b, std::int64_t e) {
      std::vector<std::int32_t> idx(static_cast<std::size_t>(E));
      for (std::int64_t t = b; t < e; ++t) {
        const Act* l = lg + t * E;
        Acc* pt = p + t * E;
        Acc mx = static_cast<Acc>(l[0]);
        for (std::int64_t i = 1; i < E; ++i) mx = std::max(mx, static_cast<Acc>(l[i]));
        Acc sum = 0;
        for (std::int64_t i = 0; i < E; ++i) sum += (pt[i] = std::exp(static_cast<Acc>(l[i]) - mx));
        for (std::int64_t i = 0; i < E; ++i) pt[i] /= sum;
        std::iota(idx.begin(), idx.end(), 0);
        std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                          [&](std::int32_t x, std::int32_t y) { return pt[x] > pt[y] || (pt[x] == pt[y] && x < y); });
        Acc chosen = 0;
        for (std::int64_t j = 0; j < k; ++j) chosen += pt[idx[static_cast<std::size_t>(j)]];
        for (std::int64_t j = 0; j < k; ++j) {
          const std::int32_t x = idx[static_cast<std::size_t>(j)];
          ex[t * k + j] = x;
          w[t * k + j] = renormalize ? pt[x] / chosen : pt[x];
        }
      }
    });
    std::int64_t* off = offsets.data();
    std::fill(off, off + E + 1, std::int64_t{0});
    for (std::int64_t a = 0; a < N; ++a) ++off[ex[a] + 1];
    for (std::int64_t i = 0; i < E; ++i) off[i + 1] += off[i];
    std::vector<std::int64_t> next(off, off + E);
    for (std::int64_t a = 0; a < N; ++a) {
      const std::int64_t r = next[static_cast<std::size_t>(ex[a])]++;
      order.data()[r] = static_cast<std::int32_t>(a);
      slot.data()[a] = static_cast<std::int32_t>(r);
    }
  }
  /// xs[r] = x[order[r] / k]: each expert's rows, grouped.
  void moe_gather(View<const Act> x, View<const std::int32_t> order, std::int64_t k, View<Act> xs) {
    const std::int64_t N = order.numel(), d = x.size(1);
    MT_CHECK(xs.rank() == 2 && xs.size(0) == N && xs.size(1) == d && N == x.size(0) * k, "moe_gather: {} rows of {} into {}",
             N, x.shape().str(), xs.shape().str());
    parallel_rows(N, 64, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t r = b; r < e; ++r)
        std::copy_n(x.data() + order.data()[r] / k * d, d, xs.data() + r * d);
    });
  }
  /// y[rows of e] = x[rows of e] w[e]^T for each expert e (offsets as moe_route's).
  /// `bias` (GPT-OSS; else empty): each expert's bias, added to its rows.
  void grouped_linear(View<const Act> x, std::span<const View<const Weight>> w, View<const std::int64_t> offsets,
                      View<Act> y, std::span<const View<const Weight>> bias = {}) {
    check_groups(x, w.size(), offsets, "grouped_linear");
    MT_CHECK(bias.empty() || bias.size() == w.size(), "grouped_linear: {} biases for {} experts", bias.size(), w.size());
    for (std::size_t e = 0; e < w.size(); ++e) {
      const std::int64_t r0 = offsets.data()[e], n = offsets.data()[e + 1] - r0;
      if (n > 0) linear(token_rows(x, r0, n), w[e], bias.empty() ? View<const Weight>{} : bias[e], token_rows(y, r0, n));
    }
  }
  /// linear_backward for each expert's rows: dx (or dx += where accumulate_dx), dw[e] += dy^T x,
  /// and with `dbias`, dbias[e] += the column sums of its rows of dy.
  void grouped_linear_backward(View<const Act> x, std::span<const View<const Weight>> w, View<const Act> dy, View<Act> dx,
                               bool accumulate_dx, std::span<const View<Acc>> dw, View<const std::int64_t> offsets,
                               std::span<const View<Acc>> dbias = {}) {
    check_groups(x, w.size(), offsets, "grouped_linear_backward");
    MT_CHECK(dw.size() == w.size(), "grouped_linear_backward: {} gradients for {} experts", dw.size(), w.size());
    MT_CHECK(dbias.empty() || dbias.size() == w.size(), "grouped_linear_backward: {} bias gradients for {} experts",
             dbias.size(), w.size());
    for (std::size_t e = 0; e < w.size(); ++e) {
      const std::int64_t r0 = offsets.data()[e], n = offsets.data()[e + 1] - r0;
      if (n > 0)
        linear_backward(token_rows(x, r0, n), w[e], token_rows(dy, r0, n), token_rows(dx, r0, n), accumulate_dx, dw[e],
                        dbias.empty() ? View<Acc>{} : dbias[e]);
    }
  }
  /// y[t] = h[t] + sum of weights[t, j] * out[slot[t, j]], the experts taken in increasing index
  /// (as transformers adds them); y may be h.
  void moe_combine(View<const Act> out, View<const std::int32_t> slot, View<const Acc> weights, std::int64_t k,
                   View<const Res> h, View<Res> y) {
    const std::int64_t M = h.size(0), d = h.size(1);
    MT_CHECK(slot.numel() == M * k && weights.numel() == M * k && out.size(1) == d && y.shape() == h.shape(),
             "moe_combine: {} tokens, top {}: out {}, y {}", M, k, out.shape().str(), y.shape().str());
    parallel_rows(M, 16, [&](std::int64_t b, std::int64_t e) {
      std::vector<std::int64_t> js(static_cast<std::size_t>(k));
      std::vector<Res> s(static_cast<std::size_t>(d));
      for (std::int64_t t = b; t < e; ++t) {
        by_row(slot, t, k, js);
        std::fill(s.begin(), s.end(), Res(0));
        for (const std::int64_t j : js) {
          const Act* o = out.data() + slot.data()[t * k + j] * d;
          const Acc wj = weights.data()[t * k + j];
          for (std::int64_t c = 0; c < d; ++c) s[static_cast<std::size_t>(c)] += static_cast<Res>(o[c] * wj);
        }
        for (std::int64_t c = 0; c < d; ++c) y.data()[t * d + c] = h.data()[t * d + c] + s[static_cast<std::size_t>(c)];
      }
    });
  }
  /// The backward of moe_combine's sum: dout[slot[t, j]] = weights[t, j] * dy[t] and
  /// dweights[t, j] = <dy[t], out[slot[t, j]]>.
  void moe_combine_backward(View<const Act> dy, View<const Act> out, View<const std::int32_t> slot, View<const Acc> weights,
                            std::int64_t k, View<Act> dout, View<Acc> dweights) {
    const std::int64_t M = dy.size(0), d = dy.size(1);
    MT_CHECK(slot.numel() == M * k && dweights.numel() == M * k && dout.shape() == out.shape(),
             "moe_combine_backward: {} tokens, top {}: out {}, dout {}", M, k, out.shape().str(), dout.shape().str());
    parallel_rows(M, 16, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t t = b; t < e; ++t)
        for (std::int64_t j = 0; j < k; ++j) {
          const std::int64_t r = slot.data()[t * k + j];
          const Act* g = dy.data() + t * d;
          const Act* o = out.data() + r * d;
          const Acc wj = weights.data()[t * k + j];
          Acc dot = 0;
          for (std::int64_t c = 0; c < d; ++c) {
            dout.data()[r * d + c] = static_cast<Act>(g[c] * wj);
            dot += static_cast<Acc>(g[c]) * static_cast<Acc>(o[c]);
          }
          dweights.data()[t * k + j] = dot;
        }
    });
  }
  /// A layer's routing statistics (RouterStats): counts[e] += expert e's rows (offsets as
  /// moe_route's), prob_sums[e] += the sum over tokens of probs[t, e] (in token order, double).
  /// With `valid` ([T], not null) only the tokens it flags count: their assignments (experts
  /// [T, k], moe_route's) and their probabilities.
  void moe_record(View<const Acc> probs, View<const std::int32_t> experts, View<const std::int64_t> offsets,
                  View<const std::uint8_t> valid, View<std::int64_t> counts, View<double> prob_sums) {
    const std::int64_t M = probs.size(0), E = probs.size(1);
    MT_CHECK(offsets.numel() == E + 1 && counts.numel() == E && prob_sums.numel() == E &&
                 (valid.is_null() || (valid.numel() == M && experts.numel() % std::max<std::int64_t>(M, 1) == 0)),
             "moe_record: probs {}, experts {}, offsets {}, valid {}, counts {}, sums {}", probs.shape().str(),
             experts.shape().str(), offsets.shape().str(), valid.shape().str(), counts.shape().str(), prob_sums.shape().str());
    const auto counted = [&](std::int64_t t) { return valid.is_null() || valid.data()[t] != 0; };
    for (std::int64_t e = 0; e < E; ++e) {
      double s = 0;
      for (std::int64_t t = 0; t < M; ++t)
        if (counted(t)) s += static_cast<double>(probs.data()[t * E + e]);
      prob_sums.data()[e] += s;
      if (valid.is_null()) counts.data()[e] += offsets.data()[e + 1] - offsets.data()[e];
    }
    if (!valid.is_null()) {
      const std::int64_t k = M > 0 ? experts.numel() / M : 0;
      for (std::int64_t t = 0; t < M; ++t)
        if (counted(t))
          for (std::int64_t j = 0; j < k; ++j) ++counts.data()[experts.data()[t * k + j]];
    }
  }
  /// dlogits from the routing weights' gradient: through the renormalisation (where the family
  /// has it) and the softmax; the experts not chosen get only the softmax's share. `aux_counts`
  /// [layers, E] (not null): the auxiliary load-balancing loss adds aux_scale x the counts of
  /// expert i summed over the layers to every token's dp_i (with `valid`, to the tokens it flags).
  void moe_route_backward(View<const Acc> probs, View<const std::int32_t> experts, View<const Acc> weights,
                          View<const Acc> dweights, std::int64_t k, bool renormalize, View<const std::int64_t> aux_counts,
                          double aux_scale, View<const std::uint8_t> valid, View<Act> dlogits) {
    const std::int64_t M = probs.size(0), E = probs.size(1);
    MT_CHECK(dlogits.shape() == probs.shape() && experts.numel() == M * k && dweights.numel() == M * k &&
                 (valid.is_null() || valid.numel() == M),
             "moe_route_backward: probs {}, dlogits {}, top {}, valid {}", probs.shape().str(), dlogits.shape().str(), k,
             valid.shape().str());
    MT_CHECK(aux_counts.is_null() || (aux_counts.numel() > 0 && aux_counts.numel() % E == 0),
             "moe_route_backward: auxiliary counts {} for {} experts", aux_counts.shape().str(), E);
    std::vector<Acc> aux(static_cast<std::size_t>(E), Acc(0));  // the auxiliary loss's dp, the same for every token
    if (!aux_counts.is_null())
      for (std::int64_t i = 0; i < E; ++i) {
        std::int64_t c = 0;
        for (std::int64_t l = 0; l < aux_counts.numel() / E; ++l) c += aux_counts.data()[l * E + i];
        aux[static_cast<std::size_t>(i)] = static_cast<Acc>(aux_scale * static_cast<double>(c));
      }
    parallel_rows(M, 64, [&](std::int64_t b, std::int64_t e) {
      std::vector<Acc> dp(static_cast<std::size_t>(E));
      for (std::int64_t t = b; t < e; ++t) {
        const Acc* p = probs.data() + t * E;
        const std::int32_t* ex = experts.data() + t * k;
        const Acc* w = weights.data() + t * k;
        const Acc* dw = dweights.data() + t * k;
        if (valid.is_null() || valid.data()[t] != 0) std::copy(aux.begin(), aux.end(), dp.begin());
        else std::fill(dp.begin(), dp.end(), Acc(0));
        if (renormalize) {  // w_j = p_j / S: dp_j = (dw_j - sum_i dw_i w_i) / S
          Acc chosen = 0, dot = 0;
          for (std::int64_t j = 0; j < k; ++j) {
            chosen += p[ex[j]];
            dot += dw[j] * w[j];
          }
          for (std::int64_t j = 0; j < k; ++j) dp[static_cast<std::size_t>(ex[j])] += (dw[j] - dot) / chosen;
        } else {
          for (std::int64_t j = 0; j < k; ++j) dp[static_cast<std::size_t>(ex[j])] += dw[j];
        }
        Acc dot = 0;  // softmax: dlogit_i = p_i (dp_i - sum_j p_j dp_j)
        for (std::int64_t i = 0; i < E; ++i) dot += p[i] * dp[static_cast<std::size_t>(i)];
        for (std::int64_t i = 0; i < E; ++i) dlogits.data()[t * E + i] = static_cast<Act>(p[i] * (dp[static_cast<std::size_t>(i)] - dot));
      }
    });
  }
  /// dx[t] += the sum of dxs[slot[t, j]] over its k experts.
  void moe_scatter_add(View<const Act> dxs, View<const std::int32_t> slot, std::int64_t k, View<Act> dx) {
    const std::int64_t M = dx.size(0), d = dx.size(1);
    MT_CHECK(slot.numel() == M * k && dxs.size(0) == M * k && dxs.size(1) == d, "moe_scatter_add: {} rows into {}",
             dxs.shape().str(), dx.shape().str());
    parallel_rows(M, 16, [&](std::int64_t b, std::int64_t e) {
      std::vector<std::int64_t> js(static_cast<std::size_t>(k));
      for (std::int64_t t = b; t < e; ++t) {
        by_row(slot, t, k, js);
        for (const std::int64_t j : js) {
          const Act* s = dxs.data() + slot.data()[t * k + j] * d;
          for (std::int64_t c = 0; c < d; ++c) dx.data()[t * d + c] += s[c];
        }
      }
    });
  }

  // ---- embedding -----------------------------------------------------------------------------
  /// y[t] = table[ids[t]]
  /// y[t] = table[ids[t]] * scale (Gemma's sqrt(hidden); 1 elsewhere)
  template <class U>  // Weight, or float (fp32 master rows)
  void embedding(View<const std::int32_t> ids, View<const U> table, View<Act> y, double scale = 1.0) {
    const std::int64_t M = ids.numel(), V = table.size(0), d = table.size(1);
    MT_CHECK(y.size(0) == M && y.size(1) == d, "embedding: output {} does not match {} tokens x {}", y.shape().str(), M, d);
    for (std::int64_t t = 0; t < M; ++t)
      MT_CHECK(ids.data()[t] >= 0 && ids.data()[t] < V, "token id {} at position {} is outside the vocabulary [0, {})",
               ids.data()[t], t, V);
    const T s = static_cast<T>(scale);
    parallel_rows(M, 64, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t t = b; t < e; ++t)
        for (std::int64_t c = 0; c < d; ++c)
          y.data()[t * d + c] = static_cast<T>(table.data()[static_cast<std::int64_t>(ids.data()[t]) * d + c]) * s;
    });
  }
  /// dtable[ids[t]] += dy[t] * scale, except for tokens whose id is `skip_id` (PyTorch's
  /// padding_idx: that row gets no gradient from the lookup; -1: none)
  void embedding_backward(View<const std::int32_t> ids, View<const Act> dy, View<Acc> dtable, std::int32_t skip_id = -1,
                          double scale = 1.0) {
    const std::int64_t M = ids.numel(), d = dtable.size(1);
    const T s = static_cast<T>(scale);
    // Split the feature dimension: each task owns a column range, so repeated ids never race
    // and every element is summed in token order.
    parallel_rows(d, 64, [&](std::int64_t c0, std::int64_t c1) {
      for (std::int64_t t = 0; t < M; ++t) {
        if (ids.data()[t] == skip_id) continue;
        T* row = dtable.data() + static_cast<std::int64_t>(ids.data()[t]) * d;
        const T* g = dy.data() + t * d;
        for (std::int64_t c = c0; c < c1; ++c) row[c] += g[c] * s;
      }
    });
  }

  /// out[i] = table[rows[i]], then table[rows[i]] = 0: moves rows of a gradient table into a
  /// compact one. Rows must be distinct and inside the table; out is [rows, d].
  void take_rows(View<const std::int32_t> rows, View<Acc> table, View<Acc> out) {
    const std::int64_t U = rows.numel(), V = table.size(0), d = table.size(1);
    MT_CHECK(out.size(0) == U && out.size(1) == d, "take_rows: output {} does not match {} rows x {}", out.shape().str(), U, d);
    for (std::int64_t i = 0; i < U; ++i)
      MT_CHECK(rows.data()[i] >= 0 && rows.data()[i] < V, "take_rows: row {} at position {} is outside [0, {})",
               rows.data()[i], i, V);
    parallel_rows(U, 64, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) {
        T* src = table.data() + static_cast<std::int64_t>(rows.data()[i]) * d;
        std::copy_n(src, d, out.data() + i * d);
        std::fill_n(src, d, T(0));
      }
    });
  }

  /// sum[0] = the sum of x's squared elements, in double (a gradient's contribution to the
  /// global norm), deterministic whatever the thread count.
  void sum_squares(View<const Acc> x, View<double> sum) {
    MT_CHECK(sum.numel() == 1, "sum_squares: the result is one element, not {}", sum.shape().str());
    sum.data()[0] = grad_sum_squares<T>(std::span<const T>(x.data(), static_cast<std::size_t>(x.numel())));
  }

  // ---- optimizer -----------------------------------------------------------------------------
  /// One AdamW step over the elements of p (optim/adamw.hpp's formula, the same code as the host
  /// optimizer, so the same bits): p, m, v updated in place from the gradient g, and w = the
  /// weights the ops read (here p itself, in T; w empty: none).
  void adamw(const AdamWScalars<float>& s, std::span<float> p, std::span<float> m, std::span<float> v, std::span<const Acc> g,
             std::span<Weight> w) {
    const std::size_t n = p.size();
    MT_CHECK(m.size() == n && v.size() == n && g.size() == n && (w.empty() || w.size() == n),
             "adamw: p {}, m {}, v {}, g {} and w {} elements differ", n, m.size(), v.size(), g.size(), w.size());
    const SimdLevel level = active_simd_level();
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, detail::kOptimBlock), [&](const auto& r) {
      const std::size_t o = r.begin(), k = r.size();
      std::vector<bf16> copy(k);  // (the host optimizer's bf16 copy; the ops here read T)
      if constexpr (std::is_same_v<T, float>) {
        detail::adamw_f32(level, s, p.data() + o, m.data() + o, v.data() + o, g.data() + o, copy.data(), k);
      } else {
        std::vector<float> gf(g.begin() + static_cast<std::ptrdiff_t>(o), g.begin() + static_cast<std::ptrdiff_t>(o + k));
        detail::adamw_f32(level, s, p.data() + o, m.data() + o, v.data() + o, gf.data(), copy.data(), k);
      }
      if (!w.empty())
        for (std::size_t i = o; i < o + k; ++i) w[i] = static_cast<T>(p[i]);
    });
  }

  // ---- LM head + cross-entropy ---------------------------------------------------------------
  /// Per-token loss of logits = h w^T against labels (-100: ignored, loss 0), computed in blocks
  /// of `logits_block` tokens so the full [M, vocab] logits never exist. Unless dh is null, also
  /// the backward of sum_t loss_scale * weight_t * loss_t (`token_weights` null: every weight 1):
  /// dh (overwritten) and dw (+=, unless null).
  void lm_head_loss(View<const Act> h, View<const Weight> w, View<const std::int32_t> labels, double loss_scale,
                    View<const Acc> token_weights, View<Acc> loss, View<Act> dh, View<Acc> dw) {
    const std::int64_t M = h.size(0), d = h.size(1), V = w.size(0);
    MT_CHECK(w.size(1) == d && labels.numel() == M && loss.numel() == M &&
                 (token_weights.is_null() || token_weights.numel() == M),
             "lm_head_loss: h {}, w {}, labels {}, token weights {}, loss {} do not agree", h.shape().str(), w.shape().str(),
             labels.shape().str(), token_weights.is_null() ? "none" : token_weights.shape().str(), loss.shape().str());
    for (std::int64_t t = 0; t < M; ++t) {
      const std::int32_t y = labels.data()[t];
      MT_CHECK(y == kIgnoreIndex || (y >= 0 && y < V), "label {} at position {} is outside the vocabulary [0, {})", y, t, V);
    }
    const bool backward = !dh.is_null();
    auto Hm = mat(h, M, d);
    auto W = mat(w, V, d);
    Matrix logits(std::min(logits_block, M), V);
    for (std::int64_t b = 0; b < M; b += logits_block) {
      const std::int64_t n = std::min(logits_block, M - b);
      auto Z = logits.topRows(n);
      parallel_rows(n, 8, [&](std::int64_t r0, std::int64_t r1) {
        Z.middleRows(r0, r1 - r0).noalias() = Hm.middleRows(b + r0, r1 - r0) * W.transpose();
        for (std::int64_t r = r0; r < r1; ++r) {
          const std::int32_t y = labels.data()[b + r];
          double mx = -std::numeric_limits<double>::infinity();
          for (std::int64_t c = 0; c < V; ++c) mx = std::max(mx, static_cast<double>(Z(r, c)));
          double sum = 0;
          for (std::int64_t c = 0; c < V; ++c) sum += std::exp(static_cast<double>(Z(r, c)) - mx);
          const double lse = mx + std::log(sum);
          loss.data()[b + r] = y == kIgnoreIndex ? T(0) : static_cast<T>(lse - static_cast<double>(Z(r, y)));
          if (!backward) continue;
          // dlogits = scale * (softmax - onehot), scale = loss_scale x the token's weight; ignored
          // tokens have no gradient.
          const double scale =
              token_weights.is_null() ? loss_scale : loss_scale * static_cast<double>(token_weights.data()[b + r]);
          for (std::int64_t c = 0; c < V; ++c)
            Z(r, c) = y == kIgnoreIndex ? T(0) : static_cast<T>(scale * std::exp(static_cast<double>(Z(r, c)) - lse));
          if (y != kIgnoreIndex) Z(r, y) -= static_cast<T>(scale);
        }
      });
      if (!backward) continue;
      auto DH = mat(dh, M, d);
      parallel_rows(n, 16, [&](std::int64_t r0, std::int64_t r1) {
        DH.middleRows(b + r0, r1 - r0).noalias() = Z.middleRows(r0, r1 - r0) * W;
      });
      if (!dw.is_null()) {
        auto DW = mat(dw, V, d);
        parallel_rows(V, 64, [&](std::int64_t v0, std::int64_t v1) {
          DW.middleRows(v0, v1 - v0).noalias() += Z.middleCols(v0, v1 - v0).transpose() * Hm.middleRows(b, n);
        });
      }
    }
  }
  /// The same with every token's weight 1.
  void lm_head_loss(View<const Act> h, View<const Weight> w, View<const std::int32_t> labels, double loss_scale,
                    View<Acc> loss, View<Act> dh, View<Acc> dw) {
    lm_head_loss(h, w, labels, loss_scale, View<const Acc>{}, loss, dh, dw);
  }

 private:
  std::shared_ptr<std::atomic<std::size_t>> allocated_ = std::make_shared<std::atomic<std::size_t>>(0);
  using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  static constexpr std::int64_t kQueryBlock = 64;  ///< queries per block of the reference attention
  using MapM = Eigen::Map<Matrix>;
  using MapCM = Eigen::Map<const Matrix>;

  static T sigmoid(T x) { return T(1) / (T(1) + std::exp(-x)); }
  /// GPT-OSS's clamped SwiGLU (Activation::clamped_swiglu), in transformers' order of operations.
  static T clamped_swiglu(T g, T u) {
    const T lim = static_cast<T>(kClampedSwigluLimit);
    const T gc = std::min(g, lim), uc = std::clamp(u, -lim, lim);
    return (uc + T(1)) * (gc * sigmoid(gc * static_cast<T>(kClampedSwigluAlpha)));
  }
  // GELU's tanh approximation (PyTorch's gelu(approximate="tanh")) and its derivative
  static constexpr double kGeluBeta = 0.7978845608028654;  // sqrt(2 / pi)
  static constexpr double kGeluKappa = 0.044715;
  static T gelu_tanh(T x) {
    return T(0.5) * x * (T(1) + std::tanh(T(kGeluBeta) * (x + T(kGeluKappa) * x * x * x)));
  }
  static T gelu_tanh_grad(T x) {
    const T t = std::tanh(T(kGeluBeta) * (x + T(kGeluKappa) * x * x * x));
    return T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * T(kGeluBeta) * (T(1) + T(3 * kGeluKappa) * x * x);
  }

  /// The [seq, D] block of head `h` of sequence `row` inside a [tokens, heads*D] activation.
  template <class E>
  static auto head(View<E> x, std::int64_t row, std::int64_t h, const AttentionShape& s, std::int64_t heads) {
    using Stride = Eigen::OuterStride<>;
    using M = std::conditional_t<std::is_const_v<E>, const Matrix, Matrix>;
    return Eigen::Map<M, Eigen::Unaligned, Stride>(x.data() + row * s.seq * heads * s.head_dim + h * s.head_dim, s.seq,
                                                    s.head_dim, Stride(heads * s.head_dim));
  }

  /// Token t's choices j in the order of their rows (that is, of their experts' indices).
  static void by_row(View<const std::int32_t> slot, std::int64_t t, std::int64_t k, std::vector<std::int64_t>& js) {
    std::iota(js.begin(), js.end(), std::int64_t{0});
    const std::int32_t* s = slot.data() + t * k;
    std::sort(js.begin(), js.end(), [&](std::int64_t a, std::int64_t b) { return s[a] < s[b]; });
  }
  static void check_groups(View<const Act> x, std::size_t experts, View<const std::int64_t> offsets, const char* what) {
    MT_CHECK(offsets.numel() == static_cast<std::int64_t>(experts) + 1 && offsets.data()[0] == 0 &&
                 offsets.data()[experts] == x.size(0),
             "{}: offsets for {} experts do not cover the {} rows of {}", what, experts, x.size(0), x.shape().str());
  }
  static void check_same(const Shape& a, const Shape& b, const char* what) {
    MT_CHECK(a == b, "{}: shapes {} and {} differ", what, a.str(), b.str());
  }
  template <class E>
  static auto mat(View<E> v, std::int64_t rows, std::int64_t cols) {
    MT_CHECK(v.numel() == rows * cols && v.is_contiguous(), "expected a contiguous [{}, {}] view, got {}", rows, cols,
             v.shape().str());
    if constexpr (std::is_const_v<E>) return MapCM(v.data(), rows, cols);
    else return MapM(v.data(), rows, cols);
  }
  static auto vec(View<const T> v, std::int64_t n) { return Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>>(v.data(), n); }

  struct LinearDims {
    std::int64_t M, K, N;
  };
  template <class Y>
  static LinearDims linear_dims(View<const Act> x, View<const Weight> w, Y y, View<const Weight> bias) {
    MT_CHECK(x.rank() == 2 && w.rank() == 2 && y.rank() == 2, "linear: x {}, w {}, y {} must be matrices", x.shape().str(),
             w.shape().str(), y.shape().str());
    const std::int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    MT_CHECK(w.size(1) == K && y.size(0) == M && y.size(1) == N, "linear: x {} . w {}^T does not give {}", x.shape().str(),
             w.shape().str(), y.shape().str());
    MT_CHECK(bias.is_null() || bias.numel() == N, "linear: bias {} does not match {} outputs", bias.shape().str(), N);
    return {M, K, N};
  }

  /// Runs f(begin, end) over [0, n) in fixed blocks of `grain`, in parallel. Blocks are fixed
  /// (simple_partitioner), so any per-block arithmetic is the same at every thread count.
  template <class F>
  static void parallel_rows(std::int64_t n, std::int64_t grain, F&& f) {
    tbb::parallel_for(tbb::blocked_range<std::int64_t>(0, n, grain),
                      [&](const tbb::blocked_range<std::int64_t>& r) { f(r.begin(), r.end()); },
                      tbb::simple_partitioner());
  }

  /// out[c] += sum_r m(r, c), summed in fixed row blocks added in order (thread-count independent).
  template <class M>
  static void column_sums(const M& m, std::span<T> out) {
    const std::int64_t rows = m.rows(), cols = m.cols(), block = 256;
    const std::int64_t nb = (rows + block - 1) / block;
    Matrix partial = Matrix::Zero(nb, cols);
    parallel_rows(nb, 1, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i)
        partial.row(i) = m.middleRows(i * block, std::min(block, rows - i * block)).colwise().sum();
    });
    for (std::int64_t i = 0; i < nb; ++i)
      for (std::int64_t c = 0; c < cols; ++c) out[static_cast<std::size_t>(c)] += partial(i, c);
  }
  /// out[c] += sum_r a(r, c) b(r, c) s[r], in fixed blocks.
  template <class A, class B>
  static void column_sums_weighted(const A& a, const B& b, const T* s, std::span<T> out) {
    const std::int64_t rows = a.rows(), cols = a.cols(), block = 256;
    const std::int64_t nb = (rows + block - 1) / block;
    Matrix partial = Matrix::Zero(nb, cols);
    parallel_rows(nb, 1, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t i = lo; i < hi; ++i)
        for (std::int64_t r = i * block; r < std::min(rows, (i + 1) * block); ++r)
          for (std::int64_t c = 0; c < cols; ++c) partial(i, c) += a(r, c) * b(r, c) * s[r];
    });
    for (std::int64_t i = 0; i < nb; ++i)
      for (std::int64_t c = 0; c < cols; ++c) out[static_cast<std::size_t>(c)] += partial(i, c);
  }

  /// The first key query i of row `row` sees: 0, or the start of its sequence in a packed row.
  /// The first key query i sees: its sequence's first token, and no earlier than the window.
  static std::int64_t first_key(const AttentionShape& s, std::int64_t row, std::int64_t i) {
    const std::int64_t f = s.packed.empty() ? 0 : i - s.packed.positions.data()[row * s.seq + i];
    return s.window > 0 ? std::max(f, i - s.window + 1) : f;
  }

  void rotate(View<Act> x, std::int64_t heads, std::int64_t seq, std::span<const double> inv_freq,
              View<const std::int32_t> positions, int sign, double scale) {
    // (a head's first 2 * half dimensions turn, the rest pass: partial rotary, Phi-4-mini)
    const std::int64_t M = x.size(0), half = static_cast<std::int64_t>(inv_freq.size());
    const std::int64_t D = heads > 0 && x.rank() == 2 ? x.size(1) / heads : 0;
    MT_CHECK(x.rank() == 2 && heads > 0 && x.size(1) == heads * D && 2 * half <= D && seq > 0 && M % seq == 0,
             "rope: x {} is not [tokens, {} heads x at least {}] with tokens a multiple of seq {}", x.shape().str(), heads,
             2 * half, seq);
    MT_CHECK(positions.is_null() || positions.numel() == M, "rope: {} positions for {} tokens", positions.numel(), M);
    parallel_rows(M, 64, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t t = b; t < e; ++t) {
        const double pos = static_cast<double>(positions.is_null() ? t % seq : positions.data()[t]);
        for (std::int64_t i = 0; i < half; ++i) {
          const double ang = pos * inv_freq[static_cast<std::size_t>(i)];
          const T c = static_cast<T>(scale * std::cos(ang)), sn = static_cast<T>(scale * sign * std::sin(ang));
          for (std::int64_t h = 0; h < heads; ++h) {
            T* p = x.data() + t * heads * D + h * D;
            const T a = p[i], bb = p[i + half];
            p[i] = a * c - bb * sn;
            p[i + half] = bb * c + a * sn;
          }
        }
      }
    });
  }

  static void check_sinks(View<const Acc> sinks, const AttentionShape& s, const char* what) {
    MT_CHECK(sinks.is_null() || sinks.numel() == s.heads, "{}: {} sinks for {} query heads", what, sinks.numel(), s.heads);
  }
  static void check_attention(View<const Act> q, View<const Act> k, View<const Act> v, View<const Act> out,
                              View<const Acc> lse, const AttentionShape& s) {
    s.validate();
    const std::int64_t M = s.rows * s.seq;
    MT_CHECK(q.numel() == M * s.heads * s.head_dim && out.numel() == q.numel() &&
                 k.numel() == M * s.kv_heads * s.head_dim && v.numel() == k.numel() && lse.numel() == s.rows * s.heads * s.seq,
             "attention: q {}, k {}, v {}, out {}, lse {} do not match {} rows x {} tokens, {}/{} heads of {}",
             q.shape().str(), k.shape().str(), v.shape().str(), out.shape().str(), lse.shape().str(), s.rows, s.seq,
             s.heads, s.kv_heads, s.head_dim);
  }
};

}  // namespace megatrain
