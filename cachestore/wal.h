#pragma once

// Durable metadata: a write-ahead log plus periodic snapshots under --data-dir.
//
// Both files use one framing: each record is
//     u32 payload_length (LE) | u32 XXH32(payload, seed 0x6b76) (LE) | payload
// and a payload is one WalOp (EncodeWalOp). A snapshot starts with the 8-byte magic "KVRSNAP1"
// and is written with WriteFileAtomically, so it is either the old one or the new one. The log
// (`wal.log`) is appended with one write() per batch (optionally fdatasync'd); a crash can leave
// a torn or garbage tail, which Open() detects (short header, length past the end, bad checksum,
// undecodable payload), cuts off with ftruncate and reports with a warning. Replay = snapshot
// records, then log records; every op is idempotent so a crash between writing a snapshot and
// truncating the log replays a few ops twice harmlessly.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "cachestore/node_registry.h"
#include "common/scoped_fd.h"

namespace kvrelay::cachestore {

struct WalReplica {
  std::string node_id;
  std::string segment_id;
  uint32_t slot = 0;
};

struct WalOp {
  enum class Type : uint8_t {
    kRegisterNode = 1,
    kRemoveNode = 2,
    kCommitBlock = 3,
    kRemoveBlock = 4,
    // High-water mark: event sequence numbers up to `sequence` may have been handed out.
    kSequenceMark = 5,
  };
  Type type = Type::kCommitBlock;
  NodeSpec node;          // kRegisterNode
  std::string node_id;    // kRemoveNode
  uint64_t sequence = 0;  // block ops: the event sequence number they produced; kSequenceMark
  kv::BlockHash hash;     // block ops
  kv::BlockHash parent;   // kCommitBlock
  uint32_t size_bytes = 0;
  std::vector<WalReplica> replicas;
  // kCommitBlock: the block's tokens (kept for KV events), or empty. Carried to HA standbys
  // only; never written to the WAL or a snapshot (tokens are tenant data, and the events of
  // blocks recovered from disk carry none).
  std::vector<int32_t> token_ids;
};

// Whether an encoded kCommitBlock carries its token_ids: the replication stream does, the WAL
// and snapshots never do. A payload with tokens appends them after the replicas, so a store
// older than them refuses it (trailing bytes): HA standbys are upgraded before the leader.
enum class WalTokens { kDrop, kInclude };
std::string EncodeWalOp(const WalOp& op, WalTokens tokens = WalTokens::kDrop);
// InvalidArgument (naming what is wrong) for a payload that does not decode.
absl::StatusOr<WalOp> DecodeWalOp(std::string_view payload);

// Appends framed records to a log file. Not thread-safe (CacheStore serializes writers).
class Wal {
 public:
  struct Recovered {
    std::vector<WalOp> ops;
    int64_t cut_bytes = 0;  // torn or corrupt tail removed
    std::string cut_reason;
  };
  // Opens (creating) `path`, reads every intact record and truncates a bad tail.
  static absl::StatusOr<std::unique_ptr<Wal>> Open(const std::string& path, bool fsync,
                                                   Recovered* recovered);
  absl::Status Append(const std::vector<WalOp>& ops);
  // Empties the log (after a snapshot).
  absl::Status Reset();
  int64_t records_since_reset() const { return records_; }
  int64_t size_bytes() const { return size_; }

 private:
  Wal(ScopedFd fd, std::string path, bool fsync, int64_t size)
      : fd_(std::move(fd)), path_(std::move(path)), fsync_(fsync), size_(size) {}
  ScopedFd fd_;
  std::string path_;
  bool fsync_;
  int64_t size_ = 0;
  int64_t records_ = 0;
};

// Frames ops into `out` (appending).
void FrameRecords(const std::vector<WalOp>& ops, std::string* out);
// Reads framed records from `data` until the end or the first bad record; `good_bytes` is the
// length of the intact prefix and `error` says why reading stopped early (empty if it did not).
std::vector<WalOp> ReadFramedRecords(std::string_view data, int64_t* good_bytes,
                                     std::string* error);

absl::Status WriteSnapshot(const std::string& path, const std::vector<WalOp>& ops);
// NotFound when absent; DataLoss naming the file when it is corrupt.
absl::StatusOr<std::vector<WalOp>> ReadSnapshot(const std::string& path);

}  // namespace kvrelay::cachestore
