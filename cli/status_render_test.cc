#include "cli/status_render.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvrelay::cli {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

v1::NodeInfo Registered(const std::string& id, v1::NodeRole role, const std::string& address,
                        uint64_t incarnation, v1::NodeState state = v1::NODE_STATE_LIVE) {
  v1::NodeInfo n;
  n.set_node_id(id);
  n.set_role(role);
  n.set_grpc_address(address);
  n.set_incarnation(incarnation);
  n.set_state(state);
  n.set_since_heartbeat_ms(state == v1::NODE_STATE_SUSPECT ? 12000 : 300);
  n.set_ttl_ms(10000);
  n.set_used_slots(12);
  n.set_capacity_slots(256);
  return n;
}

v1::WorkerStatus Worker(const std::string& id, v1::NodeRole role, const std::string& address) {
  v1::WorkerStatus w;
  w.set_role(role);
  w.set_node_id(id);
  w.set_address(address);
  w.set_breaker(v1::BREAKER_STATE_CLOSED);
  w.set_answered(true);
  if (role == v1::NODE_ROLE_PREFILL) {
    v1::PrefillStatusResponse* p = w.mutable_prefill();
    p->set_node_id(id);
    p->set_prefix_hit_tokens_total(96);
    p->set_computed_tokens_total(32);
    p->set_active_requests(1);
    p->set_compute_tokens_per_second(2500);
    v1::LinkRate* l = p->add_link_rates();
    l->set_holder_address("127.0.0.1:13337");
    l->set_bytes_per_second(1.5 * 1024 * 1024 * 1024);
  } else {
    v1::DecodeStatusResponse* d = w.mutable_decode();
    d->set_node_id(id);
    d->set_active_requests(2);
    d->set_queued_requests(1);
    d->set_free_slots(500);
    d->set_total_slots(512);
  }
  return w;
}

// One gateway, a leading store; prefill-0 and decode-0 serving, decode-1 paused (the registry
// marks it suspect and it did not answer), decode-2 killed (the registry forgot it; the
// gateway still has its fixed address), decode-3 draining.
v1::GatewayStatusResponse FixedCluster() {
  v1::GatewayStatusResponse r;
  r.set_model("model-llama");
  r.set_store_address("127.0.0.1:7000");
  v1::StatsResponse* s = r.mutable_store();
  s->set_leading(true);
  s->set_policy("adaptive");
  s->set_nodes(3);
  s->set_suspect_nodes(1);
  s->set_committed_blocks(40);
  s->set_prefix_query_blocks(20);
  s->set_prefix_hit_blocks(9);
  v1::TierStats* t = s->add_tiers();
  t->set_tier(v1::TIER_HOST);
  t->set_used_bytes(3 << 20);
  t->set_capacity_bytes(64 << 20);
  v1::ListNodesResponse* reg = r.mutable_registry();
  *reg->add_nodes() = Registered("prefill-0", v1::NODE_ROLE_PREFILL, "127.0.0.1:7100", 0xa1);
  *reg->add_nodes() = Registered("decode-0", v1::NODE_ROLE_DECODE, "127.0.0.1:7200", 0xb1);
  *reg->add_nodes() =
      Registered("decode-1", v1::NODE_ROLE_DECODE, "127.0.0.1:7201", 0xb2, v1::NODE_STATE_SUSPECT);
  *reg->add_nodes() = Registered("decode-3", v1::NODE_ROLE_DECODE, "127.0.0.1:7203", 0xb4);
  *r.add_workers() = Worker("prefill-0", v1::NODE_ROLE_PREFILL, "127.0.0.1:7100");
  v1::WorkerStatus d0 = Worker("decode-0", v1::NODE_ROLE_DECODE, "127.0.0.1:7200");
  d0.set_in_flight(2);
  d0.set_picked(7);
  d0.set_service_ms(84);
  d0.set_transfer_ms_per_mib(12.5);
  *r.add_workers() = d0;
  // Fixed workers that did not answer: no node id from their Status.
  v1::WorkerStatus d1 = Worker("", v1::NODE_ROLE_DECODE, "127.0.0.1:7201");
  d1.clear_decode();
  d1.set_answered(false);
  d1.set_status_code(static_cast<int>(absl::StatusCode::kDeadlineExceeded));
  *r.add_workers() = d1;
  v1::WorkerStatus d2 = Worker("", v1::NODE_ROLE_DECODE, "127.0.0.1:7202");
  d2.clear_decode();
  d2.set_answered(false);
  d2.set_status_code(static_cast<int>(absl::StatusCode::kUnavailable));
  d2.set_breaker(v1::BREAKER_STATE_OPEN);
  d2.set_breaker_failures(3);
  *r.add_workers() = d2;
  v1::WorkerStatus d3 = Worker("decode-3", v1::NODE_ROLE_DECODE, "127.0.0.1:7203");
  d3.clear_decode();
  d3.set_answered(false);
  d3.set_status_code(static_cast<int>(absl::StatusCode::kUnavailable));
  d3.set_status_reason(v1::FAILURE_DRAINING);
  *r.add_workers() = d3;
  return r;
}

ClusterStatus Merged() {
  std::vector<GatewayReply> replies;
  replies.push_back({"127.0.0.1:50051", FixedCluster()});
  replies.push_back({"127.0.0.1:50052", absl::UnavailableError("connection refused")});
  return MergeStatus(std::move(replies));
}

const NodeRow* Find(const ClusterStatus& s, const std::string& id) {
  for (const NodeRow& n : s.nodes) {
    if (n.node_id == id) return &n;
  }
  return nullptr;
}

// A worker with a disk tier: the registry counts its disk segment's slots apart, and the
// table shows them under SSD, not in DRAM SLOTS.
TEST(StatusRender, ADiskTiersSlotsShowUnderSsd) {
  v1::GatewayStatusResponse cluster = FixedCluster();
  v1::NodeInfo* p0 = cluster.mutable_registry()->mutable_nodes(0);
  p0->set_capacity_slots(256 + 2048);
  p0->set_used_slots(12 + 100);
  p0->set_ssd_capacity_slots(2048);
  p0->set_ssd_used_slots(100);
  std::vector<GatewayReply> replies;
  replies.push_back({"127.0.0.1:50051", cluster});
  const ClusterStatus s = MergeStatus(std::move(replies));
  const NodeRow* row = Find(s, "prefill-0");
  ASSERT_NE(row, nullptr);
  EXPECT_EQ(row->dram_used_slots, 12);
  EXPECT_EQ(row->dram_total_slots, 256);
  EXPECT_EQ(row->ssd_used_slots, 100);
  EXPECT_EQ(row->ssd_total_slots, 2048);
  EXPECT_THAT(StatusTable(s), ::testing::ContainsRegex("prefill-0 .* 12/256 +100/2048 "));
  const NodeRow* d0 = Find(s, "decode-0");
  ASSERT_NE(d0, nullptr);
  EXPECT_EQ(d0->ssd_total_slots, -1) << "no disk tier";
}

TEST(StatusRender, MergesTheRegistryAndTheGatewaysIntoOneStatePerNode) {
  const ClusterStatus s = Merged();
  ASSERT_EQ(s.nodes.size(), 5u);
  EXPECT_EQ(s.nodes[0].node_id, "prefill-0");  // prefill first, then decode by id
  const NodeRow* p0 = Find(s, "prefill-0");
  ASSERT_NE(p0, nullptr);
  EXPECT_EQ(p0->state, "serving");
  EXPECT_EQ(p0->incarnation, 0xa1u);
  ASSERT_TRUE(p0->hit_rate.has_value());
  EXPECT_DOUBLE_EQ(*p0->hit_rate, 0.75);  // 96 of 128 prompt tokens
  EXPECT_EQ(p0->dram_used_slots, 12);
  EXPECT_EQ(p0->dram_total_slots, 256);
  const NodeRow* d0 = Find(s, "decode-0");
  ASSERT_NE(d0, nullptr);
  EXPECT_EQ(d0->state, "serving");
  EXPECT_EQ(d0->in_flight, 2);
  EXPECT_EQ(d0->picked, 7);
  EXPECT_EQ(d0->active_requests, 3);
  EXPECT_EQ(d0->pool_free_slots, 500);
  EXPECT_EQ(d0->service_ms, 84);
  EXPECT_EQ(d0->transfer_ms_per_mib, 12.5);
  EXPECT_THAT(StatusTable(s), HasSubstr("first token 84 ms; push 12.5 ms/MiB"));
  // The paused one: the registry's id joined to the gateway's fixed address.
  const NodeRow* d1 = Find(s, "decode-1");
  ASSERT_NE(d1, nullptr);
  EXPECT_EQ(d1->state, "suspect");
  EXPECT_EQ(d1->address, "127.0.0.1:7201");
  EXPECT_EQ(d1->why.size(), 2u);  // registry heartbeat + no Status answer
  // The killed one: only the gateway knows it, by address.
  const NodeRow* d2 = Find(s, "127.0.0.1:7202");
  ASSERT_NE(d2, nullptr);
  EXPECT_EQ(d2->state, "unregistered");
  EXPECT_EQ(d2->breaker, "open");
  EXPECT_FALSE(d2->registered);
  const NodeRow* d3 = Find(s, "decode-3");
  ASSERT_NE(d3, nullptr);
  EXPECT_EQ(d3->state, "draining");
  EXPECT_TRUE(s.store.answered);
  ASSERT_TRUE(s.store.hit_rate.has_value());
  EXPECT_DOUBLE_EQ(*s.store.hit_rate, 0.45);
}

// A SIGTERMed worker still answers Status while it finishes what it admitted: draining, with
// its load, from whichever gateway asked.
TEST(StatusRender, AWorkerThatSaysItDrainsIsDrainingWithItsLoad) {
  v1::GatewayStatusResponse r;
  r.set_model("model-llama");
  *r.mutable_registry()->add_nodes() =
      Registered("decode-0", v1::NODE_ROLE_DECODE, "127.0.0.1:7200", 0xb1);
  v1::WorkerStatus d0 = Worker("decode-0", v1::NODE_ROLE_DECODE, "127.0.0.1:7200");
  d0.mutable_decode()->set_draining(true);
  *r.add_workers() = d0;
  std::vector<GatewayReply> replies;
  replies.push_back({"127.0.0.1:50051", r});
  const ClusterStatus s = MergeStatus(std::move(replies));
  const NodeRow* d = Find(s, "decode-0");
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->state, "draining");
  EXPECT_GT(d->active_requests, 0);
  ASSERT_EQ(d->why.size(), 1u);
  EXPECT_THAT(d->why[0], HasSubstr("finishes what it admitted"));
  EXPECT_THAT(StatusTable(s), HasSubstr("decode-0 draining:"));
}

TEST(StatusRender, JsonCarriesEveryField) {
  const nlohmann::json j = StatusJson(Merged());
  ASSERT_EQ(j["gateways"].size(), 2u);
  EXPECT_TRUE(j["gateways"][0]["ok"].get<bool>());
  EXPECT_FALSE(j["gateways"][1]["ok"].get<bool>());
  EXPECT_THAT(j["gateways"][1]["error"].get<std::string>(), HasSubstr("UNAVAILABLE"));
  EXPECT_TRUE(j["store"]["leading"].get<bool>());
  EXPECT_EQ(j["store"]["leader_address"], "127.0.0.1:7000");
  EXPECT_DOUBLE_EQ(j["store"]["hit_rate"].get<double>(), 0.45);
  EXPECT_EQ(j["store"]["tiers"][0]["tier"], "dram");
  const nlohmann::json& p0 = j["nodes"][0];
  EXPECT_EQ(p0["node_id"], "prefill-0");
  EXPECT_EQ(p0["role"], "prefill");
  EXPECT_EQ(p0["incarnation"], "00000000000000a1");
  EXPECT_EQ(p0["state"], "serving");
  EXPECT_EQ(p0["tiers"]["dram"]["used_slots"], 12);
  EXPECT_TRUE(p0["tiers"]["ssd"].is_null());
  EXPECT_DOUBLE_EQ(p0["hit_rate"].get<double>(), 0.75);
  EXPECT_EQ(p0["breaker"], "closed");
  EXPECT_EQ(p0["breakers"]["127.0.0.1:50051"], "closed");
  EXPECT_DOUBLE_EQ(p0["compute_tokens_per_second"].get<double>(), 2500);
  ASSERT_EQ(p0["link_rates"].size(), 1u);
  EXPECT_EQ(p0["link_rates"][0]["holder"], "127.0.0.1:13337");
  std::vector<std::string> states;
  for (const nlohmann::json& n : j["nodes"]) states.push_back(n["state"]);
  EXPECT_EQ(states, (std::vector<std::string>{"serving", "unregistered", "serving", "suspect",
                                              "draining"}));
  // A decode node has no hit rate of its own; an unregistered one no heartbeat.
  EXPECT_TRUE(j["nodes"][2]["hit_rate"].is_null());
  EXPECT_EQ(j["nodes"][2]["picked"], 7);
  EXPECT_TRUE(j["nodes"][1]["since_heartbeat_ms"].is_null());
}

TEST(StatusRender, TableShowsTheStoreTheGatewaysAndOneLinePerNode) {
  const std::string table = StatusTable(Merged());
  EXPECT_THAT(table, HasSubstr("store    127.0.0.1:7000  leader (no HA)  policy adaptive"));
  EXPECT_THAT(table, HasSubstr("hit rate 45.0% (9/20 blocks)"));
  EXPECT_THAT(table, HasSubstr("tier dram: 3.0 MiB of 64.0 MiB used"));
  EXPECT_THAT(table, HasSubstr("gateway  127.0.0.1:50051  ok  model model-llama, 5 workers"));
  EXPECT_THAT(table, HasSubstr("gateway  127.0.0.1:50052  NOT ANSWERING: UNAVAILABLE"));
  EXPECT_THAT(table, HasSubstr("NODE "));
  EXPECT_THAT(table, HasSubstr("compute 2500 tok/s; from 127.0.0.1:13337 1.5 GiB/s"));
  EXPECT_THAT(table, HasSubstr("decode-1 suspect: registry: no heartbeat for 12000 ms"));
  EXPECT_THAT(table, HasSubstr("127.0.0.1:7202 unregistered: not in the store's registry"));
  EXPECT_THAT(table, HasSubstr("decode-3 draining:"));
  EXPECT_THAT(table, Not(HasSubstr("decode-0 serving:")));  // no reason line when serving
  // Every node row is aligned under the header: the STATE column starts at the same place.
  const size_t header = table.find("NODE ");
  const size_t state_col = table.find("STATE", header) - header;
  const size_t row = table.find("\nprefill-0 ") + 1;
  EXPECT_EQ(table.substr(row + state_col, 7), "serving");
}

TEST(StatusRender, AStoreThatDidNotAnswerLeavesNodesToTheGateways) {
  v1::GatewayStatusResponse r = FixedCluster();
  r.clear_registry();
  r.clear_store();
  r.set_store_code(static_cast<int>(absl::StatusCode::kDeadlineExceeded));
  r.set_store_error("no answer in 500ms");
  std::vector<GatewayReply> replies;
  replies.push_back({"127.0.0.1:50051", r});
  const ClusterStatus s = MergeStatus(std::move(replies));
  EXPECT_FALSE(s.store.answered);
  EXPECT_THAT(s.store.error, HasSubstr("DEADLINE_EXCEEDED"));
  // Without a registry nothing is "unregistered"; a node that did not answer is suspect.
  for (const NodeRow& n : s.nodes) EXPECT_NE(n.state, "unregistered") << n.node_id;
  const NodeRow* d2 = Find(s, "127.0.0.1:7202");
  ASSERT_NE(d2, nullptr);
  EXPECT_EQ(d2->state, "suspect");
  EXPECT_THAT(StatusTable(s), HasSubstr("NOT ANSWERING (via 127.0.0.1:50051)"));
}

}  // namespace
}  // namespace kvrelay::cli
