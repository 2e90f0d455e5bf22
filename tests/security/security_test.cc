// Issue 13's attacks, replayed against a real `kvrelay up` cluster with mutual TLS on (its
// throwaway CA; the attacker's certificates come from that same CA, so every attack below is
// made by an authenticated caller in the wrong role or for the wrong node, the strongest case).
// Each attack must fail with PERMISSION_DENIED / UNAUTHENTICATED (or not connect at all) and
// leave the victims' tokens equal to `generate --colocated`.

#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "cli/colocated.h"
#include "common/server/auth.h"
#include "common/server/credentials.h"
#include "common/server/dev_certs.h"
#include "gateway/client/gateway_client.h"
#include "gateway/tenant_auth.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "kvrelay/v1/cachestore.grpc.pb.h"
#include "kvrelay/v1/decode.grpc.pb.h"
#include "kvrelay/v1/prefill.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "proto/grpc_status.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/local_cluster.h"
#include "tests/testing/process_harness.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::e2e {
using ::kvrelay::gateway::client::GatewayClient;
using ::kvrelay::gateway::client::GatewayRequest;

namespace {

using server::PeerRole;
using server::SecurityOptions;
using ::testing::AnyOf;
using ::testing::Eq;

std::chrono::system_clock::time_point In(absl::Duration d) {
  return absl::ToChronoTime(absl::Now() + d);
}

// A denial the caller is blamed for, never a worker.
void ExpectDenied(const grpc::Status& status, const std::string& what) {
  EXPECT_THAT(status.error_code(),
              AnyOf(Eq(grpc::StatusCode::PERMISSION_DENIED), Eq(grpc::StatusCode::UNAUTHENTICATED)))
      << what << ": " << status.error_code() << " " << status.error_message();
  std::optional<v1::ErrorInfo> info = proto::GetErrorInfo(proto::FromGrpcStatus(status));
  ASSERT_TRUE(info.has_value()) << what << ": no ErrorInfo";
  EXPECT_EQ(info->role(), v1::ROLE_CLIENT) << what;
  EXPECT_EQ(info->reason(), v1::FAILURE_UNAUTHORIZED) << what;
}

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    const std::string model_dir = dir_->File("llama");
    ASSERT_THAT(WriteModel(model_dir, "llama"), testing::IsOk());
    absl::StatusOr<std::unique_ptr<cli::ColocatedGenerator>> reference =
        cli::ColocatedGenerator::Load(model_dir);
    ASSERT_THAT(reference, testing::IsOk());
    reference_ = reference->release();
    ClusterOptions options;
    options.model_dir = model_dir;
    options.prefill = 1;
    options.decode = 2;
    options.worker_args = kPatientStoreCalls;
    options.tls = true;
    options.extra_args = {"--http-address", "127.0.0.1:0"};
    absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(options);
    ASSERT_THAT(cluster, testing::IsOk());
    cluster_ = cluster->release();
    absl::StatusOr<std::unique_ptr<server::DevCertificateAuthority>> ca =
        server::DevCertificateAuthority::Open(cluster_->data_dir() + "/tls");
    ASSERT_THAT(ca, testing::IsOk());
    ca_ = ca->release();
  }
  static void TearDownTestSuite() {
    delete ca_;
    delete cluster_;
    delete reference_;
    delete dir_;
  }

  static std::string Address(const std::string& service) {
    absl::StatusOr<ServiceInfo> info = cluster_->Service(service);
    EXPECT_TRUE(info.ok()) << service;
    return info.ok() ? info->address : "";
  }
  // A certificate of the cluster's own CA.
  static SecurityOptions Issue(PeerRole role, const std::string& id) {
    absl::StatusOr<SecurityOptions> issued = ca_->Issue(role, id);
    EXPECT_TRUE(issued.ok()) << issued.status();
    return issued.ok() ? *issued : SecurityOptions{};
  }
  template <typename Service>
  static std::unique_ptr<typename Service::Stub> Stub(const std::string& address,
                                                      const SecurityOptions& security) {
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = server::MakeChannel(address, security);
    EXPECT_TRUE(channel.ok()) << channel.status();
    return Service::NewStub(*channel);
  }

  // A victim's request through the gateway with the cluster's client certificate (tenant
  // "default"): its tokens must equal the co-located reference.
  static void ExpectVictimUnharmed(uint32_t seed) {
    GatewayRequest request;
    request.generation.tokens = RandomPrompt(70, seed);
    request.generation.max_tokens = 12;
    request.tenant = "";
    absl::StatusOr<cli::GenerationResult> expected;
    {
      absl::MutexLock lock(&reference_mu_);  // one Generate at a time
      expected = reference_->Generate(request.generation);
    }
    ASSERT_THAT(expected, testing::IsOk());
    GatewayClient client(cluster_->gateway(), cluster_->client_security());
    absl::StatusOr<cli::GenerationResult> got = client.Generate(request, absl::Seconds(60));
    ASSERT_THAT(got, testing::IsOk()) << cluster_->Log();
    EXPECT_EQ(got->tokens, expected->tokens) << "victim " << seed << " got wrong tokens";
  }

  static testing::TempDir* dir_;
  static absl::Mutex reference_mu_;
  static cli::ColocatedGenerator* reference_ ABSL_PT_GUARDED_BY(reference_mu_);
  static LocalCluster* cluster_;
  static server::DevCertificateAuthority* ca_;
};

testing::TempDir* SecurityTest::dir_ = nullptr;
ABSL_CONST_INIT absl::Mutex SecurityTest::reference_mu_(absl::kConstInit);
cli::ColocatedGenerator* SecurityTest::reference_ = nullptr;
LocalCluster* SecurityTest::cluster_ = nullptr;
server::DevCertificateAuthority* SecurityTest::ca_ = nullptr;

// Attack 6: nobody without a certificate of the cluster's CA gets a connection.
TEST_F(SecurityTest, ClientsWithoutACertificateCannotConnect) {
  for (const char* service : {"gateway", "cachestore", "prefill-0", "decode-0"}) {
    auto stub = Stub<v1::Decode>(Address(service), SecurityOptions{});  // plain text
    grpc::ClientContext context;
    context.set_deadline(In(absl::Seconds(5)));
    v1::DecodeStatusResponse response;
    grpc::Status s = stub->Status(&context, {}, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE)
        << service << ": " << s.error_message();
  }
  // TLS, but a certificate from another CA.
  testing::TempDir other;
  KV_ASSERT_OK_AND_ASSIGN(auto rogue_ca, server::DevCertificateAuthority::Create(other.path()));
  KV_ASSERT_OK_AND_ASSIGN(SecurityOptions rogue, rogue_ca->Issue(PeerRole::kGateway, "gateway"));
  rogue.ca_file = cluster_->client_security().ca_file;
  GatewayClient client(cluster_->gateway(), rogue);
  GatewayRequest request;
  request.generation.tokens = RandomPrompt(20, 1);
  request.tenant = "";
  EXPECT_THAT(client.Generate(request, absl::Seconds(10)),
              testing::StatusIs(absl::StatusCode::kUnavailable));
  ExpectVictimUnharmed(100);
}

// Attack 1: Prefill calls that name decode slots, from anyone but a gateway, while two victims
// generate (the issue's replay: 32 calls overwrote every slot of both decode workers).
TEST_F(SecurityTest, OnlyGatewaysPrefillAndReserve) {
  const SecurityOptions mallory = Issue(PeerRole::kClient, "mallory");
  const SecurityOptions rogue_decode = Issue(PeerRole::kDecode, "decode-0");  // a real node id
  std::vector<std::thread> victims;
  for (uint32_t seed : {201u, 202u}) victims.emplace_back([seed] { ExpectVictimUnharmed(seed); });
  for (int round = 0; round < 16; ++round) {
    for (const SecurityOptions* attacker : {&mallory, &rogue_decode}) {
      auto prefill = Stub<v1::Prefill>(Address("prefill-0"), *attacker);
      v1::PrefillRequest request;
      request.set_request_id("attack-1");
      for (int32_t t : RandomPrompt(64, 7)) request.add_tokens(t);
      // Every slot of group 0 of a decode worker, as the issue's attacker named them.
      request.mutable_target()->set_full_blocks(4);
      request.mutable_target()->set_block_tokens(16);
      v1::GroupTarget* group = request.mutable_target()->add_groups();
      for (int slot = 0; slot < 4; ++slot) group->add_slots(slot);
      grpc::ClientContext context;
      context.set_deadline(In(absl::Seconds(10)));
      v1::PrefillResponse response;
      ExpectDenied(prefill->Prefill(&context, request, &response), "Prefill/Prefill");
      // Nor may it make workers read their disk tier into DRAM (only gateways promote).
      v1::PromoteRequest promote;
      promote.set_request_id("attack-1");
      promote.set_chain_packed(std::string(16, 'x'));
      grpc::ClientContext promote_context;
      promote_context.set_deadline(In(absl::Seconds(10)));
      v1::PromoteResponse promoted;
      ExpectDenied(prefill->Promote(&promote_context, promote, &promoted), "Prefill/Promote");

      // Attack 4's last part: Reserve calls that would fill every decode worker's slots.
      for (const char* decode : {"decode-0", "decode-1"}) {
        auto stub = Stub<v1::Decode>(Address(decode), *attacker);
        v1::ReserveRequest reserve;
        reserve.set_request_id("attack-4");
        reserve.set_prompt_tokens(32000);
        reserve.set_max_tokens(4096);
        grpc::ClientContext reserve_context;
        reserve_context.set_deadline(In(absl::Seconds(10)));
        v1::ReserveResponse reserved;
        ExpectDenied(stub->Reserve(&reserve_context, reserve, &reserved), "Decode/Reserve");
        v1::PromoteRequest promote;
        promote.set_request_id("attack-4");
        promote.set_chain_packed(std::string(16, 'x'));
        grpc::ClientContext promote_context;
        promote_context.set_deadline(In(absl::Seconds(10)));
        v1::PromoteResponse promoted;
        ExpectDenied(stub->Promote(&promote_context, promote, &promoted), "Decode/Promote");
      }
    }
  }
  for (std::thread& t : victims) t.join();
  ExpectVictimUnharmed(101);
  ExpectVictimUnharmed(102);
}

// Attack 2: Allocate + Commit of blocks by a non-worker, or by a worker for another node.
TEST_F(SecurityTest, OnlyAWorkerWritesBlocksAndOnlyForItself) {
  const SecurityOptions mallory = Issue(PeerRole::kClient, "mallory");
  const SecurityOptions gateway = Issue(PeerRole::kGateway, "gateway-evil");
  const SecurityOptions other_worker = Issue(PeerRole::kPrefill, "prefill-evil");
  struct Case {
    const SecurityOptions* who;
    std::string node_id;  // whom the request claims to be
  };
  for (const Case& c : {Case{&mallory, "prefill-0"}, Case{&gateway, "prefill-0"},
                        Case{&other_worker, "prefill-0"}, Case{&mallory, ""}}) {
    auto store = Stub<v1::CacheStore>(Address("cachestore"), *c.who);
    v1::AllocateRequest allocate;
    v1::BlockToAllocate* block = allocate.add_blocks();
    block->mutable_hash()->set_hi(1);
    block->mutable_hash()->set_lo(2);
    block->set_size_bytes(16384);
    allocate.set_node_id(c.node_id);
    allocate.set_incarnation(1);
    grpc::ClientContext context;
    context.set_deadline(In(absl::Seconds(10)));
    v1::AllocateResponse allocated;
    ExpectDenied(store->Allocate(&context, allocate, &allocated), "Allocate as " + c.node_id);

    v1::CommitRequest commit;
    commit.set_allocation_id(1);
    commit.set_node_id(c.node_id);
    grpc::ClientContext commit_context;
    commit_context.set_deadline(In(absl::Seconds(10)));
    v1::CommitResponse committed;
    ExpectDenied(store->Commit(&commit_context, commit, &committed), "Commit as " + c.node_id);
  }
  ExpectVictimUnharmed(103);
}

// Attack 4: RegisterNode with a real worker's id, in another role, or with a huge capacity.
TEST_F(SecurityTest, NodesRegisterOnlyAsThemselvesWithBoundedCapacity) {
  const SecurityOptions intruder = Issue(PeerRole::kPrefill, "prefill-evil");
  auto store = Stub<v1::CacheStore>(Address("cachestore"), intruder);
  auto registration = [](const std::string& node_id, v1::NodeRole role, int64_t slots) {
    v1::RegisterNodeRequest r;
    r.set_node_id(node_id);
    r.set_incarnation(42);
    r.set_role(role);
    v1::Segment* s = r.add_segments();
    s->set_segment_id("kv");
    s->set_tier(v1::TIER_HOST);
    s->set_capacity_slots(slots);
    s->set_slot_bytes(16384);
    return r;
  };
  for (const std::string victim : {"decode-0", "prefill-0"}) {
    grpc::ClientContext context;
    context.set_deadline(In(absl::Seconds(10)));
    v1::RegisterNodeResponse response;
    ExpectDenied(
        store->RegisterNode(&context, registration(victim, v1::NODE_ROLE_DECODE, 64), &response),
        "RegisterNode as " + victim);
  }
  {
    grpc::ClientContext context;  // its own id, but the certificate says prefill
    context.set_deadline(In(absl::Seconds(10)));
    v1::RegisterNodeResponse response;
    ExpectDenied(store->RegisterNode(
                     &context, registration("prefill-evil", v1::NODE_ROLE_DECODE, 64), &response),
                 "RegisterNode in another role");
  }
  {
    grpc::ClientContext context;  // ~8 EiB
    context.set_deadline(In(absl::Seconds(10)));
    v1::RegisterNodeResponse response;
    grpc::Status s = store->RegisterNode(
        &context, registration("prefill-evil", v1::NODE_ROLE_PREFILL, int64_t{1} << 50), &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  }
  // Heartbeat / Deregister of a victim node.
  {
    v1::DeregisterNodeRequest request;
    request.set_node_id("decode-0");
    request.set_incarnation(1);
    grpc::ClientContext context;
    context.set_deadline(In(absl::Seconds(10)));
    v1::DeregisterNodeResponse response;
    ExpectDenied(store->DeregisterNode(&context, request, &response), "DeregisterNode decode-0");
  }
  ExpectVictimUnharmed(104);
  ExpectVictimUnharmed(105);
}

// Attack 3: the tenant is the credential's, never the request field's; tenants see nothing of
// each other (no prefix reuse, no events, no registry).
TEST_F(SecurityTest, TenantsAreAuthenticatedAndIsolated) {
  const std::vector<int32_t> prompt = RandomPrompt(96, 4242);
  auto generate = [&](const SecurityOptions& security, const std::string& tenant,
                      const std::string& token) {
    GatewayClient client(cluster_->gateway(), security, token);
    GatewayRequest request;
    request.generation.tokens = prompt;
    request.generation.max_tokens = 6;
    request.tenant = tenant;
    return client.Generate(request, absl::Seconds(60));
  };
  const SecurityOptions alice = Issue(PeerRole::kClient, "alice");
  const SecurityOptions bob = Issue(PeerRole::kClient, "bob");

  // Alice's prompt twice: the second reuses her cached prefix.
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult first, generate(alice, "", ""));
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult second, generate(alice, "alice", ""));
  EXPECT_GT(second.prefix_hit_tokens, 0);
  EXPECT_EQ(second.tokens, first.tokens);

  // Bob calling himself alice is refused; as himself he reuses nothing of hers.
  EXPECT_THAT(generate(bob, "alice", ""), testing::StatusIs(absl::StatusCode::kPermissionDenied));
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult as_bob, generate(bob, "", ""));
  EXPECT_EQ(as_bob.prefix_hit_tokens, 0) << "bob reused alice's prefix";
  EXPECT_EQ(as_bob.tokens, first.tokens);  // same model, same prompt: same tokens

  // Bearer tokens: one signed with the cluster's key names its tenant; a forged one does not.
  const SecurityOptions admin = Issue(PeerRole::kAdmin, "ops");
  KV_ASSERT_OK_AND_ASSIGN(auto keys, gateway::TenantTokenVerifier::FromKeyFile(
                                         cluster_->data_dir() + "/tenant-token-keys"));
  const std::string carol = keys.SignWithFirstKey("carol", absl::Now() + absl::Minutes(5));
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult as_carol, generate(admin, "", carol));
  EXPECT_EQ(as_carol.prefix_hit_tokens, 0);
  const std::string forged = gateway::TenantTokenVerifier::Sign("not-the-cluster-key-0123", "alice",
                                                                absl::Now() + absl::Minutes(5));
  EXPECT_THAT(generate(admin, "", forged), testing::StatusIs(absl::StatusCode::kUnauthenticated));
  const std::string expired = keys.SignWithFirstKey("alice", absl::Now() - absl::Seconds(1));
  EXPECT_THAT(generate(admin, "", expired), testing::StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_THAT(generate(admin, "", ""), testing::StatusIs(absl::StatusCode::kUnauthenticated));

  // A tenant sees neither the event stream, nor prefix matches, nor the registry.
  auto store = Stub<v1::CacheStore>(Address("cachestore"), bob);
  {
    grpc::ClientContext context;
    context.set_deadline(In(absl::Seconds(5)));
    v1::WatchEventsRequest request;
    request.set_from_sequence(1);
    auto reader = store->WatchEvents(&context, request);
    v1::Event event;
    EXPECT_FALSE(reader->Read(&event));
    ExpectDenied(reader->Finish(), "WatchEvents");
  }
  {
    grpc::ClientContext context;
    context.set_deadline(In(absl::Seconds(5)));
    v1::MatchPrefixRequest request;
    v1::BlockHash* h = request.add_chain();
    h->set_hi(1);
    h->set_lo(1);
    v1::MatchPrefixResponse response;
    ExpectDenied(store->MatchPrefix(&context, request, &response), "MatchPrefix");
  }
  {
    grpc::ClientContext context;
    context.set_deadline(In(absl::Seconds(5)));
    v1::QueryPrefixRequest request;
    v1::QueryPrefixResponse response;
    ExpectDenied(store->QueryPrefix(&context, request, &response), "QueryPrefix");
  }
  {
    grpc::ClientContext context;
    context.set_deadline(In(absl::Seconds(5)));
    v1::ListNodesResponse response;
    ExpectDenied(store->ListNodes(&context, {}, &response), "ListNodes");
  }
  ExpectVictimUnharmed(106);
}

// The OpenAI-compatible HTTP front end (HTTPS with TLS on) takes the tenant only from a bearer
// token it verifies.
TEST_F(SecurityTest, HttpTakesTheTenantFromAVerifiedBearerToken) {
  // "[gateway] gateway http listening on 127.0.0.1:PORT" in up's output.
  const std::string log = cluster_->Log();
  const std::string marker = "gateway http listening on 127.0.0.1:";
  const size_t at = log.find(marker);
  ASSERT_NE(at, std::string::npos) << log;
  const int port = std::atoi(log.c_str() + at + marker.size());
  ASSERT_GT(port, 0);
  httplib::SSLClient client("127.0.0.1", port);
  client.set_ca_cert_path(cluster_->client_security().ca_file.c_str());
  client.enable_server_certificate_verification(true);
  client.set_read_timeout(60, 0);
  const std::string body =
      R"({"model": "llama", "prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 3})";
  auto post = [&](const std::string& authorization) {
    httplib::Headers headers;
    if (!authorization.empty()) headers.emplace("Authorization", authorization);
    return client.Post("/v1/completions", headers, body, "application/json");
  };
  KV_ASSERT_OK_AND_ASSIGN(auto keys, gateway::TenantTokenVerifier::FromKeyFile(
                                         cluster_->data_dir() + "/tenant-token-keys"));
  httplib::Result ok =
      post("Bearer " + keys.SignWithFirstKey("dave", absl::Now() + absl::Hours(1)));
  ASSERT_TRUE(ok) << httplib::to_string(ok.error());
  EXPECT_EQ(ok->status, 200) << ok->body;
  httplib::Result none = post("");
  ASSERT_TRUE(none);
  EXPECT_EQ(none->status, 401) << none->body;
  httplib::Result forged =
      post("Bearer " + gateway::TenantTokenVerifier::Sign("some-other-key-0123456", "dave",
                                                          absl::Now() + absl::Hours(1)));
  ASSERT_TRUE(forged);
  EXPECT_EQ(forged->status, 401) << forged->body;
}

// Attack 4's "anyone can release others' work": a decode reservation is released only with its
// token, even by a caller that may call Release (a gateway).
TEST_F(SecurityTest, DecodeReleaseNeedsTheReservationToken) {
  const SecurityOptions gateway_a = Issue(PeerRole::kGateway, "gateway-a");
  const SecurityOptions gateway_b = Issue(PeerRole::kGateway, "gateway-b");
  auto owner = Stub<v1::Decode>(Address("decode-0"), gateway_a);
  auto other = Stub<v1::Decode>(Address("decode-0"), gateway_b);
  v1::DecodeStatusResponse status;
  {
    grpc::ClientContext context;
    context.set_deadline(In(absl::Seconds(10)));
    ASSERT_TRUE(owner->Status(&context, {}, &status).ok());
  }
  v1::ReserveRequest reserve;
  reserve.set_request_id("release-victim");
  reserve.set_model(status.model());
  reserve.set_prompt_tokens(10);  // no full block: a release frees it at the next Reserve
  reserve.set_max_tokens(4);
  reserve.set_layout_fingerprint(status.layout_fingerprint());
  v1::ReserveResponse held;
  {
    grpc::ClientContext context;
    context.set_deadline(In(absl::Seconds(10)));
    grpc::Status s = owner->Reserve(&context, reserve, &held);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  auto release = [](v1::Decode::Stub* stub, const std::string& token) {
    v1::ReleaseRequest request;
    request.set_request_id("release-victim");
    request.set_reservation_token(token);
    grpc::ClientContext context;
    context.set_deadline(In(absl::Seconds(10)));
    v1::ReleaseResponse response;
    return stub->Release(&context, request, &response);
  };
  std::string forged = held.reservation_token();
  forged.back() ^= 0x40;
  ExpectDenied(release(other.get(), ""), "Release without the token");
  ExpectDenied(release(other.get(), forged), "Release with a forged token");
  ExpectDenied(release(owner.get(), forged), "Release by the owner with a forged token");
  grpc::Status released = release(owner.get(), held.reservation_token());
  EXPECT_TRUE(released.ok()) << released.error_message();
  ExpectVictimUnharmed(107);
}

// `kvrelay bench-serve` speaks mutual TLS with the same flags as `generate`; plain text only
// when asked for.
TEST_F(SecurityTest, BenchServeSpeaksMutualTls) {
  const SecurityOptions& client = cluster_->client_security();
  KV_ASSERT_OK_AND_ASSIGN(testing::CommandResult run,
                          testing::RunCommand({testing::BinaryPath("kvrelay"),
                                               "bench-serve",
                                               "--gateway",
                                               cluster_->gateway(),
                                               "--tls-cert",
                                               client.cert_file,
                                               "--tls-key",
                                               client.key_file,
                                               "--tls-ca",
                                               client.ca_file,
                                               "--model",
                                               dir_->File("llama"),
                                               "--num-requests",
                                               "4",
                                               "--input-tokens",
                                               "40",
                                               "--output-tokens",
                                               "4",
                                               "--concurrency",
                                               "2",
                                               "--verify",
                                               "--wait-ready",
                                               "30s",
                                               "--json",
                                               "-",
                                               "--quiet"},
                                              absl::Seconds(120)));
  ASSERT_EQ(run.exit_code, 0) << run.stderr_text << run.stdout_text;
  nlohmann::json report = nlohmann::json::parse(run.stdout_text, nullptr, false);
  ASSERT_TRUE(report.is_object()) << run.stdout_text;
  const nlohmann::json& summary = report["runs"][0]["summary"];
  EXPECT_EQ(summary["ok"].get<int>(), 4) << summary.dump();
  EXPECT_EQ(summary["verified"].get<int>(), 4) << summary.dump();
  EXPECT_EQ(summary["wrong_tokens"].get<int>(), 0) << summary.dump();
  // Neither TLS flags nor --insecure: refused before anything is sent.
  KV_ASSERT_OK_AND_ASSIGN(
      testing::CommandResult bare,
      testing::RunCommand({testing::BinaryPath("kvrelay"), "bench-serve", "--gateway",
                           cluster_->gateway(), "--num-requests", "1"}));
  EXPECT_EQ(bare.exit_code, 2) << bare.stderr_text;
  EXPECT_THAT(bare.stderr_text, ::testing::HasSubstr("--insecure"));
}

// scripts/certs.sh (openssl) makes certificates the servers accept, with the roles they name.
TEST(CertsScript, IssuesCertificatesTheServersAccept) {
  testing::TempDir dir;
  const std::string certs = dir.File("certs");
  KV_ASSERT_OK_AND_ASSIGN(
      testing::CommandResult made,
      testing::RunCommand({"/bin/bash", testing::SourceDir() + "/scripts/certs.sh", certs,
                           "store/cachestore", "admin/ops", "client/eve", "prefill/prefill-a"}));
  ASSERT_EQ(made.exit_code, 0) << made.stderr_text;
  KV_ASSERT_OK_AND_ASSIGN(
      auto store,
      testing::ChildProcess::Start(
          {testing::BinaryPath("kvrelay"), "cachestore", "--port", "0", "--metrics-port", "0",
           "--tls-cert", certs + "/store-cachestore.pem", "--tls-key",
           certs + "/store-cachestore.key", "--tls-ca", certs + "/ca.pem"}));
  KV_ASSERT_OK_AND_ASSIGN(std::string line,
                          store->WaitForOutput("listening on", absl::Seconds(30)));
  // "cachestore listening on HOST:PORT metrics HOST:PORT"
  std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
  ASSERT_GE(words.size(), 4u) << line;
  const std::string address = words[3];
  auto stats = [&](const std::string& who) {
    SecurityOptions security;
    security.insecure = false;
    security.cert_file = absl::StrCat(certs, "/", who, ".pem");
    security.key_file = absl::StrCat(certs, "/", who, ".key");
    security.ca_file = certs + "/ca.pem";
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = server::MakeChannel(address, security);
    EXPECT_TRUE(channel.ok());
    grpc::ClientContext context;
    context.set_deadline(In(absl::Seconds(10)));
    v1::StatsResponse response;
    return v1::CacheStore::NewStub(*channel)->Stats(&context, {}, &response);
  };
  grpc::Status as_admin = stats("admin-ops");
  EXPECT_TRUE(as_admin.ok()) << as_admin.error_message();
  ExpectDenied(stats("client-eve"), "Stats as a client");
  // A worker is the node its certificate names: another --node-id or role does not start.
  const std::vector<std::string> prefill_tls = {"--tls-cert",   certs + "/prefill-prefill-a.pem",
                                                "--tls-key",    certs + "/prefill-prefill-a.key",
                                                "--tls-ca",     certs + "/ca.pem",
                                                "--model",      dir.path(),
                                                "--cachestore", address};
  for (const auto& [command, extra, complaint] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"prefill", "prefill-b", "differs from the certificate's node id"},
           {"decode", "prefill-a", "is a prefill certificate, not a decode one"}}) {
    std::vector<std::string> argv = {testing::BinaryPath("kvrelay"), command, "--node-id", extra};
    argv.insert(argv.end(), prefill_tls.begin(), prefill_tls.end());
    KV_ASSERT_OK_AND_ASSIGN(testing::CommandResult r, testing::RunCommand(argv));
    EXPECT_EQ(r.exit_code, 2) << command;
    EXPECT_THAT(r.stderr_text, ::testing::HasSubstr(complaint)) << r.stderr_text;
  }
  // The store refuses to start in plain text unless told so.
  KV_ASSERT_OK_AND_ASSIGN(testing::CommandResult plain,
                          testing::RunCommand({testing::BinaryPath("kvrelay"), "cachestore",
                                               "--port", "0", "--metrics-port", "0"}));
  EXPECT_EQ(plain.exit_code, 2);
  EXPECT_THAT(plain.stderr_text, ::testing::HasSubstr("--insecure"));
}

}  // namespace
}  // namespace kvrelay::e2e
