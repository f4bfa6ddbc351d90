// report.html (megatrain/io/run_report.hpp): the page made from a run folder with known metrics —
// title and strings escaped, each chart there with its points, the tables' values, a torn last
// line tolerated, a malformed line elsewhere refused with its number, non-finite values left
// out and said, one step, thousands of steps, no network reference.
#include <doctest/doctest.h>
#include <stdlib.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/io/run_report.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;
using megatrain::io::RunReportInfo;
using megatrain::io::render_run_report;
using megatrain::io::write_run_report;

namespace {

class TempDir {
 public:
  TempDir() {
    std::string templ = (fs::temp_directory_path() / "megatrain-report-XXXXXX").string();
    REQUIRE(::mkdtemp(templ.data()) != nullptr);
    path_ = templ;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

void write(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary);
  out << text;
  REQUIRE(out.good());
}

std::string read(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::size_t count(const std::string& s, const std::string& part) {
  std::size_t n = 0;
  for (auto pos = s.find(part); pos != std::string::npos; pos = s.find(part, pos + part.size())) ++n;
  return n;
}

// One metrics line as megatrain-train writes it (nlohmann::json: NaN and infinities as null).
std::string metrics_line(double step, double loss, double lr, double grad_norm, double clip, double tok_s,
                         double val = std::numeric_limits<double>::quiet_NaN(), bool with_val = false) {
  json m{{"step", step},       {"loss", loss},          {"lr", lr},         {"grad_norm", grad_norm}, {"clip_coef", clip},
         {"tokens", 1024},     {"tokens_per_s", tok_s}, {"step_time_s", 1024 / tok_s}};
  if (with_val) m["val_loss"] = val;
  return m.dump() + "\n";
}

// The `data-points` of the series labelled `label`.
int series_points(const std::string& html, const std::string& label) {
  const std::regex re("data-series=\"" + label + "\" data-points=\"([0-9]+)\"");
  std::smatch m;
  if (!std::regex_search(html, m, re)) return -1;
  return std::stoi(m[1]);
}

// A run folder of five steps with known values.
void five_steps(const fs::path& dir) {
  std::string lines;
  lines += metrics_line(1, 4.0, 0.001, 3.0, 0.5, 1000);
  lines += metrics_line(2, 3.0, 0.002, 2.0, 1.0, 2000);
  lines += metrics_line(3, 2.5, 0.003, 1.5, 1.0, 3000, 2.75, true);
  lines += metrics_line(4, 1.5, 0.002, 1.0, 1.0, 4000);
  lines += metrics_line(5, 1.75, 0.001, 0.5, 1.0, 5000, 2.25, true);
  write(dir / "metrics.jsonl", lines);
  write(dir / "options.json", json{{"lr", "0.001"}, {"data", "<script>alert(\"x\")</script> & 'q'"}, {"steps", "5"}}.dump(2));
  write(dir / "config.json", json{{"hidden_size", 64}, {"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}}.dump(2));
}

}  // namespace

TEST_CASE("run report: the charts, the tables and the summary of known metrics, every string escaped") {
  TempDir tmp;
  const fs::path dir = tmp.path();
  five_steps(dir);
  RunReportInfo info;
  info.title = "Run <b>one</b> & \"two\"";
  info.machine = json{{"gpu", "Test GPU <H200>"}, {"host_memory", "1.0 GiB"}};
  const fs::path out = write_run_report(dir, info);
  CHECK(out == dir / "report.html");
  const std::string h = read(out);

  // Escaping: the title, and options.json's strings.
  CHECK(has(h, "<title>Run &lt;b&gt;one&lt;/b&gt; &amp; &quot;two&quot;</title>"));
  CHECK(has(h, "<h1>Run &lt;b&gt;one&lt;/b&gt; &amp; &quot;two&quot;</h1>"));
  CHECK_FALSE(has(h, "<b>one"));
  CHECK_FALSE(has(h, "<script"));
  CHECK(has(h, "<th>data</th><td>&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &#39;q&#39;</td>"));
  CHECK(has(h, "<th>gpu</th><td>Test GPU &lt;H200&gt;</td>"));

  // Every chart, with its series and points (the clip coefficient: one step was clipped).
  for (const char* id : {"loss", "lr", "grad_norm", "clip_coef", "tokens_per_s"}) {
    CAPTURE(id);
    CHECK(has(h, fmt::format("data-chart=\"{}\"", id)));
    CHECK(has(h, fmt::format("id=\"chart-{}\"", id)));
  }
  CHECK(series_points(h, "train loss") == 5);
  CHECK(series_points(h, "val loss") == 2);
  CHECK(series_points(h, "lr") == 5);
  CHECK(series_points(h, "grad norm") == 5);
  CHECK(series_points(h, "clip coef") == 5);
  CHECK(series_points(h, "tokens/s") == 5);
  CHECK(count(h, "<svg viewBox=\"0 0 760 300\" role=\"img\"") == 5);
  CHECK(count(h, "<polyline") == 6);
  CHECK(has(h, ">step</text>"));  // the x axis' title
  CHECK(has(h, ">0.003</text>"));  // a tick of the learning rate
  CHECK(has(h, "<g class=\"legend\">"));

  // Tables: options.json, config.json, machine facts.
  CHECK(has(h, "<th>lr</th><td>0.001</td>"));
  CHECK(has(h, "<th>steps</th><td>5</td>"));
  CHECK(has(h, "<th>hidden_size</th><td>64</td>"));
  CHECK(has(h, "<th>architectures</th><td>LlamaForCausalLM</td>"));
  CHECK(has(h, "<th>host_memory</th><td>1.0 GiB</td>"));

  // The summary.
  CHECK(has(h, "<th>steps</th><td>5 (steps 1 to 5)</td>"));
  CHECK(has(h, "<th>last loss</th><td>1.75 at step 5</td>"));
  CHECK(has(h, "<th>best loss</th><td>1.5 at step 4</td>"));
  CHECK(has(h, "<th>last val loss</th><td>2.25 at step 5</td>"));
  CHECK(has(h, "<th>best val loss</th><td>2.25 at step 5</td>"));
  CHECK(has(h, "<th>tokens trained</th><td>5,120</td>"));
  // 5 * 1024 tokens in 1024 * (1/1000 + 1/2000 + 1/3000 + 1/4000 + 1/5000) s
  // = 2189.8
  CHECK(has(h, "<th>mean tokens/s</th><td>2,190 ("));
  CHECK(has(h, "<th>clipped steps</th><td>1 of 5</td>"));
  CHECK_FALSE(has(h, "non-finite"));

  // Self-contained: no network reference, no script.
  CHECK_FALSE(has(h, "http://"));
  CHECK_FALSE(has(h, "https://"));
  CHECK_FALSE(has(h, "<script"));
  CHECK_FALSE(has(h, "<link"));

  // machine.json keeps the machine for a report made later from the folder alone; nothing staged is left.
  CHECK(json::parse(read(dir / "machine.json")) == info.machine);
  const std::string again = render_run_report(dir);
  CHECK(has(again, "<th>gpu</th><td>Test GPU &lt;H200&gt;</td>"));
  CHECK(has(again, "<title>megatrain run " + dir.filename().string() + "</title>"));
  for (const auto& e : fs::directory_iterator(dir)) CHECK_FALSE(has(e.path().filename().string(), ".partial-"));

  // Another output file.
  const fs::path other = dir / "elsewhere.html";
  CHECK(write_run_report(dir, {}, other) == other);
  CHECK(has(read(other), "data-chart=\"loss\""));
}

TEST_CASE("run report: a mixture of experts' auxiliary loss and tokens per expert, charted where present") {
  TempDir tmp;
  const fs::path dir = tmp.path();
  std::string lines;
  for (int s = 1; s <= 3; ++s) {
    json m = json::parse(metrics_line(s, 4.0 - s, 0.001, 1.0, 1.0, 1000));
    m["aux_loss"] = 2.5 - 0.1 * s;
    m["expert_tokens"] = json::array({json::array({0, 10 + s, 90 - s}), json::array({2, 5 * s, 70})});
    lines += m.dump() + "\n";
  }
  write(dir / "metrics.jsonl", lines);
  const std::string h = render_run_report(dir);
  CHECK(has(h, "data-chart=\"aux_loss\""));
  CHECK(has(h, "data-chart=\"expert_tokens\""));
  CHECK(series_points(h, "aux loss") == 3);
  CHECK(series_points(h, "most") == 3);
  CHECK(series_points(h, "fewest") == 3);
  // a dense model's run has neither chart
  five_steps(dir);
  const std::string dense = render_run_report(dir);
  CHECK_FALSE(has(dense, "data-chart=\"aux_loss\""));
  CHECK_FALSE(has(dense, "data-chart=\"expert_tokens\""));
  // a malformed entry is refused, naming the file and the line
  write(dir / "metrics.jsonl", json{{"step", 1}, {"loss", 1.0}, {"expert_tokens", json::array({1, 2})}}.dump() + "\n");
  try {
    (void)render_run_report(dir);
    FAIL("a malformed expert_tokens was accepted");
  } catch (const megatrain::Error& e) {
    CHECK(has(e.what(), "line 1"));
    CHECK(has(e.what(), "expert_tokens"));
  }
}

TEST_CASE("run report: preference training's accuracy and reward margin, train and validation, charted where present") {
  TempDir tmp;
  const fs::path dir = tmp.path();
  std::string lines;
  for (int s = 1; s <= 4; ++s) {
    json m = json::parse(metrics_line(s, 0.7 - 0.1 * s, 0.001, 1.0, 1.0, 1000));
    m["rewards/accuracies"] = 0.25 * s;
    m["rewards/margins"] = 0.3 * s;
    if (s % 2 == 0) {
      m["val_rewards/accuracies"] = 0.2 * s;
      m["val_rewards/margins"] = 0.25 * s;
    }
    lines += m.dump() + "\n";
  }
  write(dir / "metrics.jsonl", lines);
  const std::string h = render_run_report(dir);
  CHECK(has(h, "data-chart=\"rewards_accuracies\""));
  CHECK(has(h, "data-chart=\"rewards_margins\""));
  CHECK(series_points(h, "train") == 4);  // (the accuracy chart's: a point a step)
  CHECK(series_points(h, "val") == 2);    // (a point an evaluation)
  five_steps(dir);  // an SFT run has neither chart
  const std::string sft = render_run_report(dir);
  CHECK_FALSE(has(sft, "data-chart=\"rewards_accuracies\""));
  CHECK_FALSE(has(sft, "data-chart=\"rewards_margins\""));
}

TEST_CASE("run report: a torn last line is left out and said; blank lines are skipped") {
  TempDir tmp;
  const fs::path dir = tmp.path();
  five_steps(dir);
  std::string text = read(dir / "metrics.jsonl");
  text.insert(text.find('\n') + 1, "\n   \n");  // blank lines after line 1
  write(dir / "metrics.jsonl", text + "{\"step\": 6, \"loss\": 1.2, \"lr\"");
  const std::string h = render_run_report(dir);
  CHECK(series_points(h, "train loss") == 5);
  CHECK(has(h, "<th>steps</th><td>5 (steps 1 to 5)</td>"));
  CHECK(has(h, "line 8 of metrics.jsonl does not parse"));
  // A torn line that ends with its newline (a line written whole but cut): still the last.
  write(dir / "metrics.jsonl", text + "{\"step\": 6, \"lo\n\n");
  CHECK(has(render_run_report(dir), "line 8 of metrics.jsonl does not parse"));
}

TEST_CASE("run report: a malformed line before the last is refused with the file and its line number") {
  TempDir tmp;
  const fs::path dir = tmp.path();
  five_steps(dir);
  const std::string good = read(dir / "metrics.jsonl");
  const auto refused = [&](const std::string& bad_line, const std::string& why) {
    CAPTURE(bad_line);
    std::string text = good;
    std::size_t pos = 0;
    for (int i = 0; i < 2; ++i) pos = text.find('\n', pos) + 1;  // after line 2
    text.insert(pos, bad_line + "\n");
    write(dir / "metrics.jsonl", text);
    try {
      (void)render_run_report(dir);
      FAIL("no error");
    } catch (const megatrain::Error& e) {
      const std::string r = e.reason();
      CHECK(has(r, (dir / "metrics.jsonl").string()));
      CHECK(has(r, "line 3"));
      CHECK(has(r, why));
    }
  };
  refused("{\"step\": 3, \"loss\": ", "does not parse");
  refused("[1, 2, 3]", "not an object");
  refused("{\"loss\": 2.0}", "no numeric \"step\"");
  refused("{\"step\": 3, \"loss\": \"low\"}", "\"loss\" is \"low\", not a number");
  CHECK_THROWS_AS(write_run_report(dir), megatrain::Error);
  CHECK_FALSE(fs::exists(dir / "report.html"));  // nothing written
}

TEST_CASE("run report: NaN and infinite values are left out of the charts and counted") {
  TempDir tmp;
  const fs::path dir = tmp.path();
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  std::string lines;
  lines += metrics_line(1, 5.0, 0.001, 2.0, 1.0, 1000);
  lines += metrics_line(2, 4.0, 0.001, 2.0, 1.0, 1000);
  lines += metrics_line(3, nan, 0.001, inf, 1.0, 1000, nan, true);  // written as null by nlohmann::json
  lines += "{\"step\": 4, \"loss\": NaN, \"lr\": 0.001, \"grad_norm\": Infinity, \"tokens\": 1024}\n";  // Python's json
  lines += metrics_line(5, 3.0, 0.001, 2.0, 1.0, 1000);
  lines += metrics_line(6, 2.0, 0.001, 2.0, 1.0, 1000, 2.5, true);
  write(dir / "metrics.jsonl", lines);
  const std::string h = render_run_report(dir);
  CHECK(series_points(h, "train loss") == 4);
  CHECK(series_points(h, "grad norm") == 4);
  CHECK(series_points(h, "val loss") == 1);
  // The line is broken where the values are missing: two pieces of two points each.
  const auto loss_at = h.find("data-series=\"train loss\"");
  const auto loss_end = h.find("</g>", loss_at);
  CHECK(count(h.substr(loss_at, loss_end - loss_at), "<polyline") == 2);
  CHECK(has(h, "train loss: 2 non-finite values (NaN or infinity) left out of the chart, at steps 3, 4"));
  CHECK(has(h, "grad norm: 2 non-finite values"));
  CHECK(has(h, "val loss: 1 non-finite value (NaN or infinity) left out of the chart, at step 3"));
  CHECK(has(h, "<th>non-finite values</th><td>5 left out of the charts (loss 2, val_loss 1, grad_norm 2)</td>"));
  CHECK(has(h, "<g class=\"nonfinite\">"));
  CHECK(has(h, "<th>best loss</th><td>2 at step 6</td>"));
  // The last value not finite: said.
  write(dir / "metrics.jsonl", lines + metrics_line(7, nan, 0.001, 2.0, 1.0, 1000));
  CHECK(has(render_run_report(dir), "<th>last loss</th><td>not finite at step 7; last finite 2 at step 6</td>"));
  // Every value not finite: the chart says so.
  write(dir / "metrics.jsonl", metrics_line(1, nan, 0.001, 2.0, 1.0, 1000) + metrics_line(2, inf, 0.001, 2.0, 1.0, 1000));
  const std::string all_bad = render_run_report(dir);
  CHECK(has(all_bad, "no finite values"));
  CHECK(has(all_bad, "<th>last loss</th><td>not finite (step 2)</td>"));
}

TEST_CASE("run report: one step, no validation, no options, config or machine") {
  TempDir tmp;
  const fs::path dir = tmp.path();
  write(dir / "metrics.jsonl", metrics_line(1, 5.5, 0.0003, 1.25, 1.0, 5000));
  const std::string h = render_run_report(dir);
  CHECK(has(h, "<th>steps</th><td>1 (step 1)</td>"));
  CHECK(series_points(h, "train loss") == 1);
  CHECK(series_points(h, "val loss") == -1);  // no such series
  CHECK_FALSE(has(h, "data-chart=\"clip_coef\""));  // never clipped
  CHECK(has(h, "<circle"));                   // a lone point is drawn as a dot
  CHECK(has(h, "text-anchor=\"middle\">1</text>"));  // the step's tick
  CHECK(has(h, "<th>last val loss</th><td>none</td>"));
  CHECK(has(h, "no options.json in the run folder"));
  CHECK(has(h, "no config.json in the run folder"));
  CHECK(has(h, "not recorded (no machine.json in the run folder)"));
  // No step yet (a run that has just started): a report all the same.
  write(dir / "metrics.jsonl", "");
  const std::string empty = render_run_report(dir);
  CHECK(has(empty, "none recorded yet"));
  CHECK(has(empty, "no finite values"));
}

TEST_CASE("run report: thousands of steps are drawn as min and max per bucket, spikes kept, the file small") {
  TempDir tmp;
  const fs::path dir = tmp.path();
  std::string lines;
  const int n = 20000;
  for (int s = 1; s <= n; ++s) {
    const double loss = s == 12345 ? 50.0 : 1.0 + 1.0 / s;
    lines += metrics_line(s, loss, 0.001, 1.0, 1.0, 1000, 2.0 - s * 1e-5, s % 10 == 0);
  }
  write(dir / "metrics.jsonl", lines);
  write_run_report(dir);
  const std::string h = read(dir / "report.html");
  const int loss_points = series_points(h, "train loss");
  CHECK(loss_points > 1000);
  CHECK(loss_points <= 3000);
  CHECK(series_points(h, "val loss") == 2000);  // 2000 evaluations: drawn whole
  CHECK(has(h, ">50</text>"));                   // the spike is in the y range
  CHECK(has(h, "train loss: 20,000 values drawn as the mean of each of 1500 step ranges, their minimum and maximum shaded"));
  CHECK(has(h, "<polygon class=\"band\""));
  CHECK(has(h, ">20k</text>"));                  // the last step's tick
  CHECK(h.size() < 600 * 1024);
  MESSAGE("report of 20,000 steps: " << h.size() << " bytes");
}

TEST_CASE("run report: a missing folder, missing metrics and a file that is not an object are refused, naming them") {
  TempDir tmp;
  CHECK_THROWS_WITH_AS(render_run_report(tmp.path() / "absent"), doctest::Contains("absent' does not exist"), megatrain::Error);
  CHECK_THROWS_WITH_AS(render_run_report(tmp.path()), doctest::Contains("holds no metrics.jsonl"), megatrain::Error);
  CHECK_THROWS_WITH_AS(render_run_report(tmp.path()), doctest::Contains("megatrain-train --out DIR"), megatrain::Error);
  // A folder of runs: the runs inside it are named.
  fs::create_directories(tmp.path() / "run-a");
  write(tmp.path() / "run-a" / "metrics.jsonl", "");
  const std::string inside = "run folders inside it: " + (tmp.path() / "run-a").string();
  CHECK_THROWS_WITH_AS(render_run_report(tmp.path()), doctest::Contains(inside.c_str()), megatrain::Error);
  five_steps(tmp.path());
  write(tmp.path() / "options.json", "[\"not\", \"an object\"]");
  CHECK_THROWS_WITH_AS(render_run_report(tmp.path()), doctest::Contains("options.json' is not a JSON object"), megatrain::Error);
}

TEST_CASE("describe_machine: the CPU, its threads and the host memory") {
  const json m = megatrain::io::describe_machine();
  REQUIRE(m.is_object());
  CHECK(m.contains("cpu_threads"));
  CHECK(m.contains("host_memory"));
  CHECK(m.contains("megatrain"));
  CHECK(m.contains("simd"));
  CHECK_FALSE(m.contains("gpu"));  // not asked for
}
