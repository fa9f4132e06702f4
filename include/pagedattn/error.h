// Error types. Every message names the argument, its value and the bound it broke.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace pagedattn {

/// Base of every exception the library throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// An argument, configuration field or metadata value outside what the API accepts.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

/// A valid request that this backend or this build cannot serve.
class NotSupported : public Error {
 public:
  using Error::Error;
};

/// A malformed file (safetensors, case file).
class FormatError : public Error {
 public:
  using Error::Error;
};

namespace detail {

/// Concatenates its arguments with operator<< (std::format is not in GCC 12).
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

template <class E = InvalidArgument, class... Args>
[[noreturn]] void fail(const Args&... args) {
  throw E(cat(args...));
}

template <class E = InvalidArgument, class... Args>
void require(bool ok, const Args&... args) {
  if (!ok) throw E(cat(args...));
}

}  // namespace detail
}  // namespace pagedattn
