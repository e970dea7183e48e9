// loom run: compute IHA for a case folder with one backend, write the output,
// and check it against expected.npy when the case has one.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <memory>
#include <string>

#include "api/compile.h"
#include "commands.h"
#include "cpu/cpu_backend.h"
#include "cuda/case_runner.h"
#include "emu/emulator.h"
#include "loom/runtime.h"
#include "io/case.h"
#include "jit/nvrtc_compiler.h"
#include "loom/cache_dir.h"
#include "io/decode_case.h"
#include "loom/decode.h"
#include "reference/iha_backward.h"
#include "reference/iha_decode.h"
#include "reference/iha_reference.h"

namespace loom::cli {
namespace {

struct RunOptions {
  std::string caseDir;
  std::string backend = "reference";
  std::string out = "out.npy";
  std::string outDtype = "float32";
  std::string schedulePath;
  std::string cacheDir;
  std::string dtype;
  int threads = 0;
  int device = 0;
  std::string target = "sm_80";  // --backend emu
  int64_t ctas = 0;
  uint64_t seed = 1;
  bool backward = false;
  std::string gradOut;
  int64_t decode = 0;  // T new tokens; 0: the forward
  std::vector<int64_t> ragged;  // a ragged step: each sequence's new tokens
  int64_t sharedPages = 0;  // with decode: pages every sequence shares (a shared prompt)
  int64_t pageSize = 16;
  std::string cacheLayout = "raw";
};

// "compiled in 1.23 s" or "from the cache": where the host program came from.
std::string compiledText(const cpu::CpuRunStats& stats) {
  return stats.compiled ? "compiled in " + std::to_string(stats.compileSeconds).substr(0, 4) + " s" : "from the cache";
}

// A backend's failure: its tool log (a compiler's) on stderr, then the message.
int failed(const Error& error) {
  if (!error.log.empty()) std::fprintf(stderr, "%s\n", error.log.c_str());
  return badInput(error.message);
}

// A kernel the runtime on --device provides (`get`, given the runtime and
// the --schedule), with that device opened to run it; prints what was loaded
// ("cuda backward: NVIDIA H200 (sm_90a); schedule ...; toolchain; provenance").
struct CudaKernel {
  std::shared_ptr<Kernel> kernel;
  std::shared_ptr<cuda::Device> device;
};
template <class Get>
Result<CudaKernel> loadOnCuda(const RunOptions& options, const char* label, Get get) {
  auto schedule = readScheduleFile(options.schedulePath);
  if (!schedule) return schedule.error();
  auto runtime = Runtime::create({options.device, options.cacheDir});
  if (!runtime) return runtime.error();
  Result<std::shared_ptr<Kernel>> kernel = get(**runtime, *schedule);
  if (!kernel) return kernel.error();
  const v1::CompiledKernel& compiled = (*kernel)->compiled();
  std::printf("%s: %s (%s); schedule %s; %s; %s\n", label, (*runtime)->device().name.c_str(),
              (*runtime)->device().arch().c_str(), compiled.schedule().ShortDebugString().c_str(),
              compiled.toolchain().c_str(), (*kernel)->provenance().c_str());
  auto device = cuda::Device::open(options.device);
  if (!device) return device.error();
  return CudaKernel{std::move(*kernel), std::move(*device)};
}

// The generated program through NVRTC on the GPU.
Result<std::vector<double>> runOnCuda(const RunOptions& options, const IhaCase& c) {
  auto loaded = loadOnCuda(options, "cuda", [&](Runtime& r, const Schedule& s) { return r.kernel(c.spec, s); });
  if (!loaded) return loaded.error();
  auto run = cuda::runCase(*loaded->kernel, *loaded->device, c);
  if (!run) return run.error();
  return std::move(run->out);
}

// The generated backward through NVRTC on the GPU.
Result<reference::IhaGradients> runBackwardOnCuda(const RunOptions& options, const IhaCase& c) {
  auto loaded =
      loadOnCuda(options, "cuda backward", [&](Runtime& r, const Schedule& s) { return r.backwardKernel(c.spec, s); });
  if (!loaded) return loaded.error();
  return cuda::runBackwardCase(*loaded->kernel, *loaded->device, c);
}

// The generated decode step through NVRTC on the GPU, over a cache of `layout`.
Result<cuda::DeviceDecodeRun> runDecodeOnCuda(const RunOptions& options, const DecodeCase& step) {
  auto loaded = loadOnCuda(options, "cuda decode", [&](Runtime& r, const Schedule& s) {
    return r.decodeKernel(step.spec, step.layout, s);
  });
  if (!loaded) return loaded.error();
  return cuda::runDecodeCase(*loaded->kernel, *loaded->device, step);
}

// The generated program, compiled for the host and run CTA by CTA.
Result<std::vector<double>> runOnCpu(const RunOptions& options, const IhaCase& c) {
  auto schedule = readScheduleFile(options.schedulePath);
  if (!schedule) return schedule.error();
  auto target = parseTarget("cpu");
  auto plan = generateKernel(c.spec, *schedule, *target);
  if (!plan) return plan.error();
  auto outputs = cpu::runPlan(*plan, c, {options.cacheDir, options.threads});
  if (!outputs) return outputs.error();
  const cpu::CpuRunStats& stats = outputs->stats;
  std::printf("cpu: schedule %s; %s; %lld key blocks visited, %lld masked\n", plan->schedule.ShortDebugString().c_str(),
              compiledText(stats).c_str(),
              (long long)stats.keyBlocks, (long long)stats.maskedBlocks);
  return std::move(outputs->out);
}

// The CUDA program on the emulator: its output, and its findings.
Result<emu::EmuRun> runOnEmulator(const RunOptions& options, const IhaCase& c,
                                  Direction direction = Direction::forward) {
  auto schedule = readScheduleFile(options.schedulePath);
  if (!schedule) return schedule.error();
  auto target = parseTarget(options.target);
  if (!target) return target.error();
  if (target->kind() != v1::Target::cuda) return makeError("--target must be a CUDA arch (sm_80 .. sm_90a) with --backend emu");
  GenerateOptions generate;
  generate.direction = direction;
  auto plan = generateKernel(c.spec, *schedule, *target, generate);
  if (!plan) return plan.error();
  emu::EmuOptions emuOptions;
  emuOptions.cacheDir = options.cacheDir;
  emuOptions.threads = options.threads;
  emuOptions.seed = options.seed;
  emuOptions.maxCtas = options.ctas;
  // setmaxnreg starts from what ptxas allocated: ask NVRTC (no GPU needed).
  if (std::any_of(plan->launches.begin(), plan->launches.end(), [](const LaunchPlan& l) { return l.warpSpecialized; })) {
    jit::NvrtcCompiler compiler(options.cacheDir.empty() ? defaultCacheDir() : options.cacheDir);
    auto compiled = compileKernel(c.spec, plan->schedule, *target, compiler);
    if (!compiled) return compiled.error();
    for (const v1::ResourceUsage& usage : compiled->resources()) emuOptions.registers[usage.entry()] = usage.registers();
  }
  auto run = emu::runOnEmulator(*plan, c, emuOptions);
  if (!run) return run.error();
  std::printf("emu: %s, schedule %s\n%s\n", options.target.c_str(), plan->schedule.ShortDebugString().c_str(),
              emu::summary(*run).c_str());
  return run;
}

// The generated backward, compiled for the host and run CTA by CTA.
Result<reference::IhaGradients> runBackwardOnCpu(const RunOptions& options, const IhaCase& c) {
  auto schedule = readScheduleFile(options.schedulePath);
  if (!schedule) return schedule.error();
  auto target = parseTarget("cpu");
  GenerateOptions generate;
  generate.direction = Direction::backward;
  auto plan = generateKernel(c.spec, *schedule, *target, generate);
  if (!plan) return plan.error();
  auto outputs = cpu::runBackwardPlan(*plan, c, {options.cacheDir, options.threads});
  if (!outputs) return outputs.error();
  const cpu::CpuRunStats& stats = outputs->stats;
  std::printf("cpu backward: schedule %s; %s; %lld (query block, key block) pairs, %lld masked\n",
              plan->schedule.ShortDebugString().c_str(),
              compiledText(stats).c_str(),
              (long long)stats.keyBlocks, (long long)stats.maskedBlocks);
  return std::move(outputs->gradients);
}

const std::map<std::string, NpyType> kOutTypes = {
    {"float32", NpyType::float32}, {"float64", NpyType::float64},
    {"float16", NpyType::float16}, {"bfloat16", NpyType::uint16}};

// --backward: every gradient of sum(out * dout) from the backend, written to
// --grad-out and compared with the case's expected_<name>.npy.
int runBackward(const RunOptions& options, const IhaCase& c) {
  if (!c.dout) return badInput(options.caseDir + "/dout.npy: missing (--backward needs the gradient of the output)");
  reference::IhaGradients gradients;
  NpyType fileType = NpyType::float64;
  bool clean = true;  // no emulator findings
  if (options.backend == "cpu") {
    auto result = runBackwardOnCpu(options, c);
    if (!result) return failed(result.error());
    gradients = std::move(*result);
    fileType = NpyType::float32;
  } else if (options.backend == "cuda") {
    auto result = runBackwardOnCuda(options, c);
    if (!result) return failed(result.error());
    gradients = std::move(*result);
    fileType = NpyType::float32;
  } else if (options.backend == "emu") {
    auto result = runOnEmulator(options, c, Direction::backward);
    if (!result) return failed(result.error());
    gradients = std::move(*result->gradients);
    fileType = NpyType::float32;
    clean = result->findingCount == 0 && !result->deadlocked;
    if (!clean) std::printf("emulator findings: %lld: FAILED\n", (long long)result->findingCount);
  } else {
    gradients = reference::ihaBackward(c.spec, c.inputs, *c.dout);
  }
  const std::vector<std::vector<int64_t>> shapes = inputShapes(c.spec, c.batch, c.tokens);
  const auto got = reference::gradientsOf(gradients);
  if (!options.gradOut.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(options.gradOut, ec);
    if (ec) return badInput(options.gradOut + ": cannot create folder: " + ec.message());
    for (size_t i = 0; i < got.size(); ++i) {
      const std::string path = options.gradOut + "/" + reference::kGradientNames[i] + ".npy";
      if (Status written = writeNpy(path, npyFromDouble(*got[i], shapes[i], fileType)); !written)
        return badInput(written.error().message);
    }
    std::printf("wrote %zu gradients (%s) to %s\n", got.size(), fileType == NpyType::float64 ? "float64" : "float32",
                options.gradOut.c_str());
  }
  if (!c.expectedGradients) {
    std::printf("no expected gradients in %s: nothing to compare\n", options.caseDir.c_str());
    return clean ? kExitOk : kExitCheckFailed;
  }
  const std::vector<double> errors = gradientErrors(c.spec, c.tokens, gradients, *c.expectedGradients, c.inputs.cu_seqlens);
  const double tolerance = gradientToleranceFor(c.spec.dtype());
  bool pass = true;
  for (size_t i = 0; i < got.size(); ++i) {
    const double error = errors[i];
    const bool ok = error <= tolerance;  // false for NaN
    pass = pass && ok;
    std::printf("%-9s relative error %.3e (tolerance %.0e for %s): %s\n", reference::kGradientNames[i], error,
                tolerance, dtypeName(c.spec.dtype()).c_str(), ok ? "ok" : "FAILED");
  }
  return pass && clean ? kExitOk : kExitCheckFailed;
}

// --decode T: tokens 0 .. N-T-1 of each sequence into a paged cache with a
// shuffled page table, one step over the last T, compared with the forward's
// rows at those tokens.
int runDecode(const RunOptions& options, const IhaCase& given) {
  auto layout = parseCacheLayout(options.cacheLayout);
  if (!layout) return badInput("--cache: " + layout.error().message);
  DecodeLayout decodeLayout;
  decodeLayout.newTokens = options.decode;
  decodeLayout.newTokensOf = options.ragged;
  decodeLayout.pageSize = options.pageSize;
  decodeLayout.layout = *layout;
  decodeLayout.seed = options.seed;
  decodeLayout.sharedPages = options.sharedPages;
  // --shared-pages: sequence 0's prompt in every sequence, in one copy of its pages.
  IhaCase c = given;
  if (options.sharedPages > 0) {
    auto shared = withSharedPrefix(given, options.sharedPages * options.pageSize);
    if (!shared) return badInput("--shared-pages " + std::to_string(options.sharedPages) + ": " + shared.error().message);
    c = std::move(*shared);
    std::printf("shared prefix: sequence 0's first %lld tokens in every sequence, in %lld pages every page table "
                "names; the forward's rows computed again from them\n",
                (long long)(options.sharedPages * options.pageSize), (long long)options.sharedPages);
  }
  auto built = decodeCaseFrom(c, decodeLayout);
  if (!built) return badInput(built.error().message);
  DecodeCase& dc = *built;
  if (Status ok = validateDecode(dc.shape, dc.cache.pageTable, dc.cache.cacheLen, dc.step.query_start_loc); !ok)
    return badInput(ok.error().message);
  const bool ragged = !options.ragged.empty();
  const int64_t total = ragged ? dc.step.query_start_loc.back() : c.batch * options.decode;
  if (ragged) {
    std::string counts;
    for (int64_t b = 0; b < c.batch; ++b)
      counts += (b ? ", " : "") + std::to_string(dc.cache.cacheLen[size_t(b)]) + " + " +
                std::to_string(options.ragged[size_t(b)]);
    std::printf("ragged decode: cached + new tokens of each sequence %s (%lld packed, query_start_loc", counts.c_str(),
                (long long)total);
    for (int32_t start : dc.step.query_start_loc) std::printf(" %d", start);
    std::printf("); %lld pages of %lld tokens, shuffled (seed %llu); %s cache\n", (long long)dc.shape.numPages,
                (long long)dc.shape.pageSize, (unsigned long long)options.seed, cacheLayoutName(*layout));
  } else {
    std::printf("decode: %lld cached + %lld new tokens per sequence, %lld sequences; %lld pages of %lld tokens, "
                "shuffled (seed %llu); %s cache\n",
                (long long)(c.tokens - options.decode), (long long)options.decode, (long long)c.batch,
                (long long)dc.shape.numPages, (long long)dc.shape.pageSize, (unsigned long long)options.seed,
                cacheLayoutName(*layout));
  }
  for (CacheLayout l : {CacheLayout::raw, CacheLayout::mixed}) {
    const int64_t perToken = cacheBytesPerToken(c.spec, l);
    std::printf("cache %-5s %6lld bytes per token per layer, %lld bytes for the %lld tokens\n", cacheLayoutName(l),
                (long long)perToken, (long long)(perToken * c.batch * c.tokens), (long long)(c.batch * c.tokens));
  }
  // The decode plan of the case's spec, --schedule and layout for `target`.
  auto decodePlan = [&](const v1::Target& target) -> Result<KernelPlan> {
    auto schedule = readScheduleFile(options.schedulePath);
    if (!schedule) return schedule.error();
    GenerateOptions generate;
    generate.direction = Direction::decode;
    generate.mixedCache = *layout == CacheLayout::mixed;
    return generateKernel(c.spec, *schedule, target, generate);
  };
  std::vector<double> out;
  std::optional<reference::PagedCache> appended;  // a backend's cache after the step
  bool clean = true;  // no emulator findings
  if (options.backend == "emu") {
    auto target = parseTarget(options.target);
    if (!target) return badInput(target.error().message);
    if (target->kind() != v1::Target::cuda) return badInput("--target must be a CUDA arch (sm_80 .. sm_90a) with --backend emu");
    auto plan = decodePlan(*target);
    if (!plan) return badInput(plan.error().message);
    emu::EmuOptions emuOptions;
    emuOptions.cacheDir = options.cacheDir;
    emuOptions.threads = options.threads;
    emuOptions.seed = options.seed;
    auto run = emu::runDecodeOnEmulator(*plan, dc, emuOptions);
    if (!run) return badInput(run.error().message);
    std::printf("emu decode: %s, schedule %s\n%s\n", options.target.c_str(), plan->schedule.ShortDebugString().c_str(),
                emu::summary(*run).c_str());
    clean = run->findingCount == 0 && !run->deadlocked;
    if (!clean) std::printf("emulator findings: %lld: FAILED\n", (long long)run->findingCount);
    out = std::move(run->out);
    appended = std::move(run->cache);
  } else if (options.backend == "cuda") {
    auto run = runDecodeOnCuda(options, dc);
    if (!run) return failed(run.error());
    out = std::move(run->out);
    appended = std::move(run->cache);
  } else if (options.backend == "cpu") {
    auto plan = decodePlan(*parseTarget("cpu"));
    if (!plan) return badInput(plan.error().message);
    auto run = cpu::runDecodePlan(*plan, dc, {options.cacheDir, options.threads});
    if (!run) return failed(run.error());
    const cpu::CpuRunStats& stats = run->stats;
    std::printf("cpu decode: schedule %s; %s; %lld key blocks visited, %lld masked\n",
                plan->schedule.ShortDebugString().c_str(),
                compiledText(stats).c_str(),
                (long long)stats.keyBlocks, (long long)stats.maskedBlocks);
    out = std::move(run->out);
    appended = std::move(run->cache);
  } else {
    out = reference::ihaDecode(c.spec, dc.step, dc.cache).out;
  }
  const std::vector<int64_t> shape = ragged ? std::vector<int64_t>{total, c.spec.heads(), c.spec.head_dim()}
                                            : std::vector<int64_t>{c.batch, options.decode, c.spec.heads(),
                                                                   c.spec.head_dim()};
  if (Status written = writeNpy(options.out, npyFromDouble(out, shape, kOutTypes.at(options.outDtype))); !written)
    return badInput(written.error().message);
  std::printf("wrote %s %s (%s)\n", options.out.c_str(), shapeString(shape).c_str(), options.outDtype.c_str());
  const double error = relativeError(out, dc.expected);
  const double tolerance = toleranceFor(c.spec.dtype());
  const bool pass = error <= tolerance;  // false for NaN
  std::printf("relative error %.3e against the forward's rows of %s (tolerance %.0e for %s): %s\n", error,
              ragged ? "each sequence's new tokens" : ("the last " + std::to_string(options.decode) + " tokens").c_str(),
              tolerance, dtypeName(c.spec.dtype()).c_str(), pass ? "ok" : "FAILED");
  bool appendOk = true;
  if (appended) {  // the reference's own append is what the check compares with
    const AppendCheck check = checkAppend(dc, *appended);
    appendOk = check.wrongElements == 0 && check.mixedError <= tolerance;
    if (*layout == CacheLayout::raw)
      std::printf("append: %lld cache elements differ from the new tokens' k and v at their slots and the rest "
                  "as it was: %s\n",
                  (long long)check.wrongElements, appendOk ? "ok" : "FAILED");
    else
      std::printf("append: mixed rows' relative error %.3e (tolerance %.0e), %lld elements finite where no token "
                  "is or NaN where one is: %s\n",
                  check.mixedError, tolerance, (long long)check.wrongElements, appendOk ? "ok" : "FAILED");
  }
  return pass && appendOk && clean ? kExitOk : kExitCheckFailed;
}

int run(const RunOptions& options) {
  auto loaded = loadCase(options.caseDir);
  if (!loaded) return badInput(loaded.error().message);
  if (!options.dtype.empty()) {
    KernelSpec converted = loaded->spec;
    if (Status ok = overrideDtype(converted, options.dtype); !ok) return badInput(ok.error().message);
    *loaded = withDtype(*loaded, converted.dtype());
    std::printf("inputs rounded to %s; expected recomputed by the float64 reference\n", options.dtype.c_str());
  }
  const IhaCase& c = *loaded;
  const bool stepping = options.decode > 0 || !options.ragged.empty();
  if (options.decode > 0 && !options.ragged.empty()) return badInput("--decode and --ragged: choose one");
  if (options.backward && stepping) return badInput("--backward and a decode step: choose one");
  if (options.sharedPages > 0 && !stepping)
    return badInput("--shared-pages " + std::to_string(options.sharedPages) +
                    ": a decode step's (give --decode T or --ragged)");
  if (!options.ragged.empty() && int64_t(options.ragged.size()) != c.batch)
    return badInput("--ragged: " + std::to_string(options.ragged.size()) + " counts for the case's " +
                    std::to_string(c.batch) + " sequences (one each)");
  if (options.backward) return runBackward(options, c);
  if (stepping) return runDecode(options, c);

  std::vector<double> out;
  std::optional<emu::EmuRun> emulated;
  if (options.backend == "reference") {
    out = reference::ihaForward(c.spec, c.inputs).out;
  } else if (options.backend == "cpu") {
    auto result = runOnCpu(options, c);
    if (!result) return failed(result.error());
    out = std::move(*result);
  } else if (options.backend == "cuda") {
    auto result = runOnCuda(options, c);
    if (!result) return failed(result.error());
    out = std::move(*result);
  } else if (options.backend == "emu") {
    auto result = runOnEmulator(options, c);
    if (!result) return failed(result.error());
    emulated = std::move(*result);
    out = emulated->out;
  } else {
    return badInput("backend '" + options.backend + "' is not available in this build");
  }

  const std::vector<int64_t> shape = {c.batch, c.tokens, c.spec.heads(), c.spec.head_dim()};
  if (Status written = writeNpy(options.out, npyFromDouble(out, shape, kOutTypes.at(options.outDtype))); !written)
    return badInput(written.error().message);
  std::printf("wrote %s %s (%s)\n", options.out.c_str(), shapeString(shape).c_str(), options.outDtype.c_str());

  const bool clean = !emulated || (emulated->findingCount == 0 && !emulated->deadlocked);
  if (!clean) std::printf("emulator findings: %lld: FAILED\n", (long long)emulated->findingCount);
  if (!c.expected) {
    std::printf("no expected.npy in %s: nothing to compare\n", options.caseDir.c_str());
    return clean ? kExitOk : kExitCheckFailed;
  }
  const bool partial = emulated && std::count(emulated->covered.begin(), emulated->covered.end(), false) > 0;
  const double error = emulated ? emu::coveredRelativeError(*emulated, *c.expected, c.batch, c.tokens,
                                                            c.spec.heads(), c.spec.head_dim())
                                : relativeError(out, *c.expected);
  const double tolerance = toleranceFor(c.spec.dtype());
  const bool pass = error <= tolerance;  // false for NaN
  std::printf("relative error %.3e%s (tolerance %.0e for %s): %s\n", error,
              partial ? " over the emulated query blocks' tokens" : "", tolerance, dtypeName(c.spec.dtype()).c_str(),
              pass ? "ok" : "FAILED");
  return pass && clean ? kExitOk : kExitCheckFailed;
}

}  // namespace

void addRunCommand(CLI::App& app, std::function<int()>* action) {
  auto options = std::make_shared<RunOptions>();
  CLI::App* cmd = app.add_subcommand(
      "run",
      "Compute IHA for a case folder (spec.json + q, k, v, alpha_*, collapse .npy) and write the output.\n"
      "When the folder has expected.npy, print the relative error; exit 1 if it is over the dtype's\n"
      "tolerance (float32 1e-5, float16 2e-3, bfloat16 1e-2). Bad input exits 2.");
  cmd->add_option("--case", options->caseDir, "case folder")->required();
  cmd->add_option("--backend", options->backend,
                  "reference: the float64 oracle; cpu: the generated program on the host tile API;\n"
                  "cuda: the generated program through NVRTC on the GPU;\n"
                  "emu: the CUDA program (--target) on loom's emulator, which checks it for races,\n"
                  "out-of-bounds and misaligned accesses, async results read early, deadlocks; any\n"
                  "finding fails the run")
      ->check(CLI::IsMember({"reference", "cpu", "cuda", "emu"}))
      ->capture_default_str();
  cmd->add_option("--target", options->target, "CUDA arch the emulator runs (emu): sm_80, sm_86, sm_89, sm_90, sm_90a")
      ->capture_default_str();
  cmd->add_option("--ctas", options->ctas,
                  "emulate at most this many CTAs of the attention launch, as whole query blocks (emu; 0: all);\n"
                  "the check then covers their tokens")
      ->capture_default_str();
  cmd->add_option("--seed", options->seed, "the emulator's seed: shared window base, when async copies land (emu); with --decode, the\n"
                  "page table's shuffle")
      ->capture_default_str();
  cmd->add_option("--out", options->out, "output .npy file")->capture_default_str();
  cmd->add_option("--out-dtype", options->outDtype, "element type of the output file")
      ->check(CLI::IsMember({"float32", "float64", "float16", "bfloat16"}))
      ->capture_default_str();
  cmd->add_option("--schedule", options->schedulePath, "Schedule JSON for generated backends (unset fields: defaults)");
  cmd->add_option("--cache-dir", options->cacheDir, "where compiled programs are kept (default $LOOM_CACHE_DIR or ~/.cache/loom)");
  cmd->add_option("--threads", options->threads, "CPU threads running CTAs (0: all)")->capture_default_str();
  cmd->add_option("--dtype", options->dtype,
                  "round the inputs to float16 or bfloat16 first (the CUDA backend needs 16-bit inputs);\n"
                  "expected.npy is then recomputed by the reference");
  cmd->add_option("--device", options->device, "CUDA device ordinal")->capture_default_str();
  cmd->add_flag("--backward", options->backward,
                "compute the gradients of sum(out * dout) instead (DIR/dout.npy; docs/IHA.md, Backward): dq, dk,\n"
                "dv, dalpha_q, dalpha_k, dalpha_v, dcollapse, each compared with DIR/expected_<name>.npy when\n"
                "present (tolerance float32 1e-5, float16 5e-3, bfloat16 3e-2; a gradient the function makes vanish\n"
                "but for qk_norm's epsilon is measured against all of them); every backend (reference: float64\n"
                "files; the generated backward: float32 files)");
  cmd->add_option("--grad-out", options->gradOut, "with --backward: folder to write <name>.npy of every gradient to");
  cmd->add_option("--decode", options->decode,
                  "decode the case's last T tokens over a paged cache of the earlier ones (docs/IHA.md, Decode):\n"
                  "the cache gets tokens 0 .. N-T-1 under a shuffled page table (--seed), one step appends\n"
                  "and attends the last T, and out [B, T, H, d] is compared with the forward's rows there (and a\n"
                  "backend's cache after the step with the reference's append: a raw one exactly, a mixed one within\n"
                  "the tolerance); prints the cache bytes of both layouts. Backends: reference, cpu (the generated\n"
                  "decode step), emu (its CUDA program for --target on the emulator), cuda (the runtime's decode\n"
                  "kernel on --device, out poisoned first)")
      ->check(CLI::Range(int64_t(1), std::numeric_limits<int64_t>::max()));
  cmd->add_option("--ragged", options->ragged,
                  "a ragged step (docs/IHA.md, Ragged steps): sequence b of the case brings the b-th count of its\n"
                  "last tokens (0 allowed; comma-separated, one a sequence), packed one sequence after another\n"
                  "under query_start_loc; out [total, H, d] is compared with each sequence's forward rows. The other\n"
                  "--decode options apply")
      ->delimiter(',')
      ->check(CLI::Range(int64_t(0), std::numeric_limits<int64_t>::max()));
  cmd->add_option("--shared-pages", options->sharedPages,
                  "with --decode: the sequences share their first K pages (prefix caching: sequence 0's first\n"
                  "K x page-size tokens copied into every sequence, one copy of their pages in every page table,\n"
                  "each sequence's own tokens after them; the forward's rows computed again)")
      ->check(CLI::Range(int64_t(0), std::numeric_limits<int64_t>::max()));
  cmd->add_option("--page-size", options->pageSize, "with --decode: tokens per cache page")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 20))
      ->capture_default_str();
  cmd->add_option("--cache", options->cacheLayout,
                  "with --decode: raw (k and v as projected, G*d per token, mixed and rotated on the fly) or\n"
                  "mixed (pseudo-keys and values, G*P*d per token)")
      ->check(CLI::IsMember({"raw", "mixed"}))
      ->capture_default_str();
  cmd->callback([options, action] { *action = [options] { return run(*options); }; });
}

}  // namespace loom::cli
