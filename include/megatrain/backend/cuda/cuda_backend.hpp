// The CUDA backend: the same primitives as the CPU reference (backend/backend.hpp), in bf16 with
// fp32 accumulation, enqueued on one compute stream.
//
//   matrix products   cuBLASLt (gemm.hpp), plans cached per shape; weight gradients in fp32
//   attention         cuDNN's fused flash attention through the graph API (cudnn_attention.hpp),
//                     graphs cached per shape; megatrain's own kernel where cuDNN is missing or
//                     refuses a shape
//   everything else   megatrain's kernels (kernels.hpp): embedding, RMSNorm, rotary, SwiGLU,
//                     the chunked LM-head cross-entropy, casts, reductions
//
// All device memory is cudaMalloc'ed (never managed memory) through alloc(), which counts it
// against an optional cap (CudaBackendOptions::memory_limit) so the trainer's spill paths can be
// exercised on a large GPU. prepare() allocates the workspaces once, before training. (cuDNN's
// attention keeps no device memory of its own: what its plans need lives in the workspace.)
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "megatrain/backend/backend.hpp"
#if MEGATRAIN_HAS_CUDNN
#include "megatrain/backend/cuda/cudnn_attention.hpp"
#include "megatrain/core/cudnn_check.hpp"
#endif
#include "megatrain/backend/cuda/decode.hpp"
#include "megatrain/backend/cuda/gated_deltanet.hpp"
#include "megatrain/backend/cuda/gemm.hpp"
#include "megatrain/backend/linear_attention.hpp"
#include "megatrain/backend/cuda/kernels.hpp"
#include "megatrain/backend/cuda/stream_executor.hpp"
#include "megatrain/core/cuda_check.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/core/log.hpp"
#include "megatrain/core/nvtx.hpp"
#include "megatrain/core/tensor.hpp"
#include "megatrain/optim/adamw.hpp"

namespace megatrain {

struct CudaBackendOptions {
  int device = 0;
  /// Bytes of device memory megatrain may allocate; default: what is free at start, less 1 GiB.
  std::optional<std::size_t> memory_limit;
  /// Tokens per block of the LM head's logits ([block, vocab] fp32 plus bf16 gradients).
  std::int64_t logits_block = 2048;
  bool use_cudnn = true;  ///< false: always megatrain's own attention kernel
  /// cuDNN's attention backward is deterministic (bitwise repeatable) unless its plan would need
  /// more workspace than this (it grows with the square of the sequence length): then dQ is
  /// accumulated with atomics, in workspace linear in the tokens (said once per shape).
  std::size_t deterministic_attention_workspace = std::size_t{8} << 30;
  std::size_t gemm_workspace = std::size_t{32} << 20;
  /// Time cuBLASLt's first few algorithms per matrix-product shape until end_gemm_tuning() (the
  /// Trainer calls it after its first step) and keep each shape's fastest (cuda/gemm.hpp). Off:
  /// the heuristic's first, the same in every run. On, two fresh runs may pick differently and
  /// differ in the last bits; a run continued from gemm_algorithms() (megatrain-train keeps them
  /// in its checkpoints) is bit for bit the same.
  bool gemm_tuning = false;
  /// Tokens a window of Gated DeltaNet's kernels take at a time (0: as many as a 4 GiB workspace
  /// holds, at least 4,096; delta_net_window_tokens). Smaller windows exercise the carries.
  std::int64_t delta_net_window = 0;
};

class CudaBackend {
 public:
  /// Device bytes a backend allocates at construction beside cuBLASLt's workspace (gemm_workspace):
  /// a mixture of experts' routing counts.
  static constexpr std::size_t kMoeWorkspaceBytes = cuda::kMoeRouteWorkspace;
  using Act = bf16;
  using Weight = bf16;
  using Acc = float;
  using Res = float;  ///< the residual stream, in fp32 as PyTorch's autocast keeps it
  static constexpr bool kDevice = true;
  using Executor = cuda::StreamExecutor;
  using WorkspacePlan = megatrain::WorkspacePlan;
  enum class Role { upload, compute, download };

  // ---- device buffers --------------------------------------------------------------------------
  template <class E>
  class Buffer {
   public:
    Buffer() = default;
    Buffer(E* p, std::size_t n, std::shared_ptr<std::atomic<std::size_t>> counter)
        : p_(p), n_(n), counter_(std::move(counter)) {}
    Buffer(Buffer&& o) noexcept { swap(o); }
    Buffer& operator=(Buffer&& o) noexcept {
      Buffer t(std::move(o));
      swap(t);
      return *this;
    }
    ~Buffer() {
      if (p_ != nullptr) {
        (void)cudaFree(p_);
        *counter_ -= footprint(n_);
      }
    }
    /// Bytes a buffer of n elements is counted as (and cudaMalloc'ed with): never 0.
    static std::size_t footprint(std::size_t n) { return std::max<std::size_t>(n * sizeof(E), 1); }
    std::span<E> span() { return {p_, n_}; }
    std::span<const E> span() const { return {p_, n_}; }
    std::size_t size() const { return n_; }

   private:
    void swap(Buffer& o) noexcept {
      std::swap(p_, o.p_);
      std::swap(n_, o.n_);
      std::swap(counter_, o.counter_);
    }
    E* p_ = nullptr;
    std::size_t n_ = 0;
    std::shared_ptr<std::atomic<std::size_t>> counter_;
  };

  explicit CudaBackend(CudaBackendOptions opt = {}) : opt_(opt), allocated_(std::make_shared<std::atomic<std::size_t>>(0)) {
    MT_NVTX_RANGE("CudaBackend::CudaBackend");
    int count = 0;
    MT_CUDA_CHECK(cudaGetDeviceCount(&count));
    MT_CHECK(opt.device >= 0 && opt.device < count, "CUDA device {} does not exist ({} present)", opt.device, count);
    MT_CUDA_CHECK(cudaSetDevice(opt.device));
    std::size_t free = 0, total = 0;
    MT_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    const std::size_t reserve = std::size_t{1} << 30;
    limit_ = opt.memory_limit ? *opt.memory_limit : (free > reserve ? free - reserve : free / 2);
    MT_CHECK(limit_ <= free, "the GPU memory cap of {} exceeds the {} free on device {}", format_bytes(limit_),
             format_bytes(free), opt.device);
    MT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    gemm_ws_ = alloc<std::byte>(opt.gemm_workspace);
    gemm_ = std::make_unique<cuda::Gemm>(gemm_ws_.span().data(), gemm_ws_.size(), opt.gemm_tuning);
    moe_ws_ = alloc<std::byte>(kMoeWorkspaceBytes);
#if MEGATRAIN_HAS_CUDNN
    if (opt.use_cudnn) {
      const cudnnStatus_t st = cudnnCreate(&cudnn_);
      if (st == CUDNN_STATUS_SUCCESS) {
        MT_CUDA_CHECK(cudnnSetStream(cudnn_, stream_));
        attention_ = std::make_unique<cuda::CudnnAttention>(cudnn_, true, opt.deterministic_attention_workspace);
      } else {
        log_warning("cuDNN is not usable ({}); attention uses megatrain's own kernel", cudnnGetErrorString(st));
        cudnn_ = nullptr;
      }
    }
#endif
  }
  ~CudaBackend() {
    MT_NVTX_RANGE("CudaBackend::~CudaBackend");
    // Work still queued (after an exception, say) may read buffers freed below.
    if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);
#if MEGATRAIN_HAS_CUDNN
    attention_.reset();
    if (cudnn_ != nullptr) (void)cudnnDestroy(cudnn_);
#endif
    gemm_.reset();
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  cudaStream_t stream() const { return stream_; }

  /// Matrix-product algorithms (CudaBackendOptions::gemm_tuning): fixes the tuned choices.
  void end_gemm_tuning() { gemm_->end_tuning(); }
  /// Every shape's algorithm so far, as text to keep with a run's checkpoint.
  std::string gemm_algorithms() const { return gemm_->algorithms(); }
  /// Takes saved algorithms (and ends tuning); false where they were saved with another cuBLASLt
  /// or GPU: then nothing changes (the run continues, not bit for bit).
  bool restore_gemm_algorithms(const std::string& text) { return gemm_->restore(text); }

  Executor make_executor(Role role) {
    MT_NVTX_RANGE("CudaBackend::make_executor");
    return role == Role::compute ? Executor(stream_, opt_.device) : Executor(nullptr, opt_.device);
  }
  void synchronize() {
    MT_NVTX_RANGE("CudaBackend::synchronize");
    MT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  /// A device array of n elements (contents undefined), counted against the memory cap: the
  /// bytes checked against the cap, given to cudaMalloc, counted and later uncounted are the same
  /// (Buffer<E>::footprint(n)).
  template <class E>
  Buffer<E> alloc(std::size_t n) {
    MT_NVTX_RANGE("CudaBackend::alloc");
    MT_CHECK(n <= (std::numeric_limits<std::size_t>::max() - 1) / sizeof(E), "GPU memory: {} elements of {} bytes overflow",
             n, sizeof(E));
    const std::size_t bytes = Buffer<E>::footprint(n);
    // Reserve the bytes first (compare-and-swap), so that concurrent allocations cannot pass the
    // cap together; give them back if cudaMalloc fails.
    std::size_t used = allocated_->load();
    do {
      MT_CHECK(bytes <= limit_ && used <= limit_ - bytes,
               "GPU memory: {} more would exceed the cap of {} ({} already allocated); lower the batch, the chunk or "
               "the sequence length, or raise the cap",
               format_bytes(bytes), format_bytes(limit_), format_bytes(used));
    } while (!allocated_->compare_exchange_weak(used, used + bytes));
    void* p = nullptr;
    if (const cudaError_t err = cudaMalloc(&p, bytes); err != cudaSuccess) {
      *allocated_ -= bytes;
      MT_CUDA_CHECK(err);
    }
    return Buffer<E>(static_cast<E*>(p), n, allocated_);
  }
  std::size_t allocated_bytes() const { return *allocated_; }
  std::size_t memory_limit() const { return limit_; }
  /// Bytes alloc() can still hand out.
  std::optional<std::size_t> memory_available() const { return limit_ > *allocated_ ? limit_ - *allocated_ : 0; }
  /// Whether attention of this shape runs on cuDNN (after prepare()).
  bool cudnn_attention(const AttentionShape& s) {
    MT_NVTX_RANGE("CudaBackend::cudnn_attention");  // may build the shape's cuDNN graphs
    return runs_on_cudnn(s);
  }
  /// cuDNN's plans for attention of this shape, in a line (or why it does not run them).
  std::string attention_plan_summary([[maybe_unused]] const AttentionShape& s) {
#if MEGATRAIN_HAS_CUDNN
    if (attention_) return attention_->plan_summary(dims(s));
#endif
    return "cuDNN is not used";
  }

  /// Allocates every workspace the primitives will need for chunks up to `plan`.
  void prepare(const WorkspacePlan& plan) {
    MT_NVTX_RANGE("CudaBackend::prepare");
    const Needs n = needs(plan);
    if (n.workspace > workspace_.size()) workspace_ = alloc<std::byte>(n.workspace);
    if (n.logits > logits_.size()) {
      logits_ = alloc<float>(n.logits);
      dlogits_ = alloc<bf16>(n.logits);
    }
  }
  /// The bytes prepare(plan) would add to what this backend holds (allocates nothing; may build
  /// cuDNN's plans for the attention shapes): what a memory plan counts before prepare() runs.
  std::size_t prepare_bytes(const WorkspacePlan& plan) {
    const Needs n = needs(plan);
    std::size_t add = 0;
    if (n.workspace > workspace_.size()) add += Buffer<std::byte>::footprint(n.workspace) - workspace_.size();
    if (n.logits > logits_.size())
      add += Buffer<float>::footprint(n.logits) + Buffer<bf16>::footprint(n.logits) -
             logits_.size() * (sizeof(float) + sizeof(bf16));
    return add;
  }

  // ---- transfers (a stage's executor orders them) ----------------------------------------------
  template <class S, class D>
  void upload(Executor& e, std::span<const S> src, std::span<D> dst) {
    MT_NVTX_RANGE("CudaBackend::upload");
    static_assert(std::is_same_v<S, D>, "CUDA transfers copy bytes: the element types must match");
    MT_CHECK(src.size() == dst.size(), "upload of {} elements into {}", src.size(), dst.size());
    MT_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), src.size_bytes(), cudaMemcpyDefault, e.stream()));
  }
  template <class S, class D>
  void download(Executor& e, std::span<const S> src, std::span<D> dst) {
    MT_NVTX_RANGE("CudaBackend::download");
    static_assert(std::is_same_v<S, D>, "CUDA transfers copy bytes: the element types must match");
    MT_CHECK(src.size() == dst.size(), "download of {} elements into {}", src.size(), dst.size());
    MT_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), src.size_bytes(), cudaMemcpyDefault, e.stream()));
  }
  /// Rounds fp32 values in device memory to bf16 (to nearest even, as the host's conversion), on
  /// the executor's stream: a unit's masters streamed without a bf16 copy in host memory.
  void round_weights(Executor& e, std::span<const float> src, std::span<bf16> dst) {
    MT_NVTX_RANGE("CudaBackend::round_weights");
    MT_CHECK(src.size() == dst.size(), "rounding {} elements into {}", src.size(), dst.size());
    cuda::launch_cast(src.data(), dst.data(), static_cast<std::int64_t>(src.size()), e.stream());
  }
  /// Tests: holds the executor's stream for `nanoseconds` (cuda::launch_spin).
  void spin(Executor& e, std::int64_t nanoseconds) { cuda::launch_spin(nanoseconds, e.stream()); }
  template <class E>
  void zero(Executor& e, std::span<E> dst) {
    MT_NVTX_RANGE("CudaBackend::zero");
    MT_CUDA_CHECK(cudaMemsetAsync(dst.data(), 0, dst.size_bytes(), e.stream()));
  }
  template <class E>
  void copy(View<const E> src, View<E> dst) {
    MT_NVTX_RANGE("CudaBackend::copy");
    MT_CHECK(src.shape() == dst.shape(), "copy: shapes {} and {} differ", src.shape().str(), dst.shape().str());
    MT_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), static_cast<std::size_t>(src.numel()) * sizeof(E),
                                  cudaMemcpyDeviceToDevice, stream_));
  }

  // ---- primitives ------------------------------------------------------------------------------
  void add(View<const Act> x, View<Act> y) {
    MT_NVTX_RANGE("cuda:add");
    same(x.shape(), y.shape(), "add");
    cuda::launch_add(x.data(), y.data(), x.numel(), stream_);
  }
  /// The residual stream y (fp32) += x.
  void add(View<const Act> x, View<Res> y) {
    MT_NVTX_RANGE("cuda:add_residual");
    same(x.shape(), y.shape(), "add");
    cuda::launch_add(x.data(), y.data(), x.numel(), stream_);
  }
  /// y = r + x: the residual stream r (fp32) plus activations (y may be r).
  void residual_add(View<const Res> r, View<const Act> x, View<Res> y) {
    MT_NVTX_RANGE("cuda:residual_add");
    same(r.shape(), y.shape(), "residual_add");
    same(x.shape(), y.shape(), "residual_add");
    if (y.data() != r.data())
      MT_CUDA_CHECK(cudaMemcpyAsync(y.data(), r.data(), static_cast<std::size_t>(y.numel()) * sizeof(Res),
                                    cudaMemcpyDeviceToDevice, stream_));
    cuda::launch_add(x.data(), y.data(), x.numel(), stream_);
  }
  /// Residual-stream values as activations (rounded to bf16, nearest even).
  void convert(View<const Res> x, View<Act> y) {
    MT_NVTX_RANGE("cuda:convert");
    same(x.shape(), y.shape(), "convert");
    cuda::launch_cast(x.data(), y.data(), x.numel(), stream_);
  }

  void linear(View<const Act> x, View<const Weight> w, View<const Weight> bias, View<Act> y) {
    MT_NVTX_RANGE("cuda:linear");
    const auto [M, K, N] = linear_dims(x, w, y.shape(), bias);
    gemm_->forward(x.data(), w.data(), bias.is_null() ? nullptr : bias.data(), y.data(), M, N, K, stream_);
  }
  /// y = r + x W^T (+ bias), in fp32: a projection added to the residual stream (y may be r);
  /// the sum is formed in cuBLASLt's epilogue, without rounding the product to bf16.
  void linear_add(View<const Act> x, View<const Weight> w, View<const Weight> bias, View<const Res> r, View<Res> y) {
    MT_NVTX_RANGE("cuda:linear_add");
    const auto [M, K, N] = linear_dims(x, w, y.shape(), bias);
    same(r.shape(), y.shape(), "linear_add");
    gemm_->forward_add(x.data(), w.data(), r.data(), y.data(), M, N, K, stream_);
    if (!bias.is_null()) cuda::launch_add_bias(bias.data(), y.data(), M, N, stream_);
  }
  void linear_backward(View<const Act> x, View<const Weight> w, View<const Act> dy, View<Act> dx, bool accumulate_dx,
                       View<Acc> dw, View<Acc> db) {
    MT_NVTX_RANGE("cuda:linear_backward");
    const auto [M, K, N] = linear_dims(x, w, dy.shape(), View<const Weight>{});
    if (!dx.is_null()) {
      same(dx.shape(), x.shape(), "linear_backward dx");
      gemm_->input_grad(dy.data(), w.data(), dx.data(), accumulate_dx, M, N, K, stream_);
    }
    if (dw.is_null()) {  // (the input gradient alone)
      MT_CHECK(db.is_null(), "linear_backward: a bias gradient without the weight's");
      return;
    }
    same(dw.shape(), w.shape(), "linear_backward dw");
    gemm_->weight_grad(dy.data(), x.data(), dw.data(), M, N, K, stream_);
    if (!db.is_null()) {
      MT_CHECK(db.numel() == N, "bias gradient has {} elements, expected {}", db.numel(), N);
      cuda::launch_column_sum(dy.data(), db.data(), M, N, ws(), workspace_.size(), stream_);
    }
  }

  /// y (bf16) = rmsnorm of the residual stream x with the fp32 gain w; rstd saved.
  void rmsnorm(View<const Res> x, View<const full_t<Weight>> w, double eps, View<Act> y, View<Acc> rstd,
               double offset = 0.0) {
    MT_NVTX_RANGE("cuda:rmsnorm");
    same(x.shape(), y.shape(), "rmsnorm");
    MT_CHECK(w.numel() == x.size(1) && rstd.numel() == x.size(0), "rmsnorm: weight {} / rstd {} do not match x {}",
             w.shape().str(), rstd.shape().str(), x.shape().str());
    cuda::launch_rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), x.size(0), x.size(1), static_cast<float>(eps),
                                 stream_, static_cast<float>(offset));
  }
  /// dx = residual (unless null; may be dx) + the input gradient, in fp32; dx_act = bf16(dx)
  /// unless null; dw += the gain's gradient.
  void rmsnorm_backward(View<const Res> x, View<const full_t<Weight>> w, View<const Acc> rstd, View<const Act> dy,
                        View<const Res> residual, View<Res> dx, View<Act> dx_act, View<Acc> dw, double offset = 0.0) {
    MT_NVTX_RANGE("cuda:rmsnorm_backward");
    same(x.shape(), dy.shape(), "rmsnorm_backward dy");
    same(x.shape(), dx.shape(), "rmsnorm_backward dx");
    if (!residual.is_null()) same(x.shape(), residual.shape(), "rmsnorm_backward residual");
    if (!dx_act.is_null()) same(x.shape(), dx_act.shape(), "rmsnorm_backward dx_act");
    MT_CHECK(w.numel() == x.size(1) && rstd.numel() == x.size(0), "rmsnorm_backward: weight {} / rstd {} do not match x {}",
             w.shape().str(), rstd.shape().str(), x.shape().str());
    cuda::launch_rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), residual.is_null() ? nullptr : residual.data(),
                                  dx.data(), dx_act.is_null() ? nullptr : dx_act.data(), dw.data(), x.size(0), x.size(1), ws(),
                                  workspace_.size(), stream_, static_cast<float>(offset));
  }

  /// y (bf16) = RMSNorm of bf16 activation rows with the fp32 gain w (Qwen3's q/k norms); rstd saved.
  void head_rmsnorm(View<const Act> x, View<const full_t<Weight>> w, double eps, View<Act> y, View<Acc> rstd,
                    double offset = 0.0) {
    MT_NVTX_RANGE("cuda:head_rmsnorm");
    same(x.shape(), y.shape(), "head_rmsnorm");
    MT_CHECK(w.numel() == x.size(1) && rstd.numel() == x.size(0), "head_rmsnorm: weight {} / rstd {} do not match x {}",
             w.shape().str(), rstd.shape().str(), x.shape().str());
    cuda::launch_head_rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), x.size(0), x.size(1), static_cast<float>(eps),
                                      stream_, static_cast<float>(offset));
  }
  /// Its backward: dx (bf16, overwritten), dw += the gain's gradient.
  void head_rmsnorm_backward(View<const Act> x, View<const full_t<Weight>> w, View<const Acc> rstd, View<const Act> dy,
                             View<Act> dx, View<Acc> dw, double offset = 0.0) {
    MT_NVTX_RANGE("cuda:head_rmsnorm_backward");
    same(x.shape(), dy.shape(), "head_rmsnorm_backward dy");
    same(x.shape(), dx.shape(), "head_rmsnorm_backward dx");
    MT_CHECK(w.numel() == x.size(1) && rstd.numel() == x.size(0) && dw.numel() == x.size(1),
             "head_rmsnorm_backward: weight {} / rstd {} / dw {} do not match x {}", w.shape().str(), rstd.shape().str(),
             dw.shape().str(), x.shape().str());
    cuda::launch_head_rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data(), x.size(0), x.size(1),
                                       ws(), workspace_.size(), stream_, static_cast<float>(offset));
  }

  void rope(View<Act> x, std::int64_t heads, std::int64_t seq, std::span<const double> inv_freq,
            View<const std::int32_t> positions = {}, double scale = 1.0) {
    MT_NVTX_RANGE("cuda:rope");
    rotate(x, heads, seq, inv_freq, positions, false, scale);
  }
  void rope_backward(View<Act> dx, std::int64_t heads, std::int64_t seq, std::span<const double> inv_freq,
                     View<const std::int32_t> positions = {}, double scale = 1.0) {
    MT_NVTX_RANGE("cuda:rope_backward");
    rotate(dx, heads, seq, inv_freq, positions, true, scale);
  }

  /// Packed rows (s.packed) run as cuDNN's ragged attention where it takes them and the
  /// workspace holds what its plan needs, else on megatrain's own kernel (said once).
  void attention(View<const Act> q, View<const Act> k, View<const Act> v, View<Act> out, View<Acc> lse,
                 const AttentionShape& s, View<const Acc> sinks = {}) {
    MT_NVTX_RANGE("cuda:attention");
    check_attention(q, k, v, out, s);
    check_sinks(sinks, s);
    const auto d = dims(s);
#if MEGATRAIN_HAS_CUDNN
    if (runs_on_cudnn(s) && (sinks.is_null() || s.packed.empty())) {
      attention_->forward(q.data(), k.data(), v.data(), out.data(), lse.data(), d, ws(), workspace_.size(), stream_,
                          starts(s));
      // (GPT-OSS's sinks around cuDNN's attention, which has none: out rescaled, lse with the sink)
      if (!sinks.is_null()) cuda::launch_attention_add_sinks(out.data(), lse.data(), sinks.data(), d, stream_);
      return;
    }
#endif
    cuda::launch_attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), d, stream_, positions(s),
                                   sinks.is_null() ? nullptr : sinks.data());
  }
  /// Decoding with caches (ChunkShape::decode; backend/cuda/decode.hpp): in use since
  /// tests/cuda/test_cuda_decode.cpp passed on an H100 (2026-12-07). False would make generation
  /// recompute each prefix here.
  static constexpr bool kDecodes = true;
  void attention_decode(View<const Act> q, View<const Act> k, View<const Act> v, View<Act> kcache, View<Act> vcache,
                        const DecodeRows& d, View<Act> out, const AttentionShape& s, View<const Acc> sinks = {}) {
    MT_NVTX_RANGE("cuda:attention_decode");
    const std::int64_t rows = q.rank() == 2 ? q.size(0) : 0, width = s.kv_heads * s.head_dim;
    MT_CHECK(q.numel() == rows * s.heads * s.head_dim && out.shape() == q.shape() && k.numel() == rows * width &&
                 v.numel() == k.numel() && d.positions.numel() == rows && d.first + rows <= d.rows &&
                 kcache.numel() == d.rows * d.capacity * width && vcache.numel() == kcache.numel(),
             "attention_decode: q {}, k {}, v {}, out {} for {} rows; caches of {} and {} for {} rows x {} tokens",
             q.shape().str(), k.shape().str(), v.shape().str(), out.shape().str(), rows, kcache.numel(), vcache.numel(),
             d.rows, d.capacity);
    check_sinks(sinks, s);
    cuda::launch_attention_decode(q.data(), k.data(), v.data(), kcache.data(), vcache.data(), d.positions.data(), rows,
                                  d.first, d.capacity, s.heads, s.kv_heads, s.head_dim, static_cast<float>(s.softmax_scale()),
                                  s.window, sinks.is_null() ? nullptr : sinks.data(), out.data(), stream_);
  }
  void attention_backward(View<const Act> q, View<const Act> k, View<const Act> v, View<const Act> out,
                          View<const Acc> lse, View<const Act> dout, View<Act> dq, View<Act> dk, View<Act> dv,
                          const AttentionShape& s, View<const Acc> sinks = {}, View<Acc> dsinks = {}) {
    MT_NVTX_RANGE("cuda:attention_backward");
    check_attention(q, k, v, out, s);
    check_sinks(sinks, s);
    MT_CHECK(sinks.is_null() == dsinks.is_null() && (dsinks.is_null() || dsinks.numel() == s.heads),
             "attention_backward: sinks and their gradient come together ([{}] each)", s.heads);
    const auto d = dims(s);
#if MEGATRAIN_HAS_CUDNN
    if (runs_on_cudnn(s) && (sinks.is_null() || s.packed.empty())) {  // (the forward's choice: lse is laid out for it)
      attention_->backward(q.data(), k.data(), v.data(), out.data(), lse.data(), dout.data(), dq.data(), dk.data(),
                           dv.data(), d, ws(), workspace_.size(), stream_, starts(s));
      if (!sinks.is_null())
        cuda::launch_attention_sinks_grad(out.data(), dout.data(), lse.data(), sinks.data(), dsinks.data(), d, ws(),
                                          workspace_.size(), stream_);
      return;
    }
#endif
    cuda::launch_attention_backward(q.data(), k.data(), v.data(), out.data(), lse.data(), dout.data(), dq.data(),
                                      dk.data(), dv.data(), d, ws(), workspace_.size(), stream_, positions(s),
                                      sinks.is_null() ? nullptr : sinks.data(), dsinks.is_null() ? nullptr : dsinks.data());
  }

  static_assert(static_cast<int>(Activation::silu) == 0 && static_cast<int>(Activation::gelu_tanh) == 1 &&
                    static_cast<int>(Activation::clamped_swiglu) == 2,
                "launch_swiglu_* number the activations as megatrain::Activation does");
  static void check_sinks(View<const Acc> sinks, const AttentionShape& s) {
    MT_CHECK(sinks.is_null() || sinks.numel() == s.heads, "attention: {} sinks for {} query heads", sinks.numel(), s.heads);
  }

  /// m = act(g) * u (SwiGLU, or GeGLU with Activation::gelu_tanh).
  // ---- output gates (gated attention's q_proj; the shared expert's) ------------------------------
  /// As the CPU backend's (cpu_backend.hpp): the values and gate inputs of each head of dim.
  void split_halves(View<const Act> both, std::int64_t dim, View<Act> x, View<Act> gate) {
    same(x.shape(), gate.shape(), "split_halves");
    MT_CHECK(both.numel() == 2 * x.numel() && dim > 0 && x.numel() % dim == 0, "split_halves: {} into {} by {}",
             both.shape().str(), x.shape().str(), dim);
    cuda::launch_split_halves(both.data(), x.numel(), dim, x.data(), gate.data(), stream_);
  }
  void merge_halves(View<const Act> dx, View<const Act> dgate, std::int64_t dim, View<Act> both) {
    same(dx.shape(), dgate.shape(), "merge_halves");
    MT_CHECK(both.numel() == 2 * dx.numel() && dim > 0 && dx.numel() % dim == 0, "merge_halves: {} from {} by {}",
             both.shape().str(), dx.shape().str(), dim);
    cuda::launch_merge_halves(dx.data(), dgate.data(), dx.numel(), dim, both.data(), stream_);
  }
  /// sigmoid_gate takes a gate per group of features (SharedExpertBackend).
  static constexpr bool kSigmoidGatePerGroup = true;
  /// y = x * sigmoid(gate), gate [rows, G] over x [rows, D] (cpu_backend.hpp's contract).
  void sigmoid_gate(View<const Act> x, View<const Act> gate, View<Act> y) {
    same(x.shape(), y.shape(), "sigmoid_gate");
    cuda::launch_sigmoid_gate(x.data(), gate.data(), x.numel(), gate_group(x, gate, "sigmoid_gate"), y.data(), stream_);
  }
  void sigmoid_gate_backward(View<const Act> x, View<const Act> gate, View<const Act> dy, View<Act> dx, View<Act> dgate) {
    same(dy.shape(), dx.shape(), "sigmoid_gate_backward");
    same(x.shape(), dx.shape(), "sigmoid_gate_backward");
    same(gate.shape(), dgate.shape(), "sigmoid_gate_backward");
    const std::int64_t group = gate_group(x, gate, "sigmoid_gate_backward");
    cuda::launch_sigmoid_gate_backward(x.data(), gate.data(), dy.data(), gate.numel(), group, dx.data(), dgate.data(),
                                       stream_);
  }

  // ---- Gated DeltaNet (linear attention) --------------------------------------------------------
  using DeltaNetIn = DeltaNetOperands<Act, Weight, full_t<Weight>>;
  /// The mixing of a linear-attention layer (layers/ops/gated_deltanet.hpp): o (the delta rule's
  /// output), rstd and y (the gated norm's) from the projections.
  void gated_deltanet_mix(const DeltaNetIn& m, View<Act> o, View<Acc> rstd, View<Act> y) {
    MT_NVTX_RANGE("cuda:gated_deltanet_mix");
    const cuda::DeltaNetSequences q = delta_net_sequences(m, opt_.delta_net_window);
    check_delta_net_out(m, o.shape(), rstd.numel(), y.shape());
    void* w = delta_net_workspace(m.shape, q, false);
    cuda::launch_delta_net_forward(m.shape, q, delta_net_inputs(m), o.data(), rstd.data(), y.data(), w, workspace_.size(),
                                   stream_);
  }
  /// Its step for one token a row over the rows' caches (backend/cuda/decode.hpp; see kDecodes).
  void gated_deltanet_decode(const DeltaNetIn& m, const DecodeRows& d, View<Act> taps, View<Acc> state, View<Act> y) {
    MT_NVTX_RANGE("cuda:gated_deltanet_decode");
    const DeltaNetShape& s = m.shape;
    const std::int64_t rows = m.chunk.tokens();
    MT_CHECK(m.chunk.seq == 1 && d.positions.numel() == rows && d.first + rows <= d.rows &&
                 taps.numel() == d.rows * (s.taps - 1) * s.conv_dim() && state.numel() == d.rows * s.value_heads * s.dk * s.dv &&
                 y.numel() == rows * s.value_dim(),
             "gated_deltanet_decode: {} rows of one token; caches of {} taps and {} state elements for {} rows", rows,
             taps.numel(), state.numel(), d.rows);
    cuda::DeltaNetDecodeArgs a;
    a.rows = rows;
    a.first = d.first;
    a.key_heads = s.key_heads;
    a.value_heads = s.value_heads;
    a.dk = s.dk;
    a.dv = s.dv;
    a.taps = s.taps;
    a.norm_eps = s.norm_eps;
    a.positions = d.positions.data();
    a.mixed = m.mixed.data();
    a.z = m.z.data();
    a.a = m.a.data();
    a.b = m.b.data();
    a.conv = m.conv.data();
    a.A_log = m.A_log.data();
    a.dt_bias = m.dt_bias.data();
    a.norm = m.norm.data();
    a.taps_cache = taps.data();
    a.state = state.data();
    a.y = y.data();
    cuda::launch_deltanet_decode(a, stream_);
  }
  /// Qwen3-Next's fused projections of n tokens (in_proj_qkvz's and in_proj_ba's outputs, grouped
  /// per key head) into the separate layout's rows (mixed, z, b, a); deltanet_fuse: back.
  void deltanet_unfuse(const DeltaNetShape& s, View<const Act> qkvz, View<const Act> ba, View<Act> mixed, View<Act> z,
                       View<Act> b, View<Act> a) {
    check_fused(s, qkvz.shape(), ba.shape(), mixed.shape(), z.shape(), b.shape(), a.shape());
    cuda::launch_delta_net_fused_layout(s, qkvz.size(0), const_cast<bf16*>(qkvz.data()), const_cast<bf16*>(ba.data()),
                                        mixed.data(), z.data(), b.data(), a.data(), false, stream_);
  }
  void deltanet_fuse(const DeltaNetShape& s, View<const Act> mixed, View<const Act> z, View<const Act> b, View<const Act> a,
                     View<Act> qkvz, View<Act> ba) {
    check_fused(s, qkvz.shape(), ba.shape(), mixed.shape(), z.shape(), b.shape(), a.shape());
    cuda::launch_delta_net_fused_layout(s, qkvz.size(0), qkvz.data(), ba.data(), const_cast<bf16*>(mixed.data()),
                                        const_cast<bf16*>(z.data()), const_cast<bf16*>(b.data()),
                                        const_cast<bf16*>(a.data()), true, stream_);
  }
  /// Its backward from dy and the forward's o and rstd: the projections' gradients overwritten,
  /// the convolution's, A_log's, dt_bias's and the gain's added to.
  void gated_deltanet_mix_backward(const DeltaNetIn& m, View<const Act> o, View<const Acc> rstd, View<const Act> dy,
                                   const DeltaNetGradients<Act, Acc>& g) {
    MT_NVTX_RANGE("cuda:gated_deltanet_mix_backward");
    const cuda::DeltaNetSequences q = delta_net_sequences(m, opt_.delta_net_window);
    check_delta_net_out(m, o.shape(), rstd.numel(), dy.shape());
    same(g.mixed.shape(), m.mixed.shape(), "gated_deltanet_mix_backward dmixed");
    same(g.z.shape(), m.z.shape(), "gated_deltanet_mix_backward dz");
    same(g.a.shape(), m.a.shape(), "gated_deltanet_mix_backward da");
    same(g.b.shape(), m.b.shape(), "gated_deltanet_mix_backward db");
    MT_CHECK(g.conv.numel() == m.conv.numel() && g.A_log.numel() == m.A_log.numel() &&
                 g.dt_bias.numel() == m.dt_bias.numel() && g.norm.numel() == m.norm.numel(),
             "gated_deltanet_mix_backward: a parameter's gradient differs from it in size");
    void* w = delta_net_workspace(m.shape, q, true);
    cuda::launch_delta_net_backward(m.shape, q, delta_net_inputs(m), o.data(), rstd.data(), dy.data(),
                                    {g.mixed.data(), g.z.data(), g.a.data(), g.b.data(), g.conv.data(), g.A_log.data(),
                                     g.dt_bias.data(), g.norm.data()},
                                    w, workspace_.size(), stream_);
  }

  void swiglu(View<const Act> g, View<const Act> u, View<Act> m, Activation act = Activation::silu) {
    MT_NVTX_RANGE("cuda:swiglu");
    same(g.shape(), u.shape(), "swiglu");
    same(g.shape(), m.shape(), "swiglu");
    cuda::launch_swiglu_forward(g.data(), u.data(), m.data(), g.numel(), stream_, static_cast<int>(act));
  }
  /// dg, du; with `m` (else null) also the forward's m, the same bits as swiglu() (CpuBackend).
  void swiglu_backward(View<const Act> g, View<const Act> u, View<const Act> dm, View<Act> dg, View<Act> du,
                       Activation act = Activation::silu, View<Act> m = {}) {
    MT_NVTX_RANGE("cuda:swiglu_backward");
    same(g.shape(), dm.shape(), "swiglu_backward");
    if (!m.is_null()) same(g.shape(), m.shape(), "swiglu_backward m");
    cuda::launch_swiglu_backward(g.data(), u.data(), dm.data(), dg.data(), du.data(), g.numel(), stream_,
                                 static_cast<int>(act), m.is_null() ? nullptr : m.data());
  }

  /// y[t] = table[ids[t]] * scale (Gemma's sqrt(hidden); 1 elsewhere).
  void embedding(View<const std::int32_t> ids, View<const Weight> table, View<Res> y, double scale = 1.0) {
    MT_NVTX_RANGE("cuda:embedding");
    MT_CHECK(y.size(0) == ids.numel() && y.size(1) == table.size(1), "embedding: output {} does not match {} ids x {}",
             y.shape().str(), ids.numel(), table.size(1));
    cuda::launch_embedding_forward(ids.data(), table.data(), y.data(), ids.numel(), table.size(1), table.size(0), stream_,
                                   static_cast<float>(scale));
  }
  /// The same from an fp32 table (fp32 master rows: the lookup as PyTorch's autocast does it).
  void embedding(View<const std::int32_t> ids, View<const float> table, View<Res> y, double scale = 1.0) {
    MT_NVTX_RANGE("cuda:embedding");
    MT_CHECK(y.size(0) == ids.numel() && y.size(1) == table.size(1), "embedding: output {} does not match {} ids x {}",
             y.shape().str(), ids.numel(), table.size(1));
    cuda::launch_embedding_forward(ids.data(), table.data(), y.data(), ids.numel(), table.size(1), table.size(0), stream_,
                                   static_cast<float>(scale));
  }
  /// dtable[ids[t]] += dy[t] * scale, except where ids[t] == skip_id (padding_idx; -1: none).
  void embedding_backward(View<const std::int32_t> ids, View<const Res> dy, View<Acc> dtable, std::int32_t skip_id = -1,
                          double scale = 1.0) {
    MT_NVTX_RANGE("cuda:embedding_backward");
    cuda::launch_embedding_backward(ids.data(), dy.data(), dtable.data(), ids.numel(), dtable.size(1), dtable.size(0), ws(),
                                    workspace_.size(), stream_, skip_id, static_cast<float>(scale));
  }

  void take_rows(View<const std::int32_t> rows, View<Acc> table, View<Acc> out) {
    MT_NVTX_RANGE("cuda:take_rows");
    MT_CHECK(out.size(0) == rows.numel() && out.size(1) == table.size(1), "take_rows: output {} does not match {} rows x {}",
             out.shape().str(), rows.numel(), table.size(1));
    cuda::launch_take_rows(rows.data(), table.data(), out.data(), rows.numel(), table.size(1), table.size(0), stream_);
  }

  /// sum[0] = the sum of x's squared elements, in double, in a fixed order (deterministic).
  void sum_squares(View<const Acc> x, View<double> sum) {
    MT_NVTX_RANGE("cuda:sum_squares");
    MT_CHECK(sum.numel() == 1, "sum_squares: the result is one element, not {}", sum.shape().str());
    cuda::launch_sum_squares(x.data(), x.numel(), sum.data(), ws(), workspace_.size(), stream_);
  }

  /// One AdamW step in device memory (optim/adamw.hpp's formula, bit for bit the host
  /// optimizer's): p, m, v updated in place from the gradient g, and w = bf16(p).
  void adamw(const AdamWScalars<float>& s, std::span<float> p, std::span<float> m, std::span<float> v, std::span<const Acc> g,
             std::span<Weight> w) {
    MT_NVTX_RANGE("cuda:adamw");
    const std::size_t n = p.size();
    MT_CHECK(m.size() == n && v.size() == n && g.size() == n && (w.empty() || w.size() == n),
             "adamw: p {}, m {}, v {}, g {} and w {} elements differ", n, m.size(), v.size(), g.size(), w.size());
    const cuda::AdamWArgs a{s.decay, s.one_minus_b1, s.beta2, s.one_minus_b2, s.bc2_sqrt, s.eps, s.step_size, s.grad_scale};
    cuda::launch_adamw(a, p.data(), m.data(), v.data(), g.data(), w.empty() ? nullptr : w.data(),
                       static_cast<std::int64_t>(n), stream_);
  }

  // ---- mixture of experts (MoeMlp; CpuBackend's moe_* primitives are the reference) ------------
  /// The routing of M tokens over E experts, grouped by expert (CpuBackend::moe_route).
  void moe_route(View<const Act> logits, std::int64_t k, bool renormalize, View<Acc> probs, View<std::int32_t> experts,
                 View<Acc> weights, View<std::int32_t> order, View<std::int32_t> slot, View<std::int64_t> offsets) {
    MT_NVTX_RANGE("cuda:moe_route");
    MT_CHECK(logits.rank() == 2, "moe_route: logits {} must be [tokens, experts]", logits.shape().str());
    const std::int64_t M = logits.size(0), E = logits.size(1), N = M * k;
    MT_CHECK(probs.shape() == logits.shape() && experts.numel() == N && weights.numel() == N && order.numel() == N &&
                 slot.numel() == N && offsets.numel() == E + 1,
             "moe_route: {} tokens over {} experts, top {}: buffers probs {}, experts {}, weights {}, order {}, slot {}, "
             "offsets {}", M, E, k, probs.shape().str(), experts.shape().str(), weights.shape().str(),
             order.shape().str(), slot.shape().str(), offsets.shape().str());
    cuda::launch_moe_route(logits.data(), M, E, k, renormalize, probs.data(), experts.data(), weights.data(), order.data(),
                           slot.data(), offsets.data(), moe_ws_.span().data(), cuda::kMoeRouteWorkspace, stream_);
  }
  /// xs[r] = x[order[r] / k].
  void moe_gather(View<const Act> x, View<const std::int32_t> order, std::int64_t k, View<Act> xs) {
    MT_NVTX_RANGE("cuda:moe_gather");
    const std::int64_t N = order.numel(), d = x.size(1);
    MT_CHECK(xs.rank() == 2 && xs.size(0) == N && xs.size(1) == d && N == x.size(0) * k, "moe_gather: {} rows of {} into {}",
             N, x.shape().str(), xs.shape().str());
    cuda::launch_moe_gather(x.data(), order.data(), k, N, d, xs.data(), stream_);
  }
  /// y[rows of e] = x[rows of e] w[e]^T for every expert: one kernel, which reads the offsets on
  /// the device (no synchronisation; cuda::launch_grouped_forward).
  void grouped_linear(View<const Act> x, std::span<const View<const Weight>> w, View<const std::int64_t> offsets,
                      View<Act> y, std::span<const View<const Weight>> bias = {}) {
    MT_NVTX_RANGE("cuda:grouped_linear");
    const auto [N, K] = grouped_dims(x, w, offsets, y.shape(), "grouped_linear");
    cuda::launch_grouped_forward(x.data(), weight_pointers(w), y.data(), offsets.data(), x.size(0), N, K, stream_);
    if (bias.empty()) return;
    MT_CHECK(bias.size() == w.size(), "grouped_linear: {} biases for {} experts", bias.size(), w.size());
    for (const auto& b : bias) MT_CHECK(b.numel() == N, "grouped_linear: a bias of {} for {} outputs", b.numel(), N);
    // (one launch where the experts' biases lie at equal distances, as in a unit's slab; else one per expert)
    const auto E = static_cast<std::int64_t>(w.size());
    if (const auto stride = even_stride(bias)) {
      cuda::launch_moe_bias_add(y.data(), y.size(0), N, offsets.data(), E, bias[0].data(), *stride, stream_);
      return;
    }
    for (std::int64_t e = 0; e < E; ++e)
      cuda::launch_moe_bias_add(y.data(), y.size(0), N, offsets.data() + e, 1, bias[static_cast<std::size_t>(e)].data(), 0,
                                stream_);
  }
  /// dx (or dx += where accumulate_dx) and dw[e] += dy^T x over each expert's rows (a kernel each,
  /// as grouped_linear).
  void grouped_linear_backward(View<const Act> x, std::span<const View<const Weight>> w, View<const Act> dy, View<Act> dx,
                               bool accumulate_dx, std::span<const View<Acc>> dw, View<const std::int64_t> offsets,
                               std::span<const View<Acc>> dbias = {}) {
    MT_NVTX_RANGE("cuda:grouped_linear_backward");
    const auto [N, K] = grouped_dims(x, w, offsets, dy.shape(), "grouped_linear_backward");
    MT_CHECK(dw.size() == w.size(), "grouped_linear_backward: {} gradients for {} experts", dw.size(), w.size());
    std::vector<float*> gp(dw.size());
    for (std::size_t e = 0; e < dw.size(); ++e) {
      same(dw[e].shape(), w[e].shape(), "grouped_linear_backward dw");
      gp[e] = dw[e].data();
    }
    const std::int64_t rows = x.size(0);
    if (!dx.is_null()) {
      same(dx.shape(), x.shape(), "grouped_linear_backward dx");
      cuda::launch_grouped_input_grad(dy.data(), weight_pointers(w), dx.data(), accumulate_dx, offsets.data(), rows, N, K,
                                      stream_);
    }
    cuda::launch_grouped_weight_grad(dy.data(), x.data(), gp, offsets.data(), rows, N, K, stream_);
    if (dbias.empty()) return;
    MT_CHECK(dbias.size() == w.size(), "grouped_linear_backward: {} bias gradients for {} experts", dbias.size(), w.size());
    for (const auto& b : dbias) MT_CHECK(b.numel() == N, "grouped_linear_backward: a bias gradient of {} for {} outputs",
                                         b.numel(), N);
    const auto E = static_cast<std::int64_t>(w.size());
    if (const auto stride = even_stride(dbias)) {
      cuda::launch_moe_bias_grad(dy.data(), N, offsets.data(), E, dbias[0].data(), *stride, stream_);
      return;
    }
    for (std::int64_t e = 0; e < E; ++e)
      cuda::launch_moe_bias_grad(dy.data(), N, offsets.data() + e, 1, dbias[static_cast<std::size_t>(e)].data(), 0, stream_);
  }
  /// The distance in elements between consecutive views that lie at equal distances (the experts'
  /// biases in a unit's slab), or none.
  template <class E>
  static std::optional<std::int64_t> even_stride(std::span<const View<E>> v) {
    if (v.size() < 2) return std::int64_t{0};
    const auto at = [&](std::size_t i) { return reinterpret_cast<std::uintptr_t>(v[i].data()); };
    if (at(1) < at(0) || (at(1) - at(0)) % sizeof(E) != 0) return std::nullopt;
    const std::uintptr_t step = at(1) - at(0);
    for (std::size_t i = 2; i < v.size(); ++i)
      if (at(i) != at(0) + i * step) return std::nullopt;
    return static_cast<std::int64_t>(step / sizeof(E));
  }
  /// y[t] = h[t] + the weighted sum of the token's experts' outputs, in increasing expert index
  /// (y may be h).
  void moe_combine(View<const Act> out, View<const std::int32_t> slot, View<const Acc> weights, std::int64_t k,
                   View<const Res> h, View<Res> y) {
    MT_NVTX_RANGE("cuda:moe_combine");
    const std::int64_t M = h.size(0), d = h.size(1);
    MT_CHECK(slot.numel() == M * k && weights.numel() == M * k && out.size(0) == M * k && out.size(1) == d &&
                 y.shape() == h.shape(),
             "moe_combine: {} tokens, top {}: out {}, y {}", M, k, out.shape().str(), y.shape().str());
    cuda::launch_moe_combine(out.data(), slot.data(), weights.data(), k, h.data(), y.data(), M, d, stream_);
  }
  /// dout[slot[t, j]] = weights[t, j] * dy[t], dweights[t, j] = <dy[t], out[slot[t, j]]>.
  void moe_combine_backward(View<const Act> dy, View<const Act> out, View<const std::int32_t> slot, View<const Acc> weights,
                            std::int64_t k, View<Act> dout, View<Acc> dweights) {
    MT_NVTX_RANGE("cuda:moe_combine_backward");
    const std::int64_t M = dy.size(0), d = dy.size(1);
    MT_CHECK(slot.numel() == M * k && dweights.numel() == M * k && weights.numel() == M * k && out.size(0) == M * k &&
                 out.size(1) == d && dout.shape() == out.shape(),
             "moe_combine_backward: {} tokens, top {}: out {}, dout {}", M, k, out.shape().str(), dout.shape().str());
    cuda::launch_moe_combine_backward(dy.data(), out.data(), slot.data(), weights.data(), k, M, d, dout.data(),
                                      dweights.data(), stream_);
  }
  /// dlogits through the renormalisation (where the family has it) and the softmax.
  void moe_route_backward(View<const Acc> probs, View<const std::int32_t> experts, View<const Acc> weights,
                          View<const Acc> dweights, std::int64_t k, bool renormalize, View<const std::int64_t> aux_counts,
                          double aux_scale, View<const std::uint8_t> valid, View<Act> dlogits) {
    MT_NVTX_RANGE("cuda:moe_route_backward");
    const std::int64_t M = probs.size(0), E = probs.size(1);
    MT_CHECK(dlogits.shape() == probs.shape() && experts.numel() == M * k && weights.numel() == M * k &&
                 dweights.numel() == M * k && (valid.is_null() || valid.numel() == M),
             "moe_route_backward: probs {}, dlogits {}, top {}, valid {}", probs.shape().str(), dlogits.shape().str(), k,
             valid.shape().str());
    MT_CHECK(aux_counts.is_null() || (aux_counts.numel() > 0 && aux_counts.numel() % E == 0),
             "moe_route_backward: auxiliary counts {} for {} experts", aux_counts.shape().str(), E);
    cuda::launch_moe_route_backward(probs.data(), experts.data(), weights.data(), dweights.data(), k, renormalize,
                                    aux_counts.is_null() ? nullptr : aux_counts.data(),
                                    aux_counts.is_null() ? 0 : aux_counts.numel() / E, aux_scale,
                                    valid.is_null() ? nullptr : valid.data(), M, E, dlogits.data(), stream_);
  }
  /// A layer's routing statistics (CpuBackend::moe_record).
  void moe_record(View<const Acc> probs, View<const std::int32_t> experts, View<const std::int64_t> offsets,
                  View<const std::uint8_t> valid, View<std::int64_t> counts, View<double> prob_sums) {
    MT_NVTX_RANGE("cuda:moe_record");
    const std::int64_t M = probs.size(0), E = probs.size(1);
    MT_CHECK(offsets.numel() == E + 1 && counts.numel() == E && prob_sums.numel() == E &&
                 (valid.is_null() || (valid.numel() == M && (M == 0 || experts.numel() % M == 0))),
             "moe_record: probs {}, experts {}, offsets {}, valid {}, counts {}, sums {}", probs.shape().str(),
             experts.shape().str(), offsets.shape().str(), valid.shape().str(), counts.shape().str(), prob_sums.shape().str());
    cuda::launch_moe_record(probs.data(), experts.data(), M > 0 ? experts.numel() / M : 0, offsets.data(),
                            valid.is_null() ? nullptr : valid.data(), M, E, counts.data(), prob_sums.data(), stream_);
  }
  /// dx[t] += the sum of dxs[slot[t, j]] over its k experts.
  void moe_scatter_add(View<const Act> dxs, View<const std::int32_t> slot, std::int64_t k, View<Act> dx) {
    MT_NVTX_RANGE("cuda:moe_scatter_add");
    const std::int64_t M = dx.size(0), d = dx.size(1);
    MT_CHECK(slot.numel() == M * k && dxs.size(0) == M * k && dxs.size(1) == d, "moe_scatter_add: {} rows into {}",
             dxs.shape().str(), dx.shape().str());
    cuda::launch_moe_scatter_add(dxs.data(), slot.data(), k, dx.data(), M, d, stream_);
  }

  /// Per-token cross-entropy of h w^T, in blocks of logits_block tokens: fp32 logits from
  /// cuBLASLt, then one kernel for loss and scale * (softmax - onehot) in bf16 (scale: loss_scale
  /// x the token's weight, 1 where token_weights is null), then the two products of the backward
  /// (dh rows of the block; dW += in fp32).
  void lm_head_loss(View<const Act> h, View<const Weight> w, View<const std::int32_t> labels, double loss_scale,
                    View<const Acc> token_weights, View<Acc> loss, View<Act> dh, View<Acc> dw) {
    MT_NVTX_RANGE("cuda:lm_head_loss");
    const std::int64_t M = h.size(0), d = h.size(1), V = w.size(0);
    MT_CHECK(w.size(1) == d && labels.numel() == M && loss.numel() == M &&
                 (token_weights.is_null() || token_weights.numel() == M),
             "lm_head_loss: h {}, w {}, labels {}, token weights {}, loss {} do not agree", h.shape().str(), w.shape().str(),
             labels.shape().str(), token_weights.is_null() ? "none" : token_weights.shape().str(), loss.shape().str());
    const std::int64_t block = std::min(opt_.logits_block, M);
    MT_CHECK(logits_.size() >= static_cast<std::size_t>(block * V),
             "lm_head_loss: the logits workspace holds {} elements, {} needed: call prepare() first", logits_.size(),
             block * V);
    const bool backward = !dh.is_null();
    for (std::int64_t b = 0; b < M; b += block) {
      const std::int64_t n = std::min(block, M - b);
      gemm_->forward_f32(h.data() + b * d, w.data(), logits_.span().data(), n, V, d, stream_);
      cuda::launch_cross_entropy(logits_.span().data(), labels.data() + b, loss.data() + b,
                                 backward ? dlogits_.span().data() : nullptr, static_cast<float>(loss_scale),
                                 token_weights.is_null() ? nullptr : token_weights.data() + b, n, V, stream_);
      if (!backward) continue;
      gemm_->input_grad(dlogits_.span().data(), w.data(), dh.data() + b * d, false, n, V, d, stream_);
      if (!dw.is_null()) gemm_->weight_grad(dlogits_.span().data(), h.data() + b * d, dw.data(), n, V, d, stream_);
    }
  }
  /// The same with every token's weight 1.
  void lm_head_loss(View<const Act> h, View<const Weight> w, View<const std::int32_t> labels, double loss_scale,
                    View<Acc> loss, View<Act> dh, View<Acc> dw) {
    lm_head_loss(h, w, labels, loss_scale, View<const Acc>{}, loss, dh, dw);
  }

 private:
  // What prepare() allocates for a plan: workspace bytes, and logits elements (fp32 and bf16).
  struct Needs {
    std::size_t workspace = 0, logits = 0;
  };
  Needs needs(const WorkspacePlan& plan) {
    std::size_t ws = 0;
    const std::int64_t M = plan.max_tokens, W = plan.max_width;
    ws = std::max(ws, cuda::embedding_backward_workspace_bytes(M));
    ws = std::max(ws, cuda::rmsnorm_backward_workspace_bytes(std::max(M, opt_.logits_block), W));
    ws = std::max(ws, cuda::column_sum_workspace_bytes(M, W));
    ws = std::max(ws, cuda::sum_squares_workspace_bytes(std::numeric_limits<std::int32_t>::max()));  // any size
    for (const auto& s : plan.attention) {
      const auto d = dims(s);
      ws = std::max(ws, cuda::attention_backward_workspace_bytes(d));
#if MEGATRAIN_HAS_CUDNN
      if (use_cudnn(d)) ws = std::max({ws, attention_->forward_workspace_bytes(d), attention_->backward_workspace_bytes(d)});
      if (plan.packed) {
        auto p = d;
        p.sequences = std::min(d.rows * plan.packed_sequences_per_row, d.rows * d.seq);
        p.longest = d.seq;
        if (use_cudnn(p)) ws = std::max({ws, attention_->forward_workspace_bytes(p), attention_->backward_workspace_bytes(p)});
      }
#endif
    }
    if (plan.linear_attention)
      ws = std::max(ws, delta_net_workspace_bytes(*plan.linear_attention, M, plan.most_sequences(), true, opt_.delta_net_window));
    const auto lb = static_cast<std::size_t>(std::min(opt_.logits_block, std::max<std::int64_t>(M, 1)));
    return {ws, lb * static_cast<std::size_t>(plan.vocab)};
  }

  static cuda::DeltaNetSequences delta_net_sequences(const DeltaNetIn& m, std::int64_t window) {
    const ChunkShape& c = m.chunk;
    cuda::DeltaNetSequences q;
    q.tokens = c.tokens();
    q.window = window;
    if (c.packed.empty()) {
      q.count = c.rows;
      q.seq = c.seq;
      return q;
    }
    const auto& hs = c.packed.host_starts;
    MT_CHECK(hs.size() >= 2 && hs.back() - hs.front() == q.tokens && c.packed.positions.numel() == q.tokens &&
                 c.packed.starts.numel() == static_cast<std::int64_t>(hs.size()),
             "gated_deltanet_mix: the packed sequences cover {} of the chunk's {} tokens",
             hs.empty() ? 0 : hs.back() - hs.front(), q.tokens);
    for (std::size_t i = 1; i < hs.size(); ++i) MT_CHECK(hs[i] > hs[i - 1], "gated_deltanet_mix: packed sequence {} is empty", i - 1);
    q.starts = c.packed.starts.data();
    q.base = hs.front();
    q.host_starts = hs;
    q.positions = c.packed.positions.data();
    q.count = c.packed.count();
    return q;
  }
  static void check_fused(const DeltaNetShape& s, const Shape& qkvz, const Shape& ba, const Shape& mixed, const Shape& z,
                          const Shape& b, const Shape& a) {
    const std::int64_t n = qkvz.rank() == 2 ? qkvz[0] : -1;
    MT_CHECK(qkvz == Shape({n, s.conv_dim() + s.value_dim()}) && ba == Shape({n, 2 * s.value_heads}) &&
                 mixed == Shape({n, s.conv_dim()}) && z == Shape({n, s.value_dim()}) && b == Shape({n, s.value_heads}) &&
                 a == Shape({n, s.value_heads}),
             "deltanet_unfuse: qkvz {} and ba {} do not match mixed {}, z {}, b {}, a {}", qkvz.str(), ba.str(), mixed.str(),
             z.str(), b.str(), a.str());
  }
  static cuda::DeltaNetInputs delta_net_inputs(const DeltaNetIn& m) {
    return {m.mixed.data(), m.z.data(), m.a.data(), m.b.data(), m.conv.data(), m.A_log.data(), m.dt_bias.data(),
            m.norm.data()};
  }
  static void check_delta_net_out(const DeltaNetIn& m, const Shape& o, std::int64_t rstd, const Shape& y) {
    const DeltaNetShape& s = m.shape;
    cuda::check_delta_net_shape(s);
    const std::int64_t T = m.chunk.tokens();
    MT_CHECK(m.mixed.shape() == Shape({T, s.conv_dim()}) && m.z.shape() == Shape({T, s.value_dim()}) &&
                 m.a.shape() == Shape({T, s.value_heads}) && m.b.shape() == Shape({T, s.value_heads}) &&
                 m.conv.numel() == s.conv_dim() * s.taps && m.A_log.numel() == s.value_heads &&
                 m.dt_bias.numel() == s.value_heads && m.norm.numel() == s.dv,
             "gated_deltanet_mix: operands of {} tokens do not fit {} key and {} value heads of {} and {}", T, s.key_heads,
             s.value_heads, s.dk, s.dv);
    MT_CHECK(o == Shape({T, s.value_dim()}) && y == Shape({T, s.value_dim()}) && rstd == T * s.value_heads,
             "gated_deltanet_mix: outputs {}, {} and rstd of {} for {} tokens of {} value heads of {}", o.str(), y.str(),
             rstd, T, s.value_heads, s.dv);
  }
  /// The workspace, grown (once the stream is idle) if prepare() did not foresee this chunk.
  void* delta_net_workspace(const DeltaNetShape& s, const cuda::DeltaNetSequences& q, bool backward) {
    const std::size_t need = delta_net_workspace_bytes(s, q.tokens, q.count, backward, q.window);
    if (need > workspace_.size()) {
      log_info("GPU: the linear attention of {} tokens in {} sequences grows the workspace to {}", q.tokens, q.count,
               format_bytes(need));
      synchronize();
      workspace_ = Buffer<std::byte>{};
      workspace_ = alloc<std::byte>(need);
    }
    return ws();
  }

  struct GroupedDims {
    std::int64_t N, K;
  };
  /// x [rows, K], each w[e] [N, K], y [rows, N], offsets [E + 1].
  static GroupedDims grouped_dims(View<const Act> x, std::span<const View<const Weight>> w, View<const std::int64_t> offsets,
                                  const Shape& y, const char* what) {
    MT_CHECK(!w.empty() && x.rank() == 2 && y.rank() == 2 && offsets.numel() == static_cast<std::int64_t>(w.size()) + 1,
             "{}: x {}, y {}, {} experts, offsets {}", what, x.shape().str(), y.str(), w.size(), offsets.shape().str());
    const std::int64_t N = w[0].size(0), K = x.size(1);
    for (const auto& we : w)
      MT_CHECK(we.rank() == 2 && we.size(0) == N && we.size(1) == K, "{}: an expert's weight {} is not [{}, {}]", what,
               we.shape().str(), N, K);
    MT_CHECK(y[0] == x.size(0) && y[1] == N, "{}: x {} . w^T does not give {}", what, x.shape().str(), y.str());
    return {N, K};
  }
  static std::vector<const bf16*> weight_pointers(std::span<const View<const Weight>> w) {
    std::vector<const bf16*> p(w.size());
    for (std::size_t e = 0; e < w.size(); ++e) p[e] = w[e].data();
    return p;
  }

  static void same(const Shape& a, const Shape& b, const char* what) {
    MT_CHECK(a == b, "{}: shapes {} and {} differ", what, a.str(), b.str());
  }
  struct LinearDims {
    std::int64_t M, K, N;
  };
  static LinearDims linear_dims(View<const Act> x, View<const Weight> w, const Shape& y, View<const Weight> bias) {
    MT_CHECK(x.rank() == 2 && w.rank() == 2 && y.rank() == 2, "linear: x {}, w {}, y {} must be matrices", x.shape().str(),
             w.shape().str(), y.str());
    const std::int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    MT_CHECK(w.size(1) == K && y[0] == M && y[1] == N, "linear: x {} . w {}^T does not give {}", x.shape().str(),
             w.shape().str(), y.str());
    MT_CHECK(bias.is_null() || bias.numel() == N, "linear: bias {} does not match {} outputs", bias.shape().str(), N);
    return {M, K, N};
  }
  static cuda::AttentionDims dims(const AttentionShape& s) {
    return {s.rows,   s.seq, s.heads, s.kv_heads, s.head_dim, s.packed.count(), s.packed.empty() ? 0 : s.packed.longest(),
            s.scale, s.window};
  }
  bool runs_on_cudnn(const AttentionShape& s) {
    const auto d = dims(s);
#if MEGATRAIN_HAS_CUDNN
    return use_cudnn(d) && (s.packed.empty() || packed_fits(d));
#else
    return use_cudnn(d);
#endif
  }
  static const std::int32_t* positions(const AttentionShape& s) { return s.packed.empty() ? nullptr : s.packed.positions.data(); }
  static const std::int32_t* starts(const AttentionShape& s) { return s.packed.empty() ? nullptr : s.packed.starts.data(); }
#if MEGATRAIN_HAS_CUDNN
  /// Whether the workspace holds what cuDNN's packed plans for `d` need (both directions); says
  /// once when it does not, and the own kernel runs instead.
  bool packed_fits(const cuda::AttentionDims& d) {
    const std::size_t need = std::max(attention_->forward_workspace_bytes(d), attention_->backward_workspace_bytes(d));
    if (need <= workspace_.size()) return true;
    if (!packed_fallback_said_) {
      log_warning("megatrain: packed attention of {} sequences (the longest {}) needs {:.1f} MiB of cuDNN workspace, {:.1f} "
                  "MiB are allocated: megatrain's own attention kernel runs it (slower)", d.sequences, d.longest,
                  static_cast<double>(need) / (1 << 20), static_cast<double>(workspace_.size()) / (1 << 20));
      packed_fallback_said_ = true;
    }
    return false;
  }
  bool packed_fallback_said_ = false;
#endif
  static void check_attention(View<const Act> q, View<const Act> k, View<const Act> v, View<const Act> out,
                              const AttentionShape& s) {
    s.validate();
    const std::int64_t M = s.rows * s.seq;
    MT_CHECK(q.numel() == M * s.heads * s.head_dim && out.numel() == q.numel() &&
                 k.numel() == M * s.kv_heads * s.head_dim && v.numel() == k.numel(),
             "attention: q {}, k {}, v {}, out {} do not match {} rows x {} tokens, {}/{} heads of {}", q.shape().str(),
             k.shape().str(), v.shape().str(), out.shape().str(), s.rows, s.seq, s.heads, s.kv_heads, s.head_dim);
  }
  void rotate(View<Act> x, std::int64_t heads, std::int64_t seq, std::span<const double> inv_freq,
              View<const std::int32_t> positions, bool inverse, double scale) {
    cuda::RopeFreqs f{};
    f.scale = static_cast<float>(scale);
    MT_CHECK(inv_freq.size() <= static_cast<std::size_t>(cuda::RopeFreqs::kMax), "rope: head_dim {} exceeds {}",
             2 * inv_freq.size(), 2 * cuda::RopeFreqs::kMax);
    f.half = static_cast<int>(inv_freq.size());
    for (std::size_t i = 0; i < inv_freq.size(); ++i) f.inv_freq[i] = static_cast<float>(inv_freq[i]);
    // (the first 2 * half dimensions of each head turn; fewer than head_dim: partial rotary)
    const std::int64_t head_dim = heads > 0 && x.rank() == 2 ? x.size(1) / heads : 0;
    MT_CHECK(x.rank() == 2 && heads > 0 && x.size(1) == heads * head_dim && 2 * f.half <= head_dim && seq > 0 &&
                 x.size(0) % seq == 0,
             "rope: x {} is not [tokens, {} heads x at least {}]", x.shape().str(), heads, 2 * f.half);
    MT_CHECK(positions.is_null() || positions.numel() == x.size(0), "rope: {} positions for {} tokens", positions.numel(),
             x.size(0));
    cuda::launch_rope(x.data(), positions.is_null() ? nullptr : positions.data(), x.size(0), heads, head_dim, seq, f,
                      inverse, stream_);
  }
  void* ws() { return workspace_.size() ? workspace_.span().data() : nullptr; }
  bool use_cudnn([[maybe_unused]] const cuda::AttentionDims& d) {
#if MEGATRAIN_HAS_CUDNN
    return attention_ && attention_->supports(d);
#else
    return false;
#endif
  }

  CudaBackendOptions opt_;
  std::shared_ptr<std::atomic<std::size_t>> allocated_;
  std::size_t limit_ = 0;
  cudaStream_t stream_ = nullptr;
  Buffer<std::byte> gemm_ws_;
  std::unique_ptr<cuda::Gemm> gemm_;
#if MEGATRAIN_HAS_CUDNN
  cudnnHandle_t cudnn_ = nullptr;
  std::unique_ptr<cuda::CudnnAttention> attention_;
#endif
  Buffer<std::byte> workspace_;
  Buffer<float> logits_;
  Buffer<bf16> dlogits_;
  // Mixture of experts: the routing's counts (allocated with the backend, so counted before any plan)
  Buffer<std::byte> moe_ws_;
};

}  // namespace megatrain
