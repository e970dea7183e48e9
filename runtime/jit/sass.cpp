#include "jit/sass.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <set>
#include <sstream>
#include <sys/wait.h>

namespace loom::jit::sass {
namespace fs = std::filesystem;
namespace {

bool startsWith(const std::string& text, const char* prefix) { return text.rfind(prefix, 0) == 0; }

std::string trim(const std::string& text) {
  const size_t first = text.find_first_not_of(" \t");
  if (first == std::string::npos) return "";
  const size_t last = text.find_last_not_of(" \t\r");
  return text.substr(first, last - first + 1);
}

// "/*01a0*/   @!P0 BRA `(.L_x_3) ;" -> the instruction; false for other lines.
bool parseInstruction(const std::string& line, Instruction& out) {
  const size_t open = line.find("/*");
  if (open == std::string::npos || line.find_first_not_of(" \t") != open) return false;
  const size_t close = line.find("*/", open + 2);
  if (close == std::string::npos) return false;
  const std::string offset = line.substr(open + 2, close - open - 2);
  if (offset.empty() || offset.find_first_not_of("0123456789abcdef") != std::string::npos) return false;
  out = Instruction();
  out.offset = int(std::stol(offset, nullptr, 16));
  std::string body = line.substr(close + 2);
  const size_t semicolon = body.find(';');
  if (semicolon != std::string::npos) body = body.substr(0, semicolon);
  body = trim(body);
  if (startsWith(body, "@")) {
    const size_t space = body.find(' ');
    out.predicate = body.substr(0, space);
    body = space == std::string::npos ? "" : trim(body.substr(space));
  }
  const size_t space = body.find(' ');
  out.opcode = body.substr(0, space);
  out.operands = space == std::string::npos ? "" : trim(body.substr(space));
  const size_t tick = out.operands.find("`(");
  if (tick != std::string::npos) {
    const size_t end = out.operands.find(')', tick);
    if (end != std::string::npos) out.target = out.operands.substr(tick + 2, end - tick - 2);
  }
  // BRX R4 -0x2550 (*"BRANCH_TARGETS .L_x_70,.L_x_71,.L_x_72"*)
  if (const size_t note = out.operands.find("BRANCH_TARGETS"); note != std::string::npos) {
    std::string list = out.operands.substr(note + std::string("BRANCH_TARGETS").size());
    list = list.substr(0, list.find('"'));
    std::stringstream labels(list);
    for (std::string label; std::getline(labels, label, ',');)
      if (!trim(label).empty()) out.switchTargets.push_back(trim(label));
  }
  return !out.opcode.empty();
}

// A transfer of control to a label. CALL.REL.NOINC is one too: ptxas both
// calls subroutines with it (a shuffle's divergent path, which returns)
// and jumps with it (out of a loop it peeled, which does not), so its
// flow goes to the target and on to the next instruction.
bool isBranch(const std::string& opcode) {
  return startsWith(opcode, "BRA") || startsWith(opcode, "BRX") || startsWith(opcode, "JMP") ||
         startsWith(opcode, "CALL.REL.NOINC");
}
// Control never reaches the next instruction. BRA.DIV branches only when
// the warp has diverged; CALL.REL.NOINC, above, falls through.
bool endsFlow(const Instruction& i) {
  if (startsWith(i.opcode, "BRA.DIV") || startsWith(i.opcode, "CALL")) return false;
  return (startsWith(i.opcode, "EXIT") || startsWith(i.opcode, "RET") || startsWith(i.opcode, "BRX") ||
          startsWith(i.opcode, "BPT") || isBranch(i.opcode)) &&
         (i.predicate.empty() || i.predicate == "@PT" || i.predicate == "@UPT");
}

bool isTensor(const std::string& opcode) {
  return startsWith(opcode, "HGMMA") || startsWith(opcode, "HMMA") || startsWith(opcode, "IMMA") ||
         startsWith(opcode, "QGMMA") || startsWith(opcode, "IGMMA");
}

// One warp's share of the FLOP of a tensor instruction: HGMMA.MxNxK is a
// warpgroup's (4 warps), HMMA.MNK a warp's (HMMA.16816: m16 n8 k16).
double tensorFlopsPerWarp(const std::string& opcode) {
  const size_t dot = opcode.find('.');
  if (dot == std::string::npos) return 0;
  const std::string shape = opcode.substr(dot + 1, opcode.find('.', dot + 1) - dot - 1);
  if (startsWith(opcode, "HGMMA") || startsWith(opcode, "QGMMA") || startsWith(opcode, "IGMMA")) {
    int m = 0, n = 0, k = 0;
    if (std::sscanf(shape.c_str(), "%dx%dx%d", &m, &n, &k) != 3) return 0;
    return 2.0 * m * n * k / 4;
  }
  if (shape.size() < 4 || shape.find_first_not_of("0123456789") != std::string::npos) return 0;
  const int m = std::stoi(shape.substr(0, 2)), n = std::stoi(shape.substr(2, 1)), k = std::stoi(shape.substr(3));
  return 2.0 * m * n * k;
}

// The first operand as an immediate ("0x2" -> 2); -1 when it is a register.
int immediateOperand(const std::string& operands) {
  const std::string first = trim(operands.substr(0, operands.find(',')));
  if (startsWith(first, "0x")) return int(std::stol(first.substr(2), nullptr, 16));
  if (!first.empty() && std::isdigit(static_cast<unsigned char>(first[0]))) return std::stoi(first);
  return -1;
}

struct Block {
  int first = 0, last = 0;  // instruction indices [first, last]
  std::vector<int> successors, predecessors;
};

}  // namespace

std::string classOf(const std::string& opcode) {
  const std::string base = opcode.substr(0, opcode.find('.'));
  if (isTensor(opcode)) return "tensor";
  if (startsWith(opcode, "MUFU.EX2")) return "mufu_ex2";
  if (base == "MUFU") return "mufu";
  if (base == "LDL" || base == "STL") return "local";
  static const std::set<std::string> fp32 = {"FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FSEL", "FSET", "FCHK", "FSWZADD"};
  if (fp32.count(base)) return "fp32";
  static const std::set<std::string> conversion = {"F2FP", "F2F", "I2F", "F2I", "FRND", "I2FP", "F2IP"};
  if (conversion.count(base)) return "conversion";
  if (base == "SHFL") return "shuffle";
  static const std::set<std::string> sync = {"BAR", "WARPGROUP", "SYNCS", "DEPBAR", "MEMBAR", "FENCE", "ERRBAR",
                                             "CCTL", "WARPSYNC", "ARRIVES", "UCGABAR_ARV", "UCGABAR_WAIT"};
  if (sync.count(base)) return "sync";
  static const std::set<std::string> memory = {"LDG",  "STG",  "LDS",   "STS",  "LDSM", "STSM",    "LD",      "ST",
                                               "ATOM", "ATOMG", "ATOMS", "RED", "REDG", "LDC",    "ULDC",    "LDGSTS",
                                               "UTMALDG", "UTMASTG", "UBLKCP", "UTMAPF", "UTMACCTL", "UBLKRED", "LDGDEPBAR",
                                               "UTMAREDG", "UBLKPF"};
  if (memory.count(base)) return "memory";
  static const std::set<std::string> branch = {"BRA", "BRX", "JMP", "CALL", "RET", "EXIT", "BSSY", "BSYNC", "BREAK",
                                               "KILL", "BPT", "YIELD", "NANOSLEEP"};
  if (branch.count(base)) return "branch";
  if (base[0] == 'U' || base == "R2UR" || base == "S2UR") return "uniform";
  static const std::set<std::string> integer = {"IADD3", "IMAD", "IMUL", "ISETP", "IMNMX", "IABS", "LOP3", "LEA",
                                                "SHF",   "SHL",  "SHR",  "SEL",   "PRMT",  "POPC", "FLO",  "BREV",
                                                "BMSK",  "IADD", "IDP",  "LOP",   "VIADD", "VIMNMX", "IMNMX3", "LEA.HI"};
  if (integer.count(base)) return "integer";
  return "other";
}

std::vector<Function> parseListing(const std::string& text) {
  std::vector<Function> functions;
  std::istringstream lines(text);
  std::string line;
  std::vector<std::string> pendingLabels;
  while (std::getline(lines, line)) {
    const std::string t = trim(line);
    if (startsWith(t, ".text.") && !t.empty() && t.back() == ':') {
      functions.emplace_back().name = t.substr(6, t.size() - 7);
      pendingLabels.clear();
      continue;
    }
    if (functions.empty()) continue;
    Function& f = functions.back();
    if (startsWith(t, ".L") && t.back() == ':' && t.find(' ') == std::string::npos) {
      pendingLabels.push_back(t.substr(0, t.size() - 1));
      continue;
    }
    Instruction instruction;
    if (!parseInstruction(line, instruction)) continue;
    for (const std::string& label : pendingLabels) f.labels[label] = int(f.code.size());
    pendingLabels.clear();
    f.code.push_back(std::move(instruction));
  }
  return functions;
}

namespace {

// The figures of one loop (its hot blocks of `body`, first instruction at
// `offset`).
void describeLoop(const Function& f, const std::vector<Block>& blocks, const std::vector<bool>& hot,
                  const std::set<int>& body, int offset, v1::SassLoop& loop) {
  loop.set_first_offset(offset);

  std::vector<const Instruction*> code;  // address order
  for (int b : body)
    if (hot[size_t(b)])
      for (int k = blocks[size_t(b)].first; k <= blocks[size_t(b)].last; ++k) code.push_back(&f.code[size_t(k)]);
  std::map<std::string, int> classes;
  for (const char* c : kClasses) classes[c] = 0;
  double flops = 0;
  int maskSelects = 0;
  std::set<int> synced, arrived;
  for (const Instruction* i : code) {
    const std::string c = classOf(i->opcode);
    ++classes[c];
    if (c == "tensor") flops += tensorFlopsPerWarp(i->opcode);
    if (c == "local") loop.set_local_memory(loop.local_memory() + 1);
    const std::string base = i->opcode.substr(0, i->opcode.find('.'));
    if ((base == "FSEL" || base == "SEL" || base == "MOV" || base == "IMAD") &&
        (i->operands.find("-INF") != std::string::npos || i->operands.find("0xff800000") != std::string::npos ||
         i->operands.find("-0x800000") != std::string::npos))
      ++maskSelects;
    if (base == "BAR") {
      const int id = immediateOperand(i->operands);
      if (id == 0) continue;
      if (startsWith(i->opcode, "BAR.ARV")) arrived.insert(id);
      else if (startsWith(i->opcode, "BAR.SYNC") || startsWith(i->opcode, "BAR.RED")) synced.insert(id);
    }
  }
  loop.set_instructions(int(code.size()));
  for (const char* name : kClasses) {
    v1::SassClassCount& c = *loop.add_classes();
    c.set_name(name);
    c.set_count(classes[name]);
  }
  loop.set_tensor_flops_per_warp(flops);
  loop.set_instructions_per_tensor_mflop(flops > 0 ? code.size() / (flops / 1e6) : 0);
  // A mask selects -inf into each score a thread holds that it hides: at
  // least four of them (an absorbed step's one-warp m-tile of eight
  // tokens holds four scores a thread; a 16 x 16 tile, eight).
  loop.set_masked(maskSelects >= 4);
  loop.set_exponentials(classes["mufu_ex2"]);
  for (int id : synced) loop.add_named_barriers_synced(id);
  for (int id : arrived) loop.add_named_barriers_arrived(id);
  bool pingPong = false;
  for (int s : synced)
    for (int a : arrived) pingPong = pingPong || s != a || s < 0;
  loop.set_ping_pong(pingPong);
  // The P V window: from a wait that leaves one group in flight (S retired,
  // P V running) to the next wait for none, following the loop around.
  int best = -1;
  const int m = int(code.size());
  for (int k = 0; k < m; ++k) {
    if (!startsWith(code[size_t(k)]->opcode, "WARPGROUP.DEPBAR") || immediateOperand(code[size_t(k)]->operands.substr(
                                                                        code[size_t(k)]->operands.find(',') + 1)) != 1)
      continue;
    int inside = 0;
    for (int step = 1; step < m; ++step) {
      const Instruction* i = code[size_t((k + step) % m)];
      if (startsWith(i->opcode, "WARPGROUP.DEPBAR")) {
        const size_t comma = i->operands.find(',');
        if (comma != std::string::npos && immediateOperand(i->operands.substr(comma + 1)) == 0) {
          best = std::max(best, inside);
          break;
        }
      }
      if (startsWith(i->opcode, "MUFU.EX2")) ++inside;
    }
  }
  loop.set_exponentials_in_pv_window(best);
}

// Static counts of the function's memory instructions by kind and width.
void countMemory(const Function& f, v1::SassMemory& m) {
  auto has = [](const std::string& opcode, const char* part) { return opcode.find(part) != std::string::npos; };
  for (const Instruction& i : f.code) {
    const std::string base = i.opcode.substr(0, i.opcode.find('.'));
    const bool wide = has(i.opcode, ".64") || has(i.opcode, ".128");
    const bool narrow = has(i.opcode, ".U16") || has(i.opcode, ".S16");
    if (base == "LDG") {
      m.set_global_loads(m.global_loads() + 1);
      if (wide) m.set_global_loads_wide(m.global_loads_wide() + 1);
      if (narrow) m.set_global_loads_16bit(m.global_loads_16bit() + 1);
    } else if (base == "STG") {
      m.set_global_stores(m.global_stores() + 1);
      if (wide) m.set_global_stores_wide(m.global_stores_wide() + 1);
      if (narrow) m.set_global_stores_16bit(m.global_stores_16bit() + 1);
    } else if (base == "LDS") {
      m.set_shared_loads(m.shared_loads() + 1);
      if (wide) m.set_shared_loads_wide(m.shared_loads_wide() + 1);
      if (narrow) m.set_shared_loads_16bit(m.shared_loads_16bit() + 1);
    } else if (base == "LDGSTS" || base == "UBLKCP" || base == "UTMALDG") {
      m.set_async_copies(m.async_copies() + 1);
    }
  }
}

}  // namespace

void analyzeFunction(const Function& f, v1::ResourceUsage& usage) {
  usage.clear_loops();
  usage.clear_simt_loops();
  usage.clear_memory();
  usage.clear_setmaxnreg();
  usage.set_sass_read(true);
  usage.set_sass_reader(kReaderVersion);
  const int n = int(f.code.size());
  for (const Instruction& i : f.code)
    if (startsWith(i.opcode, "USETMAXREG")) {
      const int count = immediateOperand(i.operands.substr(i.operands.rfind(',') == std::string::npos
                                                                 ? 0
                                                                 : i.operands.rfind(',') + 1));
      usage.add_setmaxnreg(i.opcode.find("DEALLOC") != std::string::npos ? -count : count);
    }
  if (n == 0) return;

  // Basic blocks: leaders are the entry, branch targets and what follows a
  // branch or exit.
  std::vector<bool> leader(size_t(n) + 1, false);
  leader[0] = true;
  for (int k = 0; k < n; ++k) {
    const Instruction& i = f.code[size_t(k)];
    if (!i.target.empty())
      if (auto found = f.labels.find(i.target); found != f.labels.end()) leader[size_t(found->second)] = true;
    for (const std::string& label : i.switchTargets)
      if (auto found = f.labels.find(label); found != f.labels.end()) leader[size_t(found->second)] = true;
    if (isBranch(i.opcode) || startsWith(i.opcode, "EXIT") || startsWith(i.opcode, "RET"))
      leader[size_t(k) + 1] = true;
  }
  std::vector<Block> blocks;
  std::vector<int> blockOf(size_t(n), -1);
  for (int k = 0; k < n; ++k) {
    if (leader[size_t(k)]) blocks.push_back({k, k, {}, {}});
    blocks.back().last = k;
    blockOf[size_t(k)] = int(blocks.size()) - 1;
  }
  const int B = int(blocks.size());
  for (int b = 0; b < B; ++b) {
    const Instruction& last = f.code[size_t(blocks[size_t(b)].last)];
    if (!last.target.empty())
      if (auto found = f.labels.find(last.target); found != f.labels.end())
        blocks[size_t(b)].successors.push_back(blockOf[size_t(found->second)]);
    for (const std::string& label : last.switchTargets)
      if (auto found = f.labels.find(label); found != f.labels.end())
        blocks[size_t(b)].successors.push_back(blockOf[size_t(found->second)]);
    if (!endsFlow(last) && b + 1 < B) blocks[size_t(b)].successors.push_back(b + 1);
  }
  for (int b = 0; b < B; ++b)
    for (int s : blocks[size_t(b)].successors) blocks[size_t(s)].predecessors.push_back(b);

  // Hot blocks: reachable from the entry without taking a BRA.DIV (the
  // out-of-line path a shuffle takes only when its warp has diverged; a
  // loop's figures leave it out, as a converged warp never issues it).
  std::vector<bool> hot(size_t(B), false);
  {
    std::vector<int> work = {0};
    hot[0] = true;
    while (!work.empty()) {
      const int b = work.back();
      work.pop_back();
      const Instruction& last = f.code[size_t(blocks[size_t(b)].last)];
      const bool divergent = startsWith(last.opcode, "BRA.DIV");
      for (size_t k = 0; k < blocks[size_t(b)].successors.size(); ++k) {
        const int next = blocks[size_t(b)].successors[k];
        if (divergent && k == 0 && next != b + 1) continue;  // the taken edge (listed first)
        if (!hot[size_t(next)]) hot[size_t(next)] = true, work.push_back(next);
      }
    }
  }

  // Dominators (iterative, over the blocks reachable from the entry).
  std::vector<bool> reachable(size_t(B), false);
  std::vector<int> stack = {0};
  reachable[0] = true;
  while (!stack.empty()) {
    const int b = stack.back();
    stack.pop_back();
    for (int s : blocks[size_t(b)].successors)
      if (!reachable[size_t(s)]) reachable[size_t(s)] = true, stack.push_back(s);
  }
  std::vector<std::vector<bool>> dom(size_t(B), std::vector<bool>(size_t(B), true));
  dom[0].assign(size_t(B), false);
  dom[0][0] = true;
  for (bool changed = true; changed;) {
    changed = false;
    for (int b = 1; b < B; ++b) {
      if (!reachable[size_t(b)]) continue;
      std::vector<bool> meet(size_t(B), true);
      bool any = false;
      for (int p : blocks[size_t(b)].predecessors) {
        if (!reachable[size_t(p)]) continue;
        any = true;
        for (int x = 0; x < B; ++x) meet[size_t(x)] = meet[size_t(x)] && dom[size_t(p)][size_t(x)];
      }
      if (!any) meet.assign(size_t(B), false);
      meet[size_t(b)] = true;
      if (meet != dom[size_t(b)]) dom[size_t(b)] = std::move(meet), changed = true;
    }
  }

  // Natural loops, one per header (the union of its back edges' bodies).
  std::map<int, std::set<int>> loops;
  for (int u = 0; u < B; ++u) {
    if (!reachable[size_t(u)]) continue;
    for (int v : blocks[size_t(u)].successors) {
      if (!dom[size_t(u)][size_t(v)]) continue;
      std::set<int>& body = loops[v];
      body.insert(v);
      std::vector<int> work;
      if (body.insert(u).second) work.push_back(u);
      while (!work.empty()) {
        const int x = work.back();
        work.pop_back();
        for (int p : blocks[size_t(x)].predecessors)
          if (reachable[size_t(p)] && body.insert(p).second) work.push_back(p);
      }
    }
  }
  auto holdsTensor = [&](const std::set<int>& body) {
    for (int b : body)
      for (int k = blocks[size_t(b)].first; k <= blocks[size_t(b)].last; ++k)
        if (isTensor(f.code[size_t(k)].opcode)) return true;
    return false;
  };
  // A wait, not work: an mbarrier try-wait retried, or an ELECT's loop over
  // the warp's lanes (its trips are stalls or one).
  auto isSpin = [&](const std::set<int>& body) {
    int instructions = 0;
    bool waits = false;
    for (int b : body)
      for (int k = blocks[size_t(b)].first; k <= blocks[size_t(b)].last; ++k) {
        ++instructions;
        const std::string& opcode = f.code[size_t(k)].opcode;
        waits = waits || startsWith(opcode, "SYNCS.PHASECHK") || startsWith(opcode, "ELECT");
      }
    return waits && instructions <= 16;
  };
  // The innermost of `candidates` (loops holding none of the others), by
  // first offset.
  auto innermostOf = [&](const std::vector<const std::set<int>*>& candidates) {
    std::vector<std::pair<int, const std::set<int>*>> innermost;  // first offset, body
    for (const std::set<int>* body : candidates) {
      bool holdsAnother = false;
      for (const std::set<int>* other : candidates)
        if (other != body && other->size() < body->size() &&
            std::includes(body->begin(), body->end(), other->begin(), other->end()))
          holdsAnother = true;
      if (!holdsAnother) innermost.emplace_back(f.code[size_t(blocks[size_t(*body->begin())].first)].offset, body);
    }
    std::sort(innermost.begin(), innermost.end());
    return innermost;
  };
  std::vector<const std::set<int>*> tensorLoops, allLoops;
  for (const auto& [header, body] : loops) {
    allLoops.push_back(&body);
    if (holdsTensor(body)) tensorLoops.push_back(&body);
  }
  for (const auto& [offset, body] : innermostOf(tensorLoops)) {
    v1::SassLoop& loop = *usage.add_loops();
    describeLoop(f, blocks, hot, *body, offset, loop);
    int inner = 0;  // the loops without tensor cores inside it, innermost or not
    for (const std::set<int>* other : allLoops)
      if (other != body && other->size() < body->size() &&
          std::includes(body->begin(), body->end(), other->begin(), other->end()) && !isSpin(*other))
        ++inner;
    loop.set_inner_loops(inner);
  }
  for (const auto& [offset, body] : innermostOf(allLoops))
    if (!holdsTensor(*body)) describeLoop(f, blocks, hot, *body, offset, *usage.add_simt_loops());
  countMemory(f, *usage.mutable_memory());
}

std::string nvdisasmPath() {
  if (const char* chosen = std::getenv("LOOM_NVDISASM"); chosen && *chosen) return chosen;
  std::vector<std::string> candidates;
#ifdef LOOM_NVDISASM_DEFAULT
  candidates.push_back(LOOM_NVDISASM_DEFAULT);
#endif
  if (const char* path = std::getenv("PATH")) {
    std::istringstream dirs(path);
    for (std::string dir; std::getline(dirs, dir, ':');)
      if (!dir.empty()) candidates.push_back(dir + "/nvdisasm");
  }
  candidates.push_back("/usr/local/cuda/bin/nvdisasm");
  for (const std::string& candidate : candidates)
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  return "";
}

Result<std::string> disassemble(const std::string& cubin) {
  const std::string tool = nvdisasmPath();
  if (tool.empty())
    return makeError("no nvdisasm: scripts/setup installs it under .tools/ (or set LOOM_NVDISASM)");
  char name[] = "/tmp/loom-sass-XXXXXX";
  const int fd = ::mkstemp(name);
  if (fd < 0) return makeError("cannot create a temporary file for nvdisasm");
  ::close(fd);
  {
    std::ofstream out(name, std::ios::binary);
    out.write(cubin.data(), std::streamsize(cubin.size()));
    if (!out) {
      ::unlink(name);
      return makeError("cannot write the cubin for nvdisasm");
    }
  }
  auto quoted = [](const std::string& text) {
    std::string q = "'";
    for (char c : text) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
  };
  const std::string command = quoted(tool) + " -c " + quoted(name) + " 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  if (!pipe) {
    ::unlink(name);
    return makeError("cannot run " + tool);
  }
  std::string listing;
  std::array<char, 65536> buffer;
  for (size_t got; (got = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0;) listing.append(buffer.data(), got);
  const int status = ::pclose(pipe);
  ::unlink(name);
  if (status != 0) return makeError(tool + " failed on the cubin", listing);
  return listing;
}

Status readLoops(const std::string& cubin, std::vector<v1::ResourceUsage>& resources) {
  auto listing = disassemble(cubin);
  if (!listing) return listing.error();
  applyListing(*listing, resources);
  return Status::success();
}

void applyListing(const std::string& listing, std::vector<v1::ResourceUsage>& resources) {
  for (const Function& function : parseListing(listing)) {
    v1::ResourceUsage* usage = nullptr;
    for (v1::ResourceUsage& u : resources)
      if (u.entry() == function.name) usage = &u;
    if (!usage) {
      usage = &resources.emplace_back();
      usage->set_entry(function.name);
    }
    analyzeFunction(function, *usage);
  }
}

bool pingPongExpected(const v1::Schedule& schedule) {
  return schedule.engine() == v1::engine_wgmma && schedule.warps() > 4;
}

std::vector<std::string> gateMisses(const v1::ResourceUsage& usage, const v1::KernelSpec& spec,
                                    const v1::Schedule& schedule) {
  return budgetMisses(usage, spec.head_dim(), pingPongExpected(schedule));
}

double fa3BackwardPerTensorMflop(int headDim) {
  switch (headDim) {
    case 96: return kFa3BackwardHdim96PerTensorMflop;
    case 128: return kFa3BackwardPerTensorMflop;
    case 192: return kFa3BackwardHdim192PerTensorMflop;
    case 256: return kFa3BackwardHdim256PerTensorMflop;
    default: return 0;
  }
}

std::vector<std::string> backwardGateMisses(const v1::ResourceUsage& usage, int headDim) {
  const double budget = fa3BackwardPerTensorMflop(headDim);
  std::vector<std::string> misses;
  for (const v1::SassLoop& loop : usage.loops()) {
    if (loop.tensor_flops_per_warp() <= 0) continue;
    std::ostringstream where;
    where << usage.entry() << " loop at 0x" << std::hex << loop.first_offset() << std::dec
          << (loop.masked() ? " (masked)" : "");
    if (!loop.masked() && budget > 0 && loop.instructions_per_tensor_mflop() > budget) {
      std::ostringstream line;
      line << where.str() << ": " << std::fixed << std::setprecision(0) << loop.instructions_per_tensor_mflop()
           << " instructions per tensor MFLOP, over FlashAttention-3's backward at head_dim " << headDim << " ("
           << budget << ")";
      misses.push_back(line.str());
    }
    if (loop.local_memory() > 0)
      misses.push_back(where.str() + ": " + std::to_string(loop.local_memory()) + " local-memory instructions");
  }
  return misses;
}

double fa3PerTensorMflop(int headDim, bool masked) {
  if (headDim == 128) return masked ? 599 : 459;  // 628 and 481 instructions per warp, 128 x 128
  if (headDim == 64) return masked ? 1123 : 845;  // 589 and 443, 192 x 128
  return 0;
}

double budgetPerTensorMflop(int headDim, bool masked) {
  if (headDim == 128) return masked ? 588 : 447;   // 616 and 469 instructions per warp, 128 x 128
  if (headDim == 64) return masked ? 1101 : 822;   // 577 and 431
  return 0;
}

std::vector<std::string> budgetMisses(const v1::ResourceUsage& usage, int headDim, bool pingPong) {
  std::vector<std::string> misses;
  for (const v1::SassLoop& loop : usage.loops()) {
    std::ostringstream where;
    where << usage.entry() << " loop at 0x" << std::hex << loop.first_offset() << std::dec
          << (loop.masked() ? " (masked)" : "");
    const double budget = budgetPerTensorMflop(headDim, loop.masked());
    if (budget > 0 && loop.instructions_per_tensor_mflop() > budget) {
      std::ostringstream line;
      line << where.str() << ": " << std::fixed << std::setprecision(0) << loop.instructions_per_tensor_mflop()
           << " instructions per tensor MFLOP, over the gate of " << budget << " (FlashAttention-3: "
           << fa3PerTensorMflop(headDim, loop.masked()) << ")";
      misses.push_back(line.str());
    }
    if (loop.exponentials() > 0 &&
        loop.exponentials_in_pv_window() < kMinExpInPvWindowShare * loop.exponentials() - 1e-9)
      misses.push_back(where.str() + ": " + std::to_string(std::max(0, loop.exponentials_in_pv_window())) + " of " +
                       std::to_string(loop.exponentials()) +
                       " exponentials between the wait for S and the wait for P V (at least 13 of 66 wanted)");
    if (pingPong && !loop.ping_pong())
      misses.push_back(where.str() + ": no ping-pong (no named barrier synced with another's arrival)");
    if (loop.local_memory() > 0)
      misses.push_back(where.str() + ": " + std::to_string(loop.local_memory()) + " local-memory instructions");
  }
  return misses;
}

int classCount(const v1::SassLoop& loop, const std::string& name) {
  for (const v1::SassClassCount& c : loop.classes())
    if (c.name() == name) return c.count();
  return 0;
}

std::string loopsBrief(const v1::ResourceUsage& usage) {
  if (!usage.sass_read()) return "SASS not read";
  std::ostringstream out;
  for (const v1::SassLoop& loop : usage.loops())
    out << (out.tellp() > 0 ? ", " : "") << std::fixed << std::setprecision(0) << loop.instructions_per_tensor_mflop()
        << (loop.masked() ? "m" : "") << " " << std::max(0, loop.exponentials_in_pv_window()) << "/"
        << loop.exponentials() << (loop.ping_pong() ? " pp" : "");
  return usage.loops().empty() ? "-" : out.str();
}

std::string memoryBrief(const v1::SassMemory& m) {
  std::ostringstream out;
  out << "global loads " << m.global_loads() << " (" << m.global_loads_wide() << " wide, " << m.global_loads_16bit()
      << " 16-bit), stores " << m.global_stores() << " (" << m.global_stores_wide() << " wide, "
      << m.global_stores_16bit() << " 16-bit); shared loads " << m.shared_loads() << " (" << m.shared_loads_wide()
      << " wide, " << m.shared_loads_16bit() << " 16-bit); async copies " << m.async_copies();
  return out.str();
}

std::string formatLoops(const std::vector<v1::ResourceUsage>& resources) {
  std::ostringstream out;
  for (const v1::ResourceUsage& u : resources) {
    out << u.entry() << ": " << u.registers() << " registers";
    if (u.setmaxnreg_size()) {
      out << ", setmaxnreg";
      for (int r : u.setmaxnreg()) out << (r < 0 ? " dec " : " inc ") << std::abs(r);
    }
    if (!u.sass_read()) {
      out << " (SASS not read)\n";
      continue;
    }
    out << ", " << u.loops_size() << " tensor-core loop" << (u.loops_size() == 1 ? "" : "s") << "\n";
    for (const v1::SassLoop& l : u.loops()) {
      out << "  loop at 0x" << std::hex << l.first_offset() << std::dec << (l.masked() ? " (masked)" : "") << ": "
          << l.instructions() << " instructions per warp per iteration, " << std::fixed << std::setprecision(0)
          << l.instructions_per_tensor_mflop() << " per tensor MFLOP (" << std::setprecision(3)
          << l.tensor_flops_per_warp() / 1e6 << " MFLOP a warp)";
      if (l.inner_loops())
        out << ", holds " << l.inner_loops() << " inner loop" << (l.inner_loops() == 1 ? "" : "s")
            << " (each body counted once)";
      out << "\n    ";
      for (const v1::SassClassCount& c : l.classes())
        if (c.count()) out << c.name() << " " << c.count() << "  ";
      out << "\n    MUFU.EX2 in the P V window: ";
      if (l.exponentials_in_pv_window() < 0) out << "no window";
      else out << l.exponentials_in_pv_window() << " of " << l.exponentials();
      out << "; named barriers: sync";
      for (int id : l.named_barriers_synced()) out << " " << id;
      if (l.named_barriers_synced().empty()) out << " none";
      out << ", arrive";
      for (int id : l.named_barriers_arrived()) out << " " << id;
      if (l.named_barriers_arrived().empty()) out << " none";
      out << (l.ping_pong() ? " (ping-pong)" : "") << "; local memory " << l.local_memory() << "\n";
    }
    out << "  " << memoryBrief(u.memory()) << "\n";
    for (const v1::SassLoop& l : u.simt_loops()) {
      out << "  loop at 0x" << std::hex << l.first_offset() << std::dec << " (no tensor cores): " << l.instructions()
          << " instructions per warp per iteration\n    ";
      for (const v1::SassClassCount& c : l.classes())
        if (c.count()) out << c.name() << " " << c.count() << "  ";
      out << "\n";
    }
  }
  return out.str();
}

}  // namespace loom::jit::sass
