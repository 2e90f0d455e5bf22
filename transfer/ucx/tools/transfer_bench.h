#pragma once

// The two peer roles of `kvrelay transfer-bench` (command.h), run in processes of their own.
//
// RunTransferReceiver is also the peer process of the multi-process tests: it registers one
// region, prints "READY <address> <region id> <region bytes>", counts what arrives (the
// transport verifies every checksum) and, when its stdin closes, prints
// "RECEIVED events=E blocks=B ok=O bad=X bytes=Y" and exits 0.

#include <string>
#include <vector>

namespace kvrelay::transfer::ucx::tools {

// Flags: --tls tcp|shm|<UCX_TLS list>, --region-bytes N, --listen-host HOST, --listen-port P.
int RunTransferReceiver(const std::vector<std::string>& args);
// A peer that pushes one block every --interval-ms to --connect for --duration-s, reconnecting
// the way a prefill worker does (a dead peer is dropped, Connect gives a fresh connection);
// prints "OK peer=P incarnation=I region=R" or "FAIL <step> <code> <message>" per attempt.
// Used by the link-cut test (tests/transfer/transfer_netns_test.cc).
int RunTransferSender(const std::vector<std::string>& args);
// "tcp" -> "tcp", "shm" -> "posix,sysv,cma,self", anything else unchanged.
std::string UcxTlsFor(const std::string& tls);

}  // namespace kvrelay::transfer::ucx::tools
