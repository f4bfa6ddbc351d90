// megatrain-tokenize: text and JSON records in, token files out, with a model's tokenizer
// (docs/data.md). The program is the megatrain_app library's tokenize_main (src/app/programs.hpp).
#include "programs.hpp"

int main(int argc, char** argv) { return megatrain::app::tokenize_main(argc, argv); }
