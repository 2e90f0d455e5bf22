#pragma once

// Secrets the serving path hands out and checks: reservation tokens, data-plane keys.
// Random bytes come from OpenSSL's CSPRNG; comparisons take the same time whatever the
// contents, so a peer cannot learn a token byte by byte from response times.

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvrelay::kv {

// `bytes` random bytes (RAND_bytes). Internal error if the CSPRNG fails (never a weak value).
absl::StatusOr<std::string> RandomSecret(size_t bytes);

// Constant-time in the contents (CRYPTO_memcmp); unequal lengths are unequal at once. An
// empty `expected` never matches: an unset secret accepts nothing.
bool SecretEquals(std::string_view expected, std::string_view presented);

}  // namespace kvrelay::kv
