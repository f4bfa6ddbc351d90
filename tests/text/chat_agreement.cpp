// Checks megatrain's chat formats against a model's own chat template rendered by Hugging Face's
// Jinja and encoded by Hugging Face tokenizers (reference/chat.js):
//   chat_agreement TOKENIZER_JSON CONVERSATIONS REFERENCE
// For every conversation: the rendered text is the template's, the ids are the reference's, and
// the trained tokens are exactly the assistant turns (each trained run decodes to its piece's
// text: the content and the end-of-turn token); with the generation prompt, the text is the
// template's with add_generation_prompt=True; a conversation the template refuses
// (raise_exception) is refused by megatrain too. Exit 1 on any difference.
#include <fmt/format.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "megatrain/core/error.hpp"
#include "megatrain/io/detail/atomic_files.hpp"
#include "megatrain/text/chat.hpp"

using json = nlohmann::json;
using namespace megatrain::text;

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: chat_agreement TOKENIZER_JSON CONVERSATIONS REFERENCE\n");
    return 2;
  }
  try {
    const Tokenizer tok = Tokenizer::from_file(argv[1]);
    if (!tok.chat_template()) {
      std::fprintf(stderr, "%s has no chat template\n", argv[1]);
      return 1;
    }
    const auto format = recognise_chat_template(*tok.chat_template());
    if (!format) {
      std::fprintf(stderr, "%s: chat template not recognised (digest %s)\n", argv[1], chat_template_digest(*tok.chat_template()).c_str());
      return 1;
    }
    const json convs = json::parse(megatrain::io::detail::read_file(argv[2]));
    const json ref = json::parse(megatrain::io::detail::read_file(argv[3]));
    RecordOptions opt;
    opt.chat = format;
    if (tok.bos_id()) opt.bos = *tok.id_to_token(*tok.bos_id());
    std::size_t bad = 0, trained_tokens = 0, tokens = 0, spanning = 0, refused = 0;
    for (std::size_t i = 0; i < convs.size(); ++i) {
      if (ref[i].contains("error")) {  // the template raises: megatrain must refuse the conversation too
        std::string why;
        try {
          (void)record_pieces(convs[i], RecordFormat::messages, opt);
          why = "megatrain renders a conversation the template refuses (" + ref[i]["error"].get<std::string>() + ")";
        } catch (const megatrain::Error&) {
          ++refused;
        }
        if (!why.empty() && ++bad <= 3) std::fprintf(stderr, "conversation %zu: %s\n", i, why.c_str());
        continue;
      }
      std::vector<Piece> pieces;
      try {
        pieces = record_pieces(convs[i], RecordFormat::messages, opt);
      } catch (const megatrain::Error& e) {
        if (++bad <= 3) std::fprintf(stderr, "conversation %zu: megatrain refuses what the template renders: %s\n", i, e.what());
        continue;
      }
      std::string text;
      for (const auto& p : pieces) text += p.text;
      const auto want_text = ref[i]["text"].get<std::string>();
      const auto want_ids = ref[i]["ids"].get<std::vector<std::int32_t>>();
      const EncodedExample e = encode_pieces(tok, pieces);
      std::string why;
      const std::string prompt = render_prompt(*format, chat_messages(convs[i]), opt.bos);
      if (text != want_text) why = "text differs:\n--- megatrain\n" + text + "\n--- template\n" + want_text;
      else if (prompt != ref[i]["prompt"].get<std::string>())
        why = "the generation prompt differs:\n--- megatrain\n" + prompt + "\n--- template\n" + ref[i]["prompt"].get<std::string>();
      else if (e.ids != want_ids) why = "ids differ";
      else {
        // trained runs against trained pieces, in order
        std::vector<std::vector<std::int32_t>> run_ids;
        for (std::size_t t = 0; t < e.ids.size(); ++t) {
          if (!e.trained[t]) continue;
          if (t == 0 || !e.trained[t - 1]) run_ids.emplace_back();
          run_ids.back().push_back(e.ids[t]);
          ++trained_tokens;
        }
        std::vector<std::string> runs;
        for (const auto& r : run_ids) runs.push_back(tok.decode(r));
        std::vector<std::string> want;
        for (const auto& p : pieces)
          if (p.trained) want.push_back(p.text);
        if (runs.size() != want.size()) why = fmt::format("{} trained runs for {} assistant turns", runs.size(), want.size());
        for (std::size_t k = 0; why.empty() && k < runs.size(); ++k)
          if (runs[k] != want[k]) {
            // a token spanning the start of the turn is trained: the run may begin earlier
            if (runs[k].ends_with(want[k]) && runs[k].size() - want[k].size() <= 4) ++spanning;
            else why = "trained run " + std::to_string(k) + " is '" + runs[k] + "', its turn '" + want[k] + "'";
          }
      }
      tokens += e.ids.size();
      if (!why.empty()) {
        if (++bad <= 3) std::fprintf(stderr, "conversation %zu: %s\n", i, why.c_str());
      }
    }
    std::printf("%s (%s): %zu conversations (%zu refused by the template and by megatrain), %zu tokens, %zu trained, %zu turns "
                "with a spanning token; %zu differ\n",
                argv[1], std::string(chat_format_name(*format)).c_str(), convs.size(), refused, tokens, trained_tokens, spanning,
                bad);
    return bad == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "chat_agreement: %s\n", e.what());
    return 1;
  }
}
