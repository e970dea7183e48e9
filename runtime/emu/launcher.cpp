// Runs a plan's CUDA program on the emulator: compile it for the host with
// the emulation layer (loom/tile/emu.h) and clang's load/store hooks, lay
// the launch's buffers out between red zones, encode the tensor maps with
// the emulated driver call, and run every launch's grid CTA by CTA (CTAs on
// a few OS threads, each CTA's threads as fibers).
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>

#include "loom/counters.h"
#include "cpu/cpu_backend.h"
#include "cpu/host_program.h"
#include "cuda/driver.h"
#include "emu/emulator.h"
#include "emu/instructions.h"
#include "emu/tensor_map.h"
#include "loom/cache_dir.h"

namespace loom::emu {
namespace fs = std::filesystem;
namespace {

// -O1 compiles quickly and keeps every memory access the source makes; -g
// gives findings their source lines; -fno-builtin keeps loops from turning
// into memcpy / memset calls the hooks would not see.
constexpr const char* kEmuFlags =
    "-std=c++17 -O1 -g -fPIC -shared -w -fno-builtin -fno-omit-frame-pointer "
    "-fsanitize-coverage=func,trace-loads,trace-stores -DLOOM_EMULATED -include loom/tile/emu.h";

using Kernel = void (*)(IhaArgs);
// A kernel that takes tensor maps is called through its trampoline
// (withTrampolines), by pointers.
using MappedKernel = void (*)(const IhaArgs*, const cuda::TmaMaps*);
using BindFn = void (*)(const Api*);
using SetThreadFn = void (*)(const ThreadInfo*);
using VersionFn = uint32_t (*)();

std::string trampolineName(const std::string& entry) { return "loom_emu_call_" + entry; }

uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The program with a trampoline for each launch that takes its TmaMaps
// (alignas(64)) by value: the launcher (gcc) and the program (clang) may
// place such an argument at different stack offsets when the caller's frame
// is not 64-byte aligned (it held only while IhaArgs was 384 bytes), so the
// launcher passes pointers and the program's own code makes the call.
std::string withTrampolines(std::string source, const KernelPlan& plan) {
  for (const LaunchPlan& launch : plan.launches)
    if (launch.tensorMaps)
      source += "\nextern \"C\" void " + trampolineName(launch.name) +
                "(const loom::IhaArgs* args, const loom::TmaMaps* maps) { " + launch.name + "(*args, *maps); }\n";
  return source;
}

Status compilerPresent(const std::string& compiler) {
  const std::string probe = "command -v '" + compiler + "' > /dev/null 2>&1";
  if (std::system(probe.c_str()) == 0) return Status::success();
  return makeError("the emulator compiles device code with clang: '" + compiler +
                   "' was not found (apt-get install clang-19, or set LOOM_EMU_CXX to a clang++ of version 14 or "
                   "later)");
}

// The query blocks of the attention launch to emulate: all, or `wanted`
// spread from the first to the last.
std::vector<int64_t> chosenBlocks(int64_t gridX, int64_t ctasPerBlock, int64_t maxCtas) {
  std::vector<int64_t> blocks;
  const int64_t wanted = maxCtas > 0 ? std::max<int64_t>(1, maxCtas / std::max<int64_t>(ctasPerBlock, 1)) : gridX;
  if (wanted >= gridX) {
    for (int64_t x = 0; x < gridX; ++x) blocks.push_back(x);
    return blocks;
  }
  for (int64_t i = 0; i < wanted; ++i)
    blocks.push_back(wanted == 1 ? gridX - 1 : i * (gridX - 1) / (wanted - 1));
  blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
  return blocks;
}

}  // namespace

Result<EmuRun> runOnEmulator(const KernelPlan& plan, const IhaCase& c, const EmuOptions& options) {
  if (plan.target.kind() != v1::Target::cuda)
    return makeError("the emulator runs CUDA programs: generate the plan for an sm_XX target");
  const KernelSpec& spec = plan.spec;
  if (spec.dtype() == v1::float32)
    return makeError("the CUDA tiles take float16 or bfloat16 inputs (loom run --dtype converts a case)");
  const bool backward = plan.direction == Direction::backward;
  if (backward && !c.dout) return makeError("the backward needs dout, the gradient of the output");
  if (backward && options.maxCtas > 0)
    return makeError("the backward runs whole (its launches read each other's results everywhere): no --ctas");
  if (options.keep) {
    if (Status ok = canKeepForward(plan); !ok) return ok.error();
    if (options.maxCtas > 0) return makeError("a forward that keeps its state for the backward runs whole: no --ctas");
  }
  if (options.kept && !backward) return makeError("only a backward starts from a kept forward");
  if ((plan.direction == Direction::decode) != (options.decode != nullptr))
    return makeError("a decode plan runs on a decode step (runDecodeOnEmulator), and only a decode plan does");
  if (options.kept)
    if (Status ok = checkKeptFits(*options.kept, plan, c.batch, c.tokens); !ok) return ok.error();
  const fs::path cacheDir = options.cacheDir.empty() ? defaultCacheDir() : options.cacheDir;
  cpu::HostProgram program{withTrampolines(options.source.empty() ? plan.source : options.source, plan),
                           cpu::compilerFrom("LOOM_EMU_CXX", "clang++-19"), kEmuFlags, options.headers, "emu"};
  if (Status ok = compilerPresent(program.compiler); !ok) return ok.error();
  auto compiled = cpu::compileHostProgram(program, cacheDir);
  if (!compiled) return compiled.error();
  auto handle = cpu::loadHostProgram(compiled->object);
  if (!handle) return handle.error();
  auto bind = reinterpret_cast<BindFn>(::dlsym(*handle, "loom_emu_bind"));
  auto setThread = reinterpret_cast<SetThreadFn>(::dlsym(*handle, "loom_emu_set_thread"));
  auto version = reinterpret_cast<VersionFn>(::dlsym(*handle, "loom_emu_abi_version"));
  if (!bind || !setThread || !version)
    return makeError(compiled->object.string() + ": not built against loom/tile/emu.h");
  if (version() != kAbiVersion) return makeError(compiled->object.string() + ": built for another emulator ABI");
  bind(&api());

  EmuRun run;
  run.compiled = compiled->compiled;
  run.compileSeconds = compiled->seconds;
  const auto start = std::chrono::steady_clock::now();

  // The launch's buffers, each between red zones; outputs and workspaces
  // poisoned (0xff is NaN in every float type) so nothing unwritten passes.
  const int64_t B = c.batch, N = c.tokens, H = spec.heads(), G = spec.kv_heads(), P = spec.pseudo_heads(),
                d = spec.head_dim(), L = N * P;
  const NpyType storage = storageTypeOf(spec.dtype());
  GlobalMemory memory;
  auto tensor16 = [&](const char* name, const std::vector<double>& values) {
    const NpyArray array = npyFromDouble(values, {int64_t(values.size())}, storage);
    unsigned char* data = memory.allocate(name, array.bytes.size(), true);
    std::memcpy(data, array.bytes.data(), array.bytes.size());
    return data;
  };
  auto floats = [&](const char* name, const std::vector<double>& values) {
    auto* data = reinterpret_cast<float*>(memory.allocate(name, values.size() * sizeof(float), true));
    for (size_t i = 0; i < values.size(); ++i) data[i] = float(values[i]);
    return data;
  };
  IhaArgs args{};
  args.q = tensor16("q", c.inputs.q);
  args.k = tensor16("k", c.inputs.k);
  args.v = tensor16("v", c.inputs.v);
  args.alpha_q = floats("alpha_q", c.inputs.alpha_q);
  args.alpha_k = floats("alpha_k", c.inputs.alpha_k);
  args.alpha_v = floats("alpha_v", c.inputs.alpha_v);
  args.collapse = floats("collapse", c.inputs.collapse);
  // A ragged decode step's out packs its sequences' new tokens, [total, H, d].
  const std::vector<int32_t>& ragged = c.inputs.query_start_loc;
  const int64_t outRows = ragged.empty() ? B * N : ragged.back();
  const size_t outBytes = size_t(outRows * H * d) * 2;
  args.out = memory.allocate("out", outBytes, false, 0xff);
  args.lse = reinterpret_cast<float*>(memory.allocate("lse", size_t(B * H * L) * sizeof(float), false, 0xff));
  for (Workspace w : plan.workspaces) {
    void* data = memory.allocate(workspaceName(w),
                                 size_t(workspaceElements(plan, w, B, N)) * size_t(workspaceElementBytes(plan, w)),
                                 false, 0xff);
    if (w == Workspace::q_mixed) args.q_mixed = data;
    if (w == Workspace::k_mixed) args.k_mixed = data;
    if (w == Workspace::v_mixed) args.v_mixed = data;
    if (w == Workspace::o_pseudo) args.o_pseudo = data;
    if (w == Workspace::do_pseudo) args.do_pseudo = data;
    if (w == Workspace::delta) setRowStats(args, static_cast<float*>(data), B * H * L);
    if (w == Workspace::dq_pseudo) args.dq_pseudo = static_cast<float*>(data);
    if (w == Workspace::dk_pseudo) args.dk_pseudo = static_cast<float*>(data);
    if (w == Workspace::dv_pseudo) args.dv_pseudo = static_cast<float*>(data);
    if (w == Workspace::partials) args.partials = static_cast<float*>(data);
    if (w == Workspace::splits) args.partials = static_cast<float*>(data);  // (a decode plan's)
  }
  // The backward's dout (the dtype, out's layout) and its gradients (f32).
  auto gradient = [&](const char* name, const std::vector<double>& like) {
    return reinterpret_cast<float*>(memory.allocate(name, like.size() * sizeof(float), false, 0xff));
  };
  if (backward) {
    args.dout = tensor16("dout", *c.dout);
    args.dq = gradient("dq", c.inputs.q);
    args.dk = gradient("dk", c.inputs.k);
    args.dv = gradient("dv", c.inputs.v);
    args.dalpha_q = gradient("dalpha_q", c.inputs.alpha_q);
    args.dalpha_k = gradient("dalpha_k", c.inputs.alpha_k);
    args.dalpha_v = gradient("dalpha_v", c.inputs.alpha_v);
    args.dcollapse = gradient("dcollapse", c.inputs.collapse);
  }
  args.batch = B;
  args.tokens = N;
  cpu::setDenseStrides(args, N, H, G, d);
  if (!c.inputs.cu_seqlens.empty()) {
    const std::vector<int32_t>& bounds = c.inputs.cu_seqlens;
    void* data = memory.allocate("cu_seqlens", bounds.size() * sizeof(int32_t), true);
    std::memcpy(data, bounds.data(), bounds.size() * sizeof(int32_t));
    args.cu_seqlens = static_cast<const int32_t*>(data);
    args.documents = int64_t(bounds.size()) - 1;
  }
  if (!ragged.empty()) {
    void* data = memory.allocate("query_start_loc", ragged.size() * sizeof(int32_t), true);
    std::memcpy(data, ragged.data(), ragged.size() * sizeof(int32_t));
    args.query_start_loc = static_cast<const int32_t*>(data);
  }
  if (options.decode) {  // the step's cache: read and appended to through the page table
    const DecodeCase& step = *options.decode;
    auto cache = [&](const char* name, const std::vector<double>& values) {
      const NpyArray array = npyFromDouble(values, {int64_t(values.size())}, storage);
      unsigned char* data = memory.allocate(name, array.bytes.size(), false);
      std::memcpy(data, array.bytes.data(), array.bytes.size());
      return data;
    };
    auto ints = [&](const char* name, const std::vector<int32_t>& values) {
      auto* data = reinterpret_cast<int32_t*>(memory.allocate(name, values.size() * sizeof(int32_t), true));
      std::memcpy(data, values.data(), values.size() * sizeof(int32_t));
      return data;
    };
    args.k_cache = cache("k_cache", step.cache.k);
    args.v_cache = cache("v_cache", step.cache.v);
    args.page_table = ints("page_table", step.cache.pageTable);
    args.cache_len = ints("cache_len", step.cache.cacheLen);
    args.page_size = step.shape.pageSize;
    args.max_pages = step.shape.maxPages;
    if (options.devicePageCheck) {
      args.num_pages = step.shape.numPages;
      args.sequence_ok = reinterpret_cast<int32_t*>(memory.allocate("sequence_ok", size_t(B) * sizeof(int32_t), false, 0xff));
      args.page_errors = reinterpret_cast<int32_t*>(memory.allocate("page_errors", sizeof(int32_t), false, 0));
    }
  }
  if (options.kept) {  // the forward's rows and lse in place of the pre-mix's and the attention's
    void* const targets[] = {args.q_mixed, args.k_mixed, args.v_mixed, args.o_pseudo};
    for (size_t i = 0; i < std::size(kKeptWorkspaces); ++i) {
      const std::vector<uint8_t>& rows = options.kept->rows.at(kKeptWorkspaces[i]);
      std::memcpy(targets[i], rows.data(), rows.size());
    }
    std::memcpy(args.lse, options.kept->lse.data(), options.kept->lse.size() * sizeof(float));
  }

  cuda::TmaMaps maps{};
  const bool wantsMaps =
      std::any_of(plan.launches.begin(), plan.launches.end(), [](const LaunchPlan& l) { return l.tensorMaps; });
  if (wantsMaps) {
    auto check = [](CUresult result, const std::string& what) -> Status {
      if (result == CUDA_SUCCESS) return Status::success();
      return makeError(what + ": " + lastEncodeError());
    };
    if (Status ok = cuda::encodeWorkspaceMaps(encodeTensorMapTiled, check, toCompiledKernel(plan), args, L, B, maps);
        !ok)
      return ok.error();
  }

  FindingLog log(options.findingLimit);
  const uint32_t windowBase = uint32_t(128 * (mix(options.seed) % 8));
  const int workers =
      options.threads > 0 ? options.threads : int(std::max(1u, std::thread::hardware_concurrency()));
  run.covered.assign(size_t(N), true);
  std::mutex merge;
  for (const LaunchPlan& launch : plan.launches) {
    if (options.kept && recomputesForward(launch)) continue;
    void* symbol = ::dlsym(*handle, (launch.tensorMaps ? trampolineName(launch.name) : launch.name).c_str());
    if (!symbol) return makeError(compiled->object.string() + ": entry point " + launch.name + " missing");
    count(Counter::launches);
    const int64_t rows = N * launch.rowsPerToken;
    const int64_t gridX = (rows + launch.rowsPerCta - 1) / launch.rowsPerCta;
    const bool attention = launch.name == kAttentionEntry;
    std::vector<int64_t> blocks = attention ? chosenBlocks(gridX, launch.gridY * B, options.maxCtas)
                                            : chosenBlocks(gridX, 1, 0);
    if (attention) {
      run.attentionCtas = gridX * launch.gridY * B;
      run.attentionCtasRun = int64_t(blocks.size()) * launch.gridY * B;
      if (int64_t(blocks.size()) < gridX) {
        run.covered.assign(size_t(N), false);
        const int64_t tokensPerBlock = launch.rowsPerCta / launch.rowsPerToken;
        for (int64_t x : blocks)
          for (int64_t n = x * tokensPerBlock; n < std::min(N, (x + 1) * tokensPerBlock); ++n) run.covered[size_t(n)] = true;
      }
    }
    std::vector<Dim3> ctas;
    for (int64_t z = 0; z < B; ++z)
      for (int64_t y = 0; y < launch.gridY; ++y)
        for (int64_t x : blocks) ctas.push_back({unsigned(x), unsigned(y), unsigned(z)});
    std::atomic<size_t> next{0};
    std::atomic<bool> deadlocked{false};
    auto worker = [&] {
      for (size_t i = next++; i < ctas.size() && !deadlocked; i = next++) {
        CtaConfig config;
        config.threads = int(launch.threads);
        config.sharedBytes = launch.sharedMemoryBytes;
        config.ctasPerSm = launch.ctasPerSm;
        config.sharedWindowBase = windowBase;
        config.blockIdx = ctas[i];
        config.gridDim = {unsigned(gridX), unsigned(launch.gridY), unsigned(B)};
        config.seed = mix(options.seed ^ (uint64_t(launch.threads) << 40) ^ ((uint64_t(ctas[i].z) << 32) |
                                                                            (uint64_t(ctas[i].y) << 20) | ctas[i].x));
        config.global = &memory;
        config.findings = &log;
        if (auto found = options.registers.find(launch.name); found != options.registers.end())
          config.registersPerThread = found->second;
        config.setThread = setThread;
        Cta cta(config);
        if (launch.tensorMaps) {
          auto kernel = reinterpret_cast<MappedKernel>(symbol);
          cta.run([&] { kernel(&args, &maps); });
        } else {
          auto kernel = reinterpret_cast<Kernel>(symbol);
          cta.run([&] { kernel(args); });
        }
        std::lock_guard lock(merge);
        run.coverage.add(cta.coverage());
        if (cta.deadlocked()) deadlocked = true;
      }
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < std::min<int>(workers, int(ctas.size())); ++t) pool.emplace_back(worker);
    worker();
    for (std::thread& t : pool) t.join();
    if (deadlocked) {
      run.deadlocked = true;
      break;  // what follows would read what the stuck launch never wrote
    }
  }
  run.runSeconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  log.symbolize();
  run.findings = log.findings();
  run.findingCount = log.total();

  NpyArray out;
  out.type = storage;
  out.shape = {outRows, H, d};
  out.bytes.assign(static_cast<const uint8_t*>(args.out), static_cast<const uint8_t*>(args.out) + outBytes);
  run.out = npyToDouble(out, spec.dtype() == v1::bfloat16);
  run.lse.assign(args.lse, args.lse + B * H * L);
  if (args.sequence_ok) {
    run.pageErrors = *args.page_errors;
    run.sequenceOk.assign(args.sequence_ok, args.sequence_ok + B);
  }
  if (options.keep) {
    const void* const sources[] = {args.q_mixed, args.k_mixed, args.v_mixed, args.o_pseudo};
    for (size_t i = 0; i < std::size(kKeptWorkspaces); ++i) {
      const Workspace w = kKeptWorkspaces[i];
      const auto* bytes = static_cast<const uint8_t*>(sources[i]);
      options.keep->rows[w].assign(
          bytes, bytes + size_t(workspaceElements(plan, w, B, N)) * size_t(workspaceElementBytes(plan, w)));
    }
    options.keep->lse.assign(args.lse, args.lse + B * H * L);
  }
  if (options.decode) {
    reference::PagedCache after = options.decode->cache;
    for (auto [target, source] : {std::pair{&after.k, args.k_cache}, {&after.v, args.v_cache}}) {
      NpyArray bytes;
      bytes.type = storage;
      bytes.shape = {int64_t(target->size())};
      const auto* begin = static_cast<const uint8_t*>(source);
      bytes.bytes.assign(begin, begin + target->size() * NpyArray::elementSize(storage));
      *target = npyToDouble(bytes, spec.dtype() == v1::bfloat16);
    }
    run.cache = std::move(after);
  }
  if (backward) {
    auto widen = [](const float* values, const std::vector<double>& like) {
      return std::vector<double>(values, values + like.size());
    };
    run.gradients = reference::IhaGradients{
        widen(args.dq, c.inputs.q),           widen(args.dk, c.inputs.k),           widen(args.dv, c.inputs.v),
        widen(args.dalpha_q, c.inputs.alpha_q), widen(args.dalpha_k, c.inputs.alpha_k),
        widen(args.dalpha_v, c.inputs.alpha_v), widen(args.dcollapse, c.inputs.collapse)};
  }
  return run;
}

Result<EmuRun> runDecodeOnEmulator(const KernelPlan& plan, const DecodeCase& step, const EmuOptions& options) {
  // With the device's check the entries are the device's to check.
  if (Status ok = cpu::checkDecodeStep(plan, step, !options.devicePageCheck); !ok) return ok.error();
  IhaCase c = stepCase(step);
  c.spec = plan.spec;
  EmuOptions withStep = options;
  withStep.decode = &step;
  return runOnEmulator(plan, c, withStep);
}

double coveredRelativeError(const EmuRun& run, const std::vector<double>& expected, int64_t batch, int64_t tokens,
                            int64_t heads, int64_t headDim) {
  std::vector<double> out, ref;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t n = 0; n < tokens; ++n) {
      if (!run.covered[size_t(n)]) continue;
      const size_t begin = size_t(((b * tokens) + n) * heads * headDim), end = begin + size_t(heads * headDim);
      out.insert(out.end(), run.out.begin() + long(begin), run.out.begin() + long(end));
      ref.insert(ref.end(), expected.begin() + long(begin), expected.begin() + long(end));
    }
  return relativeError(out, ref);
}

std::string summary(const EmuRun& run) {
  std::ostringstream text;
  const Coverage& c = run.coverage;
  text << "emulated " << c.ctas << " CTAs (" << run.attentionCtasRun << " of the attention launch's "
       << run.attentionCtas << "), " << c.threads << " threads, " << c.instructions << " PTX instructions (ldmatrix "
       << c.ldmatrix << ", mma.sync " << c.mma << ", shfl " << c.shfl << ", bar " << c.barriers << ", cp.async "
       << c.cpAsync << ", mbarrier " << c.mbarrier << ", TMA " << c.tma << ", wgmma " << c.wgmma << "), "
       << c.sharedAccesses << " checked shared and " << c.globalAccesses << " global accesses in " << run.runSeconds
       << " s";
  if (run.compiled) text << " (+" << run.compileSeconds << " s compiling)";
  text << "; " << run.findingCount << " finding" << (run.findingCount == 1 ? "" : "s");
  for (const Finding& f : run.findings) text << "\n  " << format(f);
  if (run.findingCount > int64_t(run.findings.size()))
    text << "\n  (" << run.findingCount - int64_t(run.findings.size()) << " more at the same call sites)";
  return text.str();
}

}  // namespace loom::emu
