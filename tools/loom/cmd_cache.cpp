// loom cache: look at and manage the kernel cache (compiled kernels and
// tuning decisions): ls, show, rm, verify, export, import.
#include <cstdio>
#include <ctime>
#include <memory>
#include <string>

#include "commands.h"
#include "loom/cache.h"

namespace loom::cli {
namespace {

struct CacheOptions {
  std::string path;
  std::string id;
  std::string file;
};

std::string when(int64_t seconds) {
  char text[32];
  const std::time_t t = std::time_t(seconds);
  std::strftime(text, sizeof text, "%Y-%m-%d %H:%M", std::gmtime(&t));
  return text;
}

int run(const std::string& action, const CacheOptions& options) {
  const std::string location = options.path.empty() ? cache::defaultStorePath() : options.path;
  const std::string path = cache::redactedLocation(location);  // what is printed
  auto store = cache::openStore(location);
  if (!store) return badInput(store.error().message);
  cache::KernelStore& s = **store;
  if (action == "ls") {
    auto entries = s.list();
    if (!entries) return badInput(entries.error().message);
    std::printf("%s: %zu entries\n", path.c_str(), entries->size());
    for (const auto& e : *entries)
      std::printf("%-9s %-16.48s %9lld B  %s  %s\n", e.kind.c_str(), e.id.c_str(), (long long)e.bytes,
                  when(e.lastUsed).c_str(), e.summary.c_str());
    return kExitOk;
  }
  if (action == "show") {
    auto text = s.describe(options.id);
    if (!text) return badInput(text.error().message);
    if (!text->has_value()) return badInput("no entry " + options.id + " in " + path);
    std::printf("%s\n", (*text)->c_str());
    return kExitOk;
  }
  if (action == "rm") {
    if (Status ok = s.remove(options.id); !ok) return badInput(ok.error().message);
    std::printf("removed %s\n", options.id.c_str());
    return kExitOk;
  }
  if (action == "verify") {
    auto report = s.verify();
    if (!report) return badInput(report.error().message);
    std::printf("checked %d records, %zu corrupt%s\n", report->checked, report->corrupt.size(),
                report->corrupt.empty() ? "" : " (removed):");
    for (const auto& id : report->corrupt) std::printf("  %s\n", id.c_str());
    return report->corrupt.empty() ? kExitOk : kExitCheckFailed;
  }
  if (action == "export") {
    if (Status ok = s.exportTo(options.file); !ok) return badInput(ok.error().message);
    std::printf("exported %s to %s\n", path.c_str(), options.file.c_str());
    return kExitOk;
  }
  auto imported = s.importFrom(options.file);
  if (!imported) return badInput(imported.error().message);
  std::printf("imported %d new records from %s\n", *imported, options.file.c_str());
  return kExitOk;
}

}  // namespace

void addCacheCommand(CLI::App& app, std::function<int()>* action) {
  auto options = std::make_shared<CacheOptions>();
  CLI::App* cmd = app.add_subcommand(
      "cache", "The kernel cache (compiled kernels and tuning decisions): one SQLite file,\n"
               "default $LOOM_CACHE_DIR/kernels.sqlite or ~/.cache/loom/kernels.sqlite, or the\n"
               "PostgreSQL database a fleet's replicas share (--store postgresql://...).\n"
               "Bundles (export, import) are SQLite files either store reads and writes.");
  cmd->add_option("--store,--path", options->path,
                  "the store: a SQLite file, or postgresql://USER@HOST:PORT/DB (libpq URI)");
  cmd->require_subcommand(1);
  auto add = [&](const char* name, const char* help, bool takesId, bool takesFile) {
    CLI::App* sub = cmd->add_subcommand(name, help);
    if (takesId) sub->add_option("id", options->id, "entry id (from loom cache ls)")->required();
    if (takesFile) sub->add_option("file", options->file, "bundle file")->required();
    const std::string verb = name;
    sub->callback([options, action, verb] { *action = [options, verb] { return run(verb, *options); }; });
  };
  add("ls", "list entries, most recently used first", false, false);
  add("show", "print one entry", true, false);
  add("rm", "remove one entry", true, false);
  add("verify", "check every record's checksum; corrupt ones are removed (exit 1 if any)", false, false);
  add("export", "copy every record into a bundle file for another machine", false, true);
  add("import", "merge a bundle file's records (each checked first)", false, true);
}

}  // namespace loom::cli
