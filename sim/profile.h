#pragma once

// HardwareProfile: what `kvrelay simulate` charges for compute and transfers, as cost
// functions with a handful of coefficients, read from a JSON file:
//
//   {"name": "...", "sources": ["where each figure comes from", ...],
//    "prefill": {"fixed_ms": 3, "tokens_per_second": 20000, "attention_ms_per_mtoken2": 0.5},
//    "decode": {"fixed_ms": 8, "per_sequence_ms": 0.05, "per_ktoken_context_ms": 0.02},
//    "network": {"bytes_per_second": 25e9, "latency_us": 5},
//    "disk": {"read_bytes_per_second": 6e9},
//    "rpc_ms": 0.3}
//
// prefill seconds(new, cached) = fixed + new / tokens_per_second
//                                + attention * new * (cached + new / 2) / 1e6 (ms)
// decode step seconds(batch, context) = fixed + per_sequence * batch + per_ktoken * context/1e3
// transfer seconds(bytes) = latency + bytes / bytes_per_second (each node's link one at a time)
// disk read seconds(bytes) = bytes / read_bytes_per_second (each node's disk tier, one read at
// a time; writes are the tier thread's and cost the request nothing)

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvrelay::sim {

struct HardwareProfile {
  std::string name;
  std::vector<std::string> sources;
  double prefill_fixed_ms = 3;
  double prefill_tokens_per_second = 20000;
  double prefill_attention_ms_per_mtoken2 = 0;
  double decode_fixed_ms = 8;
  double decode_per_sequence_ms = 0.05;
  double decode_per_ktoken_context_ms = 0.02;
  double network_bytes_per_second = 25e9;
  double network_latency_us = 5;
  double rpc_ms = 0.3;
  // One PCIe 4.0 NVMe (the default of `kvrelay plan --disk-gbps`).
  double disk_read_bytes_per_second = 6e9;

  absl::Duration PrefillTime(int64_t new_tokens, int64_t cached_tokens) const;
  absl::Duration DecodeStep(int64_t batch, int64_t context_tokens) const;
  absl::Duration Transfer(uint64_t bytes) const;
  absl::Duration DiskRead(uint64_t bytes) const;
  absl::Duration Rpc() const { return absl::Milliseconds(rpc_ms); }
};

// Parses the JSON above; every field optional (defaults as in the struct). InvalidArgument
// naming the field for a wrong type, an unknown key or a non-positive rate.
absl::StatusOr<HardwareProfile> ParseProfile(const std::string& json_text);
absl::StatusOr<HardwareProfile> LoadProfile(const std::string& path);

}  // namespace kvrelay::sim
