#pragma once

// The control connection's wire format (plain TCP, one per peer pair). Every frame is
//   u32 length (of what follows) | u8 type | payload
// with little-endian fixed-width integers and u32-length-prefixed byte strings. Frames over
// kMaxFrameBytes, unknown types and truncated payloads end the connection (never a crash).
// See transfer/README.md for each frame's payload.

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace kvrelay::transfer::ucx::wire {

inline constexpr uint32_t kMagic = 0x5852564b;  // "KVRX"
// 2: the hello carries the sender's incarnation and advertised address.
// 3: the hello carries the connector's data-plane key (empty from the acceptor), a refused
//    hello is answered with kRefuse, and DONE ends with the sender's credential.
inline constexpr uint32_t kVersion = 3;
inline constexpr uint32_t kMaxFrameBytes = 64u << 20;

enum class FrameType : uint8_t {
  kHello = 1,         // magic, version, incarnation, address, worker address, regions
  kRegionAdd = 2,     // one region
  kRegionRemove = 3,  // region id
  kDone = 4,          // a put's data is in the receiver's memory: id, tag, layers, blocks
  kAck = 5,           // the receiver's verdict per block
  kControl = 6,       // tag, message
  kHeartbeat = 7,     // empty
  kBye = 8,           // empty: orderly disconnect
  kRefuse = 9,        // reason: the acceptor refused the hello (wrong data-plane key)
};

class Writer {
 public:
  explicit Writer(FrameType type) {
    out_.resize(4);
    out_.push_back(static_cast<char>(type));
  }
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U32(uint32_t v) { Raw(&v, 4); }
  void U64(uint64_t v) { Raw(&v, 8); }
  void I32(int32_t v) { Raw(&v, 4); }
  void Str(std::string_view s) {
    U32(static_cast<uint32_t>(s.size()));
    out_.append(s.data(), s.size());
  }
  // The finished frame with its length prefix.
  std::string Finish() && {
    uint32_t len = static_cast<uint32_t>(out_.size() - 4);
    std::memcpy(out_.data(), &len, 4);
    return std::move(out_);
  }

 private:
  void Raw(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }
  std::string out_;
};

// Reads a payload; every getter returns false once the payload is exhausted.
class Reader {
 public:
  explicit Reader(std::string_view payload) : in_(payload) {}
  bool U8(uint8_t* v) { return Raw(v, 1); }
  bool U32(uint32_t* v) { return Raw(v, 4); }
  bool U64(uint64_t* v) { return Raw(v, 8); }
  bool I32(int32_t* v) { return Raw(v, 4); }
  bool Str(std::string* s) {
    uint32_t n;
    if (!U32(&n) || n > in_.size()) return false;
    s->assign(in_.data(), n);
    in_.remove_prefix(n);
    return true;
  }
  bool done() const { return in_.empty(); }
  // Everything not read yet; the reader is then exhausted.
  void Rest(std::string_view* rest) {
    *rest = in_;
    in_ = {};
  }
  size_t remaining() const { return in_.size(); }

 private:
  bool Raw(void* p, size_t n) {
    if (in_.size() < n) return false;
    std::memcpy(p, in_.data(), n);
    in_.remove_prefix(n);
    return true;
  }
  std::string_view in_;
};

}  // namespace kvrelay::transfer::ucx::wire
