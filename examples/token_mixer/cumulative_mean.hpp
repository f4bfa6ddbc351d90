// A token mixer written as a user's own op: each token reads the mean of the values of the tokens
// before it (itself included), a mixer of linear cost in the sequence, the simplest kind of
// linear attention:
//
//     v_t   = v_proj(x_t)
//     m_t   = (v_1 + ... + v_t) / t                 within each sequence
//     out_t = o_proj(m_t)
//
// It has the phases a ComposedBlock drives (megatrain/layers/ops/mixers.hpp, docs/layers.md#mixers):
// project and out run a token block at a time through the backend's linear layers; mix and
// mix_backward run over whole sequences as plain loops over host views, so the mixer runs on
// backends whose memory is the host's (B::kDevice false). Which layers it mixes is its own rule
// (`builds`): the odd ones, here; a shipped mixer reads config.json's layer_types instead
// (ModelConfig::layer_kind).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "megatrain/layers/layer_op.hpp"
#include "megatrain/model/config.hpp"

namespace example {

using megatrain::Arena;
using megatrain::ChunkShape;
using megatrain::ParamBinder;
using megatrain::ParamSpec;
using megatrain::Shape;
using megatrain::View;
using megatrain::token_rows;

class CumulativeMean {
 public:
  CumulativeMean(const megatrain::ModelConfig& cfg, std::int64_t layer)
      : d_(cfg.hidden_size), std_(static_cast<float>(cfg.initializer_range)),
        prefix_("model.layers." + std::to_string(layer) + ".mean_mixer.") {}

  /// The layers it mixes: the odd ones (the others fall to the block's next token mixer).
  static bool builds(const megatrain::ModelConfig&, std::int64_t layer) { return layer % 2 == 1; }

  template <class E>
  struct Weights {
    View<E> v, o;
  };
  std::vector<ParamSpec> params() const {
    return {ParamSpec::matrix(prefix_ + "v_proj.weight", Shape{d_, d_}, std_),
            ParamSpec::matrix(prefix_ + "o_proj.weight", Shape{d_, d_}, std_)};
  }
  template <class E>
  Weights<E> bind(const ParamBinder<E>& p) const {
    return {p(prefix_ + "v_proj.weight"), p(prefix_ + "o_proj.weight")};
  }

  template <class B>
  struct Acts {
    View<typename B::Act> v, mean;  // the whole chunk's
    View<typename B::Act> dv, dmean;  // with_backward only
  };
  /// What the backward reads (v is not: only its gradient) comes from `kept` where given.
  template <class B>
  Acts<B> carve(Arena& ar, ChunkShape c, bool with_backward, Arena* kept) const {
    using A = typename B::Act;
    const std::int64_t M = c.tokens();
    Acts<B> a;
    a.v = ar.alloc<A>({M, d_});
    a.mean = (kept ? *kept : ar).template alloc<A>({M, d_});
    if (with_backward) {
      a.dv = ar.alloc<A>({M, d_});
      a.dmean = ar.alloc<A>({M, d_});
    }
    return a;
  }

  template <class B>
  void project(B& be, const Weights<const typename B::Weight>& w, View<const typename B::Act> x, const Acts<B>& a,
               std::int64_t first) const {
    be.linear(x, w.v, View<const typename B::Weight>{}, token_rows(a.v, first, x.size(0)));
  }
  /// m_t = the mean of v over the sequence's tokens up to t.
  template <class B>
    requires(!B::kDevice)
  void mix(B&, ChunkShape c, const Acts<B>& a, const Weights<const typename B::Weight>&) const {
    MT_CHECK(c.packed.empty(), "the cumulative mean mixer runs one sequence a row (no packed rows)");
    for (std::int64_t r = 0; r < c.rows; ++r)
      for (std::int64_t j = 0; j < d_; ++j) {
        double sum = 0;
        for (std::int64_t t = 0; t < c.seq; ++t) {
          const std::int64_t i = (r * c.seq + t) * d_ + j;
          sum += static_cast<double>(a.v.data()[i]);
          a.mean.data()[i] = static_cast<typename B::Act>(sum / static_cast<double>(t + 1));
        }
      }
  }
  template <class B>
  void out_add(B& be, const Weights<const typename B::Weight>& w, const Acts<B>& a, std::int64_t first,
               View<const typename B::Res> x, View<typename B::Res> h) const {
    be.linear_add(View<const typename B::Act>(token_rows(a.mean, first, x.size(0))), w.o, View<const typename B::Weight>{},
                  x, h);
  }
  template <class B>
  void out(B& be, const Weights<const typename B::Weight>& w, const Acts<B>& a, std::int64_t first,
           View<typename B::Act> o) const {
    be.linear(View<const typename B::Act>(token_rows(a.mean, first, o.size(0))), w.o, View<const typename B::Weight>{}, o);
  }
  template <class B>
  void out_backward(B& be, const Weights<const typename B::Weight>& w, const Acts<B>& a, std::int64_t first,
                    View<const typename B::Act> dout, const Weights<typename B::Acc>& g) const {
    const std::int64_t n = dout.size(0);
    be.linear_backward(View<const typename B::Act>(token_rows(a.mean, first, n)), w.o, dout, token_rows(a.dmean, first, n),
                       false, g.o, View<typename B::Acc>{});
  }
  /// dv_s = the sum over t >= s of dm_t / t (within the sequence).
  template <class B>
    requires(!B::kDevice)
  void mix_backward(B&, ChunkShape c, const Acts<B>& a, const Weights<const typename B::Weight>&,
                    const Weights<typename B::Acc>&) const {
    for (std::int64_t r = 0; r < c.rows; ++r)
      for (std::int64_t j = 0; j < d_; ++j) {
        double sum = 0;
        for (std::int64_t t = c.seq - 1; t >= 0; --t) {
          const std::int64_t i = (r * c.seq + t) * d_ + j;
          sum += static_cast<double>(a.dmean.data()[i]) / static_cast<double>(t + 1);
          a.dv.data()[i] = static_cast<typename B::Act>(sum);
        }
      }
  }
  template <class B>
  void project_backward(B& be, const Weights<const typename B::Weight>& w, View<const typename B::Act> x, const Acts<B>& a,
                        std::int64_t first, View<typename B::Act> dx, const Weights<typename B::Acc>& g) const {
    be.linear_backward(x, w.v, View<const typename B::Act>(token_rows(a.dv, first, x.size(0))), dx, false, g.v,
                       View<typename B::Acc>{});
  }

 private:
  std::int64_t d_;
  float std_;
  std::string prefix_;
};

}  // namespace example
