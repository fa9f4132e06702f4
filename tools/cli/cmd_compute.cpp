// `pagedattn compute CASE.safetensors`: replays one stored attention step (docs/case_format.md).
#include "cli.h"

namespace pagedattn::cli {
void add_compute_command(CLI::App&) {}
}  // namespace pagedattn::cli
