// Subcommands of the pagedattn command. Each add_* registers a CLI11 subcommand whose callback
// does the work; errors are pagedattn::Error exceptions, reported by main().
#pragma once

#include <CLI/CLI.hpp>

namespace pagedattn::cli {

void add_backends_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_compute_command(CLI::App& app);
void add_make_case_command(CLI::App& app);
void add_run_command(CLI::App& app);

/// The process exit code a subcommand asked for (0 unless a check failed).
int exit_code();
void set_exit_code(int code);

}  // namespace pagedattn::cli
