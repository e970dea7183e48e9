#include "cpu/cpu_backend.h"

#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <unordered_map>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "cpu/host_program.h"
#include "loom/cache_dir.h"
#include "loom/tile/common.h"
#include "loom/counters.h"

namespace loom::cpu {
namespace fs = std::filesystem;
namespace {

constexpr const char* kCompileFlags = "-std=c++17 -O2 -fPIC -shared -w";

using KernelFn = void (*)(IhaArgs);
using SetBlockFn = void (*)(int64_t, int64_t, int64_t);
using StatsFn = void (*)(int64_t*, int64_t*, int64_t*);
using SetPartFn = void (*)(int);

// A program's entry points (the shared object stays loaded).
struct LoadedProgram {
  SetBlockFn setBlock = nullptr;
  StatsFn stats = nullptr;
  SetPartFn setPart = nullptr;
  std::map<std::string, KernelFn> entries;
};

Result<LoadedProgram> loadProgram(const KernelPlan& plan, const fs::path& object) {
  auto handle = loadHostProgram(object);
  if (!handle) return handle.error();
  LoadedProgram program;
  program.setBlock = reinterpret_cast<SetBlockFn>(::dlsym(*handle, "loom_host_set_block"));
  program.stats = reinterpret_cast<StatsFn>(::dlsym(*handle, "loom_host_stats"));
  program.setPart = reinterpret_cast<SetPartFn>(::dlsym(*handle, "loom_host_set_part"));
  if (!program.setBlock || !program.stats || !program.setPart)
    return makeError(object.string() + ": not built against loom/tile/host.h");
  for (const LaunchPlan& launch : plan.launches) {
    auto fn = reinterpret_cast<KernelFn>(::dlsym(*handle, launch.name.c_str()));
    if (!fn) return makeError(object.string() + ": entry point " + launch.name + " missing");
    program.entries[launch.name] = fn;
  }
  return program;
}

// A program compiled (or read from the cache folder) and loaded, kept for
// the life of the process by its source, compiler and cache folder: a
// steady-state run neither hashes the headers nor looks on disk.
struct KeptProgram {
  CompiledProgram compiled;  // `compiled` and `seconds` say so for the first run only
  LoadedProgram program;
};
Result<KeptProgram*> keptProgram(const KernelPlan& plan, const fs::path& cacheDir) {
  const HostProgram source{plan.source, compilerFrom("CXX", "c++"), kCompileFlags, {}, "cpu"};
  const std::string key = source.compiler + '\0' + cacheDir.string() + '\0' + plan.source;
  static std::mutex mutex;
  static std::unordered_map<std::string, std::unique_ptr<KeptProgram>> programs;
  std::lock_guard lock(mutex);  // compiles at most once a key
  if (auto found = programs.find(key); found != programs.end()) return found->second.get();
  auto compiled = compileHostProgram(source, cacheDir);
  if (!compiled) return compiled.error();
  auto loaded = loadProgram(plan, compiled->object);
  if (!loaded) return loaded.error();
  auto kept = std::make_unique<KeptProgram>(KeptProgram{*compiled, std::move(*loaded)});
  return programs.emplace(key, std::move(kept)).first->second.get();
}

// Runs one launch's grid: CTAs are independent, so threads take them in turn.
void runGrid(const LoadedProgram& program, const LaunchPlan& launch, const IhaArgs& args, int threads) {
  const int64_t rows = args.tokens * launch.rowsPerToken;
  const int64_t gridX = (rows + launch.rowsPerCta - 1) / launch.rowsPerCta;
  const int64_t total = gridX * launch.gridY * args.batch;
  std::atomic<int64_t> next{0};
  KernelFn kernel = program.entries.at(launch.name);
  count(Counter::launches);
  auto worker = [&] {
    for (int64_t cta = next++; cta < total; cta = next++) {
      program.setBlock(cta % gridX, (cta / gridX) % launch.gridY, cta / (gridX * launch.gridY));
      if (!launch.warpSpecialized) {
        kernel(args);
        continue;
      }
      // The producer warpgroup's part, then the consumers' (host.h checks
      // they agree block for block).
      program.setPart(1);
      kernel(args);
      program.setPart(2);
      kernel(args);
      program.setPart(0);
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& thread : pool) thread.join();
}

}  // namespace

namespace {

// The case's tensors as a launch reads them, and the plan's workspaces, all
// poisoned with NaN (0xff bytes) where the program writes.
struct HostTensors {
  std::vector<uint8_t> q, k, v, dout;
  std::vector<float> alphaQ, alphaK, alphaV, collapse, lse;
  NpyArray out;
  std::map<Workspace, std::vector<float>> workspaces;
  std::vector<float> dq, dk, dv, dalphaQ, dalphaK, dalphaV, dcollapse;
  std::vector<int32_t> cuSeqlens;
  std::vector<int32_t> queryStartLoc;
  IhaArgs args{};
};

void prepareTensors(const KernelPlan& plan, const IhaCase& c, HostTensors& t) {
  const KernelSpec& spec = plan.spec;
  const int64_t B = c.batch, N = c.tokens, H = spec.heads(), G = spec.kv_heads(), P = spec.pseudo_heads(),
                d = spec.head_dim(), L = N * P;
  const NpyType storage = storageTypeOf(spec.dtype());
  auto bytesOf = [&](const std::vector<double>& values) { return npyFromDouble(values, {int64_t(values.size())}, storage).bytes; };
  auto floats = [](const std::vector<double>& values) { return std::vector<float>(values.begin(), values.end()); };
  t.q = bytesOf(c.inputs.q);
  t.k = bytesOf(c.inputs.k);
  t.v = bytesOf(c.inputs.v);
  t.alphaQ = floats(c.inputs.alpha_q);
  t.alphaK = floats(c.inputs.alpha_k);
  t.alphaV = floats(c.inputs.alpha_v);
  t.collapse = floats(c.inputs.collapse);
  // A ragged step's out packs its sequences' new tokens, [total, H, d].
  const std::vector<int32_t>& ragged = c.inputs.query_start_loc;
  const int64_t rows = ragged.empty() ? B * N : ragged.back();
  t.out.type = storage;
  t.out.shape = ragged.empty() ? std::vector<int64_t>{B, N, H, d} : std::vector<int64_t>{rows, H, d};
  t.out.bytes.assign(size_t(rows * H * d * NpyArray::elementSize(storage)), 0xff);  // poison: NaN in every type
  t.lse.assign(size_t(B * H * L), std::nanf(""));
  for (Workspace w : plan.workspaces)
    t.workspaces[w].assign(size_t(workspaceElements(plan, w, B, N)), std::nanf(""));
  auto workspace = [&](Workspace w) { return t.workspaces.count(w) ? t.workspaces[w].data() : nullptr; };

  IhaArgs& args = t.args;
  args.q = t.q.data();
  args.k = t.k.data();
  args.v = t.v.data();
  args.alpha_q = t.alphaQ.data();
  args.alpha_k = t.alphaK.data();
  args.alpha_v = t.alphaV.data();
  args.collapse = t.collapse.data();
  args.out = t.out.bytes.data();
  args.lse = t.lse.data();
  args.q_mixed = workspace(Workspace::q_mixed);
  args.k_mixed = workspace(Workspace::k_mixed);
  args.v_mixed = workspace(Workspace::v_mixed);
  args.o_pseudo = workspace(Workspace::o_pseudo);
  args.partials = workspace(Workspace::splits);  // a split decode plan's (the backward's below)
  args.batch = B;
  args.tokens = N;
  setDenseStrides(args, N, H, G, d);
  if (!c.inputs.cu_seqlens.empty()) {
    t.cuSeqlens = c.inputs.cu_seqlens;
    args.cu_seqlens = t.cuSeqlens.data();
    args.documents = int64_t(t.cuSeqlens.size()) - 1;
  }
  if (!ragged.empty()) {
    t.queryStartLoc = ragged;
    args.query_start_loc = t.queryStartLoc.data();
  }
  if (plan.direction != Direction::backward) return;

  t.dout = bytesOf(*c.dout);
  auto poisoned = [](const std::vector<double>& like) { return std::vector<float>(like.size(), std::nanf("")); };
  t.dq = poisoned(c.inputs.q);
  t.dk = poisoned(c.inputs.k);
  t.dv = poisoned(c.inputs.v);
  t.dalphaQ = poisoned(c.inputs.alpha_q);
  t.dalphaK = poisoned(c.inputs.alpha_k);
  t.dalphaV = poisoned(c.inputs.alpha_v);
  t.dcollapse = poisoned(c.inputs.collapse);
  args.dout = t.dout.data();
  args.dq = t.dq.data();
  args.dk = t.dk.data();
  args.dv = t.dv.data();
  args.dalpha_q = t.dalphaQ.data();
  args.dalpha_k = t.dalphaK.data();
  args.dalpha_v = t.dalphaV.data();
  args.dcollapse = t.dcollapse.data();
  args.do_pseudo = workspace(Workspace::do_pseudo);
  setRowStats(args, workspace(Workspace::delta), B * H * L);
  args.dq_pseudo = workspace(Workspace::dq_pseudo);
  args.dk_pseudo = workspace(Workspace::dk_pseudo);
  args.dv_pseudo = workspace(Workspace::dv_pseudo);
  args.partials = workspace(Workspace::partials);
}

// Compiles, loads and runs every launch of `plan` on `t` (but the pre-mix and
// the attention where `skipForward`).
Result<CpuRunStats> execute(const KernelPlan& plan, HostTensors& t, const CpuOptions& options,
                            bool skipForward = false) {
  const fs::path cacheDir = options.cacheDir.empty() ? defaultCacheDir() : options.cacheDir;
  if (plan.target.kind() == v1::Target::cuda) return makeError("the CPU backend needs a plan generated for target cpu");
  auto kept = keptProgram(plan, cacheDir);
  if (!kept) return kept.error();
  const LoadedProgram& program = (*kept)->program;
  // The host tile API counts into the program's globals: one run at a time.
  static std::mutex running;
  std::lock_guard lock(running);
  const int threads = options.threads > 0 ? options.threads : int(std::max(1u, std::thread::hardware_concurrency()));
  CpuRunStats stats;
  int64_t discard[3];
  program.stats(&discard[0], &discard[1], &discard[2]);  // reset counters
  for (const LaunchPlan& launch : plan.launches)
    if (!(skipForward && recomputesForward(launch))) runGrid(program, launch, t.args, threads);
  program.stats(&stats.keyBlocks, &stats.maskedBlocks, &stats.attentionCtas);
  stats.compiled = (*kept)->compiled.compiled;
  stats.compileSeconds = (*kept)->compiled.seconds;
  (*kept)->compiled.compiled = false;  // compiled once: later runs report a kept program
  (*kept)->compiled.seconds = 0;
  return stats;
}

std::vector<double> widen(const std::vector<float>& values) { return {values.begin(), values.end()}; }

std::vector<uint8_t> bytesOf(const std::vector<float>& values) {
  std::vector<uint8_t> bytes(values.size() * sizeof(float));
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

// A forward's kept state (checkKeptFits) into the backward's workspaces and lse.
void restoreKept(const KeptForward& kept, HostTensors& t) {
  for (Workspace w : kKeptWorkspaces) std::memcpy(t.workspaces[w].data(), kept.rows.at(w).data(), kept.rows.at(w).size());
  t.lse = kept.lse;
  t.args.lse = t.lse.data();
}

}  // namespace

Result<CpuOutputs> runPlan(const KernelPlan& plan, const IhaCase& c, const CpuOptions& options, KeptForward* keep) {
  if (plan.direction != Direction::forward) return makeError("runPlan runs a forward plan; runBackwardPlan a backward one");
  if (keep)
    if (Status ok = canKeepForward(plan); !ok) return ok.error();
  HostTensors t;
  prepareTensors(plan, c, t);
  auto stats = execute(plan, t, options);
  if (!stats) return stats.error();
  CpuOutputs result;
  result.stats = *stats;
  result.out = npyToDouble(t.out, plan.spec.dtype() == v1::bfloat16);
  result.lse = widen(t.lse);
  if (keep) {
    for (Workspace w : kKeptWorkspaces) keep->rows[w] = bytesOf(t.workspaces[w]);
    keep->lse = t.lse;
  }
  return result;
}

Status checkDecodeStep(const KernelPlan& plan, const DecodeCase& step, bool entries) {
  if (plan.direction != Direction::decode) return makeError("a decode step needs a plan generated for a decode step");
  if (plan.mixedCache != (step.layout == CacheLayout::mixed))
    return makeError(std::string("the plan is for a ") + (plan.mixedCache ? "mixed" : "raw") + " cache, the step's is " +
                     cacheLayoutName(step.layout));
  if (entries) return validateDecode(step.shape, step.cache.pageTable, step.cache.cacheLen, step.step.query_start_loc);
  if (int64_t(step.cache.pageTable.size()) != step.shape.batch * step.shape.maxPages ||
      int64_t(step.cache.cacheLen.size()) != step.shape.batch)
    return makeError("page_table and cache_len: want B x max_pages and B entries");
  return Status::success();
}

Result<CpuDecodeOutputs> runDecodePlan(const KernelPlan& plan, const DecodeCase& step, const CpuOptions& options) {
  if (Status ok = checkDecodeStep(plan, step); !ok) return ok.error();
  // The step's tensors are a case of T tokens; the cache goes beside them.
  IhaCase c = stepCase(step);
  c.spec = plan.spec;
  HostTensors t;
  prepareTensors(plan, c, t);
  const NpyType storage = storageTypeOf(plan.spec.dtype());
  const int64_t elements = int64_t(step.cache.k.size());
  NpyArray kCache = npyFromDouble(step.cache.k, {elements}, storage);
  NpyArray vCache = npyFromDouble(step.cache.v, {elements}, storage);
  std::vector<int32_t> pageTable = step.cache.pageTable, cacheLen = step.cache.cacheLen;
  t.args.k_cache = kCache.bytes.data();
  t.args.v_cache = vCache.bytes.data();
  t.args.page_table = pageTable.data();
  t.args.cache_len = cacheLen.data();
  t.args.page_size = step.shape.pageSize;
  t.args.max_pages = step.shape.maxPages;
  auto stats = execute(plan, t, options);
  if (!stats) return stats.error();
  CpuDecodeOutputs result;
  result.stats = *stats;
  result.out = npyToDouble(t.out, plan.spec.dtype() == v1::bfloat16);
  result.lse = widen(t.lse);
  result.cache = step.cache;
  result.cache.k = npyToDouble(kCache, plan.spec.dtype() == v1::bfloat16);
  result.cache.v = npyToDouble(vCache, plan.spec.dtype() == v1::bfloat16);
  return result;
}

Result<CpuGradients> runBackwardPlan(const KernelPlan& plan, const IhaCase& c, const CpuOptions& options,
                                     const KeptForward* kept) {
  if (plan.direction != Direction::backward) return makeError("runBackwardPlan needs a plan generated for the backward");
  if (!c.dout) return makeError("the backward needs dout, the gradient of the output");
  if (kept)
    if (Status ok = checkKeptFits(*kept, plan, c.batch, c.tokens); !ok) return ok.error();
  HostTensors t;
  prepareTensors(plan, c, t);
  if (kept) restoreKept(*kept, t);
  auto stats = execute(plan, t, options, kept != nullptr);
  if (!stats) return stats.error();
  CpuGradients result;
  result.stats = *stats;
  result.gradients = {widen(t.dq),      widen(t.dk),      widen(t.dv),       widen(t.dalphaQ),
                      widen(t.dalphaK), widen(t.dalphaV), widen(t.dcollapse)};
  result.lse = widen(t.lse);
  return result;
}

}  // namespace loom::cpu
