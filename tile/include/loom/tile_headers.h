// The tile API headers (tile/include/loom/tile), embedded in the binary at
// build time: the JIT paths compile programs against them without reading
// the source tree.
#pragma once

#include <string>
#include <vector>

namespace loom::tile {

struct EmbeddedFile {
  const char* path;  // relative include path, e.g. "loom/tile/host.h"
  const char* text;
};

const std::vector<EmbeddedFile>& embeddedHeaders();

// Hash of every embedded header: part of each compiled artifact's key.
const std::string& embeddedHeadersHash();

}  // namespace loom::tile
