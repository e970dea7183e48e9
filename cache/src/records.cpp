// The record logic both stores share (records.h).
#include "records.h"

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>

#include <google/protobuf/util/json_util.h>

#include "loom/hash.h"

namespace loom::cache::detail {

int64_t now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string checksumOf(const std::string& blob) { return ContentHash().add(blob).hex(); }

std::string decisionToJson(const Decision& d) {
  nlohmann::json json;
  json["spec"] = nlohmann::json::parse(toJson(d.spec));
  json["device"] = {{"name", d.device.name}, {"arch", d.device.arch}, {"sm_count", d.device.smCount}};
  json["toolchain"] = d.toolchain;
  json["result"] = nlohmann::json::parse(toJson(d.result));
  json["candidates"] = d.candidatesJson.empty() ? nlohmann::json::array() : nlohmann::json::parse(d.candidatesJson, nullptr, false);
  json["artifact_key"] = d.artifactKey;
  return json.dump();
}

Result<Decision> decisionFromJson(const std::string& text) {
  const auto json = nlohmann::json::parse(text, nullptr, false);
  if (json.is_discarded() || !json.is_object()) return makeError("decision record is not JSON");
  Decision d;
  if (!json.contains("spec") || !json.contains("result") ||
      !google::protobuf::util::JsonStringToMessage(json["spec"].dump(), &d.spec).ok() ||
      !google::protobuf::util::JsonStringToMessage(json["result"].dump(), &d.result).ok())
    return makeError("decision record does not parse");
  // Records from before the Schedule named its engine were tuned on the mma.sync path.
  if (d.result.best().engine() == v1::engine_unspecified) d.result.mutable_best()->set_engine(v1::engine_mma);
  const auto device = json.value("device", nlohmann::json::object());
  if (!device.is_object()) return makeError("decision record's device is not an object");
  const auto textOf = [](const nlohmann::json& j, const char* name) {
    return j.contains(name) && j[name].is_string() ? j[name].get<std::string>() : std::string();
  };
  d.device = {textOf(device, "name"), textOf(device, "arch"),
              device.contains("sm_count") && device["sm_count"].is_number_integer() ? device["sm_count"].get<int>() : 0};
  d.toolchain = textOf(json, "toolchain");
  d.candidatesJson = json.contains("candidates") ? json["candidates"].dump() : "[]";
  d.artifactKey = textOf(json, "artifact_key");
  return d;
}

std::string decisionId(const std::string& specKey, const std::string& device, const std::string& toolchain,
                       const std::string& shapeBucket) {
  return specKey + "/" + device + "/" + toolchain + (shapeBucket.empty() ? "" : "@" + shapeBucket);
}

Record artifactRecord(const v1::CompiledKernel& kernel) {
  const std::string blob = kernel.SerializeAsString();
  const int64_t at = now();
  return {Record::Kind::artifact, artifactKey(kernel), "", "", "", "", blob, checksumOf(blob), at, at};
}

Record decisionRecord(const Decision& d) {
  const std::string blob = decisionToJson(d);
  const int64_t at = now();
  return {Record::Kind::decision, decisionSpecKey(d.spec, d.result.direction()), d.device.key(), d.toolchain,
          d.device.classKey(), d.result.shape_bucket(), blob, checksumOf(blob), at, at};
}

Record rankingRecord(const std::string& key, const Schedule& schedule) {
  const std::string blob = schedule.SerializeAsString();
  const int64_t at = now();
  return {Record::Kind::ranking, key, "", "", "", "", blob, checksumOf(blob), at, at};
}

namespace {
// The checks of a row as stored: checksum, parse, an artifact's address;
// with `fields`, also that a decision's key columns are those of its blob.
bool checked(const Record& record, bool fields) {
  if (checksumOf(record.blob) != record.checksum) return false;
  switch (record.kind) {
    case Record::Kind::artifact: {
      v1::CompiledKernel kernel;
      return kernel.ParseFromString(record.blob) && artifactKey(kernel) == record.key;
    }
    case Record::Kind::decision: {
      auto decision = decisionFromJson(record.blob);
      if (!decision || !fields) return bool(decision);
      return decisionSpecKey(decision->spec, decision->result.direction()) == record.key &&
             decision->device.key() == record.device && decision->toolchain == record.toolchain &&
             decision->device.classKey() == record.deviceClass &&
             decision->result.shape_bucket() == record.shapeBucket;
    }
    case Record::Kind::ranking: {
      Schedule schedule;
      return schedule.ParseFromString(record.blob);
    }
  }
  return false;
}
}  // namespace

bool readableRecord(const Record& record) { return checked(record, false); }
bool soundRecord(const Record& record) { return checked(record, true); }

std::string describeArtifact(const v1::CompiledKernel& kernel) {
  v1::CompiledKernel summary = kernel;
  const size_t binaryBytes = summary.binary().size(), sourceBytes = summary.source().size();
  summary.clear_binary();
  summary.clear_source();
  summary.clear_ptx();
  summary.clear_compile_log();
  auto json = nlohmann::json::parse(toJson(summary));
  json["binary_bytes"] = binaryBytes;
  json["source_bytes"] = sourceBytes;
  return json.dump(2);
}

Result<std::optional<DecisionLookup>> chooseDecision(
    const DeviceModel& device, const std::string& shapeBucket,
    const std::function<Result<std::vector<DecisionRow>>(bool fallback)>& fetch,
    const std::function<void(const DecisionRow&)>& drop, const std::function<void(const DecisionRow&)>& touch) {
  std::optional<BucketShape> wanted;
  if (!shapeBucket.empty()) {
    auto parsed = parseShapeBucket(shapeBucket);
    if (!parsed) return parsed.error();
    wanted = *parsed;
  }
  for (const bool fallback : {false, true}) {
    // The device's (or class's) decisions of every bucket, most recently used first.
    auto rows = fetch(fallback);
    if (!rows) return rows.error();
    // The bucket's own, else the nearest tuned one, else every shape's
    // (a bucket-less ask: every shape's, else the most recent).
    auto rank = [&](const DecisionRow& row) {
      if (row.bucket == shapeBucket) return -1.0;
      if (row.bucket.empty()) return 1e9;
      auto shape = parseShapeBucket(row.bucket);
      if (!shape) return 2e9;
      return wanted ? bucketDistance(*wanted, *shape) : 5e8;
    };
    std::stable_sort(rows->begin(), rows->end(),
                     [&](const DecisionRow& a, const DecisionRow& b) { return rank(a) < rank(b); });
    for (const DecisionRow& row : *rows) {
      auto decision =
          checksumOf(row.blob) == row.checksum ? decisionFromJson(row.blob) : Result<Decision>(makeError("checksum"));
      if (!decision) {
        drop(row);
        continue;
      }
      touch(row);
      DecisionLookup lookup{*decision, fallback, ""};
      if (fallback) lookup.note = "tuned on " + decision->device.name + ", another device of class " + device.classKey();
      if (row.bucket != shapeBucket) {
        const std::string shapes = row.bucket.empty() ? "every shape" : "shape bucket " + row.bucket;
        const std::string bucketNote = "tuned for " + shapes + (shapeBucket.empty() ? "" : ", the nearest to " + shapeBucket);
        lookup.note = lookup.note.empty() ? bucketNote : lookup.note + "; " + bucketNote;
      }
      return std::optional<DecisionLookup>(lookup);
    }
  }
  return std::optional<DecisionLookup>();
}

Result<int> copyRecords(RecordStore& from, RecordStore& to) {
  constexpr size_t kBatch = 64;
  std::vector<Record> batch;
  int copied = 0;
  auto flush = [&]() -> Status {
    auto put = to.putRecords(batch);
    if (!put) return put.error();
    copied += *put;
    batch.clear();
    return Status::success();
  };
  Status visited = from.forEachRecord([&](const Record& record) -> Status {
    batch.push_back(record);
    return batch.size() < kBatch ? Status::success() : flush();
  });
  if (!visited) return visited.error();
  if (Status ok = flush(); !ok) return ok.error();
  return copied;
}

}  // namespace loom::cache::detail
