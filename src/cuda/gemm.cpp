// cuBLASLt plans for the three products of a linear layer (see gemm.hpp). cuBLAS is
// column-major: a row-major [R, C] matrix is a column-major [C, R] one, so each row-major
// product is written as its transpose:
//   y = x W^T       ->  y^T (N x M)  = (W^T)^T . x^T      A = W (K x N, op T),  B = x (K x M, op N)
//   dx = dy W       ->  dx^T (K x M) = W^T . dy^T         A = W (K x N, op N),  B = dy (N x M, op N)
//   dW += dy^T x    ->  dW^T (K x N) = x^T . dy           A = x (K x M, op N),  B = dy (N x M, op T)
#include "megatrain/backend/cuda/gemm.hpp"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <string>

#include <fmt/format.h>

#include "megatrain/core/cuda_check.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/nvtx.hpp"

namespace megatrain::cuda {

struct Gemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool has_bias = false;
  // Tuning: the heuristic's candidates (best first), the calls made, the timed ones.
  std::vector<cublasLtMatmulAlgo_t> candidates;
  int uses = 0;
  struct Timed {
    int candidate;
    cudaEvent_t start, stop;
  };
  std::vector<Timed> timed;
  ~Plan() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

namespace {
// Candidates a tuned shape tries, and rounds of calls over them: the first round warms each up
// (its kernel loaded, its first launch), the others are timed.
constexpr int kCandidates = 8;
constexpr int kRounds = 4;
constexpr const char* kAlgorithmsHeader = "megatrain gemm algorithms 1";

// A new event with timing (a tuned call's start or end).
cudaEvent_t timing_event() {
  cudaEvent_t e = nullptr;
  MT_CUDA_CHECK(cudaEventCreate(&e));
  return e;
}

// What the algorithms' text names the library and GPU by: cuBLASLt's version, the device's name
// and compute capability.
std::string library_and_device() {
  int dev = 0;
  MT_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  MT_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  return fmt::format("cublasLt {}; {}; sm_{}{}", cublasLtGetVersion(), prop.name, prop.major, prop.minor);
}
}  // namespace

Gemm::Gemm(void* workspace, std::size_t workspace_bytes, bool tune)
    : workspace_(workspace), workspace_bytes_(workspace_bytes), tuning_(tune) {
  MT_CUDA_CHECK(cublasLtCreate(&handle_));
}

Gemm::~Gemm() {
  for (auto& [key, p] : plans_) drop_timed(*p);
  plans_.clear();
  if (handle_) cublasLtDestroy(handle_);
}

void Gemm::end_tuning() {
  if (!tuning_) return;
  for (auto& [key, p] : plans_) {
    std::vector<float> best(p->candidates.size(), std::numeric_limits<float>::infinity());
    for (const auto& t : p->timed) {
      MT_CUDA_CHECK(cudaEventSynchronize(t.stop));
      float ms = 0;
      MT_CUDA_CHECK(cudaEventElapsedTime(&ms, t.start, t.stop));
      best[static_cast<std::size_t>(t.candidate)] = std::min(best[static_cast<std::size_t>(t.candidate)], ms);
    }
    drop_timed(*p);
    if (!best.empty()) {
      const auto fastest = std::min_element(best.begin(), best.end());
      if (std::isfinite(*fastest)) p->algo = p->candidates[static_cast<std::size_t>(fastest - best.begin())];
    }
    p->candidates.clear();
    p->uses = 0;
  }
  tuning_ = false;
}

void Gemm::drop_timed(Plan& p) {
  for (const auto& t : p.timed) {
    (void)cudaEventSynchronize(t.stop);  // (not destroyed while a call may still record it)
    (void)cudaEventDestroy(t.start);
    (void)cudaEventDestroy(t.stop);
  }
  p.timed.clear();
}

std::size_t Gemm::timed_calls() const {
  std::size_t n = 0;
  for (const auto& [key, p] : plans_) n += p->timed.size();
  return n;
}

std::string Gemm::algorithms() const {
  std::string out = fmt::format("{}; {}\n", kAlgorithmsHeader, library_and_device());
  for (const auto& [key, p] : plans_) {
    const auto& [kind, M, N, K, aligned] = key;
    out += fmt::format("{} {} {} {} {}", kind, M, N, K, aligned ? 1 : 0);
    for (std::uint64_t word : p->algo.data) out += fmt::format(" {:016x}", word);
    out += '\n';
  }
  return out;
}

bool Gemm::restore(const std::string& text) {
  std::istringstream in(text);
  std::string line;
  std::getline(in, line);
  MT_CHECK(line.rfind(kAlgorithmsHeader, 0) == 0, "saved matrix-product algorithms: the text does not start with '{}'",
           kAlgorithmsHeader);
  if (line != fmt::format("{}; {}", kAlgorithmsHeader, library_and_device())) return false;
  std::map<Key, cublasLtMatmulAlgo_t> algos;
  for (int number = 2; std::getline(in, line); ++number) {
    if (line.empty()) continue;
    std::istringstream fields(line);
    int kind = -1, aligned = -1;
    std::int64_t M = 0, N = 0, K = 0;
    cublasLtMatmulAlgo_t algo{};
    fields >> kind >> M >> N >> K >> aligned;
    for (std::uint64_t& word : algo.data) fields >> std::hex >> word >> std::dec;
    std::string rest;
    MT_CHECK(fields && !(fields >> rest) && kind >= 0 && kind <= static_cast<int>(Kind::weight_grad) && M > 0 && N > 0 &&
                 K > 0 && (aligned == 0 || aligned == 1),
             "saved matrix-product algorithms, line {}: '{}' is not a shape and an algorithm", number, line);
    algos[Key{kind, M, N, K, aligned == 1}] = algo;
  }
  for (auto& [key, algo] : algos) restored_[key] = algo;
  for (auto& [key, p] : plans_) {
    drop_timed(*p);  // (what was timed is not read: the saved choice stands)
    p->candidates.clear();
    p->uses = 0;
    if (auto r = restored_.find(key); r != restored_.end()) p->algo = checked(*p, key, r->second);
  }
  tuning_ = false;
  return true;
}

cublasLtMatmulAlgo_t Gemm::checked(const Plan& p, const Key& key, const cublasLtMatmulAlgo_t& algo) {
  cublasLtMatmulHeuristicResult_t result{};
  const cublasStatus_t st = cublasLtMatmulAlgoCheck(handle_, p.desc, p.a, p.b, p.c, p.c, &algo, &result);
  MT_CHECK(st == CUBLAS_STATUS_SUCCESS && result.workspaceSize <= workspace_bytes_,
           "the saved matrix-product algorithm for the shape {} x {} x {} (kind {}) does not run here (cuBLASLt status "
           "{}, workspace {} of {} bytes)",
           std::get<1>(key), std::get<2>(key), std::get<3>(key), std::get<0>(key), static_cast<int>(st),
           result.workspaceSize, workspace_bytes_);
  return algo;
}


namespace {
bool aligned16(std::initializer_list<const void*> ptrs, std::initializer_list<std::int64_t> pitches_bytes) {
  for (const void* p : ptrs)
    if (p != nullptr && reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return false;
  for (std::int64_t b : pitches_bytes)
    if (b % 16 != 0) return false;
  return true;
}
}  // namespace

Gemm::Plan& Gemm::plan(Kind kind, std::int64_t M, std::int64_t N, std::int64_t K, bool aligned) {
  const Key key{static_cast<int>(kind), M, N, K, aligned};
  if (auto it = plans_.find(key); it != plans_.end()) return *it->second;
  MT_NVTX_RANGE("gemm_plan_build");  // once per shape (a cached plan returns above, without a range)
  MT_CHECK(M > 0 && N > 0 && K > 0, "matrix product of [{}, {}] x [{}, {}]^T has an empty side", M, K, N, K);
  auto p = std::make_unique<Plan>();
  MT_CUDA_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
  std::uint64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0, arows = 0, acols = 0, brows = 0, bcols = 0;
  cudaDataType_t ctype = CUDA_R_16BF;
  switch (kind) {
    case Kind::forward:
    case Kind::forward_bias:
    case Kind::forward_f32:
    case Kind::forward_add:
      ta = CUBLAS_OP_T;
      m = N, n = M, k = K;
      arows = K, acols = N, lda = K;  // W
      brows = K, bcols = M, ldb = K;  // x
      ldc = N;
      if (kind == Kind::forward_f32 || kind == Kind::forward_add) ctype = CUDA_R_32F;
      break;
    case Kind::input_grad:
    case Kind::input_grad_acc:
      m = K, n = M, k = N;
      arows = K, acols = N, lda = K;  // W
      brows = N, bcols = M, ldb = N;  // dy
      ldc = K;
      break;
    case Kind::weight_grad:
      tb = CUBLAS_OP_T;
      m = K, n = N, k = M;
      arows = K, acols = M, lda = K;  // x
      brows = N, bcols = M, ldb = N;  // dy
      ldc = K;
      ctype = CUDA_R_32F;
      break;
  }
  MT_CUDA_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  MT_CUDA_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  if (kind == Kind::forward_bias) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bias_type = CUDA_R_16BF;
    MT_CUDA_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    MT_CUDA_CHECK(
        cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof bias_type));
    p->has_bias = true;
  }
  MT_CUDA_CHECK(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, arows, acols, static_cast<std::int64_t>(lda)));
  MT_CUDA_CHECK(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, brows, bcols, static_cast<std::int64_t>(ldb)));
  MT_CUDA_CHECK(cublasLtMatrixLayoutCreate(&p->c, ctype, m, n, static_cast<std::int64_t>(ldc)));
  (void)k;

  cublasLtMatmulPreference_t pref = nullptr;
  MT_CUDA_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  MT_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes_,
                                                     sizeof workspace_bytes_));
  const std::uint32_t align = aligned ? 16 : 2;
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    MT_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof align));
  std::vector<cublasLtMatmulHeuristicResult_t> results(tuning_ ? kCandidates : 1);
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle_, p->desc, p->a, p->b, p->c, p->c, pref,
                                                           static_cast<int>(results.size()), results.data(), &found);
  cublasLtMatmulPreferenceDestroy(pref);
  MT_CUDA_CHECK(st);
  MT_CHECK(found > 0, "cuBLASLt has no algorithm for a bf16 product of m={} n={} k={}", m, n, k);
  p->algo = results[0].algo;
  if (auto r = restored_.find(key); r != restored_.end()) {
    p->algo = checked(*p, key, r->second);
  } else if (tuning_ && found > 1) {
    for (int i = 0; i < found; ++i) p->candidates.push_back(results[static_cast<std::size_t>(i)].algo);
  }
  return *plans_.emplace(key, std::move(p)).first->second;
}

void Gemm::run(Plan& p, const void* a, const void* b, void* c, const void* bias, float beta, cudaStream_t stream,
               const void* c_in) {
  if (p.has_bias)
    MT_CUDA_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
  const float alpha = 1.0f;
  // Tuning: the candidates in turn, each call a correct product; from the second round on, timed.
  const cublasLtMatmulAlgo_t* algo = &p.algo;
  const int candidates = static_cast<int>(p.candidates.size());
  cudaEvent_t stop = nullptr;
  if (tuning_ && candidates > 1 && p.uses < kRounds * candidates) {
    const int candidate = p.uses % candidates;
    algo = &p.candidates[static_cast<std::size_t>(candidate)];
    if (p.uses >= candidates) {  // (the plan owns the events: end_tuning() or ~Gemm destroys them)
      p.timed.push_back({candidate, timing_event(), timing_event()});
      stop = p.timed.back().stop;
      MT_CUDA_CHECK(cudaEventRecord(p.timed.back().start, stream));
    }
    ++p.uses;
  }
  MT_CUDA_CHECK(cublasLtMatmul(handle_, p.desc, &alpha, a, p.a, b, p.b, &beta, c_in ? c_in : c, p.c, c, p.c, algo,
                               workspace_, workspace_bytes_, stream));
  if (stop) MT_CUDA_CHECK(cudaEventRecord(stop, stream));
}

void Gemm::forward(const bf16* x, const bf16* w, const bf16* bias, bf16* y, std::int64_t M, std::int64_t N,
                   std::int64_t K, cudaStream_t stream) {
  const bool al = aligned16({x, w, bias, y}, {2 * K, 2 * N});
  run(plan(bias ? Kind::forward_bias : Kind::forward, M, N, K, al), w, x, y, bias, 0.0f, stream);
}

void Gemm::forward_f32(const bf16* x, const bf16* w, float* y, std::int64_t M, std::int64_t N, std::int64_t K,
                       cudaStream_t stream) {
  const bool al = aligned16({x, w, y}, {2 * K, 4 * N});
  run(plan(Kind::forward_f32, M, N, K, al), w, x, y, nullptr, 0.0f, stream);
}

void Gemm::forward_add(const bf16* x, const bf16* w, const float* r, float* y, std::int64_t M, std::int64_t N, std::int64_t K,
                       cudaStream_t stream) {
  const bool al = aligned16({x, w, r, y}, {2 * K, 4 * N});
  run(plan(Kind::forward_add, M, N, K, al), w, x, y, nullptr, 1.0f, stream, r);
}

void Gemm::input_grad(const bf16* dy, const bf16* w, bf16* dx, bool accumulate, std::int64_t M, std::int64_t N,
                      std::int64_t K, cudaStream_t stream) {
  const bool al = aligned16({dy, w, dx}, {2 * K, 2 * N});
  run(plan(accumulate ? Kind::input_grad_acc : Kind::input_grad, M, N, K, al), w, dy, dx, nullptr,
      accumulate ? 1.0f : 0.0f, stream);
}

void Gemm::weight_grad(const bf16* dy, const bf16* x, float* dw, std::int64_t M, std::int64_t N, std::int64_t K,
                       cudaStream_t stream) {
  const bool al = aligned16({dy, x, dw}, {2 * K, 2 * N, 4 * K});
  run(plan(Kind::weight_grad, M, N, K, al), x, dy, dw, nullptr, 1.0f, stream);
}

}  // namespace megatrain::cuda
