// loom sass: the tensor-core loops of any cubin (or of nvdisasm's listing of
// one), read as `loom compile --sass` reads loom's own: how the SASS anchors
// of docs/performance.md are measured on a peer's binary.
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "commands.h"
#include "jit/sass.h"
#include "loom/spec.h"

namespace loom::cli {
namespace {

struct SassOptions {
  std::string path;
  bool listing = false;
  std::string function;
  bool json = false;
};

int sassReport(const SassOptions& options) {
  std::ifstream in(options.path, std::ios::binary);
  if (!in) return badInput(options.path + ": cannot read");
  std::stringstream bytes;
  bytes << in.rdbuf();
  std::string text = bytes.str();
  if (!options.listing) {
    auto listing = jit::sass::disassemble(text);
    if (!listing) return badInput(listing.error().message + "\n" + listing.error().log);
    text = *listing;
  }
  std::vector<v1::ResourceUsage> entries;
  for (const jit::sass::Function& function : jit::sass::parseListing(text)) {
    if (!options.function.empty() && function.name.find(options.function) == std::string::npos) continue;
    v1::ResourceUsage& usage = entries.emplace_back();
    usage.set_entry(function.name);
    jit::sass::analyzeFunction(function, usage);
  }
  if (entries.empty()) return badInput(options.path + ": no function" +
                                       (options.function.empty() ? "" : " matching " + options.function));
  if (options.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const v1::ResourceUsage& u : entries) out.push_back(nlohmann::json::parse(toJson(u)));
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    std::printf("%s", jit::sass::formatLoops(entries).c_str());
  }
  return kExitOk;
}

}  // namespace

void addSassCommand(CLI::App& app, std::function<int()>* action) {
  auto options = std::make_shared<SassOptions>();
  CLI::App* cmd = app.add_subcommand(
      "sass", "Read the tensor-core loops of any cubin (nvdisasm; no GPU needed): per function, each innermost\n"
              "loop holding HGMMA or HMMA, its instructions per warp per iteration by class, per tensor MFLOP,\n"
              "the exponentials between the wait for S and the wait for P V, named barriers (ping-pong), local\n"
              "memory, setmaxnreg. The same reading as `loom compile --sass`, for a peer's binary (the anchors of\n"
              "docs/performance.md) or a listing saved with --sass-listing.");
  cmd->add_option("file", options->path, "a cubin, or with --listing nvdisasm's text")->required();
  cmd->add_flag("--listing", options->listing, "the file is nvdisasm's listing (nvdisasm -c), not a cubin");
  cmd->add_option("--function", options->function, "only functions whose (mangled) name contains this");
  cmd->add_flag("--json", options->json, "print the figures as JSON (ResourceUsage with its SassLoops)");
  cmd->callback([options, action] { *action = [options] { return sassReport(*options); }; });
}

}  // namespace loom::cli
