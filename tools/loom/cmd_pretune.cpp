// loom pretune: run on each GPU node of a fleet (by hand or as an array job
// of the cluster's scheduler): for every spec whose decision is missing for
// this node's device model, lease it from the service, tune it here, upload
// the result and the winning kernel, release the lease.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "autotune/tuner.h"
#include "commands.h"
#include "cuda/driver.h"
#include "loom/cache.h"
#include "loom/cache_dir.h"
#include "loom/client.h"
#include "loom/compiler.h"
#include "loom/heartbeat.h"

namespace loom::cli {
namespace {

struct PretuneOptions {
  std::string server;
  std::string specsPath;
  std::string tokenFile;
  std::string target;
  std::string worker;
  int64_t tokens = 4096;
  int compileTop = 8;
  std::vector<std::string> decode;  // cache layouts whose decode steps are pretuned too
  int64_t decodeBatch = 8;
  // Shape buckets to tune each direction for (tokens of a forward or
  // backward, cache lengths of a decode step); empty: --tokens, for every shape.
  std::vector<int64_t> buckets;
  int leaseSeconds = 600;  // renewed every third of it while a tune runs
  bool wait = true;        // then wait for pairs other workers hold
};

// "spec 3", "spec 3 (backward)", "spec 3 (decode, mixed cache)".
std::string directionName(size_t index, v1::Direction direction) {
  const std::string name = "spec " + std::to_string(index);
  switch (direction) {
    case v1::direction_backward: return name + " (backward)";
    case v1::direction_decode: return name + " (decode, raw cache)";
    case v1::direction_decode_mixed: return name + " (decode, mixed cache)";
    default: return name;
  }
}

int pretune(const PretuneOptions& options) {
  auto text = readTextFile(options.specsPath);
  if (!text) return badInput(text.error().message);
  const auto list = nlohmann::json::parse(*text, nullptr, false);
  if (list.is_discarded() || !list.is_array())
    return badInput(options.specsPath + ": want a JSON array of KernelSpec objects");
  std::vector<KernelSpec> specs;
  for (size_t i = 0; i < list.size(); ++i) {
    auto spec = parseSpecJson(list[i].dump(), options.specsPath + "[" + std::to_string(i) + "]");
    if (!spec) return badInput(spec.error().message);
    if (Status ok = validateSpec(*spec); !ok) return badInput(options.specsPath + "[" + std::to_string(i) + "]: " + ok.error().message);
    specs.push_back(*spec);
  }

  std::shared_ptr<cuda::Device> device;
  v1::Target target;
  if (auto opened = cuda::Device::open(0); opened) {
    device = *opened;
    target = cuda::targetOf(device->info());
  } else if (!options.target.empty()) {
    auto parsed = parseTarget(options.target);
    if (!parsed) return badInput(parsed.error().message);
    target = *parsed;
    std::printf("no GPU on this node: ranking offline for %s (results are marked untimed)\n", target.arch().c_str());
  } else {
    return badInput(opened.error().message + "; pretune runs on GPU nodes (or name --target to rank offline)");
  }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string worker = options.worker.empty() ? std::string(host) + ":" + std::to_string(::getpid()) : options.worker;
  auto client = service::KernelClient::connect(options.server, options.tokenFile);
  if (!client) return badInput(client.error().message);

  std::vector<v1::Direction> directions = {v1::direction_forward, v1::direction_backward};
  for (const std::string& layout : options.decode)
    directions.push_back(layout == "mixed" ? v1::direction_decode_mixed : v1::direction_decode);
  // One tune a (spec, direction) for every shape, or one a shape bucket.
  const std::vector<int64_t> shapes = options.buckets.empty() ? std::vector<int64_t>{options.tokens} : options.buckets;
  struct Item {
    size_t index;
    v1::Direction direction;
    int64_t tokens;
  };
  std::vector<Item> items;
  for (size_t i = 0; i < specs.size(); ++i)
    for (const v1::Direction direction : directions)
      for (const int64_t tokens : shapes) items.push_back({i, direction, tokens});
  int tuned = 0, skipped = 0, failed = 0;
  // One pass over the items; those another worker holds are handed back.
  // Returns an error message if the service cannot be asked.
  auto pass = [&](const std::vector<Item>& todo, std::vector<Item>* held, bool quiet) -> std::string {
    for (const Item& item : todo) {
      const size_t i = item.index;
      const v1::Direction direction = item.direction;
      const KernelSpec& spec = specs[i];
      const bool decode = directionOf(direction) == Direction::decode;
      const std::string bucket =
          options.buckets.empty() ? "" : cache::shapeBucket(direction, decode ? options.decodeBatch : 1, item.tokens);
      const std::string name = directionName(i, direction) + (bucket.empty() ? "" : " [" + bucket + "]");
      // Whether the service has this pair's decision, for this bucket itself.
      auto decided = [&]() -> Result<bool> {
        auto known = (*client)->lookupDecision(spec, target, direction, bucket);
        if (!known) return known.error();
        return known->found() && known->result().shape_bucket() == bucket;
      };
      auto known = decided();
      if (!known) return known.error().message;
      if (*known) {
        if (!quiet)
          std::printf("%s: already tuned for %s\n", name.c_str(),
                      target.device().name().empty() ? target.arch().c_str() : target.device().name().c_str());
        ++skipped;
        continue;
      }
      auto lease = (*client)->acquireLease(spec, target, worker, options.leaseSeconds, direction, bucket);
      if (!lease) return lease.error().message;
      if (!lease->granted()) {
        if (!quiet) std::printf("%s: being tuned by %s\n", name.c_str(), lease->holder().c_str());
        held->push_back(item);
        continue;
      }
      // Asked again now the lease is ours: its last holder may have
      // uploaded the decision and given the lease back just before.
      if (auto since = decided(); since && *since) {
        (void)(*client)->releaseLease(spec, target, worker, direction, bucket);
        if (!quiet) std::printf("%s: tuned by another worker meanwhile\n", name.c_str());
        ++skipped;
        continue;
      }
      std::printf("%s: tuning\n", name.c_str());
      std::fflush(stdout);
      autotune::TuneOptions tuneOptions;
      tuneOptions.tokens = item.tokens;
      tuneOptions.shapeBucketed = !bucket.empty();
      tuneOptions.cacheDir = defaultCacheDir();
      tuneOptions.offlineCompiles = options.compileTop;
      tuneOptions.direction = directionOf(direction);
      tuneOptions.mixedCache = mixedCacheOf(direction);
      // A decode step: one new token per sequence over caches of --tokens,
      // ranked by the cost model (its candidates are not timed on a GPU yet).
      if (decode) tuneOptions.batch = options.decodeBatch;
      std::vector<v1::CompiledKernel> compiled;
      Result<autotune::TuneReport> report = makeError("not tuned");
      bool uploaded = false;
      {  // the lease is renewed every third of its length until the upload is
         // answered (the service compiles the kernel to check it), so a long
         // tune keeps it and a killed worker loses it within one length
        const Heartbeat renewal(std::chrono::milliseconds(options.leaseSeconds * 1000 / 3), [&] {
          (void)(*client)->acquireLease(spec, target, worker, options.leaseSeconds, direction, bucket);
        });
        report = autotune::tune(spec, target, device, tuneOptions, {}, &compiled);
        if (report) {
          if (const v1::CompiledKernel* winner = autotune::winnerOf(*report, compiled)) {
            auto put = (*client)->putTuning(report->result, *winner);
            if (!put) std::printf("%s: upload failed: %s\n", name.c_str(), put.error().message.c_str());
            uploaded = put.ok();
          }
        } else {
          std::printf("%s: tuning failed: %s\n", name.c_str(), report.error().message.c_str());
        }
      }
      (void)(*client)->releaseLease(spec, target, worker, direction, bucket);
      if (uploaded) {
        std::printf("%s: tuned (%s) and uploaded: %s\n", name.c_str(), report->result.measured() ? "measured" : "untimed",
                    report->result.best().ShortDebugString().c_str());
        ++tuned;
      } else {
        ++failed;
      }
      std::fflush(stdout);
    }
    return "";
  };
  std::vector<Item> held;
  if (std::string error = pass(items, &held, false); !error.empty()) return badInput(error);
  // What other workers hold: done when they upload it, or taken over
  // here when a lease lapses (its worker died or was cancelled).
  if (options.wait && !held.empty())
    std::printf("waiting for %zu held by other workers (taken over if a lease lapses)\n", held.size());
  while (options.wait && !held.empty()) {
    std::this_thread::sleep_for(std::chrono::seconds(std::clamp(options.leaseSeconds / 4, 1, 15)));
    std::vector<Item> still;
    if (std::string error = pass(held, &still, true); !error.empty()) return badInput(error);
    held = std::move(still);
  }
  skipped += int(held.size());
  std::printf("pretune: %d tuned, %d skipped, %d failed\n", tuned, skipped, failed);
  return failed ? kExitCheckFailed : kExitOk;
}

}  // namespace

void addPretuneCommand(CLI::App& app, std::function<int()>* action) {
  auto options = std::make_shared<PretuneOptions>();
  CLI::App* cmd = app.add_subcommand(
      "pretune", "Fleet pre-tuning, run on each GPU node: for every spec in SPECS (a JSON array of KernelSpec)\n"
                 "and each direction (the forward kernel, the backward one, and with --decode the decode steps)\n"
                 "with no decision for this node's device model, lease it from the service, tune it here and\n"
                 "upload the result and winning kernel.\n"
                 "Two workers never tune the same pair at once; a worker's lease is renewed while it tunes, and a\n"
                 "worker waits at the end for pairs others hold, taking over any whose lease lapses.");
  cmd->add_option("--server", options->server, "HOST:PORT of the loom service (or several replicas', comma-separated)")
      ->required();
  cmd->add_option("--specs", options->specsPath, "JSON array of KernelSpec objects")->required();
  cmd->add_option("--token-file", options->tokenFile, "the service's bearer token")->required();
  cmd->add_option("--target", options->target, "without a GPU: rank offline for this arch");
  cmd->add_option("--tokens", options->tokens, "N tuned for")->capture_default_str();
  cmd->add_option("--buckets", options->buckets,
                  "tune each direction once per shape bucket instead of once for every shape: token counts\n"
                  "(comma-separated; a decode step's cache lengths at --decode-batch), each filed under its\n"
                  "bucket (n<N>, c<cache>.b<batch>: powers of two) for launches of those shapes and the nearest")
      ->delimiter(',')
      ->check(CLI::Range(int64_t(1), int64_t(1) << 24));
  cmd->add_option("--compile-top", options->compileTop,
                  "without a GPU: compile (and check on the emulator) this many best-ranked candidates per spec\n"
                  "and direction")
      ->capture_default_str();
  cmd->add_option("--worker", options->worker, "worker name in leases (default host:pid)");
  cmd->add_option("--lease-seconds", options->leaseSeconds,
                  "how long a lease lasts unrenewed: renewed every third of it while tuning, so a worker that\n"
                  "dies (or is cancelled) frees its pair within one length")
      ->capture_default_str()
      ->check(CLI::Range(3, 86400));
  cmd->add_flag("!--no-wait", options->wait,
                "finish after one pass, without waiting for the pairs other workers hold (by default a worker\n"
                "waits for them and takes over any whose lease lapses)");
  cmd->add_option("--decode", options->decode,
                  "also pretune the decode step over this cache layout (raw, mixed; may be given twice): one new\n"
                  "token per sequence over caches of --tokens: timed by launchDecode with a GPU, without one\n"
                  "ranked by the cost model and checked on the emulator")
      ->check(CLI::IsMember({"raw", "mixed"}));
  cmd->add_option("--decode-batch", options->decodeBatch, "with --decode: the sequences per step tuned for")
      ->capture_default_str();
  cmd->callback([options, action] { *action = [options] { return pretune(*options); }; });
}

}  // namespace loom::cli
