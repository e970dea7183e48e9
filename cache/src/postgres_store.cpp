// The PostgreSQL kernel store: the same records, keys, checksums and checks
// as the SQLite store, in a database that several service replicas share.
// Tables are prefixed loom_ so the store can live in a database that holds
// other things; the schema is versioned (loom_schema) and migrated on open
// under an advisory lock, so replicas starting together migrate once. One
// connection per store, used under a mutex; a connection that drops is
// re-established on the next call (a statement that fails with it is
// retried once, outside transactions).
#include <arpa/inet.h>
#include <libpq-fe.h>

#include <cctype>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>

#include "loom/cache.h"
#include "records.h"

namespace loom::cache {
namespace {

using detail::checksumOf;
using detail::now;
using detail::Record;

// The PostgreSQL schema's own versions (the SQLite file counts apart).
// Each entry migrates from its index to the next version.
const char* const kMigrations[] = {
    // 1: every table of SQLite schema 6.
    R"(
    CREATE TABLE loom_artifacts(key text PRIMARY KEY, blob bytea NOT NULL, checksum text NOT NULL,
                                created bigint NOT NULL, bytes bigint NOT NULL, last_used bigint NOT NULL);
    CREATE INDEX loom_artifacts_by_use ON loom_artifacts(last_used);
    CREATE TABLE loom_decisions(spec_key text NOT NULL, device text NOT NULL, toolchain text NOT NULL,
                                shape_bucket text NOT NULL DEFAULT '', device_class text NOT NULL,
                                blob bytea NOT NULL, checksum text NOT NULL, created bigint NOT NULL,
                                bytes bigint NOT NULL, last_used bigint NOT NULL, seq bigserial NOT NULL,
                                PRIMARY KEY(spec_key, device, toolchain, shape_bucket));
    CREATE INDEX loom_decisions_by_class ON loom_decisions(spec_key, device_class, toolchain);
    CREATE TABLE loom_rankings(key text PRIMARY KEY, blob bytea NOT NULL, checksum text NOT NULL,
                               created bigint NOT NULL);
    CREATE TABLE loom_leases(key text PRIMARY KEY, holder text NOT NULL, expires bigint NOT NULL);
  )",
};
constexpr int kPostgresSchema = int(sizeof kMigrations / sizeof kMigrations[0]);

// A statement parameter: text, a bigint (sent as text) or bytes (binary).
struct Param {
  Param(const std::string& text) : value(text) {}
  Param(const char* text) : value(text) {}
  Param(int64_t number) : value(std::to_string(number)) {}
  static Param bytes(const std::string& data) {
    Param p(data);
    p.binary = true;
    return p;
  }
  std::string value;
  bool binary = false;
};

// A result in binary format: text and bytea columns are their bytes,
// bigint columns 8 big-endian bytes.
class Rows {
 public:
  explicit Rows(PGresult* result) : result_(result) {}
  Rows(Rows&& other) noexcept : result_(std::exchange(other.result_, nullptr)) {}
  Rows& operator=(Rows&& other) noexcept {
    std::swap(result_, other.result_);
    return *this;
  }
  ~Rows() { PQclear(result_); }
  PGresult* get() const { return result_; }
  int size() const { return PQntuples(result_); }
  std::string text(int row, int column) const {
    return std::string(PQgetvalue(result_, row, column), size_t(PQgetlength(result_, row, column)));
  }
  int64_t integer(int row, int column) const {
    const char* data = PQgetvalue(result_, row, column);
    uint64_t value = 0;
    const int length = PQgetlength(result_, row, column);
    for (int i = 0; i < length && i < 8; ++i) value = (value << 8) | uint8_t(data[i]);
    if (length == 4) return int32_t(uint32_t(value));
    return int64_t(value);
  }

 private:
  PGresult* result_;
};

class PostgresStore final : public detail::RecordStore {
 public:
  PostgresStore(PGconn* connection, std::string url, PostgresOptions options)
      : connection_(connection), url_(std::move(url)), options_(options) {}
  ~PostgresStore() override { PQfinish(connection_); }

  // Opens the connection and creates or migrates the schema.
  Status migrate() {
    std::lock_guard lock(mutex_);
    if (Status ok = script("BEGIN; SELECT pg_advisory_xact_lock(7306313562711158062);"
                           "CREATE TABLE IF NOT EXISTS loom_schema(version integer NOT NULL);",
                           "opening the schema");
        !ok)
      return ok;
    auto fail = [&](const Status& status) {
      (void)script("ROLLBACK", "rollback");
      return status;
    };
    auto read = query("SELECT version FROM loom_schema", {});
    if (!read) return fail(read.error());
    int version = read->size() ? int(read->integer(0, 0)) : 0;
    if (version > kPostgresSchema)
      return fail(makeError(where() + ": schema " + std::to_string(version) + " is newer than this loom (" +
                            std::to_string(kPostgresSchema) + ")"));
    for (; version < kPostgresSchema; ++version)
      if (Status ok = script(kMigrations[version], "migration to schema " + std::to_string(version + 1)); !ok)
        return fail(ok);
    if (Status ok = script("DELETE FROM loom_schema; INSERT INTO loom_schema VALUES(" +
                               std::to_string(kPostgresSchema) + "); COMMIT;",
                           "recording the schema");
        !ok)
      return fail(ok);
    return Status::success();
  }

  Result<std::optional<v1::CompiledKernel>> getArtifact(const std::string& key) override {
    std::lock_guard lock(mutex_);
    auto rows = query("SELECT blob, checksum FROM loom_artifacts WHERE key = $1", {key});
    if (!rows) return rows.error();
    if (rows->size() == 0) return std::optional<v1::CompiledKernel>();
    const std::string blob = rows->text(0, 0);
    v1::CompiledKernel kernel;
    if (checksumOf(blob) != rows->text(0, 1) || !kernel.ParseFromString(blob) || artifactKey(kernel) != key) {
      (void)query("DELETE FROM loom_artifacts WHERE key = $1", {key});  // corrupt: gone for the next reader
      return std::optional<v1::CompiledKernel>();
    }
    (void)query("UPDATE loom_artifacts SET last_used = $1 WHERE key = $2", {now(), key});
    return std::optional<v1::CompiledKernel>(std::move(kernel));
  }

  Status putArtifact(const v1::CompiledKernel& kernel) override {
    auto put = putRecords({detail::artifactRecord(kernel)});
    if (!put) return put.error();
    return Status::success();
  }

  Result<std::optional<DecisionLookup>> getDecision(const KernelSpec& spec, const DeviceModel& device,
                                                    const std::string& toolchain, v1::Direction direction,
                                                    const std::string& shapeBucket) override {
    std::lock_guard lock(mutex_);
    auto rows = [&](bool fallback) -> Result<std::vector<detail::DecisionRow>> {
      auto found = query(std::string("SELECT blob, checksum, shape_bucket, ") + LOOM_DECISION_ID +
                             " FROM loom_decisions WHERE spec_key = $1 AND " +
                             (fallback ? "device_class" : "device") +
                             " = $2 AND toolchain = $3 ORDER BY last_used DESC, seq DESC",
                         {decisionSpecKey(spec, direction), fallback ? device.classKey() : device.key(), toolchain});
      if (!found) return found.error();
      std::vector<detail::DecisionRow> out;
      for (int r = 0; r < found->size(); ++r)
        out.push_back({found->text(r, 0), found->text(r, 1), found->text(r, 2), found->text(r, 3)});
      return out;
    };
    return detail::chooseDecision(
        device, shapeBucket, rows,
        [&](const detail::DecisionRow& row) {
          (void)query(std::string("DELETE FROM loom_decisions WHERE ") + LOOM_DECISION_ID + " = $1", {row.handle});
        },
        [&](const detail::DecisionRow& row) {
          (void)query(std::string("UPDATE loom_decisions SET last_used = $1 WHERE ") + LOOM_DECISION_ID + " = $2",
                      {now(), row.handle});
        });
  }

  Status putDecision(const Decision& d) override {
    auto put = putRecords({detail::decisionRecord(d)});
    if (!put) return put.error();
    if (*put == 0) return makeError("kernel cache: the decision does not survive its own checks");
    return Status::success();
  }

  Result<std::optional<Schedule>> getRanking(const std::string& key) override {
    std::lock_guard lock(mutex_);
    auto rows = query("SELECT blob, checksum FROM loom_rankings WHERE key = $1", {key});
    if (!rows) return rows.error();
    if (rows->size() == 0) return std::optional<Schedule>();
    Schedule schedule;
    if (checksumOf(rows->text(0, 0)) != rows->text(0, 1) || !schedule.ParseFromString(rows->text(0, 0))) {
      (void)query("DELETE FROM loom_rankings WHERE key = $1", {key});
      return std::optional<Schedule>();
    }
    return std::optional<Schedule>(std::move(schedule));
  }

  Status putRanking(const std::string& key, const Schedule& schedule) override {
    auto put = putRecords({detail::rankingRecord(key, schedule)});
    if (!put) return put.error();
    return Status::success();
  }

  Result<std::vector<Entry>> list() override {
    std::lock_guard lock(mutex_);
    std::vector<Entry> entries;
    auto artifacts = query("SELECT key, blob, bytes, last_used FROM loom_artifacts ORDER BY last_used DESC", {});
    if (!artifacts) return artifacts.error();
    for (int r = 0; r < artifacts->size(); ++r) {
      v1::CompiledKernel kernel;
      const bool parsed = kernel.ParseFromString(artifacts->text(r, 1));
      entries.push_back({"artifact", artifacts->text(r, 0),
                         parsed ? kernel.target().arch() + " " + kernel.schedule().ShortDebugString() : "(unreadable)",
                         artifacts->integer(r, 2), artifacts->integer(r, 3)});
    }
    auto decisions = query(std::string("SELECT ") + LOOM_DECISION_ID +
                               ", blob, bytes, last_used FROM loom_decisions ORDER BY last_used DESC",
                           {});
    if (!decisions) return decisions.error();
    for (int r = 0; r < decisions->size(); ++r) {
      auto decision = detail::decisionFromJson(decisions->text(r, 1));
      entries.push_back({"decision", decisions->text(r, 0),
                         decision ? (decision->result.measured() ? "measured " : "untimed ") +
                                        decision->result.best().ShortDebugString()
                                  : "(unreadable)",
                         decisions->integer(r, 2), decisions->integer(r, 3)});
    }
    return entries;
  }

  Result<std::optional<std::string>> describe(const std::string& id) override {
    auto artifact = getArtifact(id);
    if (!artifact) return artifact.error();
    if (artifact->has_value()) return std::optional<std::string>(detail::describeArtifact(**artifact));
    std::lock_guard lock(mutex_);
    auto rows = query(std::string("SELECT blob FROM loom_decisions WHERE ") + LOOM_DECISION_ID + " = $1", {id});
    if (!rows) return rows.error();
    if (rows->size() == 0) return std::optional<std::string>();
    const auto json = nlohmann::json::parse(rows->text(0, 0), nullptr, false);
    return std::optional<std::string>(json.is_discarded() ? "(unreadable)" : json.dump(2));
  }

  Status remove(const std::string& id) override {
    std::lock_guard lock(mutex_);
    int64_t changed = 0;
    for (const std::string& sql : {std::string("DELETE FROM loom_artifacts WHERE key = $1"),
                                  std::string("DELETE FROM loom_decisions WHERE ") + LOOM_DECISION_ID + " = $1"}) {
      auto gone = command(sql, {id});
      if (!gone) return gone.error();
      changed += *gone;
    }
    if (changed == 0) return makeError("kernel cache: no entry " + id);
    return Status::success();
  }

  Result<VerifyReport> verify() override {
    VerifyReport report;
    std::vector<Record> corrupt;
    Status visited = forEachRecord([&](const Record& record) -> Status {
      ++report.checked;
      if (!detail::readableRecord(record)) corrupt.push_back(record);
      return Status::success();
    });
    if (!visited) return visited.error();
    std::lock_guard lock(mutex_);
    for (const Record& r : corrupt) {
      Result<int64_t> gone = 0;
      switch (r.kind) {
        case Record::Kind::artifact:
          gone = command("DELETE FROM loom_artifacts WHERE key = $1", {r.key});
          report.corrupt.push_back(r.key);
          break;
        case Record::Kind::decision:
          gone = command("DELETE FROM loom_decisions WHERE spec_key = $1 AND device = $2 AND toolchain = $3 AND "
                         "shape_bucket = $4",
                         {r.key, r.device, r.toolchain, r.shapeBucket});
          report.corrupt.push_back(detail::decisionId(r.key, r.device, r.toolchain, r.shapeBucket));
          break;
        case Record::Kind::ranking:
          gone = command("DELETE FROM loom_rankings WHERE key = $1", {r.key});
          report.corrupt.push_back("ranking " + r.key);
          break;
      }
      if (!gone) return gone.error();
    }
    return report;
  }

  Status exportTo(const std::string& path) override {
    std::error_code ec;
    std::filesystem::remove(path, ec);
    auto target = openSqliteStore(path);
    if (!target) return target.error();
    auto copied = detail::copyRecords(*this, static_cast<detail::RecordStore&>(**target));
    if (!copied) return copied.error();
    return Status::success();
  }

  Result<int> importFrom(const std::string& path) override {
    if (!std::filesystem::exists(path)) return makeError("kernel cache: import: no file " + path);
    if (Status whole = detail::sqliteFileIsWhole(path); !whole)
      return makeError("kernel cache: import: " + whole.error().message);
    auto source = openSqliteStore(path);
    if (!source) return source.error();
    // Every record is checked before it is taken (putRecords): imported kernels run on GPUs.
    return detail::copyRecords(static_cast<detail::RecordStore&>(**source), *this);
  }

  Result<Lease> acquireLease(const std::string& key, const std::string& holder, int64_t seconds) override {
    std::lock_guard lock(mutex_);
    const int64_t at = now();
    auto taken = query("INSERT INTO loom_leases(key, holder, expires) VALUES($1, $2, $3) ON CONFLICT(key) DO UPDATE "
                       "SET holder = excluded.holder, expires = excluded.expires WHERE loom_leases.expires <= $4 OR "
                       "loom_leases.holder = excluded.holder RETURNING holder, expires",
                       {key, holder, at + seconds, at});
    if (!taken) return taken.error();
    if (taken->size()) return Lease{true, taken->text(0, 0), taken->integer(0, 1)};
    auto held = query("SELECT holder, expires FROM loom_leases WHERE key = $1", {key});
    if (!held) return held.error();
    if (!held->size()) return Lease{false, "", 0};  // given back between the two statements: ask again
    return Lease{false, held->text(0, 0), held->integer(0, 1)};
  }

  Status releaseLease(const std::string& key, const std::string& holder) override {
    std::lock_guard lock(mutex_);
    auto gone = command("DELETE FROM loom_leases WHERE key = $1 AND holder = $2", {key, holder});
    if (!gone) return gone.error();
    return Status::success();
  }

  // Page by page in key order, so neither memory nor the lock is held
  // for the whole store.
  Status forEachRecord(const std::function<Status(const Record&)>& visit) override {
    if (Status ok = forEachRow("key, blob, checksum, created, last_used", "loom_artifacts", 1,
                               [&](const Rows& rows, int r) {
                                 return visit({Record::Kind::artifact, rows.text(r, 0), "", "", "", "", rows.text(r, 1),
                                               rows.text(r, 2), rows.integer(r, 3), rows.integer(r, 4)});
                               });
        !ok)
      return ok;
    if (Status ok = forEachRow("spec_key, device, toolchain, shape_bucket, device_class, blob, checksum, created, "
                               "last_used",
                               "loom_decisions", 4,
                               [&](const Rows& rows, int r) {
                                 return visit({Record::Kind::decision, rows.text(r, 0), rows.text(r, 1), rows.text(r, 2),
                                               rows.text(r, 4), rows.text(r, 3), rows.text(r, 5), rows.text(r, 6),
                                               rows.integer(r, 7), rows.integer(r, 8)});
                               });
        !ok)
      return ok;
    return forEachRow("key, blob, checksum, created", "loom_rankings", 1, [&](const Rows& rows, int r) {
      return visit({Record::Kind::ranking, rows.text(r, 0), "", "", "", "", rows.text(r, 1), rows.text(r, 2),
                    rows.integer(r, 3), rows.integer(r, 3)});
    });
  }

  Result<int> putRecords(const std::vector<Record>& records) override {
    std::lock_guard lock(mutex_);
    if (Status ok = script("BEGIN", "kernel cache: storing records"); !ok) return ok.error();
    int stored = 0;
    for (const Record& r : records) {
      if (!detail::soundRecord(r)) continue;
      Result<int64_t> put = 0;
      switch (r.kind) {
        case Record::Kind::artifact:
          put = command("INSERT INTO loom_artifacts(key, blob, checksum, created, bytes, last_used) "
                        "VALUES($1, $2, $3, $4, $5, $6) ON CONFLICT(key) DO UPDATE SET blob = excluded.blob, "
                        "checksum = excluded.checksum, created = excluded.created, bytes = excluded.bytes, "
                        "last_used = excluded.last_used",
                        {r.key, Param::bytes(r.blob), r.checksum, r.created, r.bytes(), r.lastUsed});
          break;
        case Record::Kind::decision:
          put = command("INSERT INTO loom_decisions(spec_key, device, toolchain, shape_bucket, device_class, blob, "
                        "checksum, created, bytes, last_used) VALUES($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) "
                        "ON CONFLICT(spec_key, device, toolchain, shape_bucket) DO UPDATE SET "
                        "device_class = excluded.device_class, blob = excluded.blob, checksum = excluded.checksum, "
                        "created = excluded.created, bytes = excluded.bytes, last_used = excluded.last_used, "
                        "seq = nextval(pg_get_serial_sequence('loom_decisions', 'seq'))",
                        {r.key, r.device, r.toolchain, r.shapeBucket, r.deviceClass, Param::bytes(r.blob), r.checksum,
                         r.created, r.bytes(), r.lastUsed});
          break;
        case Record::Kind::ranking:
          put = command("INSERT INTO loom_rankings(key, blob, checksum, created) VALUES($1, $2, $3, $4) "
                        "ON CONFLICT(key) DO UPDATE SET blob = excluded.blob, checksum = excluded.checksum, "
                        "created = excluded.created",
                        {r.key, Param::bytes(r.blob), r.checksum, r.created});
          break;
      }
      if (!put) {
        (void)script("ROLLBACK", "rollback");
        return put.error();
      }
      ++stored;
    }
    if (Status ok = script("COMMIT", "kernel cache: storing records"); !ok) {
      (void)script("ROLLBACK", "rollback");
      return ok.error();
    }
    if (Status ok = evict(); !ok) return ok.error();
    return stored;
  }

 private:
  std::string where() const { return "PostgreSQL " + redactedLocation(url_); }

  // The connection, re-established when it has dropped (a restarted
  // server, a network blip). Only outside transactions.
  Status connected() {
    if (PQstatus(connection_) == CONNECTION_OK) return Status::success();
    PQreset(connection_);
    if (PQstatus(connection_) == CONNECTION_OK) return Status::success();
    return makeError(where() + ": " + PQerrorMessage(connection_));
  }

  PGresult* execute(const std::string& sql, const std::vector<Param>& params) {
    std::vector<const char*> values;
    std::vector<int> lengths, formats;
    for (const Param& p : params) {
      values.push_back(p.value.data());
      lengths.push_back(int(p.value.size()));
      formats.push_back(p.binary ? 1 : 0);
    }
    return PQexecParams(connection_, sql.c_str(), int(params.size()), nullptr, values.data(), lengths.data(),
                        formats.data(), /*resultFormat=*/1);
  }

  // Runs one statement; a statement that fails because the connection
  // dropped is run again once on a new one (never inside a transaction:
  // the transaction died with the connection).
  Result<Rows> query(const std::string& sql, const std::vector<Param>& params) {
    const bool inTransaction = PQtransactionStatus(connection_) != PQTRANS_IDLE;
    if (!inTransaction)
      if (Status ok = connected(); !ok) return ok.error();
    for (int attempt = 0;; ++attempt) {
      Rows rows(execute(sql, params));
      const ExecStatusType status = PQresultStatus(rows.get());
      if (status == PGRES_TUPLES_OK || status == PGRES_COMMAND_OK) return rows;
      const std::string message = PQerrorMessage(connection_);
      if (attempt == 0 && !inTransaction && PQstatus(connection_) != CONNECTION_OK && connected()) continue;
      return makeError(where() + ": " + message);
    }
  }

  // A statement that changes rows: how many it changed.
  Result<int64_t> command(const std::string& sql, const std::vector<Param>& params) {
    auto rows = query(sql, params);
    if (!rows) return rows.error();
    const char* tuples = PQcmdTuples(rows->get());
    return tuples && *tuples ? int64_t(std::atoll(tuples)) : 0;
  }

  // Statements without parameters, several at once (schema, transactions).
  Status script(const std::string& sql, const std::string& what) {
    if (PQtransactionStatus(connection_) == PQTRANS_IDLE)
      if (Status ok = connected(); !ok) return ok;
    Rows rows(PQexec(connection_, sql.c_str()));
    const ExecStatusType status = PQresultStatus(rows.get());
    if (status == PGRES_COMMAND_OK || status == PGRES_TUPLES_OK) return Status::success();
    return makeError(where() + ": " + what + ": " + PQerrorMessage(connection_));
  }

  // Every row of `table`, `columns` of it (the first `keys` of them its
  // primary key), a page at a time in key order, each page read under the
  // lock and visited outside it.
  Status forEachRow(const std::string& columns, const std::string& table, int keys,
                    const std::function<Status(const Rows&, int)>& visit) {
    constexpr int kPage = 64;
    std::string key, after;  // "c1, c2", "$1, $2"
    for (size_t at = 0, k = 0; k < size_t(keys); ++k) {
      const size_t comma = columns.find(',', at);
      if (k) {
        key += ", ";
        after += ", ";
      }
      key += columns.substr(at, comma - at);
      after += '$';
      after += std::to_string(k + 1);
      at = comma + 2;
    }
    std::vector<Param> last;  // the last row's key; none before the first page
    for (;;) {
      Result<Rows> page = [&] {
        std::lock_guard lock(mutex_);
        return query("SELECT " + columns + " FROM " + table +
                         (last.empty() ? "" : " WHERE (" + key + ") > (" + after + ")") + " ORDER BY " + key +
                         " LIMIT " + std::to_string(kPage),
                     last);
      }();
      if (!page) return page.error();
      for (int r = 0; r < page->size(); ++r)
        if (Status ok = visit(*page, r); !ok) return ok;
      if (page->size() < kPage) return Status::success();
      last.clear();
      for (int k = 0; k < keys; ++k) last.emplace_back(page->text(page->size() - 1, k));
    }
  }

  // Least recently used artifacts go until the store fits its bound.
  Status evict() {
    auto total = query("SELECT ((SELECT coalesce(sum(bytes), 0) FROM loom_artifacts) + "
                       "(SELECT coalesce(sum(bytes), 0) FROM loom_decisions))::bigint",
                       {});
    if (!total) return total.error();
    if (total->integer(0, 0) <= options_.maxBytes) return Status::success();
    auto gone = command("DELETE FROM loom_artifacts WHERE key IN (SELECT key FROM (SELECT key, sum(bytes) OVER "
                        "(ORDER BY last_used DESC, key DESC) AS running FROM loom_artifacts) newest WHERE running + "
                        "(SELECT coalesce(sum(bytes), 0) FROM loom_decisions) > $1)",
                        {options_.maxBytes});
    if (!gone) return gone.error();
    return Status::success();
  }

  PGconn* connection_;
  std::string url_;
  PostgresOptions options_;
  std::mutex mutex_;
};

}  // namespace

bool isPostgresUrl(const std::string& location) {
  return location.rfind("postgresql://", 0) == 0 || location.rfind("postgres://", 0) == 0;
}

std::string redactedLocation(const std::string& location) {
  std::string shown = location;
  if (isPostgresUrl(shown)) {  // scheme://user:password@host...
    const size_t scheme = shown.find("://") + 3, at = shown.find('@', scheme);
    const size_t colon = shown.find(':', scheme);
    if (at != std::string::npos && colon != std::string::npos && colon < at) shown.replace(colon + 1, at - colon - 1, "***");
  }
  for (size_t at = shown.find("password="); at != std::string::npos; at = shown.find("password=", at + 1)) {
    const size_t begin = at + 9;
    size_t end = shown.find_first_of(" &", begin);
    if (end == std::string::npos) end = shown.size();
    shown.replace(begin, end - begin, "***");
  }
  return shown;
}

Result<std::unique_ptr<KernelStore>> openPostgresStore(const std::string& url, const PostgresOptions& options) {
  // A connect timeout, then the URL's own parameters (which override it).
  const char* keys[] = {"connect_timeout", "dbname", nullptr};
  const std::string timeout = std::to_string(options.connectTimeoutSeconds);
  const char* values[] = {timeout.c_str(), url.c_str(), nullptr};
  PGconn* connection = PQconnectdbParams(keys, values, /*expand_dbname=*/1);
  if (!connection) return makeError("PostgreSQL " + redactedLocation(url) + ": out of memory");
  if (PQstatus(connection) != CONNECTION_OK) {
    std::string message = PQerrorMessage(connection);
    while (!message.empty() && std::isspace(static_cast<unsigned char>(message.back()))) message.pop_back();
    PQfinish(connection);
    return makeError("PostgreSQL " + redactedLocation(url) + ": " + message);
  }
  PQsetNoticeProcessor(connection, [](void*, const char*) {}, nullptr);  // "already exists, skipping"
  auto store = std::make_unique<PostgresStore>(connection, url, options);
  if (Status ok = store->migrate(); !ok) return ok.error();
  return std::unique_ptr<KernelStore>(std::move(store));
}

Result<std::unique_ptr<KernelStore>> openStore(const std::string& location) {
  if (isPostgresUrl(location)) return openPostgresStore(location);
  return openSqliteStore(location);
}

}  // namespace loom::cache
