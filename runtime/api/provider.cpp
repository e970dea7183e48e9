#include "api/provider.h"

#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <chrono>
#include <cstdio>
#include <thread>

#include "api/compile.h"
#include "loom/compiler.h"
#include "loom/counters.h"
#include "loom/runtime.h"

namespace loom {

// A compile's lease, renewed every third of kCompileLeaseSeconds while the
// compile runs (a long compile keeps it, a dead process loses it), given
// back on destruction.
KernelProvider::CompileLease::CompileLease(cache::KernelStore& store, std::string key, std::string holder)
    : store_(store),
      key_(std::move(key)),
      holder_(std::move(holder)),
      renewal_(std::in_place, std::chrono::seconds(kCompileLeaseSeconds / 3),
               [this] { (void)store_.acquireLease(key_, holder_, kCompileLeaseSeconds); }) {}

KernelProvider::CompileLease::~CompileLease() {
  renewal_.reset();  // no renewal after the lease is given back
  (void)store_.releaseLease(key_, holder_);
}

namespace {
// Who this provider is to the other processes on its store: host, process
// and an instance number.
std::string holderName() {
  static std::atomic<int> instances{0};
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return std::string(host) + ":" + std::to_string(::getpid()) + ":" + std::to_string(++instances);
}
// A compile (MLIR, NVRTC, ptxas) allocates and frees hundreds of MiB across
// the threads that run it; glibc keeps what its arenas freed, so a server
// that compiled some 80 kernels under load held 580-740 MiB more than after
// warm-up. Handed back to the system after each compile (milliseconds,
// against a compile's seconds): docs/reliability.md.
void releaseFreedHeap() {
#if defined(__GLIBC__)
  ::malloc_trim(0);
#endif
}
}  // namespace

std::unique_ptr<cache::KernelStore> KernelProvider::openCacheStore(const std::string& cacheDir) {
  auto store = cache::openSqliteStore(cache::storePath(cacheDir));
  if (store) return std::move(*store);
  std::fprintf(stderr, "loom: kernel cache unavailable (%s); compiling without it\n", store.error().message.c_str());
  return nullptr;
}

KernelProvider::KernelProvider(const std::string& cacheDir, int maxConcurrentCompiles)
    : KernelProvider(cacheDir, maxConcurrentCompiles, openCacheStore(cacheDir)) {}

KernelProvider::KernelProvider(const std::string& cacheDir, int maxConcurrentCompiles,
                               std::unique_ptr<cache::KernelStore> store)
    : store_(std::move(store)),
      compiler_(cacheDir),
      compileSlots_(std::max(1, maxConcurrentCompiles)),
      holder_(holderName()) {}

Result<ProvidedKernel> KernelProvider::provide(const KernelSpec& spec, const v1::Target& target,
                                               const Schedule& schedule, v1::Direction direction, bool keepsForward,
                                               const std::string& shapeBucket) {
  if (target.kind() != v1::Target::cuda) return makeError("target must be a CUDA arch (sm_80, sm_90a, ...)");
  if (keepsForward && direction != v1::direction_forward)
    return makeError("only a forward kernel keeps what its backward reads");
  ProvidedKernel provided;
  Schedule chosen = schedule;
  provided.scheduleSource = schedule.ByteSizeLong() ? "given" : "default";
  if (store_ && !schedule.ByteSizeLong()) {
    count(Counter::store_reads);
    auto decision =
        store_->getDecision(spec, cache::DeviceModel::of(target), jit::nvrtcVersion(), direction, shapeBucket);
    if (!decision && !shapeBucket.empty()) return decision.error();  // a malformed bucket
    if (decision && decision->has_value()) {
      chosen = (*decision)->decision.result.best();
      provided.scheduleSource = (*decision)->decision.result.measured() ? "tuned" : "ranked (untimed)";
      if (!(*decision)->note.empty()) provided.scheduleSource += " (" + (*decision)->note + ")";
    }
  }
  if (provided.scheduleSource == "default" && chooser_ && direction == v1::direction_forward) {  // the cost model ranks forward schedules
    if (auto best = chooser_(spec, target); best) {
      chosen = *best;
      provided.scheduleSource = "cost model";
    }
  }
  // The kernel's address needs the generated source; generating is cheap.
  GenerateOptions options;
  options.direction = directionOf(direction);
  options.mixedCache = mixedCacheOf(direction);
  // Keeping: a decision's mixing and collapse give way; a given schedule's must allow keeping.
  const bool keepsDecision =
      keepsForward && provided.scheduleSource != "given" && provided.scheduleSource != "default";
  if (keepsForward) {
    if (keepsDecision) {
      chosen.clear_mix();
      chosen.clear_collapse();
      provided.scheduleSource += ", mixing materialised and collapse separate to keep the forward";
    }
    auto keeping = keepingSchedule(chosen);
    if (!keeping) return keeping.error();
    chosen = *keeping;
  }
  auto plan = generateKernel(spec, chosen, target, options);
  if (!plan && keepsDecision) {  // the decision's tiles do not fit keeping
    chosen = *keepingSchedule({});
    provided.scheduleSource = "default (the decision does not keep the forward)";
    plan = generateKernel(spec, chosen, target, options);
  }
  if (!plan) return plan.error();
  v1::CompiledKernel probe = toCompiledKernel(*plan);
  setCompilerIdentity(probe, target.arch());
  const std::string key = cache::artifactKey(probe);
  if (store_) {
    count(Counter::store_reads);
    auto hit = store_->getArtifact(key);
    if (hit && hit->has_value()) {
      provided.kernel = std::move(**hit);
      provided.origin = "kernel cache";
      return provided;
    }
  }
  bool elsewhere = false;
  auto compiled = compileOnce(key, spec, chosen, target, direction, &provided.compileSeconds, &elsewhere);
  if (!compiled) return compiled.error();
  provided.kernel = *compiled;
  provided.origin = elsewhere ? "kernel cache" : "compiled now";
  return provided;
}

Result<v1::CompiledKernel> KernelProvider::compileOnce(const std::string& key, const KernelSpec& spec,
                                                       const Schedule& schedule, const v1::Target& target,
                                                       v1::Direction direction, std::optional<double>* seconds,
                                                       bool* elsewhere) {
  std::shared_future<Result<v1::CompiledKernel>> future;
  std::promise<Result<v1::CompiledKernel>> promise;
  bool leader = false;
  {
    std::lock_guard lock(mutex_);
    auto found = inFlight_.find(key);
    if (found != inFlight_.end()) {
      future = found->second;
    } else {
      future = promise.get_future().share();
      inFlight_.emplace(key, future);
      leader = true;
    }
  }
  if (!leader) return future.get();  // an identical miss is compiling: share its result

  // Another process on the same store (a service replica) may be compiling
  // this miss: it holds the lease, so wait for its artifact, or for the
  // lease to lapse if it died.
  std::optional<CompileLease> lease;
  const std::string leaseKey = "compile/" + key;
  if (store_) {
    const auto giveUp = std::chrono::steady_clock::now() + std::chrono::seconds(kCompileWaitSeconds);
    while (!lease && std::chrono::steady_clock::now() < giveUp) {
      auto taken = store_->acquireLease(leaseKey, holder_, kCompileLeaseSeconds);
      if (!taken) break;  // a store that cannot lease: compile here
      if (taken->granted) lease.emplace(*store_, leaseKey, holder_);
      // Looked for again once the lease is ours: the last holder may have
      // stored the artifact and given the lease back just before.
      auto hit = store_->getArtifact(key);
      if (hit && hit->has_value()) {
        lease.reset();
        *elsewhere = true;
        Result<v1::CompiledKernel> found = std::move(**hit);
        promise.set_value(found);
        std::lock_guard lock(mutex_);
        inFlight_.erase(key);
        return found;
      }
      if (!lease) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  compileSlots_.acquire();
  ++inFlightCount_;
  const auto start = std::chrono::steady_clock::now();
  auto compiled = compileKernel(spec, schedule, target, compiler_, nullptr, directionOf(direction),
                                mixedCacheOf(direction));
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  --inFlightCount_;
  compileSlots_.release();
  releaseFreedHeap();
  ++compiles_;
  if (compiled && store_) (void)store_->putArtifact(*compiled);  // a cache that cannot write costs a recompile
  lease.reset();  // given back once the artifact is in the store
  promise.set_value(compiled);
  std::lock_guard lock(mutex_);
  inFlight_.erase(key);
  return compiled;
}

}  // namespace loom
