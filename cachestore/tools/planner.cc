#include "cachestore/tools/planner.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "cachestore/eviction_policy.h"
#include "cachestore/sim/trace_gen.h"
#include "common/status_macros.h"
#include "kv/presets.h"

namespace kvrelay::cachestore::tools {

void TraceSourceFlags::Register(FlagSet& flags) {
  flags.AddString("trace", &trace, "Mooncake-format JSON-lines trace (hash_ids per 512 tokens)");
  flags.AddString("shape", &shape,
                  "instead of --trace, a generated trace: multiturn | agent | scan | shift");
  flags.AddInt64("seed", &seed, "seed of the generated trace");
  flags.AddInt64("requests", &requests, "requests in the generated trace");
}

absl::StatusOr<LoadedTrace> TraceSourceFlags::Load() const {
  if (trace.empty() == shape.empty()) {
    return absl::InvalidArgumentError("trace / shape: give exactly one of --trace FILE or --shape");
  }
  LoadedTrace out;
  if (!trace.empty()) {
    out.name = std::string(trace.substr(trace.find_last_of('/') + 1));
    absl::StatusOr<std::vector<sim::TraceRequest>> requests_or = sim::LoadTrace(trace);
    if (!requests_or.ok()) {
      return absl::Status(requests_or.status().code(),
                          absl::StrCat(trace, ": ", requests_or.status().message()));
    }
    out.requests = *std::move(requests_or);
  } else {
    out.name = absl::StrCat("gen:", shape);
    KV_ASSIGN_OR_RETURN(out.requests,
                        sim::GenerateTrace(shape, static_cast<uint64_t>(seed), requests));
  }
  if (out.requests.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("trace: ", out.name, " has no requests"));
  }
  return out;
}

absl::StatusOr<std::vector<int64_t>> ParsePositiveList(const std::string& flag,
                                                       const std::string& text) {
  std::vector<int64_t> out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &v) || v <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          flag, ": want a comma list of positive integers, got '", std::string(part), "'"));
    }
    out.push_back(v);
  }
  return out;
}

absl::StatusOr<std::vector<double>> ParsePositiveDoubles(const std::string& flag,
                                                         const std::string& text) {
  std::vector<double> out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    double v = 0;
    if (!absl::SimpleAtod(absl::StripAsciiWhitespace(part), &v) || !(v > 0) || !std::isfinite(v)) {
      return absl::InvalidArgumentError(absl::StrCat(
          flag, ": want a comma list of positive numbers, got '", std::string(part), "'"));
    }
    out.push_back(v);
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> ParsePolicyList(const std::string& flag,
                                                         const std::string& text) {
  if (text == "all")
    return std::vector<std::string>{"lru",           "leaf-lru", "lrfu",  "probation-lru",
                                    "probation-lag", "adaptive", "belady"};
  std::vector<std::string> out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    std::string name(absl::StripAsciiWhitespace(part));
    if (!sim::IsOfflinePolicy(name)) {
      absl::StatusOr<EvictionPolicyPtr> p = MakeEvictionPolicy(name, 1);
      if (!p.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            flag, ": unknown policy '", name,
            "' (want lru, leaf-lru, lrfu, probation-lru, probation-lag, adaptive, belady, "
            "belady-leaf)"));
      }
    }
    out.push_back(std::move(name));
  }
  return out;
}

namespace {

// Parameters one token passes through in one layer's attention projections.
double AttentionParams(const kv::ModelConfig& c) {
  const double h = c.hidden_size;
  if (c.kv_lora_rank > 0) {  // MLA
    const double qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
    const double q = c.q_lora_rank > 0 ? h * c.q_lora_rank + static_cast<double>(c.q_lora_rank) *
                                                                 c.num_attention_heads * qk
                                       : h * c.num_attention_heads * qk;
    const double kv_down = h * (c.kv_lora_rank + c.qk_rope_head_dim);
    const double kv_up = static_cast<double>(c.kv_lora_rank) * c.num_attention_heads *
                         (c.qk_nope_head_dim + c.v_head_dim);
    const double o = static_cast<double>(c.num_attention_heads) * c.v_head_dim * h;
    return q + kv_down + kv_up + o;
  }
  const double head_dim = c.head_dim > 0 ? c.head_dim : h / std::max(1, c.num_attention_heads);
  const double kv_heads = c.num_key_value_heads > 0 ? c.num_key_value_heads : c.num_attention_heads;
  return 2 * h * c.num_attention_heads * head_dim + 2 * h * kv_heads * head_dim;
}

// FLOPs per (query, key) pair in one layer: QK^T and AV over every head.
double PairFlops(const kv::ModelConfig& c) {
  if (c.kv_lora_rank > 0) {
    return 2.0 * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim);
  }
  const double head_dim =
      c.head_dim > 0 ? c.head_dim
                     : static_cast<double>(c.hidden_size) / std::max(1, c.num_attention_heads);
  return 4.0 * c.num_attention_heads * head_dim;
}

}  // namespace

absl::StatusOr<PlanModel> LoadPlanModel(const std::string& spec,
                                        std::optional<kv::DType> kv_dtype) {
  kv::ConfigOptions options;
  options.block_tokens = static_cast<int32_t>(sim::kTraceBlockTokens);
  options.kv_dtype = kv_dtype;
  PlanModel m;
  m.name = spec;
  absl::StatusOr<kv::ModelConfig> config = kv::LoadPreset(spec, options);
  // A known preset that refuses the options (fp8 for an SSM state) is not a path either.
  if (!config.ok() && !absl::IsNotFound(config.status())) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: ", spec, ": ", config.status().message()));
  }
  if (!config.ok() && spec.find('/') == std::string::npos &&
      spec.find(".json") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("model: '", spec,
                                                   "' is neither a preset nor a config.json path (",
                                                   config.status().message(), ")"));
  }
  if (!config.ok()) {
    config = kv::LoadHfConfig(spec, options);
    if (!config.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("model: ", spec, ": ", config.status().message()));
    }
    m.name = spec.substr(0, spec.find_last_of('/'));
    m.name = m.name.substr(m.name.find_last_of('/') + 1);
  }
  m.config = *std::move(config);
  const kv::ModelLayout& layout = m.config.layout;
  const kv::ModelConfig& c = m.config;
  int64_t window_tokens = 0;
  int32_t full_layers = 0, window_layers = 0;
  for (int g = 0; g < static_cast<int>(layout.groups().size()); ++g) {
    const kv::LayerGroup& group = layout.groups()[g];
    switch (group.kind) {
      case kv::LayerKind::kFullAttention:
      case kv::LayerKind::kMlaLatent:
        m.parts.full_bytes += layout.BlockBytes(g);
        full_layers += group.num_layers();
        break;
      case kv::LayerKind::kSlidingWindow:
        m.parts.window_bytes += layout.BlockBytes(g);
        window_tokens = std::max<int64_t>(window_tokens, group.window_tokens);
        window_layers += group.num_layers();
        m.parts.window_blocks = std::max<int32_t>(
            m.parts.window_blocks,
            static_cast<int32_t>((group.window_tokens + sim::kTraceBlockTokens - 1) /
                                 sim::kTraceBlockTokens));
        break;
      case kv::LayerKind::kSsmState:
        // A resume point needs the state snapshot taken at it: one per block, only the last
        // one used, like a window of one block.
        m.parts.window_bytes += layout.BlockBytes(g);
        m.parts.window_blocks = std::max<int32_t>(m.parts.window_blocks, 1);
        break;
    }
  }
  m.window_tokens = window_tokens;
  const double h = c.hidden_size;
  const double inter = c.intermediate_size > 0 ? c.intermediate_size : 4 * h;
  const bool gated = c.model_type != "gpt2";
  double per_layer = 0;
  if (c.model_type == "mamba") {
    per_layer = 6 * h * h;  // in_proj (h -> 4h) + out_proj (2h -> h), expand 2
  } else {
    per_layer = AttentionParams(c) + (gated ? 3 : 2) * h * inter;
  }
  m.linear_flops_per_token = 2 * per_layer * c.num_hidden_layers;
  if (c.model_type != "mamba") {
    m.attention_flops_per_pair = PairFlops(c) * full_layers;
    m.window_flops_per_pair = PairFlops(c) * window_layers;
  }
  return m;
}

double PrefillFlops(const PlanModel& model, int64_t n) {
  const double dn = static_cast<double>(n);
  double pairs_window = dn * (dn + 1) / 2;
  if (model.window_tokens > 0 && n > model.window_tokens) {
    const double w = static_cast<double>(model.window_tokens);
    pairs_window = w * (w + 1) / 2 + (dn - w) * w;
  }
  return model.linear_flops_per_token * dn + model.attention_flops_per_pair * dn * (dn + 1) / 2 +
         model.window_flops_per_pair * pairs_window;
}

absl::StatusOr<TierSizes> ParseTierSizes(const std::string& flag, const std::string& text) {
  TierSizes sizes;
  bool dram = false, ssd = false;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    const std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(part, '=');
    absl::string_view value = kv.second;
    uint64_t unit = 1;
    for (const auto& [suffix, scale] :
         std::vector<std::pair<absl::string_view, uint64_t>>{{"TiB", uint64_t{1} << 40},
                                                             {"GiB", uint64_t{1} << 30},
                                                             {"MiB", uint64_t{1} << 20},
                                                             {"KiB", uint64_t{1} << 10},
                                                             {"B", 1}}) {
      if (absl::ConsumeSuffix(&value, suffix)) {
        unit = scale;
        break;
      }
    }
    double number = 0;
    if (!absl::SimpleAtod(value, &number) || !(number > 0) || number * unit > 9e18) {
      return absl::InvalidArgumentError(absl::StrCat(
          flag, ": want dram=SIZE,ssd=SIZE (e.g. dram=64GiB,ssd=2TiB), got '", part, "'"));
    }
    const uint64_t bytes = static_cast<uint64_t>(number * static_cast<double>(unit));
    if (kv.first == "dram") {
      sizes.dram_bytes = bytes;
      dram = true;
    } else if (kv.first == "ssd") {
      sizes.ssd_bytes = bytes;
      ssd = true;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": unknown tier '", kv.first, "' (want dram and ssd)"));
    }
  }
  if (!dram || !ssd) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": give both dram=SIZE and ssd=SIZE"));
  }
  return sizes;
}

absl::StatusOr<std::vector<TieredPlanRow>> PlanTiered(const LoadedTrace& trace,
                                                      const PlanModel& model, TierSizes sizes,
                                                      const std::vector<std::string>& policies,
                                                      TierRates rates) {
  if (!(rates.prefill_flops_per_second > 0) || !(rates.disk_read_bytes_per_second > 0)) {
    return absl::InvalidArgumentError(
        "tier rates: the prefill FLOP/s and disk read bytes/s "
        "must be positive");
  }
  const int64_t block_bytes = model.parts.full_bytes + model.parts.window_bytes;
  const int64_t dram_blocks = static_cast<int64_t>(sizes.dram_bytes) / block_bytes;
  const int64_t ssd_blocks = static_cast<int64_t>(sizes.ssd_bytes) / block_bytes;
  if (dram_blocks < 1 || ssd_blocks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tiers: each tier must hold at least one 512-token block of ", model.name,
                     " (", block_bytes, " bytes)"));
  }
  // A saved token's prefill FLOPs at the trace's mean prompt length (its attention over that
  // context, window layers over at most their window).
  double prompt_tokens = 0;
  for (const sim::TraceRequest& r : trace.requests) {
    prompt_tokens += static_cast<double>(
        r.input_length >= 0 ? r.input_length
                            : static_cast<int64_t>(r.hash_ids.size()) * sim::kTraceBlockTokens);
  }
  const double mean_prompt =
      prompt_tokens / static_cast<double>(std::max<size_t>(trace.requests.size(), 1));
  const double window_context =
      model.window_tokens > 0 ? std::min(mean_prompt, static_cast<double>(model.window_tokens))
                              : mean_prompt;
  const double flops_per_saved_token = model.linear_flops_per_token +
                                       model.attention_flops_per_pair * mean_prompt +
                                       model.window_flops_per_pair * window_context;
  std::vector<TieredPlanRow> rows;
  for (const std::string& policy : policies) {
    if (sim::IsOfflinePolicy(policy)) {
      return absl::InvalidArgumentError(
          absl::StrCat("policy: ", policy, " is offline; a tiered plan takes online policies"));
    }
    KV_ASSIGN_OR_RETURN(sim::TieredReplayResult tiered,
                        sim::ReplayTiered(trace.requests, dram_blocks, ssd_blocks, policy));
    KV_ASSIGN_OR_RETURN(sim::ReplayResult alone,
                        sim::ReplayTrace(trace.requests, dram_blocks, policy));
    TieredPlanRow row;
    row.model = model.name;
    row.policy = policy;
    row.dram_blocks = dram_blocks;
    row.ssd_blocks = ssd_blocks;
    const double blocks = static_cast<double>(std::max<int64_t>(tiered.total.blocks, 1));
    const double requests = static_cast<double>(std::max<int64_t>(tiered.total.requests, 1));
    row.hit_rate = static_cast<double>(tiered.total.hit_blocks) / blocks;
    row.dram_hit_rate = static_cast<double>(tiered.dram_hit_blocks) / blocks;
    row.disk_hit_rate = static_cast<double>(tiered.disk_hit_blocks) / blocks;
    row.dram_only_hit_rate = alone.hit_rate();
    row.extra_hit_tokens_per_request =
        static_cast<double>(tiered.total.hit_blocks - alone.hit_blocks) * sim::kTraceBlockTokens /
        requests;
    row.disk_read_bytes_per_request =
        static_cast<double>(tiered.disk_hit_blocks) * static_cast<double>(block_bytes) / requests;
    row.ttft_saved_ms_per_request =
        1e3 *
        (row.extra_hit_tokens_per_request * flops_per_saved_token / rates.prefill_flops_per_second -
         row.disk_read_bytes_per_request / rates.disk_read_bytes_per_second);
    rows.push_back(std::move(row));
  }
  return rows;
}

absl::StatusOr<std::vector<PlanRow>> Plan(const LoadedTrace& trace, const PlanModel& model,
                                          const PlanOptions& options) {
  if (options.memory_gib.empty()) return absl::InvalidArgumentError("memory-gib: empty list");
  if (options.policies.empty()) return absl::InvalidArgumentError("policy: empty list");
  const sim::BlockParts& parts = model.parts;
  const int64_t block_bytes = parts.full_bytes + parts.window_bytes;
  double total_flops = 0;
  std::vector<int64_t> prompt_tokens;
  for (const sim::TraceRequest& r : trace.requests) {
    const int64_t n = r.input_length >= 0
                          ? r.input_length
                          : static_cast<int64_t>(r.hash_ids.size()) * sim::kTraceBlockTokens;
    prompt_tokens.push_back(n);
    total_flops += PrefillFlops(model, n);
  }
  std::vector<PlanRow> rows;
  for (double gib : options.memory_gib) {
    const double bytes = gib * 1073741824.0;
    if (bytes < static_cast<double>(block_bytes) || bytes > 9e18) {
      return absl::InvalidArgumentError(
          absl::StrCat("memory-gib: ", gib, " GiB is less than one 512-token block of ", model.name,
                       " (", block_bytes, " bytes) or absurdly large"));
    }
    const int64_t capacity_bytes = static_cast<int64_t>(bytes);
    for (const std::string& policy : options.policies) {
      PlanRow row;
      row.model = model.name;
      row.policy = policy;
      row.memory_gib = gib;
      row.capacity_blocks = capacity_bytes / block_bytes;
      std::vector<int32_t> hits;
      sim::ReplayResult r;
      if (sim::IsOfflinePolicy(policy)) {
        // Offline optimum over whole blocks (no window split): the ceiling for the online rows.
        KV_ASSIGN_OR_RETURN(r, sim::ReplayTrace(trace.requests, row.capacity_blocks, policy));
        hits.clear();
      } else {
        KV_ASSIGN_OR_RETURN(r, sim::ReplayWindowed(trace.requests, capacity_bytes, parts,
                                                   options.window_aware, policy, &hits));
      }
      row.hit_rate = r.hit_rate();
      const bool split =
          options.window_aware && parts.window_blocks > 0 && !sim::IsOfflinePolicy(policy);
      const double read_bytes =
          split ? static_cast<double>(r.hit_blocks) * parts.full_bytes +
                      static_cast<double>(r.hit_window_blocks) * parts.window_bytes
                : static_cast<double>(r.hit_blocks) * block_bytes;
      const double requests = static_cast<double>(r.requests);
      row.bytes_read_per_request = read_bytes / requests;
      row.bytes_written_per_request =
          static_cast<double>(r.blocks - r.hit_blocks) * block_bytes / requests;
      double saved = 0;
      for (size_t i = 0; i < hits.size(); ++i) {
        saved += PrefillFlops(
            model, std::min<int64_t>(prompt_tokens[i], hits[i] * sim::kTraceBlockTokens));
      }
      row.compute_saved = hits.empty() || total_flops <= 0 ? -1 : saved / total_flops;
      rows.push_back(std::move(row));
    }
  }
  return rows;
}

}  // namespace kvrelay::cachestore::tools
