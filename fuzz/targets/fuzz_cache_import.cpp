// The cache's export file on import: any bytes as the file. Opening and
// importing succeed or fail cleanly; every record the store then serves
// passes its checks (the import verified them).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "loom/cache.h"
#include "scratch.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fs = std::filesystem;
  const fs::path dir = loom::fuzz::scratch();
  for (const char* name : {"bundle.sqlite", "bundle.sqlite-wal", "bundle.sqlite-shm", "here.sqlite",
                           "here.sqlite-wal", "here.sqlite-shm"})
    fs::remove(dir / name);
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().filename().string().rfind("bundle.sqlite.corrupt-", 0) == 0) fs::remove(entry.path());
  const std::string bundle = loom::fuzz::writeFile("bundle.sqlite", data, size);
  auto here = loom::cache::openSqliteStore((dir / "here.sqlite").string());
  if (!here) std::abort();  // a fresh store always opens
  auto imported = (*here)->importFrom(bundle);
  if (!imported) return 0;
  auto report = (*here)->verify();
  if (!report) std::abort();
  for (const std::string& id : report->corrupt) std::fprintf(stderr, "imported, then found corrupt: %s\n", id.c_str());
  if (!report->corrupt.empty()) std::abort();
  return 0;
}
