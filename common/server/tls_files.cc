#include "common/server/tls_files.h"

#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/status_macros.h"

namespace kvrelay::server {
namespace {

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct StoreFree {
  void operator()(X509_STORE* s) const { X509_STORE_free(s); }
};
struct StoreCtxFree {
  void operator()(X509_STORE_CTX* c) const { X509_STORE_CTX_free(c); }
};
struct StackFree {
  void operator()(STACK_OF(X509) * s) const { sk_X509_free(s); }
};
using Bio = std::unique_ptr<BIO, BioFree>;
using Cert = std::unique_ptr<X509, X509Free>;

Bio MemoryBio(const std::string& pem) {
  return Bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// Every certificate of a PEM file, in order; InvalidArgument when it holds none.
absl::StatusOr<std::vector<Cert>> ReadCerts(const std::string& path, const std::string& what) {
  KV_ASSIGN_OR_RETURN(std::string pem, ReadFileToString(path));
  Bio bio = MemoryBio(pem);
  std::vector<Cert> certs;
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) certs.emplace_back(x);
  if (certs.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", path, " holds no PEM certificate"));
  }
  return certs;
}

}  // namespace

absl::Status VerifyTlsFiles(const TlsFiles& files, const std::string& what) {
  KV_ASSIGN_OR_RETURN(std::vector<Cert> chain, ReadCerts(files.cert_file, what));
  KV_ASSIGN_OR_RETURN(std::vector<Cert> cas, ReadCerts(files.ca_file, what));
  KV_ASSIGN_OR_RETURN(std::string key_pem, ReadFileToString(files.key_file));
  Bio key_bio = MemoryBio(key_pem);
  std::unique_ptr<EVP_PKEY, KeyFree> key(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  if (key == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", files.key_file, " holds no PEM private key"));
  }
  if (X509_check_private_key(chain[0].get(), key.get()) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": the key in ", files.key_file,
                                                   " is not the key of the certificate in ",
                                                   files.cert_file));
  }
  std::unique_ptr<X509_STORE, StoreFree> store(X509_STORE_new());
  for (const Cert& ca : cas) X509_STORE_add_cert(store.get(), ca.get());
  std::unique_ptr<STACK_OF(X509), StackFree> intermediates(sk_X509_new_null());
  for (size_t i = 1; i < chain.size(); ++i) sk_X509_push(intermediates.get(), chain[i].get());
  std::unique_ptr<X509_STORE_CTX, StoreCtxFree> ctx(X509_STORE_CTX_new());
  if (store == nullptr || intermediates == nullptr || ctx == nullptr ||
      X509_STORE_CTX_init(ctx.get(), store.get(), chain[0].get(), intermediates.get()) != 1) {
    return absl::InternalError(absl::StrCat(what, ": cannot set up certificate verification"));
  }
  if (X509_verify_cert(ctx.get()) != 1) {
    const int error = X509_STORE_CTX_get_error(ctx.get());
    return absl::InvalidArgumentError(absl::StrCat(what, ": the certificate in ", files.cert_file,
                                                   " does not verify against ", files.ca_file, " (",
                                                   X509_verify_cert_error_string(error), ")"));
  }
  return absl::OkStatus();
}

}  // namespace kvrelay::server
