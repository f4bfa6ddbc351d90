// Hugging Face tokenizers in C++: see megatrain/text/tokenizer.hpp for what is supported.
#include "megatrain/text/tokenizer.hpp"

#include "regex.hpp"
#include "utf8.hpp"

#include <tbb/enumerable_thread_specific.h>
#include <tbb/parallel_for.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "megatrain/core/error.hpp"
#include "megatrain/io/detail/atomic_files.hpp"

namespace megatrain::text {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ---- UTF-8 ----------------------------------------------------------------------------------

namespace {

/// The UTF-8 sequence at byte i of p[0, n): its bytes that belong to it (k >= 1; the longest valid
/// prefix where it is invalid) and whether they make a whole valid sequence (ASCII included).
struct Utf8Sequence {
  std::size_t k = 1;
  bool valid = false;
};
Utf8Sequence utf8_sequence(const unsigned char* p, std::size_t n, std::size_t i) {
  const unsigned char b = p[i];
  if (b < 0x80) return {1, true};
  std::size_t len = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
  if (b >= 0xC2 && b <= 0xDF) len = 2;
  else if (b == 0xE0) len = 3, lo = 0xA0;
  else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) len = 3;
  else if (b == 0xED) len = 3, hi = 0x9F;
  else if (b == 0xF0) len = 4, lo = 0x90;
  else if (b >= 0xF1 && b <= 0xF3) len = 4;
  else if (b == 0xF4) len = 4, hi = 0x8F;
  if (len == 0) return {1, false};
  std::size_t k = 1;
  for (; k < len && i + k < n; ++k) {
    const unsigned char c = p[i + k];
    const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (c < l || c > h) break;
  }
  return {k, k == len};
}

}  // namespace

std::string utf8_lossy(std::string_view s) {
  static constexpr char kReplacement[] = "\xEF\xBF\xBD";
  std::string out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  std::size_t i = 0;
  while (i < n) {
    if (p[i] < 0x80) {
      // ASCII runs are copied whole
      std::size_t j = i + 1;
      while (j < n && p[j] < 0x80) ++j;
      out.append(s.substr(i, j - i));
      i = j;
      continue;
    }
    // One replacement for the whole of an invalid sequence's longest valid prefix.
    const Utf8Sequence q = utf8_sequence(p, n, i);
    if (q.valid) out.append(s.substr(i, q.k));
    else out += kReplacement;
    i += q.k;
  }
  return out;
}

std::size_t first_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (std::size_t i = 0; i < s.size();) {
    const Utf8Sequence q = utf8_sequence(p, s.size(), i);
    if (!q.valid) return i;
    i += q.k;
  }
  return std::string_view::npos;
}

namespace {

using detail::Regex;
using detail::utf8_next;

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  if (from.empty()) return;
  std::string out;
  std::size_t pos = 0;
  for (std::size_t hit; (hit = s.find(from, pos)) != std::string::npos; pos = hit + from.size()) {
    out.append(s, pos, hit - pos);
    out.append(to);
  }
  if (pos == 0) return;
  out.append(s, pos, std::string::npos);
  s = std::move(out);
}

// GPT-2's byte-to-character map: printable Latin-1 bytes stand for themselves, the others for
// code points from 256 on, in byte order.
struct ByteMap {
  std::array<std::string, 256> to_char;      // byte -> UTF-8 of its character
  std::unordered_map<char32_t, unsigned char> to_byte;
  ByteMap() {
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool self = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const char32_t c = self ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + extra++);
      append_utf8(to_char[static_cast<std::size_t>(b)], c);
      to_byte.emplace(c, static_cast<unsigned char>(b));
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

// ---- the pipeline's pieces ------------------------------------------------------------------

// A piece of the text as it goes through the pipeline: `added` >= 0 for an added token.
struct Segment {
  std::string text;
  std::int32_t added = -1;
  bool at_start = false;  // begins at offset 0 of the original text (Metaspace's "first")
};

struct Normalizer {
  enum class Kind { unicode, prepend, replace } kind;
  int utf8proc_options = 0;  // unicode
  std::string a, b;           // prepend: a; replace: a -> b

  void apply(std::string& s) const {
    switch (kind) {
      case Kind::unicode: {
        if (std::all_of(s.begin(), s.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; })) return;
        utf8proc_uint8_t* out = nullptr;
        const auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()),
                                    &out, static_cast<utf8proc_option_t>(utf8proc_options));
        MT_CHECK(n >= 0, "Unicode normalization failed: {}", utf8proc_errmsg(n));
        s.assign(reinterpret_cast<const char*>(out), static_cast<std::size_t>(n));
        std::free(out);
        return;
      }
      case Kind::prepend:
        if (!s.empty()) s.insert(0, a);
        return;
      case Kind::replace:
        replace_all(s, a, b);
        return;
    }
  }
};

enum class SplitBehavior { isolated, removed, merged_with_previous, merged_with_next };

struct PreTokenizer {
  enum class Kind { split, byte_level, metaspace } kind = Kind::split;
  std::shared_ptr<const Regex> regex;  // split; byte_level with use_regex
  SplitBehavior behavior = SplitBehavior::isolated;
  bool add_prefix_space = false;       // byte_level
  std::string replacement;             // metaspace
  enum class Prepend { always, first, never } prepend = Prepend::always;
  bool metaspace_split = true;
};

// Splits `s` at the matches of `re` by `behavior`.
void split_by(const Regex& re, SplitBehavior behavior, const std::string& s, std::vector<std::string>& out) {
  std::size_t last = 0;
  std::string carry;  // merged_with_next: the match waiting for what follows
  re.for_each_match(s, [&](std::size_t b, std::size_t e) {
    std::string gap = s.substr(last, b - last), hit = s.substr(b, e - b);
    switch (behavior) {
      case SplitBehavior::isolated:
        if (!gap.empty()) out.push_back(std::move(gap));
        out.push_back(std::move(hit));
        break;
      case SplitBehavior::removed:
        if (!gap.empty()) out.push_back(std::move(gap));
        break;
      case SplitBehavior::merged_with_previous:
        out.push_back(gap + hit);
        break;
      case SplitBehavior::merged_with_next:
        if (!carry.empty() || !gap.empty()) out.push_back(carry + gap);
        carry = std::move(hit);
        break;
    }
    last = e;
  });
  std::string tail = carry + s.substr(last);
  if (!tail.empty()) out.push_back(std::move(tail));
}

struct DecoderStep {
  enum class Kind { byte_level, metaspace, replace, byte_fallback, fuse, strip } kind = Kind::fuse;
  std::string a, b;  // replace: a -> b; metaspace: a = replacement; strip: a = content
  std::size_t start = 0, stop = 0;
  bool prepend = true;  // metaspace: a prefix space was added (not "never")
  static DecoderStep of(Kind k, std::string a = {}, std::string b = {}) {
    DecoderStep d;
    d.kind = k, d.a = std::move(a), d.b = std::move(b);
    return d;
  }
};

std::optional<unsigned> byte_token(std::string_view t) {  // "<0x41>" -> 0x41
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>') return std::nullopt;
  unsigned v = 0;
  for (char c : t.substr(3, 2)) {
    v <<= 4;
    if (c >= '0' && c <= '9') v |= static_cast<unsigned>(c - '0');
    else if (c >= 'A' && c <= 'F') v |= static_cast<unsigned>(c - 'A' + 10);
    else return std::nullopt;
  }
  return v;
}

void run_decoder(const DecoderStep& d, std::vector<std::string>& toks) {
  switch (d.kind) {
    case DecoderStep::Kind::byte_level: {
      std::string bytes;
      const ByteMap& m = byte_map();
      for (const auto& t : toks) {
        std::string mine;
        bool all = true;
        for (std::size_t i = 0; i < t.size();) {
          char32_t c;
          i += utf8_next(t, i, &c);
          const auto it = m.to_byte.find(c);
          if (it == m.to_byte.end()) {
            all = false;
            break;
          }
          mine += static_cast<char>(it->second);
        }
        bytes += all ? mine : t;
      }
      toks.assign(1, utf8_lossy(bytes));
      return;
    }
    case DecoderStep::Kind::metaspace:
      for (std::size_t i = 0; i < toks.size(); ++i) {
        replace_all(toks[i], d.a, " ");
        if (i == 0 && d.prepend && !toks[i].empty() && toks[i][0] == ' ') toks[i].erase(0, 1);
      }
      return;
    case DecoderStep::Kind::replace:
      for (auto& t : toks) replace_all(t, d.a, d.b);
      return;
    case DecoderStep::Kind::byte_fallback: {
      std::vector<std::string> out;
      std::string pending;
      std::size_t pending_count = 0;
      const auto flush = [&] {
        if (pending_count == 0) return;
        const std::string fixed = utf8_lossy(pending);
        if (fixed == pending) {
          out.push_back(pending);
        } else {  // not valid UTF-8: one replacement character per byte token
          std::string r;
          for (std::size_t k = 0; k < pending_count; ++k) r += "\xEF\xBF\xBD";
          out.push_back(r);
        }
        pending.clear();
        pending_count = 0;
      };
      for (auto& t : toks) {
        if (const auto v = byte_token(t)) {
          pending += static_cast<char>(*v);
          ++pending_count;
        } else {
          flush();
          out.push_back(std::move(t));
        }
      }
      flush();
      toks = std::move(out);
      return;
    }
    case DecoderStep::Kind::fuse: {
      std::string all;
      for (const auto& t : toks) all += t;
      toks.assign(1, std::move(all));
      return;
    }
    case DecoderStep::Kind::strip:
      for (auto& t : toks) {
        for (std::size_t k = 0; k < d.start && t.starts_with(d.a); ++k) t.erase(0, d.a.size());
        for (std::size_t k = 0; k < d.stop && t.ends_with(d.a); ++k) t.erase(t.size() - d.a.size());
      }
      return;
  }
}

struct AddedToken {
  std::string content;
  std::int32_t id = 0;
  bool special = false, normalized = false, lstrip = false, rstrip = false;
};

// Leftmost-longest matching of a set of added tokens.
class AddedMatcher {
 public:
  void add(const AddedToken* t) {
    if (t->content.empty()) return;
    first_[static_cast<unsigned char>(t->content[0])] = true;
    tokens_.push_back(t);
    std::stable_sort(tokens_.begin(), tokens_.end(),
                     [](const AddedToken* a, const AddedToken* b) { return a->content.size() > b->content.size(); });
  }
  bool empty() const { return tokens_.empty(); }

  /// Splits `seg` (not an added token) into segments of text and of added tokens.
  void split(Segment seg, std::vector<Segment>& out) const {
    if (tokens_.empty()) {
      out.push_back(std::move(seg));
      return;
    }
    const std::string& s = seg.text;
    std::size_t last = 0;
    bool start = seg.at_start;
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (!first_[static_cast<unsigned char>(s[i])]) continue;
      const AddedToken* hit = nullptr;
      for (const AddedToken* t : tokens_)
        if (s.compare(i, t->content.size(), t->content) == 0) {
          hit = t;
          break;
        }
      if (!hit) continue;
      std::size_t b = i, e = i + hit->content.size();
      if (hit->lstrip)
        while (b > last && is_space(s[b - 1])) --b;
      if (hit->rstrip)
        while (e < s.size() && is_space(s[e])) ++e;
      if (b > last) out.push_back({s.substr(last, b - last), -1, start});
      out.push_back({s.substr(b, e - b), hit->id, false});
      start = false;
      last = e;
      i = e - 1;
    }
    if (last < s.size()) out.push_back({s.substr(last), -1, start && last == 0});
  }

 private:
  static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
  std::array<bool, 256> first_{};
  std::vector<const AddedToken*> tokens_;
};

// Unused ids a tokenizer.json may leave beyond the tokens it defines (ids number the tokens from
// 0; added tokens may follow the model's vocabulary after a gap). An id beyond that is a broken
// file, and would size the id table (id_to_token) far beyond the file.
constexpr std::int64_t kMaxUnusedIds = 65536;

/// A token id read from the file: an integer in [0, limit), or an Error naming `what`.
std::int32_t id_of(const json& v, std::int64_t limit, const std::string& where, std::string_view what) {
  MT_CHECK(v.is_number_integer(), "{}: {} has the id {}, which is not an integer", where, what, v.dump());
  const auto id = v.is_number_unsigned() && v.get<std::uint64_t>() > std::uint64_t{INT64_MAX} ? std::int64_t{-1}
                                                                                               : v.get<std::int64_t>();
  MT_CHECK(id >= 0 && id < limit,
           "{}: {} has the id {}; the file defines {} tokens, so ids must lie in [0, {}) (they number the tokens from 0)",
           where, what, v.dump(), limit - kMaxUnusedIds, limit);
  return static_cast<std::int32_t>(id);
}

/// A count read from the file (Strip's start and stop): an integer >= 0, or an Error naming `what`.
std::size_t count_of(const json& v, const std::string& where, std::string_view what) {
  MT_CHECK(v.is_number_unsigned() || (v.is_number_integer() && v.get<std::int64_t>() >= 0),
           "{}: {} must be a whole number >= 0, not {}", where, what, v.dump());
  return static_cast<std::size_t>(v.get<std::uint64_t>());
}

struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};
using Vocab = std::unordered_map<std::string, std::int32_t, StringHash, std::equal_to<>>;


}  // namespace

// ---- the tokenizer ----------------------------------------------------------------------------

struct Tokenizer::Impl {
  fs::path path;
  std::string family = "BPE";
  // model
  Vocab vocab;
  std::vector<std::string> id_to_token;  // model and added, by id ("" where none)
  std::unordered_map<std::uint64_t, std::pair<std::int32_t, std::int32_t>> merges;  // (a, b) -> (rank, merged id)
  bool ignore_merges = false, byte_fallback = false, fuse_unk = false;
  std::optional<std::int32_t> unk;
  std::array<std::int32_t, 256> byte_ids{};  // byte fallback: <0xXX> ids (-1: none)
  // pipeline
  std::vector<Normalizer> normalizers;
  std::vector<PreTokenizer> pre_tokenizers;
  std::vector<DecoderStep> decoders;
  std::vector<std::vector<std::int32_t>> template_single;  // post-processor: ids, or {} for the sequence
  // added tokens
  std::vector<AddedToken> added;
  std::unordered_map<std::int32_t, const AddedToken*> added_by_id;
  AddedMatcher raw_matcher, normalized_matcher;
  // tokenizer_config.json
  std::optional<std::int32_t> eos, bos;
  std::optional<std::string> chat_template;
  // a cache of words (thread-local; cleared when large)
  mutable tbb::enumerable_thread_specific<std::unordered_map<std::string, std::vector<std::int32_t>>> cache;

  std::int64_t id_limit = 0;  // ids must be below this (the tokens the file defines + kMaxUnusedIds)

  std::string where() const { return path.string(); }

  // ---- loading --------------------------------------------------------------------------------

  void load_model(const json& m) {
    const std::string type = m.value("type", "BPE");
    MT_CHECK(type == "BPE", "{}: model type '{}' is not supported (megatrain reads BPE tokenizers: Qwen, Llama, Mistral, GPT-2)",
             where(), type);
    MT_CHECK(!m.contains("dropout") || m["dropout"].is_null(), "{}: BPE dropout is not supported", where());
    for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
      MT_CHECK(!m.contains(k) || m[k].is_null() || m[k].get<std::string>().empty(), "{}: BPE with a {} is not supported", where(),
               k);
    ignore_merges = m.value("ignore_merges", false) == true;
    byte_fallback = m.contains("byte_fallback") && m["byte_fallback"].is_boolean() && m["byte_fallback"].get<bool>();
    fuse_unk = m.contains("fuse_unk") && m["fuse_unk"].is_boolean() && m["fuse_unk"].get<bool>();
    const json& v = m.at("vocab");
    MT_CHECK(v.is_object(), "{}: model.vocab must be an object of token -> id", where());
    vocab.reserve(v.size());
    for (const auto& [tok, id] : v.items()) {
      const std::int32_t i = id_of(id, id_limit, where(), fmt::format("token '{}'", tok));
      vocab.emplace(tok, i);
      set_token(i, tok);
    }
    if (m.contains("unk_token") && m["unk_token"].is_string()) {
      const auto it = vocab.find(m["unk_token"].get<std::string>());
      MT_CHECK(it != vocab.end(), "{}: the unk_token '{}' is not in the vocabulary", where(), m["unk_token"].get<std::string>());
      unk = it->second;
    }
    byte_ids.fill(-1);
    if (byte_fallback)
      for (int b = 0; b < 256; ++b) {
        const auto it = vocab.find(fmt::format("<0x{:02X}>", b));
        if (it != vocab.end()) byte_ids[static_cast<std::size_t>(b)] = it->second;
      }
    const json& ms = m.at("merges");
    merges.reserve(ms.size());
    std::int32_t rank = 0;
    for (const auto& e : ms) {
      std::string a, b;
      if (e.is_string()) {
        const std::string s = e.get<std::string>();
        const auto sp = s.find(' ');
        MT_CHECK(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos, "{}: merge {} ('{}') is not two tokens",
                 where(), rank, s);
        a = s.substr(0, sp), b = s.substr(sp + 1);
      } else {
        MT_CHECK(e.is_array() && e.size() == 2, "{}: merge {} is neither \"a b\" nor [a, b]", where(), rank);
        a = e[0].get<std::string>(), b = e[1].get<std::string>();
      }
      const auto ia = vocab.find(a), ib = vocab.find(b), iab = vocab.find(a + b);
      MT_CHECK(ia != vocab.end() && ib != vocab.end() && iab != vocab.end(),
               "{}: merge {} ('{}' '{}') names a token that is not in the vocabulary", where(), rank, a, b);
      merges.emplace(pair_key(ia->second, ib->second), std::pair{rank, iab->second});
      ++rank;
    }
  }

  static std::uint64_t pair_key(std::int32_t a, std::int32_t b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
  }

  void set_token(std::int32_t id, const std::string& tok) {
    if (static_cast<std::size_t>(id) >= id_to_token.size()) id_to_token.resize(static_cast<std::size_t>(id) + 1);
    id_to_token[static_cast<std::size_t>(id)] = tok;
  }

  void load_normalizer(const json& n) {
    if (n.is_null()) return;
    const std::string type = n.at("type").get<std::string>();
    if (type == "Sequence") {
      for (const auto& x : n.at("normalizers")) load_normalizer(x);
    } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
      int o = UTF8PROC_STABLE | (type[2] == 'K' ? UTF8PROC_COMPAT : 0);
      o |= type.back() == 'C' ? UTF8PROC_COMPOSE : UTF8PROC_DECOMPOSE;
      normalizers.push_back({Normalizer::Kind::unicode, o, {}, {}});
    } else if (type == "Prepend") {
      normalizers.push_back({Normalizer::Kind::prepend, 0, n.at("prepend").get<std::string>(), {}});
    } else if (type == "Replace") {
      const json& p = n.at("pattern");
      MT_CHECK(p.contains("String"), "{}: a Replace normalizer with a regular expression is not supported", where());
      normalizers.push_back({Normalizer::Kind::replace, 0, p["String"].get<std::string>(), n.at("content").get<std::string>()});
    } else {
      MT_FAIL("{}: the normalizer '{}' is not supported (supported: NFC, NFD, NFKC, NFKD, Prepend, Replace, Sequence)", where(),
              type);
    }
  }

  // Metaspace's prepend_scheme (always, first, never), or its older spelling add_prefix_space.
  static std::string metaspace_scheme(const json& m) {
    if (m.contains("prepend_scheme")) return m["prepend_scheme"].get<std::string>();
    return m.value("add_prefix_space", true) ? "always" : "never";
  }

  void load_pre_tokenizer(const json& p) {
    if (p.is_null()) return;
    const std::string type = p.at("type").get<std::string>();
    if (type == "Sequence") {
      for (const auto& x : p.at("pretokenizers")) load_pre_tokenizer(x);
    } else if (type == "Split") {
      const json& pat = p.at("pattern");
      std::string re;
      if (pat.contains("Regex")) {
        re = pat["Regex"].get<std::string>();
      } else {
        // a literal string: quoted for PCRE2
        re = "\\Q" + pat.at("String").get<std::string>() + "\\E";
      }
      MT_CHECK(!p.value("invert", false), "{}: an inverted Split pre-tokenizer is not supported", where());
      const std::string b = p.at("behavior").get<std::string>();
      SplitBehavior sb;
      if (b == "Isolated") sb = SplitBehavior::isolated;
      else if (b == "Removed") sb = SplitBehavior::removed;
      else if (b == "MergedWithPrevious") sb = SplitBehavior::merged_with_previous;
      else if (b == "MergedWithNext") sb = SplitBehavior::merged_with_next;
      else MT_FAIL("{}: the Split behaviour '{}' is not supported", where(), b);
      PreTokenizer t;
      t.kind = PreTokenizer::Kind::split;
      t.regex = std::make_shared<Regex>(re, where());
      t.behavior = sb;
      pre_tokenizers.push_back(std::move(t));
    } else if (type == "ByteLevel") {
      PreTokenizer t;
      t.kind = PreTokenizer::Kind::byte_level;
      t.add_prefix_space = p.value("add_prefix_space", false);
      if (p.value("use_regex", true))  // GPT-2's pattern
        t.regex = std::make_shared<Regex>(
            R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)", where());
      pre_tokenizers.push_back(std::move(t));
    } else if (type == "Metaspace") {
      PreTokenizer t;
      t.kind = PreTokenizer::Kind::metaspace;
      t.replacement = p.value("replacement", std::string("\u2581"));
      const std::string scheme = metaspace_scheme(p);
      t.prepend = scheme == "first" ? PreTokenizer::Prepend::first
                  : scheme == "never" ? PreTokenizer::Prepend::never
                                      : PreTokenizer::Prepend::always;
      t.metaspace_split = p.value("split", true);
      pre_tokenizers.push_back(std::move(t));
    } else {
      MT_FAIL("{}: the pre-tokenizer '{}' is not supported (supported: Split, ByteLevel, Metaspace, Sequence)", where(), type);
    }
  }

  void load_post_processor(const json& p) {
    if (p.is_null()) return;
    const std::string type = p.at("type").get<std::string>();
    if (type == "Sequence") {
      for (const auto& x : p.at("processors")) load_post_processor(x);
    } else if (type == "ByteLevel") {
      // offsets only
    } else if (type == "TemplateProcessing") {
      template_single.clear();
      const json& specials = p.at("special_tokens");
      for (const auto& item : p.at("single")) {
        if (item.contains("Sequence")) {
          template_single.emplace_back();
        } else {
          const std::string name = item.at("SpecialToken").at("id").get<std::string>();
          MT_CHECK(specials.contains(name), "{}: the post-processor names '{}' without its ids", where(), name);
          std::vector<std::int32_t> ids;
          for (const auto& id : specials[name].at("ids"))
            ids.push_back(id_of(id, id_limit, where(), fmt::format("the post-processor's token '{}'", name)));
          template_single.push_back(std::move(ids));
        }
      }
    } else {
      MT_FAIL("{}: the post-processor '{}' is not supported (supported: TemplateProcessing, ByteLevel, Sequence)", where(), type);
    }
  }

  void load_decoder(const json& d) {
    if (d.is_null()) return;
    const std::string type = d.at("type").get<std::string>();
    if (type == "Sequence") {
      for (const auto& x : d.at("decoders")) load_decoder(x);
    } else if (type == "ByteLevel") {
      decoders.push_back(DecoderStep::of(DecoderStep::Kind::byte_level));
    } else if (type == "Metaspace") {
      DecoderStep s = DecoderStep::of(DecoderStep::Kind::metaspace);
      s.a = d.value("replacement", std::string("\u2581"));
      const std::string scheme = metaspace_scheme(d);
      s.prepend = scheme != "never";
      decoders.push_back(std::move(s));
    } else if (type == "Replace") {
      const json& p = d.at("pattern");
      MT_CHECK(p.contains("String"), "{}: a Replace decoder with a regular expression is not supported", where());
      decoders.push_back(DecoderStep::of(DecoderStep::Kind::replace, p["String"].get<std::string>(), d.at("content").get<std::string>()));
    } else if (type == "ByteFallback") {
      decoders.push_back(DecoderStep::of(DecoderStep::Kind::byte_fallback));
    } else if (type == "Fuse") {
      decoders.push_back(DecoderStep::of(DecoderStep::Kind::fuse));
    } else if (type == "Strip") {
      DecoderStep s = DecoderStep::of(DecoderStep::Kind::strip, d.at("content").get<std::string>());
      s.start = count_of(d.at("start"), where(), "the Strip decoder's start");
      s.stop = count_of(d.at("stop"), where(), "the Strip decoder's stop");
      decoders.push_back(std::move(s));
    } else {
      MT_FAIL("{}: the decoder '{}' is not supported (supported: ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, "
              "Sequence)",
              where(), type);
    }
  }

  void load_added(const json& a) {
    if (a.is_null()) return;
    added.reserve(a.size());
    for (const auto& t : a) {
      MT_CHECK(!t.value("single_word", false), "{}: the added token '{}' is single_word, which is not supported", where(),
               t.at("content").get<std::string>());
      const std::string content = t.at("content").get<std::string>();
      added.push_back({content, id_of(t.at("id"), id_limit, where(), fmt::format("the added token '{}'", content)),
                       t.value("special", false), t.value("normalized", false), t.value("lstrip", false),
                       t.value("rstrip", false)});
    }
    for (const auto& t : added) {
      added_by_id[t.id] = &t;
      set_token(t.id, t.content);
      (t.normalized ? normalized_matcher : raw_matcher).add(&t);
    }
  }

  void describe_family() {
    const bool byte_level = std::any_of(pre_tokenizers.begin(), pre_tokenizers.end(),
                                        [](const PreTokenizer& p) { return p.kind == PreTokenizer::Kind::byte_level; });
    const bool metaspace_pre = std::any_of(pre_tokenizers.begin(), pre_tokenizers.end(),
                                           [](const PreTokenizer& p) { return p.kind == PreTokenizer::Kind::metaspace; });
    const bool metaspace_norm = std::any_of(normalizers.begin(), normalizers.end(), [](const Normalizer& n) {
      return n.kind == Normalizer::Kind::replace && n.b == "\u2581";
    });
    if (byte_level) family = "byte-level BPE";
    else if ((metaspace_pre || metaspace_norm) && byte_fallback) family = "SentencePiece BPE";
  }

  void load_config(const fs::path& cfg_path) {
    std::error_code ec;
    const fs::path dir = path.parent_path();
    const fs::path jinja = dir / "chat_template.jinja";
    if (fs::is_regular_file(jinja, ec)) chat_template = io::detail::read_file(jinja);
    if (!fs::is_regular_file(cfg_path, ec)) return;
    json c;
    try {
      c = json::parse(io::detail::read_file(cfg_path));
    } catch (const json::exception& e) {  // (parse_error, or out_of_range for a number beyond a double's range)
      MT_FAIL("{}: malformed JSON: {}", cfg_path.string(), e.what());
    }
    const auto token_of = [&](const char* key) -> std::optional<std::int32_t> {
      if (!c.contains(key)) return std::nullopt;
      const json& v = c[key];
      std::string s;
      if (v.is_string()) s = v.get<std::string>();
      else if (v.is_object() && v.contains("content")) s = v["content"].get<std::string>();
      else return std::nullopt;
      return lookup(s);
    };
    eos = token_of("eos_token");
    bos = token_of("bos_token");
    if (!chat_template && c.contains("chat_template")) {
      const json& t = c["chat_template"];
      if (t.is_string()) {
        chat_template = t.get<std::string>();
      } else if (t.is_array()) {
        for (const auto& x : t)
          if (x.value("name", "") == "default") chat_template = x.at("template").get<std::string>();
        if (!chat_template && !t.empty()) chat_template = t[0].at("template").get<std::string>();
      }
    }
  }

  std::optional<std::int32_t> lookup(std::string_view s) const {
    for (const auto& t : added)
      if (t.content == s) return t.id;
    const auto it = vocab.find(s);
    if (it != vocab.end()) return it->second;
    return std::nullopt;
  }

  // ---- encoding -------------------------------------------------------------------------------

  // The ids of one pre-tokenized word by BPE (merges lowest rank first, then leftmost).
  void bpe(const std::string& word, std::vector<std::int32_t>& out) const {
    if (word.empty()) return;
    if (ignore_merges) {
      const auto it = vocab.find(word);
      if (it != vocab.end()) {
        out.push_back(it->second);
        return;
      }
    }
    auto& c = cache.local();
    const bool cacheable = word.size() <= 64;
    if (cacheable) {
      const auto it = c.find(word);
      if (it != c.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    struct Sym {
      std::int32_t id;
      std::int32_t prev, next;
      bool alive;
    };
    std::vector<Sym> syms;
    syms.reserve(word.size());
    bool last_unk = false;
    for (std::size_t i = 0; i < word.size();) {
      const std::size_t len = utf8_next(word, i);
      const std::string_view ch(word.data() + i, len);
      i += len;
      if (const auto it = vocab.find(ch); it != vocab.end()) {
        syms.push_back({it->second, 0, 0, true});
        last_unk = false;
        continue;
      }
      if (byte_fallback) {
        bool all = true;
        for (char b : ch) all = all && byte_ids[static_cast<unsigned char>(b)] >= 0;
        if (all) {
          for (char b : ch) syms.push_back({byte_ids[static_cast<unsigned char>(b)], 0, 0, true});
          last_unk = false;
          continue;
        }
      }
      if (unk) {
        if (!(fuse_unk && last_unk)) syms.push_back({*unk, 0, 0, true});
        last_unk = true;
      }
      // (without an unknown token, a character outside the vocabulary is dropped, as the reference does)
    }
    const auto n = static_cast<std::int32_t>(syms.size());
    for (std::int32_t i = 0; i < n; ++i) syms[static_cast<std::size_t>(i)].prev = i - 1, syms[static_cast<std::size_t>(i)].next = i + 1;
    struct Cand {
      std::int32_t rank, pos, merged;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Cand, std::vector<Cand>, std::greater<>> q;
    const auto consider = [&](std::int32_t pos) {
      const std::int32_t nx = syms[static_cast<std::size_t>(pos)].next;
      if (nx >= n) return;
      const auto it = merges.find(pair_key(syms[static_cast<std::size_t>(pos)].id, syms[static_cast<std::size_t>(nx)].id));
      if (it != merges.end()) q.push({it->second.first, pos, it->second.second});
    };
    for (std::int32_t i = 0; i + 1 < n; ++i) consider(i);
    while (!q.empty()) {
      const Cand top = q.top();
      q.pop();
      Sym& left = syms[static_cast<std::size_t>(top.pos)];
      if (!left.alive || left.next >= n) continue;
      Sym& right = syms[static_cast<std::size_t>(left.next)];
      const auto it = merges.find(pair_key(left.id, right.id));
      if (it == merges.end() || it->second.second != top.merged) continue;  // stale
      left.id = top.merged;
      right.alive = false;
      left.next = right.next;
      if (right.next < n) syms[static_cast<std::size_t>(right.next)].prev = top.pos;
      if (left.prev >= 0) consider(left.prev);
      consider(top.pos);
    }
    const std::size_t first = out.size();
    for (std::int32_t i = 0; i < n; i = syms[static_cast<std::size_t>(i)].next) out.push_back(syms[static_cast<std::size_t>(i)].id);
    if (cacheable) {
      if (c.size() > 200000) c.clear();
      c.emplace(word, std::vector<std::int32_t>(out.begin() + static_cast<std::ptrdiff_t>(first), out.end()));
    }
  }

  void pre_tokenize(std::vector<std::string>& pieces, bool at_start) const {
    const ByteMap& bm = byte_map();
    for (const PreTokenizer& p : pre_tokenizers) {
      std::vector<std::string> next;
      switch (p.kind) {
        case PreTokenizer::Kind::split:
          for (const auto& s : pieces) split_by(*p.regex, p.behavior, s, next);
          break;
        case PreTokenizer::Kind::byte_level:
          for (auto& s : pieces) {
            if (p.add_prefix_space && !s.starts_with(' ')) s.insert(0, " ");
            std::vector<std::string> parts;
            if (p.regex) split_by(*p.regex, SplitBehavior::isolated, s, parts);
            else parts.push_back(std::move(s));
            for (auto& part : parts) {
              std::string mapped;
              mapped.reserve(part.size() * 2);
              for (char b : part) mapped += bm.to_char[static_cast<unsigned char>(b)];
              next.push_back(std::move(mapped));
            }
          }
          break;
        case PreTokenizer::Kind::metaspace:
          for (std::size_t k = 0; k < pieces.size(); ++k) {
            std::string s = pieces[k];
            replace_all(s, " ", p.replacement);
            const bool prepend = p.prepend == PreTokenizer::Prepend::always ||
                                 (p.prepend == PreTokenizer::Prepend::first && at_start && k == 0);
            if (prepend && !s.starts_with(p.replacement)) s.insert(0, p.replacement);
            if (!p.metaspace_split) {
              next.push_back(std::move(s));
              continue;
            }
            // each piece starts at a replacement character (merged with what follows it)
            std::size_t from = 0;
            for (std::size_t hit = s.find(p.replacement, 1); hit != std::string::npos; hit = s.find(p.replacement, hit + 1)) {
              if (hit > from) next.push_back(s.substr(from, hit - from));
              from = hit;
            }
            if (from < s.size()) next.push_back(s.substr(from));
          }
          break;
      }
      pieces = std::move(next);
    }
  }

  std::vector<std::int32_t> encode(std::string_view raw, bool add_special) const {
    std::vector<Segment> segs, segs2;
    raw_matcher.split({utf8_lossy(raw), -1, true}, segs);
    for (auto& seg : segs) {
      if (seg.added >= 0) {
        segs2.push_back(std::move(seg));
        continue;
      }
      for (const Normalizer& n : normalizers) n.apply(seg.text);
      normalized_matcher.split(std::move(seg), segs2);
    }
    std::vector<std::int32_t> ids;
    for (auto& seg : segs2) {
      if (seg.added >= 0) {
        ids.push_back(seg.added);
        continue;
      }
      if (seg.text.empty()) continue;
      std::vector<std::string> pieces{std::move(seg.text)};
      pre_tokenize(pieces, seg.at_start);
      for (const auto& w : pieces) bpe(w, ids);
    }
    if (!add_special || template_single.empty()) return ids;
    std::vector<std::int32_t> out;
    for (const auto& item : template_single) {
      if (item.empty()) out.insert(out.end(), ids.begin(), ids.end());
      else out.insert(out.end(), item.begin(), item.end());
    }
    return out;
  }

  std::string decode(std::span<const std::int32_t> ids, bool skip_special) const {
    std::vector<std::string> toks;
    toks.reserve(ids.size());
    for (const std::int32_t id : ids) {
      MT_CHECK(id >= 0 && static_cast<std::size_t>(id) < id_to_token.size() &&
                   (!id_to_token[static_cast<std::size_t>(id)].empty() || added_by_id.contains(id)),
               "token id {} is not in the vocabulary of '{}' ({} ids)", id, where(), id_to_token.size());
      const auto a = added_by_id.find(id);
      if (skip_special && a != added_by_id.end() && a->second->special) continue;
      toks.push_back(id_to_token[static_cast<std::size_t>(id)]);
    }
    for (const DecoderStep& d : decoders) run_decoder(d, toks);
    std::string out;
    for (const auto& t : toks) out += t;
    return out;
  }
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_file(const fs::path& file) {
  auto impl = std::make_unique<Impl>();
  impl->path = file;
  json j;
  try {
    j = json::parse(io::detail::read_file(file));
  } catch (const json::exception& e) {  // (parse_error, or out_of_range for a number beyond a double's range)
    MT_FAIL("{}: malformed JSON: {}", file.string(), e.what());
  }
  MT_CHECK(j.is_object() && j.contains("model"), "{}: not a Hugging Face tokenizer.json (no \"model\")", file.string());
  try {
    const auto count = [&](const json& x) { return x.is_object() || x.is_array() ? static_cast<std::int64_t>(x.size()) : 0; };
    impl->id_limit = count(j["model"].value("vocab", json())) + count(j.value("added_tokens", json())) + kMaxUnusedIds;
    impl->load_model(j["model"]);
    impl->load_normalizer(j.value("normalizer", json()));
    impl->load_pre_tokenizer(j.value("pre_tokenizer", json()));
    impl->load_post_processor(j.value("post_processor", json()));
    impl->load_decoder(j.value("decoder", json()));
    impl->load_added(j.value("added_tokens", json()));
    for (const auto& ids : impl->template_single)
      for (const std::int32_t id : ids)
        MT_CHECK(static_cast<std::size_t>(id) < impl->id_to_token.size() &&
                     (!impl->id_to_token[static_cast<std::size_t>(id)].empty() || impl->added_by_id.contains(id)),
                 "{}: the post-processor adds the token id {}, which is neither in the vocabulary nor an added token",
                 file.string(), id);
    impl->describe_family();
    impl->load_config(file.parent_path() / "tokenizer_config.json");
  } catch (const json::exception& e) {
    MT_FAIL("{}: unexpected content ({}); is it a tokenizer.json written by Hugging Face tokenizers?", file.string(), e.what());
  }
  if (!impl->eos)
    for (const char* name : {"<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"})
      if (const auto id = impl->lookup(name)) {
        impl->eos = id;
        break;
      }
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_folder(const fs::path& dir) {
  std::error_code ec;
  const fs::path file = dir / "tokenizer.json";
  if (!fs::is_regular_file(file, ec)) {
    MT_CHECK(!fs::is_regular_file(dir / "tokenizer.model", ec),
             "'{}' has a SentencePiece tokenizer.model but no tokenizer.json; megatrain reads tokenizer.json (write one with "
             "transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir))",
             dir.string());
    MT_FAIL("'{}' has no tokenizer.json", dir.string());
  }
  return from_file(file);
}

std::vector<std::int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  return impl_->encode(text, add_special_tokens);
}

std::vector<std::vector<std::int32_t>> Tokenizer::encode_batch(std::span<const std::string_view> texts,
                                                               bool add_special_tokens) const {
  std::vector<std::vector<std::int32_t>> out(texts.size());
  tbb::parallel_for(std::size_t{0}, texts.size(), [&](std::size_t i) { out[i] = impl_->encode(texts[i], add_special_tokens); });
  return out;
}

std::string Tokenizer::decode(std::span<const std::int32_t> ids, bool skip_special_tokens) const {
  return impl_->decode(ids, skip_special_tokens);
}

std::int64_t Tokenizer::vocab_size() const { return static_cast<std::int64_t>(impl_->id_to_token.size()); }

std::optional<std::int32_t> Tokenizer::token_to_id(std::string_view token) const { return impl_->lookup(token); }

std::optional<std::string> Tokenizer::id_to_token(std::int32_t id) const {
  if (id < 0 || static_cast<std::size_t>(id) >= impl_->id_to_token.size()) return std::nullopt;
  const auto& t = impl_->id_to_token[static_cast<std::size_t>(id)];
  if (t.empty() && !impl_->added_by_id.contains(id)) return std::nullopt;
  return t;
}

bool Tokenizer::is_special(std::int32_t id) const {
  const auto it = impl_->added_by_id.find(id);
  return it != impl_->added_by_id.end() && it->second->special;
}

const std::string& Tokenizer::family() const { return impl_->family; }
const fs::path& Tokenizer::path() const { return impl_->path; }
std::optional<std::int32_t> Tokenizer::eos_id() const { return impl_->eos; }
std::optional<std::int32_t> Tokenizer::bos_id() const { return impl_->bos; }
const std::optional<std::string>& Tokenizer::chat_template() const { return impl_->chat_template; }
std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>> Tokenizer::special_tokens_around() const {
  std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>> r;
  bool after = false;
  for (const auto& item : impl_->template_single) {
    if (item.empty()) after = true;
    else (after ? r.second : r.first).insert((after ? r.second : r.first).end(), item.begin(), item.end());
  }
  return r;
}

}  // namespace megatrain::text
