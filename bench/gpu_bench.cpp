// loom-gpu-bench: times precompiled kernels on the GPU. Each bundle named
// bench.n<N>b<B>.<label>.pb is run on fresh random inputs of that size:
// warm-up, then CUDA-event timings with the L2 flushed before every run,
// and the median reported with TFLOP/s (docs/IHA.md's FLOP count; a
// backward bundle's by FlashAttention's count, 2.5 forwards) and the
// bandwidth of the operands moved once. A backward bundle is timed whole
// (pre-mix, recomputed attention, prep, dK/dV, dQ, un-mix, reduce) on a
// fresh dout as well, and, where the bundle has a keeping forward beside it
// (NAME-keep: its mixing materialised, collapse separate), again from what
// that forward kept (row NAME-kept: no pre-mix, no recomputed attention,
// loom.torch's default training step). Prints a table; with a second
// argument also writes it as JSON there (bench/report.py reads it).
// A decode bundle, bench-decode.c<C>b<B>.<label>.pb, is one step of one new
// token per sequence over B raw paged caches of C tokens (16-token pages
// under a shuffled page table, random values), timed without the page-table
// check (the kernel alone; the first launch is checked), with the bandwidth
// of the cache it reads and the bytes both cache layouts would take.
// A ragged bundle, bench-ragged.<name>.pb with bench-ragged.<name>.txt
// beside it (two lines: each sequence's cached tokens, and its new tokens,
// comma-separated; bench/peers.py --emit writes them), is one ragged step
// (docs/IHA.md, Ragged steps) of those sequences' new tokens packed under
// query_start_loc, timed the same way, with the bytes the step moves.
// Every row also gives the host's time a launch call at steady state
// (200 calls queued on a stream, on the host clock).
//
//   loom-gpu-bench build/gpu-bundles [results.json]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "autotune/cost_model.h"
#include "autotune/measure.h"
#include "cuda/case_runner.h"
#include "cuda/driver.h"
#include "io/case.h"
#include "loom/runtime.h"

namespace fs = std::filesystem;
using namespace loom;

namespace {

// Three warm-up launches, then exactly 20 timed ones.
constexpr autotune::TimingPlan kPlan{3, 20, 20, 0};

constexpr int64_t kDecodePageSize = 16;

// The host's cost of one launch call at steady state (the issue's target:
// at most 5 us): after a warm-up on a stream of its own, 200 calls queued
// on it, timed on the host clock before the stream is waited on.
template <class Launch>
Result<double> hostMicrosPerCall(const cuda::Device& device, Launch launch) {
  constexpr int kCalls = 200;
  const cuda::DriverApi& api = device.api();
  CUstream stream = nullptr;
  if (Status ok = cuda::check(api.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate"); !ok)
    return ok.error();
  Status ok = launch(stream);
  if (ok) ok = cuda::check(api.cuStreamSynchronize(stream), "warm-up");
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; ok && i < kCalls; ++i) ok = launch(stream);
  const double micros = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
  if (ok) ok = cuda::check(api.cuStreamSynchronize(stream), "the timed calls");
  api.cuStreamDestroy(stream);
  if (!ok) return ok.error();
  return micros / kCalls;
}

// One decode step over B sequences, sequence b with cached[b] tokens in the
// cache and fresh[b] new ones: a uniform step of one token each (ragged
// false: q [B, 1, H, d]) or a ragged one (q [total, H, d] under
// query_start_loc). Device buffers of random values under a shuffled page
// table, the launch checked once, then timed.
Result<autotune::Timing> timeDecode(Kernel& kernel, const cuda::Device& device, const cuda::DeviceBuffer& flush,
                                    const KernelSpec& spec, const std::vector<int64_t>& cached,
                                    const std::vector<int64_t>& fresh, bool ragged, std::mt19937_64& rng,
                                    double* hostMicros) {
  const int64_t batch = int64_t(cached.size());
  int64_t total = 0, most = 0, pagesPer = 1;
  std::vector<int32_t> starts = {0};
  for (int64_t b = 0; b < batch; ++b) {
    total += fresh[size_t(b)];
    most = std::max(most, fresh[size_t(b)]);
    starts.push_back(int32_t(total));
    pagesPer = std::max(pagesPer, (cached[size_t(b)] + fresh[size_t(b)] + kDecodePageSize - 1) / kDecodePageSize);
  }
  const IhaCase step = drawCase(spec, ragged ? 1 : batch, ragged ? total : 1, rng());
  auto buffers = cuda::CaseBuffers::upload(device, step);
  if (!buffers) return buffers.error();
  IhaTensors tensors = buffers->tensors();
  if (ragged) {  // [1, total, ...] as the packed [total, ...]; no lse
    for (Tensor* x : {&tensors.q, &tensors.k, &tensors.v, &tensors.out}) x->shape.erase(x->shape.begin());
    tensors.lse.reset();
  }
  const int64_t pages = batch * pagesPer;
  const int64_t perPage = kDecodePageSize * spec.kv_heads() * spec.head_dim();
  // One chunk of random values in the dtype, repeated over the cache.
  std::normal_distribution<double> normal;
  std::vector<double> values(static_cast<size_t>(std::min<int64_t>(pages * perPage, int64_t(1) << 22)));
  for (double& x : values) x = normal(rng);
  const NpyArray chunk = npyFromDouble(values, {int64_t(values.size())}, storageTypeOf(spec.dtype()));
  std::vector<cuda::DeviceBuffer> owned;
  for (int role = 0; role < 2; ++role) {
    auto buffer = cuda::DeviceBuffer::allocate(device, size_t(pages * perPage * 2));
    if (!buffer) return buffer.error();
    for (size_t at = 0; at < buffer->size(); at += chunk.bytes.size())
      if (Status ok = cuda::check(device.api().cuMemcpyHtoD(buffer->get() + at, chunk.bytes.data(),
                                                            std::min(chunk.bytes.size(), buffer->size() - at)),
                                  "cuMemcpyHtoD");
          !ok)
        return ok.error();
    owned.push_back(std::move(*buffer));
  }
  std::vector<int32_t> order(static_cast<size_t>(pages)), lengths(cached.begin(), cached.end());
  for (int64_t i = 0; i < pages; ++i) order[size_t(i)] = int32_t(i);
  std::shuffle(order.begin(), order.end(), rng);
  for (const std::vector<int32_t>* ints : {&order, &lengths, &starts}) {
    auto buffer = cuda::DeviceBuffer::allocate(device, ints->size() * sizeof(int32_t));
    if (!buffer) return buffer.error();
    if (Status ok = cuda::check(device.api().cuMemcpyHtoD(buffer->get(), ints->data(), ints->size() * sizeof(int32_t)),
                                "cuMemcpyHtoD");
        !ok)
      return ok.error();
    owned.push_back(std::move(*buffer));
  }
  const std::vector<int64_t> shape = {pages, kDecodePageSize, spec.kv_heads(), spec.head_dim()};
  const ElementKind element = spec.dtype() == v1::float16 ? ElementKind::float16 : ElementKind::bfloat16;
  PagedCacheTensors cache;
  cache.k_cache = Tensor{owned[0].data(), element, shape, {}, device.info().ordinal};
  cache.v_cache = Tensor{owned[1].data(), element, shape, {}, device.info().ordinal};
  cache.page_table = static_cast<const int32_t*>(owned[2].data());
  cache.cache_len = static_cast<const int32_t*>(owned[3].data());
  cache.max_pages = pagesPer;
  if (ragged) {
    cache.query_start_loc = static_cast<const int32_t*>(owned[4].data());
    cache.batch = batch;
    cache.max_query_len = most;
  }
  if (Status ok = kernel.launchDecode(tensors, cache); !ok) return ok.error();  // checked once
  auto host =
      hostMicrosPerCall(device, [&](CUstream stream) { return kernel.launchDecode(tensors, cache, stream, false); });
  if (!host) return host.error();
  *hostMicros = *host;
  return autotune::timeRuns([&](int) { return kernel.launchDecode(tensors, cache, nullptr, /*checkPages=*/false); },
                            device, flush, kPlan);
}

// A ragged bundle at `path` (its counts in the .txt beside it): one row,
// direction "ragged", with the bytes the step moves at least (the raw cache
// it reads, every sequence's cached and new tokens, and the new tokens' q,
// k, v and out) and their rate.
Status timeRagged(const fs::path& path, const std::string& label, const std::shared_ptr<cuda::Device>& gpu,
                  const cuda::DeviceBuffer& flush, std::mt19937_64& rng, nlohmann::json& results) {
  std::ifstream counts(fs::path(path).replace_extension(".txt"));
  std::string cachedLine, freshLine;
  if (!std::getline(counts, cachedLine) || !std::getline(counts, freshLine))
    return makeError("no counts beside it (" + fs::path(path).replace_extension(".txt").string() + ")");
  auto parse = [](const std::string& line) {
    std::vector<int64_t> values;
    std::stringstream in(line);
    for (std::string item; std::getline(in, item, ',');) values.push_back(std::stoll(item));
    return values;
  };
  const std::vector<int64_t> cached = parse(cachedLine), fresh = parse(freshLine);
  if (cached.empty() || cached.size() != fresh.size()) return makeError("the counts' two lines differ in length");
  v1::CompiledKernel compiled;
  std::ifstream in(path, std::ios::binary);
  if (!compiled.ParseFromIstream(&in) || compiled.direction() != v1::direction_decode)
    return makeError("not a raw-cache decode kernel");
  auto kernel = Kernel::load(gpu, compiled);
  if (!kernel) return kernel.error();
  double hostMicros = 0;
  auto timing = timeDecode(**kernel, *gpu, flush, compiled.spec(), cached, fresh, /*ragged=*/true, rng, &hostMicros);
  if (!timing) return timing.error();
  const KernelSpec& spec = compiled.spec();
  int64_t tokens = 0, total = 0;
  for (size_t b = 0; b < cached.size(); ++b) tokens += cached[b] + fresh[b], total += fresh[b];
  const double bytes = double(tokens) * double(cacheBytesPerToken(spec, CacheLayout::raw)) +
                       2.0 * double(total) * double((2 * spec.heads() + 2 * spec.kv_heads()) * spec.head_dim());
  const double median = timing->medianMs;
  std::printf("%-34s %4zu %6lld %10.3f %10.3f %9s %9.1f %9.1f  (ragged; %lld new tokens, %.2f GB moved)\n",
              label.c_str(), cached.size(), (long long)total, median, timing->p90Ms, "-", bytes / (median * 1e-3) / 1e9,
              hostMicros, (long long)total, bytes / 1e9);
  results.push_back({{"name", label},
                     {"batch", int64_t(cached.size())},
                     {"tokens", total},
                     {"median_ms", median},
                     {"p90_ms", timing->p90Ms},
                     {"direction", "ragged"},
                     {"launch_host_us", hostMicros},
                     {"bytes_moved", bytes},
                     {"gbps", bytes / (median * 1e-3) / 1e9}});
  return Status::success();
}

// The backward from a kept forward: the keeping forward bundle at `keeping`
// run once on the case's inputs into SavedBuffers, then the backward timed
// from them; a row named `label` (direction backward_kept, saved_bytes the
// rows kept between the passes).
Status timeKeptBackward(Kernel& backward, const std::shared_ptr<cuda::Device>& gpu, const cuda::DeviceBuffer& flush,
                        const fs::path& keeping, const IhaCase& c, const IhaTensors& inputs, const std::string& label,
                        nlohmann::json& results) {
  v1::CompiledKernel compiled;
  std::ifstream in(keeping, std::ios::binary);
  if (!compiled.ParseFromIstream(&in)) return makeError("cannot read " + keeping.string());
  const cuda::Device& device = *gpu;
  auto forward = Kernel::load(gpu, compiled);
  if (!forward) return forward.error();
  auto saved = cuda::SavedBuffers::allocate(device, c.spec, c.batch, c.tokens);
  if (!saved) return saved.error();
  auto grads = cuda::GradBuffers::upload(device, c);
  if (!grads) return grads.error();
  if (Status ok = (*forward)->launch(inputs, nullptr, &saved->saved()); !ok) return ok;
  auto timing = autotune::timeRuns(
      [&](int) { return backward.launchBackward(inputs, grads->tensors(), nullptr, &saved->saved()); }, device, flush,
      kPlan);
  if (!timing) return timing.error();
  const double median = timing->medianMs, flops = autotune::ihaBackwardFlops(c.spec, c.batch, c.tokens);
  std::printf("%-34s %4lld %6lld %10.3f %10.3f %9.1f %9s %9s\n", label.c_str(), (long long)c.batch,
              (long long)c.tokens, median, timing->p90Ms, flops / (median * 1e-3) / 1e12, "", "");
  results.push_back({{"name", label},
                     {"batch", c.batch},
                     {"tokens", c.tokens},
                     {"median_ms", median},
                     {"p90_ms", timing->p90Ms},
                     {"tflops", flops / (median * 1e-3) / 1e12},
                     {"direction", "backward_kept"},
                     {"engine", backward.compiled().schedule().engine() == v1::engine_wgmma ? "wgmma" : "mma"},
                     {"workspace_bytes", workspaceBytes(backward.compiled(), c.batch, c.tokens)},
                     {"saved_bytes", saved->bytes()}});
  return Status::success();
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : "build/gpu-bundles";
  const std::string jsonPath = argc > 2 ? argv[2] : "";
  nlohmann::json results = nlohmann::json::array();
  auto device = cuda::Device::open(0);
  if (!device) {
    std::fprintf(stderr, "loom-gpu-bench: %s\n", device.error().message.c_str());
    return 2;
  }
  auto flush = cuda::DeviceBuffer::allocate(**device, autotune::kL2FlushBytes);
  if (!flush) return 2;
  std::mt19937_64 rng(std::random_device{}());

  std::printf("device: %s (%s, %d SMs)\n", (*device)->info().name.c_str(), (*device)->info().arch().c_str(),
              (*device)->info().smCount);
  std::printf("%-34s %4s %6s %10s %10s %9s %9s %9s\n", "kernel", "B", "N", "median ms", "p90 ms", "TFLOP/s", "GB/s",
              "launch us");  // the host's time a launch call
  const std::regex name(R"(bench\.n(\d+)b(\d+)\.([^.]+)\.pb)");
  const std::regex decodeName(R"(bench-decode\.c(\d+)b(\d+)\.([^.]+)\.pb)");
  const std::regex raggedName(R"(bench-ragged\.([^.]+)\.pb)");
  std::vector<fs::path> files;
  if (fs::is_directory(dir))
    for (const auto& entry : fs::directory_iterator(dir)) files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  int failures = 0;
  for (const fs::path& path : files) {
    std::smatch m;
    const std::string file = path.filename().string();
    if (std::regex_match(file, m, decodeName)) {
      const int64_t cached = std::stoll(m[1]), batch = std::stoll(m[2]);
      v1::CompiledKernel compiled;
      std::ifstream in(path, std::ios::binary);
      if (!compiled.ParseFromIstream(&in) || compiled.direction() != v1::direction_decode) continue;
      auto kernel = Kernel::load(*device, compiled);
      double hostMicros = 0;
      auto timing = kernel ? timeDecode(**kernel, **device, *flush, compiled.spec(),
                                        std::vector<int64_t>(size_t(batch), cached), std::vector<int64_t>(size_t(batch), 1),
                                        /*ragged=*/false, rng, &hostMicros)
                           : Result<autotune::Timing>(kernel.error());
      if (!timing) {
        std::printf("%-34s decode failed: %s\n", m[3].str().c_str(), timing.error().message.c_str());
        ++failures;
        continue;
      }
      const KernelSpec& spec = compiled.spec();
      const int64_t tokens = batch * (cached + 1);
      const double raw = double(tokens) * double(cacheBytesPerToken(spec, CacheLayout::raw));
      const double mixed = double(tokens) * double(cacheBytesPerToken(spec, CacheLayout::mixed));
      const double median = timing->medianMs;
      std::printf("%-34s %4lld %6lld %10.3f %10.3f %9s %9.1f %9.1f  (decode; cache %.2f GB raw, %.2f GB mixed)\n",
                  m[3].str().c_str(), (long long)batch, (long long)cached, median, timing->p90Ms, "-",
                  raw / (median * 1e-3) / 1e9, hostMicros, raw / 1e9, mixed / 1e9);
      results.push_back({{"name", m[3].str()},
                         {"batch", batch},
                         {"tokens", cached},
                         {"median_ms", median},
                         {"p90_ms", timing->p90Ms},
                         {"direction", "decode"},
                         {"launch_host_us", hostMicros},
                         {"cache_bytes_raw", raw},
                         {"cache_bytes_mixed", mixed},
                         {"cache_gbps", raw / (median * 1e-3) / 1e9}});
      if (!jsonPath.empty()) {
        std::ofstream out(jsonPath, std::ios::trunc);
        out << nlohmann::json{{"device", (*device)->info().name}, {"results", results}}.dump(2) << "\n";
      }
      continue;
    }
    if (std::regex_match(file, m, raggedName)) {
      if (Status ok = timeRagged(path, m[1].str(), *device, *flush, rng, results); !ok) {
        std::printf("%-34s ragged step failed: %s\n", m[1].str().c_str(), ok.error().message.c_str());
        ++failures;
      }
      if (!jsonPath.empty()) {
        std::ofstream out(jsonPath, std::ios::trunc);
        out << nlohmann::json{{"device", (*device)->info().name}, {"results", results}}.dump(2) << "\n";
      }
      continue;
    }
    if (!std::regex_match(file, m, name)) continue;
    const int64_t tokens = std::stoll(m[1]), batch = std::stoll(m[2]);
    v1::CompiledKernel compiled;
    std::ifstream in(path, std::ios::binary);
    if (!compiled.ParseFromIstream(&in)) continue;
    auto kernel = Kernel::load(*device, compiled);
    if (!kernel) {
      std::printf("%-34s load failed: %s\n", m[3].str().c_str(), kernel.error().message.c_str());
      ++failures;
      continue;
    }
    const KernelSpec& spec = compiled.spec();
    const bool backward = compiled.direction() == v1::direction_backward;
    IhaCase c = drawCase(spec, batch, tokens, rng());
    if (backward) c.dout = drawDout(spec, batch, tokens, rng());
    auto buffers = cuda::CaseBuffers::upload(**device, c);
    if (!buffers) return 2;
    Result<autotune::Timing> timing = makeError("not timed");
    Result<double> hostMicros = makeError("not timed");
    if (backward) {
      auto grads = cuda::GradBuffers::upload(**device, c);
      if (!grads) return 2;
      timing = autotune::timeRuns([&](int) { return (*kernel)->launchBackward(buffers->tensors(), grads->tensors()); },
                                  **device, *flush, kPlan);
      hostMicros = hostMicrosPerCall(**device, [&](CUstream stream) {
        return (*kernel)->launchBackward(buffers->tensors(), grads->tensors(), stream);
      });
    } else {
      timing = autotune::timeLaunches(**kernel, **device, {buffers->tensors()}, *flush, kPlan);
      hostMicros = hostMicrosPerCall(**device,
                                     [&](CUstream stream) { return (*kernel)->launch(buffers->tensors(), stream); });
    }
    if (timing && !hostMicros) timing = hostMicros.error();
    if (!timing) {
      std::printf("%-34s launch failed: %s\n", m[3].str().c_str(), timing.error().message.c_str());
      ++failures;
      continue;
    }
    const fs::path keeping = fs::path(path).parent_path() / ("bench.n" + m[1].str() + "b" + m[2].str() + "." +
                                                              m[3].str() + "-keep.pb");
    if (backward && fs::exists(keeping)) {
      if (Status ok = timeKeptBackward(**kernel, *device, *flush, keeping, c, buffers->tensors(), m[3].str() + "-kept",
                                       results);
          !ok) {
        std::printf("%-34s kept backward failed: %s\n", (m[3].str() + "-kept").c_str(), ok.error().message.c_str());
        ++failures;
      }
    }
    const double median = timing->medianMs, p90 = timing->p90Ms;
    const double flops =
        backward ? autotune::ihaBackwardFlops(spec, batch, tokens) : autotune::ihaFlops(spec, batch, tokens);
    const double bytes = autotune::operandBytes(spec, batch, tokens);
    std::printf("%-34s %4lld %6lld %10.3f %10.3f %9.1f %9.1f %9.1f\n", m[3].str().c_str(), (long long)batch,
                (long long)tokens, median, p90, flops / (median * 1e-3) / 1e12, bytes / (median * 1e-3) / 1e9,
                *hostMicros);
    results.push_back({{"name", m[3].str()},
                       {"batch", batch},
                       {"tokens", tokens},
                       {"median_ms", median},
                       {"p90_ms", p90},
                       {"tflops", flops / (median * 1e-3) / 1e12},
                       {"direction", backward ? "backward" : "forward"},
                       {"launch_host_us", *hostMicros},
                       {"engine", compiled.schedule().engine() == v1::engine_wgmma ? "wgmma" : "mma"},
                       {"workspace_bytes", workspaceBytes(compiled, batch, tokens)}});
    // Rewritten after every kernel: a later hang (killed by a timeout) keeps what was measured.
    if (!jsonPath.empty()) {
      std::ofstream out(jsonPath, std::ios::trunc);
      out << nlohmann::json{{"device", (*device)->info().name}, {"results", results}}.dump(2) << "\n";
    }
  }
  return failures ? 1 : 0;
}
