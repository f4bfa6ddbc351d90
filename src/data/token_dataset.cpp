#include "megatrain/data/token_dataset.hpp"
#include "megatrain/data/shuffle.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/parallel_reduce.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <random>

#include <nlohmann/json.hpp>

#include "megatrain/backend/backend.hpp"  // kIgnoreIndex
#include "megatrain/core/digest.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/nvtx.hpp"

namespace megatrain {

namespace {
constexpr std::int32_t kLlmcMagic = 20240520;
constexpr std::size_t kLlmcHeaderBytes = 256 * sizeof(std::int32_t);

std::size_t width(TokenFormat f) { return f == TokenFormat::u32 ? 4 : f == TokenFormat::u16 ? 2 : 1; }
}  // namespace

std::filesystem::path example_mask_path(const std::filesystem::path& tokens) { return tokens.string() + ".mask"; }
std::filesystem::path example_index_path(const std::filesystem::path& tokens) { return tokens.string() + ".idx"; }
std::filesystem::path example_pairs_path(const std::filesystem::path& tokens) { return tokens.string() + ".pairs"; }

std::string example_pairs_note(std::int64_t pairs) {
  return nlohmann::json{{"megatrain", "preference pairs"}, {"pairs", pairs}, {"rows", "chosen, then rejected"}}.dump() + "\n";
}

struct TokenSource::Mapping {
  void* addr = nullptr;
  std::size_t length = 0;
  std::string text;  // when the tokens are bytes held in memory
  ~Mapping() {
    if (addr != nullptr) munmap(addr, length);
  }
  static std::shared_ptr<Mapping> of(const std::filesystem::path& path);
};

// A read-only mapping of a whole, non-empty file.
std::shared_ptr<TokenSource::Mapping> TokenSource::Mapping::of(const std::filesystem::path& path) {
  const std::string label = path.string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MT_CHECK(fd >= 0, "cannot open dataset '{}': {}", label, std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    MT_FAIL("cannot stat dataset '{}': {}", label, std::strerror(err));
  }
  const auto size = static_cast<std::size_t>(st.st_size);
  if (size == 0) {
    ::close(fd);
    MT_FAIL("dataset '{}' is empty", label);
  }
  auto map = std::make_shared<Mapping>();
  map->addr = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);
  MT_CHECK(map->addr != MAP_FAILED, "cannot map dataset '{}': {}", label, std::strerror(err));
  map->length = size;
  (void)madvise(map->addr, size, MADV_WILLNEED);
  return map;
}

namespace {
// FILE.pairs (example_pairs_note's): megatrain-tokenize's note, naming as many pairs as the
// examples make.
void check_pairs_note(const std::filesystem::path& pairs, std::int64_t examples, const std::string& label) {
  std::int64_t n = -1;
  try {
    std::ifstream in(pairs, std::ios::binary);
    const nlohmann::json note = nlohmann::json::parse(std::string(std::istreambuf_iterator<char>(in), {}));
    if (note.is_object() && note.value("megatrain", "") == "preference pairs" && note.contains("pairs") &&
        note["pairs"].is_number_integer())
      n = note["pairs"].get<std::int64_t>();
  } catch (const nlohmann::json::exception&) {
  }
  MT_CHECK(n >= 0, "dataset '{}': '{}' is not megatrain-tokenize's note of preference pairs (prepare it again)", label,
           pairs.string());
  MT_CHECK(2 * n == examples, "dataset '{}': '{}' says {} pairs, but the file holds {} examples (the files are not one "
           "preparation's; prepare them again)", label, pairs.string(), n, examples);
}
}  // namespace

TokenSource TokenSource::open(const std::filesystem::path& path, TokenFormat bin_format) {
  MT_NVTX_RANGE("TokenSource::open");
  MT_CHECK(bin_format != TokenFormat::text, "bin_format must be u16 or u32");
  const std::string label = path.string();
  auto map = Mapping::of(path);
  const std::size_t size = map->length;
  TokenSource s;
  s.label_ = label;
  const auto* bytes = static_cast<const std::byte*>(map->addr);
  const bool is_bin = path.extension() == ".bin";
  std::int32_t head[3] = {0, 0, 0};
  if (size >= kLlmcHeaderBytes) std::memcpy(head, bytes, sizeof head);
  if (size >= kLlmcHeaderBytes && head[0] == kLlmcMagic) {
    MT_CHECK(head[1] == 1, "dataset '{}': llm.c header version {} is not supported (only version 1, uint16 tokens)", label,
             head[1]);
    const auto body = size - kLlmcHeaderBytes;
    MT_CHECK(body % 2 == 0, "dataset '{}': {} bytes after the llm.c header is not a whole number of uint16 tokens", label,
             body);
    MT_CHECK(head[2] > 0 && static_cast<std::size_t>(head[2]) * 2 == body,
             "dataset '{}': the llm.c header says {} tokens but the file holds {}", label, head[2], body / 2);
    s.format_ = TokenFormat::u16;
    s.data_ = bytes + kLlmcHeaderBytes;
    s.count_ = head[2];
  } else if (is_bin) {
    const std::size_t w = width(bin_format);
    MT_CHECK(size % w == 0, "dataset '{}': size {} bytes is not a multiple of the token width {} ({} tokens)", label, size, w,
             bin_format == TokenFormat::u16 ? "uint16" : "uint32");
    s.format_ = bin_format;
    s.data_ = bytes;
    s.count_ = static_cast<std::int64_t>(size / w);
    // uint32 ids (of any vocabulary below 2^18) read as uint16 are pairs whose second half is
    // 0 to 3: refuse that pattern rather than train on wrong ids (a sample of the first 2^20
    // pairs; real uint16 text never holds only such ids at every other position).
    if (bin_format == TokenFormat::u16 && size % 4 == 0) {
      const std::int64_t pairs = std::min<std::int64_t>(s.count_ / 2, std::int64_t{1} << 20);
      std::int32_t high = 0, low = 0;
      for (std::int64_t i = 0; i < pairs; ++i) {
        low = std::max(low, s.at(2 * i));
        high = std::max(high, s.at(2 * i + 1));
      }
      MT_CHECK(pairs < 16 || high > 3 || low <= high,
               "dataset '{}' looks like uint32 token ids read as uint16 (in the first {} pairs of uint16 every second one "
               "is at most {}): pass --data-format u32", label, pairs, high);
    }
  } else {
    s.format_ = TokenFormat::text;
    s.data_ = bytes;
    s.count_ = static_cast<std::int64_t>(size);
  }
  s.map_ = std::move(map);
  // Examples: the mask and the index beside the token file (both, and consistent with it).
  const auto mask = example_mask_path(path), index = example_index_path(path);
  std::error_code ec;
  const bool has_mask = std::filesystem::exists(mask, ec), has_index = std::filesystem::exists(index, ec);
  if (has_mask || has_index) {
    MT_CHECK(is_bin, "dataset '{}': '{}' is beside it, but only a .bin token file can be examples (rename it, or remove "
             "the sidecar)", label, (has_mask ? mask : index).string());
    MT_CHECK(has_mask && has_index,
             "dataset '{}': '{}' is there but not '{}' (a token file of examples has both; prepare it again with "
             "megatrain-tokenize)", label, (has_mask ? mask : index).string(), (has_mask ? index : mask).string());
    s.mask_map_ = Mapping::of(mask);
    s.index_map_ = Mapping::of(index);
    MT_CHECK(static_cast<std::int64_t>(s.mask_map_->length) == s.count_,
             "dataset '{}': its mask '{}' has {} bytes for {} tokens (the files are not one preparation's; prepare them again)",
             label, mask.string(), s.mask_map_->length, s.count_);
    const std::size_t n = s.index_map_->length / 8;
    MT_CHECK(s.index_map_->length % 8 == 0 && n >= 2,
             "dataset '{}': its index '{}' is not a list of int64 offsets (prepare it again)", label, index.string());
    s.mask_ = static_cast<const std::byte*>(s.mask_map_->addr);
    s.index_ = static_cast<const std::byte*>(s.index_map_->addr);
    s.examples_ = static_cast<std::int64_t>(n) - 1;
    std::int64_t prev = -1;
    for (std::int64_t e = 0; e <= s.examples_; ++e) {
      const std::int64_t at = s.example_begin(e);
      MT_CHECK(at > prev && (e > 0 || at == 0) && (e < s.examples_ || at == s.count_),
               "dataset '{}': its index '{}' does not divide its {} tokens into examples (entry {} is {}; prepare them again)",
               label, index.string(), s.count_, e, at);
      prev = at;
    }
  }
  const auto pairs = example_pairs_path(path);
  if (std::filesystem::exists(pairs, ec)) {
    MT_CHECK(s.examples_ > 0, "dataset '{}': '{}' is beside it, but it is not examples (no '{}'; prepare it again with "
             "megatrain-tokenize)", label, pairs.string(), index.string());
    check_pairs_note(pairs, s.examples_, label);
    s.pairs_ = true;
  }
  return s;
}

std::int64_t TokenSource::example_begin(std::int64_t e) const {
  std::int64_t v;
  std::memcpy(&v, index_ + 8 * e, 8);
  return v;
}

TokenSource TokenSource::from_text(std::string text, std::string label) {
  MT_CHECK(!text.empty(), "text '{}' is empty", label);
  auto map = std::make_shared<Mapping>();
  map->text = std::move(text);
  TokenSource s;
  s.label_ = std::move(label);
  s.format_ = TokenFormat::text;
  s.data_ = reinterpret_cast<const std::byte*>(map->text.data());
  s.count_ = static_cast<std::int64_t>(map->text.size());
  s.map_ = std::move(map);
  return s;
}

std::int32_t TokenSource::at(std::int64_t i) const {
  switch (format_) {
    case TokenFormat::text: return static_cast<std::int32_t>(std::to_integer<std::uint8_t>(data_[i]));
    case TokenFormat::u16: {
      std::uint16_t v;
      std::memcpy(&v, data_ + 2 * i, 2);
      return v;
    }
    case TokenFormat::u32: {
      std::uint32_t v;
      std::memcpy(&v, data_ + 4 * i, 4);
      return v > 0x7fffffffu ? -1 : static_cast<std::int32_t>(v);  // -1: caught by the vocabulary check
    }
  }
  return -1;
}

bool TokenSource::holds_u16_pairs(std::int64_t vocab) const {
  if (format_ != TokenFormat::u32) return false;
  const std::int64_t n = std::min<std::int64_t>(count_, std::int64_t{1} << 20);
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint32_t v;
    std::memcpy(&v, data_ + 4 * i, 4);
    if ((v & 0xffffu) >= vocab || (v >> 16) >= vocab) return false;
  }
  return n > 0;
}

std::string TokenSource::digest() const {
  MT_NVTX_RANGE("TokenSource::digest");
  const std::size_t bytes = static_cast<std::size_t>(count_) * width(format_);
  constexpr std::size_t kBlock = std::size_t{64} << 20;
  const std::size_t blocks = (bytes + kBlock - 1) / kBlock;
  std::vector<Digest128> parts(blocks);
  tbb::parallel_for(std::size_t{0}, blocks, [&](std::size_t b) {
    const std::size_t first = b * kBlock;
    parts[b] = digest_of(std::span<const std::byte>(data_ + first, std::min(kBlock, bytes - first)));
  });
  if (has_examples()) {
    parts.push_back(digest_of(std::span<const std::byte>(mask_, static_cast<std::size_t>(count_))));
    parts.push_back(digest_of(std::span<const std::byte>(index_, static_cast<std::size_t>(examples_ + 1) * 8)));
  }
  if (pairs_) {  // (the same examples read as pairs are other data)
    const std::string note = example_pairs_note(examples_ / 2);
    parts.push_back(digest_of(std::as_bytes(std::span(note.data(), note.size()))));
  }
  return digest_of(std::as_bytes(std::span<const Digest128>(parts))).hex();
}

void TokenSource::read(std::int64_t start, std::span<std::int32_t> out) const {
  MT_CHECK(start >= 0 && start + static_cast<std::int64_t>(out.size()) <= count_, "tokens [{}, {}) are outside '{}' ({} tokens)",
           start, start + static_cast<std::int64_t>(out.size()), label_, count_);
  for (std::size_t k = 0; k < out.size(); ++k) out[k] = at(start + static_cast<std::int64_t>(k));
}

std::int32_t TokenSource::max_id() const {
  MT_NVTX_RANGE("TokenSource::max_id");
  // A negative id (uint32 above INT32_MAX) wins as "largest" so the caller reports it.
  return tbb::parallel_reduce(
      tbb::blocked_range<std::int64_t>(0, count_, 1 << 16), std::int32_t{0},
      [&](const tbb::blocked_range<std::int64_t>& r, std::int32_t m) {
        for (std::int64_t i = r.begin(); i != r.end(); ++i) {
          const std::int32_t v = at(i);
          if (v < 0) return std::int32_t{-1};
          if (m >= 0) m = std::max(m, v);
        }
        return m;
      },
      [](std::int32_t a, std::int32_t b) { return (a < 0 || b < 0) ? std::int32_t{-1} : std::max(a, b); });
}

namespace {
void check_vocab(const TokenSource& s, std::int64_t vocab) {
  const std::int32_t m = s.max_id();
  if (m >= 0 && m < vocab) return;
  // uint16 ids read as uint32 pair up into ids far above any vocabulary: say so.
  const std::string hint =
      s.holds_u16_pairs(vocab) ? "; the file looks like uint16 token ids: pass --data-format u16" : "";
  // Find the first offender for the message.
  for (std::int64_t i = 0; i < s.size(); ++i) {
    const std::int32_t v = s.at(i);
    MT_CHECK(v >= 0 && v < vocab, "dataset '{}': token {} has id {}, outside the model's vocabulary [0, {}){}", s.label(), i,
             v < 0 ? std::string("above 2^31") : std::to_string(v), vocab, hint);
  }
}
}  // namespace

TokenDataset::TokenDataset(TokenSource train, DatasetOptions opt, std::optional<TokenSource> val)
    : train_(std::move(train)), val_(std::move(val)), opt_(opt) {
  MT_NVTX_RANGE("TokenDataset::TokenDataset");
  MT_CHECK(opt.vocab_size > 0, "vocab_size must be > 0 (got {})", opt.vocab_size);
  MT_CHECK(opt.seq_len > 0, "sequence length must be > 0 (got {})", opt.seq_len);
  MT_CHECK(opt.val_fraction >= 0 && opt.val_fraction < 1, "val_fraction must be in [0, 1) (got {})", opt.val_fraction);
  check_vocab(train_, opt.vocab_size);
  const std::int64_t need = opt.seq_len + 1;
  if (train_.has_examples()) {
    std::int64_t n_train = train_.examples();
    if (val_) {
      check_vocab(*val_, opt.vocab_size);
      MT_CHECK(val_->has_examples(), "validation set '{}' is not examples like '{}' (no '{}' beside it): prepare it the same way",
               val_->label(), train_.label(), example_index_path(val_->label()).string());
      MT_CHECK(val_->has_pairs() == train_.has_pairs(), "validation set '{}' {} preference pairs but '{}' {}: prepare them the "
               "same way", val_->label(), val_->has_pairs() ? "holds" : "does not hold", train_.label(),
               train_.has_pairs() ? "does" : "does not");
      val_stats_ = select(*val_, 0, val_->examples(), val_kept_);
      val_begin_ = 0;
      val_end_ = val_->size();
    } else {
      // (pairs: the split counts pairs, and falls between them)
      const std::int64_t unit = train_.has_pairs() ? 2 : 1, n = train_.examples() / unit;
      MT_CHECK(n >= 2, "dataset '{}' has {} {}: too few for one training and one validation {}", train_.label(), n,
               unit == 2 ? "pair" : "example", unit == 2 ? "pair" : "example");
      const std::int64_t n_val =
          std::min<std::int64_t>(n - 1, std::max<std::int64_t>(1, std::llround(static_cast<double>(n) * opt.val_fraction)));
      n_train = (n - n_val) * unit;
      val_stats_ = select(train_, n_train, train_.examples(), val_kept_);
      val_begin_ = train_.example_begin(n_train);
      val_end_ = train_.size();
    }
    train_stats_ = select(train_, 0, n_train, train_kept_);
    train_begin_ = 0;
    train_end_ = train_.example_begin(n_train);
    if (opt.pack) {
      train_packing_ = pack(train_, train_kept_, true);
      val_packing_ = pack(val_ ? *val_ : train_, val_kept_, false);
      train_stats_.rows = static_cast<std::int64_t>(train_packing_.begin.size()) - 1;
      val_stats_.rows = static_cast<std::int64_t>(val_packing_.begin.size()) - 1;
    } else {
      train_stats_.rows = static_cast<std::int64_t>(train_kept_.size());
      val_stats_.rows = static_cast<std::int64_t>(val_kept_.size());
    }
    train_windows_ = train_stats_.rows;
    val_windows_ = val_stats_.rows;
    MT_CHECK(train_windows_ > 0 || train_stats_.split == 0,
             "dataset '{}': none of its {} training pairs fits one row of {} tokens, its chosen and its rejected answer "
             "together, as packing needs (a longer --seq, or --pack false)", train_.label(), n_train / 2, opt.seq_len);
    MT_CHECK(train_windows_ > 0,
             "dataset '{}': none of its {} training examples has a trained token within the first {} + 1 tokens (a longer "
             "--seq keeps more of each example)", train_.label(), n_train, opt.seq_len);
    MT_CHECK(val_windows_ > 0 || val_stats_.split == 0,
             "validation set of '{}': none of its {} pairs fits one row of {} tokens, its chosen and its rejected answer "
             "together, as packing needs (a longer --seq, or --pack false)", (val_ ? *val_ : train_).label(),
             val_stats_.examples / 2, opt.seq_len);
    MT_CHECK(val_windows_ > 0,
             "validation set of '{}': none of its {} examples has a trained token within the first {} + 1 tokens",
             (val_ ? *val_ : train_).label(), val_stats_.examples, opt.seq_len);
    return;
  }
  if (val_) {
    MT_CHECK(!val_->has_examples(), "validation set '{}' is examples but '{}' is not: prepare them the same way", val_->label(),
             train_.label());
    check_vocab(*val_, opt.vocab_size);
    train_begin_ = 0;
    train_end_ = train_.size();
    val_begin_ = 0;
    val_end_ = val_->size();
    MT_CHECK(val_->size() >= need, "validation set '{}' has {} tokens, fewer than one sequence of {} + 1", val_->label(),
             val_->size(), opt.seq_len);
  } else {
    const std::int64_t n = train_.size();
    const std::int64_t n_val = std::max(need, static_cast<std::int64_t>(static_cast<double>(n) * opt.val_fraction));
    MT_CHECK(n >= 2 * need,
             "dataset '{}' has {} tokens: too few for one training and one validation sequence of {} + 1 tokens each "
             "(use a shorter sequence length or more data)",
             train_.label(), n, opt.seq_len);
    train_begin_ = 0;
    train_end_ = n - n_val;
    val_begin_ = train_end_;
    val_end_ = n;
  }
  MT_CHECK(train_end_ - train_begin_ >= need, "dataset '{}' has {} training tokens, fewer than one sequence of {} + 1",
           train_.label(), train_end_ - train_begin_, opt.seq_len);
  train_windows_ = (train_end_ - train_begin_ - 1) / opt.seq_len;
  val_windows_ = (val_end_ - val_begin_ - 1) / opt.seq_len;
}

ExampleStats TokenDataset::select(const TokenSource& src, std::int64_t first, std::int64_t last,
                                  std::vector<std::int64_t>& kept) const {
  ExampleStats st;
  st.examples = last - first;
  std::vector<std::int64_t> labels(static_cast<std::size_t>(st.examples));
  tbb::parallel_for(first, last, [&](std::int64_t e) {
    const std::int64_t b = src.example_begin(e), end = std::min(src.example_end(e), b + opt_.seq_len + 1);
    std::int64_t n = 0;
    for (std::int64_t t = b + 1; t < end; ++t) n += opt_.train_on_prompt || src.trained(t);
    labels[static_cast<std::size_t>(e - first)] = n;
  });
  if (src.has_pairs())  // (a pair is kept whole or dropped whole; packed, its two answers must share a row)
    for (std::int64_t e = first; e + 1 < last; e += 2) {
      auto& a = labels[static_cast<std::size_t>(e - first)];
      auto& b = labels[static_cast<std::size_t>(e + 1 - first)];
      const bool apart = opt_.pack && row_tokens(src, e) + row_tokens(src, e + 1) > opt_.seq_len;
      st.split += apart && a > 0 && b > 0 ? 1 : 0;
      if (a == 0 || b == 0 || apart) a = b = 0;
    }
  for (std::int64_t e = first; e < last; ++e) {
    const std::int64_t len = src.example_end(e) - src.example_begin(e);
    const std::int64_t n = labels[static_cast<std::size_t>(e - first)];
    if (n == 0) {
      ++st.dropped;
      continue;
    }
    st.truncated += len > opt_.seq_len + 1;
    kept.push_back(e);
    st.labels += n;
    st.tokens += std::min(len, opt_.seq_len + 1);
  }
  return st;
}

std::int64_t TokenDataset::row_tokens(const TokenSource& src, std::int64_t e) const {
  return std::min(src.example_end(e) - src.example_begin(e), opt_.seq_len + 1) - 1;
}

TokenDataset::Packing TokenDataset::pack(const TokenSource& src, std::vector<std::int64_t> kept, bool shuffle) const {
  // (the units placed: examples, or pairs: a pair's chosen then its rejected answer, together)
  const std::size_t unit = src.has_pairs() ? 2 : 1, units = kept.size() / unit;
  if (shuffle) {  // a fixed order of its own, drawn from the seed (the epochs' orders shuffle the rows)
    std::mt19937_64 rng(opt_.seed * 0x9e3779b97f4a7c15ull + 0x7061636b);  // ("pack")
    for (std::size_t i = units; i > 1; --i)
      if (const std::size_t j = rng() % i; j != i - 1)  // (a unit swapped with itself: nothing)
        std::swap_ranges(kept.begin() + static_cast<std::ptrdiff_t>((i - 1) * unit),
                         kept.begin() + static_cast<std::ptrdiff_t>(i * unit), kept.begin() + static_cast<std::ptrdiff_t>(j * unit));
  }
  // Best fit: each unit into the row with the least room that still holds it, else a new row.
  std::vector<std::int64_t> row_of(kept.size());
  std::multimap<std::int64_t, std::int64_t> room;  // free tokens -> row
  std::int64_t rows = 0;
  for (std::size_t i = 0; i < kept.size(); i += unit) {
    std::int64_t n = 0;
    for (std::size_t j = i; j < i + unit; ++j) n += row_tokens(src, kept[j]);
    auto it = room.lower_bound(n);
    std::int64_t row, left;
    if (it == room.end()) {
      row = rows++;
      left = opt_.seq_len - n;
    } else {
      row = it->second;
      left = it->first - n;
      room.erase(it);
    }
    std::fill_n(row_of.begin() + static_cast<std::ptrdiff_t>(i), unit, row);
    if (left > 0) room.emplace(left, row);
  }
  Packing p;  // counting sort by row, keeping the order within a row
  p.begin.assign(static_cast<std::size_t>(rows) + 1, 0);
  for (const std::int64_t r : row_of) ++p.begin[static_cast<std::size_t>(r) + 1];
  for (std::size_t r = 0; r < static_cast<std::size_t>(rows); ++r) p.begin[r + 1] += p.begin[r];
  p.examples.resize(kept.size());
  std::vector<std::int64_t> next(p.begin.begin(), p.begin.end() - 1);
  for (std::size_t i = 0; i < kept.size(); ++i) p.examples[static_cast<std::size_t>(next[static_cast<std::size_t>(row_of[i])]++)] = kept[i];
  return p;
}

void TokenDataset::packed_window(const TokenSource& src, const Packing& packing, std::int64_t row,
                                 std::span<std::int32_t> ids, std::span<std::int32_t> labels,
                                 std::span<std::int32_t> positions, std::span<std::uint8_t> mask) const {
  std::int64_t o = 0;
  for (auto k = packing.begin[static_cast<std::size_t>(row)]; k < packing.begin[static_cast<std::size_t>(row) + 1]; ++k) {
    const std::int64_t e = packing.examples[static_cast<std::size_t>(k)], b = src.example_begin(e), n = row_tokens(src, e);
    for (std::int64_t t = 0; t < n; ++t, ++o) {
      const auto i = static_cast<std::size_t>(o);
      ids[i] = src.at(b + t);
      labels[i] = opt_.train_on_prompt || src.trained(b + t + 1) ? src.at(b + t + 1) : kIgnoreIndex;
      positions[i] = static_cast<std::int32_t>(t);
      if (!mask.empty()) mask[i] = 1;
    }
  }
  for (std::int64_t t = 0; o < opt_.seq_len; ++t, ++o) {  // the free tail: a sequence of padding
    const auto i = static_cast<std::size_t>(o);
    ids[i] = 0;
    labels[i] = kIgnoreIndex;
    positions[i] = static_cast<std::int32_t>(t);
    if (!mask.empty()) mask[i] = 0;
  }
}

void TokenDataset::example_window(const TokenSource& src, std::int64_t e, std::span<std::int32_t> ids,
                                  std::span<std::int32_t> labels, std::span<std::uint8_t> mask) const {
  const std::int64_t b = src.example_begin(e);
  const std::int64_t len = std::min(src.example_end(e) - b, opt_.seq_len + 1);
  for (std::int64_t t = 0; t < opt_.seq_len; ++t) {
    const auto k = static_cast<std::size_t>(t);
    ids[k] = t < len ? src.at(b + t) : 0;  // (padding: any id; its label is ignored and attention is causal)
    if (!mask.empty()) mask[k] = t < len ? 1 : 0;
    labels[k] = t + 1 < len && (opt_.train_on_prompt || src.trained(b + t + 1)) ? src.at(b + t + 1) : kIgnoreIndex;
  }
}

DataPosition TokenDataset::position(std::int64_t windows_consumed) const {
  MT_CHECK(windows_consumed >= 0, "windows consumed must be >= 0 (got {})", windows_consumed);
  return {opt_.seed, windows_consumed / train_windows_, windows_consumed % train_windows_, train_windows_};
}

const std::vector<std::int64_t>& TokenDataset::permutation(std::int64_t epoch) const {
  if (epoch != perm_epoch_) {
    // (pairs a window each: the units shuffled are pairs, each then its two windows in order;
    // packed pairs are whole within their rows)
    const std::int64_t unit = pairs() && !packed() ? 2 : 1, units = train_windows_ / unit;
    const std::vector<std::int64_t> order = shuffled_order(units, opt_.seed, epoch);
    perm_.resize(static_cast<std::size_t>(train_windows_));
    for (std::int64_t i = 0; i < train_windows_; ++i)
      perm_[static_cast<std::size_t>(i)] = order[static_cast<std::size_t>(i / unit)] * unit + i % unit;
    perm_epoch_ = epoch;
  }
  return perm_;
}

void TokenDataset::window(const TokenSource& src, std::int64_t begin, std::int64_t w, std::span<std::int32_t> ids,
                          std::span<std::int32_t> labels) const {
  const auto seq = static_cast<std::size_t>(opt_.seq_len);
  std::vector<std::int32_t> buf(seq + 1);
  src.read(begin + w * opt_.seq_len, buf);
  std::copy_n(buf.begin(), seq, ids.begin());
  std::copy_n(buf.begin() + 1, seq, labels.begin());
}

/// Window w of a split into one row of ids, labels and (unless empty) positions.
void TokenDataset::fill(const TokenSource& src, std::int64_t begin, const std::vector<std::int64_t>& kept,
                        const Packing& packing, std::int64_t w, std::span<std::int32_t> ids, std::span<std::int32_t> labels,
                        std::span<std::int32_t> positions, std::span<std::uint8_t> mask) const {
  if (packed()) return packed_window(src, packing, w, ids, labels, positions, mask);
  if (examples()) {
    example_window(src, kept[static_cast<std::size_t>(w)], ids, labels, mask);
  } else {
    window(src, begin, w, ids, labels);
    std::fill(mask.begin(), mask.end(), std::uint8_t{1});  // (documents: every token)
  }
  for (std::size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<std::int32_t>(i);  // one sequence
}

namespace {
void check_batch_buffers(std::int64_t rows, std::int64_t seq_len, std::span<std::int32_t> ids, std::span<std::int32_t> labels,
                         std::span<std::int32_t> positions, bool packed) {
  const auto n = static_cast<std::size_t>(rows * seq_len);
  MT_CHECK(ids.size() == n && labels.size() == n && (positions.empty() || positions.size() == n),
           "batch buffers hold {} / {} / {} tokens, expected {} x {}", ids.size(), labels.size(), positions.size(), rows,
           seq_len);
  MT_CHECK(!packed || !positions.empty(), "packed examples: the batch needs a buffer for the positions");
}
}  // namespace

void TokenDataset::train_batch(std::int64_t first_window, std::int64_t rows, std::span<std::int32_t> ids,
                               std::span<std::int32_t> labels, std::span<std::int32_t> positions,
                               std::span<std::uint8_t> attention_mask) const {
  MT_NVTX_RANGE("TokenDataset::train_batch");
  check_batch_buffers(rows, opt_.seq_len, ids, labels, positions, packed());
  MT_CHECK(attention_mask.empty() || attention_mask.size() == ids.size(), "an attention mask buffer of {} for {} tokens",
           attention_mask.size(), ids.size());
  const auto seq = static_cast<std::size_t>(opt_.seq_len);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t w = train_window(first_window + r);
    const auto at = static_cast<std::size_t>(r) * seq;
    fill(train_, train_begin_, train_kept_, train_packing_, w, ids.subspan(at, seq), labels.subspan(at, seq),
         positions.empty() ? positions : positions.subspan(at, seq),
         attention_mask.empty() ? attention_mask : attention_mask.subspan(at, seq));
  }
}

std::int64_t TokenDataset::train_window(std::int64_t k) const {
  MT_CHECK(k >= 0, "a slot of the training order must be >= 0 (got {})", k);
  return permutation(k / train_windows_)[static_cast<std::size_t>(k % train_windows_)];
}

void TokenDataset::train_rows(std::int64_t first_window, std::int64_t rows, std::span<std::int32_t> ids,
                              std::span<std::int32_t> labels, std::span<std::int32_t> positions) const {
  check_batch_buffers(rows, opt_.seq_len, ids, labels, positions, packed());
  const auto seq = static_cast<std::size_t>(opt_.seq_len);
  for (std::int64_t r = 0; r < rows; ++r) {
    const auto at = static_cast<std::size_t>(r) * seq;
    fill(train_, train_begin_, train_kept_, train_packing_, (first_window + r) % train_windows_, ids.subspan(at, seq),
         labels.subspan(at, seq), positions.empty() ? positions : positions.subspan(at, seq));
  }
}

std::int64_t TokenDataset::window_examples(std::int64_t w, bool val) const {
  const std::int64_t windows = val ? val_windows_ : train_windows_;
  MT_CHECK(w >= 0 && w < windows, "window {} of {} {} windows", w, windows, val ? "validation" : "training");
  if (!packed()) return 1;
  const Packing& p = val ? val_packing_ : train_packing_;
  return p.begin[static_cast<std::size_t>(w) + 1] - p.begin[static_cast<std::size_t>(w)];
}

void TokenDataset::val_batch(std::int64_t first_window, std::int64_t rows, std::span<std::int32_t> ids,
                             std::span<std::int32_t> labels, std::span<std::int32_t> positions) const {
  MT_NVTX_RANGE("TokenDataset::val_batch");
  check_batch_buffers(rows, opt_.seq_len, ids, labels, positions, packed());
  const auto seq = static_cast<std::size_t>(opt_.seq_len);
  const TokenSource& src = val_ ? *val_ : train_;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t w = (first_window + r) % val_windows_;
    const auto at = static_cast<std::size_t>(r) * seq;
    fill(src, val_begin_, val_kept_, val_packing_, w, ids.subspan(at, seq), labels.subspan(at, seq),
         positions.empty() ? positions : positions.subspan(at, seq));
  }
}

std::string builtin_text(std::size_t bytes, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto num = [&](int hi) { return static_cast<int>(rng() % static_cast<std::uint64_t>(hi)); };
  static const char* kNames[] = {"Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana"};
  static const char* kThings[] = {"apples", "books", "coins", "stones", "shells", "cards"};
  std::string out;
  out.reserve(bytes + 64);
  char line[128];
  while (out.size() < bytes) {
    const int a = num(100), b = num(100);
    switch (num(5)) {
      case 0: std::snprintf(line, sizeof line, "%d plus %d is %d.\n", a, b, a + b); break;
      case 1: std::snprintf(line, sizeof line, "%d minus %d is %d.\n", std::max(a, b), std::min(a, b), std::abs(a - b)); break;
      case 2: std::snprintf(line, sizeof line, "%d times %d is %d.\n", a % 13, b % 13, (a % 13) * (b % 13)); break;
      case 3: {
        const char* who = kNames[num(8)];
        const char* what = kThings[num(6)];
        std::snprintf(line, sizeof line, "%s has %d %s and finds %d more, so %s has %d %s.\n", who, a % 20, what, b % 20,
                      who, a % 20 + b % 20, what);
        break;
      }
      default: std::snprintf(line, sizeof line, "%d + %d = %d\n", a, b, a + b); break;
    }
    out += line;
  }
  return out;
}

}  // namespace megatrain
