#pragma once

// Who is calling, and may they: component identities carried in mutual-TLS certificates and the
// one authorization table every kvrelay server checks, RPC by RPC.
//
// Identity. Every certificate our CA issues carries exactly one URI subject alternative name
//   spiffe://kvrelay/<role>/<id>
// with <role> one of gateway, prefill, decode, store, client, admin and <id> the node id (the
// components) or the tenant (role client). A SPIFFE URI SAN rather than a subject OU because
// (1) one field holds both role and id, so nothing has to be matched across several DN
// attributes; (2) gRPC itself parses URI SANs out of the verified peer certificate
// ("peer_uri" in grpc::AuthContext), so no second X.509 parser runs per call; (3) SPIFFE is the
// identity format service meshes and cert-manager already issue, so a cluster's own CA can mint
// these certificates without kvrelay-specific tooling.
//
// Authorization. AuthorizationTable() maps each RPC's full method name
// ("/kvrelay.v1.CacheStore/Allocate") to the roles allowed to call it and whether it is
// node-scoped (the request's node id must equal the certificate's id). A method absent from the
// table is refused (fail closed); a test checks that every method of every kvrelay service is in
// it. Who may call what, and why:
//   - workers (prefill, decode) register, heartbeat, announce, deregister, match with leases,
//     allocate, commit, abort and release leases, each only as themselves (node-scoped);
//   - gateways reserve, decode, release and prefill on behalf of clients, query prefixes
//     (routing) and list nodes (discovery);
//   - WatchEvents and Stats expose every tenant's block activity and the whole registry, so only
//     gateways (routers consume events) and admin certificates (operators) get them;
//   - Gateway/Generate is for clients (their tenant is in the certificate or a bearer token) and
//     admin; worker Status RPCs and Gateway/Status (`kvrelay status`: every node's load) for
//     gateways and admin.
// With --insecure nothing is checked (the caller is anonymous), so plain-text dev clusters and
// tests behave exactly as before.
//
// Thread-safe; Authorizer is immutable after construction.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/server/credentials.h"
#include "grpcpp/grpcpp.h"

namespace kvrelay::server {

enum class PeerRole : uint8_t { kGateway, kPrefill, kDecode, kStore, kClient, kAdmin };
inline constexpr int kNumPeerRoles = 6;

absl::string_view RoleName(PeerRole role);  // "gateway", "prefill", ...
std::optional<PeerRole> ParseRole(absl::string_view name);

inline constexpr absl::string_view kSpiffePrefix = "spiffe://kvrelay/";

struct Peer {
  // False in --insecure mode: nobody was authenticated and role/id mean nothing.
  bool authenticated = false;
  PeerRole role = PeerRole::kClient;
  std::string id;  // node id, or the tenant for PeerRole::kClient
};

// "spiffe://kvrelay/<role>/<id>".
std::string SpiffeUri(PeerRole role, absl::string_view id);
// The identity a SPIFFE URI names; InvalidArgument for anything else (other trust domains,
// unknown roles, ids that are empty, over 128 bytes or outside [A-Za-z0-9._:-]).
absl::StatusOr<Peer> ParseSpiffeUri(absl::string_view uri);
// The identity in a PEM certificate (its single kvrelay SPIFFE URI SAN). Used by a component to
// learn its own node id from --tls-cert.
absl::StatusOr<Peer> IdentityOfCertificatePem(absl::string_view pem);
absl::StatusOr<Peer> IdentityOfCertificateFile(const std::string& path);

// A set of roles.
class RoleSet {
 public:
  constexpr RoleSet() = default;
  constexpr RoleSet(std::initializer_list<PeerRole> roles) {
    for (PeerRole r : roles) bits_ |= Bit(r);
  }
  constexpr bool Contains(PeerRole r) const { return (bits_ & Bit(r)) != 0; }
  std::string ToString() const;  // "gateway|admin"

 private:
  static constexpr uint32_t Bit(PeerRole r) { return 1u << static_cast<int>(r); }
  uint32_t bits_ = 0;
};

struct MethodRule {
  absl::string_view method;  // "/kvrelay.v1.CacheStore/Allocate"
  RoleSet roles;
  // The request names a node (node_id) and only that node's own certificate may send it.
  bool node_scoped = false;
};

// Every kvrelay RPC, once.
const std::vector<MethodRule>& AuthorizationTable();
// The rule for `method`, or nullptr when it has none.
const MethodRule* FindRule(absl::string_view method);

class Authorizer {
 public:
  // Checks nothing: every caller is an anonymous Peer (--insecure, in-process tests).
  Authorizer() = default;
  // Checks when `security` is TLS.
  explicit Authorizer(const SecurityOptions& security) : enforce_(!security.insecure) {}

  bool enforcing() const { return enforce_; }

  // The caller of `method`, when it may call it: UNAUTHENTICATED without a kvrelay
  // certificate, PERMISSION_DENIED (with ErrorInfo{role CLIENT, FAILURE_UNAUTHORIZED}) when its
  // role is not allowed or, for node-scoped methods, `request_node_id` is not its own id.
  absl::StatusOr<Peer> Authorize(const grpc::ServerContextBase& context, absl::string_view method,
                                 absl::string_view request_node_id = {}) const;

  // The authenticated identity of the caller, without any table check (anonymous when not
  // enforcing).
  absl::StatusOr<Peer> Identify(const grpc::ServerContextBase& context) const;

 private:
  bool enforce_ = false;
};

// Attaches ErrorInfo{role CLIENT, reason FAILURE_UNAUTHORIZED} to a denial, so callers (the
// gateway's failover) never blame the worker that refused.
absl::Status Unauthorized(absl::Status status);

}  // namespace kvrelay::server
