#pragma once

// IsOk() / StatusIs(code[, message_matcher]) for absl::Status and absl::StatusOr<T>, until
// Abseil >= 20240722 ships its own.

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvrelay::testing {
namespace internal {

inline const absl::Status& GetStatus(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

}  // namespace internal

MATCHER(IsOk, "is OK") {
  const absl::Status& status = internal::GetStatus(arg);
  if (!status.ok()) *result_listener << "status is " << status;
  return status.ok();
}

MATCHER_P(StatusIs, code, "has status code " + ::testing::PrintToString(code)) {
  const absl::Status& status = internal::GetStatus(arg);
  *result_listener << "status is " << status;
  return status.code() == code;
}

MATCHER_P2(StatusIs, code, message_matcher,
           "has status code " + ::testing::PrintToString(code) + " and a matching message") {
  const absl::Status& status = internal::GetStatus(arg);
  *result_listener << "status is " << status;
  return status.code() == code &&
         ::testing::ExplainMatchResult(message_matcher, std::string(status.message()),
                                       result_listener);
}

// A StatusOr that is OK and whose value matches `value_matcher`.
MATCHER_P(IsOkAndHolds, value_matcher, "is OK and holds a matching value") {
  if (!arg.ok()) {
    *result_listener << "status is " << arg.status();
    return false;
  }
  return ::testing::ExplainMatchResult(value_matcher, *arg, result_listener);
}

}  // namespace kvrelay::testing

#define KV_ASSERT_OK(expr) ASSERT_THAT(expr, ::kvrelay::testing::IsOk())
#define KV_EXPECT_OK(expr) EXPECT_THAT(expr, ::kvrelay::testing::IsOk())
#define KV_ASSERT_OK_AND_ASSIGN(lhs, expr) \
  KV_ASSERT_OK_AND_ASSIGN_IMPL_(KV_STATUS_CONCAT_(kv_test_statusor_, __LINE__), lhs, expr)
#define KV_ASSERT_OK_AND_ASSIGN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                  \
  ASSERT_TRUE(statusor.ok()) << statusor.status();         \
  lhs = std::move(statusor).value()

#ifndef KV_STATUS_CONCAT_
#define KV_STATUS_CONCAT_INNER_(a, b) a##b
#define KV_STATUS_CONCAT_(a, b) KV_STATUS_CONCAT_INNER_(a, b)
#endif
