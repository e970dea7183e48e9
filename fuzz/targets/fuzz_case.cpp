// The case loader: a shared case (tests/data/cases/gqa-rope) with one of its
// files replaced by the input (the first byte picks spec.json or one of the
// arrays). It loads or fails cleanly; a loaded case has the sizes its spec
// and shapes imply.
#include <cstdint>
#include <cstdlib>
#include <filesystem>

#include "io/case.h"
#include "scratch.h"

namespace fs = std::filesystem;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const fs::path original = fs::path(LOOM_TEST_DATA) / "cases" / "gqa-rope";
  static const fs::path dir = [] {
    const fs::path copy = loom::fuzz::scratch() / "case";
    fs::remove_all(copy);
    fs::copy(original, copy, fs::copy_options::recursive);
    return copy;
  }();
  constexpr size_t kFiles = std::size(loom::kCaseInputs) + 1;
  const size_t which = data[0] % kFiles;
  const std::string name = which == 0 ? "spec.json" : std::string(loom::kCaseInputs[which - 1]) + ".npy";
  loom::fuzz::writeFile("case/" + name, data + 1, size - 1);
  auto c = loom::loadCase(dir.string());
  fs::copy_file(original / name, dir / name, fs::copy_options::overwrite_existing);  // the case as it was
  if (!c) return 0;
  const auto& s = c->spec;
  if (int64_t(c->inputs.q.size()) != c->batch * c->tokens * s.heads() * s.head_dim()) std::abort();
  if (int64_t(c->inputs.k.size()) != c->batch * c->tokens * s.kv_heads() * s.head_dim()) std::abort();
  return 0;
}
