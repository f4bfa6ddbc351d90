// The heads and sizes of a Gated DeltaNet mixing as device kernels see them, and the device
// memory those kernels use beside their operands. Backend-neutral (no CUDA): the planner prices
// the same bytes the CUDA backend allocates (backend/cuda/gated_deltanet.hpp holds the kernels).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace megatrain {

/// The heads and sizes of one Gated DeltaNet mixing (LinearAttentionConfig's, as the kernels see them).
struct DeltaNetShape {
  std::int64_t key_heads = 0, value_heads = 0, dk = 0, dv = 0, taps = 0;
  double norm_eps = 1e-6;  ///< the gated RMSNorm's

  std::int64_t key_dim() const { return key_heads * dk; }
  std::int64_t value_dim() const { return value_heads * dv; }
  std::int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
  bool operator==(const DeltaNetShape&) const = default;
};

/// Tokens per chunk of the delta rule on a device (its matrices are chunk x chunk).
inline constexpr std::int64_t kDeltaRuleChunk = 64;
/// The widest key head the device kernels take (the state's rows live in one block).
inline constexpr std::int64_t kDeltaRuleMaxKeyDim = 128;
/// The longest convolution the device kernels take (its taps' partial sums live in registers).
inline constexpr std::int64_t kDeltaNetMaxTaps = 8;
/// Tokens per segment of the weights' gradient sums (each segment's partial sums, then their sum).
inline constexpr std::int64_t kDeltaNetSegment = 1024;
/// Rows (token, value head) per part of the gated norm's gain gradient (each part's sums, then theirs).
inline constexpr std::int64_t kDeltaNetNormRows = 1024;
/// Parts of the gated norm's gain gradient over `tokens` tokens.
inline std::int64_t delta_net_norm_parts(const DeltaNetShape& s, std::int64_t tokens) {
  return (tokens * s.value_heads + kDeltaNetNormRows - 1) / kDeltaNetNormRows;
}
/// The device kernels take a long chunk a window of tokens at a time, the state carried across:
/// a window's workspace is about this many bytes (windows hold at least kDeltaNetMinWindow tokens).
inline constexpr std::size_t kDeltaNetWindowBytes = std::size_t{4} << 30;
inline constexpr std::int64_t kDeltaNetMinWindow = 4096;

/// Device bytes a token of a window takes in the backward's workspace (the forward's is less).
inline std::size_t delta_net_token_bytes(const DeltaNetShape& s) {
  const auto Hk = static_cast<std::size_t>(s.key_heads), Hv = static_cast<std::size_t>(s.value_heads);
  const auto vd = static_cast<std::size_t>(s.value_dim()), cd = static_cast<std::size_t>(s.conv_dim());
  const std::size_t state = Hv * static_cast<std::size_t>(s.dk * s.dv);
  const auto C = static_cast<std::size_t>(kDeltaRuleChunk), dk = static_cast<std::size_t>(s.dk);
  return 4 * (cd + 2 * Hk + 2 * Hv + 2 * state / C + 4 * vd + 3 * Hv * dk + Hv * C + 2 * Hv + 1);
}
/// Tokens in each window of a mixing of `tokens` (the last may hold fewer; a window ends where a
/// chunk of its last sequence does, so it may stop up to a chunk short of this). `window` > 0 asks
/// for windows of that many tokens (rounded down to chunks, at least one); 0: kDeltaNetWindowBytes'.
inline std::int64_t delta_net_window_tokens(const DeltaNetShape& s, std::int64_t tokens, std::int64_t window = 0) {
  const auto fit = static_cast<std::int64_t>(kDeltaNetWindowBytes / std::max<std::size_t>(delta_net_token_bytes(s), 1));
  const std::int64_t w = window > 0 ? std::max(kDeltaRuleChunk, window / kDeltaRuleChunk * kDeltaRuleChunk)
                                    : std::max(kDeltaNetMinWindow, fit / kDeltaRuleChunk * kDeltaRuleChunk);
  return std::min(tokens, w);
}
/// Windows of a mixing of `tokens` tokens: at most this many.
inline std::int64_t delta_net_windows(const DeltaNetShape& s, std::int64_t tokens, std::int64_t window = 0) {
  const std::int64_t w = delta_net_window_tokens(s, tokens, window);
  return w >= tokens ? 1 : (tokens + w - kDeltaRuleChunk) / (w - kDeltaRuleChunk + 1) + 1;
}

/// Device bytes the mixing's kernels use besides their operands, for `tokens` tokens in at most
/// `sequences` sequences, in windows of `window` tokens (delta_net_window_tokens); `backward`: the backward's (which recomputes the forward's and keeps a
/// window's chunk states and their gradients, in fp32).
inline std::size_t delta_net_workspace_bytes(const DeltaNetShape& s, std::int64_t tokens, std::int64_t sequences,
                                             bool backward, std::int64_t window = 0) {
  const std::int64_t W = delta_net_window_tokens(s, tokens, window), pieces = std::min(sequences, W);
  const auto T = static_cast<std::size_t>(W), C = static_cast<std::size_t>((W + kDeltaRuleChunk - 1) / kDeltaRuleChunk + pieces);
  const auto Hk = static_cast<std::size_t>(s.key_heads), Hv = static_cast<std::size_t>(s.value_heads);
  const auto vd = static_cast<std::size_t>(s.value_dim()), cd = static_cast<std::size_t>(s.conv_dim());
  const std::size_t state = Hv * static_cast<std::size_t>(s.dk * s.dv), pad = 256, f = sizeof(float);
  const auto windows = static_cast<std::size_t>(delta_net_windows(s, tokens, window));
  // (each piece below aligned to 256 bytes: the sequence table, conv, norms, gates, window states,
  // the rule's W, U and T, the chunks' states and delta)
  const auto dk = static_cast<std::size_t>(s.dk), chunk = static_cast<std::size_t>(kDeltaRuleChunk);
  std::size_t n = 2 * (static_cast<std::size_t>(pieces) + 1) * sizeof(std::int32_t) + T * cd * f + T * 2 * Hk * f +
                  2 * T * Hv * f + (windows + 1) * state * f + T * Hv * dk * f + T * vd * f + C * Hv * chunk * chunk * f +
                  C * state * f + T * vd * f + 13 * pad;
  if (backward) {
    const auto segments = static_cast<std::size_t>((W + kDeltaNetSegment - 1) / kDeltaNetSegment);
    n += C * state * f + 2 * T * vd * f + 2 * T * Hv * dk * f + 2 * T * Hv * f;
    n += segments * (cd * static_cast<std::size_t>(s.taps) + 2 * Hv) * f +
         static_cast<std::size_t>(delta_net_norm_parts(s, W)) * static_cast<std::size_t>(s.dv) * f;
    n += 2 * state * f + static_cast<std::size_t>(std::max<std::int64_t>(s.taps - 1, 1)) * cd * f + 18 * pad;
  }
  return n;
}

}  // namespace megatrain
