#include "kv/digest.h"

#include <openssl/evp.h>

#include "common/check.h"

namespace kvrelay::kv::internal {

std::array<uint8_t, 32> Sha256(std::string_view data) {
  std::array<uint8_t, 32> digest;
  unsigned int size = 0;
  // EVP_Digest with a static EVP_MD fails only on allocation failure.
  KV_CHECK(EVP_Digest(data.data(), data.size(), digest.data(), &size, EVP_sha256(), nullptr) == 1);
  KV_DCHECK(size == digest.size());
  return digest;
}

}  // namespace kvrelay::kv::internal
