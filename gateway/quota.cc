#include "gateway/quota.h"

#include "absl/strings/str_cat.h"
#include "proto/grpc_status.h"

namespace kvrelay::gateway {

QuotaTable::QuotaTable(std::string kind, std::string holding, std::string flag, int32_t limit,
                       Counter* refusals)
    : kind_(std::move(kind)),
      holding_(std::move(holding)),
      flag_(std::move(flag)),
      limit_(limit),
      refusals_(refusals) {}

QuotaTable::Lease& QuotaTable::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Return();
    table_ = other.table_;
    key_ = std::move(other.key_);
    other.table_ = nullptr;
  }
  return *this;
}

void QuotaTable::Lease::Return() {
  if (table_ != nullptr) table_->Give(key_);
  table_ = nullptr;
}

absl::StatusOr<QuotaTable::Lease> QuotaTable::Take(const std::string& key) {
  if (limit_ <= 0 || key.empty()) return Lease();
  std::lock_guard<std::mutex> lock(mu_);
  int32_t& held = held_[key];
  if (held >= limit_) {
    if (refusals_ != nullptr) refusals_->Increment();
    return proto::Attribute(
        absl::ResourceExhaustedError(absl::StrCat(kind_, " '", key, "' already has ", held, " ",
                                                  holding_, " (quota ", flag_, " ", limit_, ")")),
        kvrelay::v1::ROLE_CLIENT, "", kvrelay::v1::FAILURE_OVERLOADED);
  }
  ++held;
  return Lease(this, key);
}

int32_t QuotaTable::Held(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(key);
  return it == held_.end() ? 0 : it->second;
}

void QuotaTable::Give(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(key);
  if (it != held_.end() && --it->second <= 0) held_.erase(it);
}

}  // namespace kvrelay::gateway
