#include "jit/nvrtc_compiler.h"

#include "jit/sass.h"

#include <google/protobuf/util/json_util.h>
#include <nvrtc.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "loom/cache_dir.h"
#include "loom/tile/layout.h"
#include "loom/hash.h"
#include "loom/spec.h"
#include "loom/tile_headers.h"
#include "loom/counters.h"

namespace loom::jit {
namespace fs = std::filesystem;
namespace {

std::string readAll(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string computeArch(const std::string& arch) { return "compute_" + arch.substr(3); }

}  // namespace

bool Artifact::usesTensorCores() const {
  return ptx.find("mma.sync.aligned") != std::string::npos || ptx.find("wgmma.mma_async") != std::string::npos;
}
bool Artifact::usesAsyncCopies() const { return ptx.find("cp.async") != std::string::npos; }
bool Artifact::usesWgmma() const { return ptx.find("wgmma.mma_async") != std::string::npos; }
bool Artifact::usesTma() const { return ptx.find("cp.async.bulk.tensor") != std::string::npos; }
bool Artifact::usesSetmaxnreg() const { return ptx.find("setmaxnreg") != std::string::npos; }

std::vector<std::string> Artifact::warnings() const {
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < log.size()) {
    size_t end = log.find('\n', start);
    if (end == std::string::npos) end = log.size();
    const std::string line = log.substr(start, end - start);
    if (line.find("warning") != std::string::npos || line.find("(C7") != std::string::npos) lines.push_back(line);
    start = end + 1;
  }
  return lines;
}
std::vector<std::string> Artifact::performanceLosses() const { return jit::performanceLosses(resources); }

int64_t Artifact::spillBytes() const {
  int64_t total = 0;
  for (const auto& r : resources) total += r.spill_store_bytes() + r.spill_load_bytes();
  return total;
}

std::string nvrtcVersion() {
  int major = 0, minor = 0;
  ::nvrtcVersion(&major, &minor);
  return "nvrtc-" + std::to_string(major) + "." + std::to_string(minor);
}

bool readsSassOnCompile(const std::string& arch) { return arch == "sm_90a"; }

Result<std::vector<v1::ResourceUsage>> resourcesWithSass(const Artifact& artifact) {
  std::vector<v1::ResourceUsage> resources = artifact.resources;
  if (!resources.empty() && resources.front().sass_read()) return resources;
  if (Status read = sass::readLoops(artifact.binary, resources); !read) return read.error();
  return resources;
}

bool nvrtcKnowsArch(const std::string& arch) {
  // Asked on every request the service takes: the list and the pattern once.
  static const std::vector<int> archs = [] {
    int count = 0;
    if (nvrtcGetNumSupportedArchs(&count) != NVRTC_SUCCESS) return std::vector<int>();
    std::vector<int> numbers(static_cast<size_t>(count));
    nvrtcGetSupportedArchs(numbers.data());
    return numbers;
  }();
  static const std::regex pattern("sm_([0-9]+)a?");
  std::smatch match;
  if (!std::regex_match(arch, match, pattern)) return false;
  const int number = std::stoi(match[1]);
  return std::find(archs.begin(), archs.end(), number) != archs.end();
}

std::vector<v1::ResourceUsage> parsePtxasReport(const std::string& log, const std::string& ptx) {
  std::vector<v1::ResourceUsage> usage;
  std::istringstream lines(log);
  std::string line;
  std::smatch m;
  const std::regex function(R"(Function properties for (\S+))");
  const std::regex frame(R"((\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads)");
  const std::regex registers(R"(Used (\d+) registers)");
  const std::regex shared(R"((\d+) bytes smem)");
  // "(C7520) Potential Performance Loss: ... in the function 'iha_attention'"
  const std::regex note(R"(\((C7\d\d\d)\) (.*?) in (?:the )?function '([^']+)')");
  std::vector<std::pair<std::string, std::string>> notes;  // entry, note
  while (std::getline(lines, line)) {
    if (std::regex_search(line, m, note)) {
      notes.emplace_back(m[3], std::string(m[1]) + " " + std::string(m[2]));
    } else if (std::regex_search(line, m, function)) {
      usage.emplace_back().set_entry(m[1]);
    } else if (!usage.empty() && std::regex_search(line, m, frame)) {
      usage.back().set_stack_frame_bytes(std::stoll(m[1]));
      usage.back().set_spill_store_bytes(std::stoll(m[2]));
      usage.back().set_spill_load_bytes(std::stoll(m[3]));
    } else if (!usage.empty() && std::regex_search(line, m, registers)) {
      usage.back().set_registers(std::stoi(m[1]));
      if (std::regex_search(line, m, shared)) usage.back().set_shared_memory_bytes(std::stoll(m[1]));
    }
  }
  auto entry = [&](const std::string& name) -> v1::ResourceUsage& {
    for (v1::ResourceUsage& u : usage)
      if (u.entry() == name) return u;
    v1::ResourceUsage& added = usage.emplace_back();
    added.set_entry(name);
    return added;
  };
  // ptxas prints a note once per entry and line; keep each once.
  for (const auto& [name, text] : notes) {
    v1::ResourceUsage& u = entry(name);
    if (std::find(u.performance_notes().begin(), u.performance_notes().end(), text) != u.performance_notes().end())
      continue;
    u.add_performance_notes(text);
    if (text.find("wgmma") != std::string::npos && text.find("serialized") != std::string::npos)
      u.set_serialized_wgmma(true);
  }
  // The PTX of each entry: from ".entry NAME(" to the next entry.
  const std::regex entryStart(R"(\.entry\s+(\w+)\s*\()");
  const std::regex fp64(R"(^\s*(?:@!?%\w+\s+)?([a-z][\w.]*)\s)");
  std::vector<std::pair<std::string, size_t>> starts;
  for (auto it = std::sregex_iterator(ptx.begin(), ptx.end(), entryStart); it != std::sregex_iterator(); ++it)
    starts.emplace_back((*it)[1], size_t(it->position()));
  for (size_t e = 0; e < starts.size(); ++e) {
    const size_t end = e + 1 < starts.size() ? starts[e + 1].second : ptx.size();
    std::istringstream body(ptx.substr(starts[e].second, end - starts[e].second));
    int doubles = 0, local = 0;
    while (std::getline(body, line)) {
      if (!std::regex_search(line, m, fp64)) continue;
      const std::string opcode = m[1];
      if (opcode.rfind("ld.local", 0) == 0 || opcode.rfind("st.local", 0) == 0) ++local;
      // Arithmetic, comparisons and conversions; moves and memory access of
      // f64 data cost nothing special.
      if (opcode.find(".f64") != std::string::npos && opcode.rfind("ld.", 0) != 0 && opcode.rfind("st.", 0) != 0 &&
          opcode.rfind("mov.", 0) != 0)
        ++doubles;
    }
    v1::ResourceUsage& u = entry(starts[e].first);
    u.set_fp64_instructions(doubles);
    u.set_local_memory_instructions(local);
  }
  return usage;
}

int registersOf(const std::vector<v1::ResourceUsage>& resources, std::string_view entry) {
  for (const v1::ResourceUsage& u : resources)
    if (u.entry() == entry) return u.registers();
  return 0;
}

std::vector<std::string> performanceLosses(const std::vector<v1::ResourceUsage>& resources) {
  std::vector<std::string> losses;
  for (const v1::ResourceUsage& u : resources) {
    const std::string& name = u.entry();
    if (u.spill_store_bytes() + u.spill_load_bytes() > 0)
      losses.push_back(name + " spills " + std::to_string(u.spill_store_bytes()) + " bytes and reloads " +
                       std::to_string(u.spill_load_bytes()) + " (" + std::to_string(u.registers()) + " registers)");
    if (u.stack_frame_bytes() > 0)
      losses.push_back(name + " has a " + std::to_string(u.stack_frame_bytes()) + "-byte stack frame");
    for (const std::string& note : u.performance_notes()) losses.push_back(name + ": ptxas " + note);
    if (u.fp64_instructions() > 0)
      losses.push_back(name + " computes in fp64 (" + std::to_string(u.fp64_instructions()) + " PTX instructions)");
    if (u.local_memory_instructions() > 0)
      losses.push_back(name + " uses local memory (" + std::to_string(u.local_memory_instructions()) +
                       " PTX instructions)");
  }
  return losses;
}

NvrtcCompiler::NvrtcCompiler(std::string cacheDir) : cacheDir_(std::move(cacheDir)) {}

Result<std::shared_ptr<const Artifact>> NvrtcCompiler::compile(const std::string& source, const std::string& arch) {
  const std::string key = ContentHash()
                              .add(source)
                              .add(arch)
                              .add(kNvrtcOptions)
                              .add(nvrtcVersion())
                              .add(tile::embeddedHeadersHash())
                              .hex();
  {
    std::lock_guard lock(mutex_);
    if (auto found = memory_.find(key); found != memory_.end()) return found->second;
  }
  if (auto cached = readDisk(key)) {
    std::lock_guard lock(mutex_);
    return memory_.emplace(key, cached).first->second;
  }
  // Compile outside the lock: different programs compile in parallel.
  auto compiled = compileUncached(source, arch, key);
  if (!compiled) return compiled;
  writeDisk(**compiled);
  std::lock_guard lock(mutex_);
  return memory_.emplace(key, *compiled).first->second;
}

Result<std::shared_ptr<const Artifact>> NvrtcCompiler::compileUncached(const std::string& source,
                                                                       const std::string& arch,
                                                                       const std::string& key) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<const char*> headerText, headerNames;
  for (const tile::EmbeddedFile& file : tile::embeddedHeaders()) {
    headerText.push_back(file.text);
    headerNames.push_back(file.path);
  }
  nvrtcProgram program;
  if (nvrtcCreateProgram(&program, source.c_str(), "iha.cu", int(headerText.size()), headerText.data(),
                         headerNames.data()) != NVRTC_SUCCESS)
    return makeError("NVRTC could not create a program");

  const bool cubin = nvrtcKnowsArch(arch);
  const std::string archOption = "--gpu-architecture=" + (cubin ? arch : computeArch(arch));
  std::vector<std::string> options = {archOption};
  std::istringstream fixed(kNvrtcOptions);
  for (std::string option; fixed >> option;) options.push_back(option);
  // ptxas options the program asks for on its first line (loom::kPtxasOptionsLine).
  if (source.rfind(kPtxasOptionsLine, 0) == 0) {
    std::istringstream asked(source.substr(std::strlen(kPtxasOptionsLine), source.find('\n') - std::strlen(kPtxasOptionsLine)));
    for (std::string option; asked >> option;) options.push_back("--ptxas-options=" + option);
  }
  std::vector<const char*> optionPointers;
  for (const std::string& option : options) optionPointers.push_back(option.c_str());
  count(Counter::programs_compiled);
  const nvrtcResult result = nvrtcCompileProgram(program, int(optionPointers.size()), optionPointers.data());

  auto artifact = std::make_shared<Artifact>();
  size_t logSize = 0;
  nvrtcGetProgramLogSize(program, &logSize);
  artifact->log.resize(logSize);
  nvrtcGetProgramLog(program, artifact->log.data());
  while (!artifact->log.empty() && artifact->log.back() == '\0') artifact->log.pop_back();
  if (result != NVRTC_SUCCESS) {
    nvrtcDestroyProgram(&program);
    return makeError(std::string("NVRTC failed for ") + arch + ": " + nvrtcGetErrorString(result), artifact->log);
  }
  size_t ptxSize = 0;
  if (nvrtcGetPTXSize(program, &ptxSize) == NVRTC_SUCCESS && ptxSize > 0) {
    artifact->ptx.resize(ptxSize);
    nvrtcGetPTX(program, artifact->ptx.data());
    while (!artifact->ptx.empty() && artifact->ptx.back() == '\0') artifact->ptx.pop_back();
  }
  if (cubin) {
    size_t size = 0;
    nvrtcGetCUBINSize(program, &size);
    artifact->binary.resize(size);
    nvrtcGetCUBIN(program, artifact->binary.data());
    artifact->binaryKind = "cubin";
  } else {
    artifact->binary = artifact->ptx;
    artifact->binaryKind = "ptx";
  }
  nvrtcDestroyProgram(&program);
  artifact->arch = arch;
  artifact->key = key;
  artifact->resources = parsePtxasReport(artifact->log, artifact->ptx);
  // The machine code's loops (sass.h) of the arch whose gates and cost
  // model read them; without nvdisasm they stay unread. (`loom compile
  // --sass` reads any arch's on demand.)
  if (cubin && readsSassOnCompile(arch)) (void)sass::readLoops(artifact->binary, artifact->resources);
  artifact->compileSeconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return std::shared_ptr<const Artifact>(artifact);
}

std::shared_ptr<const Artifact> NvrtcCompiler::readDisk(const std::string& key) {
  if (cacheDir_.empty()) return nullptr;
  const fs::path base = fs::path(cacheDir_) / "cuda" / key;
  const fs::path meta = base.string() + ".json";
  if (!fs::exists(meta)) return nullptr;
  v1::CompiledKernel record;  // binary + log + resources; source is not needed again
  if (!google::protobuf::util::JsonStringToMessage(readAll(meta), &record).ok()) return nullptr;
  auto artifact = std::make_shared<Artifact>();
  artifact->arch = record.target().arch();
  artifact->binary = readAll(base.string() + ".bin");
  artifact->binaryKind = record.toolchain().find("ptx") != std::string::npos ? "ptx" : "cubin";
  artifact->ptx = readAll(base.string() + ".ptx");
  artifact->log = record.compile_log();
  artifact->resources = parsePtxasReport(artifact->log, artifact->ptx);  // today's reading of the stored log
  // The SASS figures as stored; read now where they were not.
  bool sassRead = artifact->binaryKind == "cubin";
  for (v1::ResourceUsage& u : artifact->resources) {
    bool found = false;
    for (const v1::ResourceUsage& stored : record.resources())
      if (stored.entry() == u.entry() && stored.sass_read() && stored.sass_reader() == sass::kReaderVersion) {
        *u.mutable_loops() = stored.loops();
        *u.mutable_simt_loops() = stored.simt_loops();
        *u.mutable_memory() = stored.memory();
        *u.mutable_setmaxnreg() = stored.setmaxnreg();
        u.set_sass_reader(stored.sass_reader());
        u.set_sass_read(true);
        found = true;
      }
    sassRead = sassRead && found;
  }
  if (artifact->binaryKind == "cubin" && readsSassOnCompile(artifact->arch) && !sassRead)
    (void)sass::readLoops(artifact->binary, artifact->resources);
  artifact->compileSeconds = record.compile_seconds();
  artifact->fromCache = true;
  artifact->key = key;
  count(Counter::store_reads);
  if (artifact->binary.empty()) return nullptr;
  return artifact;
}

void NvrtcCompiler::writeDisk(const Artifact& artifact) {
  if (cacheDir_.empty()) return;
  const fs::path dir = fs::path(cacheDir_) / "cuda";
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return;  // the disk cache is an optimisation: failures are survived
  v1::CompiledKernel record;
  record.mutable_target()->set_arch(artifact.arch);
  record.set_toolchain(nvrtcVersion() + (artifact.binaryKind == "ptx" ? " ptx" : " cubin"));
  record.set_compile_log(artifact.log);
  record.set_compile_seconds(artifact.compileSeconds);
  for (const auto& r : artifact.resources) *record.add_resources() = r;
  const fs::path base = dir / artifact.key;
  // Binary first, metadata last: a reader sees the entry only when complete.
  if (!writeFileAtomically(base.string() + ".bin", artifact.binary)) return;
  if (!writeFileAtomically(base.string() + ".ptx", artifact.ptx)) return;
  (void)writeFileAtomically(base.string() + ".json", toJson(record));
}

}  // namespace loom::jit
