// runOnHost and runOnEmulator: the host API on host tensors. The tensors are
// gathered into the doubles the CPU backend and the emulator take, the
// spec's program runs on the host tile API or its CUDA program on the
// emulator, and out (and lse) are written back through their strides.
#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "api/strided.h"
#include "cpu/cpu_backend.h"
#include "emu/emulator.h"
#include "io/npy.h"
#include "loom/runtime.h"

namespace loom {
namespace {

NpyType npyTypeOf(ElementKind element) {
  switch (element) {
    case ElementKind::float16: return NpyType::float16;
    case ElementKind::bfloat16: return NpyType::uint16;  // bfloat16 bit patterns
    default: return NpyType::float32;
  }
}

// Calls visit(elementOffset, denseIndex) for every element, in C order.
template <typename Visit>
void forEachElement(const Tensor& t, Visit visit) {
  loom::forEachElement(t.shape, stridesOf(t), visit);
}

}  // namespace

std::vector<double> hostValues(const Tensor& t) {
  NpyArray dense;
  dense.type = npyTypeOf(t.element);
  dense.shape = t.shape;
  const int64_t size = NpyArray::elementSize(dense.type);
  dense.bytes.resize(size_t(dense.elementCount() * size));
  const auto* base = static_cast<const uint8_t*>(t.data);
  forEachElement(t, [&](int64_t offset, int64_t i) {
    std::memcpy(&dense.bytes[size_t(i * size)], base + offset * size, size_t(size));
  });
  return npyToDouble(dense);
}

namespace {

void scatter(const std::vector<double>& values, const Tensor& t) {
  const NpyArray dense = npyFromDouble(values, t.shape, npyTypeOf(t.element));
  const int64_t size = NpyArray::elementSize(dense.type);
  auto* base = static_cast<uint8_t*>(t.data);
  forEachElement(t, [&](int64_t offset, int64_t i) {
    std::memcpy(base + offset * size, &dense.bytes[size_t(i * size)], size_t(size));
  });
}

// A varlen launch's bounds (host memory), checked, into the case.
Status documentsInto(const IhaTensors& t, IhaCase& c) {
  if (!t.cu_seqlens) return Status::success();
  c.inputs.cu_seqlens.assign(t.cu_seqlens, t.cu_seqlens + t.documents + 1);
  return validateCuSeqlens(c.inputs.cu_seqlens.data(), t.documents + 1, c.tokens);
}

// The host tensors as a case for the CPU backend or the emulator.
Result<IhaCase> hostCase(const KernelSpec& spec, const IhaTensors& given) {
  if (Status ok = validateSpec(spec); !ok) return ok.error();
  if (Status ok = validateTensors(spec, given, kHostDevice); !ok) return ok.error();
  const IhaTensors t = batchedView(spec, given);
  IhaCase c;
  c.spec = spec;
  c.batch = t.q.shape[0];
  c.tokens = t.q.shape[1];
  c.inputs = {c.batch,
              c.tokens,
              hostValues(t.q),
              hostValues(t.k),
              hostValues(t.v),
              hostValues(t.alpha_q),
              hostValues(t.alpha_k),
              hostValues(t.alpha_v),
              hostValues(t.collapse)};
  if (Status ok = documentsInto(t, c); !ok) return ok.error();
  return c;
}

// Generated plans kept for the life of the process, by everything that
// decides one (spec, schedule, target and direction, serialized): a
// steady-state host call generates nothing (loom/counters.h). A process
// sees a handful of specs, so nothing is evicted.
Result<std::shared_ptr<const KernelPlan>> keptPlan(const KernelSpec& spec, const Schedule& schedule,
                                                   const v1::Target& target, const GenerateOptions& options = {}) {
  std::string key = spec.SerializeAsString();
  key += '\0' + schedule.SerializeAsString() + '\0' + target.SerializeAsString() + '\0' +
         std::to_string(int(options.direction)) + (options.mixedCache ? "m" : "r");
  static std::mutex mutex;
  static std::unordered_map<std::string, std::shared_ptr<const KernelPlan>> plans;
  {
    std::lock_guard lock(mutex);
    if (auto found = plans.find(key); found != plans.end()) return found->second;
  }
  auto plan = generateKernel(spec, schedule, target, options);
  if (!plan) return plan.error();
  std::lock_guard lock(mutex);
  return plans.emplace(key, std::make_shared<const KernelPlan>(std::move(*plan))).first->second;
}

// The case of the host tensors and the spec's program for `arch`.
struct HostProgram {
  IhaCase c;
  std::shared_ptr<const KernelPlan> plan;
};
// With `keep`, the schedule keepingSchedule makes of `schedule`.
Result<HostProgram> hostProgram(const KernelSpec& spec, const IhaTensors& t, const Schedule& schedule,
                                const std::string& arch, const IhaSaved* keep) {
  auto c = hostCase(spec, t);
  if (!c) return c.error();
  auto target = parseTarget(arch);
  if (!target) return target.error();
  Schedule chosen = schedule;
  if (keep) {
    if (Status ok = validateSaved(spec, *keep, c->batch, c->tokens, arch != "cpu", kHostDevice); !ok) return ok.error();
    auto keeping = keepingSchedule(schedule);
    if (!keeping) return keeping.error();
    chosen = *keeping;
  }
  auto plan = keptPlan(spec, chosen, *target);
  if (!plan) return plan.error();
  return HostProgram{std::move(*c), *plan};
}

// The saved tensors (dense, validated) as the backends hold a kept forward, and back.
const Tensor* savedRows(const IhaSaved& s, Workspace w) {
  return w == Workspace::q_mixed ? &s.q_mixed : w == Workspace::k_mixed ? &s.k_mixed
                                         : w == Workspace::v_mixed ? &s.v_mixed : &s.o_pseudo;
}
size_t bytesOf(const Tensor& t) {
  size_t count = 1;
  for (int64_t extent : t.shape) count *= size_t(extent);
  return count * size_t(elementBytes(t.element));
}
KeptForward keptFrom(const IhaSaved& s) {
  KeptForward kept;
  for (Workspace w : kKeptWorkspaces) {
    const Tensor& t = *savedRows(s, w);
    const auto* bytes = static_cast<const uint8_t*>(t.data);
    kept.rows[w].assign(bytes, bytes + bytesOf(t));
  }
  const auto* lse = static_cast<const float*>(s.lse.data);
  kept.lse.assign(lse, lse + bytesOf(s.lse) / sizeof(float));
  return kept;
}
Status writeKept(const KeptForward& kept, const IhaSaved& s) {
  for (Workspace w : kKeptWorkspaces) {
    const Tensor& t = *savedRows(s, w);
    auto found = kept.rows.find(w);
    if (found == kept.rows.end() || found->second.size() != bytesOf(t))
      return makeError("the forward kept no " + workspaceName(w) + " of the saved tensor's size");
    std::memcpy(t.data, found->second.data(), found->second.size());
  }
  std::memcpy(s.lse.data, kept.lse.data(), std::min(kept.lse.size() * sizeof(float), bytesOf(s.lse)));
  return Status::success();
}

// out (and lse) written back through their strides.
void scatterOutputs(const std::vector<double>& out, const std::vector<double>& lse, const IhaTensors& t) {
  scatter(out, t.out);
  if (t.lse) scatter(lse, *t.lse);
}

}  // namespace

Status runOnHost(const KernelSpec& spec, const IhaTensors& t, const Schedule& schedule, const cpu::CpuOptions& options,
                 const IhaSaved* keep) {
  auto program = hostProgram(spec, t, schedule, "cpu", keep);
  if (!program) return program.error();
  KeptForward kept;
  auto outputs = cpu::runPlan(*program->plan, program->c, options, keep ? &kept : nullptr);
  if (!outputs) return outputs.error();
  scatterOutputs(outputs->out, outputs->lse, t);
  if (keep) return writeKept(kept, *keep);
  return Status::success();
}

Result<emu::EmuRun> runOnEmulator(const KernelSpec& spec, const IhaTensors& t, const Schedule& schedule,
                                  const std::string& arch, const emu::EmuOptions& options, const IhaSaved* keep) {
  auto program = hostProgram(spec, t, schedule, arch, keep);
  if (!program) return program.error();
  KeptForward kept;
  emu::EmuOptions withKeep = options;
  if (keep) withKeep.keep = &kept;
  auto run = emu::runOnEmulator(*program->plan, program->c, withKeep);
  if (!run) return run.error();
  scatterOutputs(run->out, run->lse, t);
  if (keep)
    if (Status ok = writeKept(kept, *keep); !ok) return ok.error();
  return run;
}

Status runDecodeOnHost(const KernelSpec& spec, const IhaTensors& step, const PagedCacheTensors& cache,
                       const Schedule& schedule, const cpu::CpuOptions& options) {
  if (Status ok = validateSpec(spec); !ok) return ok.error();
  if (Status ok = validateDecodeTensors(spec, step, cache, kHostDevice); !ok) return ok.error();
  // A ragged step's packed rows come in as one batch of its tokens, then
  // take its sequences and offsets.
  const IhaTensors packed = packedView(step, cache);
  auto c = hostCase(spec, packed);
  if (!c) return c.error();
  const bool ragged = cache.query_start_loc != nullptr;
  const int64_t total = c->tokens;
  if (ragged) {
    c->batch = c->inputs.batch = cache.batch;
    c->tokens = c->inputs.tokens = cache.max_query_len;
    c->inputs.query_start_loc.assign(cache.query_start_loc, cache.query_start_loc + cache.batch + 1);
  }
  DecodeCase dc;
  dc.spec = spec;
  dc.layout = cache.layout;
  dc.shape = {c->batch, c->tokens, cache.k_cache.shape[0], cache.k_cache.shape[1], cache.max_pages, ragged ? total : 0};
  dc.step = c->inputs;
  reference::PagedCache& paged = dc.cache;
  paged.mixed = cache.layout == CacheLayout::mixed;
  paged.numPages = dc.shape.numPages;
  paged.pageSize = dc.shape.pageSize;
  paged.maxPages = cache.max_pages;
  paged.k = hostValues(cache.k_cache);
  paged.v = hostValues(cache.v_cache);
  paged.pageTable.assign(cache.page_table, cache.page_table + c->batch * cache.max_pages);
  paged.cacheLen.assign(cache.cache_len, cache.cache_len + c->batch);
  GenerateOptions generate;
  generate.direction = Direction::decode;
  generate.mixedCache = paged.mixed;
  auto plan = keptPlan(spec, schedule, *parseTarget("cpu"), generate);
  if (!plan) return plan.error();
  auto outputs = cpu::runDecodePlan(**plan, dc, options);
  if (!outputs) return outputs.error();
  scatterOutputs(outputs->out, outputs->lse, packed);
  // Only the new tokens' slots go back: the rest of the cache is the caller's.
  const int64_t E = reference::cacheTokenElements(spec, paged.mixed), bytes = elementBytes(cache.k_cache.element);
  const NpyType type = npyTypeOf(cache.k_cache.element);
  for (int64_t b = 0; b < c->batch; ++b)
    for (int64_t t = 0; t < reference::stepRows(dc.step, b).count; ++t) {
      const int64_t slot = reference::cacheSlot(paged, b, paged.cacheLen[size_t(b)] + t);
      for (const auto& [values, tensor] : {std::pair{&outputs->cache.k, &cache.k_cache}, {&outputs->cache.v, &cache.v_cache}}) {
        const std::vector<double> row(values->begin() + slot * E, values->begin() + (slot + 1) * E);
        const NpyArray dense = npyFromDouble(row, {E}, type);
        std::memcpy(static_cast<uint8_t*>(tensor->data) + slot * E * bytes, dense.bytes.data(), size_t(E * bytes));
      }
    }
  return Status::success();
}

namespace {

// The host tensors and dout as a backward case, and the backward plan.
Result<HostProgram> hostBackward(const KernelSpec& spec, const IhaTensors& givenInputs, const IhaGradTensors& givenGrads,
                                 const Schedule& schedule, const std::string& arch, const IhaSaved* saved) {
  if (Status ok = validateSpec(spec); !ok) return ok.error();
  if (Status ok = validateGradTensors(spec, givenInputs, givenGrads, kHostDevice); !ok) return ok.error();
  const IhaTensors t = batchedView(spec, givenInputs);
  const IhaGradTensors g = batchedView(spec, givenGrads);
  if (saved)
    if (Status ok = validateSaved(spec, *saved, t.q.shape[0], t.q.shape[1], arch != "cpu", kHostDevice); !ok)
      return ok.error();
  IhaCase c;
  c.spec = spec;
  c.batch = t.q.shape[0];
  c.tokens = t.q.shape[1];
  c.inputs = {c.batch,           c.tokens,          hostValues(t.q),        hostValues(t.k),
              hostValues(t.v),   hostValues(t.alpha_q), hostValues(t.alpha_k), hostValues(t.alpha_v),
              hostValues(t.collapse)};
  c.dout = hostValues(g.dout);
  if (Status ok = documentsInto(t, c); !ok) return ok.error();
  auto target = parseTarget(arch);
  if (!target) return target.error();
  GenerateOptions options;
  options.direction = Direction::backward;
  auto plan = keptPlan(spec, schedule, *target, options);
  if (!plan) return plan.error();
  return HostProgram{std::move(c), *plan};
}

void scatterGradients(const reference::IhaGradients& gradients, const std::vector<double>& lse, const IhaTensors& t,
                      const IhaGradTensors& g) {
  const auto values = reference::gradientsOf(gradients);
  const Tensor* targets[] = {&g.dq, &g.dk, &g.dv, &g.dalpha_q, &g.dalpha_k, &g.dalpha_v, &g.dcollapse};
  for (size_t i = 0; i < values.size(); ++i) scatter(*values[i], *targets[i]);
  if (t.lse) scatter(lse, *t.lse);
}

}  // namespace

Status runBackwardOnHost(const KernelSpec& spec, const IhaTensors& t, const IhaGradTensors& g, const Schedule& schedule,
                         const cpu::CpuOptions& options, const IhaSaved* saved) {
  auto program = hostBackward(spec, t, g, schedule, "cpu", saved);
  if (!program) return program.error();
  const KeptForward kept = saved ? keptFrom(*saved) : KeptForward{};
  auto outputs = cpu::runBackwardPlan(*program->plan, program->c, options, saved ? &kept : nullptr);
  if (!outputs) return outputs.error();
  scatterGradients(outputs->gradients, outputs->lse, t, g);
  return Status::success();
}

Result<emu::EmuRun> runBackwardOnEmulator(const KernelSpec& spec, const IhaTensors& t, const IhaGradTensors& g,
                                          const Schedule& schedule, const std::string& arch,
                                          const emu::EmuOptions& options, const IhaSaved* saved) {
  auto program = hostBackward(spec, t, g, schedule, arch, saved);
  if (!program) return program.error();
  const KeptForward kept = saved ? keptFrom(*saved) : KeptForward{};
  emu::EmuOptions withKept = options;
  if (saved) withKept.kept = &kept;
  auto run = emu::runOnEmulator(*program->plan, program->c, withKept);
  if (!run) return run.error();
  scatterGradients(*run->gradients, run->lse, t, g);
  return run;
}

}  // namespace loom
