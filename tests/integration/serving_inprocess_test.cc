// One-process serving tests: the real cache store (gRPC on loopback), real prefill and decode
// workers over the in-process transport (optionally behind the fault-injecting transport), and
// the real gateway logic, with expiry driven by a SimulatedClock. Each case runs in well under
// a second; the process-level tests in tests/e2e cover the same paths across processes.

#include <httplib.h>

#include <algorithm>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "cachestore/cache_store.h"
#include "cachestore/client/cache_store_client.h"
#include "cachestore/server/service.h"
#include "cli/colocated.h"
#include "common/file_util.h"
#include "common/server/service_host.h"
#include "common/status_macros.h"
#include "decode/decode_worker.h"
#include "gateway/gateway.h"
#include "gateway/http/openai_server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/test_model.h"
#include "nlohmann/json.hpp"
#include "prefill/prefill_worker.h"
#include "proto/grpc_status.h"
#include "sim/simulation.h"
#include "tests/integration/local_endpoints.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"
#include "tokenizer/byte_tokenizer.h"
#include "transfer/faulty_transport.h"
#include "transfer/inproc/in_process_transport.h"
#include "worker/kv_memory.h"

namespace kvrelay::testing {
namespace {

using ::testing::ElementsAreArray;

constexpr int kDecode = 2;

class InProcessCluster : public ::testing::Test {
 protected:
  void SetUp() override {
    model_dir_ = dir_.File("model");
    model::TestModelOptions model_options;
    model_options.arch = arch_;
    model_options.seed = 7;
    model_options.vocab = vocab_;
    KV_ASSERT_OK(model::WriteTestModel(model_dir_, model_options));
    KV_ASSERT_OK_AND_ASSIGN(reference_, cli::ColocatedGenerator::Load(model_dir_));

    cachestore::CacheStoreOptions store_options;
    store_options.clock = &store_clock_;
    store_options.default_node_ttl = absl::Seconds(2);
    KV_ASSERT_OK_AND_ASSIGN(store_, cachestore::CacheStore::Create(store_options));
    store_service_ = std::make_unique<cachestore::server::CacheStoreService>(
        store_.get(), cachestore::server::Limits{}, &metrics_);
    server::ServiceHostOptions host;
    host.name = "cachestore";
    KV_ASSERT_OK_AND_ASSIGN(store_host_,
                            server::ServiceHost::Start(host, {store_service_.get()}, nullptr));

    for (int i = 0; i < num_prefill_; ++i) {
      prefill::PrefillWorkerOptions options;
      options.core.model_dir = model_dir_;
      options.core.node_id = "prefill-" + std::to_string(i);
      options.core.cachestore_address = store_host_->address();
      options.core.pool_blocks = 256;
      options.core.cache_slots = prefill_cache_slots_;
      // The reuse counts below must not depend on a sanitizer-slowed store call beating the
      // 500 ms default (the worker would skip the store for a moment).
      options.core.store_request_timeout = absl::Seconds(5);
      options.model_name = "tiny";
      options.pull_remote_prefix = prefills_pull_;
      KV_ASSERT_OK_AND_ASSIGN(auto transport, transfer::MakeInProcessTransport());
      auto faulty = std::make_unique<transfer::FaultyTransport>(std::move(transport));
      prefill_faults_.push_back(faulty.get());
      KV_ASSERT_OK_AND_ASSIGN(
          auto worker,
          prefill::PrefillWorker::Create(
              options, &metrics_, {.transport = std::move(faulty), .clock = &worker_clock_}));
      KV_ASSERT_OK(worker->ConnectStore("in-process"));
      prefills_.push_back(std::move(worker));
    }
    for (int i = 0; i < kDecode; ++i) {
      decode::DecodeWorkerOptions options;
      options.core.model_dir = model_dir_;
      options.core.node_id = "decode-" + std::to_string(i);
      options.core.pool_blocks = decode_pool_blocks_;
      options.model_name = "tiny";
      options.max_batch = 4;
      options.max_queued = 4;
      options.reservation_ttl = absl::Seconds(10);
      if (decodes_use_store_) {
        options.core.cachestore_address = store_host_->address();
        options.core.store_request_timeout = absl::Seconds(5);
      }
      KV_ASSERT_OK_AND_ASSIGN(auto transport, transfer::MakeInProcessTransport());
      KV_ASSERT_OK_AND_ASSIGN(
          auto worker,
          decode::DecodeWorker::Create(
              options, &metrics_, {.transport = std::move(transport), .clock = &worker_clock_}));
      if (decodes_use_store_) {
        KV_ASSERT_OK(worker->ConnectStore("in-process"));
      }
      decodes_.push_back(std::move(worker));
    }
    gateway::Gateway::Workers workers;
    for (auto& p : prefills_) {
      auto endpoint = std::make_unique<LocalPrefillEndpoint>(p.get());
      prefill_endpoints_.push_back(endpoint.get());
      workers.prefill.push_back(std::move(endpoint));
    }
    for (auto& d : decodes_) {
      auto endpoint = std::make_unique<LocalDecodeEndpoint>(d.get());
      decode_endpoints_.push_back(endpoint.get());
      workers.decode.push_back(std::move(endpoint));
    }
    gateway::GatewayOptions options;
    options.model_dir = model_dir_;
    options.model_name = "tiny";
    options.tenant_secret = "test-secret";
    options.max_inflight_per_tenant = tenant_quota_;
    options.max_inflight_per_client = client_quota_;
    options.max_reserved_tokens_per_client = client_reserved_tokens_;
    options.breaker.open_for = absl::Seconds(1);
    options.route_timeout = route_timeout_;
    KV_ASSERT_OK_AND_ASSIGN(auto store_client,
                            cachestore::CacheStoreClient::Connect(store_host_->address()));
    KV_ASSERT_OK_AND_ASSIGN(
        gateway_,
        gateway::Gateway::Create(options, std::move(workers), std::move(store_client), &metrics_,
                                 gateway_clock_ != nullptr ? gateway_clock_ : &worker_clock_));
  }

  void TearDown() override {
    gateway_.reset();
    decodes_.clear();
    prefills_.clear();
    store_host_.reset();
  }

  std::vector<int32_t> Prompt(int n, int salt = 0) const {
    std::vector<int32_t> tokens(n);
    for (int i = 0; i < n; ++i) tokens[i] = (i * 31 + salt * 7 + 3) % 250 + 1;
    return tokens;
  }

  struct Outcome {
    absl::Status status;
    std::vector<int32_t> tokens;
    kvrelay::v1::GenerateSummary summary;
  };
  Outcome Generate(const std::vector<int32_t>& prompt, int max_tokens = 8,
                   absl::Duration timeout = absl::Seconds(30)) {
    kvrelay::v1::GenerateRequest request;
    for (int32_t t : prompt) request.add_tokens(t);
    request.set_tenant("tenant-a");
    request.set_max_tokens(max_tokens);
    Outcome out;
    out.status = gateway_->Generate(
        request, absl::Now() + timeout,
        [&](const kvrelay::v1::GenerateResponse& r) {
          out.tokens.insert(out.tokens.end(), r.tokens().begin(), r.tokens().end());
          if (r.has_summary()) out.summary = r.summary();
          return true;
        },
        [] { return false; });
    return out;
  }

  std::vector<int32_t> Reference(const std::vector<int32_t>& prompt, int max_tokens = 8) {
    cli::GenerationRequest request;
    request.tokens = prompt;
    request.max_tokens = max_tokens;
    absl::StatusOr<cli::GenerationResult> result = reference_->Generate(request);
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? result->tokens : std::vector<int32_t>{};
  }

  // Reserve + Prefill (+ Generate) straight on the workers, as a caller that bypasses the
  // gateway would.
  kvrelay::v1::ReserveResponse Reserve(int decode, const std::string& id,
                                       const std::vector<int32_t>& prompt, int max_tokens = 8) {
    kvrelay::v1::ReserveRequest r;
    r.set_request_id(id);
    r.set_model("tiny");
    r.set_prompt_tokens(static_cast<int32_t>(prompt.size()));
    r.set_max_tokens(max_tokens);
    r.set_layout_fingerprint(Fingerprint());
    absl::StatusOr<kvrelay::v1::ReserveResponse> reserved = decodes_[decode]->Reserve(r);
    EXPECT_TRUE(reserved.ok()) << reserved.status();
    return reserved.ok() ? *reserved : kvrelay::v1::ReserveResponse();
  }
  std::string Fingerprint() const {
    const kv::LayoutFingerprint& fp = gateway_->config().layout.fingerprint();
    return std::string(reinterpret_cast<const char*>(fp.bytes.data()), fp.bytes.size());
  }
  absl::StatusOr<kvrelay::v1::PrefillResponse> Prefill(const std::string& id,
                                                       const std::vector<int32_t>& prompt,
                                                       const kvrelay::v1::ReserveResponse& target) {
    kvrelay::v1::PrefillRequest p;
    p.set_request_id(id);
    p.set_model("tiny");
    for (int32_t t : prompt) p.add_tokens(t);
    p.set_tenant_salt("salt-of-" + id);
    p.set_layout_fingerprint(Fingerprint());
    *p.mutable_target() = target;
    return prefills_[0]->Run(p, absl::Now() + absl::Seconds(30));
  }
  // A prefill on worker `index` with a given tenant salt (requests sharing it share blocks).
  absl::StatusOr<kvrelay::v1::PrefillResponse> PrefillOn(int index, const std::string& id,
                                                         const std::vector<int32_t>& prompt,
                                                         const kvrelay::v1::ReserveResponse& target,
                                                         const std::string& salt,
                                                         bool skip_store_lookup = false) {
    kvrelay::v1::PrefillRequest p;
    p.set_request_id(id);
    p.set_model("tiny");
    for (int32_t t : prompt) p.add_tokens(t);
    p.set_tenant_salt(salt);
    p.set_layout_fingerprint(Fingerprint());
    p.set_skip_store_lookup(skip_store_lookup);
    *p.mutable_target() = target;
    return prefills_[index]->Run(p, absl::Now() + absl::Seconds(30));
  }
  struct DecodeOutcome {
    absl::Status status;
    std::vector<int32_t> tokens;
    int32_t computed_tokens = -1;
  };
  DecodeOutcome Decode(int decode, const std::string& id, const std::vector<int32_t>& prompt,
                       const std::string& token, int32_t pushed_tokens, int max_tokens = 8) {
    kvrelay::v1::DecodeRequest d;
    d.set_request_id(id);
    for (int32_t t : prompt) d.add_tokens(t);
    d.set_max_tokens(max_tokens);
    d.set_pushed_tokens(pushed_tokens);
    d.set_eos_token(-1);
    d.set_layout_fingerprint(Fingerprint());
    d.set_reservation_token(token);
    DecodeOutcome out;
    out.status = decodes_[decode]->Generate(
        d, absl::Now() + absl::Seconds(30),
        [&out](const kvrelay::v1::DecodeChunk& c) {
          out.tokens.insert(out.tokens.end(), c.tokens().begin(), c.tokens().end());
          if (c.done()) out.computed_tokens = c.computed_tokens();
          return true;
        },
        [] { return false; });
    return out;
  }
  static void ExpectUnauthorized(const absl::Status& status) {
    EXPECT_THAT(status, StatusIs(absl::StatusCode::kPermissionDenied));
    std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(status);
    ASSERT_TRUE(info.has_value()) << status;
    EXPECT_EQ(info->reason(), kvrelay::v1::FAILURE_UNAUTHORIZED) << status;
  }

  int32_t tenant_quota_ = 64;                 // GatewayOptions::max_inflight_per_tenant
  int32_t client_quota_ = 32;                 // max_inflight_per_client
  int64_t client_reserved_tokens_ = 1 << 18;  // max_reserved_tokens_per_client
  std::string arch_ = "llama";                // the test model's architecture
  int num_prefill_ = 1;
  int32_t vocab_ = 0;                 // the test model's vocabulary (0: the preset's)
  int64_t prefill_cache_slots_ = 64;  // each prefill worker's store segment
  int64_t decode_pool_blocks_ = 64;   // each decode worker's KV pool
  bool decodes_use_store_ = false;    // decode workers commit what they decoded to the store
  bool prefills_pull_ = true;         // prefill workers' pull_remote_prefix
  absl::Duration route_timeout_ = absl::Milliseconds(500);  // the gateway's QueryPrefix bound
  Clock* gateway_clock_ = nullptr;  // the gateway's policy clock (null: worker_clock_)
  TempDir dir_;
  std::string model_dir_;
  std::unique_ptr<cli::ColocatedGenerator> reference_;
  SimulatedClock store_clock_;
  SimulatedClock worker_clock_;
  MetricsRegistry metrics_;
  std::unique_ptr<cachestore::CacheStore> store_;
  std::unique_ptr<cachestore::server::CacheStoreService> store_service_;
  std::unique_ptr<server::ServiceHost> store_host_;
  std::vector<transfer::FaultyTransport*> prefill_faults_;
  std::vector<std::unique_ptr<prefill::PrefillWorker>> prefills_;
  std::vector<std::unique_ptr<decode::DecodeWorker>> decodes_;
  std::vector<LocalPrefillEndpoint*> prefill_endpoints_;
  std::vector<LocalDecodeEndpoint*> decode_endpoints_;
  std::unique_ptr<gateway::Gateway> gateway_;
};

TEST_F(InProcessCluster, DisaggregatedTokensEqualColocatedAndPrefixesAreReused) {
  const std::vector<int32_t> prompt = Prompt(70);
  Outcome first = Generate(prompt);
  KV_ASSERT_OK(first.status);
  EXPECT_THAT(first.tokens, ElementsAreArray(Reference(prompt)));
  EXPECT_EQ(first.summary.prefix_hit_tokens(), 0);
  EXPECT_GT(first.summary.transferred_bytes(), 0);

  Outcome second = Generate(prompt);
  KV_ASSERT_OK(second.status);
  EXPECT_THAT(second.tokens, ElementsAreArray(first.tokens));
  EXPECT_EQ(second.summary.prefix_hit_tokens(), 64);  // 4 full blocks of 16 reused
}

TEST_F(InProcessCluster, CorruptPushIsDetectedAndRecomputed) {
  prefill_faults_[0]->SetFaults({.corrupt = true});
  const std::vector<int32_t> prompt = Prompt(50, 1);
  Outcome out = Generate(prompt);
  KV_ASSERT_OK(out.status);
  EXPECT_THAT(out.tokens, ElementsAreArray(Reference(prompt)));
  // The decode worker refused the corrupted blocks and computed the whole prompt itself.
  EXPECT_EQ(out.summary.computed_prompt_tokens(), 50);
}

TEST_F(InProcessCluster, DecodeDyingMidStreamFailsOverWithCorrectTokens) {
  const std::vector<int32_t> prompt = Prompt(40, 2);
  const std::vector<int32_t> expected = Reference(prompt, 12);
  // Whichever decode worker the gateway picks first dies after 5 tokens; the other survives.
  auto deaths = std::make_shared<std::atomic<int>>(1);
  for (LocalDecodeEndpoint* e : decode_endpoints_) e->DieAfterTokens(5, deaths);
  Outcome out = Generate(prompt, 12);
  KV_ASSERT_OK(out.status);
  EXPECT_THAT(out.tokens, ElementsAreArray(expected));
  EXPECT_EQ(out.summary.attempts(), 2);
}

TEST_F(InProcessCluster, DeadWorkerIsSkippedThenProbedAfterItsBreakerOpenTime) {
  decode_endpoints_[0]->Kill();
  const std::vector<int32_t> prompt = Prompt(33, 3);
  const std::vector<int32_t> expected = Reference(prompt);
  for (int i = 0; i < 4; ++i) {
    Outcome out = Generate(prompt);
    KV_ASSERT_OK(out.status) << i;
    EXPECT_THAT(out.tokens, ElementsAreArray(expected));
  }
  // decode-0 is back; after the breaker's open time (simulated) a probe reaches it again.
  decode_endpoints_[0]->Revive();
  worker_clock_.Advance(absl::Seconds(2));
  int served_by_0 = 0;
  for (int i = 0; i < 4; ++i) {
    Outcome out = Generate(prompt);
    KV_ASSERT_OK(out.status);
    if (out.summary.decode_worker() == decode_endpoints_[0]->address()) ++served_by_0;
  }
  EXPECT_GT(served_by_0, 0);
}

TEST_F(InProcessCluster, OverloadIsRefusedAtOnceNotCollapsed) {
  // 64 slots per decode worker, 16-token blocks: a 900-token request with 100 new tokens needs
  // 63 blocks, so one fits per worker and a third is refused with RESOURCE_EXHAUSTED.
  kvrelay::v1::ReserveRequest big;
  big.set_model("tiny");
  big.set_prompt_tokens(900);
  big.set_max_tokens(100);
  big.set_layout_fingerprint(gateway_->config().layout.fingerprint().ToBytes());
  std::vector<std::string> tokens;
  for (int i = 0; i < kDecode; ++i) {
    big.set_request_id("hold-" + std::to_string(i));
    KV_ASSERT_OK_AND_ASSIGN(kvrelay::v1::ReserveResponse held, decodes_[i]->Reserve(big));
    tokens.push_back(held.reservation_token());
  }
  Outcome refused = Generate(Prompt(900, 4), 100);
  EXPECT_THAT(refused.status, StatusIs(absl::StatusCode::kResourceExhausted));
  std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(refused.status);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->reason(), kvrelay::v1::FAILURE_OVERLOADED);
  // A small request still fits beside the big ones? No: 63 of 64 booked. Release one hold.
  KV_ASSERT_OK(decodes_[0]->Release("hold-0", tokens[0]));
  worker_clock_.Advance(absl::Seconds(31));  // past the release grace: the slots come back
  Outcome small = Generate(Prompt(20, 5), 4);
  KV_ASSERT_OK(small.status);
}

// SIGTERM drain of a decode worker: new reservations are refused with FAILURE_DRAINING, the
// gateway serves every request on the other worker without a failure, and the drain waits for
// the reservation the worker granted before it began.
TEST_F(InProcessCluster, ADrainingDecodeWorkerRefusesNewWorkAndFinishesWhatItReserved) {
  kvrelay::v1::ReserveRequest r;
  r.set_model("tiny");
  r.set_prompt_tokens(10);
  r.set_max_tokens(8);
  r.set_layout_fingerprint(gateway_->config().layout.fingerprint().ToBytes());
  r.set_request_id("admitted");
  KV_ASSERT_OK_AND_ASSIGN(kvrelay::v1::ReserveResponse held, decodes_[0]->Reserve(r));
  // A deadline already passed: the drain begins, finds the reservation and returns at once.
  EXPECT_FALSE(decodes_[0]->Drain(absl::Now()));
  r.set_request_id("new");
  absl::StatusOr<kvrelay::v1::ReserveResponse> refused = decodes_[0]->Reserve(r);
  EXPECT_THAT(refused.status(), StatusIs(absl::StatusCode::kUnavailable));
  std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(refused.status());
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->reason(), kvrelay::v1::FAILURE_DRAINING);
  EXPECT_EQ(info->role(), kvrelay::v1::ROLE_DECODE);

  const std::vector<int32_t> prompt = Prompt(33, 6);
  const std::vector<int32_t> expected = Reference(prompt);
  for (int i = 0; i < 4; ++i) {
    Outcome out = Generate(prompt);
    KV_ASSERT_OK(out.status) << i;
    EXPECT_THAT(out.tokens, ElementsAreArray(expected));
    EXPECT_EQ(out.summary.decode_worker(), decode_endpoints_[1]->address());
  }
  EXPECT_EQ(metrics_
                .GetCounter("kvrelay:gateway_breaker_opens_total", "",
                            {{"model_name", "tiny"}, {"role", "decode"}})
                ->value(),
            0);
  // The admitted reservation ends (released here): the drain completes.
  KV_ASSERT_OK(decodes_[0]->Release("admitted", held.reservation_token()));
  EXPECT_TRUE(decodes_[0]->Drain(absl::Now() + absl::Seconds(30)));
}

// Mamba: the recurrent state is what is pushed, checkpointed and reused.
class InProcessMambaCluster : public InProcessCluster {
 protected:
  InProcessMambaCluster() { arch_ = "mamba"; }
};

TEST_F(InProcessMambaCluster, StateIsPushedCheckpointedAndReused) {
  const std::vector<int32_t> prompt = Prompt(70);
  Outcome first = Generate(prompt);
  KV_ASSERT_OK(first.status);
  EXPECT_THAT(first.tokens, ElementsAreArray(Reference(prompt)));
  EXPECT_EQ(first.summary.prefix_hit_tokens(), 0);
  const int64_t state_bytes = gateway_->config().layout.BlockBytes(0);
  EXPECT_EQ(first.summary.transferred_bytes(), state_bytes);

  // The same prompt resumes from the checkpoint after block 4 and computes nothing there.
  Outcome second = Generate(prompt);
  KV_ASSERT_OK(second.status);
  EXPECT_THAT(second.tokens, ElementsAreArray(first.tokens));
  EXPECT_EQ(second.summary.prefix_hit_tokens(), 64);
  EXPECT_EQ(second.summary.transferred_bytes(), state_bytes);

  // A longer prompt with the same start resumes there and computes only blocks 5 and 6.
  std::vector<int32_t> longer = prompt;
  for (int32_t t : Prompt(40, 9)) longer.push_back(t);
  Outcome third = Generate(longer);
  KV_ASSERT_OK(third.status);
  EXPECT_THAT(third.tokens, ElementsAreArray(Reference(longer)));
  EXPECT_EQ(third.summary.prefix_hit_tokens(), 64);
  EXPECT_EQ(third.summary.computed_prompt_tokens(), 110 - 64);
  EXPECT_EQ(third.summary.transferred_bytes(), state_bytes);
}

TEST_F(InProcessMambaCluster, CorruptStateIsDetectedAndRecomputed) {
  prefill_faults_[0]->SetFaults({.corrupt = true});
  const std::vector<int32_t> prompt = Prompt(50, 1);
  Outcome out = Generate(prompt);
  KV_ASSERT_OK(out.status);
  EXPECT_THAT(out.tokens, ElementsAreArray(Reference(prompt)));
  // The decode worker refused the corrupted state and computed the whole prompt itself.
  EXPECT_EQ(out.summary.computed_prompt_tokens(), 50);
}

// A Mamba reservation holds one slot, for the state after the last pushed block; a push that
// names slots for earlier blocks is refused before anything moves.
TEST_F(InProcessMambaCluster, ReservationHoldsOnlyTheFinalStatesSlot) {
  const std::vector<int32_t> prompt = Prompt(70, 3);
  kvrelay::v1::ReserveResponse target = Reserve(0, "m-1", prompt);
  ASSERT_EQ(target.full_blocks(), 4);
  ASSERT_EQ(target.groups_size(), 1);
  for (int b = 0; b < 3; ++b) EXPECT_EQ(target.groups(0).slots(b), -1) << b;
  EXPECT_GE(target.groups(0).slots(3), 0);
  kvrelay::v1::ReserveResponse forged = target;
  forged.mutable_groups(0)->set_slots(0, target.groups(0).slots(3));
  EXPECT_THAT(Prefill("m-1", prompt, forged), StatusIs(absl::StatusCode::kInvalidArgument));
  KV_ASSERT_OK_AND_ASSIGN(kvrelay::v1::PrefillResponse pushed, Prefill("m-1", prompt, target));
  EXPECT_EQ(pushed.pushed_bytes(), gateway_->config().layout.BlockBytes(0));
  DecodeOutcome out = Decode(0, "m-1", prompt, target.reservation_token(), 64);
  KV_ASSERT_OK(out.status);
  EXPECT_EQ(out.computed_tokens, 6);
  EXPECT_THAT(out.tokens, ElementsAreArray(Reference(prompt)));
}

TEST_F(InProcessCluster, ReleaseNeedsTheReservationToken) {
  // A prompt without a full block: nothing is pushed, so a released reservation is swept by the
  // next Reserve at once (no quarantine), which makes a release visible in reserved_requests.
  kvrelay::v1::ReserveRequest r;
  r.set_model("tiny");
  r.set_prompt_tokens(10);
  r.set_max_tokens(8);
  r.set_layout_fingerprint(gateway_->config().layout.fingerprint().ToBytes());
  r.set_request_id("victim");
  KV_ASSERT_OK_AND_ASSIGN(kvrelay::v1::ReserveResponse held, decodes_[0]->Reserve(r));
  // Another token (one bit off, empty, a prefix) is refused and the reservation stays.
  std::string forged = held.reservation_token();
  forged[0] ^= 1;
  for (const std::string& token : {forged, std::string(), held.reservation_token().substr(0, 31)}) {
    absl::Status s = decodes_[0]->Release("victim", token);
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kPermissionDenied));
    std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(s);
    ASSERT_TRUE(info.has_value());
    EXPECT_EQ(info->reason(), kvrelay::v1::FAILURE_UNAUTHORIZED);
  }
  r.set_request_id("other-1");
  KV_ASSERT_OK(decodes_[0]->Reserve(r).status());  // sweeps released reservations
  EXPECT_EQ(decodes_[0]->Describe().reserved_requests(), 2);
  // Its own token releases it; releasing again, or an unknown id, is OK (idempotent).
  KV_EXPECT_OK(decodes_[0]->Release("victim", held.reservation_token()));
  KV_EXPECT_OK(decodes_[0]->Release("victim", held.reservation_token()));
  KV_EXPECT_OK(decodes_[0]->Release("never-reserved", forged));
  EXPECT_THAT(decodes_[0]->Release("", forged), StatusIs(absl::StatusCode::kInvalidArgument));
  r.set_request_id("other-2");
  KV_ASSERT_OK(decodes_[0]->Reserve(r).status());
  EXPECT_EQ(decodes_[0]->Describe().reserved_requests(), 2);  // other-1, other-2
}

class InProcessClusterWithTenantQuota : public InProcessCluster {
 protected:
  InProcessClusterWithTenantQuota() { tenant_quota_ = 1; }
};

TEST_F(InProcessClusterWithTenantQuota, ATenantOverItsQuotaIsRefusedNamingIt) {
  // While tenant-a's request is in flight (its sink is running), its next one is refused at once.
  Outcome nested;
  bool checked = false;
  kvrelay::v1::GenerateRequest request;
  for (int32_t t : Prompt(40, 6)) request.add_tokens(t);
  request.set_tenant("tenant-a");
  request.set_max_tokens(4);
  std::vector<int32_t> tokens;
  KV_ASSERT_OK(gateway_->Generate(
      request, absl::Now() + absl::Seconds(30),
      [&](const kvrelay::v1::GenerateResponse& r) {
        tokens.insert(tokens.end(), r.tokens().begin(), r.tokens().end());
        if (!checked) {
          checked = true;
          nested = Generate(Prompt(20, 7), 2);
        }
        return true;
      },
      [] { return false; }));
  ASSERT_TRUE(checked);
  EXPECT_THAT(nested.status, StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(nested.status.message(), ::testing::HasSubstr("tenant 'tenant-a'"));
  std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(nested.status);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->role(), kvrelay::v1::ROLE_CLIENT);  // never blamed on a worker
  EXPECT_EQ(tokens, Reference(Prompt(40, 6), 4));
  // The slot came back with the request's end.
  KV_EXPECT_OK(Generate(Prompt(20, 7), 2).status);
}

class InProcessClusterWithClientQuotas : public InProcessCluster {
 protected:
  InProcessClusterWithClientQuotas() {
    client_quota_ = 2;
    client_reserved_tokens_ = 60;  // one 40 + 4 token request, not a second 20 + 2 beside it
  }
  // One request of `tenant` as `client`; `during` runs in its sink once, while it streams.
  Outcome GenerateAs(const std::string& client, const std::vector<int32_t>& prompt, int max_tokens,
                     const std::function<void()>& during = nullptr) {
    kvrelay::v1::GenerateRequest request;
    for (int32_t t : prompt) request.add_tokens(t);
    request.set_tenant("tenant-a");
    request.set_max_tokens(max_tokens);
    Outcome out;
    bool ran = false;
    out.status = gateway_->Generate(
        request, absl::Now() + absl::Seconds(30),
        [&](const kvrelay::v1::GenerateResponse& r) {
          out.tokens.insert(out.tokens.end(), r.tokens().begin(), r.tokens().end());
          if (!ran && during) {
            ran = true;
            during();
          }
          return true;
        },
        [] { return false; }, client);
    return out;
  }
  static void ExpectRefusedNaming(const absl::Status& status, const std::string& what) {
    EXPECT_THAT(status, StatusIs(absl::StatusCode::kResourceExhausted));
    EXPECT_THAT(status.message(), ::testing::HasSubstr(what));
    std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(status);
    ASSERT_TRUE(info.has_value());
    EXPECT_EQ(info->role(), kvrelay::v1::ROLE_CLIENT);  // never blamed on a worker
  }
};

TEST_F(InProcessClusterWithClientQuotas, AClientOverItsInFlightQuotaIsRefusedNamingIt) {
  const std::string app1 = "spiffe://kvrelay/client/app-1";
  const std::string app2 = "spiffe://kvrelay/client/app-2";
  Outcome second, third, other_client;
  Outcome first = GenerateAs(app1, Prompt(40, 6), 4, [&] {
    // The first request streams: its reservation is no longer held, so a second one of the
    // same client (quota 2 in flight) runs; a third while both are in flight is refused.
    second = GenerateAs(app1, Prompt(30, 8), 3, [&] {
      third = GenerateAs(app1, Prompt(20, 7), 2);
      other_client = GenerateAs(app2, Prompt(20, 7), 2);  // same tenant, another client
    });
  });
  KV_ASSERT_OK(first.status);
  EXPECT_EQ(first.tokens, Reference(Prompt(40, 6), 4));
  KV_ASSERT_OK(second.status);
  EXPECT_EQ(second.tokens, Reference(Prompt(30, 8), 3));
  ExpectRefusedNaming(third.status, "client '" + app1 +
                                        "' already has 2 requests in flight (quota "
                                        "--max-inflight-per-client 2)");
  KV_ASSERT_OK(other_client.status);
  EXPECT_EQ(other_client.tokens, Reference(Prompt(20, 7), 2));
  // The slots came back with the requests' ends.
  KV_EXPECT_OK(GenerateAs(app1, Prompt(20, 7), 2).status);
}

TEST_F(InProcessClusterWithClientQuotas, AClientOverItsReservedKvQuotaIsRefusedNamingIt) {
  const std::string app1 = "spiffe://kvrelay/client/app-1";
  Outcome nested, other_client;
  bool nested_once = false;
  // While the first request's prefill runs, its decode reservation is held.
  prefill_endpoints_[0]->SetBeforePrefill([&] {
    if (nested_once) return;
    nested_once = true;
    nested = GenerateAs(app1, Prompt(20, 7), 2);
    other_client = GenerateAs("bearer:tenant-a", Prompt(20, 7), 2);
  });
  Outcome first = GenerateAs(app1, Prompt(40, 6), 4);
  KV_ASSERT_OK(first.status);
  EXPECT_EQ(first.tokens, Reference(Prompt(40, 6), 4));
  ASSERT_TRUE(nested_once);
  ExpectRefusedNaming(nested.status,
                      "client '" + app1 +
                          "' already has 44 tokens of decode KV reserved and this request needs "
                          "22 (quota --max-reserved-tokens-per-client 60)");
  KV_ASSERT_OK(other_client.status);
  EXPECT_EQ(other_client.tokens, Reference(Prompt(20, 7), 2));
  KV_EXPECT_OK(GenerateAs(app1, Prompt(20, 7), 2).status);
}

TEST_F(InProcessCluster, UnclaimedReservationsExpireOnTheClock) {
  kvrelay::v1::ReserveRequest r;
  r.set_model("tiny");
  r.set_prompt_tokens(100);
  r.set_max_tokens(8);
  r.set_layout_fingerprint(gateway_->config().layout.fingerprint().ToBytes());
  r.set_request_id("lapsed");
  KV_ASSERT_OK(decodes_[0]->Reserve(r).status());
  const int64_t free_before = decodes_[0]->Describe().free_slots();
  worker_clock_.Advance(absl::Seconds(11));  // past reservation_ttl
  r.set_request_id("next");
  KV_ASSERT_OK(decodes_[0]->Reserve(r).status());
  kvrelay::v1::DecodeStatusResponse status = decodes_[0]->Describe();
  EXPECT_EQ(status.reserved_requests(), 1);     // the lapsed one was swept
  EXPECT_EQ(status.free_slots(), free_before);  // and its blocks returned
}

TEST_F(InProcessCluster, APrefillToldTheStoreDidNotAnswerNeitherLooksUpNorCommits) {
  const std::vector<int32_t> prompt = Prompt(70, 5);
  // The gateway's lookup got no answer: this prefill must not wait for the store either.
  KV_ASSERT_OK_AND_ASSIGN(
      kvrelay::v1::PrefillResponse skipped,
      PrefillOn(0, "skip-1", prompt, Reserve(0, "skip-1", prompt), "tenant", true));
  EXPECT_EQ(skipped.committed_blocks(), 0);
  EXPECT_GT(skipped.pushed_bytes(), 0);
  // So the same prompt later finds nothing, computes it all, and commits it then.
  KV_ASSERT_OK_AND_ASSIGN(kvrelay::v1::PrefillResponse looked,
                          PrefillOn(0, "skip-2", prompt, Reserve(0, "skip-2", prompt), "tenant"));
  EXPECT_EQ(looked.prefix_hit_tokens(), 0);
  EXPECT_EQ(looked.committed_blocks(), 4);
}

TEST_F(InProcessCluster, LayoutMismatchIsRefusedNotServed) {
  kvrelay::v1::ReserveRequest r;
  r.set_request_id("wrong-layout");
  r.set_model("tiny");
  r.set_prompt_tokens(40);
  r.set_max_tokens(4);
  r.set_layout_fingerprint(std::string(16, '\x01'));
  absl::StatusOr<kvrelay::v1::ReserveResponse> refused = decodes_[0]->Reserve(r);
  EXPECT_THAT(refused.status(), StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_TRUE(proto::GetErrorInfo(refused.status()).has_value());
  EXPECT_EQ(proto::GetErrorInfo(refused.status())->reason(), kvrelay::v1::FAILURE_IDENTITY);
}

TEST_F(InProcessCluster, HeartbeatLossDropsTheNodesBlocksAndReuseComesBack) {
  const std::vector<int32_t> prompt = Prompt(70, 6);
  KV_ASSERT_OK(Generate(prompt).status);
  Outcome hit = Generate(prompt);
  KV_ASSERT_OK(hit.status);
  EXPECT_EQ(hit.summary.prefix_hit_tokens(), 64);
  // The store stops hearing from every node (simulated): they expire with their blocks.
  store_clock_.Advance(absl::Minutes(10));
  store_->Tick();
  Outcome miss = Generate(prompt);
  KV_ASSERT_OK(miss.status);
  EXPECT_EQ(miss.summary.prefix_hit_tokens(), 0);
  EXPECT_THAT(miss.tokens, ElementsAreArray(hit.tokens));
  // The worker's next heartbeat hears it was forgotten, registers again and re-announces what
  // its segment still holds: hits come back without recomputing anything (bounded wait).
  int32_t hits = 0;
  for (int i = 0; i < 50 && hits == 0; ++i) {
    absl::SleepFor(absl::Milliseconds(200));
    Outcome again = Generate(prompt);
    KV_ASSERT_OK(again.status);
    EXPECT_THAT(again.tokens, ElementsAreArray(hit.tokens));
    hits = again.summary.prefix_hit_tokens();
  }
  EXPECT_EQ(hits, 64);
}

// The OpenAI HTTP front end encodes text with the tokenizer of the served model's directory
// (here a SentencePiece-style BPE tokenizer.json copied beside config.json), and its tokens are
// the co-located reference's for the same ids.
TEST_F(InProcessCluster, OpenAiHttpTextGoesThroughTheModelDirsTokenizer) {
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<tokenizer::Tokenizer> byte,
                          gateway::LoadServedTokenizer(model_dir_));
  EXPECT_EQ(byte->name(), "byte");  // no tokenizer.json: the demo models' byte tokenizer
  KV_ASSERT_OK_AND_ASSIGN(
      std::string json,
      ReadFileToString(SourceDir() + "/tokenizer/testdata/models/tiny_sp/tokenizer.json"));
  KV_ASSERT_OK(WriteFileAtomically(model_dir_ + "/tokenizer.json", json));
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<tokenizer::Tokenizer> served,
                          gateway::LoadServedTokenizer(model_dir_));
  ASSERT_NE(served->name(), "byte");
  ASSERT_GT(served->vocab_size(), tokenizer::kByteVocabSize);

  gateway::OpenAiHttpOptions options;
  options.model_name = "tiny";
  options.resolve_tenant = [](const std::string&) -> absl::StatusOr<std::string> {
    return std::string("anonymous");
  };
  KV_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<gateway::OpenAiHttpServer> http,
      gateway::OpenAiHttpServer::Start(std::move(options), gateway_.get(), served.get()));
  const std::string prompt = "hello world, hello";
  KV_ASSERT_OK_AND_ASSIGN(std::vector<int32_t> ids, served->Encode(prompt));
  ASSERT_FALSE(ids.empty());
  httplib::Client client("127.0.0.1", http->port());
  client.set_read_timeout(30, 0);
  nlohmann::json body = {
      {"model", "tiny"}, {"prompt", prompt}, {"max_tokens", 6}, {"temperature", 0}};
  httplib::Result res = client.Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  ASSERT_EQ(res->status, 200) << res->body;
  nlohmann::json reply = nlohmann::json::parse(res->body);
  EXPECT_EQ(reply["usage"]["prompt_tokens"].get<size_t>(), ids.size());
  const std::vector<int32_t> tokens = reply["choices"][0]["token_ids"].get<std::vector<int32_t>>();
  EXPECT_THAT(tokens, ElementsAreArray(Reference(ids, 6)));
  // The text is the tokenizer's decoding of the ids it knows (the model's vocab is larger).
  std::vector<int32_t> known;
  for (int32_t t : tokens) {
    if (t < served->vocab_size()) known.push_back(t);
  }
  KV_ASSERT_OK_AND_ASSIGN(std::string text, served->Decode(known, {.skip_special_tokens = true}));
  EXPECT_EQ(reply["choices"][0]["text"].get<std::string>(), text);
}

TEST_F(InProcessCluster, ReservationsHandOutUnguessableTokensAndADataPlaneKey) {
  const std::vector<int32_t> prompt = Prompt(40, 7);
  kvrelay::v1::ReserveResponse a = Reserve(0, "token-a", prompt);
  kvrelay::v1::ReserveResponse b = Reserve(0, "token-b", prompt);
  EXPECT_EQ(a.reservation_token().size(), 32u);
  EXPECT_NE(a.reservation_token(), b.reservation_token());
  EXPECT_EQ(a.data_plane_key().size(), 32u);
  EXPECT_EQ(a.data_plane_key(), b.data_plane_key());  // one per decode worker process
  EXPECT_NE(a.data_plane_key(), Reserve(1, "token-c", prompt).data_plane_key());
}

// Attack 1 of issue 13, one process: a Prefill call that names another request's slots (with
// its own token, a guessed token or an expired one) is refused before a byte is written, and
// the victim's pushed KV is used and gives the co-located tokens.
TEST_F(InProcessCluster, PushIntoAnotherReservationsSlotsIsRefusedAndTheVictimIsUnharmed) {
  const std::vector<int32_t> victim_prompt = Prompt(70, 8);
  const std::vector<int32_t> attacker_prompt = Prompt(70, 9);
  kvrelay::v1::ReserveResponse victim = Reserve(0, "victim", victim_prompt);

  // A guessed token for the victim's own request and slots, before the victim's push.
  kvrelay::v1::ReserveResponse guessed = victim;
  guessed.set_reservation_token(std::string(32, '\x5a'));
  ExpectUnauthorized(Prefill("victim", attacker_prompt, guessed).status());
  kvrelay::v1::ReserveResponse no_token = victim;
  no_token.clear_reservation_token();
  ExpectUnauthorized(Prefill("victim", attacker_prompt, no_token).status());

  // The attacker's own reservation and token, pointed at the victim's slots.
  kvrelay::v1::ReserveResponse own = Reserve(0, "attacker", attacker_prompt);
  kvrelay::v1::ReserveResponse forged = own;
  *forged.mutable_groups() = victim.groups();
  ExpectUnauthorized(Prefill("attacker", attacker_prompt, forged).status());

  // The victim's legitimate push, then the same attacks again after it.
  absl::StatusOr<kvrelay::v1::PrefillResponse> pushed = Prefill("victim", victim_prompt, victim);
  KV_ASSERT_OK(pushed.status());
  EXPECT_EQ(pushed->pushed_tokens(), 64);
  ExpectUnauthorized(Prefill("attacker", attacker_prompt, forged).status());
  // Even the victim's real token cannot push twice (the reservation is bound to its pusher).
  ExpectUnauthorized(Prefill("victim", attacker_prompt, victim).status());

  // Generate presents the token: a wrong one is refused and leaves the reservation as it was.
  ExpectUnauthorized(Decode(0, "victim", victim_prompt, guessed.reservation_token(), 64).status);
  DecodeOutcome out = Decode(0, "victim", victim_prompt, victim.reservation_token(), 64);
  KV_ASSERT_OK(out.status);
  EXPECT_THAT(out.tokens, ElementsAreArray(Reference(victim_prompt)));
  EXPECT_EQ(out.computed_tokens, 6);  // the pushed 64 tokens were used, only the tail computed
}

TEST_F(InProcessCluster, ExpiredReservationTokenIsRefused) {
  const std::vector<int32_t> prompt = Prompt(40, 10);
  kvrelay::v1::ReserveResponse lapsed = Reserve(0, "lapsed-push", prompt);
  worker_clock_.Advance(absl::Seconds(11));  // past reservation_ttl
  absl::Status refused = Prefill("lapsed-push", prompt, lapsed).status();
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kPermissionDenied));
  // The decode side's timing, not the caller's doing: attributed to the decode worker.
  std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(refused);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->reason(), kvrelay::v1::FAILURE_EXPIRED);
  EXPECT_EQ(info->role(), kvrelay::v1::ROLE_DECODE);
}

// A peer that holds the data-plane key but skips the claim, or claims its own reservation and
// writes outside it: the decode worker does not count those blocks, and a reservation whose
// pusher wrote outside its slots is not used (the prompt is computed, tokens stay right).
TEST_F(InProcessCluster, BlocksWithoutAClaimOrOutsideTheReservationAreNotUsed) {
  const std::vector<int32_t> prompt = Prompt(40, 11);
  kvrelay::v1::ReserveResponse own = Reserve(0, "rogue", prompt);
  ASSERT_EQ(own.full_blocks(), 2);
  KV_ASSERT_OK_AND_ASSIGN(transfer::TransportPtr rogue, transfer::MakeInProcessTransport());
  // Without the key the decode worker's transport refuses the connection.
  EXPECT_THAT(rogue->Connect(own.transport().address(), absl::Now() + absl::Seconds(5),
                             {.peer_key = std::string(32, 'k')}),
              StatusIs(absl::StatusCode::kPermissionDenied));
  KV_ASSERT_OK_AND_ASSIGN(transfer::PeerId peer,
                          rogue->Connect(own.transport().address(), absl::Now() + absl::Seconds(5),
                                         {.peer_key = own.data_plane_key()}));
  const kvrelay::v1::GroupTarget& g0 = own.groups(0);
  std::vector<uint8_t> junk(g0.block_bytes(), 0xab);
  KV_ASSERT_OK_AND_ASSIGN(transfer::MemoryRegionPtr src,
                          rogue->RegisterMemory({junk.data(), junk.size()}, kv::MemoryKind::kHost));
  auto push = [&](int64_t slot, const std::string& credential) -> absl::Status {
    transfer::TransferBatch batch{.peer = peer,
                                  .direction = transfer::Direction::kPut,
                                  .tag = worker::RequestTag("rogue"),
                                  .credential = credential};
    batch.blocks.push_back({.local = src.get(),
                            .remote_region = g0.region_id(),
                            .remote_offset = static_cast<uint64_t>(slot) * g0.slot_stride_bytes(),
                            .length = g0.block_bytes(),
                            .layer = 0});
    KV_ASSIGN_OR_RETURN(transfer::TransferPlan plan, rogue->Prepare(batch));
    KV_ASSIGN_OR_RETURN(transfer::TransferHandlePtr h,
                        rogue->Post(plan, transfer::LayerRange::All()));
    return h->Wait(absl::Now() + absl::Seconds(10));
  };
  // Unclaimed, right token: not counted. Then a claim of its own slots, and a write outside.
  KV_ASSERT_OK(push(g0.slots(0), own.reservation_token()));
  kvrelay::v1::PushClaim claim;
  claim.set_request_id("rogue");
  claim.set_reservation_token(own.reservation_token());
  *claim.mutable_groups() = own.groups();
  transfer::InboundQueue answers;
  rogue->SetInboundHandler(answers.Handler());
  KV_ASSERT_OK(rogue->SendControl(peer, worker::RequestTag("rogue"), claim.SerializeAsString()));
  KV_ASSERT_OK_AND_ASSIGN(
      transfer::InboundEvent answer,
      answers.NextOfKind(transfer::InboundEvent::Kind::kControl, absl::Now() + absl::Seconds(10)));
  kvrelay::v1::PushVerdict verdict;
  ASSERT_TRUE(verdict.ParseFromString(answer.message));
  EXPECT_EQ(verdict.code(), 0) << verdict.message();
  const int64_t outside = std::max(g0.slots(0), g0.slots(1)) + 1;
  KV_ASSERT_OK(push(outside, own.reservation_token()));
  DecodeOutcome out = Decode(0, "rogue", prompt, own.reservation_token(), 32);
  KV_ASSERT_OK(out.status);
  EXPECT_THAT(out.tokens, ElementsAreArray(Reference(prompt)));
  EXPECT_EQ(out.computed_tokens, 40);  // nothing pushed was used
}

// Two prefill nodes: the second pulls what the first computed. Through a transport that flips a
// byte of every fetched block, the pull is refused by its checksum and the blocks are
// recomputed (never used); without the fault the same pull delivers every block.
// A third node holds the clean phase's prompt: its link is one prefill-1 has never measured, so
// the cost model pulls (an unmeasured link is tried). Pulling it from prefill-0 again made the
// test depend on machine load: the corrupted pull's time caps that link's rate, and on a loaded
// machine the cap fell below the tiny model's compute rate, so the clean prompt was recomputed.
class ThreePrefillNodes : public InProcessCluster {
 protected:
  ThreePrefillNodes() { num_prefill_ = 3; }
};

TEST_F(ThreePrefillNodes, ACorruptedPulledBlockIsDetectedAndRecomputed) {
  const kv::ModelLayout& layout = gateway_->config().layout;
  int64_t block_bytes = 0;
  for (size_t g = 0; g < layout.groups().size(); ++g) {
    block_bytes += layout.BlockBytes(static_cast<int>(g));
  }
  // 70-token prompts: 4 full blocks pushed.
  auto run = [&](int prefill, const std::string& id,
                 const std::vector<int32_t>& prompt) -> kvrelay::v1::PrefillResponse {
    kvrelay::v1::ReserveResponse target = Reserve(0, id, prompt);
    absl::StatusOr<kvrelay::v1::PrefillResponse> r =
        PrefillOn(prefill, id, prompt, target, "shared-salt");
    EXPECT_TRUE(r.ok()) << r.status();
    DecodeOutcome out = Decode(0, id, prompt, target.reservation_token(), 64);
    EXPECT_TRUE(out.status.ok()) << out.status;
    EXPECT_THAT(out.tokens, ElementsAreArray(Reference(prompt))) << id;
    return r.ok() ? *r : kvrelay::v1::PrefillResponse();
  };
  const std::vector<int32_t> a = Prompt(70, 9);
  EXPECT_EQ(run(0, "computed-a", a).computed_tokens(), 64);

  prefill_faults_[1]->SetFaults({.corrupt = true, .only = transfer::Direction::kGet});
  kvrelay::v1::PrefillResponse refused = run(1, "corrupted-pull", a);
  EXPECT_EQ(refused.prefix_source(), "recomputed");
  EXPECT_EQ(refused.fetched_bytes(), 0);
  EXPECT_EQ(refused.computed_tokens(), 64);
  EXPECT_EQ(metrics_
                .GetCounter("kvrelay:prefill_fetch_failures_total",
                            "Pulls from other nodes that did not deliver every block, by reason.",
                            {{"model_name", "tiny"}, {"reason", "corrupt"}})
                ->value(),
            1);
  // prefill-1 kept a copy of what it recomputed: the same prompt is local there now.
  EXPECT_EQ(run(1, "local-a", a).prefix_source(), "local");

  // Without the fault, a prompt computed on prefill-2 is pulled, every block of it.
  prefill_faults_[1]->SetFaults({});
  const std::vector<int32_t> b = Prompt(70, 10);
  EXPECT_EQ(run(2, "computed-b", b).computed_tokens(), 64);
  kvrelay::v1::PrefillResponse pulled = run(1, "clean-pull", b);
  EXPECT_EQ(pulled.prefix_source(), "pulled");
  EXPECT_EQ(pulled.fetched_bytes(), 4 * block_bytes);
  EXPECT_EQ(pulled.fetched_tokens(), 64);
  EXPECT_EQ(pulled.computed_tokens(), 0);
}

// `kvrelay simulate` runs this gateway's own routing (WorkerSet, GenerateCall) and the real
// cache store, with compute and transfers replaced by cost functions. On the same requests, sent
// one at a time, its twin of this cluster must send every request to the same prefill and decode
// workers and find the same prefix cached: the routing code and its inputs (the store's holdings,
// the loads) are the same. Both gateways read a clock that stands still (this fixture's worker
// clock; the simulation's gateway_clock), so neither learns service times or rates, which would
// come from real compute here and from the profile there.
class SimulatedTwin : public InProcessCluster {
 protected:
  // The worker's node id in an address ("local-prefill:prefill-0", "sim-prefill-0:1").
  static std::string NodeIn(const std::string& address) {
    std::smatch m;
    return std::regex_search(address, m, std::regex("(prefill|decode)-[0-9]+")) ? m.str() : address;
  }
  SimulatedTwin() {
    num_prefill_ = 2;
    vocab_ = 32000;  // the simulation's prompt tokens are drawn from [1, 32000)
    prefill_cache_slots_ = 256;
    decode_pool_blocks_ = 512;
    decodes_use_store_ = true;  // as deployed: a decode worker's blocks are found and reused
    // Pull or recompute is the cost model's choice on measured link and compute rates, which
    // here come from the CPU's timing (a first pull that also connects reads as a slow link)
    // and there from the profile: both recompute what another node holds.
    prefills_pull_ = false;
    // A QueryPrefix slower than its bound (a loaded CI machine) routes by load alone, which the
    // simulation's store, in process, never does.
    route_timeout_ = absl::Seconds(10);
    gateway_clock_ = &far_ahead_;
  }
  // The gateway learns service times and rates from wall-clock calls, here from this CPU's
  // timing (under load one prefill node reads five times slower than the other). On a policy
  // clock a century ahead every learned figure has gone unrefreshed so long that it is
  // forgotten into the fleet's best (WorkerSetOptions::learned): all nodes alike, as in the
  // simulation's standing-still gateway, which learns none.
  SimulatedClock far_ahead_{absl::Now() + absl::Hours(24 * 365 * 100)};
};

TEST_F(SimulatedTwin, RoutesAndReusesExactlyAsTheSimulation) {
  const int32_t block_tokens = gateway_->config().layout.block_tokens();
  // Four users behind one system prompt (ids 1-2) and two behind prompts of their own, three
  // turns each, interleaved: each turn repeats the user's previous prompt and adds two blocks;
  // then user 0's first turn again. One request every 10 simulated seconds: each ends before
  // the next.
  std::vector<cachestore::sim::TraceRequest> trace;
  auto add = [&trace](int user, int turns) {
    cachestore::sim::TraceRequest r;
    r.timestamp_ms = static_cast<int64_t>(trace.size()) * 10000;
    r.hash_ids = {user < 4 ? 1u : 1000u + static_cast<uint64_t>(user), 2};
    for (int t = 0; t < turns; ++t) {
      r.hash_ids.push_back(static_cast<uint64_t>(100 * user + 2 * t + 10));
      r.hash_ids.push_back(static_cast<uint64_t>(100 * user + 2 * t + 11));
    }
    r.output_length = 4;
    trace.push_back(r);
  };
  for (int turn = 1; turn <= 3; ++turn) {
    for (int user = 0; user < 6; ++user) add(user, turn);
  }
  add(0, 1);

  SimulatedClock standing_still;
  sim::ClusterSpec spec;
  spec.prefill_nodes = num_prefill_;
  spec.decode_nodes = kDecode;
  spec.cache_blocks = prefill_cache_slots_;
  spec.gateway_clock = &standing_still;
  spec.pull_remote_prefix = prefills_pull_;
  sim::TrafficSpec traffic;
  traffic.tokens_per_hash_id = block_tokens;
  absl::StatusOr<sim::SimReport> twin =
      sim::Simulate(trace, spec, traffic, sim::HardwareProfile(), gateway_->config().layout);
  KV_ASSERT_OK(twin);
  ASSERT_EQ(twin->records.size(), trace.size());

  int64_t hit_here = 0, hit_there = 0, prompt = 0, held = 0;
  std::set<std::string> prefill_used, decode_used;
  for (size_t k = 0; k < trace.size(); ++k) {
    const std::vector<int32_t> tokens = sim::TracePromptTokens(trace[k], 0, block_tokens);
    const Outcome here = Generate(tokens, 4);
    KV_ASSERT_OK(here.status) << "request " << k;
    const sim::RequestRecord& there = twin->records[k];
    ASSERT_TRUE(there.ok) << "request " << k << ": " << there.code;
    EXPECT_EQ(NodeIn(here.summary.prefill_worker()), NodeIn(there.prefill))
        << "request " << k << ": " << here.summary.ShortDebugString();
    EXPECT_EQ(NodeIn(here.summary.decode_worker()), NodeIn(there.decode)) << "request " << k;
    EXPECT_EQ(here.summary.prefix_hit_tokens(), there.hit_tokens) << "request " << k;
    EXPECT_EQ(here.summary.prefix_source(), there.prefix_source) << "request " << k;
    EXPECT_EQ(here.summary.prompt_tokens(), there.prompt_tokens) << "request " << k;
    EXPECT_EQ(here.summary.attempts(), there.attempts) << "request " << k;
    hit_here += here.summary.prefix_hit_tokens();
    hit_there += there.hit_tokens;
    prompt += here.summary.prompt_tokens();
    held += here.summary.decode_held_blocks();
    prefill_used.insert(NodeIn(there.prefill));
    decode_used.insert(NodeIn(there.decode));
  }
  EXPECT_EQ(hit_here, hit_there);
  // The requests exercise the routing: prefixes are found, both roles spread over both nodes.
  EXPECT_GT(hit_here, prompt / 3) << hit_here << " of " << prompt;
  EXPECT_EQ(prefill_used.size(), 2u);
  EXPECT_EQ(decode_used.size(), 2u);
  EXPECT_GT(held, 0);  // decode workers' own blocks were found (and not pushed again)
}

}  // namespace
}  // namespace kvrelay::testing
