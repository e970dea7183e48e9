// A private PostgreSQL server for a test: initdb into a scratch folder, the
// server on a free loopback port (and a socket in that folder), trust
// authentication for the one local user, stopped and removed at the end.
// Run as the postgres user when the tests run as root (the server refuses
// root). Debian's postgresql package (scripts/setup) provides the binaries;
// `pg_config --bindir` finds them.
#pragma once

#include <arpa/inet.h>
#include <libpq-fe.h>
#include <netinet/in.h>
#include <pwd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>

#include "test_util.h"

namespace loom::testing {

// A loopback port nothing listens on now (bound once and let go).
inline int freePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0)
    port = ntohs(address.sin_port);
  ::close(fd);
  return port;
}


class PostgresServer {
 public:
  // The server, or nullptr with `why` saying what failed.
  static std::unique_ptr<PostgresServer> start(std::string* why) {
    const CommandResult bindir = runCommand("pg_config --bindir");
    std::string bin = bindir.output;
    while (!bin.empty() && std::isspace(static_cast<unsigned char>(bin.back()))) bin.pop_back();
    if (bindir.exitCode != 0 || !std::filesystem::exists(bin + "/initdb")) {
      *why = "PostgreSQL's server binaries are not installed (scripts/setup installs Debian's postgresql)";
      return nullptr;
    }
    auto server = std::unique_ptr<PostgresServer>(new PostgresServer(bin));
    if (::geteuid() == 0) {  // the server refuses root: its folder is the postgres user's
      const passwd* user = ::getpwnam("postgres");
      if (!user) {
        *why = "running as root and there is no postgres user to run the server as";
        return nullptr;
      }
      if (::chown(server->dir_.path().c_str(), user->pw_uid, user->pw_gid) != 0) {
        *why = "cannot hand " + server->dir_.path() + " to the postgres user";
        return nullptr;
      }
      server->as_ = "runuser -u postgres -- ";
    }
    const CommandResult init = runCommand(server->as_ + bin + "/initdb -D " + server->data() +
                                          " -A trust -U loom -E UTF8 --no-sync");
    if (init.exitCode != 0) {
      *why = "initdb failed: " + init.output;
      return nullptr;
    }
    for (int attempt = 0; attempt < 5; ++attempt) {
      server->port_ = freePort();
      const CommandResult started = runCommand(
          server->as_ + bin + "/pg_ctl -D " + server->data() + " -l " + server->dir_.path() + "/log -w -t 30 -o \"-p " +
          std::to_string(server->port_) + " -k " + server->dir_.path() +
          " -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200\" start");
      if (started.exitCode == 0) return server;
      *why = "the server did not start: " + started.output;
    }
    return nullptr;
  }

  ~PostgresServer() {
    if (port_) (void)runCommand(as_ + bin_ + "/pg_ctl -D " + data() + " -m immediate -w stop");
  }

  int port() const { return port_; }

  // Stops the server at once (every connection drops) and starts it again
  // on the same port; whether it came back.
  bool restart() {
    return runCommand(as_ + bin_ + "/pg_ctl -D " + data() + " -m immediate -w -t 30 restart").exitCode == 0;
  }
  std::string url(const std::string& database) const {
    return "postgresql://loom@127.0.0.1:" + std::to_string(port_) + "/" + database;
  }

  // A fresh, empty database; its URL.
  std::string createDatabase() {
    const std::string name = "t" + std::to_string(++databases_);
    run(url("postgres"), "CREATE DATABASE " + name);
    return url(name);
  }

  // Runs one statement (test set-up and damage); "" or the error.
  static std::string run(const std::string& url, const std::string& sql) {
    PGconn* connection = PQconnectdb(url.c_str());
    std::string error;
    if (PQstatus(connection) != CONNECTION_OK) {
      error = PQerrorMessage(connection);
    } else {
      PGresult* result = PQexec(connection, sql.c_str());
      if (PQresultStatus(result) != PGRES_COMMAND_OK && PQresultStatus(result) != PGRES_TUPLES_OK)
        error = PQerrorMessage(connection);
      PQclear(result);
    }
    PQfinish(connection);
    return error;
  }

 private:
  explicit PostgresServer(std::string bin) : bin_(std::move(bin)) {}
  std::string data() const { return dir_.path() + "/data"; }

  std::string bin_, as_;
  TempDir dir_;
  int port_ = 0;
  int databases_ = 0;
};

}  // namespace loom::testing
