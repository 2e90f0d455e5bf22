// Overload on real processes (issue 34's smallest reproduction): one decode worker with few
// batch places, more concurrent long completions over the OpenAI HTTP API than it can start.
// Every request, streamed or not, is either served with the co-located tokens or refused at
// once with HTTP 429, a Retry-After header and an "overloaded_error" body; none is UNAVAILABLE
// (503: "no healthy decode worker"), the gateway's breakers never open, and the worker serves
// again afterwards.

#include <httplib.h>

#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/local_cluster.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::e2e {
namespace {

using Json = nlohmann::json;

constexpr int kRequests = 10;
constexpr int kMaxTokens = 96;

struct Answer {
  int status = 0;
  std::string retry_after;  // the header, "" when absent
  Json body;                // the error, or the answer (streamed: its last event)
  std::vector<int32_t> token_ids;
};

// A completion, answered once or streamed (server-sent events, token ids gathered).
Answer Complete(int port, const std::vector<int32_t>& prompt, bool stream) {
  httplib::Client client("127.0.0.1", port);
  client.set_read_timeout(120, 0);
  Json request = {{"model", "llama"},
                  {"prompt", prompt},
                  {"max_tokens", kMaxTokens},
                  {"temperature", 0},
                  {"stream", stream}};
  Answer answer;
  httplib::Result r = client.Post("/v1/completions", request.dump(), "application/json");
  if (!r) return answer;  // status 0: no HTTP answer at all
  answer.status = r->status;
  answer.retry_after = r->get_header_value("Retry-After");
  if (!stream || r->status != 200) {
    answer.body = Json::parse(r->body, nullptr, /*allow_exceptions=*/false);
    if (answer.body.contains("choices")) {
      answer.token_ids = answer.body["choices"][0]["token_ids"].get<std::vector<int32_t>>();
    }
    return answer;
  }
  for (absl::string_view line : absl::StrSplit(r->body, '\n', absl::SkipEmpty())) {
    if (!absl::ConsumePrefix(&line, "data: ") || line == "[DONE]") continue;
    answer.body = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (answer.body.contains("error")) answer.status = -1;  // an error after the 200
    if (!answer.body.contains("choices") || answer.body["choices"].empty()) continue;
    for (int32_t t : answer.body["choices"][0]["token_ids"]) answer.token_ids.push_back(t);
  }
  return answer;
}

TEST(Overload, ConcurrentLongRequestsAreServedOrRefusedWith429NeverUnavailable) {
  testing::TempDir dir;
  const std::string model_dir = dir.File("llama");
  KV_ASSERT_OK(WriteModel(model_dir, "llama"));
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<cli::ColocatedGenerator> reference,
                          cli::ColocatedGenerator::Load(model_dir));
  const int http_port = testing::PickUnusedPort();
  ClusterOptions options;
  options.model_dir = model_dir;
  options.prefill = 1;
  options.decode = 1;
  // Two batch places and no queue: the third request at once is more than the worker can start.
  options.extra_args = {"--http-address", absl::StrCat("127.0.0.1:", http_port), "--decode-args",
                        "--max-batch 2 --max-queued 0"};
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<LocalCluster> cluster, LocalCluster::Start(options));
  KV_ASSERT_OK_AND_ASSIGN(ServiceInfo gateway, cluster->Service("gateway"));

  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < kRequests; ++i) prompts.push_back(RandomPrompt(40 + i, 3400 + i));
  std::vector<Answer> answers(kRequests);
  std::vector<std::thread> threads;
  for (int i = 0; i < kRequests; ++i) {
    // Every other one streamed: a refusal must be a 429 there too, not a 200 and an error.
    threads.emplace_back([&, i] { answers[i] = Complete(http_port, prompts[i], i % 2 == 1); });
  }
  for (std::thread& t : threads) t.join();

  int served = 0, refused = 0;
  for (int i = 0; i < kRequests; ++i) {
    const Answer& a = answers[i];
    if (a.status == 200) {
      ++served;
      KV_ASSERT_OK_AND_ASSIGN(
          cli::GenerationResult expected,
          reference->Generate({.tokens = prompts[i], .max_tokens = kMaxTokens}));
      EXPECT_EQ(a.token_ids, expected.tokens) << "request " << i;
      continue;
    }
    ASSERT_EQ(a.status, 429) << "request " << i << ": " << a.body.dump() << "\n" << cluster->Log();
    ++refused;
    int64_t seconds = 0;
    EXPECT_TRUE(absl::SimpleAtoi(a.retry_after, &seconds) && seconds >= 1)
        << "request " << i << ": Retry-After '" << a.retry_after << "'";
    EXPECT_EQ(a.body["error"]["type"], "overloaded_error") << a.body.dump();
    EXPECT_EQ(a.body["error"]["code"], "overloaded") << a.body.dump();
  }
  std::cout << served << " served, " << refused << " refused with 429\n";
  EXPECT_GE(served, 2);
  EXPECT_GE(refused, 1) << "more concurrent requests than batch places, none refused";
  // Overload is not sickness: no breaker opened, every refusal counted as shed.
  KV_ASSERT_OK_AND_ASSIGN(
      double opens, ScrapeMetric(gateway.metrics_address, "kvrelay:gateway_breaker_opens_total"));
  EXPECT_EQ(opens, 0);
  KV_ASSERT_OK_AND_ASSIGN(double shed,
                          ScrapeMetric(gateway.metrics_address, "kvrelay:gateway_shed_total"));
  EXPECT_EQ(shed, refused);
  // The worker was busy, not taken out: the next request is served.
  const Answer again = Complete(http_port, prompts[0], /*stream=*/true);
  EXPECT_EQ(again.status, 200) << again.body.dump();
}

}  // namespace
}  // namespace kvrelay::e2e
