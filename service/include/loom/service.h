// The kernel service: KernelService over gRPC in front of a KernelProvider
// and its kernel store (SQLite, or PostgreSQL under several replicas), with health checking and reflection on, and
// Prometheus metrics on a port of their own.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "loom/result.h"

namespace loom::service {

struct ServerOptions {
  std::string listen = "127.0.0.1:50051";  // port 0 picks a free one
  std::string cacheDir;                    // empty: $LOOM_CACHE_DIR or ~/.cache/loom
  // The kernel store: empty, the SQLite file in cacheDir; "postgresql://..."
  // a database several replicas share (docs/fleet.md); else a SQLite file.
  std::string store;
  std::string tokenFile;                   // bearer token for writes; none: writes refused
  std::string tlsCert, tlsKey, tlsClientCa;  // TLS (mutual when a client CA is given)
  int metricsPort = -1;                    // -1: off, 0: any free port
  int maxConcurrentCompiles = 4;
  int maxMessageBytes = 64 << 20;
  // Each request's JSON log line (method, code, a bounded message); unset:
  // standard error.
  std::function<void(const std::string&)> requestLog;
};

class KernelServer {
 public:
  // Starts serving. Fails at start-up on bad configuration (an unreadable
  // token file, insecure credentials on a non-loopback address).
  static Result<std::unique_ptr<KernelServer>> start(const ServerOptions& options);
  virtual ~KernelServer() = default;

  virtual int port() const = 0;
  virtual int metricsPort() const = 0;
  // Stops taking requests and finishes those in flight (up to the grace period).
  virtual void shutdown(int graceMilliseconds = 10000) = 0;
  virtual void wait() = 0;
  // NVRTC compiles the server has run (identical concurrent misses count once).
  virtual int64_t compiles() const = 0;
};

}  // namespace loom::service
