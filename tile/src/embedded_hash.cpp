#include "loom/hash.h"
#include "loom/tile_headers.h"

namespace loom::tile {

const std::string& embeddedHeadersHash() {
  static const std::string hash = [] {
    ContentHash h;
    for (const EmbeddedFile& file : embeddedHeaders()) h.add(file.path).add(file.text);
    return h.hex();
  }();
  return hash;
}

}  // namespace loom::tile
