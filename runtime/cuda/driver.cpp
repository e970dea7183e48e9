#include "cuda/driver.h"

#include <dlfcn.h>

#include <mutex>

#include "loom/counters.h"

namespace loom::cuda {
namespace {

// The driver API version whose entry points (and _v2 variants) loom uses.
constexpr int kDriverApiVersion = 12000;
constexpr const char* kNoGpu =
    "no CUDA driver: libcuda.so.1 could not be loaded, so this machine has no usable GPU "
    "(use --backend cpu, or loom compile to build CUDA kernels without one)";

using GetProcAddressV2 = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);

// The driver's entry points behind the counted ones (loom/counters.h): the
// DriverApi every caller uses holds wrappers that count, then call these.
struct CountedEntries {
  decltype(DriverApi::cuMemAlloc) memAlloc = nullptr;
  decltype(DriverApi::cuCtxSynchronize) ctxSynchronize = nullptr;
  decltype(DriverApi::cuStreamSynchronize) streamSynchronize = nullptr;
  decltype(DriverApi::cuEventSynchronize) eventSynchronize = nullptr;
  decltype(DriverApi::cuMemcpyDtoH) memcpyDtoH = nullptr;
  decltype(DriverApi::cuModuleLoadData) moduleLoadData = nullptr;
  decltype(DriverApi::cuLaunchKernel) launchKernel = nullptr;
} real;

CUresult countedMemAlloc(CUdeviceptr* pointer, size_t bytes) {
  count(Counter::device_allocations);
  return real.memAlloc(pointer, bytes);
}
CUresult countedCtxSynchronize() {
  count(Counter::host_syncs);
  return real.ctxSynchronize();
}
CUresult countedStreamSynchronize(CUstream stream) {
  count(Counter::host_syncs);
  return real.streamSynchronize(stream);
}
CUresult countedEventSynchronize(CUevent event) {
  count(Counter::host_syncs);
  return real.eventSynchronize(event);
}
CUresult countedMemcpyDtoH(void* host, CUdeviceptr device, size_t bytes) {
  count(Counter::host_syncs);  // a synchronous copy back waits for the device
  return real.memcpyDtoH(host, device, bytes);
}
CUresult countedModuleLoadData(CUmodule* module, const void* image) {
  count(Counter::modules_loaded);
  return real.moduleLoadData(module, image);
}
CUresult countedLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                             unsigned shared, CUstream stream, void** params, void** extra) {
  count(Counter::launches);
  return real.launchKernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra);
}

void countCalls(DriverApi& api) {
  real = {api.cuMemAlloc,       api.cuCtxSynchronize, api.cuStreamSynchronize, api.cuEventSynchronize,
          api.cuMemcpyDtoH,     api.cuModuleLoadData, api.cuLaunchKernel};
  api.cuMemAlloc = countedMemAlloc;
  api.cuCtxSynchronize = countedCtxSynchronize;
  api.cuStreamSynchronize = countedStreamSynchronize;
  api.cuEventSynchronize = countedEventSynchronize;
  api.cuMemcpyDtoH = countedMemcpyDtoH;
  api.cuModuleLoadData = countedModuleLoadData;
  api.cuLaunchKernel = countedLaunchKernel;
}

Result<const DriverApi*> load() {
  void* library = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!library) return makeError(std::string(kNoGpu) + ": " + ::dlerror());
  auto getProc = reinterpret_cast<GetProcAddressV2>(::dlsym(library, "cuGetProcAddress_v2"));
  if (!getProc) return makeError("libcuda.so.1 has no cuGetProcAddress_v2: the driver predates CUDA 12");
  static DriverApi api;
  std::string missing;
  auto fetch = [&](auto& slot, const char* name) {
    void* function = nullptr;
    CUdriverProcAddressQueryResult status;
    if (getProc(name, &function, kDriverApiVersion, CU_GET_PROC_ADDRESS_DEFAULT, &status) != CUDA_SUCCESS ||
        !function)
      missing += std::string(missing.empty() ? "" : ", ") + name;
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(function);
  };
  fetch(api.cuInit, "cuInit");
  fetch(api.cuDriverGetVersion, "cuDriverGetVersion");
  fetch(api.cuGetErrorString, "cuGetErrorString");
  fetch(api.cuDeviceGetCount, "cuDeviceGetCount");
  fetch(api.cuDeviceGet, "cuDeviceGet");
  fetch(api.cuDeviceGetName, "cuDeviceGetName");
  fetch(api.cuDeviceGetAttribute, "cuDeviceGetAttribute");
  fetch(api.cuDeviceTotalMem, "cuDeviceTotalMem");
  fetch(api.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  fetch(api.cuCtxSetCurrent, "cuCtxSetCurrent");
  fetch(api.cuCtxSynchronize, "cuCtxSynchronize");
  fetch(api.cuModuleLoadData, "cuModuleLoadData");
  fetch(api.cuModuleUnload, "cuModuleUnload");
  fetch(api.cuModuleGetFunction, "cuModuleGetFunction");
  fetch(api.cuFuncSetAttribute, "cuFuncSetAttribute");
  fetch(api.cuTensorMapEncodeTiled, "cuTensorMapEncodeTiled");
  fetch(api.cuLaunchKernel, "cuLaunchKernel");
  fetch(api.cuMemAlloc, "cuMemAlloc");
  fetch(api.cuMemFree, "cuMemFree");
  fetch(api.cuMemcpyHtoD, "cuMemcpyHtoD");
  fetch(api.cuMemcpyDtoH, "cuMemcpyDtoH");
  fetch(api.cuMemsetD8, "cuMemsetD8");
  fetch(api.cuStreamSynchronize, "cuStreamSynchronize");
  fetch(api.cuStreamCreate, "cuStreamCreate");
  fetch(api.cuStreamDestroy, "cuStreamDestroy");
  fetch(api.cuStreamBeginCapture, "cuStreamBeginCapture");
  fetch(api.cuStreamEndCapture, "cuStreamEndCapture");
  fetch(api.cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags");
  fetch(api.cuGraphLaunch, "cuGraphLaunch");
  fetch(api.cuGraphExecDestroy, "cuGraphExecDestroy");
  fetch(api.cuGraphDestroy, "cuGraphDestroy");
  fetch(api.cuEventCreate, "cuEventCreate");
  fetch(api.cuEventDestroy, "cuEventDestroy");
  fetch(api.cuEventRecord, "cuEventRecord");
  fetch(api.cuEventSynchronize, "cuEventSynchronize");
  fetch(api.cuEventElapsedTime, "cuEventElapsedTime");
  if (!missing.empty()) return makeError("the CUDA driver lacks " + missing);
  countCalls(api);
  if (Status ok = check(api.cuInit(0), "cuInit"); !ok) return makeError(std::string(kNoGpu) + ": " + ok.error().message);
  int count = 0;
  if (Status ok = check(api.cuDeviceGetCount(&count), "cuDeviceGetCount"); !ok) return ok.error();
  if (count == 0) return makeError("the CUDA driver sees no GPU (use --backend cpu)");
  return &api;
}

}  // namespace

Result<const DriverApi*> driver() {
  static std::once_flag once;
  static Result<const DriverApi*> loaded = makeError("not loaded");
  std::call_once(once, [] { loaded = load(); });
  return loaded;
}

Status check(CUresult result, const std::string& what) {
  if (result == CUDA_SUCCESS) return Status::success();
  const char* text = nullptr;
  auto api = driver();
  if (api.ok() && (*api)->cuGetErrorString) (*api)->cuGetErrorString(result, &text);
  return makeError(what + " failed: " + (text ? text : "CUDA error " + std::to_string(int(result))));
}

std::string DeviceInfo::arch() const {
  return "sm_" + std::to_string(major) + std::to_string(minor) + (major == 9 && minor == 0 ? "a" : "");
}

v1::Target targetOf(const DeviceInfo& info) {
  v1::Target target;
  target.set_kind(v1::Target::cuda);
  target.set_arch(info.arch());
  v1::DeviceProperties* p = target.mutable_device();
  p->set_name(info.name);
  p->set_sm_count(info.smCount);
  p->set_shared_memory_per_block(info.sharedMemoryPerBlock);
  p->set_shared_memory_per_multiprocessor(info.sharedMemoryPerMultiprocessor);
  p->set_registers_per_multiprocessor(info.registersPerMultiprocessor);
  p->set_l2_cache_bytes(info.l2Bytes);
  p->set_global_memory_bytes(info.globalMemoryBytes);
  return target;
}

Result<std::shared_ptr<Device>> Device::open(int ordinal) {
  auto api = driver();
  if (!api) return api.error();
  auto device = std::make_shared<Device>();
  device->api_ = *api;
  const DriverApi& d = **api;
  CUdevice handle;
  if (Status ok = check(d.cuDeviceGet(&handle, ordinal), "cuDeviceGet(" + std::to_string(ordinal) + ")"); !ok)
    return ok.error();
  if (Status ok = check(d.cuDevicePrimaryCtxRetain(&device->context_, handle), "cuDevicePrimaryCtxRetain"); !ok)
    return ok.error();
  DeviceInfo& info = device->info_;
  info.ordinal = ordinal;
  char name[256] = {};
  d.cuDeviceGetName(name, sizeof name, handle);
  info.name = name;
  auto attribute = [&](CUdevice_attribute which) {
    int value = 0;
    d.cuDeviceGetAttribute(&value, which, handle);
    return value;
  };
  info.major = attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
  info.minor = attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
  info.smCount = attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
  info.sharedMemoryPerBlock = attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
  info.sharedMemoryPerMultiprocessor = attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR);
  info.registersPerMultiprocessor = attribute(CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR);
  info.l2Bytes = attribute(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE);
  size_t total = 0;
  d.cuDeviceTotalMem(&total, handle);
  info.globalMemoryBytes = int64_t(total);
  if (Status ok = device->makeCurrent(); !ok) return ok.error();
  return device;
}

Status Device::makeCurrent() const { return check(api_->cuCtxSetCurrent(context_), "cuCtxSetCurrent"); }

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  std::swap(api_, other.api_);
  std::swap(pointer_, other.pointer_);
  std::swap(bytes_, other.bytes_);
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (pointer_) api_->cuMemFree(pointer_);
}

Result<DeviceBuffer> DeviceBuffer::allocate(const Device& device, size_t bytes) {
  DeviceBuffer buffer;
  buffer.api_ = &device.api();
  buffer.bytes_ = bytes;
  if (Status ok = check(device.api().cuMemAlloc(&buffer.pointer_, bytes ? bytes : 1),
                        "cuMemAlloc(" + std::to_string(bytes) + " bytes)");
      !ok)
    return ok.error();
  return buffer;
}

}  // namespace loom::cuda
