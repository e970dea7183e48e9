// loom run: compute IHA for a case folder with one backend, write the output,
// and check it against expected.npy when the case has one.
#include <cstdio>
#include <map>
#include <memory>
#include <string>

#include "commands.h"
#include "io/case.h"
#include "reference/iha_reference.h"

namespace loom::cli {
namespace {

struct RunOptions {
  std::string caseDir;
  std::string backend = "reference";
  std::string out = "out.npy";
  std::string outDtype = "float32";
};

const std::map<std::string, NpyType> kOutTypes = {
    {"float32", NpyType::float32}, {"float64", NpyType::float64},
    {"float16", NpyType::float16}, {"bfloat16", NpyType::uint16}};

int run(const RunOptions& options) {
  auto loaded = loadCase(options.caseDir);
  if (!loaded) return badInput(loaded.error().message);
  const IhaCase& c = *loaded;

  std::vector<double> out;
  if (options.backend == "reference") {
    out = reference::ihaForward(c.spec, c.inputs).out;
  } else {
    return badInput("backend '" + options.backend + "' is not available in this build");
  }

  const std::vector<int64_t> shape = {c.batch, c.tokens, c.spec.heads(), c.spec.head_dim()};
  if (Status written = writeNpy(options.out, npyFromDouble(out, shape, kOutTypes.at(options.outDtype))); !written)
    return badInput(written.error().message);
  std::printf("wrote %s %s (%s)\n", options.out.c_str(), shapeString(shape).c_str(), options.outDtype.c_str());

  if (!c.expected) {
    std::printf("no expected.npy in %s: nothing to compare\n", options.caseDir.c_str());
    return kExitOk;
  }
  const double error = relativeError(out, *c.expected);
  const double tolerance = toleranceFor(c.spec.dtype());
  const bool pass = error <= tolerance;  // false for NaN
  std::printf("relative error %.3e (tolerance %.0e for %s): %s\n", error, tolerance,
              dtypeName(c.spec.dtype()).c_str(), pass ? "ok" : "FAILED");
  return pass ? kExitOk : kExitCheckFailed;
}

}  // namespace

int badInput(const std::string& message) {
  std::fprintf(stderr, "loom: %s\n", message.c_str());
  return kExitBadInput;
}

void addRunCommand(CLI::App& app, std::function<int()>* action) {
  auto options = std::make_shared<RunOptions>();
  CLI::App* cmd = app.add_subcommand(
      "run",
      "Compute IHA for a case folder (spec.json + q, k, v, alpha_*, collapse .npy) and write the output.\n"
      "When the folder has expected.npy, print the relative error; exit 1 if it is over the dtype's\n"
      "tolerance (float32 1e-5, float16 2e-3, bfloat16 1e-2). Bad input exits 2.");
  cmd->add_option("--case", options->caseDir, "case folder")->required();
  cmd->add_option("--backend", options->backend, "reference: the float64 oracle")
      ->check(CLI::IsMember({"reference"}))
      ->capture_default_str();
  cmd->add_option("--out", options->out, "output .npy file")->capture_default_str();
  cmd->add_option("--out-dtype", options->outDtype, "element type of the output file")
      ->check(CLI::IsMember({"float32", "float64", "float16", "bfloat16"}))
      ->capture_default_str();
  cmd->callback([options, action] { *action = [options] { return run(*options); }; });
}

}  // namespace loom::cli
