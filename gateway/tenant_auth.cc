#include "gateway/tenant_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <atomic>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/file_util.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "proto/limits.h"

namespace kvrelay::gateway {
namespace {

constexpr size_t kMinKeyBytes = 16;
constexpr size_t kMaxTokenBytes = 4096;
constexpr absl::string_view kHeader = R"({"alg":"HS256","typ":"JWT"})";

std::string HmacSha256(absl::string_view key, absl::string_view data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(data.data()), data.size(), digest, &length);
  return std::string(reinterpret_cast<const char*>(digest), length);
}

absl::Status Unauthenticated(absl::string_view why) {
  return server::Unauthorized(absl::UnauthenticatedError(absl::StrCat("bearer token: ", why)));
}

bool ValidTenant(absl::string_view tenant) {
  if (tenant.empty() || tenant.size() > limits::kMaxTenantBytes) return false;
  for (char c : tenant) {
    const bool ok = absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' ||
                    c == ':' || c == '-';
    if (!ok) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<TenantTokenVerifier> TenantTokenVerifier::FromKeyFile(const std::string& path) {
  KV_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  std::vector<std::string> keys;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    if (line.size() < kMinKeyBytes) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": every key must be at least ",
                                                     kMinKeyBytes, " bytes, got ", line.size()));
    }
    keys.emplace_back(line);
  }
  if (keys.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no key in the file"));
  return TenantTokenVerifier(std::move(keys));
}

std::string TenantTokenVerifier::Sign(absl::string_view key, absl::string_view tenant,
                                      absl::Time expiry) {
  nlohmann::json claims = {{"sub", std::string(tenant)}, {"exp", absl::ToUnixSeconds(expiry)}};
  const std::string signing_input = absl::StrCat(absl::WebSafeBase64Escape(std::string(kHeader)),
                                                 ".", absl::WebSafeBase64Escape(claims.dump()));
  return absl::StrCat(signing_input, ".",
                      absl::WebSafeBase64Escape(HmacSha256(key, signing_input)));
}

absl::StatusOr<std::string> TenantTokenVerifier::Verify(absl::string_view token,
                                                        absl::Time now) const {
  if (token.size() > kMaxTokenBytes) {
    return Unauthenticated(absl::StrCat("at most ", kMaxTokenBytes, " bytes"));
  }
  std::vector<absl::string_view> parts = absl::StrSplit(token, '.');
  if (parts.size() != 3) return Unauthenticated("not a JWT (header.claims.signature)");
  std::string header_json, claims_json, signature;
  if (!absl::WebSafeBase64Unescape(parts[0], &header_json) ||
      !absl::WebSafeBase64Unescape(parts[1], &claims_json) ||
      !absl::WebSafeBase64Unescape(parts[2], &signature)) {
    return Unauthenticated("not base64url");
  }
  // The signature first: nothing of an unsigned token is trusted, not even its header.
  const std::string signing_input = absl::StrCat(parts[0], ".", parts[1]);
  bool signed_by_us = false;
  for (const std::string& key : keys_) {
    const std::string expected = HmacSha256(key, signing_input);
    if (expected.size() == signature.size() &&
        CRYPTO_memcmp(expected.data(), signature.data(), expected.size()) == 0) {
      signed_by_us = true;
    }
  }
  if (!signed_by_us) return Unauthenticated("signature does not verify with any configured key");
  nlohmann::json header = nlohmann::json::parse(header_json, nullptr, /*allow_exceptions=*/false);
  if (!header.is_object() || !header.contains("alg") || header["alg"] != "HS256") {
    return Unauthenticated("header alg must be HS256");
  }
  nlohmann::json claims = nlohmann::json::parse(claims_json, nullptr, /*allow_exceptions=*/false);
  if (!claims.is_object()) return Unauthenticated("claims are not a JSON object");
  if (!claims.contains("exp") || !claims["exp"].is_number()) {
    return Unauthenticated("claim exp (expiry, unix seconds) is required");
  }
  const int64_t now_s = absl::ToUnixSeconds(now);
  if (claims["exp"].get<double>() <= static_cast<double>(now_s)) {
    return Unauthenticated("expired");
  }
  if (claims.contains("nbf") &&
      (!claims["nbf"].is_number() || claims["nbf"].get<double>() > static_cast<double>(now_s))) {
    return Unauthenticated("not valid yet (nbf)");
  }
  if (!claims.contains("sub") || !claims["sub"].is_string() ||
      !ValidTenant(claims["sub"].get<std::string>())) {
    return Unauthenticated(absl::StrCat("claim sub (the tenant) must be 1-",
                                        limits::kMaxTenantBytes, " bytes of [A-Za-z0-9._:-]"));
  }
  return claims["sub"].get<std::string>();
}

absl::StatusOr<std::string> ResolveTenant(const ::kvrelay::server::Peer& peer, bool enforcing,
                                          absl::string_view authorization,
                                          absl::string_view requested,
                                          const TenantTokenVerifier* verifier, absl::Time now) {
  std::string tenant;
  if (!authorization.empty()) {
    constexpr absl::string_view kBearer = "Bearer ";
    if (authorization.substr(0, kBearer.size()) != kBearer) {
      return Unauthenticated("the Authorization value must be 'Bearer <token>'");
    }
    if (verifier == nullptr) return Unauthenticated("this gateway has no --tenant-token-keys");
    KV_ASSIGN_OR_RETURN(tenant, verifier->Verify(authorization.substr(kBearer.size()), now));
  } else if (!enforcing) {
    static std::atomic<bool> logged{false};
    if (!logged.exchange(true)) {
      KV_LOG(WARNING) << "gateway: --insecure: tenants are taken from the request field, "
                         "unauthenticated";
    }
    return std::string(requested);
  } else if (peer.authenticated && peer.role == server::PeerRole::kClient) {
    tenant = peer.id;
  } else {
    return server::Unauthorized(absl::UnauthenticatedError(absl::StrCat(
        "no tenant credential: send 'authorization: Bearer <token>' or use a client "
        "certificate (spiffe://kvrelay/client/<tenant>); ",
        peer.authenticated ? absl::StrCat(server::RoleName(peer.role), " '", peer.id, "'")
                           : std::string("the caller"),
        " names no tenant")));
  }
  if (!requested.empty() && requested != tenant) {
    return server::Unauthorized(absl::PermissionDeniedError(absl::StrCat(
        "tenant '", requested, "' requested, but the credential is for tenant '", tenant, "'")));
  }
  return tenant;
}

}  // namespace kvrelay::gateway
