// WAL records (cachestore/wal): a log file's bytes are read record by record up to the first
// bad one; every record read re-encodes to bytes that decode to the same op, with its tokens
// in the replication stream's form and without them in the log's.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cachestore/wal.h"

namespace {

using kvrelay::cachestore::WalOp;

bool SameOp(const WalOp& a, const WalOp& b) {
  return kvrelay::cachestore::EncodeWalOp(a) == kvrelay::cachestore::EncodeWalOp(b);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  // One record's payload.
  absl::StatusOr<WalOp> op = kvrelay::cachestore::DecodeWalOp(bytes);
  if (op.ok()) {
    absl::StatusOr<WalOp> again =
        kvrelay::cachestore::DecodeWalOp(kvrelay::cachestore::EncodeWalOp(*op));
    if (!again.ok() || !SameOp(*op, *again) || !again->token_ids.empty()) __builtin_trap();
    absl::StatusOr<WalOp> replicated = kvrelay::cachestore::DecodeWalOp(
        kvrelay::cachestore::EncodeWalOp(*op, kvrelay::cachestore::WalTokens::kInclude));
    if (!replicated.ok() || !SameOp(*op, *replicated) || replicated->token_ids != op->token_ids) {
      __builtin_trap();
    }
  }
  // A whole log: framing, checksums, torn tails.
  int64_t good_bytes = -1;
  std::string error;
  std::vector<WalOp> ops = kvrelay::cachestore::ReadFramedRecords(bytes, &good_bytes, &error);
  if (good_bytes < 0 || static_cast<size_t>(good_bytes) > size) __builtin_trap();
  // The intact prefix reads back to the same records, with nothing cut.
  std::string framed;
  kvrelay::cachestore::FrameRecords(ops, &framed);
  int64_t good_again = -1;
  std::string error_again;
  std::vector<WalOp> reread =
      kvrelay::cachestore::ReadFramedRecords(framed, &good_again, &error_again);
  if (reread.size() != ops.size() || good_again != static_cast<int64_t>(framed.size())) {
    __builtin_trap();
  }
  return 0;
}
