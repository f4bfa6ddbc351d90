// megatrain-train: trains, fine-tunes, evaluates or exports a decoder-only model from the command
// line (docs/training.md). The program is the megatrain_app library's train_main (src/app/programs.hpp).
#include "programs.hpp"

int main(int argc, char** argv) { return megatrain::app::train_main(argc, argv); }
