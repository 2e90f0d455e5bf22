// KV events a router can use (issue 35.5), on real processes: `kvrelay up` with mutual TLS and
// the store's KV-event publisher behind ZeroMQ CURVE, prompts sent as token ids through the
// gateway, and an independent subscriber (tests/cachestore/kv_events_subscriber.py: Debian's
// python3-zmq + python3-msgpack, a strict mirror of vLLM's KVEventBatch types) decoding the
// stream. For every BlockStored: len(token_ids) == len(block_hashes) * block_size, and the
// tokens from the root block down to it are a prefix of a request's tokens (its prompt, then
// what decode generated); every prompt's full blocks are announced with the prompt's tokens. A
// subscriber without a listed CURVE key receives nothing (tokens are tenant data).

#include <unistd.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv/hf_config.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/local_cluster.h"
#include "tests/testing/process_harness.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::e2e {
namespace {

using ::kvrelay::gateway::client::GatewayClient;
using ::kvrelay::gateway::client::GatewayRequest;
using ::kvrelay::testing::ChildProcess;
using Tokens = std::vector<int32_t>;

nlohmann::json ReadJson(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) return nlohmann::json();
  nlohmann::json j = nlohmann::json::parse(*text, nullptr, false);
  return j.is_discarded() ? nlohmann::json() : j;
}

bool IsPrefix(const Tokens& prefix, const Tokens& of) {
  return prefix.size() <= of.size() && std::equal(prefix.begin(), prefix.end(), of.begin());
}

// The stream's blocks by hash: (parent hash or "", token_ids), from the subscriber's "stored".
struct StoredBlock {
  std::string parent;
  Tokens tokens;
};

// The tokens from the root down to `hash` (nullopt when a block on the way is unknown).
std::optional<Tokens> PathTokens(const std::map<std::string, StoredBlock>& blocks,
                                 std::string hash) {
  std::vector<const Tokens*> reversed;
  for (int depth = 0; !hash.empty(); ++depth) {
    auto it = blocks.find(hash);
    if (it == blocks.end() || depth > 4096) return std::nullopt;
    reversed.push_back(&it->second.tokens);
    hash = it->second.parent;
  }
  Tokens path;
  for (auto it = reversed.rbegin(); it != reversed.rend(); ++it) {
    path.insert(path.end(), (*it)->begin(), (*it)->end());
  }
  return path;
}

TEST(KvEventsEndToEnd, BlockStoredCarriesThePromptsTokensOverCurve) {
  if (::access("/usr/bin/python3", X_OK) != 0) GTEST_SKIP() << "no /usr/bin/python3";
  testing::TempDir dir;
  KV_ASSERT_OK(WriteModel(dir.File("llama"), "llama"));
  // CURVE keys from python3-zmq (libzmq's zmq_curve_keypair): the store's, the subscriber's.
  KV_ASSERT_OK_AND_ASSIGN(
      testing::CommandResult keys,
      testing::RunCommand({"/usr/bin/python3", "-c",
                           "import zmq\n"
                           "for _ in range(2):\n"
                           "  p, s = zmq.curve_keypair(); print(p.decode(), s.decode())"}));
  ASSERT_EQ(keys.exit_code, 0) << keys.stderr_text;
  std::vector<std::string> words =
      absl::StrSplit(keys.stdout_text, absl::ByAnyChar(" \n"), absl::SkipEmpty());
  ASSERT_EQ(words.size(), 4u) << keys.stdout_text;
  KV_ASSERT_OK(WriteFileAtomically(dir.File("store.key"), words[1] + "\n"));
  KV_ASSERT_OK(WriteFileAtomically(dir.File("subscribers"), words[2] + "\n"));
  KV_ASSERT_OK(WriteFileAtomically(dir.File("subscriber.keys"), words[2] + "\n" + words[3]));
  const std::string pub = absl::StrCat("tcp://127.0.0.1:", testing::PickUnusedPort());
  const std::string replay = absl::StrCat("tcp://127.0.0.1:", testing::PickUnusedPort());

  ClusterOptions options;
  options.model_dir = dir.File("llama");
  options.prefill = 1;
  options.decode = 1;
  options.tls = true;  // so the publisher must run with CURVE
  options.worker_args = kPatientStoreCalls;
  options.extra_args = {
      "--cachestore-args",
      absl::StrCat("--kv-events-endpoint ", pub, " --kv-events-replay-endpoint ", replay,
                   " --kv-events-model tiny-llama --kv-events-curve-secret-key-file ",
                   dir.File("store.key"), " --kv-events-curve-clients-file ",
                   dir.File("subscribers"))};
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<LocalCluster> cluster, LocalCluster::Start(options));

  const std::string script = testing::SourceDir() + "/tests/cachestore/kv_events_subscriber.py";
  auto subscriber_argv = [&](const std::string& state) {
    return std::vector<std::string>{"/usr/bin/python3", script, "--endpoint", pub,
                                    "--replay",         replay, "--model",    "tiny-llama",
                                    "--state",          state};
  };
  std::vector<std::string> argv = subscriber_argv(dir.File("state.json"));
  // Z85 keys may start with '-': passed as --flag=value so argparse never reads one as a flag.
  argv.push_back("--curve-server-key=" + words[0]);
  argv.push_back("--curve-client-key-file=" + dir.File("subscriber.keys"));
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ChildProcess> subscriber, ChildProcess::Start(argv));
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ChildProcess> plain,
                          ChildProcess::Start(subscriber_argv(dir.File("plain.json"))));
  for (ChildProcess* p : {subscriber.get(), plain.get()}) {
    KV_ASSERT_OK(p->WaitForOutput("subscriber ready", absl::Seconds(30)).status());
  }

  // Three prompts sent as token ids (what the store hashes): the second shares the first's
  // first two blocks; lengths leave partial blocks, which are never stored.
  const int32_t block_size = kv::kDefaultBlockTokens;
  Tokens first = RandomPrompt(50, 1);
  Tokens second(first.begin(), first.begin() + 2 * block_size);
  for (int32_t t : RandomPrompt(21, 2)) second.push_back(t);
  const std::vector<Tokens> prompts = {first, second, RandomPrompt(70, 3)};
  std::vector<Tokens> sequences;  // prompt + generated, per request
  GatewayClient client(cluster->gateway(), cluster->client_security());
  for (const Tokens& prompt : prompts) {
    GatewayRequest r;
    r.generation.tokens = prompt;
    r.generation.max_tokens = 16;  // decode then commits blocks holding generated tokens too
    KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult result, client.Generate(r, absl::Seconds(60)));
    Tokens sequence = prompt;
    sequence.insert(sequence.end(), result.tokens.begin(), result.tokens.end());
    sequences.push_back(std::move(sequence));
  }

  // Waits (bounded) until every prompt's full blocks came through with its tokens.
  std::map<std::string, StoredBlock> blocks;
  nlohmann::json state;
  int stored_events = 0;
  auto prompts_covered = [&] {
    for (const Tokens& prompt : prompts) {
      const size_t full = prompt.size() / block_size * block_size;
      const Tokens want(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(full));
      bool found = false;
      for (const auto& [hash, block] : blocks) {
        std::optional<Tokens> path = PathTokens(blocks, hash);
        found |= path.has_value() && *path == want;
      }
      if (!found) return false;
    }
    return true;
  };
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  do {
    absl::SleepFor(absl::Milliseconds(100));
    state = ReadJson(dir.File("state.json"));
    blocks.clear();
    stored_events = 0;
    if (!state.contains("stored")) continue;
    for (const nlohmann::json& s : state["stored"]) {
      // [node, hash, parent or null, token_ids, block_size]
      ++stored_events;
      StoredBlock b;
      b.parent = s[2].is_null() ? "" : s[2].get<std::string>();
      b.tokens = s[3].get<Tokens>();
      EXPECT_EQ(s[4].get<int>(), block_size) << s.dump();
      EXPECT_EQ(b.tokens.size(), static_cast<size_t>(block_size))
          << "a BlockStored without its block's tokens: " << s.dump();
      blocks[s[1].get<std::string>()] = std::move(b);
    }
  } while (!prompts_covered() && absl::Now() < deadline);
  ASSERT_TRUE(state.contains("errors")) << subscriber->Stderr();
  EXPECT_TRUE(state["errors"].empty()) << state["errors"].dump();
  EXPECT_TRUE(prompts_covered()) << state.dump() << "\n" << cluster->Log();
  // Every block's tokens, root to it, are the start of one request's tokens.
  int checked = 0;
  for (const auto& [hash, block] : blocks) {
    std::optional<Tokens> path = PathTokens(blocks, hash);
    ASSERT_TRUE(path.has_value()) << "block " << hash << " hangs off an unannounced parent";
    bool matches = false;
    for (const Tokens& sequence : sequences) matches |= IsPrefix(*path, sequence);
    EXPECT_TRUE(matches) << "block " << hash << "'s tokens are no request's";
    ++checked;
  }
  std::printf("kv events: %d BlockStored blocks, %zu distinct, every token_ids checked\n",
              stored_events, blocks.size());
  EXPECT_GE(checked, 3 + 1 + 4);  // the three prompts' distinct full blocks at least

  // The subscriber without a listed key got nothing.
  const nlohmann::json plain_state = ReadJson(dir.File("plain.json"));
  ASSERT_TRUE(plain_state.contains("batches")) << plain->Stderr();
  EXPECT_EQ(plain_state["batches"].get<int>(), 0);
  EXPECT_TRUE(plain_state["stored"].empty());
  KV_ASSERT_OK_AND_ASSIGN(int code, cluster->Stop());
  EXPECT_EQ(code, 0) << cluster->Log();
}

}  // namespace
}  // namespace kvrelay::e2e
