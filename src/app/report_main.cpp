// megatrain-report (programs.hpp): report.html for a run folder, after the fact (megatrain-train writes one
// itself at each evaluation and at the end). See docs/report.md.
//
//   megatrain-report runs/mine                      # writes runs/mine/report.html
//   megatrain-report runs/mine --output mine.html   # somewhere else
//
// The report shows the training and validation loss, learning rate, gradient norm, clip
// coefficient and tokens/s against the step (inline SVG: no network, no JavaScript), then the
// run's options, model and machine. It can be made while the run is still going.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <string>

#include "megatrain/core/error.hpp"
#include "megatrain/core/version.hpp"
#include "megatrain/io/run_report.hpp"
#include "programs.hpp"

namespace megatrain::app {

namespace fs = std::filesystem;

int report_main(int argc, char** argv) {
  std::string run_dir, output, title;
  CLI::App app{"megatrain-report: a self-contained report.html (charts and tables) for a megatrain-train run folder", "megatrain-report"};
  app.set_version_flag("--version", "megatrain-report " + std::string(megatrain::version()), "Print the version and exit");
  app.add_option("RUN_DIR", run_dir, "The run folder (megatrain-train --out DIR): its metrics.jsonl, options.json, config.json")
      ->required();
  app.add_option("--output,-o", output, "Where to write the report (default: RUN_DIR/report.html)");
  app.add_option("--title", title, "The report's heading (default: megatrain run <the folder's name>)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 1;  // (--help: 0; a usage error, printed with what to do: 1)
  }
  try {
    if (!output.empty()) {
      const fs::path parent = fs::path(output).parent_path();
      MT_CHECK(parent.empty() || fs::is_directory(parent), "--output '{}': the folder '{}' does not exist; create it first",
               output, parent.string());
      MT_CHECK(!fs::is_directory(output), "--output '{}' is a folder; give a file name, e.g. {}", output,
               (fs::path(output) / megatrain::io::kRunReportFile).string());
    }
    megatrain::io::RunReportInfo info;
    info.title = title;
    const fs::path written = megatrain::io::write_run_report(run_dir, info, output);
    if (const auto torn = megatrain::io::incomplete_metrics_line(run_dir))
      std::fprintf(stderr, "megatrain-report: warning: line %zu of %s is incomplete (the run was killed while writing it, "
                   "or is writing it now); the report leaves it out and says so\n", *torn,
                   (fs::path(run_dir) / "metrics.jsonl").string().c_str());
    std::printf("%s\n", written.string().c_str());
    return 0;
  } catch (const megatrain::Error& e) {
    std::fprintf(stderr, "megatrain-report: error: %s\n", e.reason().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "megatrain-report: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace megatrain::app
