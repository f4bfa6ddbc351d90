// megatrain-train's command line read into Settings (parse.hpp).
#include "parse.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "megatrain/core/error.hpp"
#include "options.hpp"

namespace megatrain::app {

namespace fs = std::filesystem;

std::vector<std::string> config_args(const std::string& path, const CLI::App& app) {
  std::ifstream f(path);
  MT_CHECK(f.good(), "cannot open config file '{}'", path);
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception& e) {  // (parse_error, or out_of_range for a number beyond a double's range)
    MT_FAIL("config file '{}': malformed JSON: {}", path, e.what());
  }
  MT_CHECK(j.is_object(), "config file '{}' must hold a JSON object of option names and values", path);
  std::vector<std::string> args;
  for (const auto& [key, value] : j.items()) {
    MT_CHECK(key != "config", "config file '{}' cannot name another config file", path);
    try {
      (void)app.get_option("--" + key);
    } catch (const CLI::OptionNotFound&) {
      MT_FAIL("config file '{}': unknown option '{}' (see megatrain-train --help)", path, key);
    }
    args.push_back("--" + key);
    if (value.is_string()) args.push_back(value.get<std::string>());
    else if (value.is_boolean()) args.push_back(value.get<bool>() ? "true" : "false");
    else if (value.is_number()) args.push_back(value.dump());
    else MT_FAIL("config file '{}': option '{}' must be a string, number or boolean, not {}", path, key, value.dump());
  }
  return args;
}

void refuse_empty_positionals(const CLI::App& app, const std::vector<std::string>& args, std::string_view program) {
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (!args[i].empty()) continue;
    bool value = false;
    if (i > 0 && args[i - 1].rfind("--", 0) == 0 && args[i - 1].find('=') == std::string::npos) {
      try {
        value = app.get_option(args[i - 1])->get_items_expected_max() > 0;
      } catch (const CLI::OptionNotFound&) {
      }
    }
    MT_CHECK(value, "an empty argument (\"\"){} is no option's value, and {} takes no positional argument",
             i > 0 ? " after " + args[i - 1] : std::string(), program);
  }
}

void parse(Parsed& p, const std::vector<std::string>& args, const std::vector<std::string>& before) {
  Settings& s = *p.settings;
  p.app = make_train_app(s, p.config_file);
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--config" && i + 1 < args.size()) p.config_file = args[i + 1];
    else if (args[i].rfind("--config=", 0) == 0) p.config_file = args[i].substr(9);
  }
  // An option may appear once on the command line (a value there overrides the file's).
  for (const auto& a : args) {
    if (a.rfind("--", 0) != 0 || a.size() == 2) continue;
    const std::string name = a.substr(0, a.find('='));
    MT_CHECK(s.origins.cli.insert(name).second, "{} is given more than once; pass it once", name);
  }
  std::vector<std::string> all = before;
  if (!p.config_file.empty()) {
    const auto file = config_args(p.config_file, *p.app);
    for (const auto& a : file)
      if (a.rfind("--", 0) == 0) s.origins.config.insert(a);
    all.insert(all.end(), file.begin(), file.end());
  }
  for (const auto& a : all)
    if (a.rfind("--", 0) == 0) s.origins.file.insert(a);
  all.insert(all.end(), args.begin(), args.end());
  refuse_empty_positionals(*p.app, all, "megatrain-train");
  parse_args(*p.app, std::move(all));
  s.resume_given = p.app->get_option("--resume")->count() > 0;
  if (s.resume_given && s.resume.empty()) s.resume = "latest";
}

bool decides(const Settings& s, const std::string& x, const std::string& y) {
  const Origins& o = s.origins;
  MT_CHECK(!(o.conflicts(x, y) && o.conflicts(y, x)), "{} and {} set the same thing; pass one of them", x, y);
  return o.given(x) && (!o.given(y) || o.cli.contains(x));
}

double min_lr_of(const Settings& s) {
  if (decides(s, "--min-lr", "--min-lr-ratio")) return s.min_lr;
  const double ratio = s.origins.given("--min-lr-ratio") ? s.min_lr_ratio : s.schedule == "linear" ? 0.0 : 0.1;
  return ratio * s.lr;
}

namespace {
// The options of `app` and of its groups.
std::vector<const CLI::Option*> all_options(const CLI::App& app) {
  std::vector<const CLI::Option*> opts = app.get_options();
  for (const CLI::App* group : app.get_subcommands([](const CLI::App*) { return true; }))
    for (const CLI::Option* opt : group->get_options()) opts.push_back(opt);
  return opts;
}
}  // namespace

json given_options(const Parsed& p) {
  json j = json::object();
  const CLI::App& app = *p.app;
  for (const CLI::Option* opt : all_options(app)) {
    if (opt->get_lnames().empty() || opt->count() == 0) continue;
    const std::string name = "--" + opt->get_lnames().front();
    if (!replayed_option(name)) continue;
    std::string value = opt->as<std::string>();
    if (path_option(name) && !value.empty()) value = fs::absolute(value).lexically_normal().string();
    j[name] = value;
  }
  return j;
}

json recorded_options(const Parsed& p) {
  json j = given_options(p);
  j.erase("--gpus");  // (how many GPUs a resumed run uses is the resuming command's choice)
  j.erase("--gpu-ranks");
  const Settings& s = *p.settings;
  const auto record = [&](const char* name, const std::string& value) {
    if (!j.contains(name)) j[name] = value;
  };
  record("--batch", fmt::format("{}", s.batch));
  record("--seq", fmt::format("{}", s.seq));
  record("--seed", fmt::format("{}", s.seed));
  record("--lr", fmt::format("{}", s.lr));
  record("--weight-decay", fmt::format("{}", s.weight_decay));
  record("--beta1", fmt::format("{}", s.beta1));
  record("--beta2", fmt::format("{}", s.beta2));
  record("--eps", fmt::format("{}", s.eps));
  record("--schedule", s.schedule);
  record("--clip", fmt::format("{}", s.clip));
  if (s.clip > 0) record("--clip-mode", s.clip_mode);
  if (s.schedule != "constant" && !j.contains("--min-lr-ratio")) record("--min-lr", fmt::format("{}", min_lr_of(s)));
  return j;
}

std::vector<std::string> replay_args(const json& given, const std::set<std::string>& only, const std::set<std::string>& except) {
  std::vector<std::string> args;
  for (const auto& [name, value] : given.items()) {
    if (!replayed_option(name) || (!only.empty() && !only.contains(name)) || except.contains(name)) continue;
    args.push_back(name);
    args.push_back(value.get<std::string>());
  }
  return args;
}

json resolved_options(const CLI::App& app) {
  json o;
  for (const CLI::Option* opt : all_options(app))
    if (!opt->get_lnames().empty() && opt->get_lnames().front() != "help" && opt->get_lnames().front() != "config")
      o[opt->get_lnames().front()] = opt->count() > 0 ? opt->as<std::string>() : opt->get_default_str();
  return o;
}

}  // namespace megatrain::app
