// loom-service-load: a load test of `loom serve`. Starts the server (or
// --replicas of them on one --store, clients spread over them) on loopback
// with a fresh cache, then drives it with concurrent clients for a
// bounded time in three phases:
//   warm     GetKernel for specs already compiled (p50, p99, requests/s)
//   misses   the same, with a share of requests for new specs that compile
//   cancel   clients whose deadline ends mid-compile (they hang up), then a
//            check that the server still answers
// and reports errors (any status but OK, and the expected DEADLINE_EXCEEDED
// of the hanging-up clients), the server's resident memory and open file
// descriptors before and after. Exits non-zero on an error, on memory growth
// past --max-growth-mb or on descriptors left open.
#include <CLI/CLI.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "loom/client.h"
#include "loom/compiler.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

loom::KernelSpec specNumber(int i) {
  loom::KernelSpec spec;
  spec.set_heads(2);
  spec.set_kv_heads(1);
  spec.set_pseudo_heads(2);
  spec.set_head_dim(32);
  spec.set_dtype(loom::v1::float16);
  spec.set_mask(loom::v1::flat_causal);
  spec.set_collapse(loom::v1::per_head);
  spec.set_window(i);  // window i tokens (0: none): one spec per i
  return spec;
}

int64_t residentKiB(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  return -1;
}

int openDescriptors(pid_t pid) {
  std::error_code ec;
  int count = 0;
  for (auto it = fs::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec); !ec && it != fs::end(it);
       it.increment(ec))
    ++count;
  return count;
}

struct Phase {
  std::vector<double> latenciesMs;
  int64_t ok = 0, errors = 0, hungUp = 0;
  double seconds = 0;
  std::string firstError;
};

double percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  return values[std::min(values.size() - 1, size_t(p * double(values.size())))];
}

// `clients` threads send GetKernel for `seconds`; `pick(thread, i)` gives
// the spec number and deadline of request i.
template <typename Pick>
Phase drive(const std::string& address, const loom::v1::Target& target, int clients, double seconds, Pick pick) {
  Phase phase;
  std::mutex mutex;
  const auto start = Clock::now();
  const auto end = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  std::vector<std::thread> threads;
  for (int t = 0; t < clients; ++t)
    threads.emplace_back([&, t] {
      auto client = loom::service::KernelClient::connect(address);
      if (!client) {
        std::lock_guard lock(mutex);
        ++phase.errors;
        return;
      }
      std::vector<double> latencies;
      int64_t ok = 0, errors = 0, hungUp = 0;
      std::string firstError;
      for (int i = 0; Clock::now() < end; ++i) {
        const auto [number, deadlineMs] = pick(t, i);
        const auto sent = Clock::now();
        auto response = (*client)->getKernel(specNumber(number), target, deadlineMs);
        const double ms = std::chrono::duration<double, std::milli>(Clock::now() - sent).count();
        if (response) {
          ++ok;
          latencies.push_back(ms);
        } else if (deadlineMs < 1000 && response.error().message.find("DEADLINE_EXCEEDED") != std::string::npos) {
          ++hungUp;
        } else {
          ++errors;
          if (firstError.empty()) firstError = response.error().message;
        }
      }
      std::lock_guard lock(mutex);
      phase.latenciesMs.insert(phase.latenciesMs.end(), latencies.begin(), latencies.end());
      phase.ok += ok;
      phase.errors += errors;
      phase.hungUp += hungUp;
      if (phase.firstError.empty()) phase.firstError = firstError;
    });
  for (auto& thread : threads) thread.join();
  phase.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return phase;
}

void print(const char* name, const Phase& p) {
  std::printf("%-7s %8lld ok %6lld errors %6lld hung up  %9.0f req/s  p50 %8.2f ms  p99 %8.2f ms\n", name,
              static_cast<long long>(p.ok), static_cast<long long>(p.errors), static_cast<long long>(p.hungUp),
              double(p.ok) / p.seconds, percentile(p.latenciesMs, 0.50), percentile(p.latenciesMs, 0.99));
  if (!p.firstError.empty()) std::printf("        first error: %s\n", p.firstError.substr(0, 300).c_str());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Load test of loom serve: warm hits, misses that compile, clients that hang up mid-request"};
  std::string loomBinary = (fs::path(argv[0]).parent_path() / "loom").string();
  int clients = 64, port = 0, warmSpecs = 4, maxGrowthMb = 512, replicas = 1;
  double seconds = 10, missShare = 0.02;
  std::string arch = "sm_80", store;
  app.add_option("--loom", loomBinary, "the loom binary to serve with")->capture_default_str();
  app.add_option("--clients", clients, "concurrent clients")->capture_default_str();
  app.add_option("--seconds", seconds, "length of each phase")->capture_default_str();
  app.add_option("--miss-share", missShare, "share of requests in the misses phase for a new spec")->capture_default_str();
  app.add_option("--arch", arch, "target arch of the requests")->capture_default_str();
  app.add_option("--port", port, "port to serve on (0: one derived from the process id)");
  app.add_option("--max-growth-mb", maxGrowthMb, "resident memory the server may gain over the run")->capture_default_str();
  app.add_option("--replicas", replicas, "servers on one store, on consecutive ports; each client starts on its own")
      ->capture_default_str()
      ->check(CLI::Range(1, 16));
  app.add_option("--store", store,
                 "the servers' store: postgresql://... (an empty database: the run fills it), or a SQLite file;\n"
                 "default: the run's fresh cache folder's SQLite file");
  CLI11_PARSE(app, argc, argv);

  const fs::path cache = fs::temp_directory_path() / ("loom-service-load-" + std::to_string(::getpid()));
  fs::create_directories(cache);
  if (port == 0) port = 30000 + int(::getpid() % 20000);
  std::string address;  // every replica's, comma-separated: each client starts on its own
  std::vector<pid_t> servers;
  for (int r = 0; r < replicas; ++r) {
    const std::string listen = "127.0.0.1:" + std::to_string(port + r);
    address += (r ? "," : "") + listen;
    const pid_t server = ::fork();
    if (server == 0) {
      const std::string log = (cache / ("serve-" + std::to_string(r) + ".log")).string();
      if (std::FILE* f = std::freopen(log.c_str(), "w", stderr); !f) ::_exit(126);
      if (std::FILE* f = std::freopen(log.c_str(), "a", stdout); !f) ::_exit(126);
      const std::string storeLocation = store.empty() ? (cache / "kernels.sqlite").string() : store;
      ::execl(loomBinary.c_str(), loomBinary.c_str(), "serve", "--listen", listen.c_str(), "--cache-dir",
              (cache / ("replica-" + std::to_string(r))).c_str(), "--store", storeLocation.c_str(),
              static_cast<char*>(nullptr));
      ::_exit(127);
    }
    servers.push_back(server);
  }
  auto stop = [&](int code) {
    for (pid_t server : servers) ::kill(server, SIGTERM);
    for (pid_t server : servers) {
      int status = 0;
      ::waitpid(server, &status, 0);
    }
    std::error_code ec;
    fs::remove_all(cache, ec);
    return code;
  };
  // Memory and descriptors summed over the replicas.
  auto resident = [&] {
    int64_t sum = 0;
    for (pid_t server : servers) sum += residentKiB(server);
    return sum;
  };
  auto descriptors = [&] {
    int sum = 0;
    for (pid_t server : servers) sum += openDescriptors(server);
    return sum;
  };
  auto target = loom::parseTarget(arch);
  if (!target) {
    std::fprintf(stderr, "service_load: %s\n", target.error().message.c_str());
    return stop(2);
  }
  bool up = true;
  for (int r = 0; r < replicas && up; ++r) {  // each replica answers
    auto one = loom::service::KernelClient::connect("127.0.0.1:" + std::to_string(port + r));
    up = false;
    for (int wait = 0; wait < 200 && one && !up; ++wait) {
      up = (*one)->listKernels().ok();
      if (!up) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  auto probe = loom::service::KernelClient::connect(address);
  if (!up) {
    std::fprintf(stderr, "service_load: %s serve did not come up on %s\n", loomBinary.c_str(), address.c_str());
    return stop(2);
  }
  std::printf("service_load: %d clients, %.0f s per phase, %s, %d server%s on %s\n", clients, seconds, arch.c_str(),
              replicas, replicas > 1 ? "s" : "", address.c_str());
  for (int i = 0; i < warmSpecs; ++i)
    if (auto r = (*probe)->getKernel(specNumber(i), *target, 120000); !r) {
      std::fprintf(stderr, "service_load: warming up: %s\n", r.error().message.c_str());
      return stop(1);
    }
  const int64_t rssStart = resident();
  const int fdsStart = descriptors();

  const Phase warm = drive(address, *target, clients, seconds, [&](int t, int i) {
    return std::pair<int, int>((t + i) % warmSpecs, 60000);
  });
  std::atomic<int> nextNew{1000};
  const int missEvery = missShare > 0 ? std::max(1, int(1.0 / missShare)) : 0;
  const Phase misses = drive(address, *target, clients, seconds, [&](int t, int i) {
    if (missEvery && (t * 7919 + i) % missEvery == 0) return std::pair<int, int>(nextNew++, 120000);
    return std::pair<int, int>((t + i) % warmSpecs, 60000);
  });
  // Clients that hang up 20 ms into a request for one of kHangUpSpecs new
  // specs (each compile takes longer): the server finishes each compile into
  // the cache all the same, once per spec.
  constexpr int kHangUpSpecs = 16;
  const int firstHangUp = nextNew;
  const Phase cancel = drive(address, *target, clients, std::min(seconds, 5.0), [&](int t, int i) {
    return std::pair<int, int>(firstHangUp + (t + i) % kHangUpSpecs, 20);
  });
  // Then the server still answers: every hung-up spec from the cache (the
  // compiles it went on with), and the warm ones.
  int landed = 0;
  for (int i = 0; i < kHangUpSpecs; ++i)
    if (auto r = (*probe)->getKernel(specNumber(firstHangUp + i), *target, 120000); r) ++landed;
  const Phase after = drive(address, *target, std::min(clients, 8), 2, [&](int t, int i) {
    return std::pair<int, int>((t + i) % warmSpecs, 60000);
  });
  const int64_t rssEnd = resident();
  const int fdsEnd = descriptors();

  print("warm", warm);
  print("misses", misses);
  print("cancel", cancel);
  print("after", after);
  const int64_t errors = warm.errors + misses.errors + cancel.errors + after.errors;
  const double growthMb = double(rssEnd - rssStart) / 1024.0;
  std::printf("server%s memory: %.1f MiB at start, %.1f MiB at end (%+.1f MiB, bound %d a server)\n", replicas > 1 ? "s'" : "",
              double(rssStart) / 1024.0,
              double(rssEnd) / 1024.0, growthMb, maxGrowthMb);
  std::printf("server descriptors: %d at start, %d at end\n", fdsStart, fdsEnd);
  std::printf("hung-up specs served afterwards: %d of %d\n", landed, kHangUpSpecs);
  std::printf("errors: %lld\n", static_cast<long long>(errors));
  const bool failed = errors > 0 || after.ok == 0 || landed < kHangUpSpecs || growthMb > double(maxGrowthMb) * replicas ||
                      fdsEnd > fdsStart + 8 * replicas;
  return stop(failed ? 1 : 0);
}
