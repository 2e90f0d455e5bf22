#pragma once

// Every bound the cache store puts on what callers send, in one place. The gRPC glue answers a
// value outside these with INVALID_ARGUMENT (or RESOURCE_EXHAUSTED for a count over a limit)
// naming the field; the domain (CacheStore) re-checks the ones it relies on.

#include <cstdint>

namespace kvrelay::cachestore {

struct Limits {
  int max_chain = 4096;     // chain / blocks / hashes entries per call
  int max_announce = 4096;  // AnnounceBlocks entries per call
  int max_segments = 64;    // per node
  int max_id_bytes = 128;   // node_id, segment_id
  int max_memory_key_bytes = 4096;
  int max_address_bytes = 256;  // transport and gRPC addresses
  int max_nodes = 4096;         // registered at once (live + suspect)
  int64_t min_ttl_ms = 100;     // node heartbeat TTL
  int64_t max_ttl_ms = 600000;  // node TTL and lease TTL
  // Advertised capacity: a node cannot claim more than this, so a fake node cannot swamp the
  // watermark arithmetic (issue 13.4: ~8 EiB advertised switched global eviction off).
  int64_t max_capacity_slots = int64_t{1} << 24;         // per segment
  uint64_t max_slot_bytes = uint64_t{1} << 30;           // per slot (1 GiB)
  uint64_t max_node_capacity_bytes = uint64_t{1} << 46;  // all segments of a node (64 TiB)
  int64_t max_load_value = int64_t{1} << 40;             // each NodeLoad field
  int max_replicas = 4;
  int max_message_bytes = 4 << 20;
};

}  // namespace kvrelay::cachestore
