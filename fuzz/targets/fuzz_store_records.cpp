// A store's rows as the stores read them back (both the SQLite and the
// PostgreSQL store take records through detail::soundRecord and
// decisionFromJson): any bytes split into a row's fields, once with the
// checksum they carry and once with the checksum of their blob, so the
// parsing past the checksum is reached. Checking never crashes; a row that
// passes is stored, served, and passes verify; a row that fails is not
// taken.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "loom/cache.h"
#include "records.h"
#include "scratch.h"

namespace {

using loom::cache::detail::Record;

// Fields separated by 0x00 bytes: kind, key, device, toolchain, class,
// bucket, checksum, then the blob (the rest).
Record split(const uint8_t* data, size_t size) {
  Record record;
  std::string fields[7];
  size_t at = 0;
  for (int f = 0; f < 7 && at < size; ++f) {
    while (at < size && data[at] != 0) fields[f].push_back(char(data[at++]));
    ++at;
  }
  if (at < size) record.blob.assign(reinterpret_cast<const char*>(data + at), size - at);
  const int kind = fields[0].empty() ? 0 : uint8_t(fields[0][0]) % 3;
  record.kind = kind == 0 ? Record::Kind::artifact : kind == 1 ? Record::Kind::decision : Record::Kind::ranking;
  record.key = fields[1];
  record.device = fields[2];
  record.toolchain = fields[3];
  record.deviceClass = fields[4];
  record.shapeBucket = fields[5];
  record.checksum = fields[6];
  record.created = record.lastUsed = 1;
  return record;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fs = std::filesystem;
  namespace detail = loom::cache::detail;
  Record given = split(data, size);
  Record summed = given;
  summed.checksum = detail::checksumOf(summed.blob);
  (void)detail::decisionFromJson(given.blob);

  const fs::path path = loom::fuzz::scratch() / "records.sqlite";
  for (const char* suffix : {"", "-wal", "-shm"}) fs::remove(path.string() + suffix);
  auto opened = loom::cache::openSqliteStore(path.string());
  if (!opened) std::abort();  // a fresh store always opens
  auto& store = static_cast<detail::RecordStore&>(**opened);
  int sound = 0;
  for (const Record& record : {given, summed}) sound += detail::soundRecord(record);
  auto stored = store.putRecords({given, summed});
  if (!stored || *stored != sound) std::abort();  // exactly the sound rows are taken
  auto report = store.verify();
  if (!report || !report->corrupt.empty()) std::abort();
  for (const Record& record : {given, summed}) {
    if (!detail::soundRecord(record) || record.kind != Record::Kind::artifact) continue;
    auto served = store.getArtifact(record.key);
    if (!served || !served->has_value()) {
      std::fprintf(stderr, "a sound artifact was not served\n");
      std::abort();
    }
  }
  return 0;
}
