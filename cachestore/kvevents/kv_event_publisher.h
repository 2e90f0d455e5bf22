#pragma once

// Publishes the cache store's block events in vLLM's KV-event wire format, so routers that
// consume vLLM's events (llm-d's KV-cache indexer, Dynamo) can follow kvrelay's cache:
//   ZeroMQ PUB, multipart [topic, 8-byte big-endian sequence, msgpack KVEventBatch],
//   one topic per node: "kv@<node id>@<model>", with its own sequence (0, 1, 2, ...), so each
//   node's stream looks like one vLLM instance's.
// Events: BlockStored when a block is committed (once per replica node), BlockRemoved when it
// leaves the store, AllBlocksCleared when a node expires or re-registers with a new spec (its
// blocks that live on elsewhere lose only that replica). block_hashes are kv::BlockHash::hi, the
// first 8 bytes of kvrelay's 128-bit chained hash read big-endian; token_ids are the block's
// block_size tokens as its committing worker sent them (CommitRequest.token_ids; the store keeps
// them in memory while the publisher runs), empty for blocks the store recovered from its WAL or
// learned from a re-announcement only. See cachestore/README.md "KV events".
//
// On start (and whenever it falls behind the store's event retention) the publisher sends every
// node's state: AllBlocksCleared, then BlockStored for each block it holds, so a subscriber's
// index is exact after a store restart. Replay: a ROUTER socket takes [empty, 8-byte start
// sequence] (vLLM's request) or [empty, start sequence, topic] and answers each retained batch
// with sequence >= start as [empty, sequence, payload] (of that topic only, when given), then
// [empty, -1, ""].
//
// Authentication: the stream shows every tenant's block activity, so with TLS on (no
// --insecure) the publisher runs only with ZeroMQ CURVE: the PUB and ROUTER sockets are CURVE
// servers (--kv-events-curve-secret-key-file, Z85) and a ZAP handler admits only subscribers
// whose public key is listed in --kv-events-curve-clients-file; anyone else's handshake fails
// and they receive nothing. Plain ZeroMQ only with --insecure (logged).
//
// One thread owns both sockets and reads CacheStore::EventsSince; a second one answers ZAP
// requests on its own socket. Start/destroy from one thread.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "cachestore/cache_store.h"
#include "common/flags.h"

namespace kvrelay::cachestore::kvevents {

struct KvEventsOptions {
  std::string endpoint;         // PUB endpoint to bind, e.g. tcp://127.0.0.1:5557; empty = off
  std::string replay_endpoint;  // ROUTER endpoint to bind; empty = no replay
  std::string model = "kvrelay";
  // Tokens per block, as BlockStored.block_size: the store's --block-tokens (0 = that; any
  // other value is refused, since token_ids are the store's blocks' tokens).
  int32_t block_size = 0;
  int64_t replay_batches = 10000;  // batches retained for replay (all topics)
  int32_t data_parallel_rank = 0;
  // ZeroMQ CURVE: this server's secret key (a file holding its 40-character Z85 text) and the
  // subscribers allowed in (a file with one Z85 public key per line). Both or neither.
  std::string curve_secret_key_file;
  std::string curve_clients_file;
  // The server runs with --insecure: plain ZeroMQ is allowed (without CURVE files).
  bool insecure = false;
};

// --kv-events-endpoint, --kv-events-replay-endpoint, --kv-events-model,
// --kv-events-block-size, --kv-events-replay-batches, --kv-events-curve-secret-key-file,
// --kv-events-curve-clients-file (`insecure` comes from the server's --insecure).
void AddKvEventsFlags(FlagSet& flags, KvEventsOptions* options);

class KvEventPublisher {
 public:
  // Binds the sockets and starts the thread; nullptr when options.endpoint is empty.
  // InvalidArgument for a bad option (an endpoint without CURVE keys unless insecure, a key
  // that is not Z85, a block size other than the store's), FailedPrecondition when libzmq has no
  // CURVE, Unavailable when an endpoint cannot be bound. `store` must outlive the publisher and
  // should keep block tokens (CacheStoreOptions::keep_block_tokens), or every token_ids is empty.
  static absl::StatusOr<std::unique_ptr<KvEventPublisher>> Start(CacheStore* store,
                                                                 KvEventsOptions options);
  ~KvEventPublisher();  // stops the thread, closes the sockets (linger 0)
  KvEventPublisher(const KvEventPublisher&) = delete;
  KvEventPublisher& operator=(const KvEventPublisher&) = delete;

  struct Impl;

 private:
  explicit KvEventPublisher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvrelay::cachestore::kvevents
