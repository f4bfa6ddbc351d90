// megatrain-generate: completions of prompts by a model, JSONL in and out (docs/generation.md).
// The program is the megatrain_app library's generate_main (src/app/programs.hpp).
#include "programs.hpp"

int main(int argc, char** argv) { return megatrain::app::generate_main(argc, argv); }
