// TensorBoard event files: a run's scalars (loss, learning rate, gradient norm, tokens/s, ...) and
// texts (its samples) in the format TensorBoard reads, so that `tensorboard --logdir DIR` charts a megatrain run beside
// others.
//
// The format is TensorFlow's record framing of `Event` protocol buffers:
//   record   uint64 length (little-endian), uint32 masked CRC-32C of those 8 bytes, the data,
//            uint32 masked CRC-32C of the data; masked = ((crc >> 15) | (crc << 17)) + 0xa282ead8
//   Event    wall_time (1, double), step (2, int64), file_version (3, string: "brain.Event:2",
//            the first event of a file), summary (5, message)
//   Summary  value (1, repeated message); Summary.Value: tag (1, string), simple_value (2, float),
//            or for text (the samples of --sample-every) tensor (8: TensorProto with dtype 1 =
//            DT_STRING, an empty tensor_shape 2, string_val 8) and metadata (9: SummaryMetadata
//            whose plugin_data 1 names plugin_name 1 "text"), which TensorBoard's Text tab shows
// The few fields megatrain writes are encoded here by hand (protobuf's wire format: varints and
// length-delimited fields), so no protobuf library is needed.
//
// A resumed run opens a new file in the same folder; TensorBoard reads a folder's files in name
// order and, where a step goes back, drops the later steps it had (its purge of orphaned data).
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace megatrain::io {

/// CRC-32C (Castagnoli) of `bytes`, and TensorFlow's masked form of it.
std::uint32_t crc32c(std::span<const std::byte> bytes);
std::uint32_t masked_crc32c(std::span<const std::byte> bytes);

/// One Event with a summary of scalars, encoded (without the record framing).
std::string encode_scalar_event(double wall_time, std::int64_t step,
                                std::span<const std::pair<std::string, float>> scalars);
/// One Event with a summary of texts (tag, text: Markdown, as TensorBoard's Text tab renders it), encoded.
std::string encode_text_event(double wall_time, std::int64_t step, std::span<const std::pair<std::string, std::string>> texts);
/// The file's first Event: file_version "brain.Event:2".
std::string encode_file_version_event(double wall_time);
/// `data` framed as a record.
std::string frame_record(std::string_view data);

class TensorBoardWriter {
 public:
  /// Creates `dir` where missing and a new events file in it
  /// (events.out.tfevents.<seconds>.<host>.<pid>.megatrain), holding the file_version event.
  /// Throws megatrain::Error naming the file where that fails.
  explicit TensorBoardWriter(const std::filesystem::path& dir);
  TensorBoardWriter(TensorBoardWriter&&) noexcept;
  TensorBoardWriter& operator=(TensorBoardWriter&&) noexcept;
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  ~TensorBoardWriter();

  const std::filesystem::path& path() const { return path_; }
  /// Appends one event with these scalars at `step` (one write). Returns the empty string, or why
  /// it could not (the file then holds whole records only: a short write is cut back).
  std::string scalars(std::int64_t step, std::span<const std::pair<std::string, float>> values);
  /// The same for texts (tag, Markdown).
  std::string texts(std::int64_t step, std::span<const std::pair<std::string, std::string>> values);

 private:
  std::string append(const std::string& record);
  std::filesystem::path path_;
  int fd_ = -1;
};

}  // namespace megatrain::io
