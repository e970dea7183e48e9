// The kernel stores: one suite of records, fallbacks, several processes at
// once, damage, eviction, leases, export and import run against both the
// SQLite file and PostgreSQL (a private server this test starts); then the
// SQLite file's own cases (a damaged file, migrations from old schemas).
#include <gtest/gtest.h>
#include <sqlite3.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "loom/cache.h"
#include "loom/hash.h"
#include "postgres_server.h"
#include "test_util.h"

namespace loom::cache {
namespace {

namespace fs = std::filesystem;

v1::CompiledKernel kernel(int id, size_t binaryBytes = 64) {
  v1::CompiledKernel k;
  k.set_source("// program " + std::to_string(id));
  k.mutable_target()->set_kind(v1::Target::cuda);
  k.mutable_target()->set_arch("sm_90a");
  k.set_toolchain("nvrtc-13.0 cubin");
  k.mutable_schedule()->set_block_m(64);
  std::string binary(binaryBytes, '\0');
  for (size_t i = 0; i < binary.size(); ++i) binary[i] = char('A' + (i * 7 + size_t(id)) % 26);
  k.set_binary(binary);
  return k;
}

KernelSpec spec(int heads) { return testing::makeSpec({.heads = heads}); }

DeviceModel h200() { return {"NVIDIA H200", "sm_90a", 132}; }

Decision decision(int heads, const DeviceModel& device) {
  Decision d;
  d.spec = spec(heads);
  d.device = device;
  d.toolchain = "nvrtc-13.0";
  d.result.mutable_best()->set_block_m(128);
  d.result.set_measured(true);
  d.result.set_median_ms(1.25);
  d.candidatesJson = R"([{"schedule": "bm128", "median_ms": 1.25}])";
  return d;
}

std::unique_ptr<KernelStore> open(const std::string& path, SqliteOptions options = {}) {
  auto store = openSqliteStore(path, options);
  EXPECT_TRUE(store) << store.error().message;
  return store ? std::move(*store) : nullptr;
}

// This process's PostgreSQL server, started on first use.
testing::PostgresServer* postgresServer(std::string* why) {
  static std::string failure;
  static std::unique_ptr<testing::PostgresServer> server = testing::PostgresServer::start(&failure);
  *why = failure;
  return server.get();
}

// The store under test, by its kind: a SQLite file in a scratch folder, or
// a fresh database on this process's PostgreSQL server.
class Store : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (postgres()) {
      std::string why;
      testing::PostgresServer* server = postgresServer(&why);
      if (!server) {
        if (why.find("not installed") != std::string::npos) GTEST_SKIP() << why;
        FAIL() << why;
      }
      location_ = server->createDatabase();
    } else {
      location_ = dir_ / "k.sqlite";
    }
  }
  bool postgres() const { return GetParam() == "postgresql"; }
  const std::string& location() const { return location_; }

  std::unique_ptr<KernelStore> open(int64_t maxBytes = 0) {
    Result<std::unique_ptr<KernelStore>> store = makeError("unopened");
    if (postgres()) {
      PostgresOptions options;
      if (maxBytes) options.maxBytes = maxBytes;
      store = openPostgresStore(location_, options);
    } else {
      SqliteOptions options;
      if (maxBytes) options.maxBytes = maxBytes;
      store = openSqliteStore(location_, options);
    }
    EXPECT_TRUE(store) << store.error().message;
    return store ? std::move(*store) : nullptr;
  }

  // One statement straight into the store's database (damage from outside);
  // tables by their SQLite names (PostgreSQL's have loom_ before them).
  void sql(std::string statement) {
    if (postgres()) {
      for (const char* table : {"artifacts", "decisions", "rankings"}) {
        const std::string from = std::string("UPDATE ") + table, to = std::string("UPDATE loom_") + table;
        if (statement.rfind(from, 0) == 0) statement = to + statement.substr(from.size());
      }
      const std::string error = testing::PostgresServer::run(location_, statement);
      ASSERT_EQ(error, "") << statement;
      return;
    }
    sqlite3* raw = nullptr;
    ASSERT_EQ(sqlite3_open(location_.c_str(), &raw), SQLITE_OK);
    ASSERT_EQ(sqlite3_exec(raw, statement.c_str(), nullptr, nullptr, nullptr), SQLITE_OK) << statement;
    sqlite3_close(raw);
  }

  testing::TempDir dir_;

 private:
  std::string location_;
};

INSTANTIATE_TEST_SUITE_P(Stores, Store, ::testing::Values("sqlite", "postgresql"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

TEST_P(Store, StoresAndFindsArtifactsAndDecisions) {
  auto store = open();
  const v1::CompiledKernel k = kernel(1);
  ASSERT_TRUE(store->putArtifact(k));
  auto found = store->getArtifact(artifactKey(k));
  ASSERT_TRUE(found && found->has_value());
  EXPECT_EQ((*found)->binary(), k.binary());
  auto miss = store->getArtifact("0000000000000000");
  ASSERT_TRUE(miss);
  EXPECT_FALSE(miss->has_value());

  ASSERT_TRUE(store->putDecision(decision(8, h200())));
  auto exact = store->getDecision(spec(8), h200(), "nvrtc-13.0");
  ASSERT_TRUE(exact && exact->has_value());
  EXPECT_FALSE((*exact)->fallback);
  EXPECT_EQ((*exact)->decision.result.best().block_m(), 128);
  EXPECT_NE((*exact)->decision.candidatesJson.find("median_ms"), std::string::npos);
  EXPECT_FALSE(store->getDecision(spec(4), h200(), "nvrtc-13.0")->has_value());
  EXPECT_FALSE(store->getDecision(spec(8), h200(), "nvrtc-12.8")->has_value());
}

// The backward's kernels and decisions are keyed apart from the forward's
// by their own direction field: the same spec on the same device holds one
// decision per direction, and a backward artifact never answers a forward
// lookup, even with the same source.
TEST_P(Store, BackwardKernelsAndDecisionsAreKeyedApart) {
  auto store = open();
  Decision forward = decision(8, h200());
  Decision backward = decision(8, h200());
  backward.result.set_direction(v1::direction_backward);
  backward.result.mutable_best()->set_block_m(32);
  ASSERT_TRUE(store->putDecision(forward));
  EXPECT_FALSE(store->getDecision(spec(8), h200(), "nvrtc-13.0", v1::direction_backward)->has_value());
  ASSERT_TRUE(store->putDecision(backward));
  auto f = store->getDecision(spec(8), h200(), "nvrtc-13.0");
  auto b = store->getDecision(spec(8), h200(), "nvrtc-13.0", v1::direction_backward);
  ASSERT_TRUE(f && f->has_value() && b && b->has_value());
  EXPECT_EQ((*f)->decision.result.best().block_m(), 128);
  EXPECT_EQ((*b)->decision.result.best().block_m(), 32);
  EXPECT_EQ((*b)->decision.result.direction(), v1::direction_backward);
  EXPECT_NE(decisionSpecKey(spec(8), v1::direction_backward), decisionSpecKey(spec(8), v1::direction_forward));
  EXPECT_EQ(decisionSpecKey(spec(8), v1::direction_forward), specKey(spec(8)));  // forward keys unchanged

  v1::CompiledKernel fk = kernel(3), bk = kernel(3);
  bk.set_direction(v1::direction_backward);
  EXPECT_NE(artifactKey(fk), artifactKey(bk));
  ASSERT_TRUE(store->putArtifact(bk));
  EXPECT_FALSE(store->getArtifact(artifactKey(fk))->has_value());
  auto found = store->getArtifact(artifactKey(bk));
  ASSERT_TRUE(found && found->has_value());
  EXPECT_EQ((*found)->direction(), v1::direction_backward);
}

TEST_P(Store, FallsBackToTheSameDeviceClassAndSaysSo) {
  auto store = open();
  ASSERT_TRUE(store->putDecision(decision(8, h200())));
  auto sibling = store->getDecision(spec(8), {"NVIDIA H100 80GB HBM3", "sm_90a", 132}, "nvrtc-13.0");
  ASSERT_TRUE(sibling && sibling->has_value());
  EXPECT_TRUE((*sibling)->fallback);
  EXPECT_NE((*sibling)->note.find("NVIDIA H200"), std::string::npos) << (*sibling)->note;
  EXPECT_FALSE(store->getDecision(spec(8), {"NVIDIA H100 PCIe", "sm_90a", 114}, "nvrtc-13.0")->has_value());
}

TEST_P(Store, SeveralProcessesWriteAtOnce) {
  { open(); }  // created and migrated once
  constexpr int kProcesses = 4, kEach = 25;
  std::vector<pid_t> children;
  for (int p = 0; p < kProcesses; ++p) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      auto store = openStore(location());
      bool ok = bool(store);
      for (int i = 0; ok && i < kEach; ++i) {
        ok = bool((*store)->putArtifact(kernel(p * kEach + i))) && bool((*store)->putDecision(decision(p * kEach + i + 1, h200())));
        ok = ok && (*store)->getArtifact(artifactKey(kernel(p * kEach + i))).ok();
      }
      ::_exit(ok ? 0 : 1);
    }
    children.push_back(pid);
  }
  for (pid_t pid : children) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  auto store = open();
  for (int i = 0; i < kProcesses * kEach; ++i) {
    auto found = store->getArtifact(artifactKey(kernel(i)));
    ASSERT_TRUE(found && found->has_value()) << i;
    EXPECT_TRUE(store->getDecision(spec(i + 1), h200(), "nvrtc-13.0")->has_value()) << i;
  }
  auto report = store->verify();
  ASSERT_TRUE(report);
  EXPECT_EQ(report->checked, 2 * kProcesses * kEach);
  EXPECT_TRUE(report->corrupt.empty());
}

// One byte of a stored binary flipped in the file itself: detected, never loaded.
TEST(Cache, ACorruptBlobInTheFileIsAMissAndIsRemoved) {
  testing::TempDir dir;
  const std::string path = dir / "k.sqlite";
  const v1::CompiledKernel k = kernel(7, 4096);
  { ASSERT_TRUE(open(path)->putArtifact(k)); }  // closing checkpoints the WAL into the file
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const size_t at = bytes.find(k.binary().substr(100, 64));
  ASSERT_NE(at, std::string::npos);
  bytes[at + 10] ^= 0x20;
  { std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes; }

  auto store = open(path);
  auto found = store->getArtifact(artifactKey(k));
  ASSERT_TRUE(found);
  EXPECT_FALSE(found->has_value());
  auto entries = store->list();
  ASSERT_TRUE(entries);
  EXPECT_TRUE(entries->empty()) << "the corrupt record is gone";
}

TEST_P(Store, VerifyFindsAndRemovesDamagedRecords) {
  auto store = open();
  ASSERT_TRUE(store->putArtifact(kernel(1)));
  ASSERT_TRUE(store->putArtifact(kernel(2)));
  ASSERT_TRUE(store->putDecision(decision(8, h200())));
  ASSERT_TRUE(store->putDecision(decision(4, h200())));
  ASSERT_TRUE(store->putRanking("spec/device/model", Schedule()));
  sql("UPDATE artifacts SET blob = " + std::string(postgres() ? "'\\x00112233'" : "x'00112233'") + " WHERE key = '" +
      artifactKey(kernel(2)) + "'");
  sql("UPDATE decisions SET checksum = 'ab' WHERE spec_key = '" + specKey(spec(4)) + "'");
  auto report = store->verify();
  ASSERT_TRUE(report) << report.error().message;
  EXPECT_EQ(report->checked, 5);
  ASSERT_EQ(report->corrupt.size(), 2u);
  EXPECT_EQ(std::set<std::string>(report->corrupt.begin(), report->corrupt.end()),
            (std::set<std::string>{artifactKey(kernel(2)),
                                   specKey(spec(4)) + "/" + h200().key() + "/nvrtc-13.0"}));
  EXPECT_TRUE(store->getArtifact(artifactKey(kernel(1)))->has_value());
  EXPECT_TRUE(store->getDecision(spec(8), h200(), "nvrtc-13.0")->has_value());
  EXPECT_FALSE(store->getDecision(spec(4), h200(), "nvrtc-13.0")->has_value());
  EXPECT_EQ(store->verify()->checked, 3) << "the damaged records are gone";
}

// One byte of a stored binary flipped inside the database: never loaded,
// and gone for the next reader.
TEST_P(Store, ACorruptBlobIsAMissAndIsRemoved) {
  auto store = open();
  const v1::CompiledKernel k = kernel(7, 4096);
  ASSERT_TRUE(store->putArtifact(k));
  sql(std::string("UPDATE artifacts SET blob = ") +
      (postgres() ? "overlay(blob placing '\\x5a'::bytea from 300 for 1)"
                  : "substr(blob, 1, 299) || x'5a' || substr(blob, 301)"));
  auto found = store->getArtifact(artifactKey(k));
  ASSERT_TRUE(found);
  EXPECT_FALSE(found->has_value());
  EXPECT_TRUE(store->list()->empty()) << "the corrupt record is gone";
}

// A database file cut short: moved aside, a fresh store takes its place.
TEST(Cache, ATruncatedDatabaseIsSetAsideNotLoaded) {
  testing::TempDir dir;
  const std::string path = dir / "k.sqlite";
  {
    auto store = open(path);
    for (int i = 0; i < 40; ++i) ASSERT_TRUE(store->putArtifact(kernel(i, 8192)));
  }
  fs::resize_file(path, fs::file_size(path) / 2);
  auto store = open(path);
  ASSERT_TRUE(store);
  EXPECT_FALSE(store->getArtifact(artifactKey(kernel(3, 8192)))->has_value());
  ASSERT_TRUE(store->putArtifact(kernel(99)));
  EXPECT_TRUE(store->getArtifact(artifactKey(kernel(99)))->has_value());
  int aside = 0;
  for (const auto& entry : fs::directory_iterator(dir.path()))
    aside += entry.path().filename().string().find("k.sqlite.corrupt-") == 0;
  EXPECT_EQ(aside, 1);
}

TEST_P(Store, EvictsTheLeastRecentlyUsed) {
  const int64_t maxBytes = 5 * 1200;  // room for about five 1 KiB kernels
  auto store = open(maxBytes);
  // Timestamps have 1 s resolution and ties go by key: kernel 1 is put a
  // second before the others so it alone is the oldest.
  ASSERT_TRUE(store->putArtifact(kernel(1, 1024)));
  ::sleep(1);
  for (int i : {0, 2, 3, 4}) ASSERT_TRUE(store->putArtifact(kernel(i, 1024)));
  // Make kernel 0 the most recently used.
  ::sleep(1);
  ASSERT_TRUE(store->getArtifact(artifactKey(kernel(0, 1024)))->has_value());
  ::sleep(1);
  for (int i = 5; i < 8; ++i) ASSERT_TRUE(store->putArtifact(kernel(i, 1024)));
  auto entries = store->list();
  ASSERT_TRUE(entries);
  int64_t total = 0;
  for (const Entry& e : *entries) total += e.bytes;
  EXPECT_LE(total, maxBytes);
  EXPECT_TRUE(store->getArtifact(artifactKey(kernel(0, 1024)))->has_value()) << "recently used survives";
  EXPECT_TRUE(store->getArtifact(artifactKey(kernel(7, 1024)))->has_value()) << "newest survives";
  EXPECT_FALSE(store->getArtifact(artifactKey(kernel(1, 1024)))->has_value()) << "oldest unused goes";
}

// Each option of public IHA code changes the spec's key; a spec without
// options keeps the key it had before the options existed (its serialisation
// is unchanged: every option defaults to zero).
TEST(Cache, OptionsArePartOfTheSpecKey) {
  KernelSpec base = spec(4);
  base.set_rope_theta(10000);
  base.set_window(2);
  std::vector<KernelSpec> variants(5, base);
  variants[0].set_qk_norm(v1::KernelSpec::rms);
  variants[1].set_qk_norm(v1::KernelSpec::rms);
  variants[1].set_qk_norm_eps(1e-5);
  variants[2].set_rope_direction(v1::KernelSpec::negative);
  variants[3].set_window_align(v1::KernelSpec::token);
  variants[4].set_window(0);
  variants[4].set_window_rows(5);
  std::set<std::string> keys{specKey(base)};
  for (const KernelSpec& v : variants) {
    ASSERT_TRUE(validateSpec(v)) << v.ShortDebugString();
    EXPECT_TRUE(keys.insert(specKey(v)).second) << v.ShortDebugString();
  }
  KernelSpec explicitDefaults = base;
  explicitDefaults.set_qk_norm(v1::KernelSpec::none);
  explicitDefaults.set_rope_direction(v1::KernelSpec::positive);
  explicitDefaults.set_window_align(v1::KernelSpec::virtual_);
  EXPECT_EQ(specKey(explicitDefaults), specKey(base));
}

// Records the way schema 3 and before wrote them: FNV-1a keys and checksums
// (cache::schema3), the decision as the store's JSON.
std::string oldDecisionJson(const Decision& d) {
  nlohmann::json json;
  json["spec"] = nlohmann::json::parse(toJson(d.spec));
  json["device"] = {{"name", d.device.name}, {"arch", d.device.arch}, {"sm_count", d.device.smCount}};
  json["toolchain"] = d.toolchain;
  json["result"] = nlohmann::json::parse(toJson(d.result));
  json["candidates"] = nlohmann::json::parse(d.candidatesJson);
  json["artifact_key"] = d.artifactKey;
  return json.dump();
}

// Runs `sql` with parameters ?1, ?2, ... on a raw connection: text, but
// ?2 (every record's blob column here) as a blob.
void run(sqlite3* raw, const std::string& sql, const std::vector<std::string>& parameters) {
  sqlite3_stmt* stmt = nullptr;
  ASSERT_EQ(sqlite3_prepare_v2(raw, sql.c_str(), -1, &stmt, nullptr), SQLITE_OK) << sqlite3_errmsg(raw);
  for (size_t i = 0; i < parameters.size(); ++i) {
    if (i == 1) sqlite3_bind_blob(stmt, 2, parameters[i].data(), int(parameters[i].size()), SQLITE_TRANSIENT);
    else sqlite3_bind_text(stmt, int(i + 1), parameters[i].data(), int(parameters[i].size()), SQLITE_TRANSIENT);
  }
  EXPECT_EQ(sqlite3_step(stmt), SQLITE_DONE) << sqlite3_errmsg(raw);
  sqlite3_finalize(stmt);
}

int userVersion(const std::string& path) {
  sqlite3* raw = nullptr;
  EXPECT_EQ(sqlite3_open(path.c_str(), &raw), SQLITE_OK);
  sqlite3_stmt* stmt = nullptr;
  sqlite3_prepare_v2(raw, "PRAGMA user_version", -1, &stmt, nullptr);
  const int version = sqlite3_step(stmt) == SQLITE_ROW ? sqlite3_column_int(stmt, 0) : -1;
  sqlite3_finalize(stmt);
  sqlite3_close(raw);
  return version;
}

// A file written by schema 1 opens, migrates through every schema and still answers.
TEST(Cache, MigratesFromSchemaOne) {
  testing::TempDir dir;
  const std::string path = dir / "k.sqlite";
  {
    sqlite3* raw = nullptr;
    ASSERT_EQ(sqlite3_open(path.c_str(), &raw), SQLITE_OK);
    const std::string v1 = R"(
      CREATE TABLE artifacts(key TEXT PRIMARY KEY, blob BLOB NOT NULL, checksum TEXT NOT NULL, created INTEGER NOT NULL);
      CREATE TABLE decisions(spec_key TEXT NOT NULL, device TEXT NOT NULL, toolchain TEXT NOT NULL,
                             blob BLOB NOT NULL, checksum TEXT NOT NULL, created INTEGER NOT NULL,
                             PRIMARY KEY(spec_key, device, toolchain));
      PRAGMA user_version = 1;)";
    ASSERT_EQ(sqlite3_exec(raw, v1.c_str(), nullptr, nullptr, nullptr), SQLITE_OK);
    v1::CompiledKernel k = kernel(5);
    k.set_compile_options("-std=c++17 --ptxas-options=-v -default-device");
    const std::string blob = k.SerializeAsString();
    run(raw, "INSERT INTO artifacts VALUES(?1, ?2, ?3, 1)", {schema3::artifactKey(k), blob, schema3::checksumOf(blob)});
    const Decision d = decision(8, h200());
    const std::string json = oldDecisionJson(d);
    run(raw, "INSERT INTO decisions(spec_key, blob, device, toolchain, checksum, created) VALUES(?1, ?2, ?3, ?4, ?5, 1)",
        {schema3::specKey(d.spec), json, d.device.key(), d.toolchain, schema3::checksumOf(json)});
    sqlite3_close(raw);
  }
  auto store = open(path);
  v1::CompiledKernel k = kernel(5);
  k.set_compile_options("-std=c++17 --ptxas-options=-v -default-device");
  EXPECT_TRUE(store->getArtifact(artifactKey(k))->has_value());
  // The device class was backfilled: the fallback lookup works on old rows.
  auto sibling = store->getDecision(spec(8), {"NVIDIA H100 80GB HBM3", "sm_90a", 132}, "nvrtc-13.0");
  ASSERT_TRUE(sibling && sibling->has_value());
  EXPECT_TRUE((*sibling)->fallback);
  EXPECT_EQ(userVersion(path), schemaVersion());
}

// A schema-2 file: artifacts stored before records carried their compile
// options open, gain the options every earlier loom compiled with, and are
// found under today's key for them.
TEST(Cache, MigratedArtifactsGainTheirCompileOptions) {
  testing::TempDir dir;
  const std::string path = dir / "k.sqlite";
  { ASSERT_TRUE(open(path)); }
  v1::CompiledKernel compiled = kernel(3);
  compiled.set_compile_options("-std=c++17 --ptxas-options=-v -default-device");
  const std::string blob = kernel(3).SerializeAsString();  // as schema 2 stored it: no options field
  {
    sqlite3* raw = nullptr;
    ASSERT_EQ(sqlite3_open(path.c_str(), &raw), SQLITE_OK);
    ASSERT_EQ(sqlite3_exec(raw, "DROP TABLE rankings; DROP TABLE leases; PRAGMA user_version = 2", nullptr, nullptr, nullptr), SQLITE_OK);
    run(raw, "INSERT INTO artifacts(key, blob, checksum, created, bytes, last_used) VALUES(?1, ?2, ?3, 1, 9, 1)",
        {schema3::artifactKey(compiled), blob, schema3::checksumOf(blob)});
    sqlite3_close(raw);
  }
  auto store = open(path);
  auto found = store->getArtifact(artifactKey(compiled));
  ASSERT_TRUE(found && found->has_value()) << "the old record is found under today's key";
  EXPECT_EQ((*found)->compile_options(), compiled.compile_options());
  EXPECT_EQ((*found)->binary(), compiled.binary());
  auto report = store->verify();
  ASSERT_TRUE(report);
  EXPECT_TRUE(report->corrupt.empty());
}

// Schema 3 to 4: FNV-1a addresses become SHA-256 ones. Every record schema 3
// would have served is re-keyed (a decision's spec key and artifact key
// follow); a record whose old checksum fails goes.
TEST(Cache, MigratesFnvAddressesToSha256) {
  testing::TempDir dir;
  const std::string path = dir / "k.sqlite";
  { ASSERT_TRUE(open(path)); }
  v1::CompiledKernel good = kernel(7), damaged = kernel(8);
  good.set_compile_options("-std=c++17");
  damaged.set_compile_options("-std=c++17");
  Decision d = decision(8, h200());
  d.artifactKey = schema3::artifactKey(good);
  {
    sqlite3* raw = nullptr;
    ASSERT_EQ(sqlite3_open(path.c_str(), &raw), SQLITE_OK);
    ASSERT_EQ(sqlite3_exec(raw, "DROP TABLE rankings; DROP TABLE leases; PRAGMA user_version = 3", nullptr, nullptr, nullptr), SQLITE_OK);
    const std::string insert =
        "INSERT INTO artifacts(key, blob, checksum, created, bytes, last_used) VALUES(?1, ?2, ?3, 1, 9, 1)";
    const std::string blob = good.SerializeAsString(), other = damaged.SerializeAsString();
    run(raw, insert, {schema3::artifactKey(good), blob, schema3::checksumOf(blob)});
    run(raw, insert, {schema3::artifactKey(damaged), other, schema3::checksumOf(other + "x")});
    const std::string json = oldDecisionJson(d);
    run(raw,
        "INSERT INTO decisions(spec_key, blob, device, toolchain, checksum, created, bytes, last_used, device_class) "
        "VALUES(?1, ?2, ?3, ?4, ?5, 1, 9, 1, ?6)",
        {schema3::specKey(d.spec), json, d.device.key(), d.toolchain, schema3::checksumOf(json), d.device.classKey()});
    sqlite3_close(raw);
  }
  auto store = open(path);
  EXPECT_EQ(userVersion(path), schemaVersion());
  EXPECT_EQ(artifactKey(good).size(), 64u);
  auto found = store->getArtifact(artifactKey(good));
  ASSERT_TRUE(found && found->has_value());
  EXPECT_EQ((*found)->binary(), good.binary());
  EXPECT_FALSE(store->getArtifact(schema3::artifactKey(good))->has_value()) << "no record under the old key";
  EXPECT_FALSE(store->getArtifact(artifactKey(damaged))->has_value());
  auto lookup = store->getDecision(spec(8), h200(), "nvrtc-13.0");
  ASSERT_TRUE(lookup && lookup->has_value());
  EXPECT_EQ((*lookup)->decision.artifactKey, artifactKey(good));
  EXPECT_EQ((*lookup)->decision.result.median_ms(), 1.25);
  auto listed = store->list();
  ASSERT_TRUE(listed);
  EXPECT_EQ(listed->size(), 2u);
  auto report = store->verify();
  ASSERT_TRUE(report);
  EXPECT_TRUE(report->corrupt.empty());
}

// Shape buckets: powers of two, a forward's N and a decode step's cache
// length and batch; malformed ones named.
TEST(Cache, ShapeBucketsRoundUpToPowersOfTwo) {
  EXPECT_EQ(shapeBucket(v1::direction_forward, 4, 3000), "n4096");
  EXPECT_EQ(shapeBucket(v1::direction_backward, 1, 4096), "n4096");
  EXPECT_EQ(shapeBucket(v1::direction_forward, 1, 3), "n16");
  EXPECT_EQ(shapeBucket(v1::direction_decode, 5, 33000), "c65536.b8");
  EXPECT_EQ(shapeBucket(v1::direction_decode_mixed, 1, 100), "c128.b1");
  auto shape = parseShapeBucket("c65536.b8");
  ASSERT_TRUE(shape) << shape.error().message;
  EXPECT_EQ(shape->tokens, 65536);
  EXPECT_EQ(shape->batch, 8);
  EXPECT_EQ(parseShapeBucket("n4096")->batch, 1);
  EXPECT_DOUBLE_EQ(bucketDistance(*parseShapeBucket("n1024"), *parseShapeBucket("n8192")), 3.0);
  EXPECT_DOUBLE_EQ(bucketDistance(*parseShapeBucket("c1024.b1"), *parseShapeBucket("c2048.b4")), 3.0);
  for (const char* bad : {"", "n", "n0", "x4096", "c4096", "c4096.b", "c.b8", "n-4", "n12ab"}) {
    auto parsed = parseShapeBucket(bad);
    ASSERT_FALSE(parsed) << bad;
    EXPECT_NE(parsed.error().message.find("want n<tokens>"), std::string::npos) << parsed.error().message;
  }
}

// Decisions per shape bucket: the bucket's own, else the nearest tuned
// bucket's (the note says so), else the one for every shape; a lookup
// naming no bucket gets the one for every shape. Ids name the bucket.
TEST_P(Store, DecisionsAreKeptPerShapeBucketAndTheNearestAnswers) {
  auto store = open();
  auto tuned = [&](const std::string& bucket, int blockM) {
    Decision d = decision(8, h200());
    d.result.set_shape_bucket(bucket);
    d.result.mutable_best()->set_block_m(blockM);
    ASSERT_TRUE(store->putDecision(d));
  };
  tuned("n1024", 32);
  tuned("n16384", 64);
  auto get = [&](const std::string& bucket) { return store->getDecision(spec(8), h200(), "nvrtc-13.0",
                                                                        v1::direction_forward, bucket); };
  // Only bucketed decisions: an ask for every shape takes the most recent.
  auto any = get("");
  ASSERT_TRUE(any && any->has_value());
  EXPECT_EQ((*any)->decision.result.shape_bucket(), "n16384");
  tuned("", 128);
  for (const auto& [ask, want, blockM] : {std::tuple{"n1024", "n1024", 32}, {"n2048", "n1024", 32},
                                          {"n8192", "n16384", 64}, {"n65536", "n16384", 64}, {"", "", 128}}) {
    auto found = get(ask);
    ASSERT_TRUE(found && found->has_value()) << ask;
    EXPECT_EQ((*found)->decision.result.shape_bucket(), want) << ask;
    EXPECT_EQ((*found)->decision.result.best().block_m(), blockM) << ask;
    EXPECT_FALSE((*found)->fallback) << ask;
    if (std::string(ask) != want)
      EXPECT_EQ((*found)->note, "tuned for shape bucket " + std::string(want) + ", the nearest to " + ask);
    else
      EXPECT_EQ((*found)->note, "");
  }
  // Another device of the class: the bucket still chooses, both noted.
  auto sibling = store->getDecision(spec(8), {"NVIDIA H100 80GB HBM3", "sm_90a", 132}, "nvrtc-13.0",
                                    v1::direction_forward, "n2048");
  ASSERT_TRUE(sibling && sibling->has_value());
  EXPECT_TRUE((*sibling)->fallback);
  EXPECT_EQ((*sibling)->decision.result.shape_bucket(), "n1024");
  EXPECT_NE((*sibling)->note.find("another device of class"), std::string::npos) << (*sibling)->note;
  EXPECT_NE((*sibling)->note.find("tuned for shape bucket n1024, the nearest to n2048"), std::string::npos);
  // A decode step's buckets are its own; a malformed ask is an error.
  Decision step = decision(8, h200());
  step.result.set_direction(v1::direction_decode);
  step.result.set_shape_bucket("c32768.b8");
  ASSERT_TRUE(store->putDecision(step));
  auto decodeLookup = store->getDecision(spec(8), h200(), "nvrtc-13.0", v1::direction_decode, "c131072.b16");
  ASSERT_TRUE(decodeLookup && decodeLookup->has_value());
  EXPECT_EQ((*decodeLookup)->decision.result.shape_bucket(), "c32768.b8");
  EXPECT_FALSE(store->getDecision(spec(8), h200(), "nvrtc-13.0", v1::direction_forward, "n40x"));
  // Listed, described and removed by ids that name the bucket.
  auto listed = store->list();
  ASSERT_TRUE(listed);
  std::set<std::string> ids;
  for (const Entry& e : *listed) ids.insert(e.id);
  const std::string base = decisionSpecKey(spec(8), v1::direction_forward) + "/" + h200().key() + "/nvrtc-13.0";
  for (const std::string id : {base, base + "@n1024", base + "@n16384"}) EXPECT_TRUE(ids.count(id)) << id;
  auto described = store->describe(base + "@n1024");
  ASSERT_TRUE(described && described->has_value());
  EXPECT_NE((*described)->find("\"shape_bucket\": \"n1024\""), std::string::npos) << **described;
  ASSERT_TRUE(store->remove(base + "@n1024"));
  EXPECT_EQ((*get("n1024"))->decision.result.shape_bucket(), "n16384") << "the nearest left";
  EXPECT_TRUE(store->verify()->corrupt.empty());
}

// A schema-4 file (decisions before shape buckets) migrates: its decision
// serves every shape, asked with a bucket or without, and a bucketed
// decision then stands beside it.
TEST(Cache, MigratesSchemaFourDecisionsToEveryShape) {
  testing::TempDir dir;
  const std::string path = dir / "k.sqlite";
  const Decision d = decision(8, h200());
  {
    sqlite3* raw = nullptr;
    ASSERT_EQ(sqlite3_open(path.c_str(), &raw), SQLITE_OK);
    const std::string v4 = R"(
      CREATE TABLE artifacts(key TEXT PRIMARY KEY, blob BLOB NOT NULL, checksum TEXT NOT NULL, created INTEGER NOT NULL,
                             bytes INTEGER NOT NULL DEFAULT 0, last_used INTEGER NOT NULL DEFAULT 0);
      CREATE TABLE decisions(spec_key TEXT NOT NULL, device TEXT NOT NULL, toolchain TEXT NOT NULL,
                             blob BLOB NOT NULL, checksum TEXT NOT NULL, created INTEGER NOT NULL,
                             bytes INTEGER NOT NULL DEFAULT 0, last_used INTEGER NOT NULL DEFAULT 0,
                             device_class TEXT NOT NULL DEFAULT '', PRIMARY KEY(spec_key, device, toolchain));
      CREATE INDEX decisions_by_class ON decisions(spec_key, device_class, toolchain);
      CREATE INDEX artifacts_by_use ON artifacts(last_used);
      CREATE TABLE rankings(key TEXT PRIMARY KEY, blob BLOB NOT NULL, checksum TEXT NOT NULL, created INTEGER NOT NULL);
      PRAGMA user_version = 4;)";
    ASSERT_EQ(sqlite3_exec(raw, v4.c_str(), nullptr, nullptr, nullptr), SQLITE_OK);
    // The record as a schema-4 loom wrote it (no shape_bucket in its result).
    nlohmann::json json = nlohmann::json::parse(oldDecisionJson(d));
    const std::string blob = json.dump();
    run(raw,
        "INSERT INTO decisions(spec_key, blob, device, toolchain, checksum, created, bytes, last_used, device_class) "
        "VALUES(?1, ?2, ?3, ?4, ?5, 1, 9, 1, ?6)",
        {decisionSpecKey(d.spec, v1::direction_forward), blob, d.device.key(), d.toolchain,
         ContentHash().add(blob).hex(), d.device.classKey()});
    sqlite3_close(raw);
  }
  auto store = open(path);
  EXPECT_EQ(userVersion(path), schemaVersion());
  for (const std::string ask : {"", "n4096"}) {
    auto found = store->getDecision(spec(8), h200(), "nvrtc-13.0", v1::direction_forward, ask);
    ASSERT_TRUE(found && found->has_value()) << ask;
    EXPECT_EQ((*found)->decision.result.median_ms(), 1.25);
    EXPECT_EQ((*found)->decision.result.shape_bucket(), "");
    EXPECT_EQ((*found)->note, ask.empty() ? "" : "tuned for every shape, the nearest to n4096");
  }
  Decision bucketed = d;
  bucketed.result.set_shape_bucket("n4096");
  bucketed.result.set_median_ms(0.5);
  ASSERT_TRUE(store->putDecision(bucketed));
  EXPECT_EQ((*store->getDecision(spec(8), h200(), "nvrtc-13.0", v1::direction_forward, "n4096"))->decision.result.median_ms(), 0.5);
  EXPECT_EQ((*store->getDecision(spec(8), h200(), "nvrtc-13.0"))->decision.result.median_ms(), 1.25);
  EXPECT_TRUE(store->verify()->corrupt.empty());
}

// Keys are SHA-256 over length-prefixed fields: the FIPS 180-2 vector, and
// two kernels whose fields differ only in where a 0xff byte falls, which
// the old FNV-1a key (a 0xff separator) could not tell apart.
TEST(Cache, KeysAreSha256OverUnambiguousFields) {
  EXPECT_EQ(sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_NE(ContentHash().add("ab").add("c").hex(), ContentHash().add("a").add("bc").hex());
  v1::CompiledKernel a = kernel(1), b = kernel(1);
  a.set_source("x\xff");
  a.set_compile_options("y");
  b.set_source("x");
  b.set_compile_options("\xffy");
  EXPECT_EQ(schema3::artifactKey(a), schema3::artifactKey(b)) << "the collision schema 3 had";
  EXPECT_NE(artifactKey(a), artifactKey(b));
  const ContentHash partial = ContentHash().add("a");
  EXPECT_EQ(partial.hex(), partial.hex()) << "hex() leaves the hash as it was";
  EXPECT_EQ(ContentHash(partial).add("b").hex(), ContentHash().add("a").add("b").hex());
}

// The cost model's choice is kept (a restarted service need not rank
// again), checksummed like every record, and travels in exports.
TEST_P(Store, RankingsAreKeptCheckedAndExported) {
  Schedule s;
  s.set_block_m(128);
  s.set_block_n(64);
  {
    auto store = open();
    EXPECT_FALSE(store->getRanking("spec/device/model")->has_value());
    ASSERT_TRUE(store->putRanking("spec/device/model", s));
  }
  auto store = open();
  auto found = store->getRanking("spec/device/model");
  ASSERT_TRUE(found && found->has_value());
  EXPECT_EQ((*found)->block_n(), 64);
  ASSERT_TRUE(store->exportTo(dir_ / "bundle.sqlite"));
  auto there = cache::open(dir_ / "there.sqlite");
  ASSERT_TRUE(there->importFrom(dir_ / "bundle.sqlite"));
  EXPECT_TRUE(there->getRanking("spec/device/model")->has_value());
  sql(std::string("UPDATE rankings SET blob = ") + (postgres() ? "'\\x08ff'" : "x'08ff'"));
  EXPECT_FALSE(store->getRanking("spec/device/model")->has_value()) << "a damaged ranking is a miss";
}

// Found by fuzz_cache_import: a file whose primary-key index cannot find
// one of its rows (quick_check on open does not read indexes). verify could
// not remove that corrupt row, and import copied it. An import now checks
// the whole file first and refuses it.
TEST(Cache, ImportRefusesAFileWhoseIndexMissesARow) {
  testing::TempDir dir;
  const std::string bundle = dir / "bundle.sqlite";
  fs::copy_file(std::string(LOOM_TEST_DATA) + "/cache/index-misses-a-row.sqlite", bundle);
  auto here = open(dir / "here.sqlite");
  auto imported = here->importFrom(bundle);
  ASSERT_FALSE(imported);
  EXPECT_NE(imported.error().message.find("is not a healthy database"), std::string::npos) << imported.error().message;
  auto report = here->verify();
  ASSERT_TRUE(report);
  EXPECT_EQ(report->checked, 0);
}

// Records leave a store in a SQLite bundle and enter either kind of store
// from it: SQLite to PostgreSQL and back, every record checked on the way
// in (a damaged one in the bundle is not taken).
TEST_P(Store, ExportAndImportMoveRecordsBetweenStores) {
  auto here = open();
  ASSERT_TRUE(here->putArtifact(kernel(1)));
  ASSERT_TRUE(here->putArtifact(kernel(2, 2048)));
  Decision bucketed = decision(8, h200());
  bucketed.result.set_shape_bucket("n4096");
  ASSERT_TRUE(here->putDecision(decision(8, h200())));
  ASSERT_TRUE(here->putDecision(bucketed));
  ASSERT_TRUE(here->putRanking("spec/device/model", Schedule()));
  ASSERT_TRUE(here->exportTo(dir_ / "bundle.sqlite"));
  {  // one artifact damaged inside the bundle
    sqlite3* raw = nullptr;
    ASSERT_EQ(sqlite3_open((dir_ / "bundle.sqlite").c_str(), &raw), SQLITE_OK);
    const std::string damage = "UPDATE artifacts SET checksum = 'ab' WHERE key = '" + artifactKey(kernel(2, 2048)) + "'";
    ASSERT_EQ(sqlite3_exec(raw, damage.c_str(), nullptr, nullptr, nullptr), SQLITE_OK);
    sqlite3_close(raw);
  }
  std::vector<std::string> targets = {dir_ / "there.sqlite"};
  std::string why;
  if (auto* server = postgresServer(&why)) targets.push_back(server->createDatabase());
  else if (why.find("not installed") == std::string::npos) FAIL() << why;
  for (const std::string& target : targets) {
    auto there = openStore(target);
    ASSERT_TRUE(there) << there.error().message;
    auto imported = (*there)->importFrom(dir_ / "bundle.sqlite");
    ASSERT_TRUE(imported) << target << ": " << imported.error().message;
    EXPECT_EQ(*imported, 4) << target;
    EXPECT_TRUE((*there)->getArtifact(artifactKey(kernel(1)))->has_value()) << target;
    EXPECT_FALSE((*there)->getArtifact(artifactKey(kernel(2, 2048)))->has_value()) << target;
    auto d = (*there)->getDecision(spec(8), h200(), "nvrtc-13.0", v1::direction_forward, "n4096");
    ASSERT_TRUE(d && d->has_value()) << target;
    EXPECT_EQ((*d)->decision.result.shape_bucket(), "n4096");
    EXPECT_TRUE((*there)->getDecision(spec(8), h200(), "nvrtc-13.0")->has_value()) << target;
    EXPECT_TRUE((*there)->getRanking("spec/device/model")->has_value()) << target;
    auto report = (*there)->verify();
    ASSERT_TRUE(report);
    EXPECT_TRUE(report->corrupt.empty()) << target;
  }
  auto missing = here->importFrom(dir_ / "nothing-here.sqlite");
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.error().message.find("no file"), std::string::npos) << missing.error().message;
}

// An export reads each table a page at a time (PostgreSQL: 64 rows, in key
// order, resuming after the last key of a page; decisions' keys are five
// columns): more records than several pages all arrive, once each.
TEST_P(Store, ExportPagesThroughEveryRecord) {
  constexpr int kArtifacts = 150, kDecisions = 70, kRankings = 70;
  auto here = open();
  for (int i = 0; i < kArtifacts; ++i) ASSERT_TRUE(here->putArtifact(kernel(1000 + i)));
  auto decisionAt = [](int i) {
    Decision d = decision(1 + i / 2, h200());
    if (i % 2) d.result.set_shape_bucket("n" + std::to_string(1024 << (i % 5)));
    return d;
  };
  for (int i = 0; i < kDecisions; ++i) ASSERT_TRUE(here->putDecision(decisionAt(i)));
  for (int i = 0; i < kRankings; ++i) ASSERT_TRUE(here->putRanking("spec" + std::to_string(i) + "/device/model", Schedule()));
  ASSERT_TRUE(here->exportTo(dir_ / "bundle.sqlite"));
  auto there = cache::open(dir_ / "there.sqlite");
  auto imported = there->importFrom(dir_ / "bundle.sqlite");
  ASSERT_TRUE(imported) << imported.error().message;
  EXPECT_EQ(*imported, kArtifacts + kDecisions + kRankings);
  for (int i = 0; i < kArtifacts; ++i)
    EXPECT_TRUE(there->getArtifact(artifactKey(kernel(1000 + i)))->has_value()) << "artifact " << i;
  for (int i = 0; i < kDecisions; ++i) {
    const Decision d = decisionAt(i);
    auto found = there->getDecision(d.spec, d.device, d.toolchain, v1::direction_forward, d.result.shape_bucket());
    ASSERT_TRUE(found && found->has_value()) << "decision " << i;
    EXPECT_EQ((*found)->decision.result.shape_bucket(), d.result.shape_bucket()) << "decision " << i;
  }
  for (int i = 0; i < kRankings; ++i)
    EXPECT_TRUE(there->getRanking("spec" + std::to_string(i) + "/device/model")->has_value()) << "ranking " << i;
  auto report = there->verify();
  ASSERT_TRUE(report);
  EXPECT_EQ(report->checked, kArtifacts + kDecisions + kRankings);
  EXPECT_TRUE(report->corrupt.empty());
}

// Leases: one holder at a time until it expires or is given back; the
// holder renews its own; everyone on the store sees the same.
TEST_P(Store, LeasesAreHeldByOneUntilTheyExpireOrAreGivenBack) {
  auto a = open(), b = open();
  auto first = a->acquireLease("tune/x", "worker-a", 60);
  ASSERT_TRUE(first) << first.error().message;
  EXPECT_TRUE(first->granted);
  auto refused = b->acquireLease("tune/x", "worker-b", 60);
  ASSERT_TRUE(refused);
  EXPECT_FALSE(refused->granted);
  EXPECT_EQ(refused->holder, "worker-a");
  EXPECT_EQ(refused->expires, first->expires);
  auto renewed = b->acquireLease("tune/x", "worker-a", 120);
  ASSERT_TRUE(renewed && renewed->granted);
  EXPECT_GT(renewed->expires, first->expires);
  EXPECT_TRUE(b->acquireLease("tune/y", "worker-b", 60)->granted) << "another key is free";
  ASSERT_TRUE(b->releaseLease("tune/x", "worker-b"));  // not its lease: nothing happens
  EXPECT_FALSE(b->acquireLease("tune/x", "worker-b", 60)->granted);
  ASSERT_TRUE(a->releaseLease("tune/x", "worker-a"));
  EXPECT_TRUE(b->acquireLease("tune/x", "worker-b", 1)->granted);
  ::sleep(2);  // expired: anyone may take it
  auto taken = a->acquireLease("tune/x", "worker-a", 60);
  ASSERT_TRUE(taken);
  EXPECT_TRUE(taken->granted);
  EXPECT_EQ(taken->holder, "worker-a");
}

// The database restarted under an open store (every connection dropped):
// the next call connects again and finds what was stored.
TEST(Cache, APostgresStoreReconnectsAfterTheServerRestarts) {
  std::string why;
  testing::PostgresServer* server = postgresServer(&why);
  if (!server && why.find("not installed") != std::string::npos) GTEST_SKIP() << why;
  ASSERT_TRUE(server) << why;
  auto store = openPostgresStore(server->createDatabase());
  ASSERT_TRUE(store) << store.error().message;
  ASSERT_TRUE((*store)->putArtifact(kernel(1)));
  ASSERT_TRUE(server->restart());
  auto found = (*store)->getArtifact(artifactKey(kernel(1)));
  ASSERT_TRUE(found) << found.error().message;
  EXPECT_TRUE(found->has_value());
  EXPECT_TRUE((*store)->putArtifact(kernel(2)));
}

// `loom cache --store` on either store: list, verify, export from
// PostgreSQL, import into a SQLite file, remove; a password in the URL is
// never printed.
TEST(Cache, TheCliManagesEitherStore) {
  std::string why;
  testing::PostgresServer* server = postgresServer(&why);
  if (!server && why.find("not installed") != std::string::npos) GTEST_SKIP() << why;
  ASSERT_TRUE(server) << why;
  const std::string url = server->createDatabase();
  {
    auto store = openPostgresStore(url);
    ASSERT_TRUE(store) << store.error().message;
    ASSERT_TRUE((*store)->putArtifact(kernel(1)));
    ASSERT_TRUE((*store)->putDecision(decision(8, h200())));
  }
  const auto listed = testing::runLoom("cache --store " + url + " ls");
  ASSERT_EQ(listed.exitCode, 0) << listed.output;
  EXPECT_NE(listed.output.find("2 entries"), std::string::npos) << listed.output;
  EXPECT_NE(listed.output.find("measured block_m: 128"), std::string::npos) << listed.output;
  const auto verified = testing::runLoom("cache --store " + url + " verify");
  EXPECT_EQ(verified.exitCode, 0) << verified.output;
  EXPECT_NE(verified.output.find("checked 2 records, 0 corrupt"), std::string::npos) << verified.output;
  testing::TempDir dir;
  ASSERT_EQ(testing::runLoom("cache --store " + url + " export " + (dir / "bundle.sqlite")).exitCode, 0);
  const auto imported = testing::runLoom("cache --store " + (dir / "k.sqlite") + " import " + (dir / "bundle.sqlite"));
  ASSERT_EQ(imported.exitCode, 0) << imported.output;
  EXPECT_NE(imported.output.find("imported 2 new records"), std::string::npos) << imported.output;
  const auto removed = testing::runLoom("cache --store " + url + " rm " + artifactKey(kernel(1)));
  EXPECT_EQ(removed.exitCode, 0) << removed.output;
  EXPECT_NE(testing::runLoom("cache --store " + url + " ls").output.find("1 entries"), std::string::npos);
  // A refused connection names the store, its password masked.
  std::string secret = url;
  secret.replace(secret.find("loom@"), 5, "loom:hunter2@");
  secret.replace(secret.find(std::to_string(server->port())), std::to_string(server->port()).size(), "1");
  const auto refused = testing::runLoom("cache --store '" + secret + "' ls");
  EXPECT_NE(refused.exitCode, 0);
  EXPECT_NE(refused.output.find("loom:***@127.0.0.1:1"), std::string::npos) << refused.output;
  EXPECT_EQ(refused.output.find("hunter2"), std::string::npos) << refused.output;
}

TEST_P(Store, RemoveNamesUnknownIds) {
  auto store = open();
  ASSERT_TRUE(store->putArtifact(kernel(1)));
  EXPECT_TRUE(store->remove(artifactKey(kernel(1))));
  Status missing = store->remove("nope");
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.error().message.find("no entry nope"), std::string::npos);
}

}  // namespace
}  // namespace loom::cache
