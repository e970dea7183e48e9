// Faults put into copies of the device code: the emulator tests run a plan
// against a tile header with one line changed and expect the findings (or
// the wrong result) the change deserves.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "emu/emulator.h"
#include "loom/tile_headers.h"

namespace loom::testing {

// The emulator as the tests run it: the test cache, two threads, `seed`
// choosing the shared window's base and when copies land.
inline emu::EmuOptions emulatorOptions(uint64_t seed) {
  emu::EmuOptions o;
  o.cacheDir = LOOM_TEST_CACHE;
  o.threads = 2;
  o.seed = seed;
  return o;
}

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

// The faulty run reported a finding of each of `kinds`; prints the first
// finding (or `otherwise`, where a wrong value is what the fault leaves).
inline void expectEachFinding(const emu::EmuRun& faulty, const std::vector<emu::FindingKind>& kinds,
                              const std::string& fault, const std::string& otherwise) {
  for (emu::FindingKind kind : kinds) {
    const bool found = std::any_of(faulty.findings.begin(), faulty.findings.end(),
                                   [&](const emu::Finding& f) { return f.kind == kind; });
    EXPECT_TRUE(found) << fault << ": no " << emu::kindName(kind) << " finding\n" << emu::summary(faulty);
  }
  std::printf("[ fault    ] %s: %s\n", fault.c_str(),
              faulty.findings.empty() ? otherwise.c_str() : emu::format(faulty.findings.front()).c_str());
}

// The faulty run reported a finding of one of `kinds` at least (a fault
// that shows as one or another as the emulator's seed lands the copies).
inline void expectSomeFinding(const emu::EmuRun& faulty, const std::vector<emu::FindingKind>& kinds,
                              const std::string& fault) {
  const bool found = std::any_of(faulty.findings.begin(), faulty.findings.end(), [&](const emu::Finding& f) {
    return std::find(kinds.begin(), kinds.end(), f.kind) != kinds.end();
  });
  std::string names;
  for (emu::FindingKind kind : kinds) names += std::string(names.empty() ? "" : " or ") + emu::kindName(kind);
  EXPECT_TRUE(found) << fault << ": no " << names << " finding\n" << emu::summary(faulty);
  std::printf("[ fault    ] %s: %s\n", fault.c_str(),
              faulty.findings.empty() ? "no finding" : emu::format(faulty.findings.front()).c_str());
}

}  // namespace loom::testing
