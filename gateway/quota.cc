#include "gateway/quota.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/grpc_status.h"

namespace kvrelay::gateway {

QuotaTable::QuotaTable(std::string kind, std::string unit, std::string flag, int64_t limit,
                       Counter* refusals)
    : kind_(std::move(kind)),
      unit_(std::move(unit)),
      flag_(std::move(flag)),
      limit_(limit),
      refusals_(refusals) {}

QuotaTable::Lease& QuotaTable::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Return();
    table_ = other.table_;
    key_ = std::move(other.key_);
    units_ = other.units_;
    other.table_ = nullptr;
  }
  return *this;
}

void QuotaTable::Lease::Return() {
  if (table_ != nullptr) table_->Give(key_, units_);
  table_ = nullptr;
}

absl::StatusOr<QuotaTable::Lease> QuotaTable::Take(const std::string& key, int64_t units) {
  if (limit_ <= 0 || key.empty()) return Lease();
  units = std::max<int64_t>(units, 1);
  absl::MutexLock lock(&mu_);
  int64_t& held = held_[key];
  if (held + units > limit_) {
    const int64_t had = held;
    if (held == 0) held_.erase(key);
    if (refusals_ != nullptr) refusals_->Increment();
    return proto::Attribute(
        absl::ResourceExhaustedError(absl::StrCat(
            kind_, " '", key, "' already has ", had, " ", unit_,
            units > 1 ? absl::StrCat(" and this request needs ", units) : std::string(), " (quota ",
            flag_, " ", limit_, ")")),
        kvrelay::v1::ROLE_CLIENT, "", kvrelay::v1::FAILURE_OVERLOADED);
  }
  held += units;
  return Lease(this, key, units);
}

int64_t QuotaTable::Held(const std::string& key) const {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(key);
  return it == held_.end() ? 0 : it->second;
}

void QuotaTable::Give(const std::string& key, int64_t units) {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(key);
  if (it != held_.end() && (it->second -= units) <= 0) held_.erase(it);
}

}  // namespace kvrelay::gateway
