// megatrain-train's command line read into Settings: the --config file, the command line, and
// the options a resumed run takes over from its checkpoint; and what a checkpoint records of them.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "settings.hpp"

namespace megatrain::app {

using json = nlohmann::json;

/// What was parsed: the settings and the parser that holds their option records.
struct Parsed {
  std::unique_ptr<Settings> settings = std::make_unique<Settings>();
  std::string config_file;
  std::unique_ptr<CLI::App> app;
};

// Turns the JSON config into "--key value" arguments placed before the command line, so the
// command line (parsed later, last value wins) overrides the file.
std::vector<std::string> config_args(const std::string& path, const CLI::App& app);

/// Throws megatrain::Error for an empty argument of `args` (in command-line order) that is no
/// option's value. CLI11 2.1.2 takes such an argument for the name of an option group (groups have
/// none) and then never returns: `megatrain-train "" --config x` and {"help": ""} in a --config
/// file hung. A program without positional arguments refuses it anyway.
void refuse_empty_positionals(const CLI::App& app, const std::vector<std::string>& args, std::string_view program);

/// Parses into `p` (fresh): `before` (options taken over from a checkpoint: "--key value" pairs),
/// then the --config file named in `args`, then `args` (the command line), later ones winning.
/// Throws CLI::ParseError (p.app can report it) or megatrain::Error.
void parse(Parsed& p, const std::vector<std::string>& args, const std::vector<std::string>& before = {});

/// Whether option x, rather than y (which sets the same thing), decides: x is given and y is not,
/// or x on the command line overrides y from a file. Throws where both are given alike.
bool decides(const Settings& s, const std::string& x, const std::string& y);

/// The floor of a decaying schedule (see Settings::min_lr).
double min_lr_of(const Settings& s);

/// The options this run was given (command line, config file, or taken over from a checkpoint)
/// that a resumed run takes over: name -> value as the parser holds it (paths made absolute).
json given_options(const Parsed& p);

/// What a checkpoint records of the options: those given (given_options), plus the value of
/// every option that defines the update even where it was left at its default, so that a resume
/// by a later megatrain with other defaults still continues the same run.
json recorded_options(const Parsed& p);

/// Every option of `app` (and its groups) as resolved: given or default, long name -> value
/// (options.json in the run folder).
json resolved_options(const CLI::App& app);

/// "--key value" arguments of `given` (from a checkpoint) for parse(); `only` (if not empty)
/// restricts them to those names, and those in `except` are left out.
std::vector<std::string> replay_args(const json& given, const std::set<std::string>& only = {},
                                     const std::set<std::string>& except = {});

}  // namespace megatrain::app
