#include "cli/status_render.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace kvrelay::cli {
namespace {

using ::kvrelay::v1::GatewayStatusResponse;
using ::kvrelay::v1::NodeInfo;
using ::kvrelay::v1::WorkerStatus;

std::string RoleName(kvrelay::v1::NodeRole role) {
  switch (role) {
    case kvrelay::v1::NODE_ROLE_PREFILL:
      return "prefill";
    case kvrelay::v1::NODE_ROLE_DECODE:
      return "decode";
    case kvrelay::v1::NODE_ROLE_CACHE:
      return "cache";
    default:
      return "unknown";
  }
}

std::string BreakerName(kvrelay::v1::BreakerState state) {
  switch (state) {
    case kvrelay::v1::BREAKER_STATE_CLOSED:
      return "closed";
    case kvrelay::v1::BREAKER_STATE_OPEN:
      return "open";
    case kvrelay::v1::BREAKER_STATE_HALF_OPEN:
      return "half-open";
    default:
      return "-";
  }
}

int BreakerRank(const std::string& name) {
  if (name == "open") return 3;
  if (name == "half-open") return 2;
  if (name == "closed") return 1;
  return 0;
}

std::string TierName(kvrelay::v1::Tier tier) {
  switch (tier) {
    case kvrelay::v1::TIER_GPU:
      return "gpu";
    case kvrelay::v1::TIER_HOST:
      return "dram";
    case kvrelay::v1::TIER_SSD:
      return "ssd";
    default:
      return "unknown";
  }
}

std::optional<double> Ratio(int64_t part, int64_t whole) {
  if (whole <= 0) return std::nullopt;
  return static_cast<double>(part) / static_cast<double>(whole);
}

std::string Percent(const std::optional<double>& r) {
  return r.has_value() ? absl::StrFormat("%.1f%%", *r * 100) : "-";
}

std::string Bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  return u == 0 ? absl::StrFormat("%.0f %s", b, units[u]) : absl::StrFormat("%.1f %s", b, units[u]);
}

NodeRow& RowFor(std::map<std::string, NodeRow>& rows, const std::string& node_id,
                const std::string& address) {
  // Fixed workers are listed by address until their id is known: join them to the id's row.
  if (!node_id.empty()) {
    if (auto it = rows.find(address); it != rows.end() && it->second.node_id == address) {
      NodeRow moved = std::move(it->second);
      rows.erase(it);
      moved.node_id = node_id;
      return rows[node_id] = std::move(moved);
    }
    NodeRow& row = rows[node_id];
    row.node_id = node_id;
    return row;
  }
  for (auto& [key, row] : rows) {
    if (row.address == address) return row;
  }
  NodeRow& row = rows[address];
  row.node_id = address;
  return row;
}

void AddWorker(NodeRow& row, const std::string& gateway, const WorkerStatus& w) {
  if (row.role.empty() || row.role == "unknown") row.role = RoleName(w.role());
  if (row.incarnation == 0) row.incarnation = w.incarnation();
  if (row.address.empty()) row.address = w.address();
  row.in_flight += w.in_flight();
  row.picked += w.picked();
  row.service_ms = std::max(row.service_ms, w.service_ms());
  row.transfer_ms_per_mib = std::max(row.transfer_ms_per_mib, w.transfer_ms_per_mib());
  const std::string breaker = BreakerName(w.breaker());
  row.breakers.emplace_back(gateway, breaker);
  if (BreakerRank(breaker) > BreakerRank(row.breaker)) row.breaker = breaker;
  if (w.breaker() != kvrelay::v1::BREAKER_STATE_CLOSED) {
    row.why.push_back(absl::StrCat("breaker ", breaker, " at gateway ", gateway, " (",
                                   w.breaker_failures(), " failures)"));
  }
  if (!w.answered()) {
    if (w.status_reason() == kvrelay::v1::FAILURE_DRAINING) {
      row.state = "draining";
      row.why.push_back(absl::StrCat("draining (refused gateway ", gateway, "'s Status)"));
    } else {
      row.why.push_back(
          absl::StrCat("no Status answer to gateway ", gateway, ": ",
                       absl::StatusCodeToString(static_cast<absl::StatusCode>(w.status_code()))));
    }
    return;
  }
  if ((w.has_prefill() && w.prefill().draining()) || (w.has_decode() && w.decode().draining())) {
    row.state = "draining";
    row.why.push_back(absl::StrCat("draining (told gateway ", gateway,
                                   "): refuses new work, finishes what it admitted, then leaves"));
  }
  if (w.has_prefill()) {
    const kvrelay::v1::PrefillStatusResponse& p = w.prefill();
    row.active_requests = p.active_requests();
    row.hit_tokens = p.prefix_hit_tokens_total();
    row.computed_tokens = p.computed_tokens_total();
    row.hit_rate =
        Ratio(p.prefix_hit_tokens_total(), p.prefix_hit_tokens_total() + p.computed_tokens_total());
    row.compute_tokens_per_second = p.compute_tokens_per_second();
    row.link_rates.clear();
    for (const kvrelay::v1::LinkRate& l : p.link_rates()) {
      row.link_rates.push_back({l.holder_address(), l.bytes_per_second()});
    }
  } else if (w.has_decode()) {
    const kvrelay::v1::DecodeStatusResponse& d = w.decode();
    row.active_requests = d.active_requests() + d.queued_requests();
    row.pool_free_slots = d.free_slots();
    row.pool_total_slots = d.total_slots();
  }
}

void AddRegistered(NodeRow& row, const NodeInfo& n) {
  row.registered = true;
  row.role = RoleName(n.role());
  row.incarnation = n.incarnation();
  row.address = n.grpc_address();
  row.since_heartbeat_ms = n.since_heartbeat_ms();
  row.dram_used_slots = n.used_slots() - n.ssd_used_slots();
  row.dram_total_slots = n.capacity_slots() - n.ssd_capacity_slots();
  if (n.ssd_capacity_slots() > 0) {
    row.ssd_used_slots = n.ssd_used_slots();
    row.ssd_total_slots = n.ssd_capacity_slots();
  }
  if (n.state() == kvrelay::v1::NODE_STATE_SUSPECT) {
    row.why.push_back(absl::StrCat("registry: no heartbeat for ", n.since_heartbeat_ms(),
                                   " ms (TTL ", n.ttl_ms(), " ms)"));
  }
}

}  // namespace

ClusterStatus MergeStatus(std::vector<GatewayReply> gateways) {
  ClusterStatus out;
  out.gateways = std::move(gateways);
  // The store's view: a leading instance's if any gateway reached one, else the first answer.
  const GatewayStatusResponse* store_view = nullptr;
  for (const GatewayReply& g : out.gateways) {
    if (!g.reply.ok() || g.reply->store_code() != 0 || g.reply->store_address().empty()) continue;
    if (store_view == nullptr || (!store_view->store().leading() && g.reply->store().leading())) {
      store_view = &*g.reply;
      out.store.via = g.address;
    }
  }
  if (store_view != nullptr) {
    out.store.answered = true;
    out.store.address = store_view->store_address();
    out.store.stats = store_view->store();
    out.store.hit_rate =
        Ratio(out.store.stats.prefix_hit_blocks(), out.store.stats.prefix_query_blocks());
  } else {
    for (const GatewayReply& g : out.gateways) {
      if (!g.reply.ok() || g.reply->store_address().empty()) continue;
      out.store.address = g.reply->store_address();
      out.store.via = g.address;
      out.store.error = absl::StrCat(
          absl::StatusCodeToString(static_cast<absl::StatusCode>(g.reply->store_code())), ": ",
          g.reply->store_error());
      break;
    }
  }

  std::map<std::string, NodeRow> rows;
  if (store_view != nullptr) {
    for (const NodeInfo& n : store_view->registry().nodes()) {
      AddRegistered(RowFor(rows, n.node_id(), n.grpc_address()), n);
    }
  }
  for (const GatewayReply& g : out.gateways) {
    if (!g.reply.ok()) continue;
    for (const WorkerStatus& w : g.reply->workers()) {
      // A fixed worker's id comes from its Status answer, else from the registry by address.
      std::string id = w.node_id();
      if (id.empty() && store_view != nullptr) {
        for (const NodeInfo& n : store_view->registry().nodes()) {
          if (n.grpc_address() == w.address()) id = n.node_id();
        }
      }
      AddWorker(RowFor(rows, id, w.address()), g.address, w);
    }
  }
  for (auto& [key, row] : rows) {
    if (row.state == "draining") {
      // decided above
    } else if (store_view != nullptr && !row.registered) {
      row.state = "unregistered";
      row.why.insert(row.why.begin(), "not in the store's registry (lease ran out or it left)");
    } else if (!row.why.empty()) {
      row.state = "suspect";
    } else {
      row.state = "serving";
    }
    out.nodes.push_back(std::move(row));
  }
  // Prefill before decode ("prefill" > "decode"), then by id.
  std::stable_sort(out.nodes.begin(), out.nodes.end(), [](const NodeRow& a, const NodeRow& b) {
    return a.role != b.role ? a.role > b.role : a.node_id < b.node_id;
  });
  return out;
}

nlohmann::json StatusJson(const ClusterStatus& status) {
  nlohmann::json gateways = nlohmann::json::array();
  for (const GatewayReply& g : status.gateways) {
    nlohmann::json j = {{"address", g.address}, {"ok", g.reply.ok()}};
    if (g.reply.ok()) {
      j["model"] = g.reply->model();
      j["workers"] = g.reply->workers_size();
    } else {
      j["error"] = absl::StrCat(absl::StatusCodeToString(g.reply.status().code()), ": ",
                                g.reply.status().message());
    }
    gateways.push_back(std::move(j));
  }
  const StoreRow& s = status.store;
  nlohmann::json store = {{"address", s.address}, {"answered", s.answered}, {"via", s.via}};
  if (s.answered) {
    nlohmann::json tiers = nlohmann::json::array();
    for (const kvrelay::v1::TierStats& t : s.stats.tiers()) {
      tiers.push_back({{"tier", TierName(t.tier())},
                       {"used_bytes", t.used_bytes()},
                       {"capacity_bytes", t.capacity_bytes()}});
    }
    store.update({{"leading", s.stats.leading()},
                  {"term", s.stats.term()},
                  {"leader_address", s.stats.leading() ? s.address : s.stats.leader_address()},
                  {"policy", s.stats.policy()},
                  {"live_nodes", s.stats.nodes()},
                  {"suspect_nodes", s.stats.suspect_nodes()},
                  {"committed_blocks", s.stats.committed_blocks()},
                  {"evictions", s.stats.evictions()},
                  {"prefix_query_blocks", s.stats.prefix_query_blocks()},
                  {"prefix_hit_blocks", s.stats.prefix_hit_blocks()},
                  {"hit_rate", s.hit_rate.has_value() ? nlohmann::json(*s.hit_rate) : nullptr},
                  {"tiers", tiers}});
  } else {
    store["error"] = s.error;
  }
  nlohmann::json nodes = nlohmann::json::array();
  for (const NodeRow& n : status.nodes) {
    nlohmann::json breakers = nlohmann::json::object();
    for (const auto& [gateway, state] : n.breakers) breakers[gateway] = state;
    nlohmann::json links = nlohmann::json::array();
    for (const LinkRateRow& l : n.link_rates) {
      links.push_back({{"holder", l.holder}, {"bytes_per_second", l.bytes_per_second}});
    }
    auto known = [](int64_t v) { return v >= 0 ? nlohmann::json(v) : nlohmann::json(nullptr); };
    nodes.push_back(
        {{"node_id", n.node_id},
         {"role", n.role},
         {"incarnation", absl::StrFormat("%016x", n.incarnation)},
         {"address", n.address},
         {"state", n.state},
         {"why", n.why},
         {"registered", n.registered},
         {"since_heartbeat_ms", known(n.since_heartbeat_ms)},
         {"tiers",
          {{"dram",
            {{"used_slots", known(n.dram_used_slots)}, {"total_slots", known(n.dram_total_slots)}}},
           {"ssd", n.ssd_total_slots < 0 ? nlohmann::json(nullptr)
                                         : nlohmann::json{{"used_slots", n.ssd_used_slots},
                                                          {"total_slots", n.ssd_total_slots}}}}},
         {"kv_pool",
          {{"free_slots", known(n.pool_free_slots)}, {"total_slots", known(n.pool_total_slots)}}},
         {"hit_rate", n.hit_rate.has_value() ? nlohmann::json(*n.hit_rate) : nullptr},
         {"prefix_hit_tokens", n.hit_tokens},
         {"computed_tokens", n.computed_tokens},
         {"in_flight", n.in_flight},
         {"picked", n.picked},
         {"active_requests", known(n.active_requests)},
         {"breaker", n.breaker},
         {"breakers", breakers},
         {"compute_tokens_per_second", n.compute_tokens_per_second},
         {"service_ms", n.service_ms},
         {"transfer_ms_per_mib", n.transfer_ms_per_mib},
         {"link_rates", links}});
  }
  return {{"gateways", gateways}, {"store", store}, {"nodes", nodes}};
}

std::string StatusTable(const ClusterStatus& status) {
  std::string out;
  const StoreRow& s = status.store;
  if (s.answered) {
    const std::string leadership =
        s.stats.leading()
            ? (s.stats.term() > 0 ? absl::StrCat("leader, term ", s.stats.term())
                                  : std::string("leader (no HA)"))
            : absl::StrCat("standby, leader ",
                           s.stats.leader_address().empty() ? "unknown" : s.stats.leader_address());
    absl::StrAppend(&out, "store    ", s.address, "  ", leadership, "  policy ", s.stats.policy(),
                    "  nodes ", s.stats.nodes(), " live, ", s.stats.suspect_nodes(), " suspect  ",
                    "blocks ", s.stats.committed_blocks(), " committed, ", s.stats.evictions(),
                    " evicted  hit rate ", Percent(s.hit_rate), " (", s.stats.prefix_hit_blocks(),
                    "/", s.stats.prefix_query_blocks(), " blocks)\n");
    for (const kvrelay::v1::TierStats& t : s.stats.tiers()) {
      if (t.capacity_bytes() == 0) continue;  // no node has this tier
      absl::StrAppend(&out, "  tier ", TierName(t.tier()), ": ", Bytes(t.used_bytes()), " of ",
                      Bytes(t.capacity_bytes()), " used\n");
    }
  } else if (!s.address.empty()) {
    absl::StrAppend(&out, "store    ", s.address, "  NOT ANSWERING (via ", s.via, "): ", s.error,
                    "\n");
  } else {
    absl::StrAppend(&out, "store    unknown (no gateway answered)\n");
  }
  for (const GatewayReply& g : status.gateways) {
    if (g.reply.ok()) {
      absl::StrAppend(&out, "gateway  ", g.address, "  ok  model ", g.reply->model(), ", ",
                      g.reply->workers_size(), " workers\n");
    } else {
      absl::StrAppend(&out, "gateway  ", g.address,
                      "  NOT ANSWERING: ", absl::StatusCodeToString(g.reply.status().code()), ": ",
                      g.reply.status().message(), "\n");
    }
  }
  std::vector<std::vector<std::string>> cells = {{"NODE", "ROLE", "INCARNATION", "ADDRESS", "STATE",
                                                  "DRAM SLOTS", "SSD", "KV POOL FREE", "HIT RATE",
                                                  "IN-FLIGHT", "ACTIVE", "BREAKER", "RATES"}};
  auto slots = [](int64_t used, int64_t total) {
    return total >= 0 ? absl::StrCat(used, "/", total) : std::string("-");
  };
  for (const NodeRow& n : status.nodes) {
    std::vector<std::string> rates;
    if (n.compute_tokens_per_second > 0) {
      rates.push_back(absl::StrFormat("compute %.0f tok/s", n.compute_tokens_per_second));
    }
    for (const LinkRateRow& l : n.link_rates) {
      rates.push_back(absl::StrCat("from ", l.holder, " ", Bytes(l.bytes_per_second), "/s"));
    }
    if (n.service_ms > 0) rates.push_back(absl::StrFormat("first token %.0f ms", n.service_ms));
    if (n.transfer_ms_per_mib > 0) {
      rates.push_back(absl::StrFormat("push %.1f ms/MiB", n.transfer_ms_per_mib));
    }
    cells.push_back(
        {n.node_id, n.role, absl::StrFormat("%016x", n.incarnation), n.address, n.state,
         slots(n.dram_used_slots, n.dram_total_slots), slots(n.ssd_used_slots, n.ssd_total_slots),
         slots(n.pool_free_slots, n.pool_total_slots), Percent(n.hit_rate),
         absl::StrCat(n.in_flight), n.active_requests >= 0 ? absl::StrCat(n.active_requests) : "-",
         n.breaker, rates.empty() ? "-" : absl::StrJoin(rates, "; ")});
  }
  std::vector<size_t> widths(cells[0].size(), 0);
  for (const auto& row : cells) {
    for (size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], row[i].size());
  }
  out += "\n";
  for (const auto& row : cells) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      line += row[i];
      if (i + 1 < row.size()) line += std::string(widths[i] - row[i].size() + 2, ' ');
    }
    absl::StrAppend(&out, line, "\n");
  }
  for (const NodeRow& n : status.nodes) {
    if (n.why.empty()) continue;
    absl::StrAppend(&out, n.node_id, " ", n.state, ": ", absl::StrJoin(n.why, "; "), "\n");
  }
  return out;
}

}  // namespace kvrelay::cli
