// vLLM-format KV events from the real `kvrelay cachestore` process: an independent subscriber
// (kv_events_subscriber.py: Debian's python3-zmq + python3-msgpack) decodes the ZeroMQ stream,
// checks every batch against vLLM's KVEventBatch schema and rebuilds the per-node block index,
// which must equal the store's, including after a node expires and across a store restart.
// Blocks committed with their tokens carry them in BlockStored.token_ids; blocks recovered from
// the WAL after a restart carry none (tokens never reach the disk).

#include <signal.h>
#include <unistd.h>

#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cachestore/client/cache_store_client.h"
#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv/block_hash.h"
#include "nlohmann/json.hpp"
#include "tests/testing/process_harness.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::cachestore {
namespace {

using ::kvrelay::testing::ChildProcess;
using ::kvrelay::testing::IsOk;
using Index = std::map<std::string, std::set<std::string>>;  // node -> 64-bit hashes (decimal)

// The tokens of Chain(salt, n, start): [start, start + n * 16).
std::vector<int32_t> ChainTokens(int n, int start) {
  std::vector<int32_t> tokens;
  for (int i = 0; i < n * 16; ++i) tokens.push_back(start + i);
  return tokens;
}

std::vector<kv::BlockHash> Chain(const std::string& salt, int n, int start) {
  return kv::HashChain(kv::LayoutFingerprint{}, salt, ChainTokens(n, start), 16);
}

class KvEventsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::access("/usr/bin/python3", X_OK) != 0) GTEST_SKIP() << "no /usr/bin/python3";
    pub_ = absl::StrCat("tcp://127.0.0.1:", testing::PickUnusedPort());
    replay_ = absl::StrCat("tcp://127.0.0.1:", testing::PickUnusedPort());
  }

  void StartStore() {
    std::vector<std::string> argv = {
        testing::BinaryPath("kvrelay"), "cachestore", "--port", "0", "--metrics-port", "0",
        "--data-dir", dir_.File("data"), "--tick", "20ms",
        // An expired node is forgotten (AllBlocksCleared) at once.
        "--suspect-grace", "0s", "--kv-events-endpoint", pub_, "--kv-events-replay-endpoint",
        replay_, "--kv-events-model", "tiny-llama", "--insecure"};
    argv.insert(argv.end(), store_args_.begin(), store_args_.end());
    KV_ASSERT_OK_AND_ASSIGN(store_, ChildProcess::Start(argv));
    KV_ASSERT_OK_AND_ASSIGN(std::string line,
                            store_->WaitForOutput("cachestore listening on", absl::Seconds(30)));
    std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
    ASSERT_GE(words.size(), 4u) << line;
    KV_ASSERT_OK_AND_ASSIGN(client_, CacheStoreClient::Connect(words[3]));
    ASSERT_THAT(client_->WaitForReady(absl::Seconds(10)), IsOk());
  }

  void StopStore() {
    client_.reset();
    store_->Signal(SIGTERM);
    KV_ASSERT_OK_AND_ASSIGN(int code, store_->Wait(absl::Seconds(30)));
    EXPECT_EQ(code, 0) << store_->Stderr();
  }

  void Register(const std::string& node, int64_t ttl_ms) {
    v1::RegisterNodeRequest req;
    req.set_node_id(node);
    req.mutable_address()->set_kind("ucx");
    req.mutable_address()->set_address("127.0.0.1:1");
    v1::Segment* s = req.add_segments();
    s->set_segment_id("host0");
    s->set_tier(v1::TIER_HOST);
    s->set_capacity_slots(64);
    s->set_slot_bytes(1 << 20);
    s->set_memory_key("rkey");
    req.set_ttl_ms(ttl_ms);
    ASSERT_THAT(client_->RegisterNode(req), IsOk());
  }

  // Stores Chain(salt, n, start) on `node` (committed with its tokens unless `with_tokens` is
  // false) and records it in the expected index.
  void Store(const std::string& salt, int n, int start, const std::string& node,
             bool with_tokens = true) {
    const std::vector<kv::BlockHash> chain = Chain(salt, n, start);
    const std::vector<int32_t> tokens = ChainTokens(n, start);
    KV_ASSERT_OK_AND_ASSIGN(v1::AllocateResponse a,
                            client_->AllocateChain(chain, 1 << 20, {}, node));
    ASSERT_EQ(a.blocks_size(), static_cast<int>(chain.size()));
    for (const v1::Allocation& b : a.blocks()) {
      ASSERT_EQ(b.replicas_size(), 1);
      ASSERT_EQ(b.replicas(0).node_id(), node);
    }
    KV_ASSERT_OK_AND_ASSIGN(int committed,
                            client_->Commit(a.allocation_id(), chain, {},
                                            with_tokens ? tokens : std::vector<int32_t>()));
    ASSERT_EQ(committed, static_cast<int>(chain.size()));
    for (int i = 0; i < n; ++i) {
      const std::string hash = absl::StrCat(chain[i].hi);
      expected_[node].insert(hash);
      expected_tokens_[node][hash] =
          with_tokens ? std::vector<int32_t>(tokens.begin() + i * 16, tokens.begin() + (i + 1) * 16)
                      : std::vector<int32_t>();
    }
    chains_[node].push_back(chain);
  }

  // What a store restart does to the expected tokens: recovered blocks have none.
  void ForgetExpectedTokens() {
    for (auto& [node, blocks] : expected_tokens_) {
      for (auto& [hash, tokens] : blocks) tokens.clear();
    }
  }

  // The store's own view agrees with the expected index: every expected chain matches whole.
  void ExpectStoreHoldsExpected() {
    for (const auto& [node, chains] : chains_) {
      for (const auto& chain : chains) {
        absl::StatusOr<v1::MatchPrefixResponse> m = client_->MatchPrefix(chain);
        ASSERT_THAT(m, IsOk());
        EXPECT_EQ(m->matched(), expected_[node].empty() ? 0 : static_cast<int>(chain.size()))
            << node;
      }
    }
  }

  nlohmann::json ReadState() {
    absl::StatusOr<std::string> text = ReadFileToString(dir_.File("state.json"));
    if (!text.ok()) return nlohmann::json();
    nlohmann::json j = nlohmann::json::parse(*text, nullptr, false);
    return j.is_discarded() ? nlohmann::json() : j;
  }

  static Index NonEmpty(Index index) {
    std::erase_if(index, [](const auto& kv) { return kv.second.empty(); });
    return index;
  }

  // Waits (bounded) until the subscriber's index equals the expected one.
  // The token_ids the subscriber holds for every expected block, as "node hash" -> tokens
  // (absent when it does not hold the block).
  std::map<std::string, std::vector<int32_t>> SeenTokens(const nlohmann::json& state) {
    std::map<std::string, std::vector<int32_t>> out;
    if (!state.contains("tokens")) return out;
    for (const auto& [node, hashes] : expected_) {
      for (const std::string& hash : hashes) {
        if (state["tokens"].contains(node) && state["tokens"][node].contains(hash)) {
          out[node + " " + hash] = state["tokens"][node][hash].get<std::vector<int32_t>>();
        }
      }
    }
    return out;
  }
  std::map<std::string, std::vector<int32_t>> WantedTokens() {
    std::map<std::string, std::vector<int32_t>> out;
    for (const auto& [node, hashes] : expected_) {
      for (const std::string& hash : hashes) out[node + " " + hash] = expected_tokens_[node][hash];
    }
    return out;
  }

  // Waits (bounded) until the subscriber's index equals the expected one and every block it
  // holds has the token_ids it was committed with (none for one committed without, or
  // recovered from the WAL).
  void ExpectSubscriberConverges() {
    Index seen;
    nlohmann::json state;
    for (int i = 0; i < 200; ++i) {
      state = ReadState();
      seen.clear();
      if (state.contains("nodes")) {
        for (const auto& [node, hashes] : state["nodes"].items()) {
          for (const auto& h : hashes) seen[node].insert(h.get<std::string>());
        }
      }
      if (NonEmpty(seen) == NonEmpty(expected_) && SeenTokens(state) == WantedTokens()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    EXPECT_EQ(NonEmpty(seen), NonEmpty(expected_)) << state.dump() << "\n" << subscriber_->Stderr();
    ASSERT_TRUE(state.contains("errors"));
    EXPECT_TRUE(state["errors"].empty()) << state["errors"].dump();
    EXPECT_EQ(SeenTokens(state), WantedTokens()) << state.dump();
  }

  // The subscriber script with `extra` flags, writing its state to `state`.
  absl::StatusOr<std::unique_ptr<ChildProcess>> StartSubscriber(
      const std::string& state, const std::vector<std::string>& extra = {}) {
    std::vector<std::string> argv = {
        "/usr/bin/python3", testing::SourceDir() + "/tests/cachestore/kv_events_subscriber.py",
        "--endpoint",       pub_,
        "--replay",         replay_,
        "--model",          "tiny-llama",
        "--state",          state};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return ChildProcess::Start(argv);
  }

  testing::TempDir dir_;
  std::vector<std::string> store_args_;
  std::string pub_, replay_;
  std::unique_ptr<ChildProcess> store_, subscriber_;
  std::unique_ptr<CacheStoreClient> client_;
  Index expected_;
  std::map<std::string, std::map<std::string, std::vector<int32_t>>> expected_tokens_;
  std::map<std::string, std::vector<std::vector<kv::BlockHash>>> chains_;
};

TEST_F(KvEventsTest, SubscriberRebuildsTheIndexAcrossExpiryAndRestart) {
  StartStore();
  if (HasFatalFailure()) return;
  KV_ASSERT_OK_AND_ASSIGN(
      subscriber_,
      ChildProcess::Start({"/usr/bin/python3",
                           testing::SourceDir() + "/tests/cachestore/kv_events_subscriber.py",
                           "--endpoint", pub_, "--replay", replay_, "--model", "tiny-llama",
                           "--state", dir_.File("state.json")}));
  ASSERT_THAT(subscriber_->WaitForOutput("subscriber ready", absl::Seconds(30)), IsOk());

  Register("prefill-a", 60000);
  Register("decode-b", 60000);
  Register("short-lived", 400);
  Store("tenant-1", 3, 0, "prefill-a");
  Store("tenant-2", 2, 0, "prefill-a");  // same tokens, other tenant salt: other hashes
  Store("tenant-1", 2, 500, "decode-b", /*with_tokens=*/false);  // an older worker
  Store("tenant-1", 2, 900, "short-lived");
  // short-lived stops heartbeating: its blocks go (BlockRemoved) and it is cleared.
  expected_["short-lived"].clear();
  for (int i = 0; i < 200; ++i) {
    KV_ASSERT_OK_AND_ASSIGN(bool known, client_->Heartbeat("prefill-a"));
    ASSERT_TRUE(known);
    absl::StatusOr<v1::MatchPrefixResponse> m = client_->MatchPrefix(Chain("tenant-1", 2, 900));
    if (m.ok() && m->matched() == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ExpectStoreHoldsExpected();
  ExpectSubscriberConverges();

  // Restart: the store recovers its index from the WAL; the subscriber reconnects, replays each
  // node from sequence 0 (its full state, the recovered blocks without tokens) and keeps
  // following new events.
  StopStore();
  StartStore();
  if (HasFatalFailure()) return;
  ForgetExpectedTokens();
  Store("tenant-1", 2, 2000, "decode-b");
  Store("tenant-3", 2, 0, "prefill-a");
  ExpectStoreHoldsExpected();
  ExpectSubscriberConverges();
  const nlohmann::json state = ReadState();
  EXPECT_GE(state["replays"].get<int>(), 2);  // the restart was replayed, not guessed
}

// With CURVE only subscribers whose public key is listed see anything: one with another key, or
// a plain-text one, fails the handshake and receives no batch; a listed one follows the index.
TEST_F(KvEventsTest, CurveAdmitsOnlyListedSubscribers) {
  // Keys from python3-zmq (libzmq's zmq_curve_keypair): server, subscriber, intruder.
  KV_ASSERT_OK_AND_ASSIGN(
      testing::CommandResult keys,
      testing::RunCommand({"/usr/bin/python3", "-c",
                           "import zmq\n"
                           "for _ in range(3):\n"
                           "  p, s = zmq.curve_keypair(); print(p.decode(), s.decode())"}));
  ASSERT_EQ(keys.exit_code, 0) << keys.stderr_text;
  std::vector<std::string> words =
      absl::StrSplit(keys.stdout_text, absl::ByAnyChar(" \n"), absl::SkipEmpty());
  ASSERT_EQ(words.size(), 6u) << keys.stdout_text;
  // Z85 keys may start with '-': passed as --flag=value so argparse never reads one as a flag.
  const std::string server_public = words[0];
  ASSERT_THAT(WriteFileAtomically(dir_.File("server.key"), words[1] + "\n"), IsOk());
  ASSERT_THAT(WriteFileAtomically(dir_.File("clients"), "\n" + words[2] + "\n"), IsOk());
  ASSERT_THAT(WriteFileAtomically(dir_.File("subscriber.keys"), words[2] + "\n" + words[3]),
              IsOk());
  ASSERT_THAT(WriteFileAtomically(dir_.File("intruder.keys"), words[4] + "\n" + words[5]), IsOk());
  store_args_ = {"--kv-events-curve-secret-key-file", dir_.File("server.key"),
                 "--kv-events-curve-clients-file", dir_.File("clients")};
  StartStore();
  if (HasFatalFailure()) return;
  KV_ASSERT_OK_AND_ASSIGN(
      subscriber_, StartSubscriber(dir_.File("state.json"),
                                   {"--curve-server-key=" + server_public,
                                    "--curve-client-key-file", dir_.File("subscriber.keys")}));
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ChildProcess> intruder,
                          StartSubscriber(dir_.File("intruder.json"),
                                          {"--curve-server-key=" + server_public,
                                           "--curve-client-key-file", dir_.File("intruder.keys")}));
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ChildProcess> plain,
                          StartSubscriber(dir_.File("plain.json")));
  for (ChildProcess* p : {subscriber_.get(), intruder.get(), plain.get()}) {
    ASSERT_THAT(p->WaitForOutput("subscriber ready", absl::Seconds(30)), IsOk());
  }
  Register("prefill-a", 60000);
  Store("tenant-1", 3, 0, "prefill-a");
  Store("tenant-2", 2, 0, "prefill-a");
  ExpectSubscriberConverges();
  for (const std::string name : {"intruder.json", "plain.json"}) {
    absl::StatusOr<std::string> text = ReadFileToString(dir_.File(name));
    ASSERT_THAT(text, IsOk()) << name;
    nlohmann::json state = nlohmann::json::parse(*text, nullptr, false);
    ASSERT_TRUE(state.is_object()) << *text;
    EXPECT_EQ(state["batches"].get<int>(), 0) << name << " received events";
    EXPECT_TRUE(state["nodes"].empty()) << name << ": " << *text;
    // Its handshakes were refused (it retries, so at least one failure is recorded by now).
    for (int i = 0; i < 100 && state["handshake_failures"].get<int>() == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      text = ReadFileToString(dir_.File(name));
      if (text.ok()) state = nlohmann::json::parse(*text, nullptr, false);
    }
    EXPECT_GT(state["handshake_failures"].get<int>(), 0) << name << ": " << *text;
  }
  EXPECT_THAT(store_->Stderr(), ::testing::HasSubstr("its CURVE key is not listed"));
}

// A commit whose token_ids do not cover its blocks exactly is refused as a whole, naming both
// numbers; nothing of it is published.
TEST_F(KvEventsTest, TokensOfTheWrongLengthAreRefused) {
  StartStore();
  if (HasFatalFailure()) return;
  Register("prefill-a", 60000);
  const std::vector<kv::BlockHash> chain = Chain("tenant-1", 2, 0);
  KV_ASSERT_OK_AND_ASSIGN(v1::AllocateResponse a,
                          client_->AllocateChain(chain, 1 << 20, {}, "prefill-a"));
  std::vector<int32_t> tokens = ChainTokens(2, 0);
  tokens.resize(20);
  absl::StatusOr<int> refused = client_->Commit(a.allocation_id(), chain, {}, tokens);
  EXPECT_THAT(refused.status(),
              ::kvrelay::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                           ::testing::HasSubstr("20 tokens for 2 hashes of 16")));
  KV_ASSERT_OK_AND_ASSIGN(v1::MatchPrefixResponse m, client_->MatchPrefix(chain));
  EXPECT_EQ(m.matched(), 0);
}

TEST_F(KvEventsTest, BadFlagsAreRefused) {
  absl::StatusOr<testing::CommandResult> r =
      testing::RunCommand({testing::BinaryPath("kvrelay"), "cachestore", "--port", "0",
                           "--kv-events-endpoint", "bogus://x", "--insecure"});
  ASSERT_THAT(r, IsOk());
  EXPECT_NE(r->exit_code, 0);
  EXPECT_THAT(r->stderr_text, ::testing::HasSubstr("--kv-events-endpoint"));
  r = testing::RunCommand({testing::BinaryPath("kvrelay"), "cachestore", "--port", "0",
                           "--kv-events-replay-endpoint", replay_, "--insecure"});
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->exit_code, 2);
  EXPECT_THAT(r->stderr_text, ::testing::HasSubstr("needs --kv-events-endpoint"));
  // A malformed CURVE key, and a client list without the server key.
  ASSERT_THAT(WriteFileAtomically(dir_.File("short.key"), "too-short\n"), IsOk());
  r = testing::RunCommand({testing::BinaryPath("kvrelay"), "cachestore", "--port", "0",
                           "--kv-events-endpoint", pub_, "--kv-events-curve-secret-key-file",
                           dir_.File("short.key"), "--kv-events-curve-clients-file",
                           dir_.File("short.key"), "--insecure"});
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->exit_code, 2);
  EXPECT_THAT(r->stderr_text, ::testing::HasSubstr("40 characters of Z85, got 9"));
  r = testing::RunCommand({testing::BinaryPath("kvrelay"), "cachestore", "--port", "0",
                           "--kv-events-endpoint", pub_, "--kv-events-curve-clients-file",
                           dir_.File("short.key"), "--insecure"});
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->exit_code, 2);
  EXPECT_THAT(r->stderr_text, ::testing::HasSubstr("go together"));
  // The events' block size is the store's: another one is refused, naming both.
  r = testing::RunCommand({testing::BinaryPath("kvrelay"), "cachestore", "--port", "0",
                           "--kv-events-endpoint", pub_, "--kv-events-block-size", "32",
                           "--block-tokens", "16", "--insecure"});
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->exit_code, 2);
  EXPECT_THAT(r->stderr_text,
              ::testing::HasSubstr("--kv-events-block-size 32 differs from the store's "
                                   "--block-tokens 16"));
}

// With TLS on (no --insecure) the store does not publish every tenant's activity in plain text.
TEST_F(KvEventsTest, WithTlsThePublisherNeedsCurve) {
  const std::string certs = dir_.File("certs");
  absl::StatusOr<testing::CommandResult> made = testing::RunCommand(
      {"/bin/bash", testing::SourceDir() + "/scripts/certs.sh", certs, "store/cachestore"});
  ASSERT_THAT(made, IsOk());
  ASSERT_EQ(made->exit_code, 0) << made->stderr_text;
  absl::StatusOr<testing::CommandResult> r = testing::RunCommand(
      {testing::BinaryPath("kvrelay"), "cachestore", "--port", "0", "--metrics-port", "0",
       "--tls-cert", certs + "/store-cachestore.pem", "--tls-key", certs + "/store-cachestore.key",
       "--tls-ca", certs + "/ca.pem", "--kv-events-endpoint", pub_});
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->exit_code, 2);
  EXPECT_THAT(r->stderr_text, ::testing::HasSubstr("--kv-events-curve-secret-key-file"));
  EXPECT_THAT(r->stderr_text, ::testing::HasSubstr("or run with --insecure"));
}

}  // namespace
}  // namespace kvrelay::cachestore
