// Where loom keeps what it compiles and tunes: one folder per user.
#pragma once

#include <string>

namespace loom {

// $LOOM_CACHE_DIR, else $XDG_CACHE_HOME/loom, else ~/.cache/loom (like
// Triton's and ccache's per-user caches), else a folder under /tmp.
std::string defaultCacheDir();

}  // namespace loom
