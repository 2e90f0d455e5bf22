#pragma once

// What `kvrelay status` prints, from the gateways' Gateway/Status answers: pure functions (no
// I/O), so the table and the JSON are tested from fixed inputs (status_render_test.cc).
//
// Nodes are merged across the gateways and the store's registry by node id (by gRPC address
// while a fixed worker's id is unknown). A node's state, decided from structured fields only:
//   draining      a gateway's Status call was refused with ErrorInfo FAILURE_DRAINING;
//   unregistered  the store answered and does not list it (its lease ran out, or it left),
//                 while a gateway still has it (a fixed --prefill/--decode address);
//   suspect       the registry marks it suspect (heartbeat past its TTL), a gateway's breaker
//                 for it is not closed, or it did not answer a gateway's Status call;
//   serving       otherwise.

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvrelay/v1/gateway.pb.h"
#include "nlohmann/json.hpp"

namespace kvrelay::cli {

// One gateway's answer (or why there is none).
struct GatewayReply {
  std::string address;
  absl::StatusOr<kvrelay::v1::GatewayStatusResponse> reply;
};

struct LinkRateRow {
  std::string holder;  // data-plane address
  double bytes_per_second = 0;
};

// One node as the whole cluster sees it.
struct NodeRow {
  std::string node_id;  // the gRPC address while unknown
  std::string role;     // prefill, decode, cache, unknown
  uint64_t incarnation = 0;
  std::string address;           // gRPC
  std::string state;             // serving, draining, suspect, unregistered
  std::vector<std::string> why;  // what made it other than serving
  bool registered = false;
  int64_t since_heartbeat_ms = -1;  // -1: not registered
  // Cache segment (DRAM tier) slots, from the registry; -1: unknown.
  int64_t dram_used_slots = -1;
  int64_t dram_total_slots = -1;
  // Its disk tier's slots, from the registry; -1: no disk tier (or unknown).
  int64_t ssd_used_slots = -1;
  int64_t ssd_total_slots = -1;
  // The request KV pool (decode: free of total slots), from the node's Status; -1: unknown.
  int64_t pool_free_slots = -1;
  int64_t pool_total_slots = -1;
  // Prefill: prompt tokens found cached / (found + computed), from its Status.
  std::optional<double> hit_rate;
  int64_t hit_tokens = 0;
  int64_t computed_tokens = 0;
  int32_t in_flight = 0;         // the gateways' requests on it, summed
  int64_t picked = 0;            // requests the gateways have sent it, summed
  int32_t active_requests = -1;  // the node's own (decode: active + queued); -1: unknown
  std::string breaker = "-";     // the worst of the gateways' (closed < half-open < open)
  std::vector<std::pair<std::string, std::string>> breakers;  // gateway -> state
  double compute_tokens_per_second = 0;                       // prefill; 0: not measured
  std::vector<LinkRateRow> link_rates;                        // prefill pulls, per holder
  // Decode: what the gateways learned (the slowest gateway's view); 0: nothing yet.
  double service_ms = 0;
  double transfer_ms_per_mib = 0;
};

struct StoreRow {
  bool answered = false;
  std::string address;
  std::string via;    // the gateway it was asked through
  std::string error;  // when not answered
  kvrelay::v1::StatsResponse stats;
  std::optional<double> hit_rate;  // prefix_hit_blocks / prefix_query_blocks
};

struct ClusterStatus {
  std::vector<GatewayReply> gateways;
  StoreRow store;
  std::vector<NodeRow> nodes;  // sorted by role, then node id
};

// Merges the gateways' answers into one view (the registry and stats of the first gateway
// whose store answered, preferring a leading store instance).
ClusterStatus MergeStatus(std::vector<GatewayReply> gateways);

nlohmann::json StatusJson(const ClusterStatus& status);
std::string StatusTable(const ClusterStatus& status);

}  // namespace kvrelay::cli
