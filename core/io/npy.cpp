#include "io/npy.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <regex>
#include <sstream>

#include "loom/half.h"

namespace loom {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicSize = 6;
constexpr size_t kHeaderAlignment = 64;

const char* descrOf(NpyType type) {
  switch (type) {
    case NpyType::float64: return "<f8";
    case NpyType::float32: return "<f4";
    case NpyType::float16: return "<f2";
    case NpyType::uint16: return "<u2";
    case NpyType::int32: return "<i4";
  }
  return "?";
}

bool typeFromDescr(const std::string& descr, NpyType* type) {
  if (descr == "<f8") *type = NpyType::float64;
  else if (descr == "<f4") *type = NpyType::float32;
  else if (descr == "<f2") *type = NpyType::float16;
  else if (descr == "<u2") *type = NpyType::uint16;
  else if (descr == "<i4") *type = NpyType::int32;
  else return false;
  return true;
}

template <typename T>
T loadAt(const std::vector<uint8_t>& bytes, int64_t index) {
  T value;
  std::memcpy(&value, bytes.data() + index * sizeof(T), sizeof(T));
  return value;
}

template <typename T>
void storeAt(std::vector<uint8_t>& bytes, int64_t index, T value) {
  std::memcpy(bytes.data() + index * sizeof(T), &value, sizeof(T));
}

}  // namespace

int64_t NpyArray::elementSize(NpyType type) {
  switch (type) {
    case NpyType::float64: return 8;
    case NpyType::float32:
    case NpyType::int32: return 4;
    case NpyType::float16:
    case NpyType::uint16: return 2;
  }
  return 0;
}

int64_t NpyArray::elementCount() const {
  int64_t count = 1;
  for (int64_t extent : shape) count *= extent;
  return count;
}

std::string shapeString(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

Result<NpyArray> readNpy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return makeError(path + ": cannot open file");
  std::vector<uint8_t> file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto bad = [&](const std::string& why) { return makeError(path + ": malformed .npy: " + why); };

  if (file.size() < kMagicSize + 4 || std::memcmp(file.data(), kMagic, kMagicSize) != 0)
    return bad("missing \\x93NUMPY magic");
  const int major = file[6];
  size_t headerLength = 0, headerStart = 0;
  if (major == 1) {
    headerLength = file[8] | (size_t(file[9]) << 8);
    headerStart = 10;
  } else if (major == 2 || major == 3) {
    if (file.size() < 12) return bad("truncated header");
    headerLength = file[8] | (size_t(file[9]) << 8) | (size_t(file[10]) << 16) | (size_t(file[11]) << 24);
    headerStart = 12;
  } else {
    return bad("unsupported format version " + std::to_string(major));
  }
  if (headerStart + headerLength > file.size()) return bad("truncated header");
  const std::string header(file.begin() + headerStart, file.begin() + headerStart + headerLength);

  std::smatch match;
  NpyArray array;
  if (!std::regex_search(header, match, std::regex(R"('descr'\s*:\s*'([^']*)')")))
    return bad("header has no 'descr'");
  if (!typeFromDescr(match[1], &array.type))
    return bad("unsupported dtype '" + match[1].str() + "' (want <f8, <f4, <f2, <u2 or <i4)");
  if (std::regex_search(header, match, std::regex(R"('fortran_order'\s*:\s*True)")))
    return bad("Fortran order is not supported");
  if (!std::regex_search(header, match, std::regex(R"('shape'\s*:\s*\(([^)]*)\))")))
    return bad("header has no 'shape'");
  std::stringstream dims(match[1].str());
  std::string item;
  while (std::getline(dims, item, ',')) {
    if (item.find_first_not_of(" \t") == std::string::npos) continue;
    try {
      const long long extent = std::stoll(item);
      if (extent < 0) return bad("negative extent in shape");
      array.shape.push_back(extent);
    } catch (const std::exception&) {
      return bad("shape entry '" + item + "' is not an integer");
    }
  }

  // The data's size, its product checked: a shape whose bytes overflow
  // 64 bits (found by fuzz_npy) is refused, never wrapped.
  int64_t dataBytes = NpyArray::elementSize(array.type);
  for (int64_t extent : array.shape)
    if (__builtin_mul_overflow(dataBytes, extent, &dataBytes))
      return bad("shape " + shapeString(array.shape) + " holds more bytes than 64 bits count");
  const size_t dataStart = headerStart + headerLength;
  if (file.size() - dataStart != size_t(dataBytes))
    return bad("expected " + std::to_string(dataBytes) + " data bytes for shape " + shapeString(array.shape) +
               ", found " + std::to_string(file.size() - dataStart));
  array.bytes.assign(file.begin() + dataStart, file.end());
  return array;
}

Status writeNpy(const std::string& path, const NpyArray& array) {
  std::string shape = "(";
  for (size_t i = 0; i < array.shape.size(); ++i) shape += (i ? ", " : "") + std::to_string(array.shape[i]);
  shape += array.shape.size() == 1 ? ",)" : ")";  // Python's one-tuple spelling
  std::string header = std::string("{'descr': '") + descrOf(array.type) +
                       "', 'fortran_order': False, 'shape': " + shape + ", }";
  // Pad with spaces so the data starts on a 64-byte boundary; end with '\n'.
  const size_t unpadded = kMagicSize + 4 + header.size() + 1;
  header.append((kHeaderAlignment - unpadded % kHeaderAlignment) % kHeaderAlignment, ' ');
  header += '\n';

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return makeError(path + ": cannot open for writing");
  out.write(kMagic, kMagicSize);
  const char version[2] = {1, 0};
  out.write(version, 2);
  const uint16_t length = uint16_t(header.size());
  const char lengthBytes[2] = {char(length & 0xff), char(length >> 8)};
  out.write(lengthBytes, 2);
  out.write(header.data(), std::streamsize(header.size()));
  out.write(reinterpret_cast<const char*>(array.bytes.data()), std::streamsize(array.bytes.size()));
  if (!out) return makeError(path + ": write failed");
  return Status::success();
}

std::vector<double> npyToDouble(const NpyArray& array, bool uint16IsBfloat16) {
  const int64_t count = array.elementCount();
  std::vector<double> values(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    switch (array.type) {
      case NpyType::float64: values[i] = loadAt<double>(array.bytes, i); break;
      case NpyType::float32: values[i] = loadAt<float>(array.bytes, i); break;
      case NpyType::int32: values[i] = loadAt<int32_t>(array.bytes, i); break;
      case NpyType::float16: values[i] = half::halfToFloat(loadAt<uint16_t>(array.bytes, i)); break;
      case NpyType::uint16: {
        const uint16_t bits = loadAt<uint16_t>(array.bytes, i);
        values[i] = uint16IsBfloat16 ? half::bfloat16ToFloat(bits) : double(bits);
        break;
      }
    }
  }
  return values;
}

NpyArray npyFromDouble(const std::vector<double>& values, std::vector<int64_t> shape, NpyType type) {
  NpyArray array;
  array.type = type;
  array.shape = std::move(shape);
  array.bytes.resize(values.size() * size_t(NpyArray::elementSize(type)));
  for (size_t i = 0; i < values.size(); ++i) {
    switch (type) {
      case NpyType::float64: storeAt<double>(array.bytes, int64_t(i), values[i]); break;
      case NpyType::float32: storeAt<float>(array.bytes, int64_t(i), float(values[i])); break;
      case NpyType::int32: storeAt<int32_t>(array.bytes, int64_t(i), int32_t(std::llround(values[i]))); break;
      case NpyType::float16: storeAt<uint16_t>(array.bytes, int64_t(i), half::floatToHalf(float(values[i]))); break;
      case NpyType::uint16: storeAt<uint16_t>(array.bytes, int64_t(i), half::floatToBfloat16(float(values[i]))); break;
    }
  }
  return array;
}

}  // namespace loom
