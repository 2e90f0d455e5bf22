#pragma once

// InProcessTransport: the Transport interface over plain memcpy between regions of one process.
// Real copies, real checksums, the same ordering and failure semantics as UCX: transfers run
// on one worker thread per transport in Post order; a control message runs after every earlier
// Post to that peer; destroying a transport makes its peers see kPeerDown and Unavailable.
// Used by unit tests and by co-located prefill + decode.
//
// Thread-safe. Addresses are "inproc:<name>"; names are unique within the process.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "transfer/transport.h"

namespace kvrelay::transfer {

struct InProcessTransportOptions {
  std::string name;                     // empty: a unique generated name
  uint64_t copy_chunk_bytes = 4 << 20;  // cancellation and deadlines are checked per chunk
};

absl::StatusOr<TransportPtr> MakeInProcessTransport(InProcessTransportOptions options = {});

}  // namespace kvrelay::transfer
