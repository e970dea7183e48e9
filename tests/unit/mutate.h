// Faults put into copies of the device code: the emulator tests run a plan
// against a tile header with one line changed and expect the finding (or
// the wrong result) the change deserves.
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <string>

#include "loom/tile_headers.h"

namespace loom::testing {

// The embedded text of a tile header with `from` replaced by `to` (which
// must occur exactly once).
inline std::map<std::string, std::string> mutatedHeader(const std::string& header, const std::string& from,
                                                        const std::string& to) {
  for (const tile::EmbeddedFile& file : tile::embeddedHeaders()) {
    if (file.path != header) continue;
    std::string text = file.text;
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << header << " has no '" << from << "'";
    EXPECT_EQ(text.find(from, at + 1), std::string::npos) << header << " has '" << from << "' twice";
    if (at == std::string::npos) return {};
    text.replace(at, from.size(), to);
    return {{header, text}};
  }
  ADD_FAILURE() << "no embedded header " << header;
  return {};
}

}  // namespace loom::testing
