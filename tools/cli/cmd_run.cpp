// `pagedattn run`: the main job.
#include "cli.h"

namespace pagedattn::cli {
void add_run_command(CLI::App&) {}
}  // namespace pagedattn::cli
