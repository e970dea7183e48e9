#include <cstdio>
#include <functional>

#include "commands.h"
#include "jit/nvrtc_compiler.h"
#include "loom/cache.h"

int main(int argc, char** argv) {
  CLI::App app{
      "loom: generates, compiles, autotunes and serves GPU kernels for Interleaved Head Attention.\n"
      "Specs and schedules are JSON (the KernelSpec / Schedule messages of proto/loom/v1/loom.proto)."};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("loom " LOOM_VERSION " (") + loom::cache::kGeneratorVersion + ", " +
                                        loom::jit::nvrtcVersion() + ", MLIR 19)");
  std::function<int()> action;
  loom::cli::addRunCommand(app, &action);
  loom::cli::addDrawCommand(app, &action);
  loom::cli::addGenCommand(app, &action);
  loom::cli::addCompileCommand(app, &action);
  loom::cli::addSassCommand(app, &action);
  loom::cli::addTuneCommand(app, &action);
  loom::cli::addCacheCommand(app, &action);
  loom::cli::addServeCommands(app, &action);
  loom::cli::addPretuneCommand(app, &action);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : loom::cli::kExitBadInput;
  }
  return action ? action() : loom::cli::kExitBadInput;
}
