// The op concepts (layers/layer_op.hpp) accept the shipped ops and reject bad types, one bad
// type per requirement, each otherwise complete. Everything here is checked at compile time;
// the one test case runs a minimal op through LayerTemplate to show that the smallest thing
// the concept accepts is a working op. (That LayerTemplate<NotAnOp>, and a Trainer over a block
// without backward(), fail with a readable message is checked by compiling compile_fail/*.cpp;
// see CMakeLists.txt.)
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/layers/decoder_model.hpp"

using namespace megatrain;

namespace {

using F = CpuBackend<float>;
using D = CpuBackend<double>;

// ---- the shipped ops ----------------------------------------------------------------------

static_assert(Backend<F> && Backend<D>);
// The CPU backend is the fp32 reference unless asked for float64.
static_assert(std::is_same_v<CpuBackend<>, CpuBackend<float>>);
static_assert(std::is_same_v<CpuBackend<>::Act, float> && std::is_same_v<CpuBackend<>::Weight, float> &&
              std::is_same_v<CpuBackend<>::Acc, float>);
static_assert(ParamOp<DecoderBlock> && ParamOp<Embedding> && ParamOp<LmHead>);
static_assert(LayerOp<DecoderBlock, F> && LayerOp<DecoderBlock, D>);
static_assert(LayerOp<SelfAttention, F> && LayerOp<SelfAttention, D>);  // the block's parts are ops too
static_assert(LayerOp<SwiGluMlp, F> && LayerOp<SwiGluMlp, D>);
static_assert(EmbeddingOp<Embedding, F> && EmbeddingOp<Embedding, D>);
static_assert(HeadOp<LmHead, F> && HeadOp<LmHead, D>);
// Each satisfies its own contract only.
static_assert(!LayerOp<Embedding, F> && !HeadOp<Embedding, F>);
static_assert(!LayerOp<LmHead, F> && !EmbeddingOp<LmHead, F>);
static_assert(!EmbeddingOp<DecoderBlock, F> && !HeadOp<DecoderBlock, F>);

// ---- backends -----------------------------------------------------------------------------

struct NotABackend {  // element types, but no primitives
  using Act = float;
  using Weight = float;
  using Acc = float;
  static constexpr bool kDevice = false;
};
static_assert(!Backend<int>);
static_assert(!Backend<NotABackend>);
static_assert(!LayerOp<DecoderBlock, NotABackend>);  // a good op with a bad backend is no LayerOp

// ---- a good op, declared only (what the concept sees) ---------------------------------------

/// Everything ParamOp asks for; the LayerOp-level bad types below inherit it.
struct Params {
  template <class E>
  struct Weights {
    View<E> w;
  };
  std::vector<ParamSpec> params() const;
  template <class E>
  Weights<E> bind(const ParamBinder<E>&) const;
};

struct GoodOp : Params {
  std::int64_t hidden_size() const;
  template <class B>
  std::size_t scratch_bytes(ChunkShape) const;
  template <class B>
  void forward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
               View<typename B::Act>, Arena&) const;
  template <class B>
  void backward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act> x,
                View<const typename B::Act> dy, View<typename B::Act> dx, const Weights<typename B::Acc>& grads,
                Arena&) const;
};
static_assert(ParamOp<GoodOp>);
static_assert(LayerOp<GoodOp, F> && LayerOp<GoodOp, D>);

// ---- ParamOp: one bad type per requirement ------------------------------------------------

struct MissingParams {  // no params()
  template <class E>
  struct Weights {
    View<E> w;
  };
  template <class E>
  Weights<E> bind(const ParamBinder<E>&) const;
};
static_assert(!ParamOp<MissingParams>);

struct ParamsWrongType {  // params() returns names, not std::vector<ParamSpec>
  template <class E>
  struct Weights {
    View<E> w;
  };
  std::vector<std::string> params() const;
  template <class E>
  Weights<E> bind(const ParamBinder<E>&) const;
};
static_assert(!ParamOp<ParamsWrongType>);

struct ParamsNotConst {  // params() callable only on a mutable op
  template <class E>
  struct Weights {
    View<E> w;
  };
  std::vector<ParamSpec> params();
  template <class E>
  Weights<E> bind(const ParamBinder<E>&) const;
};
static_assert(!ParamOp<ParamsNotConst>);

struct MissingWeights {  // no Weights<E>: bind returns a plain list of views
  std::vector<ParamSpec> params() const;
  template <class E>
  std::vector<View<E>> bind(const ParamBinder<E>&) const;
};
static_assert(!ParamOp<MissingWeights>);

struct WeightsNotATemplate {  // Weights must take the element type: the same op binds weights and gradients
  struct Weights {
    View<float> w;
  };
  std::vector<ParamSpec> params() const;
  template <class E>
  Weights bind(const ParamBinder<E>&) const;
};
static_assert(!ParamOp<WeightsNotATemplate>);

struct MissingBind {  // no bind()
  template <class E>
  struct Weights {
    View<E> w;
  };
  std::vector<ParamSpec> params() const;
};
static_assert(!ParamOp<MissingBind>);

struct BindWrongType {  // bind() returns something other than Weights<E>
  template <class E>
  struct Weights {
    View<E> w;
  };
  std::vector<ParamSpec> params() const;
  template <class E>
  View<E> bind(const ParamBinder<E>&) const;
};
static_assert(!ParamOp<BindWrongType>);

// A type that is not a ParamOp is no LayerOp, EmbeddingOp or HeadOp either.
static_assert(!LayerOp<MissingParams, F> && !EmbeddingOp<MissingParams, F> && !HeadOp<MissingParams, F>);
static_assert(!LayerOp<MissingWeights, F> && !LayerOp<BindWrongType, F>);

// ---- LayerOp: one bad type per requirement (each is a good ParamOp) ------------------------

struct MissingHiddenSize : Params {
  template <class B>
  std::size_t scratch_bytes(ChunkShape) const;
  template <class B>
  void forward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
               View<typename B::Act>, Arena&) const;
  template <class B>
  void backward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
                View<const typename B::Act>, View<typename B::Act>, const Weights<typename B::Acc>&, Arena&) const;
};

struct HiddenSizeNotANumber : Params {
  std::string hidden_size() const;
  template <class B>
  std::size_t scratch_bytes(ChunkShape) const;
  template <class B>
  void forward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
               View<typename B::Act>, Arena&) const;
  template <class B>
  void backward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
                View<const typename B::Act>, View<typename B::Act>, const Weights<typename B::Acc>&, Arena&) const;
};

struct MissingScratchBytes : Params {
  std::int64_t hidden_size() const;
  template <class B>
  void forward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
               View<typename B::Act>, Arena&) const;
  template <class B>
  void backward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
                View<const typename B::Act>, View<typename B::Act>, const Weights<typename B::Acc>&, Arena&) const;
};

struct ScratchBytesNotPerBackend : Params {  // scratch_bytes must be a template on the backend
  std::int64_t hidden_size() const;
  std::size_t scratch_bytes(ChunkShape) const;
  template <class B>
  void forward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
               View<typename B::Act>, Arena&) const;
  template <class B>
  void backward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
                View<const typename B::Act>, View<typename B::Act>, const Weights<typename B::Acc>&, Arena&) const;
};

struct MissingForward : Params {
  std::int64_t hidden_size() const;
  template <class B>
  std::size_t scratch_bytes(ChunkShape) const;
  template <class B>
  void backward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
                View<const typename B::Act>, View<typename B::Act>, const Weights<typename B::Acc>&, Arena&) const;
};

struct NonConstForward : Params {  // ops are stateless: forward must be const
  std::int64_t hidden_size() const;
  template <class B>
  std::size_t scratch_bytes(ChunkShape) const;
  template <class B>
  void forward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
               View<typename B::Act>, Arena&);
  template <class B>
  void backward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
                View<const typename B::Act>, View<typename B::Act>, const Weights<typename B::Acc>&, Arena&) const;
};

struct ForwardWritesItsInput : Params {  // forward's input is a const view
  std::int64_t hidden_size() const;
  template <class B>
  std::size_t scratch_bytes(ChunkShape) const;
  template <class B>
  void forward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<typename B::Act>, View<typename B::Act>,
               Arena&) const;
  template <class B>
  void backward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
                View<const typename B::Act>, View<typename B::Act>, const Weights<typename B::Acc>&, Arena&) const;
};

struct MissingBackward : Params {
  std::int64_t hidden_size() const;
  template <class B>
  std::size_t scratch_bytes(ChunkShape) const;
  template <class B>
  void forward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
               View<typename B::Act>, Arena&) const;
};

struct BackwardWithoutInput : Params {  // backward must get x, the checkpoint it recomputes from
  std::int64_t hidden_size() const;
  template <class B>
  std::size_t scratch_bytes(ChunkShape) const;
  template <class B>
  void forward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
               View<typename B::Act>, Arena&) const;
  template <class B>
  void backward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act> dy,
                View<typename B::Act> dx, const Weights<typename B::Acc>&, Arena&) const;
};

struct BackwardGradsByMutableRef : Params {  // the gradient views come in a const Weights<Acc>&
  std::int64_t hidden_size() const;
  template <class B>
  std::size_t scratch_bytes(ChunkShape) const;
  template <class B>
  void forward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
               View<typename B::Act>, Arena&) const;
  template <class B>
  void backward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
                View<const typename B::Act>, View<typename B::Act>, Weights<typename B::Acc>&, Arena&) const;
};

struct NonConstBackward : Params {
  std::int64_t hidden_size() const;
  template <class B>
  std::size_t scratch_bytes(ChunkShape) const;
  template <class B>
  void forward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
               View<typename B::Act>, Arena&) const;
  template <class B>
  void backward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
                View<const typename B::Act>, View<typename B::Act>, const Weights<typename B::Acc>&, Arena&);
};

static_assert(ParamOp<MissingHiddenSize> && !LayerOp<MissingHiddenSize, F>);
static_assert(ParamOp<HiddenSizeNotANumber> && !LayerOp<HiddenSizeNotANumber, F>);
static_assert(ParamOp<MissingScratchBytes> && !LayerOp<MissingScratchBytes, F>);
static_assert(ParamOp<ScratchBytesNotPerBackend> && !LayerOp<ScratchBytesNotPerBackend, F>);
static_assert(ParamOp<MissingForward> && !LayerOp<MissingForward, F>);
static_assert(ParamOp<NonConstForward> && !LayerOp<NonConstForward, F>);
static_assert(ParamOp<ForwardWritesItsInput> && !LayerOp<ForwardWritesItsInput, F>);
static_assert(ParamOp<MissingBackward> && !LayerOp<MissingBackward, F>);
static_assert(ParamOp<BackwardWithoutInput> && !LayerOp<BackwardWithoutInput, F>);
static_assert(ParamOp<BackwardGradsByMutableRef> && !LayerOp<BackwardGradsByMutableRef, F>);
static_assert(ParamOp<NonConstBackward> && !LayerOp<NonConstBackward, F>);

// ---- EmbeddingOp and HeadOp -----------------------------------------------------------------

struct GoodEmbedding : Params {
  std::int64_t hidden_size() const;
  template <class B>
  void forward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const std::int32_t> ids,
               View<typename B::Act>, Arena&) const;
  template <class B>
  void backward(B&, ChunkShape, View<const std::int32_t> ids, View<const typename B::Act> dy,
                const Weights<typename B::Acc>&, Arena&) const;
};
struct EmbeddingBackwardNeedsWeights : Params {  // an embedding's backward is a scatter: no weights
  std::int64_t hidden_size() const;
  template <class B>
  void forward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const std::int32_t>,
               View<typename B::Act>, Arena&) const;
  template <class B>
  void backward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const std::int32_t>,
                View<const typename B::Act>, const Weights<typename B::Acc>&, Arena&) const;
};
struct EmbeddingOfActivations : Params {  // forward takes token ids, not activations
  std::int64_t hidden_size() const;
  template <class B>
  void forward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
               View<typename B::Act>, Arena&) const;
  template <class B>
  void backward(B&, ChunkShape, View<const std::int32_t>, View<const typename B::Act>, const Weights<typename B::Acc>&,
                Arena&) const;
};
static_assert(EmbeddingOp<GoodEmbedding, F>);
static_assert(!EmbeddingOp<EmbeddingBackwardNeedsWeights, F>);
static_assert(!EmbeddingOp<EmbeddingOfActivations, F>);

struct GoodHead : Params {
  std::int64_t hidden_size() const;
  template <class B>
  std::size_t scratch_bytes(ChunkShape) const;
  template <class B>
  void forward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act> x,
               View<const std::int32_t> labels, View<typename B::Acc> loss, Arena&) const;
  template <class B>
  void forward_backward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act> x,
                        View<const std::int32_t> labels, double loss_scale, View<typename B::Acc> loss,
                        View<typename B::Act> dx, const Weights<typename B::Acc>&, Arena&) const;
};
struct HeadWithoutForwardBackward : Params {  // evaluation only: cannot train
  std::int64_t hidden_size() const;
  template <class B>
  std::size_t scratch_bytes(ChunkShape) const;
  template <class B>
  void forward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
               View<const std::int32_t>, View<typename B::Acc>, Arena&) const;
};
struct HeadWithoutLossScale : Params {  // forward_backward must take the loss scale
  std::int64_t hidden_size() const;
  template <class B>
  std::size_t scratch_bytes(ChunkShape) const;
  template <class B>
  void forward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
               View<const std::int32_t>, View<typename B::Acc>, Arena&) const;
  template <class B>
  void forward_backward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
                        View<const std::int32_t>, View<typename B::Acc>, View<typename B::Act>,
                        const Weights<typename B::Acc>&, Arena&) const;
};
struct HeadWithoutScratchBytes : Params {
  std::int64_t hidden_size() const;
  template <class B>
  void forward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
               View<const std::int32_t>, View<typename B::Acc>, Arena&) const;
  template <class B>
  void forward_backward(B&, ChunkShape, const Weights<const typename B::Weight>&, View<const typename B::Act>,
                        View<const std::int32_t>, double, View<typename B::Acc>, View<typename B::Act>,
                        const Weights<typename B::Acc>&, Arena&) const;
};
static_assert(HeadOp<GoodHead, F>);
static_assert(!HeadOp<HeadWithoutForwardBackward, F>);
static_assert(!HeadOp<HeadWithoutLossScale, F>);
static_assert(!HeadOp<HeadWithoutScratchBytes, F>);

// ---- the smallest complete op ---------------------------------------------------------------

/// y = x * w elementwise (one weight vector): everything LayerOp asks for, defined.
class ScaleOp {
 public:
  explicit ScaleOp(std::int64_t hidden) : hidden_(hidden) {}

  template <class E>
  struct Weights {
    View<E> w;
  };
  std::vector<ParamSpec> params() const { return {ParamSpec::norm("scale.weight", hidden_)}; }
  template <class E>
  Weights<E> bind(const ParamBinder<E>& p) const {
    return {p("scale.weight")};
  }
  std::int64_t hidden_size() const { return hidden_; }
  template <class B>
  std::size_t scratch_bytes(ChunkShape) const {
    return 0;
  }
  template <class B>
    requires(!B::kDevice)
  void forward(B&, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
               View<typename B::Act> y, Arena&) const {
    for (std::int64_t t = 0; t < c.tokens(); ++t)
      for (std::int64_t i = 0; i < hidden_; ++i) y(t, i) = x(t, i) * w.w(i);
  }
  template <class B>
    requires(!B::kDevice)
  void backward(B&, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
                View<const typename B::Act> dy, View<typename B::Act> dx, const Weights<typename B::Acc>& g,
                Arena&) const {
    for (std::int64_t t = 0; t < c.tokens(); ++t)
      for (std::int64_t i = 0; i < hidden_; ++i) {
        dx(t, i) = dy(t, i) * w.w(i);
        g.w(i) += dy(t, i) * x(t, i);
      }
  }

 private:
  std::int64_t hidden_;
};
static_assert(LayerOp<ScaleOp, F> && LayerOp<ScaleOp, D>);

}  // namespace

TEST_CASE("concepts: the smallest complete op runs through LayerTemplate") {
  const LayerTemplate<ScaleOp> t{ScaleOp(3)};
  CHECK(t.layout().entries().size() == 1);
  CHECK(t.unit_spec("scale").params.at(0).name == "scale.weight");
  std::vector<double> slab(static_cast<std::size_t>(t.layout().numel()), 0.0), grad(slab.size(), 0.0);
  slab[0] = 2, slab[1] = -1, slab[2] = 0.5;
  const std::vector<double> x{1, 2, 3, 4, 5, 6}, dy{1, 1, 1, 2, 2, 2};
  std::vector<double> y(6), dx(6);
  D be;
  Arena arena;
  const ChunkShape c{2, 1};
  const auto w = t.bind(std::span<const double>(slab));
  t.op().forward(be, c, w, View<const double>(std::span<const double>(x), Shape{2, 3}),
                 View<double>(std::span<double>(y), Shape{2, 3}), arena);
  CHECK(y == std::vector<double>{2, -2, 1.5, 8, -5, 3});
  t.op().backward(be, c, w, View<const double>(std::span<const double>(x), Shape{2, 3}),
                  View<const double>(std::span<const double>(dy), Shape{2, 3}),
                  View<double>(std::span<double>(dx), Shape{2, 3}), t.bind(std::span<double>(grad)), arena);
  CHECK(dx == std::vector<double>{2, -1, 0.5, 4, -2, 1});
  CHECK(grad[0] == 1 + 2 * 4);
  CHECK(grad[1] == 2 + 2 * 5);
  CHECK(grad[2] == 3 + 2 * 6);
}
