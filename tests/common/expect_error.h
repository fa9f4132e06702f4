// EXPECT_ERROR(statement, ExceptionType, "substring"): the statement throws that type and the
// message names what broke. A test written this way fails when its rule is removed.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#define EXPECT_ERROR(statement, exception_type, substring)                          \
  do {                                                                              \
    bool pagedattn_thrown_ = false;                                                 \
    try {                                                                           \
      statement;                                                                    \
    } catch (const exception_type& e) {                                             \
      pagedattn_thrown_ = true;                                                     \
      EXPECT_THAT(std::string(e.what()), ::testing::HasSubstr(substring));          \
    }                                                                               \
    EXPECT_TRUE(pagedattn_thrown_) << #statement " did not throw " #exception_type; \
  } while (0)

namespace pagedattn::testing {

/// The message of the exception of type E that f() throws (a test failure if it throws none).
template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return {};
}

inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace pagedattn::testing
