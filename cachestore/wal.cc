#include "cachestore/wal.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/errno_status.h"
#include "common/file_util.h"
#include "common/logging.h"
#include "xxhash.h"

namespace kvrelay::cachestore {

namespace {

constexpr uint32_t kChecksumSeed = 0x6b76;
constexpr char kSnapshotMagic[] = "KVRSNAP1";
constexpr size_t kMagicLen = 8;
constexpr uint32_t kMaxRecordBytes = 64u << 20;
// Tokens of one block: far above any --block-tokens, far below a record's size limit.
constexpr uint32_t kMaxBlockTokenIds = 1u << 16;

void PutU8(std::string* s, uint8_t v) { s->push_back(static_cast<char>(v)); }
void PutU32(std::string* s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
void PutU64(std::string* s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
void PutStr(std::string* s, std::string_view v) {
  PutU32(s, static_cast<uint32_t>(v.size()));
  s->append(v.data(), v.size());
}
void PutHash(std::string* s, const kv::BlockHash& h) {
  PutU64(s, h.hi);
  PutU64(s, h.lo);
}

class Reader {
 public:
  explicit Reader(std::string_view d) : d_(d) {}
  bool U8(uint8_t* v) {
    if (d_.size() < 1) return false;
    *v = static_cast<uint8_t>(d_[0]);
    d_.remove_prefix(1);
    return true;
  }
  bool U32(uint32_t* v) {
    if (d_.size() < 4) return false;
    *v = 0;
    for (int i = 0; i < 4; ++i) *v |= static_cast<uint32_t>(static_cast<uint8_t>(d_[i])) << (8 * i);
    d_.remove_prefix(4);
    return true;
  }
  bool U64(uint64_t* v) {
    if (d_.size() < 8) return false;
    *v = 0;
    for (int i = 0; i < 8; ++i) *v |= static_cast<uint64_t>(static_cast<uint8_t>(d_[i])) << (8 * i);
    d_.remove_prefix(8);
    return true;
  }
  bool Str(std::string* v) {
    uint32_t n;
    if (!U32(&n) || d_.size() < n) return false;
    v->assign(d_.data(), n);
    d_.remove_prefix(n);
    return true;
  }
  bool Hash(kv::BlockHash* h) { return U64(&h->hi) && U64(&h->lo); }
  bool done() const { return d_.empty(); }

 private:
  std::string_view d_;
};

absl::Status Bad(std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("wal record: ", std::string(what)));
}

}  // namespace

std::string EncodeWalOp(const WalOp& op, WalTokens tokens) {
  std::string s;
  PutU8(&s, static_cast<uint8_t>(op.type));
  switch (op.type) {
    case WalOp::Type::kRegisterNode: {
      const NodeSpec& n = op.node;
      PutStr(&s, n.node_id);
      PutStr(&s, n.transport_kind);
      PutStr(&s, n.transport_address);
      PutU64(&s, static_cast<uint64_t>(absl::ToInt64Milliseconds(n.ttl)));
      PutU32(&s, static_cast<uint32_t>(n.segments.size()));
      for (const SegmentSpec& seg : n.segments) {
        PutStr(&s, seg.segment_id);
        PutU8(&s, static_cast<uint8_t>(seg.tier));
        PutU64(&s, static_cast<uint64_t>(seg.capacity_slots));
        PutU64(&s, seg.slot_bytes);
        PutStr(&s, seg.memory_key);
      }
      // Identity and discovery fields, appended so logs written before them still decode.
      PutU64(&s, n.incarnation);
      PutU8(&s, static_cast<uint8_t>(n.role));
      PutStr(&s, n.grpc_address);
      break;
    }
    case WalOp::Type::kSequenceMark:
      PutU64(&s, op.sequence);
      break;
    case WalOp::Type::kRemoveNode:
      PutStr(&s, op.node_id);
      break;
    case WalOp::Type::kCommitBlock:
      PutU64(&s, op.sequence);
      PutHash(&s, op.hash);
      PutHash(&s, op.parent);
      PutU32(&s, op.size_bytes);
      PutU32(&s, static_cast<uint32_t>(op.replicas.size()));
      for (const WalReplica& r : op.replicas) {
        PutStr(&s, r.node_id);
        PutStr(&s, r.segment_id);
        PutU32(&s, r.slot);
      }
      if (tokens == WalTokens::kInclude && !op.token_ids.empty()) {
        PutU32(&s, static_cast<uint32_t>(op.token_ids.size()));
        for (int32_t t : op.token_ids) PutU32(&s, static_cast<uint32_t>(t));
      }
      break;
    case WalOp::Type::kRemoveBlock:
      PutU64(&s, op.sequence);
      PutHash(&s, op.hash);
      break;
  }
  return s;
}

absl::StatusOr<WalOp> DecodeWalOp(std::string_view payload) {
  Reader r(payload);
  WalOp op;
  uint8_t type;
  if (!r.U8(&type)) return Bad("empty");
  op.type = static_cast<WalOp::Type>(type);
  switch (op.type) {
    case WalOp::Type::kRegisterNode: {
      uint64_t ttl_ms;
      uint32_t nseg;
      if (!r.Str(&op.node.node_id) || !r.Str(&op.node.transport_kind) ||
          !r.Str(&op.node.transport_address) || !r.U64(&ttl_ms) || !r.U32(&nseg) || nseg > 4096) {
        return Bad("truncated node");
      }
      op.node.ttl = absl::Milliseconds(static_cast<int64_t>(ttl_ms));
      for (uint32_t i = 0; i < nseg; ++i) {
        SegmentSpec seg;
        uint8_t tier;
        uint64_t cap;
        if (!r.Str(&seg.segment_id) || !r.U8(&tier) || !r.U64(&cap) || !r.U64(&seg.slot_bytes) ||
            !r.Str(&seg.memory_key)) {
          return Bad("truncated segment");
        }
        seg.tier = static_cast<Tier>(tier);
        seg.capacity_slots = static_cast<int64_t>(cap);
        op.node.segments.push_back(std::move(seg));
      }
      if (!r.done()) {
        uint8_t role;
        if (!r.U64(&op.node.incarnation) || !r.U8(&role) || role > 3 ||
            !r.Str(&op.node.grpc_address)) {
          return Bad("truncated node identity");
        }
        op.node.role = static_cast<NodeRole>(role);
      }
      break;
    }
    case WalOp::Type::kSequenceMark:
      if (!r.U64(&op.sequence)) return Bad("truncated sequence mark");
      break;
    case WalOp::Type::kRemoveNode:
      if (!r.Str(&op.node_id)) return Bad("truncated node id");
      break;
    case WalOp::Type::kCommitBlock: {
      uint32_t n;
      if (!r.U64(&op.sequence) || !r.Hash(&op.hash) || !r.Hash(&op.parent) ||
          !r.U32(&op.size_bytes) || !r.U32(&n) || n > 16) {
        return Bad("truncated block");
      }
      for (uint32_t i = 0; i < n; ++i) {
        WalReplica rep;
        if (!r.Str(&rep.node_id) || !r.Str(&rep.segment_id) || !r.U32(&rep.slot)) {
          return Bad("truncated replica");
        }
        op.replicas.push_back(std::move(rep));
      }
      if (!r.done()) {  // token_ids (replication only)
        uint32_t count;
        if (!r.U32(&count) || count == 0 || count > kMaxBlockTokenIds)
          return Bad("bad token count");
        op.token_ids.reserve(count);
        for (uint32_t i = 0; i < count; ++i) {
          uint32_t t;
          if (!r.U32(&t)) return Bad("truncated token ids");
          op.token_ids.push_back(static_cast<int32_t>(t));
        }
      }
      break;
    }
    case WalOp::Type::kRemoveBlock:
      if (!r.U64(&op.sequence) || !r.Hash(&op.hash)) return Bad("truncated removal");
      break;
    default:
      return Bad(absl::StrCat("unknown type ", type));
  }
  if (!r.done()) return Bad("trailing bytes");
  return op;
}

void FrameRecords(const std::vector<WalOp>& ops, std::string* out) {
  for (const WalOp& op : ops) {
    const std::string payload = EncodeWalOp(op);
    PutU32(out, static_cast<uint32_t>(payload.size()));
    PutU32(out, XXH32(payload.data(), payload.size(), kChecksumSeed));
    out->append(payload);
  }
}

std::vector<WalOp> ReadFramedRecords(std::string_view data, int64_t* good_bytes,
                                     std::string* error) {
  std::vector<WalOp> ops;
  size_t pos = 0;
  error->clear();
  while (pos < data.size()) {
    if (data.size() - pos < 8) {
      *error = absl::StrCat("torn record header at offset ", pos);
      break;
    }
    Reader hdr(data.substr(pos, 8));
    uint32_t len = 0, sum = 0;
    hdr.U32(&len);
    hdr.U32(&sum);
    if (len > kMaxRecordBytes || data.size() - pos - 8 < len) {
      *error = absl::StrCat("torn record at offset ", pos, " (length ", len, ")");
      break;
    }
    const std::string_view payload = data.substr(pos + 8, len);
    if (XXH32(payload.data(), payload.size(), kChecksumSeed) != sum) {
      *error = absl::StrCat("checksum mismatch at offset ", pos);
      break;
    }
    absl::StatusOr<WalOp> op = DecodeWalOp(payload);
    if (!op.ok()) {
      *error = absl::StrCat("undecodable record at offset ", pos, ": ", op.status().message());
      break;
    }
    ops.push_back(*std::move(op));
    pos += 8 + len;
  }
  *good_bytes = static_cast<int64_t>(pos);
  return ops;
}

absl::StatusOr<std::unique_ptr<Wal>> Wal::Open(const std::string& path, bool fsync,
                                               Recovered* recovered) {
  ScopedFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  if (!fd.valid()) {
    return ErrnoToStatus(errno, absl::StrCat("data-dir: open ", path));
  }
  std::string data;
  char buf[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, absl::StrCat("read ", path));
    }
    if (n == 0) break;
    data.append(buf, static_cast<size_t>(n));
  }
  int64_t good = 0;
  std::string error;
  recovered->ops = ReadFramedRecords(data, &good, &error);
  recovered->cut_bytes = static_cast<int64_t>(data.size()) - good;
  recovered->cut_reason = error;
  if (recovered->cut_bytes > 0) {
    KV_LOG(WARNING) << "wal " << path << ": " << error << "; cutting " << recovered->cut_bytes
                    << " bytes after " << recovered->ops.size() << " intact records";
    if (::ftruncate(fd.get(), good) != 0) {
      return ErrnoToStatus(errno, absl::StrCat("truncate ", path));
    }
    if (fsync) ::fdatasync(fd.get());
  }
  if (::lseek(fd.get(), good, SEEK_SET) < 0) {
    return ErrnoToStatus(errno, absl::StrCat("seek ", path));
  }
  auto wal = std::unique_ptr<Wal>(new Wal(std::move(fd), path, fsync, good));
  wal->records_ = static_cast<int64_t>(recovered->ops.size());
  return wal;
}

absl::Status Wal::Append(const std::vector<WalOp>& ops) {
  if (ops.empty()) return absl::OkStatus();
  std::string framed;
  FrameRecords(ops, &framed);
  size_t off = 0;
  while (off < framed.size()) {
    const ssize_t n = ::write(fd_.get(), framed.data() + off, framed.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, absl::StrCat("append ", path_));
    }
    off += static_cast<size_t>(n);
  }
  if (fsync_ && ::fdatasync(fd_.get()) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("fdatasync ", path_));
  }
  size_ += static_cast<int64_t>(framed.size());
  records_ += static_cast<int64_t>(ops.size());
  return absl::OkStatus();
}

absl::Status Wal::Reset() {
  if (::ftruncate(fd_.get(), 0) != 0 || ::lseek(fd_.get(), 0, SEEK_SET) < 0) {
    return ErrnoToStatus(errno, absl::StrCat("truncate ", path_));
  }
  if (fsync_) ::fdatasync(fd_.get());
  size_ = 0;
  records_ = 0;
  return absl::OkStatus();
}

absl::Status WriteSnapshot(const std::string& path, const std::vector<WalOp>& ops) {
  std::string data(kSnapshotMagic, kMagicLen);
  FrameRecords(ops, &data);
  return WriteFileAtomically(path, data);
}

absl::StatusOr<std::vector<WalOp>> ReadSnapshot(const std::string& path) {
  absl::StatusOr<std::string> data = ReadFileToString(path);
  if (!data.ok()) return data.status();
  if (data->size() < kMagicLen || data->compare(0, kMagicLen, kSnapshotMagic) != 0) {
    return absl::DataLossError(absl::StrCat("snapshot ", path, ": bad magic"));
  }
  int64_t good = 0;
  std::string error;
  std::vector<WalOp> ops =
      ReadFramedRecords(std::string_view(*data).substr(kMagicLen), &good, &error);
  if (!error.empty()) {
    return absl::DataLossError(absl::StrCat("snapshot ", path, ": ", error));
  }
  return ops;
}

}  // namespace kvrelay::cachestore
