// Each model family against transformers itself: the fixtures of tests/fixtures/<family>/ hold a
// tiny random model as transformers saved it (config.json, model.safetensors) and transformers'
// loss and gradients on fixed inputs (reference.safetensors; written by tests/hf/make_fixtures.py).
// megatrain loads the folder as a user's --model, and its CPU backend (fp32) must give the same
// loss and the same gradient for every parameter, within fp32 rounding.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "../train/reference_loop.hpp"
#include "megatrain/io/hf_checkpoint.hpp"
#include "megatrain/io/safetensors.hpp"

using namespace megatrain;
using namespace megatrain::io;
namespace fs = std::filesystem;

namespace {

template <class T>
std::vector<T> read_tensor(const SafetensorsFile& f, const std::string& name, SafetensorsDType want) {
  const auto& info = f.tensor(name);
  REQUIRE(info.dtype == want);
  const auto b = f.view(info).bytes;
  std::vector<T> out(b.size() / sizeof(T));
  std::memcpy(out.data(), b.data(), out.size() * sizeof(T));
  return out;
}

/// ||a - b|| / ||b||
/// ||a - b|| / max(||b||, floor).
double rel(std::span<const float> a, std::span<const float> b, double floor = 0) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num) / std::max({std::sqrt(den), floor, 1e-150});
}

void check_family(const fs::path& dir) {
  const auto ref = SafetensorsFile::open(dir / "reference.safetensors");
  const auto ids = read_tensor<std::int32_t>(ref, "input_ids", SafetensorsDType::i32);
  const auto labels = read_tensor<std::int32_t>(ref, "labels", SafetensorsDType::i32);
  const auto shape = ref.tensor("input_ids").shape;
  REQUIRE(shape.size() == 2);
  const float want_loss = read_tensor<float>(ref, "loss", SafetensorsDType::f32).at(0);

  HfModel m = load_hf_model(dir);
  const bool wrapped = !m.config.wrapper_architecture.empty();  // (a multimodal checkpoint's language model)
  if (!wrapped) {
    CHECK(m.ignored.empty());
  } else {  // (its vision tower and projector: left alone, said once)
    REQUIRE(m.ignored.size() == 1);
    CHECK(m.ignored[0].find("vision tower") != std::string::npos);
  }
  DecoderModel<> model(m.config);
  test::ReferenceLoop loop{model, m.store, AdamWConfig{}, LrSchedule{}, 0.0, shape[0], shape[1], {}};
  if (ref.find("attention_mask") != nullptr)  // (right padding, which transformers' mask leaves out of the auxiliary loss)
    for (const std::int32_t v : read_tensor<std::int32_t>(ref, "attention_mask", SafetensorsDType::i32))
      loop.attention_mask.push_back(static_cast<std::uint8_t>(v));
  std::vector<std::vector<float>> grads;
  std::vector<float> logits;
  loop.logits = &logits;
  const auto r = loop.gradients(ids, labels, grads);
  // The logits (rows x seq x vocab) within fp32 rounding of transformers', every one but a padded
  // token's (transformers' mask keeps padding from attending to padding; megatrain attends causally
  // and refuses a label on padding, so no loss depends on them).
  auto want_logits = read_tensor<float>(ref, "logits", SafetensorsDType::f32);
  REQUIRE(ref.tensor("logits").shape == std::vector<std::int64_t>{shape[0], shape[1], m.config.vocab_size});
  if (!loop.attention_mask.empty()) {
    const auto V = static_cast<std::size_t>(m.config.vocab_size);
    std::size_t kept = 0;
    for (std::size_t t = 0; t < loop.attention_mask.size(); ++t)
      if (loop.attention_mask[t] != 0) {
        std::copy_n(logits.begin() + static_cast<std::ptrdiff_t>(t * V), V, logits.begin() + static_cast<std::ptrdiff_t>(kept * V));
        std::copy_n(want_logits.begin() + static_cast<std::ptrdiff_t>(t * V), V,
                    want_logits.begin() + static_cast<std::ptrdiff_t>(kept * V));
        ++kept;
      }
    REQUIRE(kept < loop.attention_mask.size());  // (the fixture has padding)
    logits.resize(kept * V);
    want_logits.resize(kept * V);
  }
  // The tolerance: fp32 rounding, 1e-5 of a tensor's size. The hybrid families' (Qwen3.5, Qwen3-Next)
  // is 2e-4: their linear attention makes the problem itself less well conditioned, and an fp32
  // computation is that far from the exact one. Their references are transformers' in float64
  // (make_fixtures.py's float64_family), which megatrain's CPU backend in float64 matches within
  // 1e-6 (the test case below); megatrain's fp32 gradients are 3.4e-5 to 1.1e-4 from them (Qwen3's
  // within 1.1e-6 of its fp32 reference).
  const double tol = m.config.block().linear_attention ? 2e-4 : 1e-5;
  const double logits_err = rel(logits, want_logits);
  CHECK(logits_err <= tol);
  double logits_worst = 0;  // (the largest single difference, against the largest logit)
  double logits_largest = 0;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    logits_worst = std::max(logits_worst, std::abs(static_cast<double>(logits[i]) - want_logits[i]));
    logits_largest = std::max(logits_largest, std::abs(static_cast<double>(want_logits[i])));
  }
  CHECK(logits_worst <= tol * logits_largest);
  MESSAGE(dir.filename().string() << ": logits within " << logits_err << " (relative norm), largest difference "
                                  << logits_worst << " of logits up to " << logits_largest);
  if (ref.find("aux_loss") != nullptr) {  // transformers' loss is the cross-entropy plus coef x the auxiliary loss
    REQUIRE(m.config.moe.output_router_logits);
    const float want_aux = read_tensor<float>(ref, "aux_loss", SafetensorsDType::f32).at(0);
    CHECK(r.aux_loss == doctest::Approx(want_aux).epsilon(1e-5));
    CHECK(r.loss + m.config.moe.router_aux_loss_coef * r.aux_loss == doctest::Approx(want_loss).epsilon(1e-5));
    MESSAGE(dir.filename().string() << ": auxiliary loss " << r.aux_loss << " (transformers " << want_aux << ")");
  } else {
    CHECK(!m.config.moe.output_router_logits);
    CHECK(r.loss == doctest::Approx(want_loss).epsilon(1e-5));
  }

  // Every parameter's gradient, by its Hugging Face name (a tied head's is the embedding's; a
  // parameter held in a fused tensor, Phi-3's rows or GPT-OSS's stacked experts, is its part of
  // the fused gradient).
  std::map<std::string, std::pair<std::string, const FusedPart*>> fused_parts;  // part -> (fused tensor, place)
  const auto fused = fused_tensors(m.config);
  const auto fixture = SafetensorsCheckpoint::open(dir);
  for (const auto& f : fused)
    if (!f.optional || fixture.contains(f.name))  // (Qwen3.5-MoE's experts: stacked or per expert)
      for (const auto& part : f.parts) fused_parts[part.param] = {f.name, &part};
  // Some gradients are zero in exact arithmetic, and both sides give rounding noise: the key bias
  // of a layer without rotary (SmolLM3's NoPE layers: the same logit added to every key leaves
  // the softmax unchanged). A gradient is measured against its own size or, where that is below
  // 1e-3 of the largest gradient's (across the model), against that.
  double largest = 0;
  for (const auto& t : ref.tensors())
    if (t.name.rfind("grad.", 0) == 0) {
      double sq = 0;
      for (const float v : read_tensor<float>(ref, t.name, SafetensorsDType::f32)) sq += static_cast<double>(v) * v;
      largest = std::max(largest, std::sqrt(sq));
    }
  std::set<std::string> seen;
  double worst = 0;
  for (std::size_t u = 0; u < m.store.num_units(); ++u)
    for (const auto& e : m.store.unit(u).layout().entries()) {
      const auto place = fused_parts.find(e.spec.name);
      const std::string name = "grad." + (place == fused_parts.end() ? e.spec.name : place->second.first);
      CAPTURE(name);
      CAPTURE(e.spec.name);
      REQUIRE(ref.find(name) != nullptr);
      auto want = read_tensor<float>(ref, name, SafetensorsDType::f32);
      if (place != fused_parts.end()) {
        std::vector<float> part(static_cast<std::size_t>(e.numel()));
        gather_part(*place->second.second, want, part);
        want = std::move(part);
      }
      const auto got = std::span<const float>(grads[u]).subspan(static_cast<std::size_t>(e.offset),
                                                               static_cast<std::size_t>(e.numel()));
      const double err = rel(got, want, 1e-3 * largest);
      CHECK(err <= tol);
      worst = std::max(worst, err);
      seen.insert(name);
    }
  const double total = r.loss + (m.config.moe.output_router_logits ? m.config.moe.router_aux_loss_coef * r.aux_loss : 0.0);
  MESSAGE(dir.filename().string() << ": loss " << total << " (transformers " << want_loss << "), " << seen.size()
                                  << " gradients, largest relative difference " << worst);
  // An fp32 export loads back bit for bit, under the checkpoint's own names (fused ones too).
  const fs::path out = fs::temp_directory_path() / ("megatrain_family_export_" + dir.filename().string());
  fs::remove_all(out);
  HfExportOptions eo;
  eo.dtype = DType::f32;
  export_hf_model(m.store, m.config, out, eo);
  const auto names = SafetensorsCheckpoint::open(out).names();
  std::set<std::string> orig;  // (MXFP4 experts are written unquantized, under the name their blocks stand for)
  for (const std::string& tensor : SafetensorsCheckpoint::open(dir).names()) {
    const auto param = m.config.param_name(tensor);  // (the language model alone: a text model's names)
    if (!param) continue;                             // (the vision tower, Qwen3.5's mtp.*: not exported)
    const std::string& n = *param;
    if (n.ends_with("_blocks")) orig.insert(n.substr(0, n.size() - 7));
    else if (!n.ends_with("_scales")) orig.insert(n);
  }
  CHECK(std::set<std::string>(names.begin(), names.end()) == orig);
  {
    std::ifstream f(out / "config.json");
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    CHECK(text.find("quantization_config") == std::string::npos);
    if (wrapped) CHECK(text.find("\"" + std::string(m.config.architecture_name()) + "\"") != std::string::npos);
  }
  HfModel back = load_hf_model(out);
  for (std::size_t u = 0; u < m.store.num_units(); ++u) {
    const auto a0 = m.store.unit(u).master(), b0 = back.store.unit(u).master();
    CHECK(std::memcmp(a0.data(), b0.data(), a0.size() * sizeof(float)) == 0);
  }
  fs::remove_all(out);

  std::size_t grads_in_ref = 0;
  for (const auto& t : ref.tensors()) grads_in_ref += t.name.rfind("grad.", 0) == 0;
  CHECK(seen.size() == grads_in_ref);  // no parameter of transformers' model left unchecked
}

/// Every unit's gradient of the mean loss over the labelled tokens, computed by the CPU backend in
/// float64 from the store's fp32 masters (the whole batch as one chunk; no auxiliary loss).
std::vector<std::vector<double>> float64_gradients(const DecoderModel<>& model, const HostParamStore<float>& store,
                                                   std::span<const std::int32_t> ids, std::span<const std::int32_t> labels,
                                                   std::int64_t rows, std::int64_t seq) {
  CpuBackend<double> be;
  const std::int64_t M = rows * seq, d = model.config().hidden_size;
  const std::size_t L = model.num_blocks(), H = model.head_unit();
  const ChunkShape c{rows, seq};
  std::vector<std::byte> mem(std::size_t{256} << 20);
  Arena arena{std::span<std::byte>(mem)};
  std::vector<std::vector<double>> masters, grads, acts(L + 1, std::vector<double>(static_cast<std::size_t>(M * d)));
  for (const auto& u : store.units()) {
    masters.emplace_back(u.master().begin(), u.master().end());
    grads.emplace_back(static_cast<std::size_t>(u.numel()), 0.0);
  }
  const auto view = [&](std::vector<double>& v) { return View<double>(std::span<double>(v), Shape{M, d}); };
  const auto master = [&](std::size_t u) { return std::span<const double>(masters[u]); };
  const View<const std::int32_t> idv(ids, Shape{M}), lbv(labels, Shape{M});
  const auto& emb = model.embedding();
  emb.op().forward(be, c, emb.bind(master(0)), idv, view(acts[0]), arena);
  for (std::size_t l = 0; l < L; ++l)
    model.block(l).op().forward(be, c, model.block(l).bind(master(l + 1)), View<const double>(view(acts[l])),
                                view(acts[l + 1]), arena);
  const auto valid = std::count_if(labels.begin(), labels.end(), [](std::int32_t y) { return y != kIgnoreIndex; });
  std::vector<double> loss(static_cast<std::size_t>(M)), dy(static_cast<std::size_t>(M * d)), dx(dy.size());
  model.head().op().forward_backward(be, c, model.head().bind(master(H), {{&emb.layout(), master(0)}}),
                                     View<const double>(view(acts[L])), lbv, 1.0 / static_cast<double>(valid),
                                     View<const double>{}, View<double>(std::span<double>(loss), Shape{M}), view(dy),
                                     model.head().bind(std::span<double>(grads[H]), {{&emb.layout(), std::span<double>(grads[0])}}),
                                     arena);
  for (std::size_t l = L; l-- > 0;) {
    model.block(l).op().backward(be, c, model.block(l).bind(master(l + 1)), View<const double>(view(acts[l])),
                                 View<const double>(view(dy)), view(dx), model.block(l).bind(std::span<double>(grads[l + 1])),
                                 arena);
    std::swap(dy, dx);
  }
  emb.op().backward(be, c, idv, View<const double>(view(dy)), emb.bind(std::span<double>(grads[0])), arena);
  return grads;
}

}  // namespace

TEST_CASE("the hybrid families' fixtures: megatrain in float64 gives transformers' float64 gradients within 1e-6") {
  // The hybrids' references are transformers' computation in float64: megatrain's CPU backend in
  // float64 must give them within 1e-6 of each gradient's size (what storing them in fp32 leaves).
  // Beside it, megatrain's fp32 gradients' distance from them: why the check above is 2e-4 for
  // the hybrids. Qwen3 (an fp32 reference): both within 1e-5.
  for (const char* name : {"qwen3", "qwen3_5", "qwen3_5_mm", "qwen3_5_moe", "qwen3_next"}) {
    CAPTURE(name);
    const fs::path dir = fs::path(MEGATRAIN_TEST_FIXTURES) / name;
    const auto ref = SafetensorsFile::open(dir / "reference.safetensors");
    const auto ids = read_tensor<std::int32_t>(ref, "input_ids", SafetensorsDType::i32);
    const auto labels = read_tensor<std::int32_t>(ref, "labels", SafetensorsDType::i32);
    const auto shape = ref.tensor("input_ids").shape;
    HfModel m = load_hf_model(dir);
    DecoderModel<> model(m.config);
    test::ReferenceLoop loop{model, m.store, AdamWConfig{}, LrSchedule{}, 0.0, shape[0], shape[1], {}};
    std::vector<std::vector<float>> g32;
    (void)loop.gradients(ids, labels, g32);
    const auto g64 = float64_gradients(model, m.store, ids, labels, shape[0], shape[1]);
    double ours = 0, theirs = 0;
    for (std::size_t u = 0; u < m.store.num_units(); ++u)
      for (const auto& e : m.store.unit(u).layout().entries()) {
        const auto want = read_tensor<float>(ref, "grad." + e.spec.name, SafetensorsDType::f32);
        double d32 = 0, dtf = 0, n64 = 0;
        for (std::int64_t i = 0; i < e.numel(); ++i) {
          const auto at = static_cast<std::size_t>(e.offset + i);
          d32 += (g32[u][at] - g64[u][at]) * (g32[u][at] - g64[u][at]);
          dtf += (want[static_cast<std::size_t>(i)] - g64[u][at]) * (want[static_cast<std::size_t>(i)] - g64[u][at]);
          n64 += g64[u][at] * g64[u][at];
        }
        ours = std::max(ours, std::sqrt(d32 / n64));
        theirs = std::max(theirs, std::sqrt(dtf / n64));
      }
    const bool hybrid = std::string_view(name) != "qwen3";
    MESSAGE(std::string(name) << ": largest distance from megatrain's float64 gradients: megatrain fp32 " << ours
                              << ", transformers " << std::string(hybrid ? "float64 " : "fp32 ") << theirs);
    CHECK(ours <= (hybrid ? 2e-4 : 1e-5));
    CHECK(theirs <= (hybrid ? 1e-6 : 1e-5));
  }
}

TEST_CASE("every model family gives transformers' loss and gradients (fp32 CPU backend, rel 1e-5; hybrids 2e-4)") {
  std::vector<fs::path> dirs;
  for (const auto& e : fs::directory_iterator(MEGATRAIN_TEST_FIXTURES))
    if (fs::exists(e.path() / "reference.safetensors")) dirs.push_back(e.path());
  std::sort(dirs.begin(), dirs.end());
  // Every fixture make_fixtures.py writes, by name: a missing or unreadable one fails here rather
  // than leaving its family unchecked.
  std::vector<std::string> names;
  for (const auto& d : dirs) names.push_back(d.filename().string());
  const std::vector<std::string> expected{"gemma3",  "gemma3_mm",    "gpt_oss",  "gpt_oss_mxfp4",   "llama",
                                          "mixtral", "mixtral_aux",  "olmoe",    "olmoe_aux",       "phi3",
                                          "phi3_longrope", "phi3_partial", "qwen2", "qwen3",        "qwen3_5",
                                          "qwen3_5_mm", "qwen3_5_moe", "qwen3_moe", "qwen3_moe_aux", "qwen3_moe_aux_mask", "qwen3_moe_step2",
                                          "qwen3_next", "qwen3_tied_bias", "smollm3"};
  CHECK(names == expected);
  for (const auto& d : dirs) {
    CAPTURE(d.filename().string());
    check_family(d);
  }
}
