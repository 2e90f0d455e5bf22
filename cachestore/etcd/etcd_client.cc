#include "cachestore/etcd/etcd_client.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/file_util.h"
#include "common/server/tls_files.h"
#include "common/status_macros.h"

namespace kvrelay::etcd {
namespace {

absl::Status FromGrpc(const grpc::Status& s, const std::string& what, const std::string& endpoint) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat("etcd ", what, " at ", endpoint, ": ", s.error_message()));
}

bool EndpointDown(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s);
}

// A numeric IPv4 address goes straight to gRPC's ipv4 resolver: the DNS resolver waits between
// re-resolutions, which keeps a channel failing for seconds after etcd came back.
std::string ChannelTarget(const std::string& address) {
  const std::string host = address.substr(0, address.rfind(':'));
  in_addr unused;
  return inet_pton(AF_INET, host.c_str(), &unused) == 1 ? "ipv4:" + address : address;
}

// The transaction goes through only while `key`'s create revision is `revision` (0: absent).
void RequireCreateRevision(etcdserverpb::TxnRequest& txn, const std::string& key,
                           int64_t revision) {
  etcdserverpb::Compare* c = txn.add_compare();
  c->set_key(key);
  c->set_target(etcdserverpb::Compare::CREATE);
  c->set_result(etcdserverpb::Compare::EQUAL);
  c->set_create_revision(revision);
}

KeyValue FromProto(const mvccpb::KeyValue& kv) {
  KeyValue out;
  out.key = kv.key();
  out.value = kv.value();
  out.create_revision = kv.create_revision();
  out.mod_revision = kv.mod_revision();
  out.lease = kv.lease();
  return out;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ParseEndpoints(const std::string& text) {
  std::vector<std::string> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    absl::string_view e = absl::StripAsciiWhitespace(part);
    if (!absl::ConsumePrefix(&e, "http://")) absl::ConsumePrefix(&e, "https://");
    const size_t colon = e.rfind(':');
    int port = 0;
    if (colon == absl::string_view::npos || colon == 0 ||
        !absl::SimpleAtoi(e.substr(colon + 1), &port) || port < 1 || port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("etcd endpoint: want host:port, got '", part, "'"));
    }
    out.emplace_back(e);
  }
  if (out.empty()) return absl::InvalidArgumentError("etcd endpoints: none given");
  return out;
}

EtcdClient::EtcdClient(EtcdOptions options) : options_(std::move(options)) {}

namespace {

// Plain text, or mutual TLS from `options`' files once they verify.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> EtcdCredentials(
    const EtcdOptions& options) {
  if (!options.tls()) return grpc::InsecureChannelCredentials();
  if (options.ca_file.empty() || options.cert_file.empty() || options.key_file.empty()) {
    return absl::InvalidArgumentError(
        "etcd TLS needs all of --etcd-ca, --etcd-cert and --etcd-key (or none: plain text)");
  }
  KV_RETURN_IF_ERROR(server::VerifyTlsFiles(
      {.cert_file = options.cert_file, .key_file = options.key_file, .ca_file = options.ca_file},
      "etcd TLS"));
  grpc::SslCredentialsOptions ssl;
  KV_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFileToString(options.ca_file));
  KV_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadFileToString(options.cert_file));
  KV_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadFileToString(options.key_file));
  return grpc::SslCredentials(ssl);
}

}  // namespace

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Create(EtcdOptions options) {
  if (options.endpoints.empty()) return absl::InvalidArgumentError("etcd: no endpoints");
  if (options.rpc_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("etcd: rpc_timeout must be positive");
  }
  KV_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                      EtcdCredentials(options));
  auto client = std::unique_ptr<EtcdClient>(new EtcdClient(options));
  client->credentials_ = std::move(credentials);
  for (const std::string& address : options.endpoints) {
    auto e = std::make_unique<Endpoint>();
    e->address = address;
    absl::MutexLock lock(&e->mu);
    e->stubs = client->Connect(address);
    e->connected_at = absl::Now();
    client->endpoints_.push_back(std::move(e));
  }
  return client;
}

std::shared_ptr<const EtcdClient::Stubs> EtcdClient::Connect(const std::string& address) const {
  grpc::ChannelArguments args;
  // etcd's certificate is checked against the host this client dials, whatever the target
  // scheme (a numeric address goes to the ipv4 resolver, see ChannelTarget).
  if (options_.tls()) args.SetSslTargetNameOverride(address.substr(0, address.rfind(':')));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 2000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // Its own connection: a fresh channel must not reuse a subchannel stuck in backoff.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(ChannelTarget(address), credentials_, args);
  auto stubs = std::make_shared<Stubs>();
  stubs->address = address;
  stubs->kv = etcdserverpb::KV::NewStub(channel);
  stubs->lease = etcdserverpb::Lease::NewStub(channel);
  stubs->watch = etcdserverpb::Watch::NewStub(channel);
  return stubs;
}

std::shared_ptr<const EtcdClient::Stubs> EtcdClient::StubsOf(size_t i) const {
  absl::MutexLock lock(&endpoints_[i]->mu);
  return endpoints_[i]->stubs;
}

void EtcdClient::Reconnect(size_t i) {
  constexpr absl::Duration kReconnectEvery = absl::Milliseconds(500);
  Endpoint& e = *endpoints_[i];
  absl::MutexLock lock(&e.mu);
  if (absl::Now() - e.connected_at < kReconnectEvery) return;
  e.stubs = Connect(e.address);
  e.connected_at = absl::Now();
}

const std::string& EtcdClient::endpoint() const {
  return endpoints_[current_.load() % endpoints_.size()]->address;
}

void EtcdClient::SetCallDeadline(grpc::ClientContext& ctx) const {
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
}

template <typename Call>
absl::Status EtcdClient::WithEndpoint(Call&& call) {
  absl::Status last;
  const size_t first = current_.load();
  for (size_t k = 0; k < endpoints_.size(); ++k) {
    const size_t i = (first + k) % endpoints_.size();
    const std::shared_ptr<const Stubs> stubs = StubsOf(i);
    last = call(*stubs);
    if (!EndpointDown(last)) {
      current_.store(i);
      return last;
    }
    if (absl::IsUnavailable(last)) Reconnect(i);
  }
  return last;
}

absl::StatusOr<int64_t> EtcdClient::GrantLease(absl::Duration ttl) {
  const int64_t seconds = absl::ToInt64Seconds(absl::Ceil(ttl, absl::Seconds(1)));
  if (seconds < 1) return absl::InvalidArgumentError("etcd lease: ttl must be >= 1s");
  int64_t id = 0;
  absl::Status s = WithEndpoint([&](const Stubs& e) {
    grpc::ClientContext ctx;
    SetCallDeadline(ctx);
    etcdserverpb::LeaseGrantRequest req;
    req.set_ttl(seconds);
    etcdserverpb::LeaseGrantResponse resp;
    absl::Status st = FromGrpc(e.lease->LeaseGrant(&ctx, req, &resp), "LeaseGrant", e.address);
    if (st.ok() && !resp.error().empty()) {
      st = absl::FailedPreconditionError(absl::StrCat("etcd LeaseGrant: ", resp.error()));
    }
    id = resp.id();
    return st;
  });
  if (!s.ok()) return s;
  return id;
}

absl::Status EtcdClient::RevokeLease(int64_t lease) {
  return WithEndpoint([&](const Stubs& e) {
    grpc::ClientContext ctx;
    SetCallDeadline(ctx);
    etcdserverpb::LeaseRevokeRequest req;
    req.set_id(lease);
    etcdserverpb::LeaseRevokeResponse resp;
    return FromGrpc(e.lease->LeaseRevoke(&ctx, req, &resp), "LeaseRevoke", e.address);
  });
}

absl::StatusOr<absl::Duration> EtcdClient::KeepAlive(int64_t lease) {
  int64_t ttl = 0;
  absl::Status s = WithEndpoint([&](const Stubs& e) {
    grpc::ClientContext ctx;
    SetCallDeadline(ctx);
    auto stream = e.lease->LeaseKeepAlive(&ctx);
    etcdserverpb::LeaseKeepAliveRequest req;
    req.set_id(lease);
    etcdserverpb::LeaseKeepAliveResponse resp;
    if (!stream->Write(req) || !stream->Read(&resp)) {
      stream->WritesDone();
      absl::Status st = FromGrpc(stream->Finish(), "LeaseKeepAlive", e.address);
      return st.ok() ? absl::UnavailableError(
                           absl::StrCat("etcd LeaseKeepAlive at ", e.address, ": stream ended"))
                     : st;
    }
    stream->WritesDone();
    ctx.TryCancel();  // one round trip is all we want from the stream
    stream->Finish();
    ttl = resp.ttl();
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  // etcd answers TTL <= 0 for a lease that has expired or never existed.
  if (ttl <= 0) return absl::NotFoundError(absl::StrCat("etcd lease ", lease, " has expired"));
  return absl::Seconds(ttl);
}

absl::StatusOr<std::optional<KeyValue>> EtcdClient::Get(const std::string& key) {
  std::optional<KeyValue> out;
  absl::Status s = WithEndpoint([&](const Stubs& e) {
    grpc::ClientContext ctx;
    SetCallDeadline(ctx);
    etcdserverpb::RangeRequest req;
    req.set_key(key);
    etcdserverpb::RangeResponse resp;
    absl::Status st = FromGrpc(e.kv->Range(&ctx, req, &resp), "Range", e.address);
    out.reset();
    if (st.ok() && resp.kvs_size() > 0) out = FromProto(resp.kvs(0));
    return st;
  });
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<EtcdClient::CreateResult> EtcdClient::CreateIfAbsent(const std::string& key,
                                                                    const std::string& value,
                                                                    int64_t lease) {
  CreateResult result;
  absl::Status s = WithEndpoint([&](const Stubs& e) {
    grpc::ClientContext ctx;
    SetCallDeadline(ctx);
    etcdserverpb::TxnRequest txn;
    RequireCreateRevision(txn, key, 0);
    etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
    put->set_key(key);
    put->set_value(value);
    put->set_lease(lease);
    txn.add_failure()->mutable_request_range()->set_key(key);
    etcdserverpb::TxnResponse resp;
    absl::Status st = FromGrpc(e.kv->Txn(&ctx, txn, &resp), "Txn", e.address);
    if (!st.ok()) return st;
    result.created = resp.succeeded();
    if (result.created) {
      // The new key's create revision is the revision of this transaction.
      result.kv.key = key;
      result.kv.value = value;
      result.kv.create_revision = resp.header().revision();
      result.kv.mod_revision = resp.header().revision();
      result.kv.lease = lease;
    } else if (resp.responses_size() > 0 && resp.responses(0).response_range().kvs_size() > 0) {
      result.kv = FromProto(resp.responses(0).response_range().kvs(0));
    }
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  return result;
}

absl::StatusOr<bool> EtcdClient::DeleteIfCreatedAt(const std::string& key,
                                                   int64_t create_revision) {
  bool deleted = false;
  absl::Status s = WithEndpoint([&](const Stubs& e) {
    grpc::ClientContext ctx;
    SetCallDeadline(ctx);
    etcdserverpb::TxnRequest txn;
    RequireCreateRevision(txn, key, create_revision);
    txn.add_success()->mutable_request_delete_range()->set_key(key);
    etcdserverpb::TxnResponse resp;
    absl::Status st = FromGrpc(e.kv->Txn(&ctx, txn, &resp), "Txn", e.address);
    deleted = st.ok() && resp.succeeded();
    return st;
  });
  if (!s.ok()) return s;
  return deleted;
}

absl::StatusOr<bool> EtcdClient::PutIfGuardCreatedAt(const std::string& guard_key,
                                                     int64_t guard_revision, const std::string& key,
                                                     const std::string& value) {
  bool written = false;
  absl::Status s = WithEndpoint([&](const Stubs& e) {
    grpc::ClientContext ctx;
    SetCallDeadline(ctx);
    etcdserverpb::TxnRequest txn;
    RequireCreateRevision(txn, guard_key, guard_revision);
    etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
    put->set_key(key);
    put->set_value(value);
    etcdserverpb::TxnResponse resp;
    absl::Status st = FromGrpc(e.kv->Txn(&ctx, txn, &resp), "Txn", e.address);
    written = st.ok() && resp.succeeded();
    return st;
  });
  if (!s.ok()) return s;
  return written;
}

absl::StatusOr<bool> EtcdClient::WaitForChange(const std::string& key, int64_t after_revision,
                                               absl::Time deadline) {
  const size_t index = current_.load() % endpoints_.size();
  const std::shared_ptr<const Stubs> stubs = StubsOf(index);
  const Stubs& e = *stubs;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  auto stream = e.watch->Watch(&ctx);
  etcdserverpb::WatchRequest req;
  etcdserverpb::WatchCreateRequest* create = req.mutable_create_request();
  create->set_key(key);  // no range_end: this one key
  create->set_start_revision(after_revision + 1);
  if (!stream->Write(req)) {
    absl::Status st = FromGrpc(stream->Finish(), "Watch", e.address);
    if (absl::Now() >= deadline) return false;
    Reconnect(index);
    return st.ok() ? absl::UnavailableError("etcd Watch: stream closed") : st;
  }
  etcdserverpb::WatchResponse resp;
  while (stream->Read(&resp)) {
    if (resp.canceled()) {
      // A compacted start revision: the key changed, whatever it was.
      ctx.TryCancel();
      stream->Finish();
      return true;
    }
    if (resp.events_size() > 0) {
      ctx.TryCancel();
      stream->Finish();
      return true;
    }
  }
  const grpc::Status st = stream->Finish();
  if (absl::Now() >= deadline || st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return false;
  }
  Reconnect(index);
  return FromGrpc(st, "Watch", e.address);
}

}  // namespace kvrelay::etcd
