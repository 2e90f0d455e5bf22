#pragma once

// KV_RETURN_IF_ERROR / KV_ASSIGN_OR_RETURN: the macros newer Abseil ships, absent in 20220623.

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KV_STATUS_CONCAT_INNER_(a, b) a##b
#define KV_STATUS_CONCAT_(a, b) KV_STATUS_CONCAT_INNER_(a, b)

#define KV_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::absl::Status kv_status_ = (expr);      \
    if (!kv_status_.ok()) return kv_status_; \
  } while (false)

#define KV_ASSIGN_OR_RETURN(lhs, expr) \
  KV_ASSIGN_OR_RETURN_IMPL_(KV_STATUS_CONCAT_(kv_statusor_, __LINE__), lhs, expr)

#define KV_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr)     \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()
