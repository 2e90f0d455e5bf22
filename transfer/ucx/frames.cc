#include "transfer/ucx/frames.h"

#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvrelay::transfer::ucx::frames {

absl::StatusOr<std::optional<Frame>> NextFrame(std::string_view buffered) {
  if (buffered.size() < 4) return std::nullopt;
  uint32_t len;
  std::memcpy(&len, buffered.data(), 4);
  if (len == 0 || len > wire::kMaxFrameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("bad frame length ", len));
  }
  if (buffered.size() - 4 < len) return std::nullopt;
  return Frame{.type = static_cast<wire::FrameType>(buffered[4]),
               .payload = buffered.substr(5, len - 1),
               .consumed = 4 + static_cast<size_t>(len)};
}

absl::StatusOr<HelloHeader> DecodeHelloHeader(wire::Reader& r) {
  uint32_t magic;
  HelloHeader h;
  if (!r.U32(&magic) || !r.U32(&h.version) || magic != wire::kMagic) {
    return absl::InvalidArgumentError("not a kvrelay transfer peer");
  }
  if (h.version != wire::kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer speaks protocol version ", h.version, ", we speak ", wire::kVersion));
  }
  if (!r.U64(&h.incarnation) || !r.Str(&h.advertised_address) || !r.Str(&h.key) ||
      h.incarnation == 0 || h.advertised_address.size() > kMaxAddressBytes ||
      h.key.size() > kMaxKeyBytes) {
    return absl::InvalidArgumentError("truncated or invalid hello");
  }
  return h;
}

absl::StatusOr<Region> DecodeRegion(wire::Reader& r) {
  Region region;
  if (!r.U64(&region.id) || !r.U64(&region.base) || !r.U64(&region.size) ||
      !r.Str(&region.packed_rkey)) {
    return absl::InvalidArgumentError("truncated region");
  }
  return region;
}

absl::StatusOr<HelloBody> DecodeHelloBody(wire::Reader& r) {
  HelloBody body;
  uint32_t n;
  if (!r.Str(&body.worker_address) || !r.U32(&n) || n > kMaxRegions) {
    return absl::InvalidArgumentError("truncated hello");
  }
  // Each region takes at least 28 bytes: never reserve more than the frame can hold.
  if (r.remaining() / 28 < n) return absl::InvalidArgumentError("truncated hello region");
  body.regions.reserve(n);
  for (uint32_t i = 0; i < n; ++i) {
    absl::StatusOr<Region> region = DecodeRegion(r);
    if (!region.ok()) return absl::InvalidArgumentError("truncated hello region");
    body.regions.push_back(*std::move(region));
  }
  return body;
}

absl::StatusOr<Done> DecodeDone(std::string_view payload) {
  wire::Reader r(payload);
  Done d;
  uint32_t n;
  if (!r.U64(&d.transfer_id) || !r.U64(&d.tag) || !r.I32(&d.layer_begin) || !r.I32(&d.layer_end) ||
      !r.U32(&n) || n > kMaxBlocksPerFrame || r.remaining() / 33 < n) {
    return absl::InvalidArgumentError("truncated done frame");
  }
  d.blocks.resize(n);
  for (DoneBlock& b : d.blocks) {
    uint8_t has = 0;
    uint64_t ck = 0;
    r.U64(&b.region);
    r.U64(&b.offset);
    r.U64(&b.length);
    r.U8(&has);
    r.U64(&ck);
    if (has) b.checksum = ck;
  }
  if (!r.Str(&d.credential) || d.credential.size() > kMaxCredentialBytes) {
    return absl::InvalidArgumentError("done frame without a valid credential");
  }
  return d;
}

absl::StatusOr<Ack> DecodeAck(std::string_view payload) {
  wire::Reader r(payload);
  Ack a;
  uint32_t n;
  if (!r.U64(&a.transfer_id) || !r.U32(&n) || r.remaining() < n) {
    return absl::InvalidArgumentError("truncated ack frame");
  }
  a.codes.resize(n);
  for (uint8_t& code : a.codes) r.U8(&code);
  r.Str(&a.first_error);  // optional
  if (a.first_error.size() > kMaxErrorBytes) a.first_error.resize(kMaxErrorBytes);
  return a;
}

absl::StatusOr<Control> DecodeControl(std::string_view payload) {
  wire::Reader r(payload);
  Control c;
  if (!r.U64(&c.tag) || !r.Str(&c.message)) return absl::InvalidArgumentError("truncated control");
  return c;
}

}  // namespace kvrelay::transfer::ucx::frames
