// The loom command line: one function per subcommand, registered on a CLI11
// app. Each returns the process exit code (0 ok, 1 check failed, 2 bad input).
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>

#include "loom/result.h"
#include "loom/spec.h"

namespace loom::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitCheckFailed = 1;
inline constexpr int kExitBadInput = 2;

// Adds the subcommand to `app`; when it is chosen, `*action` runs it.
void addRunCommand(CLI::App& app, std::function<int()>* action);
void addDrawCommand(CLI::App& app, std::function<int()>* action);
void addGenCommand(CLI::App& app, std::function<int()>* action);
void addCompileCommand(CLI::App& app, std::function<int()>* action);
void addSassCommand(CLI::App& app, std::function<int()>* action);
void addTuneCommand(CLI::App& app, std::function<int()>* action);
void addCacheCommand(CLI::App& app, std::function<int()>* action);
void addServeCommands(CLI::App& app, std::function<int()>* action);
void addPretuneCommand(CLI::App& app, std::function<int()>* action);

// Prints "loom: <message>" on stderr and returns kExitBadInput.
int badInput(const std::string& message);

// Applies a --dtype override ("" leaves the spec as it is).
Status overrideDtype(KernelSpec& spec, const std::string& dtype);

// A Schedule from a JSON file; an empty path gives the all-default schedule.
Result<Schedule> readScheduleFile(const std::string& path);

}  // namespace loom::cli
