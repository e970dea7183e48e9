// What the two stores share: how a record is encoded and checked, how a
// decision is chosen among a device's rows, and the record-level access
// that copies records from one store into the other (export and import
// between SQLite and PostgreSQL). Internal to cache/.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "loom/cache.h"

namespace loom::cache::detail {

int64_t now();  // unix seconds
std::string checksumOf(const std::string& blob);

std::string decisionToJson(const Decision& decision);
Result<Decision> decisionFromJson(const std::string& text);

// A decision's id (Entry::id; describe, remove): spec key / device /
// toolchain, and @bucket where it was tuned for one. The same expression
// in SQL for both stores' queries.
std::string decisionId(const std::string& specKey, const std::string& device, const std::string& toolchain,
                       const std::string& shapeBucket);
#define LOOM_DECISION_ID \
  "(spec_key || '/' || device || '/' || toolchain || CASE WHEN shape_bucket = '' THEN '' ELSE '@' || shape_bucket END)"

// One row of any table, as both stores keep it.
struct Record {
  enum class Kind { artifact, decision, ranking };
  Kind kind = Kind::artifact;
  std::string key;  // artifact or ranking key; a decision's spec key
  std::string device, toolchain, deviceClass, shapeBucket;  // decisions only
  std::string blob, checksum;
  int64_t created = 0, lastUsed = 0;
  int64_t bytes() const { return int64_t(blob.size()); }
};

// The row a store writes for each kind of record, stamped now.
Record artifactRecord(const v1::CompiledKernel& kernel);
Record decisionRecord(const Decision& decision);
Record rankingRecord(const std::string& key, const Schedule& schedule);

// Whether a stored row may be served (verify's check): its checksum holds,
// its blob parses, and an artifact's content address is its key.
bool readableRecord(const Record& record);
// That, and a decision's key columns are those of its blob: what a row
// must be to be taken into a store (import, putRecords).
bool soundRecord(const Record& record);

// An artifact described for `loom cache show`: its JSON without binary,
// source and PTX, with their sizes.
std::string describeArtifact(const v1::CompiledKernel& kernel);

// The row of one decision among a device's (or class's) candidates.
struct DecisionRow {
  std::string blob, checksum, bucket;
  std::string handle;  // the store's own way to name the row again (rowid, id)
};

// KernelStore::getDecision over a store's rows: `rows(fallback)` gives the
// decisions of (spec, direction, toolchain) on the device itself (false)
// or its class (true); a corrupt row is handed to `drop` and skipped, the
// one chosen to `touch`.
Result<std::optional<DecisionLookup>> chooseDecision(
    const DeviceModel& device, const std::string& shapeBucket,
    const std::function<Result<std::vector<DecisionRow>>(bool fallback)>& rows,
    const std::function<void(const DecisionRow&)>& drop, const std::function<void(const DecisionRow&)>& touch);

// Record-level access, beside KernelStore's, for copying between stores.
class RecordStore : public KernelStore {
 public:
  // Every record, table by table; stops at the first error `visit` returns.
  virtual Status forEachRecord(const std::function<Status(const Record&)>& visit) = 0;
  // Stores records as they are (replacing equal keys), in one transaction.
  // Each is checked with soundRecord first; unsound ones are not taken and
  // not counted.
  virtual Result<int> putRecords(const std::vector<Record>& records) = 0;
};

// Copies every sound record of `from` into `to`, in batches; how many went.
Result<int> copyRecords(RecordStore& from, RecordStore& to);

// Whether the SQLite file at `path` is whole, indexes included (an import
// reads it only if so).
Status sqliteFileIsWhole(const std::string& path);

}  // namespace loom::cache::detail
