// The /metrics of real processes (`kvrelay up`: cache store, prefill, decode, gateway) after a
// cold and a warm request, parsed by prometheus_client's own parser (tests/e2e/parse_metrics.py,
// independent of kvrelay's renderer): the families dashboards built for vLLM read exist under
// the `kvrelay:` namespace with vLLM's types and bucket boundaries, every worker and gateway
// sample carries the served model's `model_name`, and the values agree with what the requests
// did (prefix hits in tokens, bytes per transfer, TTFT/ITL/E2E counts).

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "common/server/server_flags.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/local_cluster.h"
#include "tests/testing/process_harness.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::e2e {
using ::kvrelay::gateway::client::GatewayClient;
using ::kvrelay::gateway::client::GatewayRequest;

namespace {

using ::testing::ElementsAreArray;

constexpr absl::Duration kRequestTimeout = absl::Seconds(60);
constexpr int kBlockTokens = 16;  // the generated test models'

// vLLM's boundaries, written out here rather than taken from common/metrics.h, so a change
// there that would break vLLM dashboards fails this test (vllm/v1/metrics/loggers.py and the
// NIXL connector's metrics).
const std::vector<double> kVllmTtft = {0.001, 0.005, 0.01, 0.02,  0.04,  0.06,  0.08, 0.1,
                                       0.25,  0.5,   0.75, 1.0,   2.5,   5.0,   7.5,  10.0,
                                       20.0,  40.0,  80.0, 160.0, 640.0, 2560.0};
const std::vector<double> kVllmItl = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
                                      0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
const std::vector<double> kVllmE2e = {0.3,  0.5,   0.8,   1.0,   1.5,   2.0,    2.5,
                                      5.0,  10.0,  15.0,  20.0,  30.0,  40.0,   50.0,
                                      60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
const std::vector<double> kVllmXferTime = {0.005, 0.01, 0.025, 0.05, 0.075, 0.1,
                                           0.2,   0.3,  0.5,   0.75, 1.0,   5.0};
std::vector<double> VllmXferBytes() {  // [2 ** (10 + i) for i in range(1, 25, 2)]
  std::vector<double> out;
  for (int i = 1; i < 25; i += 2) out.push_back(static_cast<double>(int64_t{1} << (10 + i)));
  return out;
}

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;  // +Inf buckets' values are their counts; only the `le` label is +Inf
};
struct Family {
  std::string type;
  std::vector<Sample> samples;
};
// One process's /metrics: family name (as the parser names it: counters without `_total`) ->
// family.
using Exposition = std::map<std::string, Family>;

// Scrapes every service, parses each text with parse_metrics.py.
absl::StatusOr<std::map<std::string, Exposition>> ScrapeAll(const LocalCluster& cluster,
                                                            const testing::TempDir& dir) {
  std::vector<std::string> argv = {"/usr/bin/python3",
                                   testing::SourceDir() + "/tests/e2e/parse_metrics.py"};
  std::vector<std::string> names;
  for (const ServiceInfo& s : cluster.services()) {
    KV_ASSIGN_OR_RETURN(std::string text, ScrapeText(s.metrics_address));
    const std::string path = dir.File(s.name + ".prom");
    std::ofstream(path, std::ios::binary) << text;
    argv.push_back(path);
    names.push_back(s.name);
  }
  KV_ASSIGN_OR_RETURN(testing::CommandResult parsed, testing::RunCommand(argv));
  if (parsed.exit_code != 0) {
    return absl::InternalError(
        absl::StrCat("parse_metrics.py exited ", parsed.exit_code, ": ", parsed.stderr_text));
  }
  const nlohmann::json all = nlohmann::json::parse(parsed.stdout_text);
  std::map<std::string, Exposition> out;
  for (size_t i = 0; i < names.size(); ++i) {
    Exposition& e = out[names[i]];
    for (const auto& f : all[i]["families"]) {
      Family& family = e[f["name"].get<std::string>()];
      family.type = f["type"].get<std::string>();
      for (const auto& s : f["samples"]) {
        Sample sample;
        sample.name = s["name"].get<std::string>();
        sample.labels = s["labels"].get<std::map<std::string, std::string>>();
        sample.value = s["value"].is_null() ? 0 : s["value"].get<double>();
        family.samples.push_back(std::move(sample));
      }
    }
  }
  return out;
}

// The family `name` of type `type`, failing the test when it is absent or of another type.
const Family* Expect(const Exposition& e, const std::string& process, const std::string& name,
                     const std::string& type) {
  auto it = e.find(name);
  if (it == e.end()) {
    ADD_FAILURE() << process << " exports no " << name;
    return nullptr;
  }
  EXPECT_EQ(it->second.type, type) << process << " " << name;
  return &it->second;
}

double Sum(const Family* f, const std::string& sample_name) {
  double sum = 0;
  if (f == nullptr) return 0;
  for (const Sample& s : f->samples) {
    if (s.name == sample_name) sum += s.value;
  }
  return sum;
}

// The `le` bounds of a histogram's buckets (one label set), +Inf last and left out.
std::vector<double> Bounds(const Family* f) {
  std::vector<double> bounds;
  if (f == nullptr) return bounds;
  bool inf = false;
  for (const Sample& s : f->samples) {
    if (s.name.size() < 7 || s.name.compare(s.name.size() - 7, 7, "_bucket") != 0) continue;
    const std::string& le = s.labels.at("le");
    if (le == "+Inf") {
      inf = true;
      continue;
    }
    bounds.push_back(std::stod(le));
  }
  EXPECT_TRUE(inf) << "no +Inf bucket";
  return bounds;
}

TEST(Metrics, NamesTypesBucketsAndLabelsOfEveryProcess) {
  testing::TempDir dir;
  const std::string model_dir = dir.File("llama");
  KV_ASSERT_OK(WriteModel(model_dir, "llama"));
  const std::string model_name = server::ModelNameFromDir(model_dir);
  ClusterOptions options;
  options.model_dir = model_dir;
  options.prefill = 1;
  options.decode = 1;
  KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<LocalCluster> cluster, LocalCluster::Start(options));

  // A cold 100-token prompt, then a 116-token one sharing its first 96 tokens. The decode worker
  // computes the last prompt token itself, so the prefill worker looks up (100 - 1) / 16 = 6
  // full blocks, then 115 / 16 = 7, of which the first 6 hit (and the decode worker that kept
  // them is sent only block 7).
  GatewayClient client(cluster->gateway());
  const std::vector<int32_t> cold = RandomPrompt(100, 5);
  std::vector<int32_t> warm(cold.begin(), cold.begin() + 96);
  for (int32_t t : RandomPrompt(20, 6)) warm.push_back(t);
  constexpr int kMaxTokens = 8;
  int generated = 0;
  for (const std::vector<int32_t>* prompt :
       std::vector<const std::vector<int32_t>*>{&cold, &warm}) {
    GatewayRequest request;
    request.generation.tokens = *prompt;
    request.generation.max_tokens = kMaxTokens;
    request.tenant = "metrics";
    KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult result,
                            client.Generate(request, kRequestTimeout));
    generated += result.generated_tokens;
  }

  KV_ASSERT_OK_AND_ASSIGN(auto scraped, ScrapeAll(*cluster, dir));
  ASSERT_EQ(scraped.size(), 4u) << cluster->Log();
  for (const auto& [process, exposition] : scraped) {
    const bool per_model = process != "cachestore";  // the store serves every model
    for (const auto& [name, family] : exposition) {
      EXPECT_EQ(name.rfind("kvrelay:", 0), 0u) << process << ": " << name << " is outside kvrelay:";
      for (const Sample& s : family.samples) {
        if (!per_model) continue;
        auto it = s.labels.find("model_name");
        ASSERT_TRUE(it != s.labels.end()) << process << ": " << s.name << " has no model_name";
        EXPECT_EQ(it->second, model_name) << process << ": " << s.name;
      }
    }
  }

  // The gateway: request-level latencies with vLLM's buckets, tokens, successes.
  const Exposition& gateway = scraped.at("gateway");
  const Family* ttft =
      Expect(gateway, "gateway", "kvrelay:time_to_first_token_seconds", "histogram");
  const Family* itl =
      Expect(gateway, "gateway", "kvrelay:inter_token_latency_seconds", "histogram");
  const Family* e2e =
      Expect(gateway, "gateway", "kvrelay:e2e_request_latency_seconds", "histogram");
  EXPECT_THAT(Bounds(ttft), ElementsAreArray(kVllmTtft));
  EXPECT_THAT(Bounds(itl), ElementsAreArray(kVllmItl));
  EXPECT_THAT(Bounds(e2e), ElementsAreArray(kVllmE2e));
  EXPECT_EQ(Sum(ttft, "kvrelay:time_to_first_token_seconds_count"), 2);
  EXPECT_EQ(Sum(e2e, "kvrelay:e2e_request_latency_seconds_count"), 2);
  // One observation per chunk after a request's first: at most one per token after the first
  // (a chunk may carry several when the stream falls behind the batch).
  EXPECT_GE(Sum(itl, "kvrelay:inter_token_latency_seconds_count"), 2);
  EXPECT_LE(Sum(itl, "kvrelay:inter_token_latency_seconds_count"), generated - 2);
  EXPECT_EQ(Sum(Expect(gateway, "gateway", "kvrelay:prompt_tokens", "counter"),
                "kvrelay:prompt_tokens_total"),
            216);
  EXPECT_EQ(Sum(Expect(gateway, "gateway", "kvrelay:generation_tokens", "counter"),
                "kvrelay:generation_tokens_total"),
            generated);
  const Family* success = Expect(gateway, "gateway", "kvrelay:request_success", "counter");
  EXPECT_EQ(Sum(success, "kvrelay:request_success_total"), 2);
  if (success != nullptr) {
    std::set<std::string> reasons;
    for (const Sample& s : success->samples) reasons.insert(s.labels.at("finished_reason"));
    EXPECT_EQ(reasons, (std::set<std::string>{"length", "stop"}));
  }

  // Workers and breakers as the gateway routes, and the shed families alerts read, at zero.
  for (const char* role : {"prefill", "decode"}) {
    const Family* workers = Expect(gateway, "gateway", "kvrelay:gateway_workers", "gauge");
    const Family* open = Expect(gateway, "gateway", "kvrelay:gateway_breakers_open", "gauge");
    for (const Family* f : {workers, open}) {
      if (f == nullptr) continue;
      for (const Sample& s : f->samples) {
        if (s.labels.at("role") != role) continue;
        EXPECT_EQ(s.value, f == workers ? 1 : 0) << s.name << " " << role;
      }
    }
  }
  const Family* shed = Expect(gateway, "gateway", "kvrelay:gateway_shed", "counter");
  if (shed != nullptr) {
    std::set<std::string> tiers;
    for (const Sample& s : shed->samples) {
      if (s.name != "kvrelay:gateway_shed_total") continue;
      tiers.insert(s.labels.at("tier"));
      EXPECT_EQ(s.value, 0) << s.labels.at("tier");
    }
    EXPECT_EQ(tiers, (std::set<std::string>{"decode", "gateway", "prefill"}));
  }

  // The prefill worker: prefix-cache queries and hits in tokens, engine state, transfers.
  const Exposition& prefill = scraped.at("prefill-0");
  const double queries = Sum(Expect(prefill, "prefill", "kvrelay:prefix_cache_queries", "counter"),
                             "kvrelay:prefix_cache_queries_total");
  const double hits = Sum(Expect(prefill, "prefill", "kvrelay:prefix_cache_hits", "counter"),
                          "kvrelay:prefix_cache_hits_total");
  EXPECT_EQ(queries, (6 + 7) * kBlockTokens);
  EXPECT_EQ(hits, 6 * kBlockTokens);
  const Exposition& decode = scraped.at("decode-0");
  for (const Exposition* worker : std::vector<const Exposition*>{&prefill, &decode}) {
    const std::string who = worker == &prefill ? "prefill" : "decode";
    Expect(*worker, who, "kvrelay:num_requests_running", "gauge");
    Expect(*worker, who, "kvrelay:num_requests_waiting", "gauge");
    EXPECT_EQ(Sum(Expect(*worker, who, "kvrelay:num_requests_running", "gauge"),
                  "kvrelay:num_requests_running") +
                  Sum(Expect(*worker, who, "kvrelay:num_requests_waiting", "gauge"),
                      "kvrelay:num_requests_waiting"),
              0)
        << who << ": nothing is in flight after the requests";
    const double usage = Sum(Expect(*worker, who, "kvrelay:kv_cache_usage_perc", "gauge"),
                             "kvrelay:kv_cache_usage_perc");
    EXPECT_GE(usage, 0);
    EXPECT_LE(usage, 1);
    const Family* info = Expect(*worker, who, "kvrelay:cache_config_info", "gauge");
    if (info != nullptr) {
      ASSERT_EQ(info->samples.size(), 1u) << who;
      const Sample& s = info->samples[0];
      EXPECT_EQ(s.value, 1);
      EXPECT_EQ(s.labels.at("block_size"), absl::StrCat(kBlockTokens));
      EXPECT_EQ(s.labels.at("role"), who);
      EXPECT_EQ(s.labels.at("enable_prefix_caching"), who == "prefill" ? "True" : "False");
      EXPECT_FALSE(s.labels.at("cache_dtype").empty());
      EXPECT_GT(std::stoll(s.labels.at("num_gpu_blocks")), 0);
      // LocalCluster runs the workers with --device cpu.
      EXPECT_EQ(s.labels.at("device"), "cpu");
      EXPECT_EQ(s.labels.at("device_name"), "cpu");
    }
  }
  const Family* xfer_time =
      Expect(prefill, "prefill", "kvrelay:kv_transfer_time_seconds", "histogram");
  const Family* xfer_bytes = Expect(prefill, "prefill", "kvrelay:kv_transfer_bytes", "histogram");
  EXPECT_THAT(Bounds(xfer_time), ElementsAreArray(kVllmXferTime));
  EXPECT_THAT(Bounds(xfer_bytes), ElementsAreArray(VllmXferBytes()));
  EXPECT_EQ(Sum(xfer_time, "kvrelay:kv_transfer_time_seconds_count"), 2);
  EXPECT_EQ(Sum(xfer_bytes, "kvrelay:kv_transfer_bytes_count"), 2);
  EXPECT_EQ(Sum(xfer_bytes, "kvrelay:kv_transfer_bytes_sum"),
            Sum(Expect(prefill, "prefill", "kvrelay:prefill_pushed_kv_bytes", "counter"),
                "kvrelay:prefill_pushed_kv_bytes_total"));
  EXPECT_GT(Sum(xfer_bytes, "kvrelay:kv_transfer_bytes_sum"), 0);
  // Bytes moved per token: what was pushed is exactly the layout's bytes for the tokens of the
  // blocks sent (6 cold, then only block 7: the decode worker held the first 6).
  const double pushed_tokens =
      Sum(Expect(prefill, "prefill", "kvrelay:prefill_pushed_kv_tokens", "counter"),
          "kvrelay:prefill_pushed_kv_tokens_total");
  EXPECT_EQ(pushed_tokens, (6 + 1) * kBlockTokens);
  const double bytes_per_token =
      Sum(Expect(prefill, "prefill", "kvrelay:kv_bytes_per_token", "gauge"),
          "kvrelay:kv_bytes_per_token");
  EXPECT_GT(bytes_per_token, 0);
  EXPECT_EQ(Sum(Expect(decode, "decode", "kvrelay:kv_bytes_per_token", "gauge"),
                "kvrelay:kv_bytes_per_token"),
            bytes_per_token);
  EXPECT_EQ(Sum(xfer_bytes, "kvrelay:kv_transfer_bytes_sum"), pushed_tokens * bytes_per_token);
  // Per link: the one decode worker got every pushed byte.
  const Family* link = Expect(prefill, "prefill", "kvrelay:kv_transfer_link_bytes", "counter");
  EXPECT_EQ(Sum(link, "kvrelay:kv_transfer_link_bytes_total"),
            Sum(xfer_bytes, "kvrelay:kv_transfer_bytes_sum"));
  if (link != nullptr) {
    for (const Sample& s : link->samples) EXPECT_EQ(s.labels.at("decode"), "decode-0") << s.name;
  }
  EXPECT_GT(Sum(Expect(prefill, "prefill", "kvrelay:kv_transfer_link_seconds", "counter"),
                "kvrelay:kv_transfer_link_seconds_total"),
            0);
  // Failures by reason: the family is registered on first failure; none happened here.
  EXPECT_EQ(prefill.count("kvrelay:kv_transfer_failures"), 0u);

  // The cache store keeps its own families, in blocks and per RPC.
  const Exposition& store = scraped.at("cachestore");
  Expect(store, "cachestore", "kvrelay:cachestore_rpc_seconds", "histogram");
  EXPECT_GE(Sum(Expect(store, "cachestore", "kvrelay:cachestore_prefix_hit_blocks", "counter"),
                "kvrelay:cachestore_prefix_hit_blocks_total"),
            6);

  absl::StatusOr<int> code = cluster->Stop();
  EXPECT_TRUE(code.ok() && *code == 0) << cluster->Log();
}

}  // namespace
}  // namespace kvrelay::e2e
