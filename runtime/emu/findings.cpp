#include "emu/findings.h"

#include <dlfcn.h>

#include <cstdio>
#include <memory>
#include <set>
#include <sstream>
#include <tuple>

namespace loom::emu {

const char* kindName(FindingKind kind) {
  switch (kind) {
    case FindingKind::race: return "data race";
    case FindingKind::outOfBounds: return "out of bounds";
    case FindingKind::uninitialized: return "uninitialised read";
    case FindingKind::misaligned: return "misaligned access";
    case FindingKind::asyncAccess: return "async result used before its wait";
    case FindingKind::proxyFence: return "missing fence.proxy.async";
    case FindingKind::mbarrier: return "mbarrier misuse";
    case FindingKind::barrier: return "barrier misuse";
    case FindingKind::divergence: return "divergent collective";
    case FindingKind::deadlock: return "deadlock";
    case FindingKind::invalidOperand: return "invalid operand";
    case FindingKind::readOnly: return "store to an input";
  }
  return "finding";
}

void FindingLog::add(Finding finding) {
  std::lock_guard lock(mutex_);
  ++total_;
  const auto key = std::make_pair(int(finding.kind), finding.pc);
  if (++repeats_[key] > 1 && finding.pc) return;
  if (int(findings_.size()) >= limit_) return;
  findings_.push_back(std::move(finding));
}

std::vector<Finding> FindingLog::findings() const {
  std::lock_guard lock(mutex_);
  return findings_;
}

int64_t FindingLog::total() const {
  std::lock_guard lock(mutex_);
  return total_;
}

void FindingLog::symbolize() {
  std::lock_guard lock(mutex_);
  for (Finding& finding : findings_) {
    if (finding.where.empty() && finding.pc) finding.where = sourceLine(finding.pc);
    if (finding.otherWhere.empty() && finding.otherPc) finding.otherWhere = sourceLine(finding.otherPc);
  }
  // One inlined helper has a call site per caller: fold those whose source
  // lines (both sides) agree, keeping the first.
  std::set<std::tuple<int, std::string, std::string>> seen;
  std::erase_if(findings_, [&](const Finding& f) {
    return !f.where.empty() && !seen.insert({int(f.kind), f.where, f.otherWhere}).second;
  });
}

std::string sourceLine(const void* pc) {
  static std::mutex mutex;
  static std::map<const void*, std::string> cache;
  std::lock_guard lock(mutex);
  if (auto found = cache.find(pc); found != cache.end()) return found->second;
  std::string result;
  Dl_info info{};
  if (::dladdr(pc, &info) && info.dli_fname) {
    // The return address is one past the call: ask for the call itself.
    const uintptr_t offset = uintptr_t(pc) - uintptr_t(info.dli_fbase) - 1;
    char command[4096];
    std::snprintf(command, sizeof command, "addr2line -C -f -i -e '%s' 0x%lx 2>/dev/null", info.dli_fname,
                  static_cast<unsigned long>(offset));
    std::unique_ptr<FILE, int (*)(FILE*)> pipe(::popen(command, "r"), ::pclose);
    if (pipe) {
      // Pairs of lines: function, file:line; innermost first. The first
      // frame outside the emulated leaves (loom/tile/emu.h) is the one the
      // reader wants, with the innermost function for context.
      std::vector<std::pair<std::string, std::string>> frames;
      char function[4096], location[4096];
      while (std::fgets(function, sizeof function, pipe.get()) && std::fgets(location, sizeof location, pipe.get())) {
        std::string f(function), l(location);
        while (!f.empty() && (f.back() == '\n' || f.back() == '\r')) f.pop_back();
        while (!l.empty() && (l.back() == '\n' || l.back() == '\r')) l.pop_back();
        frames.emplace_back(f, l);
      }
      for (const auto& [f, l] : frames) {
        if (l.find("loom/tile/emu.h") != std::string::npos || l.rfind("??", 0) == 0) continue;
        const size_t slash = l.rfind('/');
        std::string shortFunction = f.substr(0, f.find('('));
        result = (slash == std::string::npos ? l : l.substr(slash + 1)) + " (" + shortFunction + ")";
        break;
      }
    }
  }
  cache[pc] = result;
  return result;
}

std::string format(const Finding& finding) {
  std::ostringstream text;
  text << kindName(finding.kind) << " in CTA (" << finding.cta[0] << "," << finding.cta[1] << "," << finding.cta[2]
       << ")";
  if (finding.thread >= 0)
    text << " thread " << finding.thread << " (warp " << finding.thread / 32 << ", lane " << finding.thread % 32 << ")";
  if (!finding.instruction.empty()) text << " at " << finding.instruction;
  if (!finding.where.empty()) text << " [" << finding.where << "]";
  text << ": " << finding.message;
  if (finding.otherThread >= 0 || finding.otherPc) {
    text << " (other side:";
    if (finding.otherThread >= 0) text << " thread " << finding.otherThread;
    if (!finding.otherWhere.empty()) text << " at " << finding.otherWhere;
    text << ")";
  }
  return text.str();
}

}  // namespace loom::emu
