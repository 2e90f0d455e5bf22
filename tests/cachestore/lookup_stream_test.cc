// MatchPrefixStream (issue 19): CacheStoreClient's lookups on one stream per store instance
// answer exactly what unary MatchPrefix answers, against the real `kvrelay cachestore` process
// (plain text and mutual TLS); a stream broken mid-flight gives the caller a clear status within
// its deadline and the next call succeeds; a store without the RPC gets unary calls; the client
// follows a leader switch on the stream and drops answers of an older term (scripted stores).

#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "cachestore/client/cache_store_client.h"
#include "common/server/credentials.h"
#include "common/server/dev_certs.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kv/block_hash.h"
#include "proto/grpc_status.h"
#include "proto/limits.h"
#include "tests/testing/process_harness.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::cachestore {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::kvrelay::testing::ChildProcess;
using ::kvrelay::testing::IsOk;
using ::kvrelay::testing::StatusIs;
using ::testing::HasSubstr;

std::vector<kv::BlockHash> Chain(const std::string& salt, int n, int start = 0) {
  std::vector<int32_t> tokens;
  for (int i = 0; i < n * 16; ++i) tokens.push_back(start + i);
  return kv::HashChain(kv::LayoutFingerprint{}, salt, tokens, 16);
}

// Waits (bounded) until every thread of `pid` is stopped: kill(SIGSTOP) returns before that.
bool WaitUntilStopped(pid_t pid) {
  for (int i = 0; i < 500; ++i) {
    std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
    std::string line;
    std::getline(stat, line);
    const size_t paren = line.rfind(')');
    if (paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'T') {
      return true;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

int Matched(CacheStoreClient& client, const std::vector<kv::BlockHash>& chain) {
  absl::StatusOr<v1::MatchPrefixResponse> r = client.MatchPrefix(chain);
  EXPECT_THAT(r, IsOk());
  return r.ok() ? r->matched() : -1;
}

// The count of the store's kvrelay:cachestore_rpc_seconds histogram for `rpc`.
int64_t RpcCount(int metrics_port, const std::string& rpc) {
  const std::string metrics = testing::HttpGet(metrics_port, "/metrics");
  const std::string prefix =
      absl::StrCat("kvrelay:cachestore_rpc_seconds_count{rpc=\"", rpc, "\"} ");
  for (absl::string_view line : absl::StrSplit(metrics, '\n')) {
    if (!absl::StartsWith(line, prefix)) continue;
    double v = 0;
    if (absl::SimpleAtod(line.substr(prefix.size()), &v)) return static_cast<int64_t>(v);
  }
  return -1;
}

class LookupStreamProcessTest : public ::testing::Test {
 protected:
  // Starts the store (again on the same port once it has one) with its log in dir_.
  void Start(const std::vector<std::string>& extra = {}) {
    std::vector<std::string> argv = {testing::BinaryPath("kvrelay"),
                                     "cachestore",
                                     "--port",
                                     absl::StrCat(port_),
                                     "--metrics-port",
                                     "0",
                                     "--data-dir",
                                     dir_.File("data"),
                                     "--tick",
                                     "20ms"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    if (std::find(extra.begin(), extra.end(), "--tls-cert") == extra.end()) {
      argv.push_back("--insecure");
    }
    KV_ASSERT_OK_AND_ASSIGN(proc_, ChildProcess::Start(argv));
    KV_ASSERT_OK_AND_ASSIGN(std::string line,
                            proc_->WaitForOutput("cachestore listening on", absl::Seconds(30)));
    // "cachestore listening on 127.0.0.1:PORT metrics 127.0.0.1:PORT"
    std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
    ASSERT_GE(words.size(), 6u) << line;
    target_ = words[3];
    ASSERT_TRUE(absl::SimpleAtoi(target_.substr(target_.rfind(':') + 1), &port_));
    const std::string metrics = words[5];
    ASSERT_TRUE(absl::SimpleAtoi(metrics.substr(metrics.rfind(':') + 1), &metrics_port_));
  }
  std::unique_ptr<CacheStoreClient> Client(bool stream, NodeIdentity node = {},
                                           server::SecurityOptions security = {}) {
    CacheStoreClient::Options o;
    o.lookup_stream = stream;
    o.node = std::move(node);
    o.timeout = absl::Seconds(10);
    if (!security.cert_file.empty()) o.security = std::move(security);
    auto c = CacheStoreClient::Connect(target_, o);
    EXPECT_THAT(c, IsOk());
    if (!c.ok()) return nullptr;
    EXPECT_THAT((*c)->WaitForReady(absl::Seconds(10)), IsOk());
    return *std::move(c);
  }
  // Registers `node` (a worker with one 1 MiB-slot segment) through `client` and stores chains.
  static void RegisterAndStore(CacheStoreClient& client,
                               const std::vector<std::vector<kv::BlockHash>>& chains) {
    CacheStoreClient::Registration reg;
    reg.role = v1::NODE_ROLE_PREFILL;
    reg.grpc_address = "127.0.0.1:7100";
    reg.transport_kind = "ucx";
    reg.transport_address = "127.0.0.1:13337";
    reg.ttl = absl::Seconds(60);
    v1::Segment seg;
    seg.set_segment_id("kv");
    seg.set_tier(v1::TIER_HOST);
    seg.set_capacity_slots(4096);
    seg.set_slot_bytes(1 << 20);
    seg.set_memory_key("segment-key");
    reg.segments.push_back(seg);
    ASSERT_THAT(client.Register(reg), IsOk());
    for (const auto& chain : chains) {
      KV_ASSERT_OK_AND_ASSIGN(v1::AllocateResponse a, client.AllocateChain(chain, 1 << 20));
      KV_ASSERT_OK_AND_ASSIGN(int n, client.Commit(a.allocation_id()));
      ASSERT_EQ(n, static_cast<int>(chain.size()));
    }
  }

  testing::TempDir dir_;
  int port_ = 0;
  std::unique_ptr<ChildProcess> proc_;
  std::string target_;
  int metrics_port_ = 0;
};

TEST_F(LookupStreamProcessTest, StreamedAnswersEqualUnaryAnswers) {
  Start();
  const NodeIdentity me{"prefill-a", CacheStoreClient::NewIncarnation()};
  auto worker_stream = Client(true, me);
  auto worker_unary = Client(false, me);
  auto anonymous_stream = Client(true);
  auto anonymous_unary = Client(false);
  const std::vector<kv::BlockHash> stored = Chain("t", 40);
  RegisterAndStore(*worker_stream, {stored, Chain("t", 8, 5000)});
  std::vector<kv::BlockHash> longer = Chain("t", 64);  // shares the first 40 blocks
  const std::vector<std::vector<kv::BlockHash>> queries = {
      stored, longer, {stored.begin(), stored.begin() + 1}, Chain("t", 8, 5000), Chain("u", 40)};
  const int64_t unary_before = RpcCount(metrics_port_, "MatchPrefix");
  int lookups = 0;
  for (const auto& chain : queries) {
    for (absl::Duration lease : {absl::ZeroDuration(), absl::Seconds(30)}) {
      for (auto* pair : {&worker_stream, &anonymous_stream}) {
        CacheStoreClient& streamed = **pair;
        CacheStoreClient& unary = pair == &worker_stream ? *worker_unary : *anonymous_unary;
        KV_ASSERT_OK_AND_ASSIGN(v1::MatchPrefixResponse a, streamed.MatchPrefix(chain, lease));
        KV_ASSERT_OK_AND_ASSIGN(v1::MatchPrefixResponse b, unary.MatchPrefix(chain, lease));
        ++lookups;
        // Lease ids are random: both present or both absent, then compared without them.
        EXPECT_EQ(a.lease_id() != 0, b.lease_id() != 0);
        if (a.lease_id() != 0) {
          EXPECT_THAT(streamed.ReleaseLease(a.lease_id()), IsOk());
          EXPECT_THAT(unary.ReleaseLease(b.lease_id()), IsOk());
        }
        a.clear_lease_id();
        b.clear_lease_id();
        EXPECT_TRUE(MessageDifferencer::Equals(a, b))
            << "stream: " << a.ShortDebugString() << "\nunary: " << b.ShortDebugString();
        // How to read a segment goes only to the leased worker, on both paths.
        const bool keyed = a.segments_size() > 0 && !a.segments(0).memory_key().empty();
        EXPECT_EQ(keyed, pair == &worker_stream && lease > absl::ZeroDuration() && a.matched() > 0);
      }
    }
  }
  EXPECT_EQ(Matched(*worker_stream, longer), 40);
  EXPECT_EQ(Matched(*anonymous_stream, Chain("u", 40)), 0);
  // The streamed lookups went over the stream: the unary count grew by the unary ones only.
  EXPECT_EQ(RpcCount(metrics_port_, "MatchPrefix") - unary_before, lookups);
  EXPECT_GE(RpcCount(metrics_port_, "MatchPrefixStream"), lookups + 2);
}

TEST_F(LookupStreamProcessTest, TenantsDoNotShareBlocksOnTheStream) {
  Start();
  auto worker = Client(true, {"prefill-a", CacheStoreClient::NewIncarnation()});
  RegisterAndStore(*worker, {Chain("salt-alice", 16)});
  auto client = Client(true);
  EXPECT_EQ(Matched(*client, Chain("salt-alice", 16)), 16);
  // Same tokens, another tenant's salt: nothing in common.
  EXPECT_EQ(Matched(*client, Chain("salt-bob", 16)), 0);
}

TEST_F(LookupStreamProcessTest, ABadLookupIsAnsweredLikeUnaryAndTheStreamGoesOn) {
  Start();
  auto worker = Client(true, {"prefill-a", CacheStoreClient::NewIncarnation()});
  RegisterAndStore(*worker, {Chain("t", 4)});
  auto streamed = Client(true);
  auto unary = Client(false);
  const std::vector<kv::BlockHash> too_long = Chain("t", 4097);
  absl::StatusOr<v1::MatchPrefixResponse> a = streamed->MatchPrefix(too_long);
  absl::StatusOr<v1::MatchPrefixResponse> b = unary->MatchPrefix(too_long);
  EXPECT_THAT(a, StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("chain_packed")));
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(a.status().code(), b.status().code());
  EXPECT_EQ(a.status().message(), b.status().message());
  std::optional<v1::ErrorInfo> ia = proto::GetErrorInfo(a.status());
  std::optional<v1::ErrorInfo> ib = proto::GetErrorInfo(b.status());
  ASSERT_TRUE(ia.has_value() && ib.has_value());
  EXPECT_EQ(ia->reason(), v1::FAILURE_INVALID_REQUEST);
  EXPECT_TRUE(MessageDifferencer::Equals(*ia, *ib));
  // A lease TTL out of range, then a good lookup on the same client.
  EXPECT_THAT(streamed->MatchPrefix(Chain("t", 4), absl::Minutes(11)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lease_ttl_ms")));
  EXPECT_EQ(Matched(*streamed, Chain("t", 4)), 4);
}

// Every answer reaches its own caller: threads sharing one stream each get their own answer
// (chains of different lengths, so a misrouted answer shows), and callers with a short deadline
// that leave while others wait neither lose nor steal answers.
TEST_F(LookupStreamProcessTest, ThreadsSharingOneStreamEachGetTheirOwnAnswer) {
  Start();
  auto worker = Client(true, {"prefill-a", CacheStoreClient::NewIncarnation()});
  RegisterAndStore(*worker, {Chain("t", 64)});
  auto client = Client(true);
  ASSERT_EQ(Matched(*client, Chain("t", 64)), 64);  // the stream is open
  const int64_t unary_before = RpcCount(metrics_port_, "MatchPrefix");
  constexpr int kThreads = 8, kLookups = 150;
  std::atomic<int> wrong{0}, failed{0}, hurried{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::vector<kv::BlockHash> chain = Chain("t", 8 + t);
      for (int i = 0; i < kLookups; ++i) {
        CallOptions call;
        // Every other thread in a hurry: 1 ms, often shorter than the answer takes.
        const bool hurry = t % 2 == 1;
        call.deadline = absl::Now() + (hurry ? absl::Milliseconds(1) : absl::Seconds(10));
        absl::StatusOr<v1::MatchPrefixResponse> r =
            client->MatchPrefix(chain, absl::ZeroDuration(), call);
        if (!r.ok()) {
          if (hurry && absl::IsDeadlineExceeded(r.status())) {
            ++hurried;
          } else {
            ++failed;
          }
        } else if (r->matched() != 8 + t) {
          ++wrong;
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(failed.load(), 0);
  // Every lookup went over the stream, none fell back to unary calls.
  EXPECT_EQ(RpcCount(metrics_port_, "MatchPrefix"), unary_before);
  // The stream still serves after callers left at their deadlines.
  EXPECT_EQ(Matched(*client, Chain("t", 64)), 64);
  std::printf("lookups that gave up at their 1 ms deadline: %d of %d\n", hurried.load(),
              kThreads / 2 * kLookups);
}

// --- Batches (several lookups in one stream message) ------------------------------------------

// A MatchPrefixRequest as CacheStoreClient builds it: the packed chain, the columnar answer.
v1::MatchPrefixRequest PackedRequest(const std::vector<kv::BlockHash>& chain,
                                     int64_t lease_ttl_ms = 0, const NodeIdentity& node = {}) {
  v1::MatchPrefixRequest r;
  for (const kv::BlockHash& h : chain) {
    const std::array<uint8_t, 16> bytes = h.ToBytes();
    r.mutable_chain_packed()->append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }
  r.set_lease_ttl_ms(lease_ttl_ms);
  r.set_columnar(true);
  r.set_node_id(node.node_id);
  r.set_incarnation(node.incarnation);
  return r;
}

void AddLookup(v1::MatchPrefixStreamRequest* message, uint64_t id, v1::MatchPrefixRequest request,
               int64_t timeout_ms = 10000) {
  v1::MatchPrefixStreamRequest* lookup = message->add_lookups();
  lookup->set_id(id);
  *lookup->mutable_request() = std::move(request);
  lookup->set_timeout_ms(timeout_ms);
}

// A lookup's answer as the status CacheStoreClient makes of it.
absl::Status StatusOf(const v1::MatchPrefixStreamResponse& answer) {
  if (answer.code() == 0) return absl::OkStatus();
  absl::Status s(static_cast<absl::StatusCode>(answer.code()), answer.message());
  return answer.has_error_info() ? proto::WithErrorInfo(std::move(s), answer.error_info()) : s;
}

// The raw stream (the synchronous API), to send messages exactly as the test writes them.
struct RawStream {
  RawStream(const std::string& target, const server::SecurityOptions& security = {}) {
    absl::StatusOr<std::shared_ptr<grpc::Channel>> ch = server::MakeChannel(target, security);
    EXPECT_THAT(ch, IsOk());
    channel = *ch;
    stub = v1::CacheStore::NewStub(channel);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    stream = stub->MatchPrefixStream(&ctx);
  }
  // Writes `message` and reads its answer; false when the stream ended instead.
  bool Ask(const v1::MatchPrefixStreamRequest& message, v1::MatchPrefixStreamResponse* answer) {
    return stream->Write(message) && stream->Read(answer);
  }
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::CacheStore::Stub> stub;
  grpc::ClientContext ctx;
  std::unique_ptr<
      grpc::ClientReaderWriter<v1::MatchPrefixStreamRequest, v1::MatchPrefixStreamResponse>>
      stream;
};

double StreamMessages(int metrics_port) {
  const std::string metrics = testing::HttpGet(metrics_port, "/metrics");
  const std::string prefix = "kvrelay:cachestore_lookup_stream_messages_total ";
  for (absl::string_view line : absl::StrSplit(metrics, '\n')) {
    double v = 0;
    if (absl::StartsWith(line, prefix) && absl::SimpleAtod(line.substr(prefix.size()), &v)) {
      return v;
    }
  }
  return -1;
}

TEST_F(LookupStreamProcessTest, ABatchIsAnsweredInOneMessageAsUnaryAnswersEachLookup) {
  Start();
  auto worker = Client(true, {"prefill-a", CacheStoreClient::NewIncarnation()});
  RegisterAndStore(*worker, {Chain("t", 32), Chain("u", 16)});
  RawStream raw(target_);
  // The store says it takes batches.
  v1::MatchPrefixStreamRequest single;
  single.set_id(7);
  *single.mutable_request() = PackedRequest(Chain("t", 32));
  single.set_timeout_ms(10000);
  v1::MatchPrefixStreamResponse first;
  ASSERT_TRUE(raw.Ask(single, &first));
  EXPECT_EQ(first.id(), 7u);
  EXPECT_EQ(first.response().matched(), 32);
  EXPECT_EQ(first.answers_size(), 0);
  const auto& metadata = raw.ctx.GetServerInitialMetadata();
  auto batch_key = metadata.find(limits::kLookupBatchMetadataKey);
  ASSERT_NE(batch_key, metadata.end());
  EXPECT_EQ(std::string(batch_key->second.data(), batch_key->second.size()), "64");

  // Whole, partial and missed chains, another salt, and one the store refuses.
  const std::vector<std::vector<kv::BlockHash>> chains = {Chain("t", 32), Chain("t", 48),
                                                          Chain("u", 16), Chain("u", 8),
                                                          Chain("v", 8),  Chain("t", 4097)};
  const double messages_before = StreamMessages(metrics_port_);
  v1::MatchPrefixStreamRequest batch;
  for (size_t i = 0; i < chains.size(); ++i) AddLookup(&batch, 100 + i, PackedRequest(chains[i]));
  v1::MatchPrefixStreamResponse answer;
  ASSERT_TRUE(raw.Ask(batch, &answer));
  EXPECT_EQ(StreamMessages(metrics_port_), messages_before + 1);
  ASSERT_EQ(answer.answers_size(), static_cast<int>(chains.size()));
  EXPECT_EQ(answer.id(), 0u);
  EXPECT_FALSE(answer.has_response());
  for (size_t i = 0; i < chains.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("lookup ", i));
    const v1::MatchPrefixStreamResponse& a = answer.answers(static_cast<int>(i));
    EXPECT_EQ(a.id(), 100 + i);
    grpc::ClientContext unary_ctx;
    v1::MatchPrefixResponse unary;
    const grpc::Status u = raw.stub->MatchPrefix(&unary_ctx, PackedRequest(chains[i]), &unary);
    EXPECT_EQ(static_cast<int>(a.code()), static_cast<int>(u.error_code()));
    if (u.ok()) {
      EXPECT_TRUE(MessageDifferencer::Equals(a.response(), unary)) << a.response().DebugString();
    } else {
      EXPECT_EQ(a.message(), u.error_message());
      std::optional<v1::ErrorInfo> info = proto::GetErrorInfo(StatusOf(a));
      ASSERT_TRUE(info.has_value());
      EXPECT_EQ(info->reason(), v1::FAILURE_INVALID_REQUEST);
    }
  }
  EXPECT_EQ(answer.answers(0).response().matched(), 32);
  EXPECT_EQ(answer.answers(1).response().matched(), 32);
  EXPECT_EQ(answer.answers(3).response().matched(), 8);
  EXPECT_EQ(answer.answers(4).response().matched(), 0);
  EXPECT_THAT(StatusOf(answer.answers(5)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("chain_packed")));

  // A single lookup (an older client's message) on the same stream after the batch.
  single.set_id(8);
  ASSERT_TRUE(raw.Ask(single, &answer));
  EXPECT_EQ(answer.id(), 8u);
  EXPECT_EQ(answer.response().matched(), 32);
  EXPECT_EQ(answer.answers_size(), 0);
  raw.stream->WritesDone();
  EXPECT_TRUE(raw.stream->Finish().ok());
}

TEST_F(LookupStreamProcessTest, InABatchOnlyTheLookupTheCallerMayNotMakeFails) {
  const std::string tls = dir_.File("tls");
  ASSERT_EQ(::mkdir(tls.c_str(), 0700), 0);
  KV_ASSERT_OK_AND_ASSIGN(auto ca, server::DevCertificateAuthority::Create(tls));
  KV_ASSERT_OK_AND_ASSIGN(server::SecurityOptions store_cert,
                          ca->Issue(server::PeerRole::kStore, "cachestore"));
  Start(server::DevCertificateAuthority::Flags(store_cert));
  KV_ASSERT_OK_AND_ASSIGN(server::SecurityOptions prefill_a,
                          ca->Issue(server::PeerRole::kPrefill, "prefill-a"));
  const NodeIdentity me{"prefill-a", CacheStoreClient::NewIncarnation()};
  auto worker = Client(true, me, prefill_a);
  RegisterAndStore(*worker, {Chain("salt-alice", 8)});

  RawStream raw(target_, prefill_a);
  v1::MatchPrefixStreamRequest batch;
  AddLookup(&batch, 1, PackedRequest(Chain("salt-alice", 8), 30000, me));  // leased, as itself
  AddLookup(&batch, 2, PackedRequest(Chain("salt-bob", 8), 0, me));        // another tenant's chain
  AddLookup(&batch, 3, PackedRequest(Chain("salt-alice", 8), 30000, {"prefill-b", 7}));
  AddLookup(&batch, 4, PackedRequest(Chain("salt-alice", 8), 11 * 60 * 1000, me));
  AddLookup(&batch, 5, PackedRequest(Chain("salt-alice", 8), 0, me), /*timeout_ms=*/0);
  AddLookup(&batch, 6, PackedRequest(Chain("salt-alice", 8), 0, me));  // no lease
  v1::MatchPrefixStreamResponse answer;
  ASSERT_TRUE(raw.Ask(batch, &answer));
  ASSERT_EQ(answer.answers_size(), 6);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(answer.answers(i).id(), static_cast<uint64_t>(i + 1));
  // Served: the caller's leased lookup (with the segment's memory key) and its unleased one.
  const v1::MatchPrefixStreamResponse& leased = answer.answers(0);
  ASSERT_THAT(StatusOf(leased), IsOk());
  EXPECT_EQ(leased.response().matched(), 8);
  EXPECT_NE(leased.response().lease_id(), 0u);
  ASSERT_GT(leased.response().segments_size(), 0);
  EXPECT_EQ(leased.response().segments(0).memory_key(), "segment-key");
  ASSERT_THAT(StatusOf(answer.answers(5)), IsOk());
  EXPECT_EQ(answer.answers(5).response().matched(), 8);
  ASSERT_GT(answer.answers(5).response().segments_size(), 0);
  EXPECT_EQ(answer.answers(5).response().segments(0).memory_key(), "");  // no lease: no key
  // Another tenant's chain shares nothing.
  ASSERT_THAT(StatusOf(answer.answers(1)), IsOk());
  EXPECT_EQ(answer.answers(1).response().matched(), 0);
  // prefill-a's certificate naming prefill-b: refused, that lookup alone.
  EXPECT_THAT(StatusOf(answer.answers(2)),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("prefill-b")));
  EXPECT_FALSE(answer.answers(2).has_response());
  std::optional<v1::ErrorInfo> info = proto::GetErrorInfo(StatusOf(answer.answers(2)));
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->reason(), v1::FAILURE_UNAUTHORIZED);
  EXPECT_THAT(StatusOf(answer.answers(3)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lease_ttl_ms")));
  EXPECT_THAT(StatusOf(answer.answers(4)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("timeout_ms")));
  raw.stream->WritesDone();
  EXPECT_TRUE(raw.stream->Finish().ok());
}

TEST_F(LookupStreamProcessTest, AMalformedBatchEndsTheStreamWithInvalidArgument) {
  Start();
  auto worker = Client(true, {"prefill-a", CacheStoreClient::NewIncarnation()});
  RegisterAndStore(*worker, {Chain("t", 8)});
  struct Case {
    std::string name;
    v1::MatchPrefixStreamRequest message;
    std::string says;
  };
  std::vector<Case> cases(4);
  cases[0].name = "nested";
  AddLookup(&cases[0].message, 1, PackedRequest(Chain("t", 8)));
  AddLookup(cases[0].message.mutable_lookups(0), 2, PackedRequest(Chain("t", 8)));
  cases[0].says = "has lookups itself";
  cases[1].name = "too many";
  for (int i = 0; i <= limits::kMaxLookupsPerStreamMessage; ++i) {
    AddLookup(&cases[1].message, i + 1, PackedRequest(Chain("t", 1)));
  }
  cases[1].says = "at most 64 per message";
  cases[2].name = "too many blocks";
  for (int i = 0; i < 5; ++i) AddLookup(&cases[2].message, i + 1, PackedRequest(Chain("t", 4096)));
  cases[2].says = "chain blocks per message";
  cases[3].name = "lookups beside a single lookup";
  AddLookup(&cases[3].message, 1, PackedRequest(Chain("t", 8)));
  cases[3].message.set_id(9);
  cases[3].says = "must leave id, request and timeout_ms unset";
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    RawStream raw(target_);
    v1::MatchPrefixStreamResponse answer;
    EXPECT_FALSE(raw.Ask(c.message, &answer));
    const grpc::Status end = raw.stream->Finish();
    EXPECT_EQ(end.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(end.error_message(), HasSubstr(c.says));
  }
  // The store goes on serving.
  auto client = Client(true);
  EXPECT_EQ(Matched(*client, Chain("t", 8)), 8);
}

// Lookups that wait at the same time on one client's stream go out in one message; one whose
// own deadline passes while it waits ends at that deadline and is never sent.
TEST_F(LookupStreamProcessTest, WaitingLookupsGoOutTogetherAndEachKeepsItsOwnDeadline) {
  Start();
  auto worker = Client(true, {"prefill-a", CacheStoreClient::NewIncarnation()});
  RegisterAndStore(*worker, {Chain("t", 64)});
  auto client = Client(true);
  ASSERT_EQ(Matched(*client, Chain("t", 64)), 64);  // the stream is open, batches accepted
  const double messages_before = StreamMessages(metrics_port_);
  const int64_t lookups_before = RpcCount(metrics_port_, "MatchPrefixStream");
  const int64_t unary_before = RpcCount(metrics_port_, "MatchPrefix");

  // A stopped store: the first two lookups are written (kMaxMessagesInFlight), the rest wait.
  proc_->Signal(SIGSTOP);
  ASSERT_TRUE(WaitUntilStopped(proc_->pid()));
  constexpr int kWritten = LookupStream::kMaxMessagesInFlight, kPatient = 4, kHurried = 4;
  std::vector<absl::StatusOr<v1::MatchPrefixResponse>> results(kWritten + kPatient + kHurried,
                                                               absl::UnknownError("not run"));
  std::vector<std::thread> patient, hurried;
  auto lookup = [&](int i, absl::Duration timeout) {
    CallOptions call;
    call.deadline = absl::Now() + timeout;
    results[i] = client->MatchPrefix(Chain("t", 1 + i), absl::ZeroDuration(), call);
  };
  for (int i = 0; i < kWritten; ++i) {
    patient.emplace_back(lookup, i, absl::Seconds(30));
    absl::SleepFor(absl::Milliseconds(100));  // in this order onto the stream
  }
  for (int i = kWritten; i < kWritten + kPatient + kHurried; ++i) {
    const bool hurry = i % 2 == 1;
    (hurry ? hurried : patient)
        .emplace_back(lookup, i, hurry ? absl::Milliseconds(300) : absl::Seconds(30));
  }
  for (std::thread& t : hurried) t.join();
  // The queued patient lookups are still waiting when the store resumes.
  absl::SleepFor(absl::Milliseconds(100));
  proc_->Signal(SIGCONT);
  for (std::thread& t : patient) t.join();
  for (int i = 0; i < static_cast<int>(results.size()); ++i) {
    SCOPED_TRACE(absl::StrCat("lookup ", i));
    if (i >= kWritten && i % 2 == 1) {
      EXPECT_THAT(results[i], StatusIs(absl::StatusCode::kDeadlineExceeded));
    } else {
      ASSERT_THAT(results[i], IsOk());
      EXPECT_EQ(results[i]->matched(), 1 + i);
    }
  }
  // The two written alone, then the four patient ones in one message; the hurried ones were
  // never sent, and nothing fell back to unary calls.
  EXPECT_EQ(StreamMessages(metrics_port_), messages_before + kWritten + 1);
  EXPECT_EQ(RpcCount(metrics_port_, "MatchPrefixStream"), lookups_before + kWritten + kPatient);
  EXPECT_EQ(RpcCount(metrics_port_, "MatchPrefix"), unary_before);
}

TEST_F(LookupStreamProcessTest, ABrokenStreamFailsTheCallInItsDeadlineAndTheNextCallSucceeds) {
  Start();
  auto worker = Client(true, {"prefill-a", CacheStoreClient::NewIncarnation()});
  const std::vector<kv::BlockHash> chain = Chain("t", 32);
  RegisterAndStore(*worker, {chain});
  auto client = Client(true);
  ASSERT_EQ(Matched(*client, chain), 32);  // the stream is open

  // A store that does not answer: the caller gets DEADLINE_EXCEEDED at its deadline.
  proc_->Signal(SIGSTOP);
  ASSERT_TRUE(WaitUntilStopped(proc_->pid()));
  CallOptions soon;
  soon.deadline = absl::Now() + absl::Milliseconds(300);
  EXPECT_THAT(client->MatchPrefix(chain, absl::ZeroDuration(), soon),
              StatusIs(absl::StatusCode::kDeadlineExceeded));

  // Killed while a lookup waits on the stream: UNAVAILABLE, long before that lookup's deadline.
  absl::Status waited;
  std::thread waiter([&] {
    CallOptions later;
    later.deadline = absl::Now() + absl::Seconds(60);
    waited = client->MatchPrefix(chain, absl::ZeroDuration(), later).status();
  });
  absl::SleepFor(absl::Milliseconds(200));
  proc_->Signal(SIGKILL);
  ASSERT_THAT(proc_->Wait(absl::Seconds(10)), IsOk());
  waiter.join();
  EXPECT_THAT(waited, StatusIs(absl::StatusCode::kUnavailable));

  // The store comes back on the same port with its log: the same client's next call succeeds
  // on a new stream.
  Start();
  absl::StatusOr<v1::MatchPrefixResponse> again;
  for (int i = 0; i < 50; ++i) {
    again = client->MatchPrefix(chain);
    if (again.ok()) break;
    absl::SleepFor(absl::Milliseconds(100));  // the channel reconnects with backoff
  }
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(again->matched(), 32);
}

TEST_F(LookupStreamProcessTest, SigtermWithOpenStreamsDrainsAndExits) {
  Start();
  auto worker = Client(true, {"prefill-a", CacheStoreClient::NewIncarnation()});
  const std::vector<kv::BlockHash> chain = Chain("t", 16);
  RegisterAndStore(*worker, {chain});
  // Idle open streams, and one client looking up without pause while the store drains.
  std::vector<std::unique_ptr<CacheStoreClient>> idle;
  for (int i = 0; i < 4; ++i) {
    idle.push_back(Client(true));
    ASSERT_EQ(Matched(*idle.back(), chain), 16);
  }
  auto busy = Client(true);
  std::atomic<bool> stop{false};
  absl::Status last;
  std::thread looper([&] {
    while (!stop.load()) {
      CallOptions call;
      call.deadline = absl::Now() + absl::Seconds(2);
      last = busy->MatchPrefix(chain, absl::ZeroDuration(), call).status();
      if (!last.ok()) break;
    }
  });
  absl::SleepFor(absl::Milliseconds(200));
  proc_->Signal(SIGTERM);
  // The drain ends the streams at once instead of waiting out --drain (5 s) for them.
  absl::StatusOr<int> code = proc_->Wait(absl::Seconds(4));
  EXPECT_THAT(code, IsOk());
  if (code.ok()) {
    EXPECT_EQ(*code, 0);
  }
  stop = true;
  looper.join();
  EXPECT_THAT(last, StatusIs(absl::StatusCode::kUnavailable));
}

TEST_F(LookupStreamProcessTest, RolesAndNodeScopeAreCheckedAsForUnaryMatchPrefix) {
  const std::string tls = dir_.File("tls");
  ASSERT_EQ(::mkdir(tls.c_str(), 0700), 0);
  KV_ASSERT_OK_AND_ASSIGN(auto ca, server::DevCertificateAuthority::Create(tls));
  KV_ASSERT_OK_AND_ASSIGN(server::SecurityOptions store_cert,
                          ca->Issue(server::PeerRole::kStore, "cachestore"));
  Start(server::DevCertificateAuthority::Flags(store_cert));
  KV_ASSERT_OK_AND_ASSIGN(server::SecurityOptions prefill_a,
                          ca->Issue(server::PeerRole::kPrefill, "prefill-a"));
  KV_ASSERT_OK_AND_ASSIGN(server::SecurityOptions gateway,
                          ca->Issue(server::PeerRole::kGateway, "gateway-0"));
  const uint64_t incarnation = CacheStoreClient::NewIncarnation();
  auto worker = Client(true, {"prefill-a", incarnation}, prefill_a);
  const std::vector<kv::BlockHash> chain = Chain("t", 8);
  RegisterAndStore(*worker, {chain});
  KV_ASSERT_OK_AND_ASSIGN(v1::MatchPrefixResponse leased,
                          worker->MatchPrefix(chain, absl::Seconds(30)));
  EXPECT_EQ(leased.matched(), 8);
  ASSERT_GT(leased.segments_size(), 0);
  EXPECT_EQ(leased.segments(0).memory_key(), "segment-key");

  for (bool stream : {true, false}) {
    SCOPED_TRACE(stream ? "stream" : "unary");
    // A gateway may not match at all (refused when the stream opens).
    auto as_gateway = Client(stream, {}, gateway);
    absl::StatusOr<v1::MatchPrefixResponse> denied = as_gateway->MatchPrefix(chain);
    EXPECT_THAT(denied, StatusIs(absl::StatusCode::kPermissionDenied));
    std::optional<v1::ErrorInfo> info = proto::GetErrorInfo(denied.status());
    ASSERT_TRUE(info.has_value());
    EXPECT_EQ(info->reason(), v1::FAILURE_UNAUTHORIZED);
    // prefill-a's certificate claiming to be prefill-b: refused per lookup.
    auto impostor = Client(stream, {"prefill-b", 7}, prefill_a);
    EXPECT_THAT(impostor->MatchPrefix(chain, absl::Seconds(30)),
                StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("prefill-b")));
    // The same certificate as itself, on the same client after the refusal (incarnation set
    // to the registered one): served.
    impostor->SetNode({"prefill-a", incarnation});
    KV_ASSERT_OK_AND_ASSIGN(v1::MatchPrefixResponse ok, impostor->MatchPrefix(chain));
    EXPECT_EQ(ok.matched(), 8);
  }
}

// --- In-process scripted stores -----------------------------------------------------------------

// A store that knows only unary MatchPrefix (an older build): MatchPrefixStream is UNIMPLEMENTED.
class UnaryOnlyStore final : public v1::CacheStore::Service {
 public:
  grpc::Status MatchPrefix(grpc::ServerContext*, const v1::MatchPrefixRequest* req,
                           v1::MatchPrefixResponse* resp) override {
    absl::MutexLock lock(&mu_);
    ++calls_;
    resp->set_matched(static_cast<int32_t>(req->chain_packed().size() / 16));
    return grpc::Status::OK;
  }
  int calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }

 private:
  absl::Mutex mu_;
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
};

std::unique_ptr<grpc::Server> Serve(grpc::Service* service, std::string* address) {
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  *address = absl::StrCat("127.0.0.1:", port);
  return server;
}

TEST(LookupStreamFallback, AStoreWithoutTheStreamGetsUnaryCalls) {
  UnaryOnlyStore store;
  std::string address;
  std::unique_ptr<grpc::Server> server = Serve(&store, &address);
  ASSERT_NE(server, nullptr);
  KV_ASSERT_OK_AND_ASSIGN(auto client, CacheStoreClient::Connect(address));
  for (int i = 1; i <= 3; ++i) {
    KV_ASSERT_OK_AND_ASSIGN(v1::MatchPrefixResponse r, client->MatchPrefix(Chain("t", 5)));
    EXPECT_EQ(r.matched(), 5);
    EXPECT_EQ(store.calls(), i);
  }
  server->Shutdown();
}

// A store instance whose lookup stream answers `matched` under `term` while it leads, and ends
// the stream with FAILURE_NOT_LEADER naming another instance once told to redirect (as the real
// store does on the next lookup after it lost the lead).
class ScriptedStreamStore final : public v1::CacheStore::Service {
 public:
  void Lead(int64_t term, int matched) {
    absl::MutexLock lock(&mu_);
    term_ = term;
    matched_ = matched;
    redirect_to_.clear();
  }
  void Redirect(const std::string& address) {
    absl::MutexLock lock(&mu_);
    redirect_to_ = address;
  }
  int streams() {
    absl::MutexLock lock(&mu_);
    return streams_;
  }
  // Every new stream is refused at once with FAILURE_NOT_LEADER naming no leader (an instance
  // that lost its etcd lease: it knows no leader).
  void RefuseStreams() {
    absl::MutexLock lock(&mu_);
    refuse_ = true;
  }

  grpc::Status MatchPrefixStream(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<v1::MatchPrefixStreamResponse, v1::MatchPrefixStreamRequest>* stream)
      override {
    {
      absl::MutexLock lock(&mu_);
      ++streams_;
      if (refuse_) {
        return proto::ToGrpcStatus(proto::Attribute(absl::UnavailableError("no lease"),
                                                    v1::ROLE_STORE, "", v1::FAILURE_NOT_LEADER));
      }
    }
    v1::MatchPrefixStreamRequest req;
    while (stream->Read(&req)) {
      v1::MatchPrefixStreamResponse resp;
      {
        absl::MutexLock lock(&mu_);
        if (refuse_ || !redirect_to_.empty()) {
          return proto::ToGrpcStatus(proto::Attribute(absl::UnavailableError("not the leader"),
                                                      v1::ROLE_STORE, "", v1::FAILURE_NOT_LEADER,
                                                      redirect_to_));
        }
        resp.set_id(req.id());
        resp.set_term(term_);
        resp.mutable_response()->set_matched(matched_);
      }
      if (!stream->Write(resp)) break;
    }
    return grpc::Status::OK;
  }

 private:
  absl::Mutex mu_;
  int64_t term_ ABSL_GUARDED_BY(mu_) = 0;
  int matched_ ABSL_GUARDED_BY(mu_) = 0;
  std::string redirect_to_ ABSL_GUARDED_BY(mu_);
  int streams_ ABSL_GUARDED_BY(mu_) = 0;
  bool refuse_ ABSL_GUARDED_BY(mu_) = false;
};

bool IsNotLeader(const absl::Status& status) {
  std::optional<v1::ErrorInfo> info = proto::GetErrorInfo(status);
  return absl::IsUnavailable(status) && info.has_value() &&
         info->reason() == v1::FAILURE_NOT_LEADER;
}

TEST(LookupStreamFencing, FollowsTheLeaderAndDropsAnswersOfAnOlderTerm) {
  ScriptedStreamStore a, b;
  std::string address_a, address_b;
  std::unique_ptr<grpc::Server> server_a = Serve(&a, &address_a);
  std::unique_ptr<grpc::Server> server_b = Serve(&b, &address_b);
  ASSERT_NE(server_a, nullptr);
  ASSERT_NE(server_b, nullptr);
  CacheStoreClient::Options o;
  o.timeout = absl::Seconds(2);
  o.attempt_timeout = absl::Milliseconds(300);
  KV_ASSERT_OK_AND_ASSIGN(auto client, CacheStoreClient::Connect(address_a + "," + address_b, o));
  a.Lead(5, 1);
  b.Redirect(address_a);
  KV_ASSERT_OK_AND_ASSIGN(v1::MatchPrefixResponse r, client->MatchPrefix(Chain("t", 3)));
  EXPECT_EQ(r.matched(), 1);
  EXPECT_EQ(client->term(), 5);
  KV_ASSERT_OK_AND_ASSIGN(r, client->MatchPrefix(Chain("t", 3)));  // same stream
  EXPECT_EQ(a.streams(), 1);

  // Leadership moves to b: a ends its stream naming b, and the lookup is answered by b.
  a.Redirect(address_b);
  b.Lead(6, 2);
  KV_ASSERT_OK_AND_ASSIGN(r, client->MatchPrefix(Chain("t", 3)));
  EXPECT_EQ(r.matched(), 2);
  EXPECT_EQ(client->term(), 6);
  EXPECT_EQ(client->current_address(), address_b);

  // b answers under term 3 < 6 (a deposed leader that resumed): never handed to the caller.
  b.Lead(3, 3);
  a.Redirect(address_b);
  absl::StatusOr<v1::MatchPrefixResponse> stale = client->MatchPrefix(Chain("t", 3));
  EXPECT_TRUE(IsNotLeader(stale.status())) << stale.status();
  // A newer term is accepted again, on a new stream.
  b.Lead(7, 4);
  KV_ASSERT_OK_AND_ASSIGN(r, client->MatchPrefix(Chain("t", 3)));
  EXPECT_EQ(r.matched(), 4);
  EXPECT_EQ(client->term(), 7);
  client.reset();
  server_a->Shutdown();
  server_b->Shutdown();
}

TEST(LookupStreamFencing, AStoreThatRefusesEveryStreamGivesNotLeaderEveryTime) {
  ScriptedStreamStore a;
  std::string address;
  std::unique_ptr<grpc::Server> server = Serve(&a, &address);
  ASSERT_NE(server, nullptr);
  KV_ASSERT_OK_AND_ASSIGN(auto client, CacheStoreClient::Connect(address));
  a.Lead(2, 1);
  KV_ASSERT_OK_AND_ASSIGN(v1::MatchPrefixResponse r, client->MatchPrefix(Chain("t", 3)));
  EXPECT_EQ(r.matched(), 1);
  // It loses its lease: the open stream ends on the next lookup, every new one is refused as it
  // opens, often before the client's lookup is even sent; each caller must still be told
  // FAILURE_NOT_LEADER (the etcd-outage test saw "lookup stream: already ended" here).
  a.RefuseStreams();
  for (int i = 0; i < 20; ++i) {
    CallOptions quick;
    quick.deadline = absl::Now() + absl::Milliseconds(100);
    absl::StatusOr<v1::MatchPrefixResponse> refused =
        client->MatchPrefix(Chain("t", 3), absl::ZeroDuration(), quick);
    EXPECT_TRUE(IsNotLeader(refused.status())) << i << ": " << refused.status();
  }
  client.reset();
  server->Shutdown();
}

}  // namespace
}  // namespace kvrelay::cachestore
