// Runs a test case through a loaded kernel: inputs copied to the device,
// outputs poisoned with NaN before the launch, results read back.
#pragma once

#include "cuda/driver.h"
#include "io/case.h"
#include "io/decode_case.h"
#include "loom/runtime.h"

namespace loom::cuda {

struct DeviceRun {
  std::vector<double> out;  // [B, N, H, d]
  std::vector<double> lse;  // [B, H, N*P]
};

Result<DeviceRun> runCase(Kernel& kernel, const Device& device, const IhaCase& c);

struct DeviceDecodeRun {
  std::vector<double> out;      // [B, T, H, d]
  std::vector<double> lse;      // [B, H, T*P]
  reference::PagedCache cache;  // after the step, read back from the dtype
};

// A decode kernel on a decode step: the step's tensors, the cache (its empty
// slots NaN, as the step has them), page table and lengths copied to the
// device, out and lse poisoned, everything read back after the launch.
Result<DeviceDecodeRun> runDecodeCase(Kernel& kernel, const Device& device, const DecodeCase& step);

// A backward kernel on the case's inputs and c.dout: the gradients (poisoned
// with NaN before the launch) read back, float32 widened.
Result<reference::IhaGradients> runBackwardCase(Kernel& kernel, const Device& device, const IhaCase& c);

// A forward kernel (mixing materialised, collapse separate) keeping its
// state in device buffers (IhaSaved, poisoned first), then the backward
// kernel from them: the gradients read back.
Result<reference::IhaGradients> runKeptBackwardCase(Kernel& forward, Kernel& backward, const Device& device,
                                                    const IhaCase& c);

// The device buffers of one case's operands, for repeated launches.
class CaseBuffers {
 public:
  static Result<CaseBuffers> upload(const Device& device, const IhaCase& c);
  IhaTensors tensors() const;
  // Fills out and lse with NaN bit patterns so an unwritten element fails.
  Status poison(const Device& device) const;
  // Writes another case's inputs (the same spec and shapes) into the same
  // buffers: a captured CUDA graph replays on them.
  Status rewrite(const Device& device, const IhaCase& c) const;
  Result<DeviceRun> download(const Device& device, const IhaCase& c) const;

 private:
  std::vector<std::shared_ptr<DeviceBuffer>> buffers_;  // q k v alpha_q alpha_k alpha_v collapse out lse
  std::shared_ptr<DeviceBuffer> documents_;              // a varlen case's cu_seqlens
  IhaTensors tensors_;
};

// The device buffers of a decode step: the step's operands (CaseBuffers of
// its T tokens) and the paged cache, page table and lengths, for repeated
// launches (a step appends the same tokens to the same slots each time).
class DecodeBuffers {
 public:
  // A ragged step's operands are packed, [total, heads, d], with no lse.
  static Result<DecodeBuffers> upload(const Device& device, const DecodeCase& step);
  IhaTensors tensors() const;
  const PagedCacheTensors& cache() const { return cache_; }
  const CaseBuffers& step() const { return step_; }
  // The cache read back from the device, widened from the dtype.
  Result<reference::PagedCache> downloadCache(const Device& device, const DecodeCase& step) const;

 private:
  CaseBuffers step_;
  std::vector<std::shared_ptr<DeviceBuffer>> cacheBuffers_;  // k_cache v_cache page_table cache_len [query_start_loc]
  PagedCacheTensors cache_;
};

// The device buffers of a backward launch beyond the forward's inputs: dout
// (the case's, in the spec's dtype) and the seven float32 gradients.
class GradBuffers {
 public:
  static Result<GradBuffers> upload(const Device& device, const IhaCase& c);
  IhaGradTensors tensors() const { return tensors_; }
  // Fills every gradient with NaN bit patterns so an unwritten element fails.
  Status poison(const Device& device) const;
  // Writes another case's dout (the same spec and shapes) into the same buffer.
  Status rewrite(const Device& device, const IhaCase& c) const;
  Result<reference::IhaGradients> download(const Device& device) const;

 private:
  std::shared_ptr<DeviceBuffer> dout_;
  std::vector<std::shared_ptr<DeviceBuffer>> gradients_;  // dq dk dv dalpha_q dalpha_k dalpha_v dcollapse
  IhaGradTensors tensors_;
};

// What a forward keeps for its backward (IhaSaved) in device buffers of B x N
// tokens, poisoned with NaN bit patterns until a keeping forward fills them.
class SavedBuffers {
 public:
  static Result<SavedBuffers> allocate(const Device& device, const KernelSpec& spec, int64_t batch, int64_t tokens);
  const IhaSaved& saved() const { return saved_; }
  size_t bytes() const;

 private:
  std::vector<std::shared_ptr<DeviceBuffer>> buffers_;  // q_mixed k_mixed v_mixed o_pseudo lse
  IhaSaved saved_;
};

}  // namespace loom::cuda
