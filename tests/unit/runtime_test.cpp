// The host API's checks that need no GPU: tensor validation, DLPack views,
// and what happens when there is no driver.
#include <gtest/gtest.h>

#include "cuda/driver.h"
#include "loom/runtime.h"
#include "test_util.h"

namespace loom {
namespace {

// Fake device addresses: validation never dereferences them.
void* fakePointer(uintptr_t address) { return reinterpret_cast<void*>(address); }

KernelSpec spec() { return testing::makeSpec({.heads = 4, .kvHeads = 2}); }

IhaTensors validTensors(int64_t B = 2, int64_t N = 10) {
  const ElementKind act = ElementKind::bfloat16, f32 = ElementKind::float32;
  IhaTensors t;
  t.q = {fakePointer(0x10000), act, {B, N, 4, 64}, {}, 0};
  t.k = {fakePointer(0x20000), act, {B, N, 2, 64}, {}, 0};
  t.v = {fakePointer(0x30000), act, {B, N, 2, 64}, {}, 0};
  t.alpha_q = {fakePointer(0x40000), f32, {4, 4, 2}, {}, 0};
  t.alpha_k = {fakePointer(0x50000), f32, {2, 2, 2}, {}, 0};
  t.alpha_v = {fakePointer(0x60000), f32, {2, 2, 2}, {}, 0};
  t.collapse = {fakePointer(0x70000), f32, {4, 2}, {}, 0};
  t.out = {fakePointer(0x80000), act, {B, N, 4, 64}, {}, 0};
  t.lse = Tensor{fakePointer(0x90000), f32, {B, 4, N * 2}, {}, 0};
  return t;
}

std::string errorOf(const IhaTensors& t) {
  Status status = validateTensors(spec(), t, 0);
  return status ? std::string("(valid)") : status.error().message;
}

TEST(Validate, AcceptsContiguousAndPaddedStrides) {
  EXPECT_EQ(errorOf(validTensors()), "(valid)");
  IhaTensors t = validTensors();
  t.q.strides = {10 * 4 * 128, 4 * 128, 128, 1};  // rows padded to 128 elements
  EXPECT_EQ(errorOf(t), "(valid)");
  t.lse.reset();
  EXPECT_EQ(errorOf(t), "(valid)");
}

TEST(Validate, NamesTheTensorAndTheProblem) {
  IhaTensors t = validTensors();
  t.k.shape = {2, 10, 3, 64};
  EXPECT_EQ(errorOf(t), "k: shape [2, 10, 3, 64], want [2, 10, 2, 64]");

  t = validTensors();
  t.v.element = ElementKind::float16;
  EXPECT_EQ(errorOf(t), "v: element type float16, want bfloat16");

  t = validTensors();
  t.out.strides = {10 * 4 * 64, 4 * 64, 1, 4};
  EXPECT_EQ(errorOf(t), "out: the last dimension must be contiguous (stride 1)");

  t = validTensors();
  t.q.strides = {10 * 4 * 68, 4 * 68, 68, 1};
  EXPECT_NE(errorOf(t).find("q: stride 68 of dimension 2 is not a multiple of 8 elements"), std::string::npos);

  t = validTensors();
  t.q.data = fakePointer(0x10002);
  EXPECT_EQ(errorOf(t), "q: data is not 16-byte aligned");

  t = validTensors();
  t.alpha_k.device = 1;
  EXPECT_EQ(errorOf(t), "alpha_k: in CUDA device 1, the kernel runs on CUDA device 0");

  t = validTensors();
  t.collapse.shape = {4, 8};
  EXPECT_EQ(errorOf(t), "collapse: shape [4, 8], want [4, 2]");

  t = validTensors();
  t.lse->shape = {2, 4, 10};
  EXPECT_EQ(errorOf(t), "lse: shape [2, 4, 10], want [2, 4, 20]");

  t = validTensors();
  t.q.data = nullptr;
  EXPECT_EQ(errorOf(t), "q: no data pointer");

  t = validTensors();
  t.q.shape = {2, 10, 4};
  EXPECT_NE(errorOf(t).find("q: want 4 dimensions"), std::string::npos);
}

TEST(Dlpack, ViewsTensorsWithOffsetsAndStrides) {
  int64_t qShape[] = {1, 3, 4, 64}, kShape[] = {1, 3, 2, 64}, aqShape[] = {4, 4, 2}, akShape[] = {2, 2, 2},
          cShape[] = {4, 2};
  int64_t qStrides[] = {3 * 4 * 64, 4 * 64, 64, 1};
  auto make = [](int64_t* shape, int ndim, DLDataType dtype, int64_t* strides, uint64_t offset) {
    DLTensor t{};
    t.data = reinterpret_cast<void*>(0x100000);
    t.device = {kDLCUDA, 0};
    t.ndim = ndim;
    t.dtype = dtype;
    t.shape = shape;
    t.strides = strides;
    t.byte_offset = offset;
    return t;
  };
  const DLDataType bf16{kDLBfloat, 16, 1}, f32{kDLFloat, 32, 1};
  DLTensor q = make(qShape, 4, bf16, qStrides, 256), k = make(kShape, 4, bf16, nullptr, 0), v = k,
           aq = make(aqShape, 3, f32, nullptr, 0), ak = make(akShape, 3, f32, nullptr, 0), av = ak,
           c = make(cShape, 2, f32, nullptr, 0), out = make(qShape, 4, bf16, nullptr, 0);
  auto tensors = tensorsFromDlpack(&q, &k, &v, &aq, &ak, &av, &c, &out, nullptr);
  ASSERT_TRUE(tensors) << tensors.error().message;
  EXPECT_EQ(tensors->q.data, reinterpret_cast<void*>(0x100000 + 256));
  EXPECT_EQ(tensors->q.strides, std::vector<int64_t>(qStrides, qStrides + 4));
  EXPECT_EQ(tensors->q.element, ElementKind::bfloat16);
  EXPECT_EQ(tensors->alpha_q.element, ElementKind::float32);
  EXPECT_FALSE(tensors->lse.has_value());
  EXPECT_TRUE(validateTensors(spec(), *tensors, 0)) << validateTensors(spec(), *tensors, 0).error().message;

  // Host tensors are viewed (runOnHost takes them) but a CUDA kernel refuses them.
  DLTensor onHost = q;
  onHost.device = {kDLCPU, 0};
  auto mixed = tensorsFromDlpack(&onHost, &k, &v, &aq, &ak, &av, &c, &out, nullptr);
  ASSERT_TRUE(mixed) << mixed.error().message;
  EXPECT_EQ(mixed->q.device, kHostDevice);
  EXPECT_EQ(validateTensors(spec(), *mixed, 0).error().message, "q: in host memory, the kernel runs on CUDA device 0");
  DLTensor elsewhere = q;
  elsewhere.device = {kDLOpenCL, 0};
  auto rejected = tensorsFromDlpack(&elsewhere, &k, &v, &aq, &ak, &av, &c, &out, nullptr);
  ASSERT_FALSE(rejected);
  EXPECT_EQ(rejected.error().message, "q: must be on a CUDA device or in host memory (DLPack kDLCUDA or kDLCPU)");

  DLTensor integers = k;
  integers.dtype = {kDLInt, 32, 1};
  auto badType = tensorsFromDlpack(&q, &integers, &v, &aq, &ak, &av, &c, &out, nullptr);
  ASSERT_FALSE(badType);
  EXPECT_EQ(badType.error().message, "k: dtype must be float32, float16 or bfloat16");
}

// On a machine without a driver the runtime says so; with one it opens.
TEST(Runtime, ReportsWhetherAGpuIsPresent) {
  auto runtime = Runtime::create();
  if (cuda::driver().ok()) {
    ASSERT_TRUE(runtime) << runtime.error().message;
    EXPECT_FALSE((*runtime)->device().name.empty());
  } else {
    ASSERT_FALSE(runtime);
    EXPECT_NE(runtime.error().message.find("no CUDA driver"), std::string::npos) << runtime.error().message;
    EXPECT_NE(runtime.error().message.find("--backend cpu"), std::string::npos);
  }
}

}  // namespace
}  // namespace loom
