#pragma once

// Internal to kv/: canonical little-endian byte encoding and SHA-256 for fingerprints and block
// hashes.

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvrelay::kv::internal {

// Appends fixed-width little-endian integers and length-prefixed strings, so that encodings
// are unambiguous and identical on every machine.
class ByteWriter {
 public:
  void U32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  void U64(uint64_t v) {
    for (int i = 0; i < 8; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  void Bytes(std::string_view bytes) { out_.append(bytes); }
  void LengthPrefixed(std::string_view bytes) {
    U32(static_cast<uint32_t>(bytes.size()));
    out_.append(bytes);
  }
  const std::string& data() const { return out_; }
  void Clear() { out_.clear(); }

 private:
  std::string out_;
};

std::array<uint8_t, 32> Sha256(std::string_view data);

}  // namespace kvrelay::kv::internal
