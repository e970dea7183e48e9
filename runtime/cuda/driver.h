// The CUDA driver, opened at run time: libcuda.so.1 is dlopen'ed and every
// entry point is fetched through cuGetProcAddress, as the field's runtimes
// do, so loom's binaries start (and say plainly that no GPU is present) on
// machines without a driver.
#pragma once

#include <cuda.h>

#include <functional>
#include <memory>
#include <string>

#include "loom/result.h"
#include "loom/tile/common.h"
#include "loom/v1/loom.pb.h"

namespace loom::cuda {

struct DriverApi {
  CUresult (*cuInit)(unsigned int);
  CUresult (*cuDriverGetVersion)(int*);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetName)(char*, int, CUdevice);
  CUresult (*cuDeviceGetAttribute)(int*, CUdevice_attribute, CUdevice);
  CUresult (*cuDeviceTotalMem)(size_t*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxSynchronize)();
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleUnload)(CUmodule);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuFuncSetAttribute)(CUfunction, CUfunction_attribute, int);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**);
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void*, size_t);
  CUresult (*cuMemcpyDtoH)(void*, CUdeviceptr, size_t);
  CUresult (*cuMemsetD8)(CUdeviceptr, unsigned char, size_t);
  CUresult (*cuStreamSynchronize)(CUstream);
  // Streams and CUDA graphs (the capture and replay tests).
  CUresult (*cuStreamCreate)(CUstream*, unsigned int);
  CUresult (*cuStreamDestroy)(CUstream);
  CUresult (*cuStreamBeginCapture)(CUstream, CUstreamCaptureMode);
  CUresult (*cuStreamEndCapture)(CUstream, CUgraph*);
  CUresult (*cuGraphInstantiateWithFlags)(CUgraphExec*, CUgraph, unsigned long long);
  CUresult (*cuGraphLaunch)(CUgraphExec, CUstream);
  CUresult (*cuGraphExecDestroy)(CUgraphExec);
  CUresult (*cuGraphDestroy)(CUgraph);
  CUresult (*cuEventCreate)(CUevent*, unsigned int);
  CUresult (*cuEventDestroy)(CUevent);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventSynchronize)(CUevent);
  CUresult (*cuEventElapsedTime)(float*, CUevent, CUevent);
  CUresult (*cuTensorMapEncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                     const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                     CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
};

// The host side of loom::TmaMaps (tile/include/loom/tile/cuda_common.h): the tensor
// maps a warp-specialised attention launch (or the wgmma backward's key-block-outer
// launch) takes after its IhaArgs.
struct TmaMaps {
  CUtensorMap q, k, v, dO, row_stats;
};
static_assert(sizeof(TmaMaps) == 5 * 128, "loom::TmaMaps is five 128-byte tensor maps");

// cuTensorMapEncodeTiled's signature: the driver's, or the emulator's.
using TensorMapEncoder = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                      const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                      CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The tensor maps a warp-specialised launch of `compiled` takes over its
// mixed workspaces (args.q_mixed, k_mixed, v_mixed, and a backward's
// do_pseudo, lse and delta; L = N * P rows), encoded
// by `encode`; `check` turns a failure into an error naming the map.
Status encodeWorkspaceMaps(TensorMapEncoder encode, const std::function<Status(CUresult, const std::string&)>& check,
                           const v1::CompiledKernel& compiled, const IhaArgs& args, int64_t L, int64_t B,
                           TmaMaps& maps);

// The driver, loaded and initialised once. Without one the error says that
// no GPU is present and what to use instead.
Result<const DriverApi*> driver();

// OK, or an Error naming `what` and the driver's message.
Status check(CUresult result, const std::string& what);

struct DeviceInfo {
  int ordinal = 0;
  std::string name;
  int major = 0, minor = 0;
  int smCount = 0;
  int64_t sharedMemoryPerBlock = 0;  // with opt-in
  int64_t sharedMemoryPerMultiprocessor = 0;
  int registersPerMultiprocessor = 0;
  int64_t l2Bytes = 0;
  int64_t globalMemoryBytes = 0;
  // The NVRTC target: sm_XY, with the 'a' suffix on 9.0 for wgmma.
  std::string arch() const;
};

// The device as a compile target: its arch and properties.
v1::Target targetOf(const DeviceInfo& info);

// A device with its primary context, current on the calling thread while
// loom uses it.
class Device {
 public:
  static Result<std::shared_ptr<Device>> open(int ordinal);
  const DeviceInfo& info() const { return info_; }
  Status makeCurrent() const;
  const DriverApi& api() const { return *api_; }

 private:
  const DriverApi* api_ = nullptr;
  CUcontext context_ = nullptr;
  DeviceInfo info_;
};

// Device memory owned by a C++ object.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  ~DeviceBuffer();

  static Result<DeviceBuffer> allocate(const Device& device, size_t bytes);
  CUdeviceptr get() const { return pointer_; }
  void* data() const { return reinterpret_cast<void*>(pointer_); }
  size_t size() const { return bytes_; }

 private:
  const DriverApi* api_ = nullptr;
  CUdeviceptr pointer_ = 0;
  size_t bytes_ = 0;
};

}  // namespace loom::cuda
