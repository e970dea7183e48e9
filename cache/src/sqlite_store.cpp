// The SQLite kernel store: one file, WAL, a busy timeout so several
// processes can read and write it at once, every blob checksummed, schema
// versions with migrations, least-recently-used eviction past a size bound.
#include <sqlite3.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include <google/protobuf/util/json_util.h>

#include "loom/cache.h"
#include "loom/hash.h"
#include "records.h"

namespace loom::cache {
namespace fs = std::filesystem;
namespace {

constexpr int kSchemaVersion = 6;

// Every column of each table at this schema (export and import copy by name).
constexpr const char* kArtifactColumns = "key, blob, checksum, created, bytes, last_used";
constexpr const char* kDecisionColumns =
    "spec_key, device, toolchain, blob, checksum, created, bytes, last_used, device_class, shape_bucket";
constexpr const char* kRankingColumns = "key, blob, checksum, created";

using detail::checksumOf;
using detail::decisionFromJson;
using detail::decisionToJson;
using detail::now;
using detail::Record;

// A prepared statement with positional binding; finalised on scope exit.
class Statement {
 public:
  Statement(sqlite3* db, const char* sql) : db_(db) { rc_ = sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr); }
  ~Statement() { sqlite3_finalize(stmt_); }
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;

  Statement& bind(int index, const std::string& text) {
    sqlite3_bind_text(stmt_, index, text.data(), int(text.size()), SQLITE_TRANSIENT);
    return *this;
  }
  Statement& bindBlob(int index, const std::string& bytes) {
    sqlite3_bind_blob(stmt_, index, bytes.data(), int(bytes.size()), SQLITE_TRANSIENT);
    return *this;
  }
  Statement& bind(int index, int64_t value) {
    sqlite3_bind_int64(stmt_, index, value);
    return *this;
  }
  // SQLITE_ROW, SQLITE_DONE, or an error code.
  int step() { return rc_ == SQLITE_OK ? sqlite3_step(stmt_) : rc_; }
  std::string text(int column) const {
    const auto* data = sqlite3_column_text(stmt_, column);
    return data ? std::string(reinterpret_cast<const char*>(data), size_t(sqlite3_column_bytes(stmt_, column))) : "";
  }
  std::string blob(int column) const {
    const void* data = sqlite3_column_blob(stmt_, column);
    return data ? std::string(static_cast<const char*>(data), size_t(sqlite3_column_bytes(stmt_, column))) : "";
  }
  int64_t integer(int column) const { return sqlite3_column_int64(stmt_, column); }
  Status done(const std::string& what) {
    const int rc = step();
    if (rc == SQLITE_DONE || rc == SQLITE_ROW) return Status::success();
    return makeError(what + ": " + sqlite3_errmsg(db_));
  }

 private:
  sqlite3* db_;
  sqlite3_stmt* stmt_ = nullptr;
  int rc_;
};

Status exec(sqlite3* db, const std::string& sql, const std::string& what) {
  char* message = nullptr;
  if (sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &message) == SQLITE_OK) return Status::success();
  std::string text = message ? message : "unknown error";
  sqlite3_free(message);
  return makeError(what + ": " + text);
}

// Schema, version by version: migrations run in order inside one transaction.
const char* const kSchemaV1 = R"(
  CREATE TABLE artifacts(key TEXT PRIMARY KEY, blob BLOB NOT NULL, checksum TEXT NOT NULL, created INTEGER NOT NULL);
  CREATE TABLE decisions(spec_key TEXT NOT NULL, device TEXT NOT NULL, toolchain TEXT NOT NULL,
                         blob BLOB NOT NULL, checksum TEXT NOT NULL, created INTEGER NOT NULL,
                         PRIMARY KEY(spec_key, device, toolchain));
)";

// v2: sizes and last use (eviction), the device class (fallback lookups).
Status migrateToV2(sqlite3* db) {
  if (Status ok = exec(db, R"(
        ALTER TABLE artifacts ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE artifacts ADD COLUMN last_used INTEGER NOT NULL DEFAULT 0;
        UPDATE artifacts SET bytes = length(blob), last_used = created;
        ALTER TABLE decisions ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE decisions ADD COLUMN last_used INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE decisions ADD COLUMN device_class TEXT NOT NULL DEFAULT '';
        UPDATE decisions SET bytes = length(blob), last_used = created;
        CREATE INDEX decisions_by_class ON decisions(spec_key, device_class, toolchain);
        CREATE INDEX artifacts_by_use ON artifacts(last_used);
      )", "migration to schema 2");
      !ok)
    return ok;
  // The class was inside each decision's JSON: lift it into its column.
  std::vector<std::pair<std::string, std::string>> updates;  // rowid, class
  {
    Statement rows(db, "SELECT rowid, blob FROM decisions");
    while (rows.step() == SQLITE_ROW) {
      const auto json = nlohmann::json::parse(rows.blob(1), nullptr, false);
      if (json.is_discarded() || !json.contains("device")) continue;
      DeviceModel model{json["device"].value("name", ""), json["device"].value("arch", ""), json["device"].value("sm_count", 0)};
      updates.emplace_back(rows.text(0), model.classKey());
    }
  }
  for (const auto& [rowid, deviceClass] : updates) {
    Statement update(db, "UPDATE decisions SET device_class = ?1 WHERE rowid = ?2");
    if (Status ok = update.bind(1, deviceClass).bind(2, int64_t(std::stoll(rowid))).done("migration to schema 2"); !ok)
      return ok;
  }
  return Status::success();
}

// v3: an artifact carries its compile options (CompiledKernel.compile_options),
// so the store computes keys without knowing the compiler. Every loom before
// schema 3 compiled with the same NVRTC options; a record whose key proves it
// was compiled with them gets them written in. Any other record is left as it
// is (a reader finds its key wrong and drops it, as for any corrupt record).
constexpr const char* kOptionsBeforeSchemaThree = "-std=c++17 --ptxas-options=-v -default-device";

Status migrateToV3(sqlite3* db) {
  std::vector<std::pair<std::string, std::string>> updates;  // key, blob with options
  {
    Statement rows(db, "SELECT key, blob FROM artifacts");
    while (rows.step() == SQLITE_ROW) {
      v1::CompiledKernel kernel;
      if (!kernel.ParseFromString(rows.blob(1)) || !kernel.compile_options().empty()) continue;
      if (schema3::artifactKey(kernel) == rows.text(0)) continue;
      kernel.set_compile_options(kOptionsBeforeSchemaThree);
      if (schema3::artifactKey(kernel) == rows.text(0)) updates.emplace_back(rows.text(0), kernel.SerializeAsString());
    }
  }
  for (const auto& [key, blob] : updates) {
    Statement update(db, "UPDATE artifacts SET blob = ?1, checksum = ?2, bytes = ?3 WHERE key = ?4");
    if (Status ok = update.bindBlob(1, blob)
                        .bind(2, schema3::checksumOf(blob))
                        .bind(3, int64_t(blob.size()))
                        .bind(4, key)
                        .done("migration to schema 3");
        !ok)
      return ok;
  }
  return Status::success();
}

// v5: decisions per shape bucket (TuningResult.shape_bucket): the key
// gains the bucket, every earlier decision the empty one (every shape),
// served as before.
Status migrateToV5(sqlite3* db) {
  return exec(db, R"(
        CREATE TABLE decisions_v5(spec_key TEXT NOT NULL, device TEXT NOT NULL, toolchain TEXT NOT NULL,
                                  blob BLOB NOT NULL, checksum TEXT NOT NULL, created INTEGER NOT NULL,
                                  bytes INTEGER NOT NULL DEFAULT 0, last_used INTEGER NOT NULL DEFAULT 0,
                                  device_class TEXT NOT NULL DEFAULT '', shape_bucket TEXT NOT NULL DEFAULT '',
                                  PRIMARY KEY(spec_key, device, toolchain, shape_bucket));
        INSERT INTO decisions_v5 SELECT spec_key, device, toolchain, blob, checksum, created, bytes, last_used,
                                        device_class, '' FROM decisions;
        DROP TABLE decisions;
        ALTER TABLE decisions_v5 RENAME TO decisions;
        CREATE INDEX decisions_by_class ON decisions(spec_key, device_class, toolchain);
      )", "migration to schema 5");
}

// v6: leases (KernelStore::acquireLease): who is tuning or compiling
// what, until when, shared by every process on the file.
Status migrateToV6(sqlite3* db) {
  return exec(db, "CREATE TABLE leases(key TEXT PRIMARY KEY, holder TEXT NOT NULL, expires INTEGER NOT NULL);",
              "migration to schema 6");
}

// v4: SHA-256 content addresses and checksums (loom/hash.h) instead of
// FNV-1a, and the rankings table. Every record a schema 3 reader would
// have served (checksum and key right) is re-keyed and re-checksummed, and
// each decision's spec key and artifact key follow; any other record could
// never be served again and goes.
Status migrateToV4(sqlite3* db) {
  if (Status ok = exec(db, R"(
        CREATE TABLE rankings(key TEXT PRIMARY KEY, blob BLOB NOT NULL, checksum TEXT NOT NULL,
                              created INTEGER NOT NULL);
      )", "migration to schema 4");
      !ok)
    return ok;
  struct Address {
    std::string key, checksum;
  };
  std::map<std::string, Address> keys;  // old artifact key -> new key and checksum
  std::vector<std::string> dropped;
  {
    Statement rows(db, "SELECT key, blob, checksum FROM artifacts");
    while (rows.step() == SQLITE_ROW) {
      v1::CompiledKernel kernel;
      const std::string key = rows.text(0), blob = rows.blob(1);
      if (schema3::checksumOf(blob) == rows.text(2) && kernel.ParseFromString(blob) && schema3::artifactKey(kernel) == key)
        keys[key] = {artifactKey(kernel), checksumOf(blob)};
      else
        dropped.push_back(key);
    }
  }
  for (const std::string& key : dropped) {
    Statement drop(db, "DELETE FROM artifacts WHERE key = ?1");
    if (Status ok = drop.bind(1, key).done("migration to schema 4"); !ok) return ok;
  }
  for (const auto& [from, to] : keys) {
    Statement update(db, "UPDATE artifacts SET key = ?1, checksum = ?2 WHERE key = ?3");
    if (Status ok = update.bind(1, to.key).bind(2, to.checksum).bind(3, from).done("migration to schema 4"); !ok)
      return ok;
  }
  struct Rekeyed {
    int64_t rowid;
    std::string specKey, blob;  // empty blob: drop the row
  };
  std::vector<Rekeyed> decisions;
  {
    Statement rows(db, "SELECT rowid, blob, checksum FROM decisions");
    while (rows.step() == SQLITE_ROW) {
      const std::string blob = rows.blob(1);
      auto decision = schema3::checksumOf(blob) == rows.text(2) ? decisionFromJson(blob)
                                                               : Result<Decision>(makeError("checksum"));
      if (!decision) {
        decisions.push_back({rows.integer(0), "", ""});
        continue;
      }
      auto found = keys.find(decision->artifactKey);
      decision->artifactKey = found == keys.end() ? "" : found->second.key;
      decisions.push_back({rows.integer(0), decisionSpecKey(decision->spec, decision->result.direction()),
                           decisionToJson(*decision)});
    }
  }
  for (const Rekeyed& d : decisions) {
    if (d.blob.empty()) {
      Statement drop(db, "DELETE FROM decisions WHERE rowid = ?1");
      if (Status ok = drop.bind(1, d.rowid).done("migration to schema 4"); !ok) return ok;
      continue;
    }
    Statement update(db, "UPDATE decisions SET spec_key = ?1, blob = ?2, checksum = ?3, bytes = ?4 WHERE rowid = ?5");
    if (Status ok = update.bind(1, d.specKey)
                        .bindBlob(2, d.blob)
                        .bind(3, checksumOf(d.blob))
                        .bind(4, int64_t(d.blob.size()))
                        .bind(5, d.rowid)
                        .done("migration to schema 4");
        !ok)
      return ok;
  }
  return Status::success();
}

class SqliteStore final : public detail::RecordStore {
 public:
  SqliteStore(sqlite3* db, SqliteOptions options) : db_(db), options_(options) {}
  ~SqliteStore() override { sqlite3_close_v2(db_); }

  Result<std::optional<v1::CompiledKernel>> getArtifact(const std::string& key) override {
    std::string blob, checksum;
    {
      Statement select(db_, "SELECT blob, checksum FROM artifacts WHERE key = ?1");
      const int rc = select.bind(1, key).step();
      if (rc == SQLITE_DONE) return std::optional<v1::CompiledKernel>();
      if (rc != SQLITE_ROW) return makeError(std::string("kernel cache: ") + sqlite3_errmsg(db_));
      blob = select.blob(0);
      checksum = select.text(1);
    }
    v1::CompiledKernel kernel;
    if (checksumOf(blob) != checksum || !kernel.ParseFromString(blob) || artifactKey(kernel) != key) {
      (void)remove(key);  // corrupt: never loaded, gone for the next reader
      return std::optional<v1::CompiledKernel>();
    }
    touch("artifacts", "key", key);
    return std::optional<v1::CompiledKernel>(std::move(kernel));
  }

  Status putArtifact(const v1::CompiledKernel& kernel) override {
    if (Status ok = insert(detail::artifactRecord(kernel)); !ok) return ok;
    return evict();
  }

  Result<std::optional<DecisionLookup>> getDecision(const KernelSpec& spec, const DeviceModel& device,
                                                    const std::string& toolchain, v1::Direction direction,
                                                    const std::string& shapeBucket) override {
    auto rows = [&](bool fallback) -> Result<std::vector<detail::DecisionRow>> {
      Statement select(db_, fallback ? "SELECT blob, checksum, shape_bucket, rowid FROM decisions WHERE spec_key = ?1 "
                                       "AND device_class = ?2 AND toolchain = ?3 ORDER BY last_used DESC, rowid DESC"
                                     : "SELECT blob, checksum, shape_bucket, rowid FROM decisions WHERE spec_key = ?1 "
                                       "AND device = ?2 AND toolchain = ?3 ORDER BY last_used DESC, rowid DESC");
      select.bind(1, decisionSpecKey(spec, direction)).bind(2, fallback ? device.classKey() : device.key()).bind(3, toolchain);
      std::vector<detail::DecisionRow> found;
      int rc;
      while ((rc = select.step()) == SQLITE_ROW)
        found.push_back({select.blob(0), select.text(1), select.text(2), select.text(3)});
      if (rc != SQLITE_DONE) return makeError(std::string("kernel cache: ") + sqlite3_errmsg(db_));
      return found;
    };
    return detail::chooseDecision(
        device, shapeBucket, rows,
        [&](const detail::DecisionRow& row) {
          Statement drop(db_, "DELETE FROM decisions WHERE rowid = ?1");
          (void)drop.bind(1, int64_t(std::stoll(row.handle))).done("kernel cache: dropping a corrupt decision");
        },
        [&](const detail::DecisionRow& row) { touch("decisions", "rowid", row.handle); });
  }

  Status putDecision(const Decision& d) override {
    if (Status ok = insert(detail::decisionRecord(d)); !ok) return ok;
    return evict();
  }

  Result<std::optional<Schedule>> getRanking(const std::string& key) override {
    Statement select(db_, "SELECT blob, checksum FROM rankings WHERE key = ?1");
    const int rc = select.bind(1, key).step();
    if (rc == SQLITE_DONE) return std::optional<Schedule>();
    if (rc != SQLITE_ROW) return makeError(std::string("kernel cache: ") + sqlite3_errmsg(db_));
    Schedule schedule;
    if (checksumOf(select.blob(0)) != select.text(1) || !schedule.ParseFromString(select.blob(0))) {
      Statement drop(db_, "DELETE FROM rankings WHERE key = ?1");
      (void)drop.bind(1, key).done("kernel cache: dropping a corrupt ranking");
      return std::optional<Schedule>();
    }
    return std::optional<Schedule>(std::move(schedule));
  }

  Status putRanking(const std::string& key, const Schedule& schedule) override {
    return insert(detail::rankingRecord(key, schedule));
  }

  Result<std::vector<Entry>> list() override {
    std::vector<Entry> entries;
    {
      Statement select(db_, "SELECT key, blob, bytes, last_used FROM artifacts ORDER BY last_used DESC");
      while (select.step() == SQLITE_ROW) {
        v1::CompiledKernel kernel;
        const bool parsed = kernel.ParseFromString(select.blob(1));
        entries.push_back({"artifact", select.text(0),
                           parsed ? kernel.target().arch() + " " + kernel.schedule().ShortDebugString() : "(unreadable)",
                           select.integer(2), select.integer(3)});
      }
    }
    Statement select(db_, "SELECT " LOOM_DECISION_ID ", blob, bytes, last_used FROM decisions ORDER BY last_used DESC");
    while (select.step() == SQLITE_ROW) {
      auto decision = decisionFromJson(select.blob(1));
      entries.push_back({"decision", select.text(0),
                         decision ? (decision->result.measured() ? "measured " : "untimed ") +
                                        decision->result.best().ShortDebugString()
                                  : "(unreadable)",
                         select.integer(2), select.integer(3)});
    }
    return entries;
  }

  Result<std::optional<std::string>> describe(const std::string& id) override {
    auto artifact = getArtifact(id);
    if (!artifact) return artifact.error();
    if (artifact->has_value()) return std::optional<std::string>(detail::describeArtifact(**artifact));
    Statement select(db_, "SELECT blob FROM decisions WHERE " LOOM_DECISION_ID " = ?1");
    if (select.bind(1, id).step() != SQLITE_ROW) return std::optional<std::string>();
    const auto json = nlohmann::json::parse(select.blob(0), nullptr, false);
    return std::optional<std::string>(json.is_discarded() ? "(unreadable)" : json.dump(2));
  }

  Status remove(const std::string& id) override {
    Statement artifacts(db_, "DELETE FROM artifacts WHERE key = ?1");
    if (Status ok = artifacts.bind(1, id).done("kernel cache: removing"); !ok) return ok;
    int changed = sqlite3_changes(db_);
    Statement decisions(db_, "DELETE FROM decisions WHERE " LOOM_DECISION_ID " = ?1");
    if (Status ok = decisions.bind(1, id).done("kernel cache: removing"); !ok) return ok;
    changed += sqlite3_changes(db_);
    if (changed == 0) return makeError("kernel cache: no entry " + id);
    return Status::success();
  }

  Result<VerifyReport> verify() override {
    VerifyReport report;
    std::vector<std::string> corruptArtifacts;
    std::vector<int64_t> corruptDecisions;
    {
      Statement select(db_, "SELECT key, blob, checksum FROM artifacts");
      while (select.step() == SQLITE_ROW) {
        ++report.checked;
        v1::CompiledKernel kernel;
        if (checksumOf(select.blob(1)) != select.text(2) || !kernel.ParseFromString(select.blob(1)) ||
            artifactKey(kernel) != select.text(0))
          corruptArtifacts.push_back(select.text(0));
      }
    }
    {
      Statement select(db_, "SELECT rowid, blob, checksum, " LOOM_DECISION_ID " FROM decisions");
      while (select.step() == SQLITE_ROW) {
        ++report.checked;
        if (checksumOf(select.blob(1)) != select.text(2) || !decisionFromJson(select.blob(1))) {
          corruptDecisions.push_back(select.integer(0));
          report.corrupt.push_back(select.text(3));
        }
      }
    }
    std::vector<std::string> corruptRankings;
    {
      Statement select(db_, "SELECT key, blob, checksum FROM rankings");
      while (select.step() == SQLITE_ROW) {
        ++report.checked;
        Schedule schedule;
        if (checksumOf(select.blob(1)) != select.text(2) || !schedule.ParseFromString(select.blob(1)))
          corruptRankings.push_back(select.text(0));
      }
    }
    for (const std::string& key : corruptRankings) {
      Statement drop(db_, "DELETE FROM rankings WHERE key = ?1");
      (void)drop.bind(1, key).done("kernel cache: dropping a corrupt ranking");
      report.corrupt.push_back("ranking " + key);
    }
    for (const std::string& key : corruptArtifacts) {
      (void)remove(key);
      report.corrupt.push_back(key);
    }
    for (int64_t rowid : corruptDecisions) {
      Statement drop(db_, "DELETE FROM decisions WHERE rowid = ?1");
      (void)drop.bind(1, rowid).done("kernel cache: dropping a corrupt decision");
    }
    return report;
  }

  Result<Lease> acquireLease(const std::string& key, const std::string& holder, int64_t seconds) override {
    const int64_t at = now();
    {
      // Taken when free, expired or already this holder's; RETURNING gives a row only then.
      Statement take(db_,
                     "INSERT INTO leases(key, holder, expires) VALUES(?1, ?2, ?3) ON CONFLICT(key) DO UPDATE SET "
                     "holder = excluded.holder, expires = excluded.expires WHERE leases.expires <= ?4 OR "
                     "leases.holder = excluded.holder RETURNING holder, expires");
      const int rc = take.bind(1, key).bind(2, holder).bind(3, at + seconds).bind(4, at).step();
      if (rc == SQLITE_ROW) return Lease{true, take.text(0), take.integer(1)};
      if (rc != SQLITE_DONE) return makeError(std::string("kernel cache: taking a lease: ") + sqlite3_errmsg(db_));
    }
    Statement held(db_, "SELECT holder, expires FROM leases WHERE key = ?1");
    if (held.bind(1, key).step() != SQLITE_ROW)
      return makeError(std::string("kernel cache: reading a lease: ") + sqlite3_errmsg(db_));
    return Lease{false, held.text(0), held.integer(1)};
  }

  Status releaseLease(const std::string& key, const std::string& holder) override {
    Statement drop(db_, "DELETE FROM leases WHERE key = ?1 AND holder = ?2");
    return drop.bind(1, key).bind(2, holder).done("kernel cache: releasing a lease");
  }

  Status forEachRecord(const std::function<Status(const Record&)>& visit) override {
    {
      Statement rows(db_, "SELECT key, blob, checksum, created, last_used FROM artifacts");
      while (rows.step() == SQLITE_ROW)
        if (Status ok = visit({Record::Kind::artifact, rows.text(0), "", "", "", "", rows.blob(1), rows.text(2),
                               rows.integer(3), rows.integer(4)});
            !ok)
          return ok;
    }
    {
      Statement rows(db_, "SELECT spec_key, device, toolchain, device_class, shape_bucket, blob, checksum, created, "
                          "last_used FROM decisions");
      while (rows.step() == SQLITE_ROW)
        if (Status ok = visit({Record::Kind::decision, rows.text(0), rows.text(1), rows.text(2), rows.text(3),
                               rows.text(4), rows.blob(5), rows.text(6), rows.integer(7), rows.integer(8)});
            !ok)
          return ok;
    }
    Statement rows(db_, "SELECT key, blob, checksum, created FROM rankings");
    while (rows.step() == SQLITE_ROW)
      if (Status ok = visit({Record::Kind::ranking, rows.text(0), "", "", "", "", rows.blob(1), rows.text(2),
                             rows.integer(3), rows.integer(3)});
          !ok)
        return ok;
    return Status::success();
  }

  Result<int> putRecords(const std::vector<Record>& records) override {
    if (Status ok = exec(db_, "BEGIN IMMEDIATE", "kernel cache: storing records"); !ok) return ok.error();
    int stored = 0;
    for (const Record& r : records) {
      if (!detail::soundRecord(r)) continue;
      const Status put = insert(r);
      if (!put) {
        (void)exec(db_, "ROLLBACK", "rollback");
        return put.error();
      }
      ++stored;
    }
    if (Status ok = exec(db_, "COMMIT", "kernel cache: storing records"); !ok) {
      (void)exec(db_, "ROLLBACK", "rollback");
      return ok.error();
    }
    if (Status ok = evict(); !ok) return ok.error();
    return stored;
  }

  Status exportTo(const std::string& path) override {
    std::error_code ec;
    fs::remove(path, ec);
    auto target = openSqliteStore(path, options_);
    if (!target) return target.error();
    target->reset();  // closed: now attach it here and copy
    return copyRecords(path, /*into=*/false);
  }

  Result<int> importFrom(const std::string& path) override {
    if (!fs::exists(path)) return makeError("kernel cache: import: no file " + path);
    auto source = openSqliteStore(path, options_);
    if (!source) return source.error();
    // Every record is checked before it is taken: imported kernels run on GPUs.
    if (auto report = (*source)->verify(); !report) return report.error();
    source->reset();
    const int before = count();
    if (Status ok = copyRecords(path, /*into=*/true); !ok) return ok.error();
    return count() - before;
  }

 private:
  // Every record from the attached file at `path` into this store (`into`),
  // or from this store into it, in one transaction.
  Status copyRecords(const std::string& path, bool into) {
    const char* what = into ? "kernel cache: import" : "kernel cache: export";
    Statement attach(db_, "ATTACH DATABASE ?1 AS other");
    if (Status ok = attach.bind(1, path).done(what); !ok) return ok;
    const std::string from = into ? "other" : "main", to = into ? "main" : "other";
    // An imported file must be whole, indexes included: quick_check (on
    // open) skips them, and a row its index cannot find escapes verify's
    // removal and would be copied.
    bool healthy = true;
    if (into) {
      Statement check(db_, "PRAGMA other.integrity_check(1)");
      healthy = check.step() == SQLITE_ROW && check.text(0) == "ok";
    }
    if (!healthy) {
      (void)exec(db_, "DETACH DATABASE other", what);
      return makeError(std::string(what) + ": " + path + " is not a healthy database");
    }
    // By column name: a file's tables may hold their columns in another order.
    std::string sql = "BEGIN IMMEDIATE;";
    for (const auto& [table, columns] : {std::pair<const char*, const char*>{"artifacts", kArtifactColumns},
                                         {"decisions", kDecisionColumns},
                                         {"rankings", kRankingColumns}})
      sql += std::string(" INSERT OR REPLACE INTO ") + to + "." + table + "(" + columns + ") SELECT " + columns +
             " FROM " + from + "." + table + ";";
    Status copied = exec(db_, sql + " COMMIT;", what);
    if (!copied) (void)exec(db_, "ROLLBACK", "rollback");
    (void)exec(db_, "DETACH DATABASE other", what);
    return copied;
  }

  // One row as it is (replacing an equal key), in whatever transaction is open.
  Status insert(const Record& r) {
    switch (r.kind) {
      case Record::Kind::artifact: {
        Statement insert(db_, "INSERT OR REPLACE INTO artifacts(key, blob, checksum, created, bytes, last_used) "
                              "VALUES(?1, ?2, ?3, ?4, ?5, ?6)");
        return insert.bind(1, r.key).bindBlob(2, r.blob).bind(3, r.checksum).bind(4, r.created).bind(5, r.bytes())
            .bind(6, r.lastUsed).done("kernel cache: storing an artifact");
      }
      case Record::Kind::decision: {
        Statement insert(db_, "INSERT OR REPLACE INTO decisions(spec_key, device, toolchain, blob, checksum, created, "
                              "bytes, last_used, device_class, shape_bucket) VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)");
        return insert.bind(1, r.key).bind(2, r.device).bind(3, r.toolchain).bindBlob(4, r.blob).bind(5, r.checksum)
            .bind(6, r.created).bind(7, r.bytes()).bind(8, r.lastUsed).bind(9, r.deviceClass)
            .bind(10, r.shapeBucket).done("kernel cache: storing a decision");
      }
      case Record::Kind::ranking: {
        Statement insert(db_, "INSERT OR REPLACE INTO rankings(key, blob, checksum, created) VALUES(?1, ?2, ?3, ?4)");
        return insert.bind(1, r.key).bindBlob(2, r.blob).bind(3, r.checksum).bind(4, r.created)
            .done("kernel cache: storing a ranking");
      }
    }
    return makeError("kernel cache: a record of no kind");
  }

  int count() {
    Statement select(db_, "SELECT (SELECT count(*) FROM artifacts) + (SELECT count(*) FROM decisions) + "
                          "(SELECT count(*) FROM rankings)");
    return select.step() == SQLITE_ROW ? int(select.integer(0)) : 0;
  }

  void touch(const char* table, const char* column, const std::string& id) {
    const std::string sql = std::string("UPDATE ") + table + " SET last_used = ?1 WHERE " + column + " = ?2";
    Statement update(db_, sql.c_str());
    update.bind(1, now());
    if (std::string(column) == "rowid") update.bind(2, int64_t(std::stoll(id)));
    else update.bind(2, id);
    (void)update.done("kernel cache: last use");  // best effort: a busy store only loses recency
  }

  // Least recently used records go until the store fits its bound.
  Status evict() {
    Statement total(db_, "SELECT (SELECT coalesce(sum(bytes), 0) FROM artifacts) + "
                         "(SELECT coalesce(sum(bytes), 0) FROM decisions)");
    if (total.step() != SQLITE_ROW || total.integer(0) <= options_.maxBytes) return Status::success();
    return exec(db_,
                "DELETE FROM artifacts WHERE key IN (SELECT key FROM artifacts a WHERE "
                "(SELECT coalesce(sum(bytes), 0) FROM artifacts b WHERE b.last_used > a.last_used OR "
                "(b.last_used = a.last_used AND b.key >= a.key)) + (SELECT coalesce(sum(bytes), 0) FROM decisions) > " +
                    std::to_string(options_.maxBytes) + ")",
                "kernel cache: eviction");
  }

  sqlite3* db_;
  SqliteOptions options_;
};

Result<sqlite3*> openAndMigrate(const std::string& path, const SqliteOptions& options) {
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX, nullptr) !=
      SQLITE_OK) {
    std::string message = db ? sqlite3_errmsg(db) : "out of memory";
    sqlite3_close_v2(db);
    return makeError(path + ": " + message);
  }
  sqlite3_busy_timeout(db, options.busyTimeoutMs);
  // close_v2: a statement still open on the way out (a failed check
  // returns from inside its scope) does not keep the connection alive.
  auto fail = [&](const Status& status) -> Result<sqlite3*> {
    sqlite3_close_v2(db);
    return status.error();
  };
  // A damaged file fails here: quick_check reads every page once.
  {
    Statement check(db, "PRAGMA quick_check");
    if (check.step() != SQLITE_ROW || check.text(0) != "ok") return fail(makeError(path + ": not a healthy database"));
  }
  if (Status ok = exec(db, "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL;", path); !ok) return fail(ok);
  if (Status ok = exec(db, "BEGIN IMMEDIATE", path); !ok) return fail(ok);
  int version = 0;
  {
    Statement read(db, "PRAGMA user_version");
    if (read.step() == SQLITE_ROW) version = int(read.integer(0));
  }
  if (version > kSchemaVersion) {
    (void)exec(db, "ROLLBACK", path);
    return fail(makeError(path + ": schema " + std::to_string(version) + " is newer than this loom (" +
                          std::to_string(kSchemaVersion) + ")"));
  }
  Status migrated;
  if (version < 1) migrated = exec(db, kSchemaV1, "creating schema 1");
  if (migrated && version < 2) migrated = migrateToV2(db);
  if (migrated && version < 3) migrated = migrateToV3(db);
  if (migrated && version < 4) migrated = migrateToV4(db);
  if (migrated && version < 5) migrated = migrateToV5(db);
  if (migrated && version < 6) migrated = migrateToV6(db);
  if (migrated) migrated = exec(db, "PRAGMA user_version = " + std::to_string(kSchemaVersion), path);
  if (!migrated) {
    (void)exec(db, "ROLLBACK", path);
    return fail(migrated);
  }
  if (Status ok = exec(db, "COMMIT", path); !ok) return fail(ok);
  return db;
}

}  // namespace

int schemaVersion() { return kSchemaVersion; }

namespace detail {
Status sqliteFileIsWhole(const std::string& path) {
  sqlite3* db = nullptr;
  Status whole = makeError(path + " is not a healthy database");
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READONLY, nullptr) == SQLITE_OK) {
    Statement check(db, "PRAGMA integrity_check(1)");
    if (check.step() == SQLITE_ROW && check.text(0) == "ok") whole = Status::success();
  }
  sqlite3_close_v2(db);
  return whole;
}
}  // namespace detail


Result<std::unique_ptr<KernelStore>> openSqliteStore(const std::string& path, const SqliteOptions& options) {
  std::error_code ec;
  if (fs::path(path).has_parent_path()) fs::create_directories(fs::path(path).parent_path(), ec);
  auto db = openAndMigrate(path, options);
  if (!db && fs::exists(path) && db.error().message.find("not a healthy database") != std::string::npos) {
    // Keep the damaged file for inspection and start afresh: the cache only saves work.
    const std::string aside = path + ".corrupt-" + std::to_string(now());
    fs::rename(path, aside, ec);
    for (const char* suffix : {"-wal", "-shm"}) fs::remove(path + suffix, ec);
    std::fprintf(stderr, "loom: kernel cache %s was damaged; moved to %s and started afresh\n", path.c_str(),
                 aside.c_str());
    db = openAndMigrate(path, options);
  }
  if (!db) return db.error();
  return std::unique_ptr<KernelStore>(new SqliteStore(*db, options));
}

}  // namespace loom::cache
