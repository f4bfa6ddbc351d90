// A machine's measured rates (plan::MachineFigures) as JSON, and where a probe keeps them.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>

#include "megatrain/core/error.hpp"
#include "megatrain/plan/cost_model.hpp"

namespace megatrain::plan {

namespace {
// The figures' JSON fields, in the order to_json writes them (the name first, by itself).
struct FigureField {
  const char* name;
  double MachineFigures::*value;
};
constexpr FigureField kFigureFields[] = {
    {"h2d_gbs", &MachineFigures::h2d_gbs},           {"d2h_gbs", &MachineFigures::d2h_gbs},
    {"duplex_gbs", &MachineFigures::duplex_gbs},     {"gemm_tflops", &MachineFigures::gemm_tflops},
    {"moe_gemm_tflops", &MachineFigures::moe_gemm_tflops},
    {"attention_fwd_tflops", &MachineFigures::attention_fwd_tflops},
    {"attention_bwd_tflops", &MachineFigures::attention_bwd_tflops},
    {"delta_rule_fwd_tflops", &MachineFigures::delta_rule_fwd_tflops},
    {"delta_rule_bwd_tflops", &MachineFigures::delta_rule_bwd_tflops},
    {"hbm_gbs", &MachineFigures::hbm_gbs},           {"adamw_gparams", &MachineFigures::adamw_gparams},
    {"adamw_dma_gparams", &MachineFigures::adamw_dma_gparams}, {"pass_copies_gbs", &MachineFigures::pass_copies_gbs}};
}  // namespace

nlohmann::json to_json(const MachineFigures& m) {
  nlohmann::json j{{"name", m.name}};
  for (const auto& f : kFigureFields) j[f.name] = m.*f.value;
  return j;
}

MachineFigures machine_figures_from_json(const nlohmann::json& j, std::string_view what) {
  std::string names = "name";
  for (const auto& f : kFigureFields) names += fmt::format(", {}", f.name);
  MT_CHECK(j.is_object(), "{}: machine figures must be a JSON object (fields: {})", what, names);
  MachineFigures m;
  m.name = std::string(what);
  for (const auto& [key, value] : j.items()) {
    if (key == "name") {
      MT_CHECK(value.is_string(), "{}: 'name' must be a string", what);
      m.name = value.get<std::string>();
      continue;
    }
    const auto* f = std::find_if(std::begin(kFigureFields), std::end(kFigureFields),
                                 [&](const FigureField& x) { return key == x.name; });
    MT_CHECK(f != std::end(kFigureFields), "{}: unknown field '{}' (fields: {})", what, key, names);
    MT_CHECK(value.is_number() && value.get<double>() > 0 && std::isfinite(value.get<double>()),
             "{}: '{}' must be a positive number (got {})", what, key, value.dump());
    m.*f->value = value.get<double>();
  }
  return m;
}

std::filesystem::path default_machine_file() {
  if (const char* e = std::getenv("MEGATRAIN_MACHINE"); e != nullptr && *e != '\0') return e;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0')
    return std::filesystem::path(x) / "megatrain" / "machine.json";
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0')
    return std::filesystem::path(h) / ".cache" / "megatrain" / "machine.json";
  return {};
}

MachineFigures read_machine_figures(const std::filesystem::path& path, std::string_view what) {
  std::ifstream f(path);
  MT_CHECK(f.good(), "{}: cannot open it", what);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    MT_FAIL("{}: malformed JSON: {}", what, e.what());
  }
  return machine_figures_from_json(j, what);
}

MachineFigures machine_figures() {
  const std::filesystem::path f = default_machine_file();
  if (f.empty() || !std::filesystem::exists(f)) return {};
  return read_machine_figures(f, fmt::format("the figures megatrain-plan --probe kept in '{}' (remove it, or probe again)", f.string()));
}

}  // namespace megatrain::plan
