#pragma once

// Decoders for the control connection's frames (wire.h): pure functions over bytes, with no
// sockets or UCX, so that ControlChannel and UcxTransport parse every frame the same way and
// the fuzzer (fuzz/) reaches each of them. A decoder never reads past its input and returns
// InvalidArgument, naming the frame, for anything truncated, oversized or out of range.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "transfer/ucx/wire.h"

namespace kvrelay::transfer::ucx::frames {

// Bounds on what a peer may send (beyond wire::kMaxFrameBytes for a whole frame).
inline constexpr size_t kMaxAddressBytes = 1024;
inline constexpr size_t kMaxKeyBytes = 256;          // = transfer::kMaxPeerKeyBytes
inline constexpr size_t kMaxCredentialBytes = 1024;  // = transfer::kMaxCredentialBytes
inline constexpr uint32_t kMaxRegions = 1u << 20;
inline constexpr uint32_t kMaxBlocksPerFrame = 1u << 22;
inline constexpr size_t kMaxErrorBytes = 4096;

// One complete frame at the front of a receive buffer.
struct Frame {
  wire::FrameType type;
  std::string_view payload;  // into the buffer
  size_t consumed = 0;       // 4-byte length + type + payload
};
// nullopt: more bytes are needed. InvalidArgument: a length of 0 or over kMaxFrameBytes (the
// connection must end).
absl::StatusOr<std::optional<Frame>> NextFrame(std::string_view buffered);

// The channel's part of a hello: everything up to the transport's body, which `r` then holds.
struct HelloHeader {
  uint32_t version = 0;
  uint64_t incarnation = 0;
  std::string advertised_address;
  std::string key;  // the connector's data-plane key (version 3)
};
absl::StatusOr<HelloHeader> DecodeHelloHeader(wire::Reader& r);

struct Region {
  uint64_t id = 0;
  uint64_t base = 0;
  uint64_t size = 0;
  std::string packed_rkey;
};
absl::StatusOr<Region> DecodeRegion(wire::Reader& r);

// The UCX transport's body of a hello.
struct HelloBody {
  std::string worker_address;
  std::vector<Region> regions;
};
absl::StatusOr<HelloBody> DecodeHelloBody(wire::Reader& r);

struct DoneBlock {
  uint64_t region = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  std::optional<uint64_t> checksum;
};
struct Done {
  uint64_t transfer_id = 0;
  uint64_t tag = 0;
  int32_t layer_begin = 0;
  int32_t layer_end = 0;
  std::vector<DoneBlock> blocks;
  std::string credential;
};
absl::StatusOr<Done> DecodeDone(std::string_view payload);

struct Ack {
  uint64_t transfer_id = 0;
  std::vector<uint8_t> codes;  // absl::StatusCode per block, 0 = OK
  std::string first_error;
};
absl::StatusOr<Ack> DecodeAck(std::string_view payload);

struct Control {
  uint64_t tag = 0;
  std::string message;
};
absl::StatusOr<Control> DecodeControl(std::string_view payload);

}  // namespace kvrelay::transfer::ucx::frames
