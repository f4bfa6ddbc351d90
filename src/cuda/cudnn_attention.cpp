// cuDNN fused flash attention through the backend (graph) API: the operation graphs, the plan
// search and the launches behind cudnn_attention.hpp.
//
// cuDNN 9 recognises scaled dot-product attention as a *pattern* of matmul, pointwise and
// reduction nodes and hands the whole graph to its fused flash-attention engine (the "composite"
// SDPA of the cudnn-frontend). cuDNN 9 also has dedicated CUDNN_BACKEND_OPERATION_SDPA_FWD/BWD
// descriptors, but a causal mask on them needs the score-modifier subgraph attribute, which the
// backend only has from 9.21 (forward) and which its heuristics only propose for the backward from
// 9.27; the composite pattern is what runs on every cuDNN 9.10.2+ on Hopper, so that is what is
// built here, node for node as cudnn-frontend builds it for those versions. A graph that deviates
// from the pattern is not an error at build time: the heuristics simply find no engine. So the
// node order, data types and the virtual/non-virtual choice below follow the frontend exactly.
//
// Forward graph (Q: [B,H,S,D], K^T: [B,Hk,D,S], V: [B,Hk,S,D]; GQA is expressed only by the head
// dimension of K and V being Hk < H; BSHD memory is described by strides, K^T by swapping K's last
// two dims and strides):
//   S   = matmul(Q, K^T)                                  fp32 virtual [B,H,S,S]
//   S   = S * scale                                       pointwise MUL, scale a by-value fp32 scalar
//   r,c = GEN_INDEX(S, axis 2), GEN_INDEX(S, axis 3)      int32 virtual
//   m   = CMP_GE(r, c)                                    bool virtual (causal: key <= query)
//   S   = BINARY_SELECT(S, -inf, m)                       keeps S where m, else -inf (by-value scalar)
//   M   = reduce MAX over keys                            fp32 virtual [B,H,S,1]
//   E   = EXP(S - M);  Z = reduce ADD(E)
//   lse = M + LOG(Z)                                      the Stats output, fp32 [B,H,S,1]
//   P   = E / Z                                           bf16 virtual (the data type matmul 2 needs)
//   O   = matmul(P, V)                                    bf16 [B,H,S,D]
// Backward graph (K and V both given transposed, [B,Hk,D,S]):
//   Dsum = reduce ADD over D of (dO * O), times 1.0       fp32, non-virtual: lives in our workspace
//   S    = matmul(Q, K^T) * scale - lse                   (padding mask here, cuDNN <= 9.15 only)
//   P    = EXP(causal_select(S))                          fp32 virtual
//   dV   = matmul(reshape(P) = P^T as bf16, dO)           GQA: into bf16 [B,H,S,D], reduce ADD to Hk
//   dS   = (matmul(dO, V^T) - Dsum) * P * scale           fp32 virtual
//   dK   = matmul(reshape(dS) = dS^T as bf16, Q)          GQA: as dV
//   dQ   = matmul(dS, reshape(K^T) = K)                   deterministic: straight into bf16 dQ;
//                                                         otherwise into an fp32 non-virtual dQ
//                                                         accumulator (workspace), then IDENTITY.
// Determinism: cuDNN 9 has no "deterministic" attribute for this fused backward on Hopper. The
// frontend's set_deterministic_algorithm(true) changes the graph instead: without the fp32 dQ
// accumulator (which the engine fills with atomics) the engine takes its dP-workspace algorithm,
// which reduces dQ in a fixed order and needs about B*H*S^2*2 bytes of workspace. (The reduction
// descriptor's CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC, 9.11+, is for stand-alone reductions; the
// frontend leaves it unset in SDPA. On Blackwell the frontend instead pins engine knobs, and on
// Hopper with cuDNN >= 9.25 it can pin an "ordered dQ" engine option; neither is done here.) We
// also list engines that carry CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC after the others.
//
// Sources relied on (read, not copied):
//   - cuDNN 9.19 headers cudnn_graph_v9.h: every descriptor type, attribute name, attribute type
//     and enum value used here; cudnnBackendSetAttribute/GetAttribute/Finalize/Execute.
//   - NVIDIA cuDNN docs, "Graph API" (developer/graph-api.html) and "cudnn_graph Library"
//     (api/cudnn-graph-library.html): the backend workflow (op graph -> heuristics -> engine
//     config -> execution plan -> variant pack), CUDNN_ATTR_TENSOR_IS_BY_VALUE scalars.
//   - cudnn-frontend (github.com/NVIDIA/cudnn-frontend, 2025-26 main):
//       node/scaled_dot_product_flash_attention.h  CompositeSDPANode::expand_node (forward graph,
//         K -> K^T by swapping dims/strides), CompositeSDPABackwardNode::expand_node (backward
//         graph, data types, softmax_sum and dQ_accum workspace tensors, the deterministic switch,
//         the padding-mask workaround for cuDNN <= 9.15 when s_kv % 128 != 0, GQA dK/dV as a
//         bf16 full-head matmul plus a reduction), override_heuristics_query (Blackwell knobs);
//       node/softmax.h CompositeSoftmaxNode (MAX, SUB, EXP, ADD, LOG, ADD, DIV with Stats);
//       node/diagonal_band_mask.h CompositeDiagonalBandMaskNode and utils/attn_score_modifiers.h
//         (causal = GEN_INDEX row/col, CMP_GE, BINARY_SELECT with -inf; padding mask with CMP_LT
//         and LOGICAL_AND; -inf vs lowest() by version);
//       node/sdpa_support_surface.h (head_dim limits per architecture, 9.10.0/9.10.1 SDPA bugs,
//         packed BHSD Stats required before 9.26, unified SDPA backward only from 9.27);
//       cudnn_frontend_Tensor.h, cudnn_frontend_PointWiseDesc.h, cudnn_frontend_Operation.h,
//         cudnn_frontend_ReductionDesc.h, node/reshape.h (attribute types and counts: tensor
//         attributes, pointwise MODE/MATH_PREC/AXIS and ALPHA1/ALPHA2 as float, matmul
//         COMP_TYPE and M/N/K override tensors, reduction OPERATOR/COMP_TYPE, reshape X/Y);
//       backend/execution_helpers.h (variant pack), backend/plan_helpers.h, graph_interface.h
//         (a by-value scalar's variant-pack pointer is a host pointer to its value).
#include "megatrain/backend/cuda/cudnn_attention.hpp"

#include <cudnn.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "megatrain/core/cuda_check.hpp"
#include "megatrain/core/cudnn_check.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/core/log.hpp"
#include "megatrain/core/nvtx.hpp"

namespace megatrain::cuda {
// Helpers of this file only. A named namespace rather than an anonymous one: CudnnAttention::Plans
// (a member of an exported class) holds some of these types.
namespace cudnn_attention_detail {

using Dims = std::array<std::int64_t, 4>;

/// cuDNN 9.10.0 and 9.10.1 have known bf16 SDPA bugs (the frontend refuses them); earlier 9.x
/// releases need further workarounds (a second padding mask, a pre-zeroed dQ accumulator, lowest()
/// instead of -inf) that are not implemented here.
constexpr std::size_t kMinCudnnVersion = 91002;
/// Up to 9.15 the backward needs an explicit padding mask when S is not a multiple of 128.
constexpr std::size_t kLastPaddingWorkaroundVersion = 91500;
/// Every tensor is promised to start on a 16-byte boundary (CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT).
constexpr std::int64_t kByteAlignment = 16;
/// Sub-buffers of the caller's workspace start on this boundary.
constexpr std::size_t kWorkspaceAlignment = 256;

/// Unique ids of the tensors the caller's pointers bind to (non-virtual); virtual ones count up
/// from kFirstVirtual.
enum Uid : std::int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kScale,
  kNegInf,
  kDO,
  kDQ,
  kDK,
  kDV,
  kSoftmaxSum,
  kDQAccum,
  kOne,
  kSeqLenQ,
  kSeqLenKV,
  kOffQ,  // packed rows: the ragged offsets of Q (and dQ), K (dK), V (dV), O (dO) and the statistics
  kOffK,
  kOffV,
  kOffO,
  kOffStats,
  kFirstVirtual = 100,
};

// The handle attributes of the operation graph and the execution plan are deprecated in the
// 9.19 headers (a device-properties descriptor may replace them) but required by older 9.x
// libraries, and every 9.x still accepts them.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
constexpr cudnnBackendAttributeName_t kOperationGraphHandle = CUDNN_ATTR_OPERATIONGRAPH_HANDLE;
constexpr cudnnBackendAttributeName_t kExecutionPlanHandle = CUDNN_ATTR_EXECUTION_PLAN_HANDLE;
#pragma GCC diagnostic pop

/// cuDNN's name for a status plus its last error message (the "why" cuDNN logs internally).
std::string describe(cudnnStatus_t st) {
  char detail[512] = {0};
  cudnnGetLastErrorString(detail, sizeof detail);
  return fmt::format("{}{}{}", cudnnGetErrorString(st), detail[0] ? ": " : "", detail);
}

bool is_not_supported(cudnnStatus_t st) {
  return CUDNN_STATUS_CATEGORY(static_cast<int>(st)) == static_cast<int>(CUDNN_STATUS_NOT_SUPPORTED);
}

/// A status check that names the descriptor and attribute (the failing graph node) in the error.
void check(cudnnStatus_t st, std::string_view call, std::string_view node, const char* attribute,
           const detail::SourceLoc& where) {
  if (st != CUDNN_STATUS_SUCCESS) [[unlikely]] {
    const std::string expr =
        attribute ? fmt::format("{}({}, {})", call, node, attribute) : fmt::format("{}({})", call, node);
    detail::check_status(st, expr.c_str(), where);
  }
}

#define MT_CUDNN_SET(desc, node, attribute, type, count, values)                                                    \
  check(cudnnBackendSetAttribute((desc), (attribute), (type), static_cast<std::int64_t>(count), (values)),        \
        "cudnnBackendSetAttribute", (node), #attribute, MT_HERE)
#define MT_CUDNN_FINALIZE(desc, node) \
  check(cudnnBackendFinalize(desc), "cudnnBackendFinalize", (node), nullptr, MT_HERE)

/// Owns one backend descriptor (cudnnBackendDestroyDescriptor on destruction); move-only.
class Desc {
 public:
  Desc() = default;
  explicit Desc(cudnnBackendDescriptorType_t type) { MT_CUDA_CHECK(cudnnBackendCreateDescriptor(type, &d_)); }
  ~Desc() { reset(); }
  Desc(Desc&& other) noexcept : d_(std::exchange(other.d_, nullptr)) {}
  Desc& operator=(Desc&& other) noexcept {
    if (this != &other) {
      reset();
      d_ = std::exchange(other.d_, nullptr);
    }
    return *this;
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;

  cudnnBackendDescriptor_t get() const { return d_; }
  explicit operator bool() const { return d_ != nullptr; }

 private:
  void reset() noexcept {
    if (d_ != nullptr) (void)cudnnBackendDestroyDescriptor(d_);  // nothing to do about a failure here
    d_ = nullptr;
  }
  cudnnBackendDescriptor_t d_ = nullptr;
};

/// A few int32 values in pinned host memory, copied into the caller's device workspace on the
/// caller's stream before each launch that reads them. No device memory of its own: everything
/// cuDNN reads on the device lives in the workspace, which the caller allocates (CudaBackend
/// counts it against its memory cap), and the copy is an ordinary cudaMemcpyAsync on the launch's
/// stream (pinned source: asynchronous, ordered like the launch; no device-wide wait; only if
/// pinning fails is the source pageable, and then the driver may block the host for these few
/// bytes). The values never change after set(), so the source stays valid for every copy in flight.
class HostInts {
 public:
  void set(const std::vector<std::int32_t>& values) {
    count_ = values.size();
    buf_ = HostBuffer::allocate(bytes());
    std::copy(values.begin(), values.end(), buf_.as<std::int32_t>(0, count_).begin());
  }
  std::size_t bytes() const { return count_ * sizeof(std::int32_t); }
  /// Enqueues the copy of the values to `device` (at least bytes() long) on `stream`.
  void copy_to(void* device, cudaStream_t stream) const {
    MT_CUDA_CHECK(cudaMemcpyAsync(device, buf_.data(), bytes(), cudaMemcpyHostToDevice, stream));
  }

 private:
  std::size_t count_ = 0;
  HostBuffer buf_;
};

/// Builds one operation graph: creates, fills and finalizes tensor and operation descriptors and
/// keeps them alive as long as the graph and its plans (the frontend does the same).
class GraphBuilder {
 public:
  explicit GraphBuilder(std::string name) : name_(std::move(name)) {}

  cudnnBackendDescriptor_t tensor(std::string_view name, std::int64_t uid, cudnnDataType_t type, const Dims& dims,
                                  const Dims& strides, bool is_virtual = false, bool by_value = false,
                                  cudnnBackendDescriptor_t ragged_offset = nullptr) {
    const std::string node = fmt::format("{}: tensor {} (uid {})", name_, name, uid);
    Desc t(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const std::int64_t alignment = kByteAlignment;
    MT_CUDNN_SET(t.get(), node, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
    MT_CUDNN_SET(t.get(), node, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims.size(), dims.data());
    MT_CUDNN_SET(t.get(), node, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides.size(), strides.data());
    MT_CUDNN_SET(t.get(), node, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    MT_CUDNN_SET(t.get(), node, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
    if (is_virtual) {
      const bool yes = true;
      MT_CUDNN_SET(t.get(), node, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &yes);
    }
    if (by_value) {
      const bool yes = true;
      MT_CUDNN_SET(t.get(), node, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &yes);
    }
    if (ragged_offset != nullptr)
      MT_CUDNN_SET(t.get(), node, CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &ragged_offset);
    MT_CUDNN_FINALIZE(t.get(), node);
    return keep(std::move(t));
  }

  /// A virtual (intermediate) tensor with the next free uid.
  cudnnBackendDescriptor_t virtual_tensor(std::string_view name, cudnnDataType_t type, const Dims& dims,
                                          const Dims& strides, cudnnBackendDescriptor_t ragged_offset = nullptr) {
    return tensor(name, next_virtual_uid_++, type, dims, strides, /*is_virtual=*/true, false, ragged_offset);
  }

  /// A by-value fp32 scalar [1,1,1,1]; its variant-pack pointer is a host pointer to the value.
  cudnnBackendDescriptor_t scalar(std::string_view name, std::int64_t uid) {
    return tensor(name, uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, /*is_virtual=*/false, /*by_value=*/true);
  }

  /// y = mode(x[, b[, t]]); `axis` only for GEN_INDEX.
  void pointwise(std::string_view name, cudnnPointwiseMode_t mode, cudnnDataType_t compute, cudnnBackendDescriptor_t x,
                 cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y,
                 std::int64_t axis = -1) {
    const std::string node = fmt::format("{}: pointwise {}", name_, name);
    Desc pw(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    MT_CUDNN_SET(pw.get(), node, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    MT_CUDNN_SET(pw.get(), node, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &compute);
    if (mode == CUDNN_POINTWISE_GEN_INDEX)
      MT_CUDNN_SET(pw.get(), node, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    MT_CUDNN_FINALIZE(pw.get(), node);

    Desc op(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    const cudnnBackendDescriptor_t pw_desc = pw.get();
    const float one = 1.0f;
    MT_CUDNN_SET(op.get(), node, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                 &pw_desc);
    MT_CUDNN_SET(op.get(), node, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    MT_CUDNN_SET(op.get(), node, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    MT_CUDNN_SET(op.get(), node, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one);
    MT_CUDNN_SET(op.get(), node, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one);
    if (b != nullptr)
      MT_CUDNN_SET(op.get(), node, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    if (t != nullptr)
      MT_CUDNN_SET(op.get(), node, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t);
    MT_CUDNN_FINALIZE(op.get(), node);
    keep(std::move(pw));
    add_operation(std::move(op));
  }

  /// c = a b over the last two dims, batched (and broadcast, for GQA) over the first two. The
  /// optional override tensors hold per-batch M, N, K (variable sequence lengths).
  void matmul(std::string_view name, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c,
              cudnnBackendDescriptor_t m_override = nullptr, cudnnBackendDescriptor_t n_override = nullptr,
              cudnnBackendDescriptor_t k_override = nullptr) {
    const std::string node = fmt::format("{}: matmul {}", name_, name);
    Desc mm(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    MT_CUDNN_SET(mm.get(), node, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute);
    MT_CUDNN_FINALIZE(mm.get(), node);

    Desc op(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    const cudnnBackendDescriptor_t mm_desc = mm.get();
    MT_CUDNN_SET(op.get(), node, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a);
    MT_CUDNN_SET(op.get(), node, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    MT_CUDNN_SET(op.get(), node, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c);
    if (m_override != nullptr)
      MT_CUDNN_SET(op.get(), node, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                   &m_override);
    if (n_override != nullptr)
      MT_CUDNN_SET(op.get(), node, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                   &n_override);
    if (k_override != nullptr)
      MT_CUDNN_SET(op.get(), node, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                   &k_override);
    MT_CUDNN_SET(op.get(), node, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm_desc);
    MT_CUDNN_FINALIZE(op.get(), node);
    keep(std::move(mm));
    add_operation(std::move(op));
  }

  /// y = reduce(x) over every dimension where y has extent 1 (or a divisor of x's: the GQA heads).
  void reduction(std::string_view name, cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x,
                 cudnnBackendDescriptor_t y) {
    const std::string node = fmt::format("{}: reduction {}", name_, name);
    Desc red(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    MT_CUDNN_SET(red.get(), node, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute);
    MT_CUDNN_SET(red.get(), node, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode);
    MT_CUDNN_FINALIZE(red.get(), node);

    Desc op(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    const cudnnBackendDescriptor_t red_desc = red.get();
    MT_CUDNN_SET(op.get(), node, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &red_desc);
    MT_CUDNN_SET(op.get(), node, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    MT_CUDNN_SET(op.get(), node, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    MT_CUDNN_FINALIZE(op.get(), node);
    keep(std::move(red));
    add_operation(std::move(op));
  }

  /// y is x seen through other dims/strides (here: a transpose of the last two dims).
  void reshape(std::string_view name, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    const std::string node = fmt::format("{}: reshape {}", name_, name);
    Desc op(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    MT_CUDNN_SET(op.get(), node, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    MT_CUDNN_SET(op.get(), node, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    MT_CUDNN_FINALIZE(op.get(), node);
    add_operation(std::move(op));
  }

  /// The finalized operation graph, or an empty Desc and `why` when cuDNN reports it unsupported.
  /// Any other failure is a malformed graph and throws.
  Desc finalize(cudnnHandle_t handle, std::string& why) {
    Desc graph(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    MT_CUDNN_SET(graph.get(), name_, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, ops_.size(),
                 ops_.data());
    MT_CUDNN_SET(graph.get(), name_, kOperationGraphHandle, CUDNN_TYPE_HANDLE, 1, &handle);
    const cudnnStatus_t st = cudnnBackendFinalize(graph.get());
    if (st != CUDNN_STATUS_SUCCESS && is_not_supported(st)) {
      why = fmt::format("{}: the operation graph did not finalize: {}", name_, describe(st));
      return {};
    }
    check(st, "cudnnBackendFinalize", name_, "operation graph", MT_HERE);
    return graph;
  }

  const std::string& name() const { return name_; }

 private:
  cudnnBackendDescriptor_t keep(Desc d) {
    owned_.push_back(std::move(d));
    return owned_.back().get();
  }
  void add_operation(Desc op) { ops_.push_back(keep(std::move(op))); }

  std::string name_;
  std::vector<Desc> owned_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  std::int64_t next_virtual_uid_ = kFirstVirtual;
};

/// A finalized execution plan and what it needs.
struct ExecPlan {
  Desc config;  ///< the engine config the plan was made from (kept alive with it)
  Desc plan;
  std::int64_t workspace = 0;
  std::int64_t engine = -1;          ///< CUDNN_ATTR_ENGINE_GLOBAL_INDEX, for logs
  bool nondeterministic = false;     ///< the engine carries CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC
  const char* heuristics = "";
};

struct EngineInfo {
  std::int64_t index = -1;
  bool nondeterministic = false;
};

/// The engine behind a heuristics result: its global index and its nondeterminism note. These
/// are only informative, so a failed query leaves the defaults rather than throwing.
EngineInfo engine_info(cudnnBackendDescriptor_t config) {
  EngineInfo info;
  Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  cudnnBackendDescriptor_t raw = engine.get();
  std::int64_t n = 0;
  if (cudnnBackendGetAttribute(config, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &raw) !=
          CUDNN_STATUS_SUCCESS ||
      n != 1)
    return info;
  std::int64_t index = -1;
  if (cudnnBackendGetAttribute(raw, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &index) ==
      CUDNN_STATUS_SUCCESS)
    info.index = index;
  std::array<cudnnBackendNumericalNote_t, 32> notes{};
  if (cudnnBackendGetAttribute(raw, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                               static_cast<std::int64_t>(notes.size()), &n, notes.data()) == CUDNN_STATUS_SUCCESS) {
    for (std::int64_t i = 0; i < std::min<std::int64_t>(n, static_cast<std::int64_t>(notes.size())); ++i)
      if (notes[static_cast<std::size_t>(i)] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) info.nondeterministic = true;
  }
  return info;
}

void note(std::string& why, std::string_view line) {
  constexpr std::size_t kMaxReason = 2000;
  if (why.size() >= kMaxReason) return;
  if (!why.empty()) why += "; ";
  why += line;
}

/// Heuristics mode A (what the frontend uses for SDPA), then FALLBACK; within a mode the engine
/// configs in the heuristics' order (those without a nondeterminism note first when asked), the
/// first whose execution plan finalizes wins. False, with the reasons in `why`, when none does.
bool find_plan(cudnnHandle_t handle, cudnnBackendDescriptor_t graph, const std::string& name, bool prefer_deterministic,
               ExecPlan& out, std::string& why) {
  struct Mode {
    cudnnBackendHeurMode_t mode;
    const char* label;
  };
  for (const Mode m : {Mode{CUDNN_HEUR_MODE_A, "A"}, Mode{CUDNN_HEUR_MODE_FALLBACK, "FALLBACK"}}) {
    const std::string node = fmt::format("{}: heuristics {}", name, m.label);
    Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    MT_CUDNN_SET(heur.get(), node, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph);
    MT_CUDNN_SET(heur.get(), node, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &m.mode);
    if (const cudnnStatus_t st = cudnnBackendFinalize(heur.get()); st != CUDNN_STATUS_SUCCESS) {
      note(why, fmt::format("{}: {}", node, describe(st)));
      continue;
    }
    std::int64_t count = 0;
    check(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                                   nullptr),
          "cudnnBackendGetAttribute", node, "CUDNN_ATTR_ENGINEHEUR_RESULTS (count)", MT_HERE);
    if (count <= 0) {
      note(why, fmt::format("{}: no engine configuration", node));
      continue;
    }
    std::vector<Desc> configs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (std::int64_t i = 0; i < count; ++i) {
      configs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
      raw.push_back(configs.back().get());
    }
    std::int64_t returned = 0;
    check(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count,
                                   &returned, raw.data()),
          "cudnnBackendGetAttribute", node, "CUDNN_ATTR_ENGINEHEUR_RESULTS", MT_HERE);
    returned = std::min(returned, count);

    std::vector<std::pair<std::size_t, EngineInfo>> order;
    for (std::int64_t i = 0; i < returned; ++i)
      order.emplace_back(static_cast<std::size_t>(i), engine_info(raw[static_cast<std::size_t>(i)]));
    if (prefer_deterministic)
      std::stable_partition(order.begin(), order.end(), [](const auto& c) { return !c.second.nondeterministic; });

    for (const auto& [i, info] : order) {
      const std::string plan_node = fmt::format("{}: execution plan for engine {}", node, info.index);
      Desc plan(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      MT_CUDNN_SET(plan.get(), plan_node, kExecutionPlanHandle, CUDNN_TYPE_HANDLE, 1, &handle);
      MT_CUDNN_SET(plan.get(), plan_node, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                   &raw[i]);
      if (const cudnnStatus_t st = cudnnBackendFinalize(plan.get()); st != CUDNN_STATUS_SUCCESS) {
        note(why, fmt::format("{}: {}", plan_node, describe(st)));
        continue;
      }
      std::int64_t workspace = 0, n = 0;
      check(cudnnBackendGetAttribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n,
                                     &workspace),
            "cudnnBackendGetAttribute", plan_node, "CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE", MT_HERE);
      out.config = std::move(configs[i]);
      out.plan = std::move(plan);
      out.workspace = workspace;
      out.engine = info.index;
      out.nondeterministic = info.nondeterministic;
      out.heuristics = m.label;
      return true;
    }
  }
  return false;
}

/// The shape in the graph's terms: batch B = rows, H query heads, Hk kv heads, S, D. Packed
/// (`ragged`): B sequences of at most S tokens laid end to end, where the ragged offsets say.
struct Shape {
  std::int64_t b, h, hk, s, d;
  bool ragged = false;
};

/// Packed rows: the ragged-offset tensors (int64 [B+1], element offsets of each sequence's start)
/// and the sequence lengths (int32 [B]) a graph reads, or all null.
struct Ragged {
  cudnnBackendDescriptor_t q = nullptr, k = nullptr, v = nullptr, o = nullptr, stats = nullptr;
  cudnnBackendDescriptor_t seq_q = nullptr, seq_kv = nullptr;
};
Ragged ragged_tensors(GraphBuilder& g, const Shape& x) {
  Ragged r;
  if (!x.ragged) return r;
  const Dims od = {x.b + 1, 1, 1, 1}, one = {1, 1, 1, 1};
  r.q = g.tensor("ragged offsets of Q", kOffQ, CUDNN_DATA_INT64, od, one);
  r.k = g.tensor("ragged offsets of K", kOffK, CUDNN_DATA_INT64, od, one);
  r.v = g.tensor("ragged offsets of V", kOffV, CUDNN_DATA_INT64, od, one);
  r.o = g.tensor("ragged offsets of O", kOffO, CUDNN_DATA_INT64, od, one);
  r.stats = g.tensor("ragged offsets of the statistics", kOffStats, CUDNN_DATA_INT64, od, one);
  r.seq_q = g.tensor("seq_len_q", kSeqLenQ, CUDNN_DATA_INT32, {x.b, 1, 1, 1}, one);
  r.seq_kv = g.tensor("seq_len_kv", kSeqLenKV, CUDNN_DATA_INT32, {x.b, 1, 1, 1}, one);
  return r;
}

/// [B, heads, S, D] over row-major [B*S, heads*D] memory (BSHD).
Dims bshd_dims(const Shape& x, std::int64_t heads) { return {x.b, heads, x.s, x.d}; }
Dims bshd_strides(const Shape& x, std::int64_t heads) { return {x.s * heads * x.d, x.d, heads * x.d, 1}; }
/// The same memory seen transposed, [B, heads, D, S] (K^T, V^T).
Dims bshd_t_dims(const Shape& x, std::int64_t heads) { return {x.b, heads, x.d, x.s}; }
Dims bshd_t_strides(const Shape& x, std::int64_t heads) { return {x.s * heads * x.d, x.d, 1, heads * x.d}; }
/// Dense [B, H, S, S] scores and [B, H, S, 1] per-row statistics.
Dims score_dims(const Shape& x) { return {x.b, x.h, x.s, x.s}; }
Dims score_strides(const Shape& x) { return {x.h * x.s * x.s, x.s * x.s, x.s, 1}; }
Dims row_dims(const Shape& x) { return {x.b, x.h, x.s, 1}; }
Dims row_strides(const Shape& x) { return {x.h * x.s, x.s, 1, 1}; }
/// The statistics a graph keeps ([B,H,S,1]): dense per row, or, packed, token-major ([tokens, H]).
Dims stats_strides(const Shape& x) { return x.ragged ? Dims{x.h * x.s, 1, x.h, 1} : row_strides(x); }

/// Keeps scores where key index <= query index, -inf elsewhere (top-left aligned causal mask).
cudnnBackendDescriptor_t causal_mask(GraphBuilder& g, const Shape& x, cudnnBackendDescriptor_t scores,
                                     cudnnBackendDescriptor_t neg_inf) {
  const Dims dims = score_dims(x), strides = score_strides(x);
  auto row = g.virtual_tensor("causal row index", CUDNN_DATA_INT32, dims, strides);
  g.pointwise("causal row index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, scores, nullptr, nullptr, row, 2);
  auto col = g.virtual_tensor("causal column index", CUDNN_DATA_INT32, dims, strides);
  g.pointwise("causal column index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, scores, nullptr, nullptr, col, 3);
  auto keep = g.virtual_tensor("causal row >= column", CUDNN_DATA_BOOLEAN, dims, strides);
  g.pointwise("causal row >= column", CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, nullptr, keep);
  auto out = g.virtual_tensor("causal masked scores", CUDNN_DATA_FLOAT, dims, strides);
  g.pointwise("causal select", CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, scores, neg_inf, keep, out);
  return out;
}

/// Keeps scores where row < seq_len_q[b] and column < seq_len_kv[b] (the backward workaround).
cudnnBackendDescriptor_t padding_mask(GraphBuilder& g, const Shape& x, cudnnBackendDescriptor_t scores,
                                      cudnnBackendDescriptor_t neg_inf, cudnnBackendDescriptor_t seq_len_q,
                                      cudnnBackendDescriptor_t seq_len_kv) {
  const Dims dims = score_dims(x), strides = score_strides(x);
  auto row = g.virtual_tensor("padding row index", CUDNN_DATA_INT32, dims, strides);
  g.pointwise("padding row index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, scores, nullptr, nullptr, row, 2);
  auto col = g.virtual_tensor("padding column index", CUDNN_DATA_INT32, dims, strides);
  g.pointwise("padding column index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, scores, nullptr, nullptr, col, 3);
  auto row_ok = g.virtual_tensor("padding row < seq_len_q", CUDNN_DATA_BOOLEAN, dims, strides);
  g.pointwise("padding row < seq_len_q", CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, row, seq_len_q, nullptr, row_ok);
  auto col_ok = g.virtual_tensor("padding column < seq_len_kv", CUDNN_DATA_BOOLEAN, dims, strides);
  g.pointwise("padding column < seq_len_kv", CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, col, seq_len_kv, nullptr,
              col_ok);
  auto keep = g.virtual_tensor("padding keep", CUDNN_DATA_BOOLEAN, dims, strides);
  g.pointwise("padding keep", CUDNN_POINTWISE_LOGICAL_AND, CUDNN_DATA_BOOLEAN, row_ok, col_ok, nullptr, keep);
  auto out = g.virtual_tensor("padding masked scores", CUDNN_DATA_FLOAT, dims, strides);
  g.pointwise("padding select", CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, scores, neg_inf, keep, out);
  return out;
}

/// The forward graph (see the top of this file).
void build_forward(GraphBuilder& g, const Shape& x) {
  const Ragged r = ragged_tensors(g, x);
  auto q = g.tensor("Q", kQ, CUDNN_DATA_BFLOAT16, bshd_dims(x, x.h), bshd_strides(x, x.h), false, false, r.q);
  auto kt = g.tensor("K^T", kK, CUDNN_DATA_BFLOAT16, bshd_t_dims(x, x.hk), bshd_t_strides(x, x.hk), false, false, r.k);
  auto v = g.tensor("V", kV, CUDNN_DATA_BFLOAT16, bshd_dims(x, x.hk), bshd_strides(x, x.hk), false, false, r.v);
  auto o = g.tensor("O", kO, CUDNN_DATA_BFLOAT16, bshd_dims(x, x.h), bshd_strides(x, x.h), false, false, r.o);
  auto stats = g.tensor("Stats (lse)", kStats, CUDNN_DATA_FLOAT, row_dims(x), stats_strides(x), false, false, r.stats);
  auto scale = g.scalar("attention scale", kScale);
  auto neg_inf = g.scalar("-inf", kNegInf);
  const Dims sd = score_dims(x), ss = score_strides(x), rd = row_dims(x), rs = row_strides(x);

  auto s = g.virtual_tensor("S = Q K^T", CUDNN_DATA_FLOAT, sd, ss);
  g.matmul("bmm1 Q K^T", q, kt, s, r.seq_q, r.seq_kv);
  auto scaled = g.virtual_tensor("S * scale", CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise("attention scale", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, s, scale, nullptr, scaled);
  if (x.ragged) scaled = padding_mask(g, x, scaled, neg_inf, r.seq_q, r.seq_kv);
  auto masked = causal_mask(g, x, scaled, neg_inf);

  auto max = g.virtual_tensor("softmax max", CUDNN_DATA_FLOAT, rd, rs);
  g.reduction("softmax max", CUDNN_REDUCE_TENSOR_MAX, masked, max);
  auto sub = g.virtual_tensor("S - max", CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise("softmax S - max", CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, masked, max, nullptr, sub);
  auto e = g.virtual_tensor("exp(S - max)", CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise("softmax exp", CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, sub, nullptr, nullptr, e);
  auto sum = g.virtual_tensor("softmax sum", CUDNN_DATA_FLOAT, rd, rs);
  g.reduction("softmax sum", CUDNN_REDUCE_TENSOR_ADD, e, sum);
  auto log_sum = g.virtual_tensor("log(sum)", CUDNN_DATA_FLOAT, rd, rs);
  g.pointwise("softmax log(sum)", CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, sum, nullptr, nullptr, log_sum);
  g.pointwise("softmax stats = max + log(sum)", CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT, max, log_sum, nullptr, stats);
  auto p = g.virtual_tensor("P", CUDNN_DATA_BFLOAT16, sd, ss);  // bf16: matmul 2's A operand
  g.pointwise("softmax exp / sum", CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT, e, sum, nullptr, p);
  g.matmul("bmm2 P V", p, v, o, r.seq_q, nullptr, r.seq_kv);
}

/// The backward graph (see the top of this file). `deterministic`: dQ straight from the matmul
/// (no fp32 accumulator). `padding_workaround`: the explicit padding mask of cuDNN <= 9.15.
void build_backward(GraphBuilder& g, const Shape& x, bool deterministic, bool padding_workaround) {
  const Ragged r = ragged_tensors(g, x);
  auto q = g.tensor("Q", kQ, CUDNN_DATA_BFLOAT16, bshd_dims(x, x.h), bshd_strides(x, x.h), false, false, r.q);
  auto kt = g.tensor("K^T", kK, CUDNN_DATA_BFLOAT16, bshd_t_dims(x, x.hk), bshd_t_strides(x, x.hk), false, false, r.k);
  auto vt = g.tensor("V^T", kV, CUDNN_DATA_BFLOAT16, bshd_t_dims(x, x.hk), bshd_t_strides(x, x.hk), false, false, r.v);
  auto o = g.tensor("O", kO, CUDNN_DATA_BFLOAT16, bshd_dims(x, x.h), bshd_strides(x, x.h), false, false, r.o);
  auto d_o = g.tensor("dO", kDO, CUDNN_DATA_BFLOAT16, bshd_dims(x, x.h), bshd_strides(x, x.h), false, false, r.o);
  auto stats = g.tensor("Stats (lse)", kStats, CUDNN_DATA_FLOAT, row_dims(x), stats_strides(x), false, false, r.stats);
  auto d_q = g.tensor("dQ", kDQ, CUDNN_DATA_BFLOAT16, bshd_dims(x, x.h), bshd_strides(x, x.h), false, false, r.q);
  auto d_k = g.tensor("dK", kDK, CUDNN_DATA_BFLOAT16, bshd_dims(x, x.hk), bshd_strides(x, x.hk), false, false, r.k);
  auto d_v = g.tensor("dV", kDV, CUDNN_DATA_BFLOAT16, bshd_dims(x, x.hk), bshd_strides(x, x.hk), false, false, r.v);
  auto scale = g.scalar("attention scale", kScale);
  auto neg_inf = g.scalar("-inf", kNegInf);
  auto one = g.scalar("1", kOne);
  const Dims sd = score_dims(x), ss = score_strides(x), rd = row_dims(x), rs = row_strides(x);
  const Dims hd = bshd_dims(x, x.h);
  const Dims hd_packed = {x.h * x.s * x.d, x.s * x.d, x.d, 1};  // [B,H,S,D] dense, for intermediates
  // dK, dV before the GQA reduction: dense and without ragged offsets also when packed (measured
  // on cuDNN 9.19, H100: with dK's offsets, as the frontend gives them, the engine reads out of
  // bounds; dense, every packed case of tests/cuda/test_cuda_backend.cpp matches the reference)
  const Dims kv_full = {x.b, x.h, x.s, x.d};

  cudnnBackendDescriptor_t seq_q = r.seq_q, seq_kv = r.seq_kv;
  if (padding_workaround) {
    seq_q = g.tensor("seq_len_q", kSeqLenQ, CUDNN_DATA_INT32, {x.b, 1, 1, 1}, {1, 1, 1, 1});
    seq_kv = g.tensor("seq_len_kv", kSeqLenKV, CUDNN_DATA_INT32, {x.b, 1, 1, 1}, {1, 1, 1, 1});
  }

  // Dsum = rowsum(dO * O) * 1, non-virtual (the engine's "softmax_sum", in our workspace).
  auto do_o = g.virtual_tensor("dO * O", CUDNN_DATA_FLOAT, hd, hd_packed);
  g.pointwise("dO * O", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, d_o, o, nullptr, do_o);
  auto row_sum = g.virtual_tensor("rowsum(dO * O)", CUDNN_DATA_FLOAT, rd, rs);
  g.reduction("rowsum(dO * O)", CUDNN_REDUCE_TENSOR_ADD, do_o, row_sum);
  // (dense [B,H,S,1] also when packed: the engine writes it so without a bound on the total tokens)
  auto softmax_sum = g.tensor("softmax_sum", kSoftmaxSum, CUDNN_DATA_FLOAT, rd, rs);
  g.pointwise("softmax_sum = rowsum * 1", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, row_sum, one, nullptr, softmax_sum);

  // P = exp(causal(S * scale - lse)), recomputed.
  auto s = g.virtual_tensor("S = Q K^T", CUDNN_DATA_FLOAT, sd, ss);
  g.matmul("Q K^T", q, kt, s, seq_q, seq_kv);
  auto scaled = g.virtual_tensor("S * scale", CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise("attention scale", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, s, scale, nullptr, scaled);
  auto shifted = g.virtual_tensor("S - lse", CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise("S - lse", CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, scaled, stats, nullptr, shifted);
  if (padding_workaround || x.ragged) shifted = padding_mask(g, x, shifted, neg_inf, seq_q, seq_kv);
  auto masked = causal_mask(g, x, shifted, neg_inf);
  auto p = g.virtual_tensor("P = exp(S - lse)", CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise("exp(S - lse)", CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, masked, nullptr, nullptr, p);

  // dV = P^T dO (GQA: per query head, then summed over each kv head's group).
  const Dims t_dims = {x.b, x.h, x.s, x.s};
  const Dims t_strides = {x.h * x.s * x.s, x.s * x.s, 1, x.s};  // [B,H,S_kv,S_q] view of [B,H,S_q,S_kv]
  auto p_t = g.virtual_tensor("P^T", CUDNN_DATA_BFLOAT16, t_dims, t_strides);
  g.reshape("P^T", p, p_t);
  if (x.h == x.hk) {
    g.matmul("P^T dO", p_t, d_o, d_v, seq_kv, nullptr, seq_q);
  } else {
    auto d_v_full = g.virtual_tensor("dV per query head", CUDNN_DATA_BFLOAT16, kv_full, hd_packed);
    g.matmul("P^T dO", p_t, d_o, d_v_full, seq_kv, nullptr, seq_q);
    g.reduction("dV over the query-head group", CUDNN_REDUCE_TENSOR_ADD, d_v_full, d_v);
  }

  // dS = (dO V^T - Dsum) * P * scale.
  auto dp = g.virtual_tensor("dP = dO V^T", CUDNN_DATA_FLOAT, sd, ss);
  g.matmul("dO V^T", d_o, vt, dp, seq_q, seq_kv);
  auto dp_sub = g.virtual_tensor("dP - softmax_sum", CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise("dP - softmax_sum", CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, dp, softmax_sum, nullptr, dp_sub);
  auto dp_p = g.virtual_tensor("(dP - softmax_sum) * P", CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise("(dP - softmax_sum) * P", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, dp_sub, p, nullptr, dp_p);
  auto ds = g.virtual_tensor("dS", CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise("dS = ... * scale", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, dp_p, scale, nullptr, ds);

  // dK = dS^T Q (GQA as dV).
  auto ds_t = g.virtual_tensor("dS^T", CUDNN_DATA_BFLOAT16, t_dims, t_strides);
  g.reshape("dS^T", ds, ds_t);
  if (x.h == x.hk) {
    g.matmul("dS^T Q", ds_t, q, d_k, seq_kv, nullptr, seq_q);
  } else {
    auto d_k_full = g.virtual_tensor("dK per query head", CUDNN_DATA_BFLOAT16, kv_full, hd_packed);
    g.matmul("dS^T Q", ds_t, q, d_k_full, seq_kv, nullptr, seq_q);
    g.reduction("dK over the query-head group", CUDNN_REDUCE_TENSOR_ADD, d_k_full, d_k);
  }

  // dQ = dS K, K being K^T seen transposed back. (The frontend leaves this view's data type to
  // the graph's intermediate type, fp32; it is a view of the bf16 input.)
  const Dims kt_strides = bshd_t_strides(x, x.hk);
  auto k = g.virtual_tensor("K", CUDNN_DATA_FLOAT, bshd_dims(x, x.hk),
                            {kt_strides[0], kt_strides[1], kt_strides[3], kt_strides[2]}, r.k);
  g.reshape("K", kt, k);
  if (deterministic) {
    g.matmul("dS K", ds, k, d_q, seq_q, nullptr, seq_kv);
  } else {
    auto dq_accum = g.tensor("dQ_accum", kDQAccum, CUDNN_DATA_FLOAT, bshd_dims(x, x.h),
                             x.ragged ? bshd_strides(x, x.h) : hd_packed, false, false, r.q);
    g.matmul("dS K", ds, k, dq_accum, seq_q, nullptr, seq_kv);
    g.pointwise("dQ = dQ_accum", CUDNN_POINTWISE_IDENTITY, CUDNN_DATA_FLOAT, dq_accum, nullptr, nullptr, d_q);
  }
}

std::size_t align_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

bool aligned(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % static_cast<std::uintptr_t>(kByteAlignment) == 0;
}

std::int64_t next_pow2(std::int64_t n) {
  std::int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

/// Packed rows: the graph's batch (sequences, a power of two from 8, the rest empty) and the
/// graph's S (the longest sequence's power of two from 64, at most the row), so that a few plans
/// serve every batch; 0, 0 when each row is one sequence.
std::pair<std::int64_t, std::int64_t> packed_buckets(const AttentionDims& d) {
  if (d.sequences <= 0) return {0, 0};
  return {std::max<std::int64_t>(8, next_pow2(d.sequences)),
          std::min(d.seq, std::max<std::int64_t>(64, next_pow2(std::max<std::int64_t>(d.longest, 1))))};
}

std::string shape_name(const AttentionDims& d) {
  const auto [b, s] = packed_buckets(d);
  if (b > 0)
    return fmt::format("rows={} seq={} heads={} kv_heads={} head_dim={} packed: up to {} sequences of up to {}", d.rows, d.seq,
                       d.heads, d.kv_heads, d.head_dim, b, s);
  return fmt::format("rows={} seq={} heads={} kv_heads={} head_dim={}", d.rows, d.seq, d.heads, d.kv_heads, d.head_dim);
}

/// Binds pointers to uids and launches one plan on the handle's stream.
void execute(cudnnHandle_t handle, const ExecPlan& plan, const std::int64_t* uids, void* const* pointers,
             std::size_t count, void* workspace, std::string_view what) {
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  MT_CUDNN_SET(pack.get(), what, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, count, uids);
  MT_CUDNN_SET(pack.get(), what, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, count, pointers);
  MT_CUDNN_SET(pack.get(), what, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
  MT_CUDNN_FINALIZE(pack.get(), what);
  check(cudnnBackendExecute(handle, plan.plan.get(), pack.get()), "cudnnBackendExecute", what, nullptr, MT_HERE);
  MT_CUDA_CHECK_LAUNCH("cudnnBackendExecute (SDPA)");
}

#undef MT_CUDNN_SET
#undef MT_CUDNN_FINALIZE

}  // namespace cudnn_attention_detail

using namespace cudnn_attention_detail;

/// Everything built for one shape: both graphs (with every descriptor they refer to), both
/// plans, the backward workspace layout and the by-value scalars.
struct CudnnAttention::Plans {
  bool supported = false;
  std::string reason;

  std::unique_ptr<GraphBuilder> forward_ops, backward_ops;
  Desc forward_graph, backward_graph;
  ExecPlan forward, backward;

  std::size_t forward_workspace = 0;
  // Backward workspace: [cuDNN plan | softmax_sum fp32 B*H*S | dQ accumulator fp32 B*H*S*D
  // (atomic dQ only) | seq_lens int32 2*B (padding workaround only)].
  std::size_t softmax_sum_offset = 0, dq_accum_offset = 0, seq_lens_offset = 0, backward_workspace = 0;
  bool deterministic_graph = true;
  bool padding_workaround = false;
  // Packed rows: the graph's sequences and their bound, and where the ragged offsets (int64
  // [B+1] each: Q and O, K and V, the statistics) and lengths (int32 [B]) go, at the end of
  // either workspace (`ragged_offset` bytes after forward_ragged / backward_ragged).
  std::int64_t packed_b = 0, packed_s = 0;
  std::size_t forward_ragged = 0, backward_ragged = 0;
  HostInts seq_lens;  ///< rows x seq_len_q, then rows x seq_len_kv (padding workaround only)

  // By-value scalars: cuDNN reads them through host pointers when a plan is launched.
  float scale = 1.0f;
  float neg_inf = -std::numeric_limits<float>::infinity();
  float one = 1.0f;
};

CudnnAttention::CudnnAttention(cudnnHandle_t handle, bool deterministic_backward, std::size_t deterministic_workspace_limit)
    : handle_(handle), deterministic_(deterministic_backward), deterministic_limit_(deterministic_workspace_limit) {
  MT_CHECK(handle != nullptr, "the cuDNN handle is null");
}

CudnnAttention::~CudnnAttention() = default;

std::size_t CudnnAttention::runtime_version() { return cudnnGetVersion(); }

/// The ragged offsets and lengths of B sequences, as laid out at the end of a workspace.
struct RaggedLayout {
  std::size_t qo = 0, kv = 0, st = 0, len = 0, bytes = 0;
  explicit RaggedLayout(std::int64_t b) {
    const std::size_t offs = static_cast<std::size_t>(b + 1) * sizeof(std::int64_t);
    kv = align_up(offs, kWorkspaceAlignment);
    st = kv + align_up(offs, kWorkspaceAlignment);
    len = st + align_up(offs, kWorkspaceAlignment);
    bytes = len + static_cast<std::size_t>(b) * sizeof(std::int32_t);
  }
};

CudnnAttention::Plans& CudnnAttention::plans(const AttentionDims& d) {
  const auto [packed_b, packed_s] = packed_buckets(d);
  // (the softmax scale is part of the key: it is a by-value scalar of the plan's variant pack)
  const Key key{d.rows, d.seq, d.heads, d.kv_heads, d.head_dim, packed_b, packed_s, d.window, d.scale};
  if (auto it = plans_.find(key); it != plans_.end()) return *it->second;
  MT_NVTX_RANGE("cudnn_attention_build");  // once per shape
  MT_CHECK(d.rows > 0 && d.seq > 0 && d.heads > 0 && d.kv_heads > 0 && d.head_dim > 0,
           "attention dims must be positive ({})", shape_name(d));
  MT_CHECK(d.heads % d.kv_heads == 0, "heads ({}) must be a multiple of kv_heads ({})", d.heads, d.kv_heads);

  MT_CHECK(d.sequences == 0 || (d.sequences >= d.rows && d.longest > 0 && d.longest <= d.seq),
           "packed attention: {} sequences, the longest {}, in {} rows of {}", d.sequences, d.longest, d.rows, d.seq);
  auto p = std::make_unique<Plans>();
  p->packed_b = packed_b;
  p->packed_s = packed_s;
  const Shape x = packed_b > 0 ? Shape{packed_b, d.heads, d.kv_heads, packed_s, d.head_dim, true}
                               : Shape{d.rows, d.heads, d.kv_heads, d.seq, d.head_dim};
  const std::size_t version = cudnnGetVersion();
  int device = 0, cc_major = 0;
  MT_CUDA_CHECK(cudaGetDevice(&device));
  MT_CUDA_CHECK(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, device));
  // Head dims the fused kernels have (sdpa_support_surface.h: multiples of 8; up to 256 on Hopper,
  // 128 on Ampere and, for the backward, on Blackwell).
  const std::int64_t max_head_dim = cc_major == 9 ? 256 : 128;

  if (version < kMinCudnnVersion) {
    p->reason = fmt::format("cuDNN {} is older than 9.10.2, the first release whose bf16 SDPA is used here", version);
  } else if (cc_major < 8) {
    p->reason = fmt::format("compute capability {}.x: cuDNN's fused attention needs 8.0 or newer", cc_major);
  } else if (d.head_dim % 8 != 0 || d.head_dim > max_head_dim) {
    p->reason = fmt::format("head_dim {}: cuDNN's fused attention needs a multiple of 8 up to {} on this GPU",
                            d.head_dim, max_head_dim);
  } else if (d.window > 0) {
    p->reason = fmt::format("a sliding window of {} tokens: megatrain's own kernel runs it", d.window);
  } else if (d.seq > std::numeric_limits<std::int32_t>::max() / 2) {
    p->reason = fmt::format("seq {} does not fit the int32 indices of the causal mask", d.seq);
  } else {
    p->deterministic_graph = deterministic_;
    p->padding_workaround = !x.ragged && version <= kLastPaddingWorkaroundVersion && d.seq % 128 != 0;
    p->scale = static_cast<float>(d.scale > 0 ? d.scale : 1.0 / std::sqrt(static_cast<double>(d.head_dim)));

    p->forward_ops = std::make_unique<GraphBuilder>(fmt::format("SDPA forward [{}]", shape_name(d)));
    build_forward(*p->forward_ops, x);
    p->forward_graph = p->forward_ops->finalize(handle_, p->reason);
    if (p->forward_graph &&
        !find_plan(handle_, p->forward_graph.get(), p->forward_ops->name(), false, p->forward, p->reason) &&
        p->reason.empty())
      p->reason = "no forward engine";

    // The backward: deterministic if asked and its workspace is within the limit, else atomic dQ.
    for (int attempt = 0; attempt < 2 && p->forward.plan && !p->supported; ++attempt) {
      p->backward_ops = std::make_unique<GraphBuilder>(fmt::format("SDPA backward [{}]", shape_name(d)));
      build_backward(*p->backward_ops, x, p->deterministic_graph, p->padding_workaround);
      std::string why;
      p->backward_graph = p->backward_ops->finalize(handle_, why);
      if (p->backward_graph && find_plan(handle_, p->backward_graph.get(), p->backward_ops->name(),
                                         p->deterministic_graph, p->backward, why)) {
        const auto ws = static_cast<std::size_t>(p->backward.workspace);
        if (p->deterministic_graph && ws > deterministic_limit_) {
          log_warning("cuDNN attention [{}]: the deterministic backward needs {:.1f} GiB of workspace (more than {:.1f} "
                      "GiB): it accumulates dQ with atomics instead (linear in the tokens, not bitwise repeatable)",
                      shape_name(d), static_cast<double>(ws) / (1 << 30),
                      static_cast<double>(deterministic_limit_) / (1 << 30));
          p->deterministic_graph = false;
          continue;
        }
        p->supported = true;
        p->reason.clear();
      } else {
        p->reason = why.empty() ? std::string("no backward engine") : why;
      }
    }
  }

  if (p->supported) {
    p->forward_workspace = static_cast<std::size_t>(p->forward.workspace);
    // softmax_sum: one float per (sequence, head, position), the graph's [B,H,S]
    const std::size_t rows = static_cast<std::size_t>(x.b * x.h * x.s);
    p->softmax_sum_offset = align_up(static_cast<std::size_t>(p->backward.workspace), kWorkspaceAlignment);
    p->dq_accum_offset = align_up(p->softmax_sum_offset + rows * sizeof(float), kWorkspaceAlignment);
    p->backward_workspace = p->deterministic_graph
                                ? p->dq_accum_offset
                                : p->dq_accum_offset + rows * static_cast<std::size_t>(d.head_dim) * sizeof(float);
    if (p->padding_workaround) {
      // The sequence lengths live in the caller's workspace (counted against CudaBackend's memory
      // cap), copied there from pinned host memory by every backward(), on its stream.
      std::vector<std::int32_t> lens(2 * static_cast<std::size_t>(d.rows), static_cast<std::int32_t>(d.seq));
      p->seq_lens.set(lens);
      p->seq_lens_offset = align_up(p->backward_workspace, kWorkspaceAlignment);
      p->backward_workspace = p->seq_lens_offset + p->seq_lens.bytes();
    }
    if (x.ragged) {
      p->forward_ragged = align_up(p->forward_workspace, kWorkspaceAlignment);
      p->forward_workspace = p->forward_ragged + RaggedLayout(x.b).bytes;
      p->backward_ragged = align_up(p->backward_workspace, kWorkspaceAlignment);
      p->backward_workspace = p->backward_ragged + RaggedLayout(x.b).bytes;
    }
    if (p->deterministic_graph && p->backward.nondeterministic)
      log_warning("cuDNN attention [{}]: the backward engine {} is marked non-deterministic", shape_name(d),
                  p->backward.engine);
  }
  return *plans_.emplace(key, std::move(p)).first->second;
}

CudnnAttention::Plans& CudnnAttention::supported_plans(const AttentionDims& d, const char* caller) {
  Plans& p = plans(d);
  MT_CHECK(p.supported, "{}: cuDNN does not run attention of shape {} ({}); check supports() first", caller,
           shape_name(d), p.reason);
  return p;
}

bool CudnnAttention::supports(const AttentionDims& d) { return plans(d).supported; }

std::string CudnnAttention::unsupported_reason(const AttentionDims& d) { return plans(d).reason; }

bool CudnnAttention::backward_is_deterministic(const AttentionDims& d) {
  const Plans& p = supported_plans(d, "backward_is_deterministic");
  return p.deterministic_graph && !p.backward.nondeterministic;
}

std::string CudnnAttention::plan_summary(const AttentionDims& d) {
  const Plans& p = plans(d);
  if (!p.supported) return fmt::format("cuDNN {}: unsupported: {}", cudnnGetVersion(), p.reason);
  return fmt::format(
      "cuDNN {}: forward engine {} (heuristics {}, {} B workspace); backward engine {} (heuristics {}, {} B "
      "workspace in all, {}{}{})",
      cudnnGetVersion(), p.forward.engine, p.forward.heuristics, p.forward_workspace, p.backward.engine,
      p.backward.heuristics, p.backward_workspace, p.deterministic_graph ? "deterministic dQ" : "atomic dQ",
      p.backward.nondeterministic ? ", engine marked non-deterministic" : "",
      p.padding_workaround ? ", padding-mask workaround" : "");
}

std::size_t CudnnAttention::forward_workspace_bytes(const AttentionDims& d) {
  return supported_plans(d, "forward_workspace_bytes").forward_workspace;
}

std::size_t CudnnAttention::backward_workspace_bytes(const AttentionDims& d) {
  return supported_plans(d, "backward_workspace_bytes").backward_workspace;
}

namespace cudnn_attention_detail {
/// Packed rows: writes the ragged offsets and lengths into the workspace at `at` (on `stream`)
/// and adds their bindings.
void bind_ragged(const AttentionDims& d, std::int64_t b, const std::int32_t* starts, std::byte* at, cudaStream_t stream,
                 std::vector<std::int64_t>& uids, std::vector<void*>& pointers) {
  MT_CHECK(starts != nullptr, "packed attention: the sequence starts are null");
  const RaggedLayout l(b);
  auto* qo = reinterpret_cast<std::int64_t*>(at + l.qo);
  auto* kv = reinterpret_cast<std::int64_t*>(at + l.kv);
  auto* st = reinterpret_cast<std::int64_t*>(at + l.st);
  auto* len = reinterpret_cast<std::int32_t*>(at + l.len);
  launch_packed_offsets(starts, d.sequences, b, d.heads * d.head_dim, d.kv_heads * d.head_dim, d.heads, qo, kv, st, len,
                        stream);
  for (const auto& [uid, ptr] : {std::pair<std::int64_t, void*>{kOffQ, qo}, {kOffO, qo}, {kOffK, kv}, {kOffV, kv},
                                 {kOffStats, st}, {kSeqLenQ, len}, {kSeqLenKV, len}}) {
    uids.push_back(uid);
    pointers.push_back(ptr);
  }
}
}  // namespace cudnn_attention_detail

void CudnnAttention::forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, const AttentionDims& d,
                             void* workspace, std::size_t workspace_bytes, cudaStream_t stream, const std::int32_t* starts) {
  MT_NVTX_RANGE("cudnn_attention_forward");
  Plans& p = supported_plans(d, "CudnnAttention::forward");
  MT_CHECK(workspace_bytes >= p.forward_workspace, "the workspace holds {} bytes, {} needed", workspace_bytes,
           p.forward_workspace);
  MT_CHECK(q && k && v && out && lse, "a tensor pointer is null");
  MT_CHECK(workspace != nullptr || p.forward_workspace == 0, "the workspace is null");
  MT_CHECK(aligned(q) && aligned(k) && aligned(v) && aligned(out) && aligned(lse) && aligned(workspace),
           "every pointer must be 16-byte aligned");
  MT_CUDA_CHECK(cudnnSetStream(handle_, stream));
  std::vector<std::int64_t> uids{kQ, kK, kV, kO, kStats, kScale, kNegInf};
  std::vector<void*> pointers{const_cast<bf16*>(q), const_cast<bf16*>(k), const_cast<bf16*>(v), out, lse, &p.scale,
                              &p.neg_inf};
  if (p.packed_b > 0)
    bind_ragged(d, p.packed_b, starts, static_cast<std::byte*>(workspace) + p.forward_ragged, stream, uids, pointers);
  execute(handle_, p.forward, uids.data(), pointers.data(), uids.size(), workspace, p.forward_ops->name());
}

void CudnnAttention::backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse,
                              const bf16* dout, bf16* dq, bf16* dk, bf16* dv, const AttentionDims& d, void* workspace,
                              std::size_t workspace_bytes, cudaStream_t stream, const std::int32_t* starts) {
  MT_NVTX_RANGE("cudnn_attention_backward");
  Plans& p = supported_plans(d, "CudnnAttention::backward");
  MT_CHECK(workspace_bytes >= p.backward_workspace, "the workspace holds {} bytes, {} needed", workspace_bytes,
           p.backward_workspace);
  MT_CHECK(q && k && v && out && lse && dout && dq && dk && dv && workspace, "a pointer is null");
  MT_CHECK(aligned(q) && aligned(k) && aligned(v) && aligned(out) && aligned(lse) && aligned(dout) && aligned(dq) &&
               aligned(dk) && aligned(dv) && aligned(workspace),
           "every pointer must be 16-byte aligned");
  MT_CUDA_CHECK(cudnnSetStream(handle_, stream));
  std::byte* ws = static_cast<std::byte*>(workspace);
  std::vector<std::int64_t> uids{kQ, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV, kScale, kNegInf, kOne, kSoftmaxSum};
  std::vector<void*> pointers{const_cast<bf16*>(q),    const_cast<bf16*>(k), const_cast<bf16*>(v),
                              const_cast<bf16*>(out),  const_cast<float*>(lse), const_cast<bf16*>(dout),
                              dq,                      dk,                     dv,
                              &p.scale,                &p.neg_inf,             &p.one,
                              ws + p.softmax_sum_offset};
  if (!p.deterministic_graph) {
    uids.push_back(kDQAccum);
    pointers.push_back(ws + p.dq_accum_offset);
  }
  if (p.padding_workaround) {
    // The workspace is shared with other ops: the lengths are written again before every launch
    // (an asynchronous copy on `stream`, ordered before the launch; 8 bytes per row).
    auto* lens = reinterpret_cast<std::int32_t*>(ws + p.seq_lens_offset);
    p.seq_lens.copy_to(lens, stream);
    uids.push_back(kSeqLenQ);
    pointers.push_back(lens);
    uids.push_back(kSeqLenKV);
    pointers.push_back(lens + d.rows);
  }
  if (p.packed_b > 0) bind_ragged(d, p.packed_b, starts, ws + p.backward_ragged, stream, uids, pointers);
  execute(handle_, p.backward, uids.data(), pointers.data(), uids.size(), workspace, p.backward_ops->name());
}

}  // namespace megatrain::cuda
