#pragma once

// Checks a component's TLS files before anything uses them, so a wrong file is refused at start
// naming the file, instead of surfacing later as a handshake that fails on every call.

#include <string>

#include "absl/status/status.h"

namespace kvrelay::server {

struct TlsFiles {
  std::string cert_file;  // PEM certificate chain (leaf first)
  std::string key_file;   // PEM private key of the leaf
  std::string ca_file;    // PEM CA bundle the leaf must chain to
};

// OK when every file reads and parses, the key is the leaf's and the leaf (with the chain's
// intermediates) verifies against the CA bundle now. InvalidArgument naming the file and what
// is wrong otherwise (`what` prefixes the message, e.g. "--etcd-cert").
absl::Status VerifyTlsFiles(const TlsFiles& files, const std::string& what);

}  // namespace kvrelay::server
