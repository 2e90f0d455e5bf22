#include "common/server/auth.h"

#include <openssl/bio.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <memory>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "proto/grpc_status.h"

namespace kvrelay::server {
namespace {

constexpr absl::string_view kRoleNames[kNumPeerRoles] = {"gateway", "prefill", "decode",
                                                         "store",   "client",  "admin"};
constexpr size_t kMaxIdBytes = 128;

bool IsIdChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == ':' || c == '-';
}

constexpr RoleSet kWorkers = {PeerRole::kPrefill, PeerRole::kDecode};
constexpr RoleSet kGateways = {PeerRole::kGateway};
constexpr RoleSet kObservers = {PeerRole::kGateway, PeerRole::kAdmin};

}  // namespace

absl::string_view RoleName(PeerRole role) { return kRoleNames[static_cast<int>(role)]; }

std::optional<PeerRole> ParseRole(absl::string_view name) {
  for (int i = 0; i < kNumPeerRoles; ++i) {
    if (kRoleNames[i] == name) return static_cast<PeerRole>(i);
  }
  return std::nullopt;
}

std::string RoleSet::ToString() const {
  std::vector<absl::string_view> names;
  for (int i = 0; i < kNumPeerRoles; ++i) {
    if (Contains(static_cast<PeerRole>(i))) names.push_back(kRoleNames[i]);
  }
  return names.empty() ? "nobody" : absl::StrJoin(names, "|");
}

std::string SpiffeUri(PeerRole role, absl::string_view id) {
  return absl::StrCat(kSpiffePrefix, RoleName(role), "/", id);
}

absl::StatusOr<Peer> ParseSpiffeUri(absl::string_view uri) {
  if (uri.substr(0, kSpiffePrefix.size()) != kSpiffePrefix) {
    return absl::InvalidArgumentError(
        absl::StrCat("identity URI must start with ", kSpiffePrefix, ", got '", uri, "'"));
  }
  absl::string_view rest = uri.substr(kSpiffePrefix.size());
  const size_t slash = rest.find('/');
  if (slash == absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("identity URI must be ", kSpiffePrefix, "<role>/<id>, got '", uri, "'"));
  }
  std::optional<PeerRole> role = ParseRole(rest.substr(0, slash));
  if (!role.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("identity URI '", uri, "': unknown role '", rest.substr(0, slash), "'"));
  }
  absl::string_view id = rest.substr(slash + 1);
  if (id.empty() || id.size() > kMaxIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("identity URI '", uri, "': id must be 1-", kMaxIdBytes, " bytes"));
  }
  for (char c : id) {
    if (!IsIdChar(c)) {
      return absl::InvalidArgumentError(
          absl::StrCat("identity URI '", uri, "': id allows only [A-Za-z0-9._:-]"));
    }
  }
  return Peer{.authenticated = true, .role = *role, .id = std::string(id)};
}

absl::StatusOr<Peer> IdentityOfCertificatePem(absl::string_view pem) {
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(
      BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), &BIO_free);
  if (bio == nullptr) return absl::ResourceExhaustedError("BIO_new_mem_buf failed");
  std::unique_ptr<X509, decltype(&X509_free)> cert(
      PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr), &X509_free);
  if (cert == nullptr) return absl::InvalidArgumentError("not a PEM X.509 certificate");
  using Names = STACK_OF(GENERAL_NAME);
  std::unique_ptr<Names, void (*)(Names*)> names(
      static_cast<Names*>(X509_get_ext_d2i(cert.get(), NID_subject_alt_name, nullptr, nullptr)),
      [](Names* n) { GENERAL_NAMES_free(n); });
  std::optional<Peer> found;
  for (int i = 0; names != nullptr && i < sk_GENERAL_NAME_num(names.get()); ++i) {
    const GENERAL_NAME* name = sk_GENERAL_NAME_value(names.get(), i);
    if (name->type != GEN_URI) continue;
    const ASN1_STRING* value = name->d.uniformResourceIdentifier;
    absl::string_view uri(reinterpret_cast<const char*>(ASN1_STRING_get0_data(value)),
                          static_cast<size_t>(ASN1_STRING_length(value)));
    if (uri.substr(0, kSpiffePrefix.size()) != kSpiffePrefix) continue;
    if (found.has_value()) {
      return absl::InvalidArgumentError("certificate carries more than one kvrelay identity URI");
    }
    KV_ASSIGN_OR_RETURN(found, ParseSpiffeUri(uri));
  }
  if (!found.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("certificate carries no ", kSpiffePrefix,
                                                   "<role>/<id> URI subject alternative name"));
  }
  return *found;
}

absl::StatusOr<Peer> IdentityOfCertificateFile(const std::string& path) {
  KV_ASSIGN_OR_RETURN(std::string pem, ReadFileToString(path));
  absl::StatusOr<Peer> peer = IdentityOfCertificatePem(pem);
  if (!peer.ok()) {
    return absl::Status(peer.status().code(), absl::StrCat(path, ": ", peer.status().message()));
  }
  return peer;
}

const std::vector<MethodRule>& AuthorizationTable() {
  static const std::vector<MethodRule>* const table = new std::vector<MethodRule>{
      // Cache store: the node registry and block writes belong to each worker itself.
      {"/kvrelay.v1.CacheStore/RegisterNode", kWorkers, true},
      {"/kvrelay.v1.CacheStore/DeregisterNode", kWorkers, true},
      {"/kvrelay.v1.CacheStore/Heartbeat", kWorkers, true},
      {"/kvrelay.v1.CacheStore/AnnounceBlocks", kWorkers, true},
      {"/kvrelay.v1.CacheStore/MatchPrefix", kWorkers, true},
      // The same lookups on one stream: the role when it opens, the node id per lookup.
      {"/kvrelay.v1.CacheStore/MatchPrefixStream", kWorkers, true},
      {"/kvrelay.v1.CacheStore/Allocate", kWorkers, true},
      {"/kvrelay.v1.CacheStore/Commit", kWorkers, true},
      {"/kvrelay.v1.CacheStore/Abort", kWorkers, true},
      {"/kvrelay.v1.CacheStore/ReleaseLease", kWorkers, true},
      // Routing and discovery: gateways (and operators).
      {"/kvrelay.v1.CacheStore/QueryPrefix", kGateways, false},
      {"/kvrelay.v1.CacheStore/ListNodes", kObservers, false},
      // Every tenant's activity: routers and operators only.
      {"/kvrelay.v1.CacheStore/Stats", kObservers, false},
      {"/kvrelay.v1.CacheStore/WatchEvents", kObservers, false},
      // The leader's log, for standby store instances only (issue 20).
      {"/kvrelay.v1.CacheStoreReplication/Follow", {PeerRole::kStore}, false},
      // Workers act only for a gateway.
      {"/kvrelay.v1.Prefill/Prefill", kGateways, false},
      {"/kvrelay.v1.Prefill/Status", kObservers, false},
      {"/kvrelay.v1.Prefill/Promote", kGateways, false},
      {"/kvrelay.v1.Decode/Reserve", kGateways, false},
      {"/kvrelay.v1.Decode/Generate", kGateways, false},
      {"/kvrelay.v1.Decode/Release", kGateways, false},
      {"/kvrelay.v1.Decode/Status", kObservers, false},
      {"/kvrelay.v1.Decode/Promote", kGateways, false},
      // The front door: tenants (certificate or bearer token) and operators.
      {"/kvrelay.v1.Gateway/Generate", {PeerRole::kClient, PeerRole::kAdmin}, false},
      // The cluster's state (`kvrelay status`): every tenant's load, so operators only.
      {"/kvrelay.v1.Gateway/Status", kObservers, false},
  };
  return *table;
}

const MethodRule* FindRule(absl::string_view method) {
  static const auto* const index = [] {
    auto* map = new absl::flat_hash_map<absl::string_view, const MethodRule*>();
    for (const MethodRule& rule : AuthorizationTable()) (*map)[rule.method] = &rule;
    return map;
  }();
  auto it = index->find(method);
  return it == index->end() ? nullptr : it->second;
}

absl::Status Unauthorized(absl::Status status) {
  return proto::Attribute(std::move(status), kvrelay::v1::ROLE_CLIENT, "",
                          kvrelay::v1::FAILURE_UNAUTHORIZED);
}

absl::StatusOr<Peer> Authorizer::Identify(const grpc::ServerContextBase& context) const {
  if (!enforce_) return Peer{};
  std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) {
    return Unauthorized(absl::UnauthenticatedError("a kvrelay client certificate is required"));
  }
  // gRPC parsed the verified certificate's URI SANs at the handshake.
  std::optional<Peer> found;
  for (const grpc::string_ref& value : auth->FindPropertyValues(GRPC_PEER_URI_PROPERTY_NAME)) {
    absl::string_view uri(value.data(), value.size());
    if (uri.substr(0, kSpiffePrefix.size()) != kSpiffePrefix) continue;
    absl::StatusOr<Peer> peer = ParseSpiffeUri(uri);
    if (!peer.ok() || found.has_value()) {
      return Unauthorized(absl::UnauthenticatedError(
          peer.ok() ? "certificate carries more than one kvrelay identity"
                    : std::string(peer.status().message())));
    }
    found = *std::move(peer);
  }
  if (!found.has_value()) {
    return Unauthorized(absl::UnauthenticatedError(
        absl::StrCat("certificate carries no ", kSpiffePrefix, "<role>/<id> identity (URI SAN)")));
  }
  return *found;
}

absl::StatusOr<Peer> Authorizer::Authorize(const grpc::ServerContextBase& context,
                                           absl::string_view method,
                                           absl::string_view request_node_id) const {
  if (!enforce_) return Peer{};
  KV_ASSIGN_OR_RETURN(Peer peer, Identify(context));
  const MethodRule* rule = FindRule(method);
  if (rule == nullptr) {
    return Unauthorized(
        absl::PermissionDeniedError(absl::StrCat(method, " is not in the authorization table")));
  }
  if (!rule->roles.Contains(peer.role)) {
    return Unauthorized(absl::PermissionDeniedError(
        absl::StrCat(method, " is for ", rule->roles.ToString(), ", not ", RoleName(peer.role),
                     " '", peer.id, "'")));
  }
  if (rule->node_scoped && request_node_id != peer.id) {
    return Unauthorized(absl::PermissionDeniedError(
        absl::StrCat(method, ": ", RoleName(peer.role), " '", peer.id,
                     "' may act only as itself, the request names node '", request_node_id, "'")));
  }
  return peer;
}

}  // namespace kvrelay::server
