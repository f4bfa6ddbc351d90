// report.html for a run folder (see include/megatrain/io/run_report.hpp and docs/report.md).
//
// Everything is generated here: the charts are inline SVG (no script, no font, no network), the
// styles one <style> element. Every string that comes from a file is HTML-escaped.
#include "megatrain/io/run_report.hpp"

#include <sched.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string_view>
#include <vector>

#include "megatrain/core/cpu_features.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/version.hpp"
#include "megatrain/io/detail/atomic_files.hpp"

#if MEGATRAIN_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace megatrain::io {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// ---- reading the run folder -----------------------------------------------------------------------

// One metric over the steps: its finite values, and the steps where it was not finite.
struct Series {
  std::vector<double> x, y;         // finite values, by step
  std::vector<double> nonfinite;    // steps whose value was NaN or infinite (null in the file)
  bool present() const { return !x.empty() || !nonfinite.empty(); }
};

struct Metrics {
  std::size_t rows = 0;
  double first_step = 0, last_step = 0;
  Series loss, val_loss, lr, grad_norm, clip_coef, tokens_per_s;
  // A mixture of experts: the auxiliary loss, and over all sparse layers the fewest and the most
  // tokens routed to one expert (expert_tokens: [layer, fewest, most] per layer).
  Series aux_loss, expert_min, expert_max;
  // Preference training (--objective dpo): TRL's accuracy and reward margin, train and validation.
  Series accuracy, val_accuracy, margin, val_margin;
  // Reinforcement learning (--objective grpo): the mean reward of the step's completions, and of
  // the validation prompts' greedy ones.
  Series reward, val_reward;
  double tokens = 0, step_time = 0, timed_tokens = 0;  // sums over finite values (timed: where both are)
  bool have_tokens = false, have_time = false;
  std::optional<std::size_t> torn_line;  // the last line, left out because it does not parse
};

// nlohmann::json writes NaN and infinities as null; other writers (Python's json) write NaN,
// Infinity and -Infinity, which are not JSON: outside strings they are read as null.
std::string nonfinite_literals_to_null(std::string_view line) {
  std::string out;
  bool in_string = false;
  for (std::size_t i = 0; i < line.size();) {
    const char c = line[i];
    if (in_string) {
      out += c;
      if (c == '\\' && i + 1 < line.size()) out += line[++i];
      else if (c == '"') in_string = false;
      ++i;
      continue;
    }
    if (c == '"') in_string = true;
    bool replaced = false;
    for (const std::string_view w : {"-Infinity", "Infinity", "-NaN", "NaN", "-inf", "inf", "-nan", "nan"}) {
      if (line.substr(i, w.size()) == w) {
        out += "null";
        i += w.size();
        replaced = true;
        break;
      }
    }
    if (!replaced) out += line[i++];
  }
  return out;
}

// A number, or NaN for a value that stands for one that is not finite (null, "NaN", "inf"...).
// Anything else: nullopt.
std::optional<double> number_of(const json& v) {
  if (v.is_number()) return v.get<double>();
  if (v.is_null()) return std::numeric_limits<double>::quiet_NaN();
  if (v.is_string()) {
    std::string s = v.get<std::string>();
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    if (s == "nan" || s == "-nan" || s == "inf" || s == "-inf" || s == "infinity" || s == "-infinity")
      return std::numeric_limits<double>::quiet_NaN();
  }
  return std::nullopt;
}

Metrics read_metrics(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  MT_CHECK(in.good(), "cannot open '{}'", file.string());
  Metrics m;
  std::string line;
  std::size_t line_no = 0;
  std::optional<std::pair<std::size_t, std::string>> bad;  // a line that did not parse, and why
  bool sorted = true;
  while (std::getline(in, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    // A line that did not parse is only accepted as the last one (a torn write).
    MT_CHECK(!bad, "'{}' line {} is not a JSON object of metrics ({}); only the last line may be incomplete", file.string(),
             bad->first, bad->second);
    json j = json::parse(line, nullptr, false);
    if (j.is_discarded()) j = json::parse(nonfinite_literals_to_null(line), nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      bad.emplace(line_no, j.is_discarded() ? "it does not parse" : "it is not an object");
      continue;
    }
    const auto step_it = j.find("step");
    std::optional<double> step;
    if (step_it != j.end()) step = number_of(*step_it);
    if (!step || !std::isfinite(*step)) {
      bad.emplace(line_no, "it has no numeric \"step\"");
      continue;
    }
    const double x = *step;
    if (m.rows > 0 && x < m.last_step) sorted = false;
    if (m.rows == 0) m.first_step = x;
    m.first_step = std::min(m.first_step, x);
    m.last_step = std::max(m.last_step, x);
    ++m.rows;
    const auto value = [&](const char* key) -> std::optional<double> {
      const auto it = j.find(key);
      if (it == j.end()) return std::nullopt;
      const std::optional<double> v = number_of(*it);
      MT_CHECK(v.has_value(), "'{}' line {}: \"{}\" is {}, not a number", file.string(), line_no, key, it->dump());
      return v;
    };
    const auto take = [&](const char* key, Series& s) {
      const std::optional<double> v = value(key);
      if (!v) return;
      if (std::isfinite(*v)) {
        s.x.push_back(x);
        s.y.push_back(*v);
      } else {
        s.nonfinite.push_back(x);
      }
    };
    take("loss", m.loss);
    take("val_loss", m.val_loss);
    take("lr", m.lr);
    take("grad_norm", m.grad_norm);
    take("clip_coef", m.clip_coef);
    take("tokens_per_s", m.tokens_per_s);
    take("aux_loss", m.aux_loss);
    take("rewards/accuracies", m.accuracy);
    take("val_rewards/accuracies", m.val_accuracy);
    take("rewards/margins", m.margin);
    take("val_rewards/margins", m.val_margin);
    take("reward", m.reward);
    take("val_reward", m.val_reward);
    if (const auto it = j.find("expert_tokens"); it != j.end() && it->is_array() && !it->empty()) {
      double lo = std::numeric_limits<double>::infinity(), hi = -lo;
      for (const json& l : *it) {
        MT_CHECK(l.is_array() && l.size() == 3 && l[1].is_number() && l[2].is_number(),
                 "'{}' line {}: \"expert_tokens\" holds {}, not [layer, fewest, most]", file.string(), line_no, l.dump());
        lo = std::min(lo, l[1].get<double>());
        hi = std::max(hi, l[2].get<double>());
      }
      m.expert_min.x.push_back(x), m.expert_min.y.push_back(lo);
      m.expert_max.x.push_back(x), m.expert_max.y.push_back(hi);
    }
    const std::optional<double> tokens = value("tokens"), time = value("step_time_s");
    if (tokens && std::isfinite(*tokens)) m.tokens += *tokens, m.have_tokens = true;
    if (time && std::isfinite(*time)) m.step_time += *time, m.have_time = true;
    if (tokens && time && std::isfinite(*tokens) && std::isfinite(*time)) m.timed_tokens += *tokens;
  }
  MT_CHECK(!in.bad(), "cannot read '{}'", file.string());
  if (bad) m.torn_line = bad->first;
  if (!sorted) {  // (steps out of order: written by hand or by another tool) order each series by step
    for (Series* s : {&m.loss, &m.val_loss, &m.lr, &m.grad_norm, &m.clip_coef, &m.tokens_per_s, &m.aux_loss, &m.expert_min,
                      &m.expert_max}) {
      std::vector<std::size_t> order(s->x.size());
      for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return s->x[a] < s->x[b]; });
      Series t;
      for (const std::size_t i : order) t.x.push_back(s->x[i]), t.y.push_back(s->y[i]);
      t.nonfinite = std::move(s->nonfinite);
      *s = std::move(t);
    }
  }
  for (Series* s : {&m.loss, &m.val_loss, &m.lr, &m.grad_norm, &m.clip_coef, &m.tokens_per_s, &m.aux_loss})
    std::sort(s->nonfinite.begin(), s->nonfinite.end());
  return m;
}

// An optional JSON object file of the run folder: null where it does not exist.
json read_object_file(const fs::path& file) {
  std::error_code ec;
  if (!fs::exists(file, ec)) return nullptr;
  const std::string text = detail::read_file(file, 64u << 20);
  json j = json::parse(text, nullptr, false);
  MT_CHECK(!j.is_discarded() && j.is_object(), "'{}' is not a JSON object; fix or remove it", file.string());
  return j;
}

// ---- formatting -------------------------------------------------------------------------------

std::string escape(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 16);
  for (const char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// 1234567 -> "1,234,567"
std::string grouped(double v) {
  const auto n = static_cast<long long>(std::llround(v));
  std::string digits = std::to_string(n < 0 ? -n : n), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

std::string step_text(double x) {
  return x == std::floor(x) && std::abs(x) < 1e15 ? grouped(x) : fmt::format("{:g}", x);
}

// A short label for an axis tick: 12500 -> "12.5k", 0.0025 -> "0.0025", 0.00025 -> "2.5e-4".
std::string tick_label(double v, double tick) {
  if (std::abs(v) < tick * 1e-6) return "0";
  const double a = std::abs(v);
  if (a >= 1e9) return fmt::format("{:g}G", v / 1e9);
  if (a >= 1e6) return fmt::format("{:g}M", v / 1e6);
  if (a >= 1e4) return fmt::format("{:g}k", v / 1e3);
  if (a < 1e-3) {  // 0.00025 -> "2.5e-4"
    const int e = static_cast<int>(std::floor(std::log10(a) + 1e-9));
    return fmt::format("{:g}e{}", std::round(v / std::pow(10.0, e) * 1e3) / 1e3, e);
  }
  return fmt::format("{:g}", v);
}

std::string duration_text(double s) {
  if (s < 60) return fmt::format("{:.1f} s", s);
  const auto t = static_cast<long long>(std::llround(s));
  return fmt::format("{}:{:02}:{:02} (h:mm:ss)", t / 3600, (t / 60) % 60, t % 60);
}

std::string steps_list(const std::vector<double>& steps) {
  std::string out;
  const std::size_t shown = std::min<std::size_t>(steps.size(), 10);
  for (std::size_t i = 0; i < shown; ++i) out += (i ? ", " : "") + step_text(steps[i]);
  if (steps.size() > shown) out += fmt::format(" and {} more", steps.size() - shown);
  return out;
}

// A table cell for a JSON value: strings as they are, arrays of scalars joined, others as JSON.
std::string value_text(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_array() && std::all_of(v.begin(), v.end(), [](const json& e) { return e.is_primitive(); })) {
    std::string out;
    for (const json& e : v) out += (out.empty() ? "" : ", ") + value_text(e);
    return out;
  }
  return v.dump();
}

std::string key_value_table(const char* id, const json& obj, const char* empty_text) {
  if (!obj.is_object() || obj.empty()) return fmt::format("<p class=\"none\" id=\"{}\">{}</p>\n", id, empty_text);
  std::string out = fmt::format("<table class=\"kv\" id=\"{}\">\n", id);
  for (const auto& [k, v] : obj.items())
    out += fmt::format("<tr><th>{}</th><td>{}</td></tr>\n", escape(k), escape(value_text(v)));
  return out + "</table>\n";
}

// ---- charts -----------------------------------------------------------------------------------

constexpr double kWidth = 760, kHeight = 300;
constexpr double kLeft = 70, kRight = 16, kTop = 34, kBottom = 40;
constexpr double kPlotW = kWidth - kLeft - kRight, kPlotH = kHeight - kTop - kBottom;
constexpr std::size_t kBuckets = 1500;  // a series of more steps is drawn as min and max per bucket

struct Point {
  double x, y;      // a step and its value; for a bucket, the means of its steps and values
  double lo, hi;    // the bucket's smallest and largest value (y, y for a single value)
  bool gap_before;  // a non-finite value lies between this point and the one before
};

// What to draw: every finite value, or, for a series longer than 2 * kBuckets, one point per
// bucket of steps (kBuckets of equal width): the mean, and the minimum and maximum, shaded
// around it, which keep every spike in sight.
std::vector<Point> downsample(const Series& s, double x0, double x1, bool& bucketed) {
  const std::size_t n = s.x.size();
  std::vector<Point> pts;
  std::vector<std::pair<double, double>> span;  // the first and last step of each point
  bucketed = n > 2 * kBuckets && x1 > x0;
  if (!bucketed) {
    for (std::size_t i = 0; i < n; ++i) {
      pts.push_back({s.x[i], s.y[i], s.y[i], s.y[i], false});
      span.emplace_back(s.x[i], s.x[i]);
    }
  } else {
    const auto bucket_of = [&](double x) {
      return static_cast<std::size_t>(std::clamp((x - x0) / (x1 - x0) * kBuckets, 0.0, kBuckets - 1.0));
    };
    for (std::size_t i = 0; i < n;) {
      const std::size_t b = bucket_of(s.x[i]);
      double sx = 0, sy = 0, lo = s.y[i], hi = s.y[i];
      std::size_t j = i;
      for (; j < n && bucket_of(s.x[j]) == b; ++j) {
        sx += s.x[j], sy += s.y[j];
        lo = std::min(lo, s.y[j]), hi = std::max(hi, s.y[j]);
      }
      const auto k = static_cast<double>(j - i);
      pts.push_back({sx / k, sy / k, lo, hi, false});
      span.emplace_back(s.x[i], s.x[j - 1]);
      i = j;
    }
  }
  for (std::size_t k = 1; k < pts.size() && !s.nonfinite.empty(); ++k) {
    const auto it = std::upper_bound(s.nonfinite.begin(), s.nonfinite.end(), span[k - 1].second);
    pts[k].gap_before = it != s.nonfinite.end() && *it < span[k].first;
  }
  return pts;
}

double nice_step(double range, int target) {
  const double raw = range / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * mag;
}

struct Line {
  std::string label, color;
  const Series* series;
  bool points;  // drawn as markers joined by a dashed line (evaluations), else as a line
};

// Where a chart's values land: its x and y ranges (y on a logarithmic axis where `log`).
struct Frame {
  double x0, x1, y0, y1;
  bool log;
  double px(double x) const { return kLeft + (x - x0) / (x1 - x0) * kPlotW; }
  double py(double y) const {
    const double f = log ? std::log(y / y0) / std::log(y1 / y0) : (y - y0) / (y1 - y0);
    return kTop + (1 - f) * kPlotH;
  }
};

// The y axis around values in [y0, y1]: on a log scale where `log_if_wide` and the positive
// values span more than 30 times (whole decades; with few, 2 and 5 times each too), else widened
// to whole ticks (a flat series gets room around it). Sets f's y range and scale; the ticks.
std::vector<std::pair<double, std::string>> y_axis(Frame& f, bool log_if_wide) {
  std::vector<std::pair<double, std::string>> ticks;  // value, label
  f.log = log_if_wide && f.y0 > 0 && f.y1 / f.y0 > 30;
  if (f.log) {
    f.y0 = std::pow(10.0, std::floor(std::log10(f.y0)));
    f.y1 = std::pow(10.0, std::ceil(std::log10(f.y1)));
    const int decades = static_cast<int>(std::lround(std::log10(f.y1 / f.y0)));
    for (int d = 0; d <= decades; ++d) {
      const double v = f.y0 * std::pow(10.0, d);
      ticks.emplace_back(v, tick_label(v, v));
      if (decades <= 3 && d < decades)
        for (const double m : {2.0, 5.0}) ticks.emplace_back(v * m, tick_label(v * m, v));
    }
    return ticks;
  }
  if (!(f.y1 > f.y0)) {
    const double pad = f.y0 == 0 ? 1 : std::abs(f.y0) * 0.1;
    f.y0 -= pad, f.y1 += pad;
  }
  const double ty = nice_step(f.y1 - f.y0, 5);
  f.y0 = std::floor(f.y0 / ty) * ty;
  f.y1 = std::ceil(f.y1 / ty) * ty;
  for (double k = std::ceil(f.y0 / ty - 1e-9); k * ty <= f.y1 + ty * 1e-9; k += 1) ticks.emplace_back(k * ty, tick_label(k * ty, ty));
  return ticks;
}

// The grid, the ticks and their labels, and the axes' titles.
std::string axes_svg(const Frame& f, const std::vector<std::pair<double, std::string>>& yticks, std::string_view what) {
  std::string svg;
  for (const auto& [v, label] : yticks) {
    const double y = f.py(v);
    svg += fmt::format("<line class=\"grid\" x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\"/>"
                       "<text class=\"tick\" x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n",
                       kLeft, y, kLeft + kPlotW, y, kLeft - 6, y + 4, label);
  }
  const double tx = std::max(1.0, std::round(nice_step(f.x1 - f.x0, 8)));
  for (double k = std::ceil(f.x0 / tx - 1e-9); k * tx <= f.x1 + 1e-9; k += 1) {
    const double x = f.px(k * tx);
    svg += fmt::format("<line class=\"grid\" x1=\"{:.1f}\" y1=\"{}\" x2=\"{:.1f}\" y2=\"{}\"/>"
                       "<text class=\"tick\" x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
                       x, kTop, x, kTop + kPlotH, x, kTop + kPlotH + 16, tick_label(k * tx, tx));
  }
  svg += fmt::format("<text class=\"axis\" x=\"{}\" y=\"{}\" text-anchor=\"middle\">step</text>\n", kLeft + kPlotW / 2,
                     kHeight - 6);
  svg += fmt::format("<text class=\"axis\" x=\"14\" y=\"{}\" text-anchor=\"middle\" "
                     "transform=\"rotate(-90 14 {})\">{}{}</text>\n",
                     kTop + kPlotH / 2, kTop + kPlotH / 2, what, f.log ? " (log scale)" : "");
  return svg;
}

// One line's points: polylines broken where values were not finite; a lone point as a dot; the
// range of each bucket of a long series (`bucketed`) shaded behind its line.
std::string series_svg(const Frame& f, const Line& l, const std::vector<Point>& p, bool bucketed) {
  std::string svg = fmt::format("<g class=\"series\" data-series=\"{}\" data-points=\"{}\" stroke=\"{}\" fill=\"{}\">\n",
                                l.label, p.size(), l.color, l.color);
  std::size_t start = 0;
  for (std::size_t i = 1; i <= p.size(); ++i) {
    if (i < p.size() && !p[i].gap_before) continue;
    if (i - start == 1 && !l.points) {
      svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2.5\"/>\n", f.px(p[start].x), f.py(p[start].y));
    } else if (i - start > 1) {
      if (bucketed) {
        svg += "<polygon class=\"band\" points=\"";
        for (std::size_t k = start; k < i; ++k) svg += fmt::format("{:.1f},{:.1f} ", f.px(p[k].x), f.py(p[k].hi));
        for (std::size_t k = i; k-- > start;)
          svg += fmt::format("{:.1f},{:.1f}{}", f.px(p[k].x), f.py(p[k].lo), k > start ? " " : "");
        svg += "\"/>\n";
      }
      svg += fmt::format("<polyline class=\"{}\" points=\"", l.points ? "dashed" : "line");
      for (std::size_t k = start; k < i; ++k)
        svg += fmt::format("{}{:.1f},{:.1f}", k > start ? " " : "", f.px(p[k].x), f.py(p[k].y));
      svg += "\"/>\n";
    }
    start = i;
  }
  if (l.points && p.size() <= 300)
    for (const Point& q : p) svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\"/>\n", f.px(q.x), f.py(q.y));
  return svg + "</g>\n";
}

// Steps whose values were not finite: marks along the top of the plot.
std::string nonfinite_marks(const Frame& f, const std::vector<Line>& lines) {
  std::vector<long> marked;
  for (const Line& l : lines)
    for (const double x : l.series->nonfinite) marked.push_back(std::lround(f.px(x)));
  std::sort(marked.begin(), marked.end());
  marked.erase(std::unique(marked.begin(), marked.end()), marked.end());
  if (marked.empty()) return {};
  std::string svg = "<g class=\"nonfinite\">";
  for (const long x : marked) svg += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\"/>", x, kTop, x, kTop + 8);
  return svg + "</g>\n";
}

// The legend, right-aligned above the plot.
std::string legend_svg(const std::vector<Line>& lines) {
  std::string svg;
  double right = kLeft + kPlotW;
  for (std::size_t li = lines.size(); li-- > 0;) {
    const Line& l = lines[li];
    const double text_w = 7.0 * static_cast<double>(l.label.size());
    const double x = right - text_w - 26;
    svg += fmt::format("<g class=\"legend\"><line x1=\"{:.1f}\" y1=\"18\" x2=\"{:.1f}\" y2=\"18\" stroke=\"{}\"{}/>", x, x + 20,
                       l.color, l.points ? " stroke-dasharray=\"4 3\"" : "");
    if (l.points) svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"18\" r=\"3\" fill=\"{}\"/>", x + 10, l.color);
    svg += fmt::format("<text x=\"{:.1f}\" y=\"22\">{}</text></g>\n", x + 25, l.label);
    right = x - 14;
  }
  return svg;
}

// What a chart left out: non-finite values, and long series drawn by buckets.
std::string chart_notes(const std::vector<Line>& lines) {
  std::string out;
  for (const Line& l : lines) {
    const std::vector<double>& bad = l.series->nonfinite;
    if (!bad.empty())
      out += fmt::format("<p class=\"note warn\">{}: {} non-finite value{} (NaN or infinity) left out of the chart, at step{} {} "
                         "(marked in red along the top)</p>\n",
                         l.label, bad.size(), bad.size() == 1 ? "" : "s", bad.size() == 1 ? "" : "s", steps_list(bad));
    if (l.series->x.size() > 2 * kBuckets)
      out += fmt::format("<p class=\"note\">{}: {} values drawn as the mean of each of {} step ranges, their minimum "
                         "and maximum shaded</p>\n",
                         l.label, grouped(static_cast<double>(l.series->x.size())), kBuckets);
  }
  return out;
}

// A chart of `lines` against the step. `log_if_wide`: positive values whose largest is more than
// 30 times the smallest (a gradient norm with a spike) are drawn on a logarithmic y axis.
std::string chart(std::string_view id, std::string_view title, std::string_view what, const std::vector<Line>& lines,
                  double first_step, double last_step, bool log_if_wide = false) {
  Frame f{first_step, last_step, std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(), false};
  if (!(f.x1 > f.x0)) f.x0 -= 0.5, f.x1 += 0.5;  // (a single step gets room on both sides)
  std::vector<std::vector<Point>> pts;
  std::vector<bool> bucketed;
  std::size_t total = 0;
  for (const Line& l : lines) {
    bool b = false;
    pts.push_back(downsample(*l.series, f.x0, f.x1, b));
    bucketed.push_back(b);
    for (const Point& p : pts.back()) f.y0 = std::min(f.y0, p.lo), f.y1 = std::max(f.y1, p.hi);
    total += pts.back().size();
  }
  std::string svg;
  svg += fmt::format("<figure class=\"chart\" id=\"chart-{}\">\n<figcaption>{}</figcaption>\n", id, title);
  svg += fmt::format(
      "<svg viewBox=\"0 0 {} {}\" role=\"img\" aria-label=\"{} against the step\" data-chart=\"{}\" data-points=\"{}\">\n",
      kWidth, kHeight, title, id, total);
  svg += fmt::format("<title>{} against the step</title>\n", title);
  svg += fmt::format("<rect class=\"plot\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\"/>\n", kLeft, kTop, kPlotW, kPlotH);
  if (total == 0) {
    svg += fmt::format("<text class=\"empty\" x=\"{}\" y=\"{}\" text-anchor=\"middle\">no finite values</text>\n",
                       kLeft + kPlotW / 2, kTop + kPlotH / 2);
  } else {
    const auto yticks = y_axis(f, log_if_wide);
    svg += axes_svg(f, yticks, what);
    for (std::size_t li = 0; li < lines.size(); ++li) svg += series_svg(f, lines[li], pts[li], bucketed[li]);
    svg += nonfinite_marks(f, lines);
  }
  svg += legend_svg(lines) + "</svg>\n";
  return svg + chart_notes(lines) + "</figure>\n";
}

// ---- the page ---------------------------------------------------------------------------------

constexpr const char* kStyle = R"(
:root { color-scheme: light; }
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; margin: 2em auto;
       max-width: 1600px; padding: 0 1.5em; color: #1a1a1a; background: #fff; line-height: 1.4; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; word-break: break-word; }
h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
.sub { color: #555; margin-top: 0; }
code { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; font-size: 0.95em; }
.charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(460px, 1fr)); gap: 1.2em; }
figure.chart { margin: 0; padding: 0.6em; border: 1px solid #e3e3e3; border-radius: 6px; break-inside: avoid; }
figcaption { font-weight: 600; margin-bottom: 0.3em; }
svg { width: 100%; height: auto; display: block; font-size: 12px; }
svg .plot { fill: #fcfcfc; stroke: #bbb; }
svg .grid { stroke: #e6e6e6; }
svg .tick { fill: #555; }
svg .axis { fill: #333; font-size: 13px; }
svg .empty { fill: #888; font-size: 15px; }
svg .legend text { fill: #222; }
svg .legend line { stroke-width: 2.5; }
svg .series polyline { fill: none; stroke-width: 1.6; stroke-linejoin: round; }
svg .series polyline.dashed { stroke-dasharray: 5 3; stroke-width: 1.2; }
svg .series circle { stroke: none; }
svg .series polygon.band { fill-opacity: 0.3; stroke-width: 0.6; stroke-opacity: 0.6; stroke-linejoin: round; }
svg .nonfinite line { stroke: #d00; stroke-width: 1.5; }
.note { font-size: 0.85em; color: #555; margin: 0.3em 0 0; }
.warn { color: #a00; }
table { border-collapse: collapse; font-size: 0.92em; }
th, td { text-align: left; padding: 0.25em 0.9em 0.25em 0; border-bottom: 1px solid #eee; vertical-align: top; }
th { font-weight: 600; white-space: nowrap; }
td { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; word-break: break-all; }
.tables { display: grid; grid-template-columns: repeat(auto-fit, minmax(360px, 1fr)); gap: 0 2em; }
.none { color: #777; font-style: italic; }
footer { margin-top: 2em; color: #777; font-size: 0.85em; }
@media print {
  body { margin: 0; max-width: none; font-size: 10pt; }
  .charts { grid-template-columns: 1fr 1fr; }
  section, table, figure.chart { break-inside: avoid; }
}
)";

std::string utc_now() {
  const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

// "2.0076 at step 40"
std::string value_at(double v, double step) { return fmt::format("{:.6g} at step {}", v, step_text(step)); }

// The last value of a series, saying so where a later step's value was not finite.
std::string last_text(const Series& s) {
  const bool nonfinite_last = !s.nonfinite.empty() && (s.x.empty() || s.nonfinite.back() > s.x.back());
  if (s.x.empty()) return nonfinite_last ? fmt::format("not finite (step {})", step_text(s.nonfinite.back())) : "none";
  const std::string last = value_at(s.y.back(), s.x.back());
  return nonfinite_last ? fmt::format("not finite at step {}; last finite {}", step_text(s.nonfinite.back()), last) : last;
}

std::string best_text(const Series& s) {
  if (s.x.empty()) return "none";
  const auto it = std::min_element(s.y.begin(), s.y.end());
  return value_at(*it, s.x[static_cast<std::size_t>(it - s.y.begin())]);
}

fs::path folder_of(const fs::path& run_dir) {
  fs::path p = fs::absolute(run_dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return p;
}

}  // namespace

// samples.jsonl (megatrain-train --sample-every): each prompt's completion at the first and the
// latest sampled step; "" where the run has none.
std::string samples_section(const fs::path& run_dir) {
  std::error_code ec;
  const fs::path file = run_dir / "samples.jsonl";
  if (!fs::exists(file, ec)) return {};
  std::map<std::int64_t, std::map<std::int64_t, json>> by_step;  // step -> index -> line
  std::istringstream in(detail::read_file(file, 64u << 20));
  for (std::string line; std::getline(in, line);) {
    const json j = json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("step") && j.contains("index") && j["step"].is_number_integer() && j["index"].is_number_integer())
      by_step[j["step"].get<std::int64_t>()][j["index"].get<std::int64_t>()] = j;
  }
  if (by_step.empty()) return {};
  std::vector<std::int64_t> steps{by_step.begin()->first};
  if (by_step.size() > 1) steps.push_back(by_step.rbegin()->first);
  const auto cut = [](std::string t) {  // (at most 600 bytes, cut between UTF-8 characters)
    if (t.size() <= 600) return escape(t);
    std::size_t n = 600;
    while (n > 0 && (static_cast<unsigned char>(t[n]) & 0xC0) == 0x80) --n;
    return escape(t.substr(0, n)) + "...";
  };
  std::string h = "<section id=\"samples\">\n<h2>Samples</h2>\n<p>Greedy completions of <code>--sample-prompts</code> "
                  "(<code>samples.jsonl</code>), at the first and the latest sampled step.</p>\n"
                  "<table id=\"samples-table\">\n<tr><th>prompt</th>";
  for (const auto st : steps) h += fmt::format("<th>step {}</th>", st);
  h += "</tr>\n";
  for (const auto& [index, first] : by_step.at(steps.front())) {
    h += "<tr><td style=\"white-space: pre-wrap\">" + cut(first.value("prompt", std::string())) + "</td>";
    for (const auto st : steps) {
      const auto& row = by_step.at(st);
      const auto it = row.find(index);
      h += "<td style=\"white-space: pre-wrap\">" + (it == row.end() ? std::string() : cut(it->second.value("completion", std::string()))) + "</td>";
    }
    h += "</tr>\n";
  }
  return h + "</table>\n</section>\n";
}

// A folder without metrics.jsonl refused; a folder of runs (runs/) given for one of them names them.
void refuse_missing_metrics(const fs::path& run_dir) {
  std::error_code ec;
  if (fs::exists(run_dir / "metrics.jsonl", ec)) return;
  std::vector<std::string> runs;
  for (const auto& e : fs::directory_iterator(run_dir, ec))
    if (e.is_directory(ec) && fs::exists(e.path() / "metrics.jsonl", ec)) runs.push_back(e.path().string());
  std::sort(runs.begin(), runs.end());
  if (runs.size() > 5) runs.resize(5), runs.back() = "...";
  MT_FAIL("'{}' holds no metrics.jsonl: give the folder a run wrote (megatrain-train --out DIR), after its first step{}",
          run_dir.string(), runs.empty() ? "" : fmt::format("; run folders inside it: {}", fmt::join(runs, ", ")));
}

// The summary table: steps, losses, tokens, time, clipping, and what was left out.
std::string summary_section(const Metrics& m) {
  std::string h;
  h += "<section id=\"summary\">\n<h2>Summary</h2>\n<table class=\"kv\" id=\"summary-table\">\n";
  const auto row = [&](std::string_view k, const std::string& v) {
    h += fmt::format("<tr><th>{}</th><td>{}</td></tr>\n", k, escape(v));
  };
  if (m.rows == 0) {
    row("steps", "none recorded yet");
  } else {
    const std::string rows = grouped(static_cast<double>(m.rows));
    row("steps", m.first_step == m.last_step
                     ? fmt::format("{} (step {})", rows, step_text(m.first_step))
                     : fmt::format("{} (steps {} to {})", rows, step_text(m.first_step), step_text(m.last_step)));
    row("last loss", last_text(m.loss));
    row("best loss", best_text(m.loss));
    row("last val loss", last_text(m.val_loss));
    row("best val loss", best_text(m.val_loss));
    if (m.reward.present()) row("last reward", last_text(m.reward));
    if (m.val_reward.present()) row("last val reward", last_text(m.val_reward));
    if (m.have_tokens) row("tokens trained", grouped(m.tokens));
    if (m.have_time && m.step_time > 0)
      row("mean tokens/s", fmt::format("{} (tokens over the steps' time)", grouped(m.timed_tokens / m.step_time)));
    if (m.have_time) row("total step time", duration_text(m.step_time) + " (evaluation and saving not included)");
    if (!m.clip_coef.x.empty()) {
      const auto clipped = std::count_if(m.clip_coef.y.begin(), m.clip_coef.y.end(), [](double c) { return c < 1; });
      row("clipped steps", fmt::format("{} of {}", grouped(static_cast<double>(clipped)),
                                       grouped(static_cast<double>(m.clip_coef.x.size()))));
    }
  }
  std::size_t nonfinite = 0;
  for (const Series* s : {&m.loss, &m.val_loss, &m.lr, &m.grad_norm, &m.clip_coef, &m.tokens_per_s, &m.aux_loss})
    nonfinite += s->nonfinite.size();
  if (nonfinite > 0) {
    std::string where;
    const std::pair<const char*, const Series*> named[] = {{"loss", &m.loss}, {"val_loss", &m.val_loss}, {"lr", &m.lr},
                                                           {"grad_norm", &m.grad_norm}, {"clip_coef", &m.clip_coef},
                                                           {"tokens_per_s", &m.tokens_per_s}, {"aux_loss", &m.aux_loss}};
    for (const auto& [name, s] : named)
      if (!s->nonfinite.empty()) where += fmt::format("{}{} {}", where.empty() ? "" : ", ", name, s->nonfinite.size());
    row("non-finite values", fmt::format("{} left out of the charts ({})", nonfinite, where));
  }
  if (m.torn_line)
    row("incomplete last line", fmt::format("line {} of metrics.jsonl does not parse (a run killed or still writing) and is "
                                            "left out", *m.torn_line));
  h += "</table>\n</section>\n";

  return h;
}

// The charts against the step (a mixture of experts' two more where it has them, preference
// training's two where it has them, reinforcement learning's reward).
std::string charts_section(const Metrics& m) {
  std::string h;
  h += "<section id=\"charts-section\">\n<h2>Charts</h2>\n<div class=\"charts\">\n";
  std::vector<Line> loss_lines{{"train loss", "#1f77b4", &m.loss, false}};
  if (m.val_loss.present()) loss_lines.push_back({"val loss", "#d62728", &m.val_loss, true});
  h += chart("loss", "Loss", "loss", loss_lines, m.first_step, m.last_step);
  h += chart("lr", "Learning rate", "learning rate", {{"lr", "#2ca02c", &m.lr, false}}, m.first_step, m.last_step);
  h += chart("grad_norm", "Gradient norm", "global norm", {{"grad norm", "#9467bd", &m.grad_norm, false}}, m.first_step,
             m.last_step, /*log_if_wide=*/true);
  if (std::any_of(m.clip_coef.y.begin(), m.clip_coef.y.end(), [](double c) { return c < 1; }))
    h += chart("clip_coef", "Clip coefficient", "clip coefficient", {{"clip coef", "#ff7f0e", &m.clip_coef, false}},
               m.first_step, m.last_step);
  h += chart("tokens_per_s", "Throughput", "tokens/s", {{"tokens/s", "#8c564b", &m.tokens_per_s, false}}, m.first_step,
             m.last_step);
  if (m.aux_loss.present())  // a mixture of experts
    h += chart("aux_loss", "Auxiliary load-balancing loss", "aux loss", {{"aux loss", "#17becf", &m.aux_loss, false}},
               m.first_step, m.last_step);
  if (m.accuracy.present()) {  // preference training
    std::vector<Line> acc{{"train", "#1f77b4", &m.accuracy, false}}, margin{{"train", "#1f77b4", &m.margin, false}};
    if (m.val_accuracy.present()) acc.push_back({"val", "#d62728", &m.val_accuracy, true});
    if (m.val_margin.present()) margin.push_back({"val", "#d62728", &m.val_margin, true});
    h += chart("rewards_accuracies", "Preference accuracy (chosen's reward above rejected's)", "share of pairs", acc,
               m.first_step, m.last_step);
    h += chart("rewards_margins", "Reward margin (chosen - rejected)", "beta x log-ratio", margin, m.first_step, m.last_step);
  }
  if (m.reward.present()) {  // reinforcement learning
    std::vector<Line> r{{"train (sampled)", "#1f77b4", &m.reward, false}};
    if (m.val_reward.present()) r.push_back({"val (greedy)", "#d62728", &m.val_reward, true});
    h += chart("reward", "Mean reward", "reward", r, m.first_step, m.last_step);
  }
  if (m.expert_max.present())
    h += chart("expert_tokens", "Tokens per expert (any sparse layer)", "tokens",
               {{"most", "#e377c2", &m.expert_max, false}, {"fewest", "#7f7f7f", &m.expert_min, true}}, m.first_step,
               m.last_step);
  h += "</div>\n</section>\n";

  return h;
}

std::string render_run_report(const fs::path& run_dir, const RunReportInfo& info) {
  std::error_code ec;
  MT_CHECK(fs::is_directory(run_dir, ec), "run folder '{}' does not exist (or is not a folder)", run_dir.string());
  refuse_missing_metrics(run_dir);
  const Metrics m = read_metrics(run_dir / "metrics.jsonl");
  const json options = read_object_file(run_dir / "options.json");
  const json config = read_object_file(run_dir / "config.json");
  json machine = read_object_file(run_dir / "machine.json");
  if (info.machine.is_object()) {
    if (!machine.is_object()) machine = json::object();
    for (const auto& [k, v] : info.machine.items()) machine[k] = v;
  }
  const fs::path folder = folder_of(run_dir);
  const std::string title = escape(info.title.empty() ? "megatrain run " + folder.filename().string() : info.title);

  std::string h;
  h.reserve(1 << 16);
  h += "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n";
  h += "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n";
  h += fmt::format("<meta name=\"generator\" content=\"megatrain {}\">\n", escape(version()));
  h += fmt::format("<title>{}</title>\n<style>{}</style>\n</head>\n<body>\n", title, kStyle);
  h += fmt::format("<header>\n<h1>{}</h1>\n<p class=\"sub\">run folder <code>{}</code> · {} step{} recorded</p>\n</header>\n",
                   title, escape(folder.string()), grouped(static_cast<double>(m.rows)), m.rows == 1 ? "" : "s");

  h += summary_section(m);
  h += charts_section(m);
  h += samples_section(run_dir);
  // Tables.
  h += "<div class=\"tables\">\n";
  h += "<section id=\"options\">\n<h2>Run options</h2>\n" +
       key_value_table("options-table", options, "no options.json in the run folder") + "</section>\n";
  h += "<section id=\"model\">\n<h2>Model</h2>\n" + key_value_table("model-table", config, "no config.json in the run folder") +
       "</section>\n";
  h += "<section id=\"machine\">\n<h2>Machine</h2>\n" +
       key_value_table("machine-table", machine, "not recorded (no machine.json in the run folder)") + "</section>\n";
  h += "</div>\n";
  h += fmt::format("<footer>generated {} by megatrain {} from <code>metrics.jsonl</code>{}{}{}</footer>\n</body>\n</html>\n",
                   utc_now(), escape(version()), options.is_null() ? "" : ", <code>options.json</code>",
                   config.is_null() ? "" : ", <code>config.json</code>", machine.is_null() ? "" : ", machine facts");
  return h;
}

std::optional<std::size_t> incomplete_metrics_line(const fs::path& run_dir) {
  return read_metrics(run_dir / "metrics.jsonl").torn_line;
}

fs::path write_run_report(const fs::path& run_dir, const RunReportInfo& info, const fs::path& output) {
  const std::string html = render_run_report(run_dir, info);
  if (info.machine.is_object() && !info.machine.empty()) {
    const fs::path file = run_dir / "machine.json";
    json merged = read_object_file(file);
    if (!merged.is_object()) merged = json::object();
    const json before = merged;
    for (const auto& [k, v] : info.machine.items()) merged[k] = v;
    if (merged != before || !fs::exists(file)) detail::write_file_atomically(file, merged.dump(2) + "\n");
  }
  const fs::path target = output.empty() ? run_dir / kRunReportFile : output;
  detail::write_file_atomically(target, html);
  return target;
}

json describe_machine(int cuda_device) {
  json m = json::object();
  try {
    std::ifstream cpuinfo("/proc/cpuinfo");
    for (std::string line; std::getline(cpuinfo, line);) {
      if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) {
        std::string name = line.substr(line.find(':') + 1);
        name.erase(0, name.find_first_not_of(" \t"));
        m["cpu"] = name;
        break;
      }
    }
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) == 0) m["cpu_threads"] = CPU_COUNT(&set);
    else if (const long n = ::sysconf(_SC_NPROCESSORS_ONLN); n > 0) m["cpu_threads"] = n;
    m["simd"] = std::string(simd_level_name(active_simd_level()));
    const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0)
      m["host_memory"] = fmt::format("{:.1f} GiB", static_cast<double>(pages) * static_cast<double>(page) / (1u << 30));
    utsname u{};
    if (::uname(&u) == 0) m["os"] = fmt::format("{} {} ({})", u.sysname, u.release, u.machine);
    m["megatrain"] = std::string(version());
#if MEGATRAIN_HAS_CUDA
    cudaDeviceProp p{};
    if (cuda_device >= 0 && cudaGetDeviceProperties(&p, cuda_device) == cudaSuccess) {
      m["gpu"] = std::string(p.name);
      m["gpu_memory"] = fmt::format("{:.1f} GiB", static_cast<double>(p.totalGlobalMem) / (1u << 30));
      m["gpu_compute_capability"] = fmt::format("{}.{}", p.major, p.minor);
      int driver = 0;
      if (cudaDriverGetVersion(&driver) == cudaSuccess && driver > 0)
        m["cuda_driver"] = fmt::format("{}.{}", driver / 1000, (driver % 1000) / 10);
    } else if (cuda_device >= 0) {
      (void)cudaGetLastError();  // (no such device: leave no error behind for the caller's next call)
    }
#else
    (void)cuda_device;
#endif
  } catch (...) {  // (facts are best effort)
  }
  return m;
}

}  // namespace megatrain::io
