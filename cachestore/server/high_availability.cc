#include "cachestore/server/high_availability.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "cachestore/wal.h"
#include "common/heap.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "proto/grpc_status.h"

namespace kvrelay::cachestore::server {

namespace {

using ::kvrelay::proto::FromGrpcStatus;
using ::kvrelay::proto::ToGrpcStatus;

constexpr size_t kOpsPerBatch = 2048;
// An empty batch at least this often: a follower learns the leader's log end and that the
// stream is alive.
constexpr absl::Duration kHeartbeatEvery = absl::Milliseconds(100);

}  // namespace

absl::StatusOr<std::unique_ptr<HighAvailability>> HighAvailability::Create(CacheStore* store,
                                                                           HaOptions options) {
  if (options.etcd_endpoints.empty()) {
    return absl::InvalidArgumentError("etcd: at least one endpoint needed");
  }
  KV_ASSIGN_OR_RETURN(std::unique_ptr<etcd::EtcdClient> etcd,
                      etcd::EtcdClient::Create({.endpoints = options.etcd_endpoints,
                                                .rpc_timeout = options.etcd_timeout,
                                                .ca_file = options.etcd_ca_file,
                                                .cert_file = options.etcd_cert_file,
                                                .key_file = options.etcd_key_file}));
  store->EnableReplicationLog();
  return std::unique_ptr<HighAvailability>(
      new HighAvailability(store, std::move(options), std::move(etcd)));
}

HighAvailability::HighAvailability(CacheStore* store, HaOptions options,
                                   std::unique_ptr<etcd::EtcdClient> etcd)
    : store_(store), options_(std::move(options)), etcd_(std::move(etcd)) {}

HighAvailability::~HighAvailability() { Stop(); }

void HighAvailability::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  {
    absl::MutexLock lock(&follow_mu_);
    if (follow_ctx_ != nullptr) follow_ctx_->TryCancel();
  }
  if (thread_.joinable()) thread_.join();
  serving_term_.store(0, std::memory_order_release);
  if (election_ != nullptr) election_->Resign();  // a standby takes over at once
}

absl::Status HighAvailability::Start(const std::string& advertise_address) {
  if (!advertise_address.empty()) options_.advertise_address = advertise_address;
  if (options_.advertise_address.empty()) {
    return absl::InvalidArgumentError("advertise-address: must not be empty with --etcd");
  }
  etcd::ElectionOptions election;
  election.key = options_.election_key;
  election.value = options_.advertise_address;
  election.ttl = options_.lease_ttl;
  KV_ASSIGN_OR_RETURN(election_,
                      etcd::LeaderElection::Start(
                          etcd_.get(), election,
                          [this](const etcd::LeaderElection::State& s) { OnElectionChange(s); }));
  thread_ = std::thread([this] { Run(); });
  return absl::OkStatus();
}

etcd::LeaderElection::State HighAvailability::election_state() const {
  if (election_ == nullptr) return {};
  return election_->state();
}

absl::StatusOr<int64_t> HighAvailability::LeaderTerm() const {
  if (election_ == nullptr) return NotLeaderError("cache store: starting", "");
  if (stop_.HasBeenNotified()) return NotLeaderError("cache store: shutting down", "");
  const etcd::LeaderElection::State s = election_->state();
  const int64_t serving = serving_term_.load(std::memory_order_acquire);
  if (s.leader && s.term == serving) return s.term;
  if (s.leader) {
    return NotLeaderError(absl::StrCat("cache store: taking over as leader (term ", s.term, ")"),
                          "");
  }
  // Our own address is stale after we lost the lease: nobody known leads then.
  const std::string leader =
      s.leader_value == options_.advertise_address ? std::string() : s.leader_value;
  return NotLeaderError(
      absl::StrCat("cache store ", options_.advertise_address, " does not lead; the leader is ",
                   leader.empty() ? "being elected" : leader),
      leader);
}

void HighAvailability::OnElectionChange(const etcd::LeaderElection::State& state) {
  // Runs on the election thread: only wake the role thread, which does the work.
  KV_LOG(INFO) << "cachestore: election: " << (state.leader ? "leading" : "not leading") << " term "
               << (state.leader ? state.term : state.leader_term) << " leader '"
               << state.leader_value << "'";
  absl::MutexLock lock(&follow_mu_);
  if (follow_ctx_ != nullptr) follow_ctx_->TryCancel();
}

void HighAvailability::Run() {
  absl::Time last_warning = absl::InfinitePast();
  while (!stop_.HasBeenNotified()) {
    const etcd::LeaderElection::State s = election_->state();
    if (s.leader) {
      if (serving_term_.load(std::memory_order_relaxed) != s.term) {
        store_->PromoteToLeader();
        serving_term_.store(s.term, std::memory_order_release);
        max_term_seen_ = std::max(max_term_seen_, s.term);
        takeovers_.fetch_add(1, std::memory_order_relaxed);
        const StoreStats stats = store_->Stats();
        KV_LOG(INFO) << "cachestore: " << options_.advertise_address << " leads with term "
                     << s.term << " (" << stats.committed_blocks << " blocks, "
                     << stats.nodes + stats.suspect_nodes << " nodes from the log)";
      }
      stop_.WaitForNotificationWithTimeout(absl::Milliseconds(20));
      continue;
    }
    if (serving_term_.load(std::memory_order_relaxed) != 0) {
      serving_term_.store(0, std::memory_order_release);
      // What this instance applied after its last replicated op was never the cluster's: the
      // next leader's snapshot replaces it.
      followed_incarnation_ = 0;
      KV_LOG(WARNING) << "cachestore: " << options_.advertise_address
                      << " stepped down (lost its etcd lease); it refuses every call and will "
                         "follow the next leader";
    }
    if (s.leader_term > 0 && !s.leader_value.empty() &&
        s.leader_value != options_.advertise_address) {
      absl::Status followed = FollowOnce(s.leader_value, s.leader_term);
      if (!followed.ok() && !stop_.HasBeenNotified()) {
        if (absl::Now() - last_warning > absl::Seconds(5)) {
          KV_LOG(WARNING) << "cachestore: following " << s.leader_value << ": " << followed;
          last_warning = absl::Now();
        }
        stop_.WaitForNotificationWithTimeout(absl::Milliseconds(50));
      }
      continue;
    }
    stop_.WaitForNotificationWithTimeout(absl::Milliseconds(20));
  }
}

absl::Status HighAvailability::FollowOnce(const std::string& leader, int64_t term) {
  if (term < max_term_seen_) {
    return absl::FailedPreconditionError(
        absl::StrCat("etcd names term ", term, " but term ", max_term_seen_, " was seen"));
  }
  KV_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                      kvrelay::server::MakeChannel(leader, options_.security));
  auto stub = kvrelay::v1::CacheStoreReplication::NewStub(channel);
  grpc::ClientContext ctx;
  {
    absl::MutexLock lock(&follow_mu_);
    follow_ctx_ = &ctx;
  }
  // A change that landed before the context was registered would have cancelled nothing.
  const etcd::LeaderElection::State now = election_->state();
  if (stop_.HasBeenNotified() || now.leader || now.leader_term != term) {
    absl::MutexLock lock(&follow_mu_);
    follow_ctx_ = nullptr;
    return absl::OkStatus();
  }
  kvrelay::v1::FollowRequest req;
  req.set_store_incarnation(followed_incarnation_);
  req.set_from_position(position_.load(std::memory_order_relaxed));
  req.set_term(term);
  req.set_follower(options_.advertise_address);
  std::unique_ptr<grpc::ClientReader<kvrelay::v1::ReplicationBatch>> reader =
      stub->Follow(&ctx, req);
  kvrelay::v1::ReplicationBatch batch;
  absl::Status result;
  bool synced_logged = false;
  std::vector<WalOp> ops;
  while (reader->Read(&batch)) {
    if (batch.term() != term || batch.term() < max_term_seen_) {
      result = absl::FailedPreconditionError(
          absl::StrCat("leader ", leader, " sent term ", batch.term(), ", expected ", term));
      ctx.TryCancel();
      break;
    }
    if (!batch.reset() && batch.store_incarnation() != followed_incarnation_ &&
        followed_incarnation_ != 0) {
      result = absl::DataLossError("replication stream of another leader process without reset");
      followed_incarnation_ = 0;
      ctx.TryCancel();
      break;
    }
    ops.clear();
    for (const std::string& payload : batch.ops()) {
      absl::StatusOr<WalOp> op = DecodeWalOp(payload);
      if (!op.ok()) {
        result = op.status();
        break;
      }
      ops.push_back(*std::move(op));
    }
    if (!result.ok()) {
      followed_incarnation_ = 0;
      ctx.TryCancel();
      break;
    }
    if (batch.reset()) {
      store_->ResetForReplication();
      followed_incarnation_ = 0;
    }
    if (absl::Status applied = store_->ApplyReplicated(ops); !applied.ok()) {
      result = applied;
      followed_incarnation_ = 0;
      ctx.TryCancel();
      break;
    }
    max_term_seen_ = std::max(max_term_seen_, batch.term());
    position_.store(batch.next_position(), std::memory_order_relaxed);
    lag_ops_.store(static_cast<int64_t>(batch.leader_position() - batch.next_position()),
                   std::memory_order_relaxed);
    // Only a complete snapshot makes the position resumable.
    if (batch.current()) {
      followed_incarnation_ = batch.store_incarnation();
      if (!synced_logged) {
        KV_LOG(INFO) << "cachestore: following " << leader << " (term " << term << ") at "
                     << batch.next_position();
        synced_logged = true;
      }
    }
  }
  grpc::Status finished = reader->Finish();
  {
    absl::MutexLock lock(&follow_mu_);
    follow_ctx_ = nullptr;
  }
  if (!result.ok()) return result;
  if (finished.error_code() == grpc::StatusCode::CANCELLED) return absl::OkStatus();
  return FromGrpcStatus(finished);
}

void HighAvailability::RegisterMetrics(MetricsRegistry* metrics) {
  metrics->AddGaugeFunc("kvrelay:cachestore_ha_leading",
                        "1 while this store instance leads (etcd election) and serves.", {},
                        [this] { return IsLeading() ? 1.0 : 0.0; });
  metrics->AddGaugeFunc("kvrelay:cachestore_ha_term", "The term this instance serves with.", {},
                        [this] {
                          absl::StatusOr<int64_t> t = LeaderTerm();
                          return t.ok() ? static_cast<double>(*t) : 0.0;
                        });
  metrics->AddGaugeFunc("kvrelay:cachestore_ha_lag_ops",
                        "As a standby: ops of the leader's log not applied yet at the last batch.",
                        {}, [this] { return static_cast<double>(lag_ops()); });
  metrics->AddCounterFunc(
      "kvrelay:cachestore_ha_takeovers_total", "Times this instance became leader.", {},
      [this] { return static_cast<double>(takeovers_.load(std::memory_order_relaxed)); });
}

grpc::Status ReplicationService::Follow(grpc::ServerContext* ctx,
                                        const kvrelay::v1::FollowRequest* req,
                                        grpc::ServerWriter<kvrelay::v1::ReplicationBatch>* writer) {
  if (authorizer_.enforcing()) {
    absl::StatusOr<kvrelay::server::Peer> peer =
        authorizer_.Authorize(*ctx, "/kvrelay.v1.CacheStoreReplication/Follow", "");
    if (!peer.ok()) return ToGrpcStatus(peer.status());
  }
  if (req->follower().size() > 256) {
    return ToGrpcStatus(absl::InvalidArgumentError("follower: at most 256 bytes"));
  }
  absl::StatusOr<int64_t> term = leadership_->LeaderTerm();
  if (!term.ok()) return ToGrpcStatus(term.status());
  const uint64_t incarnation = store_->store_incarnation();
  auto still_leading = [&]() -> grpc::Status {
    absl::StatusOr<int64_t> now = leadership_->LeaderTerm();
    if (!now.ok()) return ToGrpcStatus(now.status());
    if (*now != *term) {
      return ToGrpcStatus(NotLeaderError("cache store: the term changed during the stream", ""));
    }
    return grpc::Status::OK;
  };
  auto make_batch = [&](bool reset, bool current, uint64_t next) {
    kvrelay::v1::ReplicationBatch batch;
    batch.set_term(*term);
    batch.set_store_incarnation(incarnation);
    batch.set_reset(reset);
    batch.set_current(current);
    batch.set_next_position(next);
    batch.set_leader_position(store_->replication_position());
    return batch;
  };
  uint64_t position = req->from_position();
  bool resumable = req->store_incarnation() == incarnation;
  if (resumable) {
    uint64_t ignored = 0;
    resumable = store_->ReplicationSince(position, 0, absl::InfinitePast(), &ignored).ok();
  }
  if (!resumable) {
    std::vector<WalOp> snapshot = store_->ReplicationSnapshot(&position);
    size_t sent = 0;
    do {
      const size_t n = std::min(kOpsPerBatch, snapshot.size() - sent);
      kvrelay::v1::ReplicationBatch batch =
          make_batch(/*reset=*/sent == 0, /*current=*/sent + n == snapshot.size(), position);
      for (size_t i = 0; i < n; ++i)
        batch.add_ops(EncodeWalOp(snapshot[sent + i], WalTokens::kInclude));
      sent += n;
      if (!writer->Write(batch)) return grpc::Status::OK;
    } while (sent < snapshot.size());
    KV_LOG(INFO) << "cachestore: " << req->follower() << " follows from a snapshot of "
                 << snapshot.size() << " ops at position " << position;
  }
  // The snapshot (the whole index as records) is gone: its pages go back to the kernel.
  if (!resumable) ReleaseFreeHeapMemory();
  while (!ctx->IsCancelled() && !stopping_.load(std::memory_order_acquire)) {
    if (grpc::Status s = still_leading(); !s.ok()) return s;
    uint64_t next = position;
    absl::StatusOr<std::vector<WalOp>> ops =
        store_->ReplicationSince(position, kOpsPerBatch, absl::Now() + kHeartbeatEvery, &next);
    if (!ops.ok()) return ToGrpcStatus(ops.status());  // fell behind the retention: resync
    // Ops logged under a term this instance no longer holds are not the cluster's.
    if (grpc::Status s = still_leading(); !s.ok()) return s;
    kvrelay::v1::ReplicationBatch batch = make_batch(false, true, next);
    for (const WalOp& op : *ops) batch.add_ops(EncodeWalOp(op, WalTokens::kInclude));
    if (!writer->Write(batch)) return grpc::Status::OK;
    position = next;
  }
  return grpc::Status::OK;
}

}  // namespace kvrelay::cachestore::server
