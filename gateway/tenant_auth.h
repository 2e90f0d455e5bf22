#pragma once

// Who the tenant of a request is. Never the request's `tenant` field alone: with TLS on, the
// tenant is the id of a client certificate (spiffe://kvrelay/client/<tenant>) or the subject of
// a bearer token the gateway verifies; a request that names another tenant is refused. Only in
// --insecure mode is the request field taken as it is.
//
// Bearer tokens are JWTs (RFC 7519) signed with HS256 (HMAC-SHA256) by one of the keys in
// --tenant-token-keys: header {"alg":"HS256","typ":"JWT"}, claims {"sub": tenant, "exp": unix
// seconds} (both required; "nbf" honoured when present). JWT rather than a home-grown format so
// an identity provider or any JWT library can mint them; several keys so keys rotate without
// downtime. `kvrelay token` mints one.
//
// Thread-safe; immutable after construction.

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/server/auth.h"

namespace kvrelay::gateway {

class TenantTokenVerifier {
 public:
  // REQUIRES: every key non-empty.
  explicit TenantTokenVerifier(std::vector<std::string> keys) : keys_(std::move(keys)) {}
  // One key per non-empty line (surrounding whitespace ignored); InvalidArgument when the file
  // holds none or a key is shorter than 16 bytes.
  static absl::StatusOr<TenantTokenVerifier> FromKeyFile(const std::string& path);

  // The tenant the token names: UNAUTHENTICATED when it is malformed, signed by no configured
  // key, not yet valid or expired.
  absl::StatusOr<std::string> Verify(absl::string_view token, absl::Time now) const;

  // A token for `tenant` valid until `expiry`, signed with the first configured key.
  std::string SignWithFirstKey(absl::string_view tenant, absl::Time expiry) const {
    return Sign(keys_.front(), tenant, expiry);
  }
  // A token for `tenant` valid until `expiry`, signed with `key`.
  static std::string Sign(absl::string_view key, absl::string_view tenant, absl::Time expiry);

 private:
  std::vector<std::string> keys_;
};

// The tenant a Generate runs as. `peer` is the authenticated caller (anonymous when the gateway
// is not enforcing, i.e. --insecure); `authorization` the "Authorization" header or gRPC
// metadata value ("" when absent); `requested` the request's tenant field; `verifier` may be
// null (no token keys configured). UNAUTHENTICATED without a credential that names a tenant,
// PERMISSION_DENIED when `requested` names another tenant than the credential.
absl::StatusOr<std::string> ResolveTenant(const ::kvrelay::server::Peer& peer, bool enforcing,
                                          absl::string_view authorization,
                                          absl::string_view requested,
                                          const TenantTokenVerifier* verifier, absl::Time now);

}  // namespace kvrelay::gateway
