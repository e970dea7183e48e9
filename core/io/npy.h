// NumPy .npy files (format version 1.0 and 2.0, little-endian, C order).
// bfloat16 has no NumPy type: it is stored as uint16 bit patterns, and the
// reader of a case knows from spec.json which uint16 arrays are bfloat16.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loom/result.h"

namespace loom {

enum class NpyType { float64, float32, float16, uint16, int32 };  // int32: varlen cases' cu_seqlens

struct NpyArray {
  NpyType type = NpyType::float64;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // little-endian elements, C order

  int64_t elementCount() const;
  static int64_t elementSize(NpyType type);
};

// Reads `path`; the error names the file and what is wrong with it.
Result<NpyArray> readNpy(const std::string& path);
Status writeNpy(const std::string& path, const NpyArray& array);

// Element values widened to double. uint16 arrays are read as bfloat16 bit
// patterns when `uint16IsBfloat16`, else as integers.
std::vector<double> npyToDouble(const NpyArray& array, bool uint16IsBfloat16 = true);

// Values narrowed (round to nearest even) into an array of `type`; uint16
// means bfloat16 bit patterns.
NpyArray npyFromDouble(const std::vector<double>& values, std::vector<int64_t> shape, NpyType type);

std::string shapeString(const std::vector<int64_t>& shape);

}  // namespace loom
