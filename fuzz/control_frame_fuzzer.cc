// The data plane's control connection (transfer/ucx/frames): a received byte stream is split
// into frames exactly as ControlChannel does, and every frame goes through the decoder its
// type selects (hello header + UCX body, region, DONE, ACK, control message, refuse).

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "transfer/ucx/frames.h"

namespace frames = kvrelay::transfer::ucx::frames;
namespace wire = kvrelay::transfer::ucx::wire;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view stream(reinterpret_cast<const char*>(data), size);
  while (true) {
    absl::StatusOr<std::optional<frames::Frame>> next = frames::NextFrame(stream);
    if (!next.ok() || !next->has_value()) break;
    const frames::Frame frame = **next;
    if (frame.consumed > stream.size() || frame.payload.size() + 5 != frame.consumed) {
      __builtin_trap();
    }
    stream.remove_prefix(frame.consumed);
    wire::Reader r(frame.payload);
    switch (frame.type) {
      case wire::FrameType::kHello:
        if (frames::DecodeHelloHeader(r).ok()) (void)frames::DecodeHelloBody(r);
        break;
      case wire::FrameType::kRegionAdd:
        (void)frames::DecodeRegion(r);
        break;
      case wire::FrameType::kDone: {
        absl::StatusOr<frames::Done> done = frames::DecodeDone(frame.payload);
        if (done.ok() && done->blocks.size() * 33 > frame.payload.size()) __builtin_trap();
        break;
      }
      case wire::FrameType::kAck: {
        absl::StatusOr<frames::Ack> ack = frames::DecodeAck(frame.payload);
        if (ack.ok() && ack->codes.size() > frame.payload.size()) __builtin_trap();
        break;
      }
      case wire::FrameType::kControl:
        (void)frames::DecodeControl(frame.payload);
        break;
      default: {
        std::string reason;
        (void)r.Str(&reason);
        break;
      }
    }
  }
  return 0;
}
