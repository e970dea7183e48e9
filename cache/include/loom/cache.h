// The kernel cache: compiled kernels and tuning decisions, kept so that a
// spec tuned once on a device model is never tuned or compiled again.
//
// Two kinds of record:
//   artifacts  CompiledKernel (plan + binary), content-addressed by a hash of
//              everything that changes the binary (artifactKey);
//   decisions  the tuned schedule of a spec on a device model with a
//              toolchain, with every candidate's measurements.
// The storage sits behind KernelStore: one SQLite file (the default, and
// the embedded choice) or a PostgreSQL database that several service
// replicas share (docs/fleet.md). A miss is not an error: lookups return an
// empty optional inside the Result.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/result.h"
#include "loom/spec.h"
#include "loom/v1/loom.pb.h"

namespace loom::cache {

// Bumped when the generator's output changes for the same inputs.
inline constexpr const char* kGeneratorVersion = "loom-iha-1";

// What identifies a GPU for tuning: its name, and the class (compute
// capability and SM count) a decision may fall back to.
struct DeviceModel {
  std::string name;   // "NVIDIA H200"
  std::string arch;   // "sm_90a"
  int smCount = 0;
  std::string key() const;         // name|arch|sms
  std::string classKey() const;    // arch|sms
  static DeviceModel of(const v1::Target& target);
};

// The content address of a compiled kernel: source, compile options, arch, the
// toolchain (NVRTC version), tile headers and generator version. All but the
// last two are the record's own fields, set by whoever compiled it: the cache
// knows no compiler.
std::string artifactKey(const v1::CompiledKernel& kernel);
// A stable key of a spec (its deterministic serialisation, hashed).
std::string specKey(const KernelSpec& spec);
// The key decisions of a spec are filed under: specKey, and ".backward",
// ".decode" or ".decode_mixed" after it for the backward kernel's and the
// decode steps' (TuningResult::direction), so the directions are tuned and
// kept apart.
std::string decisionSpecKey(const KernelSpec& spec, v1::Direction direction);

// Shape buckets (docs/serving.md... see docs/caching below): a decision
// may be tuned for the shapes a kernel meets, as Triton's autotune key=
// does. A bucket names them coarsely: "n<N>" for a forward or backward of
// N tokens (rounded up to a power of two, at least 16), "c<C>.b<B>" for a
// decode step over caches of C tokens at batch B (both rounded up the
// same way, B from 1); "" is every shape (the decisions of loom before
// buckets, and tunes that name none).
std::string shapeBucket(v1::Direction direction, int64_t batch, int64_t tokens);
// A bucket's numbers: tokens (N or C) and batch (1 for "n" buckets);
// an error names a malformed one.
struct BucketShape {
  int64_t tokens = 0, batch = 1;
};
Result<BucketShape> parseShapeBucket(const std::string& bucket);
// How far apart two buckets lie: |log2| of their tokens' ratio plus that
// of their batches'.
double bucketDistance(const BucketShape& a, const BucketShape& b);

struct Decision {
  KernelSpec spec;
  DeviceModel device;
  std::string toolchain;
  v1::TuningResult result;      // best schedule, measured or not, median, TFLOP/s
  std::string candidatesJson;   // every candidate's outcome and measurements
  std::string artifactKey;      // the winner's compiled kernel, when stored
};

struct DecisionLookup {
  Decision decision;
  bool fallback = false;  // tuned on another device of the same class
  std::string note;       // says which, when it is a fallback (or tuned for another shape bucket)
};

struct Entry {
  std::string kind;  // "artifact" or "decision"
  std::string id;    // artifact key, or decision id (spec key / device / toolchain)
  std::string summary;
  int64_t bytes = 0;
  int64_t lastUsed = 0;  // unix seconds
};

// A lease: who holds a piece of shared work (a tuning, a compile) and until
// when. `granted` when the caller now holds it.
struct Lease {
  bool granted = false;
  std::string holder;
  int64_t expires = 0;  // unix seconds
};

struct VerifyReport {
  int checked = 0;
  std::vector<std::string> corrupt;  // ids whose checksum failed (removed)
};

// Schema 3 and before keyed and checksummed records with 64-bit FNV-1a (a
// 0xff byte after each field). Only the migration to schema 4 reads these,
// and the tests that write files as those schemas did.
namespace schema3 {
std::string checksumOf(const std::string& blob);
std::string artifactKey(const v1::CompiledKernel& kernel);
std::string specKey(const KernelSpec& spec);
}  // namespace schema3

class KernelStore {
 public:
  virtual ~KernelStore() = default;

  // The artifact under `key`; nullopt on a miss. A record whose checksum
  // fails is never returned: it is removed and reported as a miss.
  virtual Result<std::optional<v1::CompiledKernel>> getArtifact(const std::string& key) = 0;
  // Stores `kernel` under artifactKey(kernel); replaces an equal key.
  virtual Status putArtifact(const v1::CompiledKernel& kernel) = 0;

  // The decision for (spec, direction, device, toolchain); failing that, one tuned on a
  // device of the same class (flagged as a fallback); nullopt on a miss.
  // Among a device's decisions, `shapeBucket`'s own, else the nearest
  // tuned bucket (bucketDistance; the note says which), else the one for
  // every shape; an empty `shapeBucket` asks for the one for every shape,
  // else the most recently used.
  virtual Result<std::optional<DecisionLookup>> getDecision(const KernelSpec& spec, const DeviceModel& device,
                                                            const std::string& toolchain,
                                                            v1::Direction direction = v1::direction_forward,
                                                            const std::string& shapeBucket = "") = 0;
  virtual Status putDecision(const Decision& decision) = 0;

  // A schedule chosen without a measurement (the cost model's ranking),
  // under a key its caller builds from everything the choice depends on;
  // kept so a restarted service need not rank again. nullopt on a miss.
  virtual Result<std::optional<Schedule>> getRanking(const std::string& key) = 0;
  virtual Status putRanking(const std::string& key, const Schedule& schedule) = 0;

  virtual Result<std::vector<Entry>> list() = 0;
  // The record with this id as JSON (an artifact without its binary and
  // source); nullopt when there is none.
  virtual Result<std::optional<std::string>> describe(const std::string& id) = 0;
  // Removes the entry with this id (either kind); an unknown id is an error.
  virtual Status remove(const std::string& id) = 0;
  // Checks every record's checksum; corrupt ones are removed and listed.
  virtual Result<VerifyReport> verify() = 0;
  // Copies every record into a new SQLite store file at `path` / merges one
  // in (each imported record's checksum and artifact key are checked
  // first). The file is the same for both stores: records move between
  // them through it.
  virtual Status exportTo(const std::string& path) = 0;
  virtual Result<int> importFrom(const std::string& path) = 0;

  // Takes the lease `key` for `holder` for `seconds` when it is free,
  // expired or already the holder's (then renewed); else says who holds it
  // until when. Every process on the store sees the same leases: workers
  // pre-tuning through any replica, replicas compiling the same miss.
  virtual Result<Lease> acquireLease(const std::string& key, const std::string& holder, int64_t seconds) = 0;
  // Gives the lease back if `holder` holds it (else does nothing).
  virtual Status releaseLease(const std::string& key, const std::string& holder) = 0;
};

struct SqliteOptions {
  int64_t maxBytes = int64_t(2) << 30;  // least recently used records go past this
  int busyTimeoutMs = 10000;
};

// Opens (creating or migrating) the SQLite store at `path`. A file that is
// not a healthy database is moved aside to <path>.corrupt-<time> and a fresh
// one started, so a damaged cache costs recompiles, never wrong kernels.
Result<std::unique_ptr<KernelStore>> openSqliteStore(const std::string& path, const SqliteOptions& options = {});

// PostgreSQL (cache/src/postgres_store.cpp): `url` is a libpq connection
// URI (postgresql://user@host:port/db) or key=value string. The schema is
// created or migrated on open (one opener at a time, under an advisory
// lock); a lost connection is re-established on the next call.
struct PostgresOptions {
  int64_t maxBytes = int64_t(16) << 30;  // least recently used records go past this
  int connectTimeoutSeconds = 10;
};
Result<std::unique_ptr<KernelStore>> openPostgresStore(const std::string& url, const PostgresOptions& options = {});

// A store by where it lives: "postgresql://..." or "postgres://..." opens
// PostgreSQL, anything else is the path of a SQLite file.
bool isPostgresUrl(const std::string& location);
Result<std::unique_ptr<KernelStore>> openStore(const std::string& location);
// The location with any password masked, for logs and errors.
std::string redactedLocation(const std::string& location);

// The store file inside a cache folder, and in the default one
// (loom::defaultCacheDir()).
std::string storePath(const std::string& cacheDir);
std::string defaultStorePath();

// The schema version this build writes.
int schemaVersion();

}  // namespace loom::cache
