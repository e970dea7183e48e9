// loom draw: write a new random case folder for a spec, with expected.npy
// computed by the float64 reference.
#include <cstdio>
#include <memory>
#include <string>

#include "commands.h"
#include "io/case.h"

namespace loom::cli {
namespace {

struct DrawOptions {
  std::string specPath;
  std::string outDir;
  int64_t batch = 1;
  int64_t tokens = 16;
  int64_t documents = 3;
  uint64_t seed = 1;
};

int draw(const DrawOptions& options) {
  auto spec = readSpecFile(options.specPath);
  if (!spec) return badInput(spec.error().message);
  if (options.batch < 1 || options.tokens < 1) return badInput("--batch and --tokens must be at least 1");
  if (spec->varlen() && options.batch != 1)
    return badInput("a varlen spec packs its documents in one batch: give --documents (and --tokens, their total), "
                    "not --batch");
  if (options.documents < 1) return badInput("--documents must be at least 1");

  // A varlen case: `documents` documents over the tokens, their bounds drawn (cu_seqlens.npy).
  const IhaCase c =
      drawCheckableCase(*spec, spec->varlen() ? options.documents : options.batch, options.tokens, options.seed);
  if (Status written = writeCase(options.outDir, c); !written) return badInput(written.error().message);
  std::string documents;
  for (int32_t bound : c.inputs.cu_seqlens) documents += (documents.empty() ? ", cu_seqlens " : " ") + std::to_string(bound);
  std::printf("wrote case %s (B=%lld, N=%lld%s, seed %llu)\n", options.outDir.c_str(), (long long)c.batch,
              (long long)options.tokens, documents.c_str(), (unsigned long long)options.seed);
  return kExitOk;
}

}  // namespace

void addDrawCommand(CLI::App& app, std::function<int()>* action) {
  auto options = std::make_shared<DrawOptions>();
  CLI::App* cmd = app.add_subcommand(
      "draw", "Draw a random case folder for a spec: inputs ~ N(0,1) in the spec's dtype, weights in float32,\n"
              "expected.npy from the float64 reference. For float16 and bfloat16, inputs whose collapse cancels so far\n"
              "that rounding the mixed rows to the dtype alone costs over half the tolerance (no 16-bit kernel could\n"
              "be checked on them; docs/IHA.md, Numerics) are drawn again from the next seed.");
  cmd->add_option("--spec", options->specPath, "KernelSpec JSON file")->required();
  cmd->add_option("--out", options->outDir, "case folder to write")->required();
  cmd->add_option("--batch", options->batch, "B")->capture_default_str();
  cmd->add_option("--tokens", options->tokens, "N")->capture_default_str();
  cmd->add_option("--documents", options->documents,
                  "varlen specs: documents packed into the --tokens of one batch (cu_seqlens drawn)")
      ->capture_default_str();
  cmd->add_option("--seed", options->seed, "random seed")->capture_default_str();
  cmd->callback([options, action] { *action = [options] { return draw(*options); }; });
}

}  // namespace loom::cli
