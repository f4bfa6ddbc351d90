// report.html: a self-contained page that shows a training run at a glance — the training and
// validation loss, the learning rate, the gradient norm (and clip coefficient) and tokens/s
// against the step, as inline SVG charts, then the run's options, model, machine and a summary.
// It needs no network and no JavaScript to view, and prints. See docs/report.md.
//
// A run folder (megatrain-train --out DIR) holds what the report is made of:
//   metrics.jsonl  one JSON object per step: step, loss, lr, grad_norm, clip_coef, tokens,
//                  tokens_per_s, step_time_s, and val_loss on the steps that evaluated (required)
//   options.json   the options as resolved (optional)
//   config.json    the model's shape, Hugging Face keys (optional)
//   machine.json   facts about the machine the run trained on (optional; see RunReportInfo)
#pragma once

#include <filesystem>
#include <optional>
#include <nlohmann/json.hpp>
#include <string>

namespace megatrain::io {

/// The report's file name inside a run folder.
inline constexpr const char* kRunReportFile = "report.html";

/// What the report shows beyond the run folder's files.
struct RunReportInfo {
  /// The page's heading and title; empty: "megatrain run <the folder's name>".
  std::string title;
  /// Facts about the machine, a JSON object of names to values (strings or numbers), e.g.
  /// describe_machine() with {"backend", "cuda"} added. Shown over the run folder's machine.json
  /// (a key given here wins). When it is an object with keys and differs from machine.json,
  /// write_run_report also saves it as machine.json, so that a report made later from the folder
  /// alone (megatrain-report) shows the same machine. Null or empty: machine.json alone, if any.
  nlohmann::json machine;
};

/// The report of the run in `run_dir`, as HTML. Reads metrics.jsonl (required; blank lines are
/// skipped, and so is a last line that does not parse: a run killed or still running may leave
/// one torn; a malformed line elsewhere throws megatrain::Error naming the file and line),
/// options.json, config.json and machine.json (each optional; one that exists but is not a JSON
/// object throws). Non-finite values (NaN or infinity, written as null by nlohmann::json) are
/// left out of the charts and counted in the report.
std::string render_run_report(const std::filesystem::path& run_dir, const RunReportInfo& info = {});

/// Renders the report and writes it atomically (staged beside the target, fsynced, renamed) to
/// `output`, by default `run_dir/report.html`; saves info.machine as machine.json (see above).
/// Returns the path written. It reads the whole metrics.jsonl each time: about 2.7 s and 85 MB
/// per million steps on one core (measured), 0.1 s for 20,000 — cheap at each evaluation.
std::filesystem::path write_run_report(const std::filesystem::path& run_dir, const RunReportInfo& info = {},
                                       const std::filesystem::path& output = {});

/// The number of the last line of `run_dir`'s metrics.jsonl where it is incomplete (does not
/// parse: a run killed while writing it), which the report leaves out and says so; nullopt where
/// every line is whole. Throws as render_run_report does.
std::optional<std::size_t> incomplete_metrics_line(const std::filesystem::path& run_dir);

/// This machine, for RunReportInfo::machine: "cpu" (model name), "cpu_threads" (logical CPUs this
/// process may use), "simd" (the CPU kernels' vector path), "host_memory" (total, e.g.
/// "125.6 GiB"), "os" (kernel name and release), "megatrain" (the library's version); and, with
/// `cuda_device` >= 0 in a CUDA build, "gpu" (name), "gpu_memory", "gpu_compute_capability" and
/// "cuda_driver" of that device. Facts that cannot be read are left out; never throws.
nlohmann::json describe_machine(int cuda_device = -1);

}  // namespace megatrain::io
