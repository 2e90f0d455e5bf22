#pragma once

// DevCertificateAuthority: a throwaway certificate authority for `kvrelay up` and tests. It makes
// an ECDSA P-256 CA and issues a certificate per component with the identity URI
// spiffe://kvrelay/<role>/<id> (common/server/auth.h) and the host names/addresses it serves on,
// written as PEM files into one directory (private keys mode 0600). scripts/certs.sh does the
// same with the openssl command for real deployments.
//
// Not thread-safe.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/server/auth.h"
#include "common/server/credentials.h"

namespace kvrelay::server {

class DevCertificateAuthority {
 public:
  // Creates <dir>/ca.pem and its key <dir>/ca.key (mode 0600, so more dev certificates can be
  // issued later with Open). `dir` must exist and should be private (0700).
  static absl::StatusOr<std::unique_ptr<DevCertificateAuthority>> Create(
      const std::string& dir, absl::Duration valid_for = absl::Hours(24 * 7));
  // The authority Create wrote into `dir`.
  static absl::StatusOr<std::unique_ptr<DevCertificateAuthority>> Open(
      const std::string& dir, absl::Duration valid_for = absl::Hours(24));
  ~DevCertificateAuthority();
  DevCertificateAuthority(const DevCertificateAuthority&) = delete;
  DevCertificateAuthority& operator=(const DevCertificateAuthority&) = delete;

  // Issues <dir>/<role>-<id>.pem and .key for (role, id), valid for `hosts` (DNS names or IP
  // addresses the component serves on) and for both TLS server and client use. Returns the
  // SecurityOptions (cert, key, CA) a component passes as --tls-cert/--tls-key/--tls-ca.
  absl::StatusOr<SecurityOptions> Issue(PeerRole role, absl::string_view id,
                                        const std::vector<std::string>& hosts = {"localhost",
                                                                                 "127.0.0.1"});

  const std::string& ca_file() const { return ca_file_; }

  // The three flags for `options` ({"--tls-cert", c, "--tls-key", k, "--tls-ca", a}).
  static std::vector<std::string> Flags(const SecurityOptions& options);

 private:
  struct Keys;
  DevCertificateAuthority(std::string dir, absl::Duration valid_for, std::unique_ptr<Keys> keys);

  const std::string dir_;
  const absl::Duration valid_for_;
  std::string ca_file_;
  std::unique_ptr<Keys> keys_;
};

}  // namespace kvrelay::server
