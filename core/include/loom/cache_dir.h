// Where loom keeps what it compiles and tunes: one folder per user.
#pragma once

#include <string>

#include "loom/result.h"

namespace loom {

// $LOOM_CACHE_DIR, else $XDG_CACHE_HOME/loom, else ~/.cache/loom (like
// Triton's and ccache's per-user caches), else a folder under /tmp.
std::string defaultCacheDir();

// A name beside `path` that no other process or thread uses: what is
// written there and then renamed over `path` is never seen half-written,
// even when several writers race for the same file.
std::string temporaryBeside(const std::string& path);

// Writes `bytes` to a temporary beside `path`, then renames it over `path`.
Status writeFileAtomically(const std::string& path, const std::string& bytes);

}  // namespace loom
