#include "kv/secret.h"

#include <openssl/crypto.h>
#include <openssl/rand.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvrelay::kv {

absl::StatusOr<std::string> RandomSecret(size_t bytes) {
  std::string out(bytes, '\0');
  if (bytes > 0 &&
      RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(bytes)) != 1) {
    return absl::InternalError(absl::StrCat("RAND_bytes could not produce ", bytes, " bytes"));
  }
  return out;
}

bool SecretEquals(std::string_view expected, std::string_view presented) {
  if (expected.empty() || expected.size() != presented.size()) return false;
  return CRYPTO_memcmp(expected.data(), presented.data(), expected.size()) == 0;
}

}  // namespace kvrelay::kv
