#include "kv/disk/disk_tier.h"

#include <fcntl.h>
#include <liburing.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "common/errno_status.h"
#include "common/status_macros.h"
#include "kv/checksum.h"

namespace kvrelay::kv {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'R', 'T', 'I', 'E', 'R', '1'};
// 2: the payload lies stage after stage, with a checksum per stage.
constexpr uint32_t kVersion = 2;

// The first bytes of a slot's 4 KiB header, little-endian as the hosts we run on. `slot` is
// where the block was written: a misdirected write never verifies at another slot.
struct SlotHeader {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;
  uint64_t block_bytes;
  uint8_t layout[16];
  uint64_t hash_hi;
  uint64_t hash_lo;
  uint64_t payload_checksum;  // of the whole payload, in disk (stage) order
  uint64_t slot;
  uint64_t stage_plan;  // checksum of the stages' ranges: another plan's slot does not verify
  uint64_t num_stages;
  uint64_t stage_checksum[DiskTier::kMaxStages];
  uint64_t header_checksum;  // BlockChecksum of every byte above
};
static_assert(sizeof(SlotHeader) == 96 + 8 * DiskTier::kMaxStages);
constexpr size_t kCheckedHeaderBytes = offsetof(SlotHeader, header_checksum);

uint64_t RoundUp(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }
uint64_t RoundDown(uint64_t n, uint64_t to) { return n / to * to; }

// Every byte of [0, block_bytes) in exactly one range, at most kMaxStages non-empty stages.
absl::Status CheckStages(const std::vector<std::vector<PayloadRange>>& stages,
                         uint64_t block_bytes) {
  if (stages.size() > static_cast<size_t>(DiskTier::kMaxStages)) {
    return absl::InvalidArgumentError(
        absl::StrCat("disk tier: ", stages.size(), " stages, at most ", DiskTier::kMaxStages));
  }
  std::vector<PayloadRange> all;
  for (size_t s = 0; s < stages.size(); ++s) {
    if (stages[s].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("disk tier: stage ", s, " has no bytes"));
    }
    for (const PayloadRange& r : stages[s]) {
      if (r.length == 0 || r.offset > block_bytes || r.length > block_bytes - r.offset) {
        return absl::InvalidArgumentError(
            absl::StrCat("disk tier: stage ", s, " range [", r.offset, ", +", r.length,
                         ") is empty or outside the ", block_bytes, "-byte block"));
      }
      all.push_back(r);
    }
  }
  std::sort(all.begin(), all.end(),
            [](const PayloadRange& a, const PayloadRange& b) { return a.offset < b.offset; });
  uint64_t next = 0;
  for (const PayloadRange& r : all) {
    if (r.offset != next) {
      return absl::InvalidArgumentError(
          absl::StrCat("disk tier: the stages ", r.offset < next ? "overlap" : "leave a gap",
                       " at byte ", std::min(r.offset, next), " of the block"));
    }
    next = r.offset + r.length;
  }
  if (next != block_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("disk tier: the stages cover ", next, " of ", block_bytes, " block bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

const char* DiskTierFailureName(DiskTierFailure failure) {
  switch (failure) {
    case DiskTierFailure::kNone:
      return "none";
    case DiskTierFailure::kFull:
      return "full";
    case DiskTierFailure::kIoError:
      return "io_error";
  }
  return "unknown";
}

struct DiskTier::Ring {
  io_uring ring{};
  bool ring_ready = false;
  bool fixed_buffers = false;
  uint8_t* memory = nullptr;  // queue_depth + 1 buffers of io_bytes, 4 KiB aligned
  std::vector<uint8_t*> buffers;
  uint32_t spare = 0;  // the buffer no operation uses (reads rotate through it)
  ~Ring() {
    // The ring first: its teardown waits for operations still in flight on the buffers.
    if (ring_ready) io_uring_queue_exit(&ring);
    std::free(memory);
  }
};

DiskTier::DiskTier(DiskTierOptions options) : options_(std::move(options)) {}

DiskTier::~DiskTier() {
  ring_.reset();
  if (fd_ >= 0) close(fd_);
}

absl::StatusOr<std::unique_ptr<DiskTier>> DiskTier::Open(DiskTierOptions options) {
  if (options.directory.empty()) return absl::InvalidArgumentError("disk tier: no directory");
  if (options.block_bytes == 0) return absl::InvalidArgumentError("disk tier: block_bytes is 0");
  if (options.queue_depth == 0 || options.queue_depth > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("disk tier: queue depth ", options.queue_depth, " is not in [1, 4096]"));
  }
  std::unique_ptr<DiskTier> tier(new DiskTier(std::move(options)));
  if (absl::Status s = tier->Init(); !s.ok()) return s;
  return tier;
}

absl::Status DiskTier::Init() {
  stages_ = options_.stages;
  if (stages_.empty()) stages_.push_back({PayloadRange{0, options_.block_bytes}});
  KV_RETURN_IF_ERROR(CheckStages(stages_, options_.block_bytes));
  std::vector<uint64_t> plan;
  uint64_t at = 0;
  for (const std::vector<PayloadRange>& stage : stages_) {
    stage_begin_.push_back(at);
    uint64_t length = 0;
    for (const PayloadRange& r : stage) {
      length += r.length;
      plan.push_back(r.offset);
      plan.push_back(r.length);
    }
    plan.push_back(~uint64_t{0});  // stage boundary
    stage_length_.push_back(length);
    at += length;
  }
  stage_plan_ = BlockChecksum(plan.data(), plan.size() * sizeof(uint64_t));
  io_bytes_ = kHeaderBytes + RoundUp(options_.block_bytes, kAlignment);
  slot_bytes_ = io_bytes_;
  num_slots_ = static_cast<int64_t>(options_.capacity_bytes / slot_bytes_);
  if (num_slots_ == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "disk tier: ", options_.capacity_bytes, " bytes hold no block slot of ", slot_bytes_,
        " bytes (", options_.block_bytes, "-byte blocks and a 4 KiB header)"));
  }
  std::error_code ec;
  std::filesystem::create_directories(options_.directory, ec);
  if (ec) {
    return ErrnoToStatus(ec.value(),
                         absl::StrCat("create disk tier directory ", options_.directory));
  }
  path_ = absl::StrCat(options_.directory, "/kvrelay-", options_.layout.ToHex(), ".tier");
  fd_ = open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_DIRECT, 0600);
  if (fd_ < 0 && errno == EINVAL) {
    // The file system refuses O_DIRECT (tmpfs before Linux 6.6): page-cache I/O still works.
    direct_io_ = false;
    fd_ = open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  }
  if (fd_ < 0) return ErrnoToStatus(errno, absl::StrCat("open ", path_));
  if (flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat(
          "disk tier ", path_, " is in use by another process (two workers on one directory?)"));
    }
    return ErrnoToStatus(errno, absl::StrCat("flock ", path_));
  }
  const uint64_t file_bytes = static_cast<uint64_t>(num_slots_) * slot_bytes_;
  struct stat st {};
  if (fstat(fd_, &st) != 0) return ErrnoToStatus(errno, absl::StrCat("stat ", path_));
  if (static_cast<uint64_t>(st.st_size) != file_bytes &&
      ftruncate(fd_, static_cast<off_t>(file_bytes)) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("resize ", path_));
  }
  if (options_.preallocate && fallocate(fd_, 0, 0, static_cast<off_t>(file_bytes)) != 0) {
    const int err = errno;
    if (err == ENOSPC) {
      struct statvfs fs {};
      const uint64_t free_bytes =
          fstatvfs(fd_, &fs) == 0 ? static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize : 0;
      return absl::ResourceExhaustedError(absl::StrCat("disk tier ", path_, " needs ", file_bytes,
                                                       " bytes; the file system has ", free_bytes,
                                                       " free (lower --ssd-bytes)"));
    }
    if (err != EOPNOTSUPP) return ErrnoToStatus(err, absl::StrCat("fallocate ", path_));
  }

  ring_ = std::make_unique<Ring>();
  if (int rc = io_uring_queue_init(options_.queue_depth, &ring_->ring, 0); rc < 0) {
    return ErrnoToStatus(-rc, "io_uring_queue_init for the disk tier");
  }
  ring_->ring_ready = true;
  const uint32_t buffers = options_.queue_depth + 1;
  const size_t total = static_cast<size_t>(io_bytes_) * buffers;
  ring_->memory = static_cast<uint8_t*>(std::aligned_alloc(kAlignment, total));
  if (ring_->memory == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("disk tier: cannot allocate ", total, " bytes of I/O buffers"));
  }
  std::vector<iovec> iovecs;
  for (uint32_t i = 0; i < buffers; ++i) {
    ring_->buffers.push_back(ring_->memory + i * io_bytes_);
    iovecs.push_back(iovec{ring_->buffers.back(), io_bytes_});
  }
  ring_->spare = options_.queue_depth;
  // Fixed buffers save the kernel pinning pages per operation; without them (a memlock
  // limit) the ring still works.
  ring_->fixed_buffers = io_uring_register_buffers(&ring_->ring, iovecs.data(), iovecs.size()) == 0;
  return absl::OkStatus();
}

std::string DiskTier::disabled_reason() const {
  absl::MutexLock lock(&reason_mu_);
  return disabled_reason_;
}

void DiskTier::Disable(DiskTierFailure failure, const std::string& reason) {
  {
    absl::MutexLock lock(&reason_mu_);
    if (!disabled_reason_.empty()) return;
    disabled_reason_ = absl::StrCat("disk tier ", path_, " stopped taking blocks: ", reason);
  }
  failure_.store(failure);
}

absl::Status DiskTier::DisabledStatus() const { return absl::UnavailableError(disabled_reason()); }

DiskTier::OpRange DiskTier::WholeSlot(int64_t slot) const {
  return {slot, static_cast<uint64_t>(slot) * slot_bytes_, static_cast<uint32_t>(io_bytes_)};
}

void DiskTier::RunOps(size_t count, bool is_write, const std::function<OpRange(size_t)>& op_of,
                      const std::function<void(size_t, uint8_t*)>& prepare,
                      const std::function<void(size_t, uint8_t*, int)>& complete) {
  io_uring* ring = &ring_->ring;
  std::vector<size_t> op_of_buffer(ring_->buffers.size());
  size_t next = 0;
  size_t in_flight = 0;
  // Queues the next operation on buffer b; false when there is none to queue.
  auto queue_next = [&](uint32_t b) {
    if (next >= count || Refuses(is_write)) return false;
    io_uring_sqe* sqe = io_uring_get_sqe(ring);
    if (sqe == nullptr) return false;  // cannot happen: one entry per buffer
    uint8_t* buffer = ring_->buffers[b];
    if (is_write) prepare(next, buffer);
    const OpRange range = op_of(next);
    const auto offset = static_cast<off_t>(range.offset);
    const auto length = static_cast<unsigned>(range.length);
    const int index = static_cast<int>(b);
    if (is_write && ring_->fixed_buffers) {
      io_uring_prep_write_fixed(sqe, fd_, buffer, length, offset, index);
    } else if (is_write) {
      io_uring_prep_write(sqe, fd_, buffer, length, offset);
    } else if (ring_->fixed_buffers) {
      io_uring_prep_read_fixed(sqe, fd_, buffer, length, offset, index);
    } else {
      io_uring_prep_read(sqe, fd_, buffer, length, offset);
    }
    io_uring_sqe_set_data64(sqe, b);
    op_of_buffer[b] = next;
    ++next;
    ++in_flight;
    return true;
  };
  for (uint32_t b = 0; b < ring_->buffers.size(); ++b) {
    if (b != ring_->spare && !queue_next(b)) break;
  }
  while (in_flight > 0) {
    const int rc = io_uring_submit_and_wait(ring, 1);
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
      // The ring itself failed: nothing more can be trusted to complete. Operations still in
      // flight finish (or are cancelled) when the ring is torn down, before their buffers go.
      Disable(DiskTierFailure::kIoError,
              absl::StrCat("io_uring_submit_and_wait: ", std::strerror(-rc)));
      return;
    }
    // Each completion's buffer is queued again at once, before the next completion's checks
    // and copies, so the device keeps queue_depth operations while this thread works.
    io_uring_cqe* cqe = nullptr;
    while (io_uring_peek_cqe(ring, &cqe) == 0) {
      const auto b = static_cast<uint32_t>(io_uring_cqe_get_data64(cqe));
      int result = cqe->res;
      io_uring_cqe_seen(ring, cqe);
      --in_flight;
      const size_t op = op_of_buffer[b];
      if (options_.inject_result) result = options_.inject_result(is_write, op_of(op).slot, result);
      if (is_write) {
        // A write's buffer is free as soon as it completed.
        complete(op, ring_->buffers[b], result);
        if (queue_next(b)) io_uring_submit(ring);
      } else {
        // A read's buffer holds the block until it is checked and copied out; the next read
        // goes to the spare buffer, and this one becomes the spare.
        const uint32_t spare = ring_->spare;
        ring_->spare = b;
        if (queue_next(spare)) io_uring_submit(ring);
        complete(op, ring_->buffers[b], result);
      }
    }
  }
}

std::vector<size_t> DiskTier::Runnable(std::vector<absl::Status>& statuses, bool is_write) const {
  std::vector<size_t> valid;
  if (Refuses(is_write)) {
    for (auto& s : statuses) s.Update(DisabledStatus());
    return valid;
  }
  for (size_t i = 0; i < statuses.size(); ++i) {
    if (statuses[i].ok()) valid.push_back(i);
  }
  return valid;
}

bool DiskTier::Refuses(bool is_write) const {
  const DiskTierFailure failure = failure_.load();
  // A full disk still holds good blocks; a failing one holds nothing to trust.
  return is_write ? failure != DiskTierFailure::kNone : failure == DiskTierFailure::kIoError;
}

std::vector<absl::Status> DiskTier::WriteBlocks(absl::Span<const BlockWrite> writes) {
  std::vector<absl::Status> statuses(writes.size());
  for (size_t i = 0; i < writes.size(); ++i) {
    const BlockWrite& w = writes[i];
    if (w.slot < 0 || w.slot >= num_slots_ || w.data.size() != options_.block_bytes) {
      statuses[i] = absl::InvalidArgumentError(
          absl::StrCat("disk tier write: slot ", w.slot, " of ", num_slots_, ", ", w.data.size(),
                       " bytes where a block is ", options_.block_bytes));
    }
  }
  const std::vector<size_t> valid = Runnable(statuses, /*is_write=*/true);
  std::vector<bool> done(writes.size(), false);
  RunOps(
      valid.size(), /*is_write=*/true, [&](size_t op) { return WholeSlot(writes[valid[op]].slot); },
      [&](size_t op, uint8_t* buffer) {
        const BlockWrite& w = writes[valid[op]];
        SlotHeader h{};
        std::memcpy(h.magic, kMagic, sizeof kMagic);
        h.version = kVersion;
        h.header_bytes = kHeaderBytes;
        h.block_bytes = options_.block_bytes;
        std::memcpy(h.layout, options_.layout.bytes.data(), sizeof h.layout);
        h.hash_hi = w.hash.hi;
        h.hash_lo = w.hash.lo;
        uint8_t* payload = buffer + kHeaderBytes;
        ToDiskOrder(w.data.data(), payload);
        h.payload_checksum = BlockChecksum(payload, w.data.size());
        h.slot = static_cast<uint64_t>(w.slot);
        h.stage_plan = stage_plan_;
        h.num_stages = stages_.size();
        for (size_t st = 0; st < stages_.size(); ++st) {
          h.stage_checksum[st] = BlockChecksum(payload + stage_begin_[st], stage_length_[st]);
        }
        h.header_checksum = BlockChecksum(&h, kCheckedHeaderBytes);
        std::memset(buffer, 0, kHeaderBytes);
        std::memcpy(buffer, &h, sizeof h);
        std::memset(buffer + kHeaderBytes + w.data.size(), 0,
                    io_bytes_ - kHeaderBytes - w.data.size());
      },
      [&](size_t op, uint8_t*, int result) {
        const size_t i = valid[op];
        done[i] = true;
        if (result == static_cast<int>(io_bytes_)) return;
        const std::string where = absl::StrCat("write slot ", writes[i].slot);
        // A short write to a regular file means the file system had no room for the rest.
        if (result == -ENOSPC || result >= 0) {
          Disable(DiskTierFailure::kFull,
                  result < 0 ? absl::StrCat("the disk is full (", where, ": ENOSPC)")
                             : absl::StrCat("the disk is full (", where, " wrote ", result, " of ",
                                            io_bytes_, " bytes)"));
          statuses[i] = absl::ResourceExhaustedError(disabled_reason());
        } else {
          Disable(DiskTierFailure::kIoError, absl::StrCat(where, ": ", std::strerror(-result)));
          statuses[i] = DisabledStatus();
        }
      });
  for (size_t i : valid) {
    if (!done[i]) statuses[i] = DisabledStatus();
  }
  return statuses;
}

absl::Status DiskTier::VerifySlot(const uint8_t* image, int64_t slot, const BlockHash* expected,
                                  BlockHash* found, absl::Span<uint8_t> out, bool header_only,
                                  StageChecksums* checksums) const {
  SlotHeader h;
  std::memcpy(&h, image, sizeof h);
  const std::string where = absl::StrCat("disk tier slot ", slot);
  if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0) {
    return absl::NotFoundError(absl::StrCat(where, " holds no block"));
  }
  if (h.header_checksum != BlockChecksum(&h, kCheckedHeaderBytes)) {
    return absl::DataLossError(absl::StrCat(where, ": header checksum mismatch"));
  }
  if (h.version != kVersion || h.header_bytes != kHeaderBytes ||
      h.block_bytes != options_.block_bytes) {
    return absl::DataLossError(absl::StrCat(where, ": format v", h.version, " with ", h.block_bytes,
                                            "-byte blocks, not v", kVersion, " with ",
                                            options_.block_bytes));
  }
  if (std::memcmp(h.layout, options_.layout.bytes.data(), sizeof h.layout) != 0) {
    return absl::DataLossError(absl::StrCat(where, " holds a block of another layout"));
  }
  if (h.slot != static_cast<uint64_t>(slot)) {
    return absl::DataLossError(absl::StrCat(where, " holds a block written for slot ", h.slot));
  }
  if (h.stage_plan != stage_plan_ || h.num_stages != stages_.size()) {
    return absl::DataLossError(absl::StrCat(where, " was written in ", h.num_stages,
                                            " stages of another plan, not these ", stages_.size()));
  }
  *found = BlockHash{h.hash_hi, h.hash_lo};
  if (expected != nullptr && *found != *expected) {
    return absl::DataLossError(
        absl::StrCat(where, " holds block ", found->ToHex(), ", not ", expected->ToHex()));
  }
  if (checksums != nullptr) {
    std::copy(std::begin(h.stage_checksum), std::end(h.stage_checksum), checksums->sums);
  }
  if (header_only) return absl::OkStatus();
  const uint8_t* payload = image + kHeaderBytes;
  if (BlockChecksum(payload, options_.block_bytes) != h.payload_checksum) {
    return absl::DataLossError(
        absl::StrCat(where, " (block ", found->ToHex(), "): payload checksum mismatch"));
  }
  if (!out.empty()) FromDiskOrder(payload, out.data());
  return absl::OkStatus();
}

void DiskTier::ToDiskOrder(const uint8_t* block, uint8_t* disk) const {
  for (const std::vector<PayloadRange>& stage : stages_) {
    for (const PayloadRange& r : stage) {
      std::memcpy(disk, block + r.offset, r.length);
      disk += r.length;
    }
  }
}

void DiskTier::FromDiskOrder(const uint8_t* disk, uint8_t* block) const {
  for (const std::vector<PayloadRange>& stage : stages_) {
    for (const PayloadRange& r : stage) {
      std::memcpy(block + r.offset, disk, r.length);
      disk += r.length;
    }
  }
}

void DiskTier::ScatterStage(int stage, absl::Span<const uint8_t> bytes,
                            absl::Span<const Destination> block) const {
  const uint8_t* from = bytes.data();
  for (const PayloadRange& r : stages_[static_cast<size_t>(stage)]) {
    // The range may span several destinations (a block's groups live in separate pools).
    for (const Destination& d : block) {
      const uint64_t lo = std::max(r.offset, d.offset);
      const uint64_t hi = std::min(r.offset + r.length, d.offset + d.length);
      if (lo < hi) std::memcpy(d.memory + (lo - d.offset), from + (lo - r.offset), hi - lo);
    }
    from += r.length;
  }
}

std::vector<absl::Status> DiskTier::ReadBlocks(absl::Span<const BlockRead> reads) {
  std::vector<absl::Status> statuses(reads.size());
  for (size_t i = 0; i < reads.size(); ++i) {
    const BlockRead& r = reads[i];
    if (r.slot < 0 || r.slot >= num_slots_ || r.out.size() != options_.block_bytes) {
      statuses[i] = absl::InvalidArgumentError(
          absl::StrCat("disk tier read: slot ", r.slot, " of ", num_slots_, ", ", r.out.size(),
                       " bytes where a block is ", options_.block_bytes));
    }
  }
  const std::vector<size_t> valid = Runnable(statuses, /*is_write=*/false);
  std::vector<bool> done(reads.size(), false);
  RunOps(
      valid.size(), /*is_write=*/false, [&](size_t op) { return WholeSlot(reads[valid[op]].slot); },
      [](size_t, uint8_t*) {},
      [&](size_t op, uint8_t* buffer, int result) {
        const size_t i = valid[op];
        const BlockRead& r = reads[i];
        done[i] = true;
        if (result == static_cast<int>(io_bytes_)) {
          BlockHash found;
          absl::Status s = VerifySlot(buffer, r.slot, &r.hash, &found, r.out);
          // An empty slot where a block was expected is a lost block too.
          statuses[i] = absl::IsNotFound(s) ? absl::DataLossError(s.message()) : s;
          return;
        }
        const std::string where = absl::StrCat("read slot ", r.slot);
        Disable(DiskTierFailure::kIoError,
                result < 0
                    ? absl::StrCat(where, ": ", std::strerror(-result))
                    : absl::StrCat(where, ": short read (", result, " of ", io_bytes_, " bytes)"));
        statuses[i] = DisabledStatus();
      });
  for (size_t i : valid) {
    if (!done[i]) statuses[i] = DisabledStatus();
  }
  return statuses;
}

std::vector<absl::Status> DiskTier::ReadStage(
    absl::Span<const StagedRead> reads, int stage,
    const std::function<void(size_t, absl::Span<const uint8_t>)>& deliver) {
  std::vector<absl::Status> statuses(reads.size());
  for (size_t i = 0; i < reads.size(); ++i) {
    const StagedRead& r = reads[i];
    if (r.slot < 0 || r.slot >= num_slots_ || r.checksums == nullptr || stage < 0 ||
        stage >= num_stages()) {
      statuses[i] = absl::InvalidArgumentError(
          absl::StrCat("disk tier stage read: slot ", r.slot, " of ", num_slots_, ", stage ", stage,
                       " of ", num_stages(), r.checksums == nullptr ? ", no checksums" : ""));
    }
  }
  const std::vector<size_t> valid = Runnable(statuses, /*is_write=*/false);
  const auto st = static_cast<size_t>(stage);
  // Stage 0 reads the header with it; a later stage reads its own bytes, 4 KiB aligned.
  const uint64_t first = stage == 0 ? 0 : RoundDown(kHeaderBytes + stage_begin_[st], kAlignment);
  const uint64_t last = RoundUp(kHeaderBytes + stage_begin_[st] + stage_length_[st], kAlignment);
  const uint64_t skip = kHeaderBytes + stage_begin_[st] - first;  // stage bytes in the buffer
  std::vector<bool> done(reads.size(), false);
  RunOps(
      valid.size(), /*is_write=*/false,
      [&](size_t op) {
        const int64_t slot = reads[valid[op]].slot;
        return OpRange{slot, static_cast<uint64_t>(slot) * slot_bytes_ + first,
                       static_cast<uint32_t>(last - first)};
      },
      [](size_t, uint8_t*) {},
      [&](size_t op, uint8_t* buffer, int result) {
        const size_t i = valid[op];
        const StagedRead& r = reads[i];
        done[i] = true;
        if (result != static_cast<int>(last - first)) {
          const std::string where = absl::StrCat("read slot ", r.slot, " stage ", stage);
          Disable(DiskTierFailure::kIoError, result < 0
                                                 ? absl::StrCat(where, ": ", std::strerror(-result))
                                                 : absl::StrCat(where, ": short read (", result,
                                                                " of ", last - first, " bytes)"));
          statuses[i] = DisabledStatus();
          return;
        }
        if (stage == 0) {
          BlockHash found;
          absl::Status s =
              VerifySlot(buffer, r.slot, &r.hash, &found, {}, /*header_only=*/true, r.checksums);
          if (!s.ok()) {
            statuses[i] = absl::IsNotFound(s) ? absl::DataLossError(s.message()) : s;
            return;
          }
        }
        const absl::Span<const uint8_t> bytes(buffer + skip, stage_length_[st]);
        if (BlockChecksum(bytes.data(), bytes.size()) != r.checksums->sums[st]) {
          statuses[i] = absl::DataLossError(absl::StrCat("disk tier slot ", r.slot, " (block ",
                                                         r.hash.ToHex(), "): stage ", stage,
                                                         " checksum mismatch"));
          return;
        }
        deliver(i, bytes);
      });
  for (size_t i : valid) {
    if (!done[i]) statuses[i] = DisabledStatus();
  }
  return statuses;
}

absl::StatusOr<std::vector<DiskTier::StoredBlock>> DiskTier::Scan(int64_t* rejected) {
  if (Refuses(/*is_write=*/false)) return DisabledStatus();
  std::vector<StoredBlock> blocks;
  int64_t rejected_count = 0;
  RunOps(
      static_cast<size_t>(num_slots_), /*is_write=*/false,
      [&](size_t op) { return WholeSlot(static_cast<int64_t>(op)); }, [](size_t, uint8_t*) {},
      [&](size_t op, uint8_t* buffer, int result) {
        const auto slot = static_cast<int64_t>(op);
        if (result != static_cast<int>(io_bytes_)) {
          Disable(DiskTierFailure::kIoError,
                  absl::StrCat("scan slot ", slot, ": ",
                               result < 0 ? std::strerror(-result) : "short read"));
          return;
        }
        BlockHash found;
        absl::Status s = VerifySlot(buffer, slot, nullptr, &found, {});
        if (s.ok()) {
          blocks.push_back({slot, found});
        } else if (!absl::IsNotFound(s)) {
          ++rejected_count;
        }
      });
  if (Refuses(/*is_write=*/false)) return DisabledStatus();
  if (rejected != nullptr) *rejected = rejected_count;
  return blocks;
}

}  // namespace kvrelay::kv
