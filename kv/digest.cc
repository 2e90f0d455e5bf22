#include "kv/digest.h"

#include <openssl/evp.h>

#include <memory>

#include "common/check.h"

namespace kvrelay::kv::internal {
namespace {

// OpenSSL 3 looks an algorithm up on every EVP_DigestInit given EVP_sha256(); fetching it once
// and reusing one context per thread halves the cost of hashing a small block.
const EVP_MD* Sha256Md() {
  static const EVP_MD* md = [] {
    EVP_MD* fetched = EVP_MD_fetch(nullptr, "SHA256", nullptr);
    KV_CHECK(fetched != nullptr);
    return fetched;  // process lifetime
  }();
  return md;
}

struct MdCtxDeleter {
  void operator()(EVP_MD_CTX* ctx) const { EVP_MD_CTX_free(ctx); }
};

EVP_MD_CTX* ThreadContext() {
  thread_local std::unique_ptr<EVP_MD_CTX, MdCtxDeleter> ctx(EVP_MD_CTX_new());
  KV_CHECK(ctx != nullptr);
  return ctx.get();
}

}  // namespace

std::array<uint8_t, 32> Sha256(std::string_view data) {
  std::array<uint8_t, 32> digest;
  unsigned int size = 0;
  EVP_MD_CTX* ctx = ThreadContext();
  // These fail only on allocation failure.
  KV_CHECK(EVP_DigestInit_ex2(ctx, Sha256Md(), nullptr) == 1);
  KV_CHECK(EVP_DigestUpdate(ctx, data.data(), data.size()) == 1);
  KV_CHECK(EVP_DigestFinal_ex(ctx, digest.data(), &size) == 1);
  KV_DCHECK(size == digest.size());
  return digest;
}

}  // namespace kvrelay::kv::internal
