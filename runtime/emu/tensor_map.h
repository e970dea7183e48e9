// Tensor maps for the emulator: cuTensorMapEncodeTiled's parameters, checked
// as the driver documents them, kept in the 128 opaque bytes of a
// CUtensorMap; and the box a cp.async.bulk.tensor load of such a map
// brings into shared memory, out-of-bounds elements filled and 16-byte
// chunks placed where the swizzle mode puts them.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <string>
#include <vector>

namespace loom::emu {

// The emulator's cuTensorMapEncodeTiled: same signature and rules as the
// driver's (tiled mode, interleave NONE; the 128B_ATOM swizzles are not
// emulated). CUDA_ERROR_INVALID_VALUE when a rule is broken.
CUresult encodeTensorMapTiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* address,
                              const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                              const cuuint32_t* elementStrides, CUtensorMapInterleave interleave,
                              CUtensorMapSwizzle swizzle, CUtensorMapL2promotion promotion,
                              CUtensorMapFloatOOBfill fill);
// Why the last encode on this OS thread failed ("" after a success).
const std::string& lastEncodeError();

struct DecodedTensorMap {
  int rank = 0;
  int elementBytes = 0;
  const unsigned char* address = nullptr;
  uint64_t dims[5] = {};
  uint64_t strides[5] = {};  // bytes; strides[0] is the element size
  uint32_t box[5] = {};
  uint32_t elementStrides[5] = {};
  int swizzleBytes = 0;      // 0, 32, 64, 128
  bool nanFill = false;
  int64_t boxElements(int dim) const;  // elements loaded along `dim`
  int64_t boxBytes() const;
};

// The map's parameters, or false when the bytes were not written by
// encodeTensorMapTiled.
bool decodeTensorMap(const void* map, DecodedTensorMap* decoded);

// Physical offset of byte `linear` of a box landing at shared address
// `base` under a swizzle of `swizzleBytes` (0: none): 16-byte chunk bits
// [4, 4+k) of the address XOR bits [7, 7+k), k = log2(swizzle / 16).
int64_t swizzledOffset(uint32_t base, int64_t linear, int swizzleBytes);

// One global element the load reads: its address, or null when it lies
// outside the tensor (and is filled).
struct BoxElement {
  const unsigned char* source;
  int64_t offset;  // where it lands, from the destination, swizzle applied
};
// The elements of the box at `coordinates` landing at shared address `destination`.
std::vector<BoxElement> boxElements(const DecodedTensorMap& map, const int32_t* coordinates, uint32_t destination);

}  // namespace loom::emu
