#include "cpu/cpu_backend.h"

#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "loom/cache_dir.h"
#include "loom/hash.h"
#include "loom/tile/common.h"
#include "loom/tile_headers.h"

namespace loom::cpu {
namespace fs = std::filesystem;
namespace {

constexpr const char* kCompileFlags = "-std=c++17 -O2 -fPIC -shared -w";

using KernelFn = void (*)(IhaArgs);
using SetBlockFn = void (*)(int64_t, int64_t, int64_t);
using StatsFn = void (*)(int64_t*, int64_t*, int64_t*);
using SetPartFn = void (*)(int);

std::string compilerCommand() {
  const char* cxx = std::getenv("CXX");
  return cxx && *cxx ? cxx : "c++";
}

Status writeFileAtomically(const fs::path& path, const std::string& text) {
  const fs::path temporary = path.string() + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out) return makeError(temporary.string() + ": write failed");
  }
  std::error_code ec;
  fs::rename(temporary, path, ec);
  if (ec) return makeError(path.string() + ": " + ec.message());
  return Status::success();
}

// The embedded tile headers, laid out once per header hash.
Result<fs::path> materializeHeaders(const fs::path& cacheDir) {
  const fs::path root = cacheDir / "include" / tile::embeddedHeadersHash();
  for (const tile::EmbeddedFile& file : tile::embeddedHeaders()) {
    const fs::path path = root / file.path;
    if (fs::exists(path)) continue;
    std::error_code ec;
    fs::create_directories(path.parent_path(), ec);
    if (ec) return makeError(path.parent_path().string() + ": " + ec.message());
    if (Status ok = writeFileAtomically(path, file.text); !ok) return ok.error();
  }
  return root;
}

// A loaded shared object; handles stay open for the process's life so a
// plan run twice is loaded once.
struct LoadedProgram {
  void* handle = nullptr;
  SetBlockFn setBlock = nullptr;
  StatsFn stats = nullptr;
  SetPartFn setPart = nullptr;
  std::map<std::string, KernelFn> entries;
};

Result<LoadedProgram> loadProgram(const KernelPlan& plan, const fs::path& object) {
  LoadedProgram program;
  program.handle = ::dlopen(object.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!program.handle) return makeError(object.string() + ": dlopen failed: " + ::dlerror());
  program.setBlock = reinterpret_cast<SetBlockFn>(::dlsym(program.handle, "loom_host_set_block"));
  program.stats = reinterpret_cast<StatsFn>(::dlsym(program.handle, "loom_host_stats"));
  program.setPart = reinterpret_cast<SetPartFn>(::dlsym(program.handle, "loom_host_set_part"));
  if (!program.setBlock || !program.stats || !program.setPart) return makeError(object.string() + ": not built against loom/tile/host.h");
  for (const LaunchPlan& launch : plan.launches) {
    auto fn = reinterpret_cast<KernelFn>(::dlsym(program.handle, launch.name.c_str()));
    if (!fn) return makeError(object.string() + ": entry point " + launch.name + " missing");
    program.entries[launch.name] = fn;
  }
  return program;
}

struct Compiled {
  fs::path object;
  bool compiled = false;
  double seconds = 0;
};

Result<Compiled> compileOrFind(const KernelPlan& plan, const fs::path& cacheDir) {
  if (plan.target.kind() == v1::Target::cuda) return makeError("the CPU backend needs a plan generated for target cpu");
  const std::string compiler = compilerCommand();
  const std::string key =
      ContentHash().add(plan.source).add(compiler).add(kCompileFlags).add(tile::embeddedHeadersHash()).hex();
  Compiled result;
  result.object = cacheDir / "cpu" / (key + ".so");
  if (fs::exists(result.object)) return result;

  auto headers = materializeHeaders(cacheDir);
  if (!headers) return headers.error();
  std::error_code ec;
  fs::create_directories(result.object.parent_path(), ec);
  if (ec) return makeError(result.object.parent_path().string() + ": " + ec.message());
  const fs::path source = cacheDir / "cpu" / (key + ".cpp");
  if (Status ok = writeFileAtomically(source, plan.source); !ok) return ok.error();

  // Build beside the final name, then rename: a crash never leaves a
  // half-written object under the key.
  const fs::path temporary = result.object.string() + ".tmp" + std::to_string(::getpid());
  const fs::path log = cacheDir / "cpu" / (key + ".log");
  const std::string command = compiler + " " + kCompileFlags + " -I'" + headers->string() + "' '" + source.string() +
                              "' -o '" + temporary.string() + "' > '" + log.string() + "' 2>&1";
  const auto start = std::chrono::steady_clock::now();
  const int status = std::system(command.c_str());
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (status != 0) {
    std::ifstream in(log);
    std::stringstream text;
    text << in.rdbuf();
    return makeError("the C++ compiler rejected the generated program (" + source.string() + ")", text.str());
  }
  fs::rename(temporary, result.object, ec);
  if (ec) return makeError(result.object.string() + ": " + ec.message());
  result.compiled = true;
  return result;
}

// Runs one launch's grid: CTAs are independent, so threads take them in turn.
void runGrid(const LoadedProgram& program, const LaunchPlan& launch, const IhaArgs& args, int threads) {
  const int64_t rows = args.tokens * launch.rowsPerToken;
  const int64_t gridX = (rows + launch.rowsPerCta - 1) / launch.rowsPerCta;
  const int64_t total = gridX * launch.gridY * args.batch;
  std::atomic<int64_t> next{0};
  KernelFn kernel = program.entries.at(launch.name);
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

void contiguousStrides(int64_t* stride, int64_t tokens, int64_t heads, int64_t d) {
  stride[0] = tokens * heads * d;
  stride[1] = heads * d;
  stride[2] = d;
}

}  // namespace

Result<CpuOutputs> runPlan(const KernelPlan& plan, const IhaCase& c, const CpuOptions& options) {
  const fs::path cacheDir = options.cacheDir.empty() ? defaultCacheDir() : options.cacheDir;
  auto compiled = compileOrFind(plan, cacheDir);
  if (!compiled) return compiled.error();

  // One loaded copy per object; programs are never unloaded.
  static std::mutex mutex;
  static std::map<std::string, LoadedProgram> loaded;
  std::unique_lock lock(mutex);
  auto found = loaded.find(compiled->object.string());
  if (found == loaded.end()) {
    auto program = loadProgram(plan, compiled->object);
    if (!program) return program.error();
    found = loaded.emplace(compiled->object.string(), *program).first;
  }
  const LoadedProgram& program = found->second;

  const KernelSpec& spec = plan.spec;
  const int64_t B = c.batch, N = c.tokens, H = spec.heads(), G = spec.kv_heads(), P = spec.pseudo_heads(),
                d = spec.head_dim(), L = N * P;
  const NpyType storage = storageTypeOf(spec.dtype());
  auto bytesOf = [&](const std::vector<double>& values) { return npyFromDouble(values, {int64_t(values.size())}, storage).bytes; };
  auto floats = [](const std::vector<double>& values) { return std::vector<float>(values.begin(), values.end()); };
  std::vector<uint8_t> q = bytesOf(c.inputs.q), k = bytesOf(c.inputs.k), v = bytesOf(c.inputs.v);
  std::vector<float> alphaQ = floats(c.inputs.alpha_q), alphaK = floats(c.inputs.alpha_k),
                     alphaV = floats(c.inputs.alpha_v), collapse = floats(c.inputs.collapse);
  NpyArray out;
  out.type = storage;
  out.shape = {B, N, H, d};
  out.bytes.assign(size_t(B * N * H * d * NpyArray::elementSize(storage)), 0xff);  // poison: NaN in every type
  std::vector<float> lse(size_t(B * H * L), std::nanf(""));
  std::map<Workspace, std::vector<float>> workspaces;
  for (Workspace w : plan.workspaces)
    workspaces[w].assign(size_t(B * (w == Workspace::k_mixed || w == Workspace::v_mixed ? G : H) * L * d),
                         std::nanf(""));
  auto workspace = [&](Workspace w) { return workspaces.count(w) ? workspaces[w].data() : nullptr; };

  IhaArgs args{};
  args.q = q.data();
  args.k = k.data();
  args.v = v.data();
  args.alpha_q = alphaQ.data();
  args.alpha_k = alphaK.data();
  args.alpha_v = alphaV.data();
  args.collapse = collapse.data();
  args.out = out.bytes.data();
  args.lse = lse.data();
  args.q_mixed = workspace(Workspace::q_mixed);
  args.k_mixed = workspace(Workspace::k_mixed);
  args.v_mixed = workspace(Workspace::v_mixed);
  args.o_pseudo = workspace(Workspace::o_pseudo);
  args.batch = B;
  args.tokens = N;
  contiguousStrides(args.q_stride, N, H, d);
  contiguousStrides(args.k_stride, N, G, d);
  contiguousStrides(args.v_stride, N, G, d);
  contiguousStrides(args.out_stride, N, H, d);

  const int threads = options.threads > 0 ? options.threads : int(std::max(1u, std::thread::hardware_concurrency()));
  CpuOutputs result;
  int64_t discard[3];
  program.stats(&discard[0], &discard[1], &discard[2]);  // reset counters
  for (const LaunchPlan& launch : plan.launches) runGrid(program, launch, args, threads);
  program.stats(&result.stats.keyBlocks, &result.stats.maskedBlocks, &result.stats.attentionCtas);
  result.stats.compiled = compiled->compiled;
  result.stats.compileSeconds = compiled->seconds;
  result.out = npyToDouble(out, spec.dtype() == v1::bfloat16);
  result.lse.assign(lse.begin(), lse.end());
  return result;
}

}  // namespace loom::cpu
