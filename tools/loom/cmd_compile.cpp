// loom compile: generate a spec's program for a CUDA arch, compile it with
// NVRTC, and report the resources (no GPU needed).
#include <google/protobuf/util/json_util.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "commands.h"
#include "api/compile.h"
#include "jit/nvrtc_compiler.h"
#include "jit/sass.h"
#include "loom/compiler.h"
#include "loom/decode.h"

namespace loom::cli {
namespace {

struct CompileOptions {
  std::string specPath;
  std::string schedulePath;
  std::string target = "sm_90";
  std::string dtype;
  bool backward = false;
  bool decode = false;
  std::string cache = "raw";
  std::string cacheDir;
  std::string outPath;
  bool json = false;
  bool sass = false;
  std::string sassListing;
};

nlohmann::json report(const KernelPlan& plan, const jit::Artifact& artifact) {
  nlohmann::json entries = nlohmann::json::array();
  for (const LaunchPlan& launch : plan.launches) {
    nlohmann::json entry = {{"name", launch.name},
                            {"threads", launch.threads},
                            {"dynamic_shared_memory_bytes", launch.sharedMemoryBytes}};
    for (const v1::ResourceUsage& usage : artifact.resources)
      if (usage.entry() == launch.name) {
        entry["registers"] = usage.registers();
        entry["spill_store_bytes"] = usage.spill_store_bytes();
        entry["spill_load_bytes"] = usage.spill_load_bytes();
        entry["stack_frame_bytes"] = usage.stack_frame_bytes();
        entry["static_shared_memory_bytes"] = usage.shared_memory_bytes();
        entry["performance_notes"] = std::vector<std::string>(usage.performance_notes().begin(),
                                                              usage.performance_notes().end());
        entry["serialized_wgmma"] = usage.serialized_wgmma();
        entry["fp64_instructions"] = usage.fp64_instructions();
        entry["local_memory_instructions"] = usage.local_memory_instructions();
        if (usage.sass_read()) {
          nlohmann::json loops = nlohmann::json::array();
          for (const v1::SassLoop& loop : usage.loops()) loops.push_back(nlohmann::json::parse(toJson(loop)));
          nlohmann::json simtLoops = nlohmann::json::array();
          for (const v1::SassLoop& loop : usage.simt_loops()) simtLoops.push_back(nlohmann::json::parse(toJson(loop)));
          entry["sass"] = {{"loops", loops},
                           {"simt_loops", simtLoops},
                           {"memory", nlohmann::json::parse(toJson(usage.memory()))},
                           {"setmaxnreg", std::vector<int>(usage.setmaxnreg().begin(), usage.setmaxnreg().end())}};
        }
      }
    entries.push_back(entry);
  }
  return {{"target", artifact.arch},
          {"toolchain", jit::nvrtcVersion()},
          {"binary", artifact.binaryKind},
          {"binary_bytes", artifact.binary.size()},
          {"compile_seconds", artifact.compileSeconds},
          {"from_cache", artifact.fromCache},
          {"uses_tensor_cores", artifact.usesTensorCores()},
          {"uses_async_copies", artifact.usesAsyncCopies()},
          {"uses_wgmma", artifact.usesWgmma()},
          {"uses_tma", artifact.usesTma()},
          {"uses_setmaxnreg", artifact.usesSetmaxnreg()},
          {"warnings", artifact.warnings()},
          {"performance_losses", artifact.performanceLosses()},
          {"spill_bytes", artifact.spillBytes()},
          {"schedule", nlohmann::json::parse(toJson(plan.schedule))},
          {"source_hash", plan.sourceHash},
          {"entries", entries}};
}

int compile(const CompileOptions& options) {
  auto spec = readSpecFile(options.specPath);
  if (!spec) return badInput(spec.error().message);
  if (Status ok = overrideDtype(*spec, options.dtype); !ok) return badInput(ok.error().message);
  auto schedule = readScheduleFile(options.schedulePath);
  if (!schedule) return badInput(schedule.error().message);
  auto target = parseTarget(options.target);
  if (!target) return badInput(target.error().message);
  if (target->kind() != v1::Target::cuda) return badInput("loom compile needs a CUDA target such as sm_80 or sm_90a");
  GenerateOptions generate;
  generate.direction = options.backward ? Direction::backward : options.decode ? Direction::decode : Direction::forward;
  auto layout = parseCacheLayout(options.cache);
  if (!layout) return badInput(layout.error().message);
  generate.mixedCache = options.decode && *layout == CacheLayout::mixed;
  auto plan = generateKernel(*spec, *schedule, *target, generate);  // the launches the report lists
  if (!plan) return badInput(plan.error().message);
  jit::NvrtcCompiler compiler(options.cacheDir);
  std::shared_ptr<const jit::Artifact> artifact;
  auto kernel = compileKernel(*spec, *schedule, *target, compiler, &artifact, generate.direction, generate.mixedCache);
  if (!kernel) {
    std::fprintf(stderr, "%s\n", kernel.error().log.c_str());
    return badInput(kernel.error().message);
  }
  const jit::Artifact& a = *artifact;
  std::string listing;  // nvdisasm's, read once for --sass and --sass-listing
  if (options.sass || !options.sassListing.empty()) {
    if (a.binaryKind != "cubin") return badInput("--sass needs a cubin; NVRTC gives only PTX for " + a.arch);
    auto disassembled = jit::sass::disassemble(a.binary);
    if (!disassembled)
      return badInput(disassembled.error().message +
                      (disassembled.error().log.empty() ? "" : "\n" + disassembled.error().log));
    listing = std::move(*disassembled);
    if (!options.sassListing.empty()) {
      std::ofstream out(options.sassListing, std::ios::trunc);
      out << listing;
      if (!out) return badInput(options.sassListing + ": write failed");
    }
  }
  if (!options.outPath.empty()) {
    std::ofstream out(options.outPath, std::ios::binary | std::ios::trunc);
    if (!kernel->SerializeToOstream(&out)) return badInput(options.outPath + ": write failed");
  }
  if (options.json) {
    std::printf("%s\n", report(*plan, a).dump(2).c_str());
    return kExitOk;
  }
  std::printf("%s: %s %s, %.2f s%s, tensor cores %s, cp.async %s", a.arch.c_str(), jit::nvrtcVersion().c_str(),
              a.binaryKind.c_str(), a.compileSeconds, a.fromCache ? " (cached)" : "", a.usesTensorCores() ? "yes" : "no",
              a.usesAsyncCopies() ? "yes" : "no");
  if (a.usesWgmma()) std::printf(", wgmma yes, TMA %s, setmaxnreg %s", a.usesTma() ? "yes" : "no",
                                 a.usesSetmaxnreg() ? "yes" : "no");
  std::printf("\n");
  for (const std::string& warning : a.warnings()) std::printf("  %s\n", warning.c_str());
  const std::vector<std::string> losses = a.performanceLosses();
  std::printf("  performance losses: %s\n", losses.empty() ? "none (no spills, stack frame, ptxas notes, fp64 or local memory)"
                                                            : std::to_string(losses.size()).c_str());
  for (const std::string& loss : losses) std::printf("    %s\n", loss.c_str());
  for (const LaunchPlan& launch : plan->launches) {
    std::printf("  %-14s %4lld threads, %7lld B dynamic smem", launch.name.c_str(), (long long)launch.threads,
                (long long)launch.sharedMemoryBytes);
    for (const auto& r : a.resources)
      if (r.entry() == launch.name)
        std::printf(", %3d registers, %lld B spilled", r.registers(), (long long)(r.spill_store_bytes() + r.spill_load_bytes()));
    std::printf("\n");
  }
  if (options.sass) {
    std::vector<v1::ResourceUsage> entries;
    for (const LaunchPlan& launch : plan->launches)
      for (const auto& r : a.resources)
        if (r.entry() == launch.name) entries.push_back(r);
    if (!entries.empty() && !entries.front().sass_read())  // an arch not read on every compile
      jit::sass::applyListing(listing, entries);
    std::printf("SASS (nvdisasm; per warp per iteration of each tensor-core loop):\n%s",
                jit::sass::formatLoops(entries).c_str());
    const int d = spec->head_dim();
    const bool backward = kernel->direction() == v1::direction_backward;
    if (backward && a.arch == "sm_90a" && kernel->schedule().engine() == v1::engine_wgmma &&
        jit::sass::fa3BackwardPerTensorMflop(d) > 0) {
      std::printf("  gate (docs/performance.md): %.0f instructions per tensor MFLOP in the unmasked loops of %s and %s, "
                  "FlashAttention-3's backward loop at head_dim %d (one loop, its causal mask inside; masked loops "
                  "printed above)\n",
                  jit::sass::fa3BackwardPerTensorMflop(d), kBackwardKvEntry, kBackwardQEntry, d);
      std::vector<std::string> misses;
      for (const v1::ResourceUsage& u : entries)
        if (u.entry() == kBackwardKvEntry || u.entry() == kBackwardQEntry)
          for (std::string& miss : jit::sass::backwardGateMisses(u, d)) misses.push_back(std::move(miss));
      if (misses.empty()) std::printf("  within the gate\n");
      for (const std::string& miss : misses) std::printf("  misses the gate: %s\n", miss.c_str());
    }
    for (const v1::ResourceUsage& u : entries) {
      // (A backward's forward launch is on mma.sync whatever its engine.)
      if (u.entry() != kAttentionEntry || a.arch != "sm_90a" || kernel->schedule().engine() != v1::engine_wgmma ||
          backward || jit::sass::budgetPerTensorMflop(d, false) == 0)
        continue;
      std::printf("  gate (docs/performance.md): %.0f / %.0f instructions per tensor MFLOP (unmasked / masked), "
                  "FlashAttention-3's loops; this reader counts them at %.0f / %.0f\n",
                  jit::sass::budgetPerTensorMflop(d, false), jit::sass::budgetPerTensorMflop(d, true),
                  jit::sass::fa3PerTensorMflop(d, false), jit::sass::fa3PerTensorMflop(d, true));
      const std::vector<std::string> misses = jit::sass::gateMisses(u, *spec, kernel->schedule());
      if (misses.empty()) std::printf("  within the gate\n");
      for (const std::string& miss : misses) std::printf("  misses the gate: %s\n", miss.c_str());
    }
  }
  return kExitOk;
}

}  // namespace

void addCompileCommand(CLI::App& app, std::function<int()>* action) {
  auto options = std::make_shared<CompileOptions>();
  CLI::App* cmd = app.add_subcommand(
      "compile", "Generate and compile a spec's CUDA program with NVRTC (no GPU needed) and report registers,\n"
                 "spills, stack frames, shared memory, tensor-core and cp.async use, the compile time, and every\n"
                 "performance loss ptxas and the PTX show: spills, stack frames, ptxas's C7xxx notes (serialised\n"
                 "wgmma, ...), fp64 instructions, local memory.");
  cmd->add_option("--spec", options->specPath, "KernelSpec JSON file")->required();
  cmd->add_option("--schedule", options->schedulePath, "Schedule JSON file (unset fields take defaults)");
  cmd->add_option("--target", options->target, "CUDA arch: sm_80, sm_86, sm_89, sm_90, sm_90a")->capture_default_str();
  cmd->add_option("--dtype", options->dtype, "override the spec's dtype (float16 or bfloat16)");
  cmd->add_option("--cache-dir", options->cacheDir, "keep compiled artifacts here (default: none)");
  cmd->add_option("--out", options->outPath, "write the CompiledKernel (plan + binary) as binary protobuf");
  cmd->add_flag("--json", options->json, "print the report as JSON");
  cmd->add_flag("--sass", options->sass,
                "read the machine code (nvdisasm): per entry, each tensor-core loop's instructions per warp per\n"
                "iteration by class, per tensor MFLOP, the exponentials between the wait for S and the wait for\n"
                "P V, named barriers (ping-pong), registers and setmaxnreg; sm_90a attention loops are checked\n"
                "against the SASS budget (docs/performance.md). --json always carries these figures");
  cmd->add_option("--sass-listing", options->sassListing, "write nvdisasm's listing of the cubin to this file");
  cmd->add_flag("--backward", options->backward,
                "compile the backward plan (every gradient of sum(out * dout); Kernel::launchBackward) instead");
  cmd->add_flag("--decode", options->decode,
                "compile the decode step over a paged cache (docs/IHA.md, Decode; Kernel::launchDecode) instead")
      ->excludes("--backward");
  cmd->add_option("--cache", options->cache,
                  "with --decode, the cache's layout: raw (k, v [pages, page_size, G, d]) or mixed (the mixed,\n"
                  "rotated pseudo-keys and values [pages, page_size, G, P, d])")
      ->check(CLI::IsMember({"raw", "mixed"}))
      ->capture_default_str();
  cmd->callback([options, action] { *action = [options] { return compile(*options); }; });
}

}  // namespace loom::cli
