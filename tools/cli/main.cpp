// The pagedattn command: one subcommand per file (cmd_*.cpp), registered here.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "cli.h"
#include "pagedattn/error.h"

int main(int argc, char** argv) {
  CLI::App app{"pagedattn: paged attention for C++ inference engines"};
  app.require_subcommand(1);
  pagedattn::cli::add_backends_command(app);
  pagedattn::cli::add_bench_command(app);
  pagedattn::cli::add_compute_command(app);
  pagedattn::cli::add_make_case_command(app);
  pagedattn::cli::add_run_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const pagedattn::Error& e) {
    std::fprintf(stderr, "pagedattn: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pagedattn: internal error: %s\n", e.what());
    return 3;
  }
  return pagedattn::cli::exit_code();
}
