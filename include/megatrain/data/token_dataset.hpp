// Token datasets: what a training step reads.
//
// A token file is a flat array of little-endian token ids, read through a memory mapping:
//   - raw: uint16 (nanoGPT's train.bin / val.bin) or uint32 ids, no header; uint32 ids read as
//     uint16 are recognised (every second uint16 at most 3) and refused;
//   - llm.c: a 1024-byte header of 256 little-endian int32 — [0] = 20240520 (magic),
//     [1] = 1 (version), [2] = number of tokens — followed by that many uint16 ids; recognised
//     by the magic whatever format was asked for;
//   - text: any other file given as text is tokenised byte by byte (vocabulary 256).
// Every id is checked against the model's vocabulary when the dataset is opened.
//
// Training windows are contiguous: window w holds tokens [w*seq, w*seq + seq] (seq + 1 tokens:
// inputs are the first seq, labels the last seq). The windows of an epoch are visited in an
// order drawn by a seeded shuffle (one permutation per epoch), so a run is reproducible from its
// seed. Validation uses a separate file or, by default, the last `val_fraction` of the tokens,
// read in order.
//
// Examples (fine-tuning data, written by megatrain-tokenize; megatrain/text/prepare.hpp): a .bin
// token file with FILE.mask (one byte per token, 1 where the token is trained on) and FILE.idx
// (little-endian int64: where each example starts, then the total) beside it. Then a window is one
// example: its first seq + 1 tokens at the start of a row (a longer example is truncated), the
// rest of the row padding; a label is the next token where that token is trained on (every token
// of the example with train_on_prompt), kIgnoreIndex elsewhere, padding included. An example with
// no trained label left within its window is dropped (counted in ExampleStats). Validation: a
// separate file of examples or the last `val_fraction` of the examples.
//
// Preference pairs: examples with FILE.pairs beside them (megatrain-tokenize writes it for
// preference records, text/preference_records.hpp). Examples 2i and 2i + 1 are pair i's chosen and
// rejected answers. A pair is kept only if both keep a trained label within their windows; the
// shuffle moves whole pairs, so windows 2k and 2k + 1 of the order are one pair's; the validation
// split falls between pairs. Packed, a pair is placed whole: its chosen then its rejected answer
// in one row (a pair whose two answers do not fit one row together is left out, and counted).
//
// Packing (DatasetOptions::pack, examples only): the kept examples are packed once into rows of
// seq tokens, and a window is a row. An example takes min(length, seq + 1) - 1 tokens of a row
// (its last token is only a label, as in its own window); positions restart at 0 for each
// example, and a row's free tail is one more sequence of padding (labels kIgnoreIndex). The
// order is a shuffle drawn from the seed (file order for validation), each example placed in
// the fullest row it still fits (best fit); the rows are fixed for the run, and their order is
// shuffled every epoch like windows. The loss of an example is the same packed or not, as long
// as attention stays within it (TrainerOptions::packed).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace megatrain {

enum class TokenFormat { u16, u32, text };

/// The sidecars of a token file of examples: FILE.mask and FILE.idx, and FILE.pairs where the
/// examples are preference pairs.
std::filesystem::path example_mask_path(const std::filesystem::path& tokens);
std::filesystem::path example_index_path(const std::filesystem::path& tokens);
std::filesystem::path example_pairs_path(const std::filesystem::path& tokens);
/// What FILE.pairs holds for `pairs` pairs (a line of JSON naming the count).
std::string example_pairs_note(std::int64_t pairs);

/// A read-only stream of token ids (memory-mapped file, or bytes in memory).
class TokenSource {
 public:
  /// Opens `path`: ".txt" (and other non-.bin files) as text, ".bin" as `bin_format` (u16 or
  /// u32; an llm.c header is recognised by its magic). Throws for an empty file or a size that is
  /// not a multiple of the token width.
  static TokenSource open(const std::filesystem::path& path, TokenFormat bin_format = TokenFormat::u16);
  /// Byte-level tokens of `text` (kept in memory); `label` names it in messages.
  static TokenSource from_text(std::string text, std::string label);

  std::int64_t size() const { return count_; }
  TokenFormat format() const { return format_; }
  const std::string& label() const { return label_; }
  std::int32_t at(std::int64_t i) const;
  /// Copies tokens [start, start + out.size()) into `out`.
  void read(std::int64_t start, std::span<std::int32_t> out) const;
  /// The largest id (scanned in parallel).
  std::int32_t max_id() const;
  /// For a uint32 source: whether its first ids (up to 2^20) all read as two uint16 ids below
  /// `vocab` — a uint16 file opened at the wrong width.
  bool holds_u16_pairs(std::int64_t vocab) const;
  /// A digest of the tokens as stored (32 hex digits): XXH3-128 over the XXH3-128 digests of
  /// consecutive 64 MiB blocks, hashed in parallel (and of the mask and index, for examples).
  /// Identifies the data a run trained on.
  std::string digest() const;

  /// Whether the file is examples (FILE.mask and FILE.idx beside it).
  bool has_examples() const { return examples_ > 0; }
  /// Whether the examples are preference pairs (FILE.pairs beside them).
  bool has_pairs() const { return pairs_; }
  std::int64_t examples() const { return examples_; }
  /// Tokens [example_begin(e), example_end(e)) are example e.
  std::int64_t example_begin(std::int64_t e) const;
  std::int64_t example_end(std::int64_t e) const { return example_begin(e + 1); }
  /// Whether token i is trained on (examples only).
  bool trained(std::int64_t i) const { return std::to_integer<std::uint8_t>(mask_[i]) != 0; }

 private:
  struct Mapping;
  std::shared_ptr<const Mapping> map_;  // the mapping or the text, shared by copies
  const std::byte* data_ = nullptr;     // first token
  std::shared_ptr<const Mapping> mask_map_, index_map_;  // examples
  const std::byte* mask_ = nullptr;
  const std::byte* index_ = nullptr;
  std::int64_t examples_ = 0;
  bool pairs_ = false;
  std::int64_t count_ = 0;
  TokenFormat format_ = TokenFormat::u16;
  std::string label_;
};

/// Where a run stands in the shuffled order of training windows: the seed of the shuffle (the
/// only random stream a training step draws from), the epoch (full passes completed) and the slot
/// (windows of the current epoch consumed). Step s of a run with batch B starts at
/// windows_consumed = (s - 1) * B.
struct DataPosition {
  std::uint64_t seed = 0;
  std::int64_t epoch = 0;
  std::int64_t slot = 0;
  std::int64_t windows_per_epoch = 0;
  std::int64_t windows_consumed() const { return epoch * windows_per_epoch + slot; }
  friend bool operator==(const DataPosition&, const DataPosition&) = default;
};

struct DatasetOptions {
  std::int64_t vocab_size = 0;   ///< ids must be < this
  std::int64_t seq_len = 0;      ///< tokens per sequence
  double val_fraction = 0.05;    ///< tail of the training source held out when no validation source is given
  std::uint64_t seed = 0;        ///< shuffle seed
  bool train_on_prompt = false;  ///< examples: every token is a label, not only the trained ones
  bool pack = false;             ///< examples: several per row (see above)
};

/// What became of the examples of a source (TokenDataset in example mode).
struct ExampleStats {
  std::int64_t examples = 0;   ///< in the split
  std::int64_t truncated = 0;  ///< kept, and longer than seq + 1 tokens: cut at the end of the window
  std::int64_t dropped = 0;    ///< no trained label within the window: left out (cut or not)
  std::int64_t labels = 0;     ///< trained labels of the kept examples, within their windows
  std::int64_t tokens = 0;     ///< tokens of the kept examples within their windows
  std::int64_t rows = 0;       ///< windows: one per kept example, or the rows they are packed into
  std::int64_t split = 0;      ///< packed pairs: pairs left out (among the dropped) as too long for one row together
};

class TokenDataset {
 public:
  /// Checks everything before training can start: ids within the vocabulary, at least one
  /// training and one validation window of seq_len + 1 tokens.
  TokenDataset(TokenSource train, DatasetOptions opt, std::optional<TokenSource> val = std::nullopt);

  std::int64_t seq_len() const { return opt_.seq_len; }
  std::int64_t train_windows() const { return train_windows_; }
  std::int64_t val_windows() const { return val_windows_; }
  std::int64_t train_tokens() const { return train_end_ - train_begin_; }
  std::int64_t val_tokens() const { return val_end_ - val_begin_; }

  /// Fills `rows` sequences of inputs and labels ([rows * seq_len] each) for training window
  /// slots [first_window, first_window + rows) of the shuffled order (epoch after epoch), and,
  /// unless empty, each token's position within its sequence (required when packed()) and
  /// transformers' attention mask of the rows (1 for an example's tokens, 0 for the padding after
  /// them; every token of documents): what Trainer::step() takes.
  void train_batch(std::int64_t first_window, std::int64_t rows, std::span<std::int32_t> ids,
                   std::span<std::int32_t> labels, std::span<std::int32_t> positions = {},
                   std::span<std::uint8_t> attention_mask = {}) const;
  /// The training window that slot `k` of the shuffled order (epoch after epoch) reads.
  std::int64_t train_window(std::int64_t k) const;
  /// Training windows [first_window, first_window + rows) in file order, wrapping around (what a
  /// pass over every training window reads: a preference run's reference, say), as train_batch().
  void train_rows(std::int64_t first_window, std::int64_t rows, std::span<std::int32_t> ids,
                  std::span<std::int32_t> labels, std::span<std::int32_t> positions = {}) const;
  /// The examples window `w` holds (training, or validation with `val`): 1, or packed, its row's.
  std::int64_t window_examples(std::int64_t w, bool val = false) const;
  /// Where the order stands once `windows_consumed` training windows have been read.
  DataPosition position(std::int64_t windows_consumed) const;
  const TokenSource& train_source() const { return train_; }
  /// Example mode: one example per window (see above).
  bool examples() const { return train_.has_examples(); }
  /// Examples packed several to a row (DatasetOptions::pack).
  bool packed() const { return examples() && opt_.pack; }
  /// Preference pairs: windows 2k and 2k + 1 of the training order (and of validation) are a pair;
  /// packed, each row holds whole pairs (each its chosen then its rejected answer).
  bool pairs() const { return train_.has_pairs(); }
  const ExampleStats& train_examples() const { return train_stats_; }
  const ExampleStats& val_examples() const { return val_stats_; }
  const std::optional<TokenSource>& val_source() const { return val_; }
  /// Validation windows [first_window, first_window + rows), in file order, wrapping around.
  void val_batch(std::int64_t first_window, std::int64_t rows, std::span<std::int32_t> ids,
                 std::span<std::int32_t> labels, std::span<std::int32_t> positions = {}) const;

 private:
  /// Packed rows: row r holds examples[begin[r] .. begin[r + 1]).
  struct Packing {
    std::vector<std::int64_t> begin, examples;
  };
  Packing pack(const TokenSource& src, std::vector<std::int64_t> kept, bool shuffle) const;
  /// The tokens example e takes in a row: min(length, seq + 1) - 1.
  std::int64_t row_tokens(const TokenSource& src, std::int64_t e) const;
  void fill(const TokenSource& src, std::int64_t begin, const std::vector<std::int64_t>& kept, const Packing& packing,
            std::int64_t w, std::span<std::int32_t> ids, std::span<std::int32_t> labels,
            std::span<std::int32_t> positions, std::span<std::uint8_t> mask = {}) const;
  void packed_window(const TokenSource& src, const Packing& packing, std::int64_t row, std::span<std::int32_t> ids,
                     std::span<std::int32_t> labels, std::span<std::int32_t> positions, std::span<std::uint8_t> mask) const;
  void window(const TokenSource& src, std::int64_t begin, std::int64_t w, std::span<std::int32_t> ids,
              std::span<std::int32_t> labels) const;
  const std::vector<std::int64_t>& permutation(std::int64_t epoch) const;
  void example_window(const TokenSource& src, std::int64_t e, std::span<std::int32_t> ids, std::span<std::int32_t> labels,
                      std::span<std::uint8_t> mask) const;
  ExampleStats select(const TokenSource& src, std::int64_t first, std::int64_t last, std::vector<std::int64_t>& kept) const;

  TokenSource train_;
  std::optional<TokenSource> val_;
  DatasetOptions opt_;
  std::int64_t train_begin_ = 0, train_end_ = 0, val_begin_ = 0, val_end_ = 0;
  std::int64_t train_windows_ = 0, val_windows_ = 0;
  std::vector<std::int64_t> train_kept_, val_kept_;  // examples: the window's example
  Packing train_packing_, val_packing_;              // packed examples: each row's examples
  ExampleStats train_stats_, val_stats_;
  mutable std::int64_t perm_epoch_ = -1;
  mutable std::vector<std::int64_t> perm_;
};

/// The built-in training text: deterministic arithmetic sentences ("17 plus 25 is 42.") in a
/// few templates, about `bytes` long. Written by the program, so no download is needed; a
/// model that learns it shows a loss falling well below that of a byte unigram model.
std::string builtin_text(std::size_t bytes = 1 << 20, std::uint64_t seed = 1);

}  // namespace megatrain
