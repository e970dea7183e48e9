#include "emu/tensor_map.h"

#include <cstring>

namespace loom::emu {
namespace {

constexpr uint64_t kMagic = 0x6c6f6f6d2d746d61ull;  // "loom-tma"

// What the 128 opaque bytes hold.
struct Stored {
  uint64_t magic;
  uint64_t address;
  uint64_t dims[5];
  uint64_t strides[4];
  uint16_t box[5];
  uint8_t elementStrides[5];
  uint8_t rank, elementBytes, swizzleBytes, nanFill;
};
static_assert(sizeof(Stored) <= sizeof(CUtensorMap), "the emulated tensor map fits the opaque bytes");

thread_local std::string lastError;

CUresult fail(const std::string& why) {
  lastError = "cuTensorMapEncodeTiled: " + why;
  return CUDA_ERROR_INVALID_VALUE;
}

int elementSize(CUtensorMapDataType type) {
  switch (type) {
    case CU_TENSOR_MAP_DATA_TYPE_UINT8: return 1;
    case CU_TENSOR_MAP_DATA_TYPE_UINT16:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT16:
    case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16: return 2;
    case CU_TENSOR_MAP_DATA_TYPE_UINT32:
    case CU_TENSOR_MAP_DATA_TYPE_INT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ:
    case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32:
    case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ: return 4;
    case CU_TENSOR_MAP_DATA_TYPE_UINT64:
    case CU_TENSOR_MAP_DATA_TYPE_INT64:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT64: return 8;
    default: return 0;  // the packed sub-byte types are not emulated
  }
}

bool isFloat(CUtensorMapDataType type) {
  return type == CU_TENSOR_MAP_DATA_TYPE_FLOAT16 || type == CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 ||
         type == CU_TENSOR_MAP_DATA_TYPE_FLOAT32 || type == CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ ||
         type == CU_TENSOR_MAP_DATA_TYPE_FLOAT64 || type == CU_TENSOR_MAP_DATA_TYPE_TFLOAT32 ||
         type == CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ;
}

}  // namespace

CUresult encodeTensorMapTiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* address,
                              const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                              const cuuint32_t* elementStrides, CUtensorMapInterleave interleave,
                              CUtensorMapSwizzle swizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill fill) {
  lastError.clear();
  if (!map || reinterpret_cast<uintptr_t>(map) % 64 != 0) return fail("the tensor map must be 64-byte aligned");
  const int size = elementSize(type);
  if (size == 0) return fail("data type " + std::to_string(int(type)) + " is not emulated");
  if (rank < 1 || rank > 5) return fail("rank " + std::to_string(rank) + " is not 1..5");
  if (interleave != CU_TENSOR_MAP_INTERLEAVE_NONE) return fail("interleaved layouts are not emulated");
  if (!address || reinterpret_cast<uintptr_t>(address) % 16 != 0)
    return fail("the global address must be 16-byte aligned");
  for (cuuint32_t i = 0; i < rank; ++i) {
    if (dims[i] == 0 || dims[i] > (uint64_t(1) << 32))
      return fail("globalDim[" + std::to_string(i) + "] must be 1..2^32");
    if (box[i] == 0 || box[i] > 256) return fail("boxDim[" + std::to_string(i) + "] must be 1..256");
    if (elementStrides[i] == 0 || elementStrides[i] > 8)
      return fail("elementStrides[" + std::to_string(i) + "] must be 1..8");
  }
  for (cuuint32_t i = 0; i + 1 < rank; ++i)
    if (strides[i] % 16 != 0 || strides[i] >= (uint64_t(1) << 40))
      return fail("globalStrides[" + std::to_string(i) + "] must be a multiple of 16 below 2^40");
  const uint64_t innerBytes = uint64_t(box[0]) * uint64_t(size);
  if (innerBytes % 16 != 0) return fail("boxDim[0] * element size must be a multiple of 16 bytes");
  int swizzleBytes = 0;
  switch (swizzle) {
    case CU_TENSOR_MAP_SWIZZLE_NONE: break;
    case CU_TENSOR_MAP_SWIZZLE_32B: swizzleBytes = 32; break;
    case CU_TENSOR_MAP_SWIZZLE_64B: swizzleBytes = 64; break;
    case CU_TENSOR_MAP_SWIZZLE_128B: swizzleBytes = 128; break;
    default: return fail("the 128B_ATOM swizzles are not emulated");
  }
  if (swizzleBytes && innerBytes > uint64_t(swizzleBytes))
    return fail("the box's inner dimension (" + std::to_string(innerBytes) + " bytes) exceeds the " +
                std::to_string(swizzleBytes) + "-byte swizzle");
  if (fill == CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA && !isFloat(type))
    return fail("NaN fill needs a floating-point type");
  Stored stored{};
  stored.magic = kMagic;
  stored.address = reinterpret_cast<uintptr_t>(address);
  for (cuuint32_t i = 0; i < rank; ++i) {
    stored.dims[i] = dims[i];
    stored.box[i] = uint16_t(box[i]);
    // Dimension 0 has no traversal stride without interleave.
    stored.elementStrides[i] = uint8_t(i == 0 ? 1 : elementStrides[i]);
  }
  for (cuuint32_t i = 0; i + 1 < rank; ++i) stored.strides[i] = strides[i];
  stored.rank = uint8_t(rank);
  stored.elementBytes = uint8_t(size);
  stored.swizzleBytes = uint8_t(swizzleBytes);
  stored.nanFill = fill == CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA;
  std::memset(map, 0, sizeof(CUtensorMap));
  std::memcpy(map, &stored, sizeof stored);
  return CUDA_SUCCESS;
}

const std::string& lastEncodeError() { return lastError; }

int64_t DecodedTensorMap::boxElements(int dim) const {
  return (int64_t(box[dim]) + elementStrides[dim] - 1) / elementStrides[dim];
}

int64_t DecodedTensorMap::boxBytes() const {
  int64_t elements = 1;
  for (int i = 0; i < rank; ++i) elements *= boxElements(i);
  return elements * elementBytes;
}

bool decodeTensorMap(const void* map, DecodedTensorMap* decoded) {
  Stored stored;
  std::memcpy(&stored, map, sizeof stored);
  if (stored.magic != kMagic) return false;
  decoded->rank = int(stored.rank);
  decoded->elementBytes = int(stored.elementBytes);
  decoded->address = reinterpret_cast<const unsigned char*>(uintptr_t(stored.address));
  decoded->strides[0] = stored.elementBytes;
  for (int i = 0; i < decoded->rank; ++i) {
    decoded->dims[i] = stored.dims[i];
    decoded->box[i] = stored.box[i];
    decoded->elementStrides[i] = stored.elementStrides[i];
    if (i > 0) decoded->strides[i] = stored.strides[i - 1];
  }
  decoded->swizzleBytes = int(stored.swizzleBytes);
  decoded->nanFill = stored.nanFill != 0;
  return true;
}

int64_t swizzledOffset(uint32_t base, int64_t linear, int swizzleBytes) {
  if (swizzleBytes == 0) return linear;
  const int bits = swizzleBytes == 128 ? 3 : swizzleBytes == 64 ? 2 : 1;
  const int64_t address = int64_t(base) + linear;
  const int64_t row = (address >> 7) & ((1 << bits) - 1);
  return (address ^ (row << 4)) - int64_t(base);
}

std::vector<BoxElement> boxElements(const DecodedTensorMap& map, const int32_t* coordinates, uint32_t destination) {
  std::vector<BoxElement> elements;
  int64_t counts[5] = {1, 1, 1, 1, 1};
  int64_t total = 1;
  for (int i = 0; i < map.rank; ++i) {
    counts[i] = map.boxElements(i);
    total *= counts[i];
  }
  elements.reserve(size_t(total));
  for (int64_t linear = 0; linear < total; ++linear) {
    int64_t rest = linear;
    bool inside = true;
    const unsigned char* source = map.address;
    for (int i = 0; i < map.rank; ++i) {
      const int64_t index = rest % counts[i];
      rest /= counts[i];
      const int64_t coordinate = int64_t(coordinates[i]) + index * map.elementStrides[i];
      if (coordinate < 0 || uint64_t(coordinate) >= map.dims[i]) inside = false;
      else source += coordinate * int64_t(map.strides[i]);
    }
    elements.push_back(
        {inside ? source : nullptr, swizzledOffset(destination, linear * map.elementBytes, map.swizzleBytes)});
  }
  return elements;
}

}  // namespace loom::emu
