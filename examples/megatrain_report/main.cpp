// megatrain-report: report.html for a megatrain-train run folder (docs/report.md). The program is
// the megatrain_app library's report_main (src/app/programs.hpp).
#include "programs.hpp"

int main(int argc, char** argv) { return megatrain::app::report_main(argc, argv); }
