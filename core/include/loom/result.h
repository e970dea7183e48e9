// Errors as values. Bad input, I/O, compiler and driver failures travel as an
// Error inside a Result<T>; exceptions are not used across loom's interfaces.
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace loom {

// What went wrong, in one line a user can act on ("q.npy: shape ... ").
// `log` carries a long tool log (a compiler's, say) when there is one.
struct Error {
  std::string message;
  std::string log;
};

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}
  Result(Error error) : v_(std::move(error)) {}

  bool ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return ok(); }

  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  const Error& error() const { return std::get<Error>(v_); }

 private:
  std::variant<T, Error> v_;
};

// Result<void>: success or an Error.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Error error) : error_(std::move(error)), failed_(true) {}
  static Status success() { return {}; }

  bool ok() const { return !failed_; }
  explicit operator bool() const { return ok(); }
  const Error& error() const { return error_; }

 private:
  Error error_;
  bool failed_ = false;
};

inline Error makeError(std::string message, std::string log = {}) {
  return Error{std::move(message), std::move(log)};
}

}  // namespace loom
