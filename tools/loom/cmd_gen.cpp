// loom gen: print the generated program for a spec, schedule and target.
#include <cstdio>
#include <memory>
#include <string>

#include "commands.h"
#include "loom/compiler.h"

namespace loom::cli {
namespace {

struct GenOptions {
  std::string specPath;
  std::string schedulePath;
  std::string target = "cpu";
  bool printIrAfterAll = false;
  bool plan = false;
  bool backward = false;
  std::string decode;  // "", raw or mixed
};

int gen(const GenOptions& options) {
  auto spec = readSpecFile(options.specPath);
  if (!spec) return badInput(spec.error().message);
  auto schedule = readScheduleFile(options.schedulePath);
  if (!schedule) return badInput(schedule.error().message);
  auto target = parseTarget(options.target);
  if (!target) return badInput(target.error().message);

  std::string ir;
  GenerateOptions generateOptions;
  if (options.printIrAfterAll) generateOptions.irLog = &ir;
  if (options.backward && !options.decode.empty()) return badInput("--backward and --decode: choose one");
  if (options.backward) generateOptions.direction = Direction::backward;
  if (!options.decode.empty()) {
    generateOptions.direction = Direction::decode;
    generateOptions.mixedCache = options.decode == "mixed";
  }
  auto plan = generateKernel(*spec, *schedule, *target, generateOptions);
  if (!plan) return badInput(plan.error().message);
  if (options.printIrAfterAll) std::fputs(ir.c_str(), stdout);
  if (options.plan) {
    std::printf("// schedule: %s\n", plan->schedule.ShortDebugString().c_str());
    for (const LaunchPlan& launch : plan->launches) {
      std::printf("// launch %s: grid (ceil(N*%lld/%lld), %lld, B), %lld threads", launch.name.c_str(),
                  (long long)launch.rowsPerToken, (long long)launch.rowsPerCta, (long long)launch.gridY,
                  (long long)launch.threads);
      if (launch.sharedMemoryBytes) std::printf(", %lld B shared memory", (long long)launch.sharedMemoryBytes);
      if (launch.warpSpecialized)
        std::printf(", warp-specialised: 1 producer + %lld consumer warpgroups%s", (long long)launch.threads / 128 - 1,
                    launch.tensorMaps ? ", TMA tensor maps" : "");
      std::printf("\n");
    }
    for (Workspace w : plan->workspaces) std::printf("// workspace %s\n", workspaceName(w).c_str());
  }
  std::fputs(plan->source.c_str(), stdout);
  return kExitOk;
}

}  // namespace

void addGenCommand(CLI::App& app, std::function<int()>* action) {
  auto options = std::make_shared<GenOptions>();
  CLI::App* cmd = app.add_subcommand(
      "gen", "Generate the IHA program for a spec and print its C++ source (deterministic: the same inputs\n"
             "give byte-identical source).");
  cmd->add_option("--spec", options->specPath, "KernelSpec JSON file")->required();
  cmd->add_option("--schedule", options->schedulePath, "Schedule JSON file (unset fields take defaults)");
  cmd->add_option("--target", options->target, "cpu, or a CUDA arch such as sm_80, sm_90a")->capture_default_str();
  cmd->add_flag("--print-ir-after-all", options->printIrAfterAll, "print the IR after every pass, then the source");
  cmd->add_flag("--plan", options->plan, "print the launches and workspaces before the source");
  cmd->add_flag("--backward", options->backward,
                "the backward plan instead (every gradient of sum(out * dout); docs/compiler.md, The backward)");
  cmd->add_option("--decode", options->decode,
                  "the decode step over a paged cache of this layout instead (raw: k and v as projected; mixed:\n"
                  "pseudo-keys and values; docs/IHA.md, Decode over a paged cache); target cpu")
      ->check(CLI::IsMember({"raw", "mixed"}));
  cmd->callback([options, action] { *action = [options] { return gen(*options); }; });
}

}  // namespace loom::cli
