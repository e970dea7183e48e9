// The SQLite kernel store: records, fallbacks, several processes at once,
// damage on disk, eviction, migration from the previous schema, export and
// import.
#include <gtest/gtest.h>
#include <sqlite3.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "loom/cache.h"
#include "loom/hash.h"
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

TEST(Cache, StoresAndFindsArtifactsAndDecisions) {
  testing::TempDir dir;
  auto store = open(dir / "k.sqlite");
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

TEST(Cache, FallsBackToTheSameDeviceClassAndSaysSo) {
  testing::TempDir dir;
  auto store = open(dir / "k.sqlite");
  ASSERT_TRUE(store->putDecision(decision(8, h200())));
  auto sibling = store->getDecision(spec(8), {"NVIDIA H100 80GB HBM3", "sm_90a", 132}, "nvrtc-13.0");
  ASSERT_TRUE(sibling && sibling->has_value());
  EXPECT_TRUE((*sibling)->fallback);
  EXPECT_NE((*sibling)->note.find("NVIDIA H200"), std::string::npos) << (*sibling)->note;
  EXPECT_FALSE(store->getDecision(spec(8), {"NVIDIA H100 PCIe", "sm_90a", 114}, "nvrtc-13.0")->has_value());
}

TEST(Cache, SeveralProcessesWriteAtOnce) {
  testing::TempDir dir;
  const std::string path = dir / "k.sqlite";
  { open(path); }  // created and migrated once
  constexpr int kProcesses = 4, kEach = 25;
  std::vector<pid_t> children;
  for (int p = 0; p < kProcesses; ++p) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      auto store = openSqliteStore(path);
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
  auto store = open(path);
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

// One byte of a stored binary flipped in the file: detected, never loaded.
TEST(Cache, ACorruptBlobIsAMissAndIsRemoved) {
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

TEST(Cache, VerifyFindsAndRemovesDamagedRecords) {
  testing::TempDir dir;
  const std::string path = dir / "k.sqlite";
  auto store = open(path);
  ASSERT_TRUE(store->putArtifact(kernel(1)));
  ASSERT_TRUE(store->putArtifact(kernel(2)));
  sqlite3* raw = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &raw), SQLITE_OK);
  const std::string sql = "UPDATE artifacts SET blob = x'00112233' WHERE key = '" + artifactKey(kernel(2)) + "'";
  ASSERT_EQ(sqlite3_exec(raw, sql.c_str(), nullptr, nullptr, nullptr), SQLITE_OK);
  sqlite3_close(raw);
  auto report = store->verify();
  ASSERT_TRUE(report);
  EXPECT_EQ(report->checked, 2);
  ASSERT_EQ(report->corrupt.size(), 1u);
  EXPECT_EQ(report->corrupt[0], artifactKey(kernel(2)));
  EXPECT_TRUE(store->getArtifact(artifactKey(kernel(1)))->has_value());
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

TEST(Cache, EvictsTheLeastRecentlyUsed) {
  testing::TempDir dir;
  SqliteOptions options;
  options.maxBytes = 5 * 1200;  // room for about five 1 KiB kernels
  auto store = open(dir / "k.sqlite", options);
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
  EXPECT_LE(total, options.maxBytes);
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

// A file written by the previous schema (1) opens, migrates and still answers.
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
    sqlite3_close(raw);
    // Records written the way schema 1 wrote them, through today's store on
    // a scratch file, then copied across without the new columns.
    const std::string scratch = dir / "scratch.sqlite";
    {
      auto today = open(scratch);
      ASSERT_TRUE(today->putArtifact(kernel(5)));
      ASSERT_TRUE(today->putDecision(decision(8, h200())));
    }
    ASSERT_EQ(sqlite3_open(path.c_str(), &raw), SQLITE_OK);
    const std::string copy = "ATTACH DATABASE '" + scratch +
                             "' AS s; INSERT INTO artifacts SELECT key, blob, checksum, created FROM s.artifacts; "
                             "INSERT INTO decisions SELECT spec_key, device, toolchain, blob, checksum, created FROM "
                             "s.decisions; DETACH DATABASE s;";
    ASSERT_EQ(sqlite3_exec(raw, copy.c_str(), nullptr, nullptr, nullptr), SQLITE_OK);
    sqlite3_close(raw);
  }
  auto store = open(path);
  EXPECT_TRUE(store->getArtifact(artifactKey(kernel(5)))->has_value());
  // The device class was backfilled: the fallback lookup works on old rows.
  auto sibling = store->getDecision(spec(8), {"NVIDIA H100 80GB HBM3", "sm_90a", 132}, "nvrtc-13.0");
  ASSERT_TRUE(sibling && sibling->has_value());
  EXPECT_TRUE((*sibling)->fallback);
  sqlite3* raw = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &raw), SQLITE_OK);
  sqlite3_stmt* stmt = nullptr;
  sqlite3_prepare_v2(raw, "PRAGMA user_version", -1, &stmt, nullptr);
  ASSERT_EQ(sqlite3_step(stmt), SQLITE_ROW);
  EXPECT_EQ(sqlite3_column_int(stmt, 0), schemaVersion());
  sqlite3_finalize(stmt);
  sqlite3_close(raw);
}

// A schema-2 file: artifacts stored before records carried their compile
// options open, gain the options every earlier loom compiled with, and still
// answer under the keys they were stored with.
TEST(Cache, MigratedArtifactsGainTheirCompileOptions) {
  testing::TempDir dir;
  const std::string path = dir / "k.sqlite";
  { ASSERT_TRUE(open(path)->putArtifact(kernel(4))); }
  v1::CompiledKernel compiled = kernel(3);
  compiled.set_compile_options("-std=c++17 --ptxas-options=-v -default-device");
  const std::string key = artifactKey(compiled);
  const std::string blob = kernel(3).SerializeAsString();  // as schema 2 stored it: no options field
  {
    sqlite3* raw = nullptr;
    ASSERT_EQ(sqlite3_open(path.c_str(), &raw), SQLITE_OK);
    sqlite3_stmt* insert = nullptr;
    sqlite3_prepare_v2(raw, "INSERT INTO artifacts(key, blob, checksum, created, bytes, last_used) VALUES(?1, ?2, ?3, 1, ?4, 1)",
                       -1, &insert, nullptr);
    const std::string checksum = ContentHash().add(blob).hex();
    sqlite3_bind_text(insert, 1, key.c_str(), -1, SQLITE_TRANSIENT);
    sqlite3_bind_blob(insert, 2, blob.data(), int(blob.size()), SQLITE_TRANSIENT);
    sqlite3_bind_text(insert, 3, checksum.c_str(), -1, SQLITE_TRANSIENT);
    sqlite3_bind_int64(insert, 4, int64_t(blob.size()));
    ASSERT_EQ(sqlite3_step(insert), SQLITE_DONE);
    sqlite3_finalize(insert);
    ASSERT_EQ(sqlite3_exec(raw, "PRAGMA user_version = 2", nullptr, nullptr, nullptr), SQLITE_OK);
    sqlite3_close(raw);
  }
  auto store = open(path);
  auto found = store->getArtifact(key);
  ASSERT_TRUE(found && found->has_value()) << "the old record is found under its old key";
  EXPECT_EQ((*found)->compile_options(), compiled.compile_options());
  EXPECT_EQ((*found)->binary(), compiled.binary());
  EXPECT_TRUE(store->getArtifact(artifactKey(kernel(4)))->has_value()) << "a record already consistent is untouched";
  auto report = store->verify();
  ASSERT_TRUE(report);
  EXPECT_TRUE(report->corrupt.empty());
}

TEST(Cache, ExportAndImportMoveRecordsBetweenMachines) {
  testing::TempDir dir;
  auto here = open(dir / "here.sqlite");
  ASSERT_TRUE(here->putArtifact(kernel(1)));
  ASSERT_TRUE(here->putDecision(decision(8, h200())));
  ASSERT_TRUE(here->exportTo(dir / "bundle.sqlite"));
  auto there = open(dir / "there.sqlite");
  auto imported = there->importFrom(dir / "bundle.sqlite");
  ASSERT_TRUE(imported) << imported.error().message;
  EXPECT_EQ(*imported, 2);
  EXPECT_TRUE(there->getArtifact(artifactKey(kernel(1)))->has_value());
  EXPECT_TRUE(there->getDecision(spec(8), h200(), "nvrtc-13.0")->has_value());
}

TEST(Cache, RemoveNamesUnknownIds) {
  testing::TempDir dir;
  auto store = open(dir / "k.sqlite");
  ASSERT_TRUE(store->putArtifact(kernel(1)));
  EXPECT_TRUE(store->remove(artifactKey(kernel(1))));
  Status missing = store->remove("nope");
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.error().message.find("no entry nope"), std::string::npos);
}

}  // namespace
}  // namespace loom::cache
