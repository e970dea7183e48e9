// KernelProvider: the one way loom hands out a compiled kernel for a spec on
// a target, shared by the host API, the CLI and the service. The schedule is
// the tuned one from the kernel cache when known (else the default); the
// compiled kernel comes from the cache when there, else from NVRTC now, with
// identical concurrent misses compiled once and a bound on compiles in
// flight. Knows nothing of gRPC.
#pragma once

#include <atomic>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <semaphore>
#include <string>

#include "jit/nvrtc_compiler.h"
#include "loom/cache.h"
#include "loom/heartbeat.h"
#include "loom/result.h"
#include "loom/spec.h"

namespace loom {

struct ProvidedKernel {
  v1::CompiledKernel kernel;
  std::string origin;          // "kernel cache" or "compiled now"
  std::string scheduleSource;  // "tuned", "ranked (untimed)", "cost model", "default", "given", with any fallback note
  // How long the NVRTC compile took when this call ran it (unset for a hit
  // and for an identical miss that waited on another call's compile).
  std::optional<double> compileSeconds;
};

class KernelProvider {
 public:
  static constexpr int kDefaultConcurrentCompiles = 4;

  // `cacheDir` holds kernels.sqlite and NVRTC's artifacts; a store that
  // cannot be opened is survived (every request then compiles).
  explicit KernelProvider(const std::string& cacheDir, int maxConcurrentCompiles = kDefaultConcurrentCompiles);
  // Over a store opened by the caller (a PostgreSQL store several service
  // replicas share); null: no store. A miss another process on the store
  // is compiling (it holds the lease "compile/<artifact key>") waits for
  // that process's artifact instead of compiling it again.
  KernelProvider(const std::string& cacheDir, int maxConcurrentCompiles, std::unique_ptr<cache::KernelStore> store);
  // The SQLite store in `cacheDir`; null (said on standard error) when it
  // cannot be opened: a provider survives that and compiles every request.
  static std::unique_ptr<cache::KernelStore> openCacheStore(const std::string& cacheDir);

  // An empty `schedule` means: the cache's decision for this device, else
  // the compiler's default.
  // `direction` backward: the backward kernel, its decision and artifact
  // keyed apart from the forward's. `keepsForward` (a forward): the kernel
  // that keeps what its backward reads (keepingSchedule of the given
  // schedule, else of the decision's with its mixing and collapse unset,
  // else of the default). `shapeBucket` (cache::shapeBucket of the
  // launches' shapes): that bucket's decision, else the nearest tuned
  // one's, else the one for every shape (KernelStore::getDecision).
  Result<ProvidedKernel> provide(const KernelSpec& spec, const v1::Target& target, const Schedule& schedule = {},
                                 v1::Direction direction = v1::direction_forward, bool keepsForward = false,
                                 const std::string& shapeBucket = "");

  // How a miss with no decision picks its schedule (default: the compiler's
  // default). The service installs the cost model's best here.
  using ScheduleChooser = std::function<Result<Schedule>(const KernelSpec&, const v1::Target&)>;
  void setScheduleChooser(ScheduleChooser chooser) { chooser_ = std::move(chooser); }

  cache::KernelStore* store() { return store_.get(); }
  int64_t compiles() const { return compiles_; }
  int compilesInFlight() const { return inFlightCount_; }

 private:
  // `seconds` is set when this call ran the compile (it led the identical
  // misses); `elsewhere` when another process on the store compiled it.
  Result<v1::CompiledKernel> compileOnce(const std::string& key, const KernelSpec& spec, const Schedule& schedule,
                                         const v1::Target& target, v1::Direction direction,
                                         std::optional<double>* seconds, bool* elsewhere);

  static constexpr int64_t kCompileLeaseSeconds = 15;  // renewed every 5 s while compiling
  static constexpr int kCompileWaitSeconds = 600;      // then compile here whatever the lease says
  class CompileLease {
   public:
    CompileLease(cache::KernelStore& store, std::string key, std::string holder);
    ~CompileLease();

   private:
    cache::KernelStore& store_;
    std::string key_, holder_;
    std::optional<Heartbeat> renewal_;
  };

  std::unique_ptr<cache::KernelStore> store_;
  ScheduleChooser chooser_;
  jit::NvrtcCompiler compiler_;
  std::counting_semaphore<1024> compileSlots_;
  std::mutex mutex_;
  std::map<std::string, std::shared_future<Result<v1::CompiledKernel>>> inFlight_;
  std::atomic<int64_t> compiles_{0};
  std::atomic<int> inFlightCount_{0};
  std::string holder_;  // this provider's name on the store's leases
};

}  // namespace loom
