// Random specs and schedules (valid or not) through generateKernel for the
// CPU, sm_80 and sm_90a: a plan or a clean error, never a crash or an
// assertion. Sizes are bounded so each run stays fast.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdlib>

#include "loom/compiler.h"
#include "loom/spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  loom::KernelSpec spec;
  spec.set_kv_heads(in.ConsumeIntegralInRange(0, 8));
  spec.set_heads(spec.kv_heads() * in.ConsumeIntegralInRange(0, 4) + in.ConsumeIntegralInRange(0, 1));
  spec.set_pseudo_heads(in.ConsumeIntegralInRange(0, 9));
  spec.set_head_dim(in.PickValueInArray({0, 8, 16, 24, 32, 48, 64, 80, 96, 128, 160, 256, 512}));
  spec.set_dtype(static_cast<loom::v1::DType>(in.ConsumeIntegralInRange(0, 4)));
  spec.set_mask(static_cast<loom::v1::MaskMode>(in.ConsumeIntegralInRange(0, 4)));
  spec.set_collapse(static_cast<loom::v1::CollapseMode>(in.ConsumeIntegralInRange(0, 3)));
  spec.set_window(in.ConsumeIntegralInRange(-1, 300));
  if (in.ConsumeBool()) spec.set_rope_theta(in.ConsumeFloatingPointInRange(-1.0, 1e6));
  if (in.ConsumeBool()) spec.set_scale(in.ConsumeFloatingPointInRange(-1.0, 4.0));
  spec.set_qk_norm(static_cast<loom::v1::KernelSpec::QkNorm>(in.ConsumeIntegralInRange(0, 2)));
  if (in.ConsumeBool()) spec.set_qk_norm_eps(in.ConsumeFloatingPointInRange(-1e-3, 1e-3));
  spec.set_rope_direction(static_cast<loom::v1::KernelSpec::RopeDirection>(in.ConsumeIntegralInRange(0, 2)));
  spec.set_window_align(static_cast<loom::v1::KernelSpec::WindowAlign>(in.ConsumeIntegralInRange(0, 2)));
  if (in.ConsumeBool()) spec.set_window_rows(in.ConsumeIntegralInRange(-1, 300));
  loom::Schedule schedule;
  if (in.ConsumeBool()) schedule.set_block_m(in.PickValueInArray({-16, 0, 8, 16, 24, 32, 48, 64, 80, 96, 128, 192, 256}));
  if (in.ConsumeBool()) schedule.set_block_n(in.PickValueInArray({-16, 0, 8, 16, 32, 48, 64, 96, 128, 256}));
  if (in.ConsumeBool()) schedule.set_warps(in.ConsumeIntegralInRange(-1, 17));
  if (in.ConsumeBool()) schedule.set_stages(in.ConsumeIntegralInRange(-1, 6));
  if (in.ConsumeBool()) schedule.set_mix(static_cast<loom::v1::MixStrategy>(in.ConsumeIntegralInRange(0, 3)));
  if (in.ConsumeBool())
    schedule.set_collapse(static_cast<loom::v1::CollapseStrategy>(in.ConsumeIntegralInRange(0, 4)));
  if (in.ConsumeBool()) schedule.set_engine(static_cast<loom::v1::Engine>(in.ConsumeIntegralInRange(0, 3)));
  if (in.ConsumeBool()) schedule.set_producer_registers(in.ConsumeIntegralInRange(-8, 256));
  const char* arch = in.PickValueInArray({"cpu", "sm_80", "sm_90a", "sm_75"});
  auto plan = loom::generateKernel(spec, schedule, *loom::parseTarget(arch));
  if (plan && plan->source.empty()) std::abort();
  if (!plan && plan.error().message.empty()) std::abort();
  return 0;
}
