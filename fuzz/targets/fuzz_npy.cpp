// The .npy reader on any bytes: an array or a clean error. A parsed array's
// data covers its shape, and converting it reads no further.
#include <cstdint>
#include <cstdlib>

#include "io/npy.h"
#include "scratch.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto array = loom::readNpy(loom::fuzz::writeFile("input.npy", data, size));
  if (!array) return 0;
  int64_t elements = 1;
  for (int64_t extent : array->shape) elements *= extent;
  const std::vector<double> values = loom::npyToDouble(*array);
  if (int64_t(values.size()) != elements) std::abort();
  return 0;
}
