// Walking a strided tensor in C order: the host API's gathers and scatters,
// and the Python module's float64 reads.
#pragma once

#include <cstdint>
#include <vector>

namespace loom {

// Calls visit(elementOffset, denseIndex) for every element of a tensor of
// `shape` laid out with `strides` (in elements), in C order.
template <typename Visit>
void forEachElement(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides, Visit visit) {
  int64_t count = 1;
  for (int64_t extent : shape) count *= extent;
  std::vector<int64_t> index(shape.size(), 0);
  for (int64_t dense = 0; dense < count; ++dense) {
    int64_t offset = 0;
    for (size_t i = 0; i < index.size(); ++i) offset += index[i] * strides[i];
    visit(offset, dense);
    for (int i = int(index.size()) - 1; i >= 0 && ++index[i] == shape[i]; --i) index[i] = 0;
  }
}

}  // namespace loom
