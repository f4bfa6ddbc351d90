// megatrain-plan: the memory and the step time of a training configuration, before anything is
// allocated (docs/planner.md). The program is the megatrain_app library's plan_main (src/app/programs.hpp).
#include "programs.hpp"

int main(int argc, char** argv) { return megatrain::app::plan_main(argc, argv); }
