#include "common/server/dev_certs.h"

#include <arpa/inet.h>
#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/status_macros.h"

namespace kvrelay::server {
namespace {

using PkeyPtr = std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)>;
using X509Ptr = std::unique_ptr<X509, decltype(&X509_free)>;
using BioPtr = std::unique_ptr<BIO, decltype(&BIO_free)>;

absl::Status OpenSslError(absl::string_view what) {
  return absl::InternalError(absl::StrCat("openssl: ", what, " failed"));
}

absl::StatusOr<PkeyPtr> NewKey() {
  PkeyPtr key(EVP_EC_gen("P-256"), &EVP_PKEY_free);
  if (key == nullptr) return OpenSslError("EVP_EC_gen(P-256)");
  return key;
}

bool IsIpAddress(const std::string& host) {
  unsigned char buffer[16];
  return inet_pton(AF_INET, host.c_str(), buffer) == 1 ||
         inet_pton(AF_INET6, host.c_str(), buffer) == 1;
}

absl::Status AddExtension(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str());
  if (ext == nullptr) return OpenSslError(absl::StrCat("extension ", OBJ_nid2sn(nid), "=", value));
  const int added = X509_add_ext(cert, ext, -1);
  X509_EXTENSION_free(ext);
  return added == 1 ? absl::OkStatus() : OpenSslError("X509_add_ext");
}

// An unsigned certificate for `key` named `common_name`, issued by `issuer` (self-issued when
// null); the caller adds extensions and signs it.
absl::StatusOr<X509Ptr> NewCertificate(EVP_PKEY* key, const std::string& common_name, X509* issuer,
                                       absl::Duration valid_for) {
  X509Ptr cert(X509_new(), &X509_free);
  if (cert == nullptr) return OpenSslError("X509_new");
  X509_set_version(cert.get(), 2);
  unsigned char serial[16];
  if (RAND_bytes(serial, sizeof(serial)) != 1) return OpenSslError("RAND_bytes");
  serial[0] &= 0x7f;  // positive
  BIGNUM* bn = BN_bin2bn(serial, sizeof(serial), nullptr);
  ASN1_INTEGER* asn1_serial = BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(cert.get()));
  BN_free(bn);
  if (asn1_serial == nullptr) return OpenSslError("BN_to_ASN1_INTEGER");
  X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600);  // tolerate clock skew
  X509_gmtime_adj(X509_getm_notAfter(cert.get()), absl::ToInt64Seconds(valid_for));
  X509_set_pubkey(cert.get(), key);
  X509_NAME* name = X509_get_subject_name(cert.get());
  X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>("kvrelay"), -1, -1, 0);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(common_name.c_str()), -1, -1,
                             0);
  X509_set_issuer_name(cert.get(), issuer != nullptr ? X509_get_subject_name(issuer) : name);
  return cert;
}

absl::StatusOr<std::string> ToPem(X509* cert) {
  BioPtr bio(BIO_new(BIO_s_mem()), &BIO_free);
  if (bio == nullptr || PEM_write_bio_X509(bio.get(), cert) != 1) {
    return OpenSslError("PEM_write_bio_X509");
  }
  char* data = nullptr;
  const long size = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(size));
}

absl::StatusOr<std::string> ToPem(EVP_PKEY* key) {
  BioPtr bio(BIO_new(BIO_s_mem()), &BIO_free);
  if (bio == nullptr ||
      PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr) != 1) {
    return OpenSslError("PEM_write_bio_PrivateKey");
  }
  char* data = nullptr;
  const long size = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(size));
}

absl::Status WritePrivate(const std::string& path, const std::string& contents) {
  KV_RETURN_IF_ERROR(WriteFileAtomically(path, contents));
  if (::chmod(path.c_str(), 0600) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("chmod 0600 ", path));
  }
  return absl::OkStatus();
}

}  // namespace

struct DevCertificateAuthority::Keys {
  PkeyPtr ca_key{nullptr, &EVP_PKEY_free};
  X509Ptr ca_cert{nullptr, &X509_free};
};

DevCertificateAuthority::DevCertificateAuthority(std::string dir, absl::Duration valid_for,
                                                 std::unique_ptr<Keys> keys)
    : dir_(std::move(dir)),
      valid_for_(valid_for),
      ca_file_(dir_ + "/ca.pem"),
      keys_(std::move(keys)) {}

DevCertificateAuthority::~DevCertificateAuthority() = default;

absl::StatusOr<std::unique_ptr<DevCertificateAuthority>> DevCertificateAuthority::Create(
    const std::string& dir, absl::Duration valid_for) {
  auto keys = std::make_unique<Keys>();
  KV_ASSIGN_OR_RETURN(keys->ca_key, NewKey());
  KV_ASSIGN_OR_RETURN(keys->ca_cert, NewCertificate(keys->ca_key.get(), "kvrelay dev CA", nullptr,
                                                    valid_for + absl::Hours(1)));
  X509* ca = keys->ca_cert.get();
  KV_RETURN_IF_ERROR(AddExtension(ca, ca, NID_basic_constraints, "critical,CA:TRUE,pathlen:0"));
  KV_RETURN_IF_ERROR(AddExtension(ca, ca, NID_key_usage, "critical,keyCertSign,cRLSign"));
  KV_RETURN_IF_ERROR(AddExtension(ca, ca, NID_subject_key_identifier, "hash"));
  if (X509_sign(ca, keys->ca_key.get(), EVP_sha256()) == 0) return OpenSslError("X509_sign (CA)");
  KV_ASSIGN_OR_RETURN(std::string pem, ToPem(ca));
  KV_ASSIGN_OR_RETURN(std::string key_pem, ToPem(keys->ca_key.get()));
  auto authority = std::unique_ptr<DevCertificateAuthority>(
      new DevCertificateAuthority(dir, valid_for, std::move(keys)));
  KV_RETURN_IF_ERROR(WritePrivate(dir + "/ca.key", key_pem));
  KV_RETURN_IF_ERROR(WriteFileAtomically(authority->ca_file_, pem));
  return authority;
}

absl::StatusOr<std::unique_ptr<DevCertificateAuthority>> DevCertificateAuthority::Open(
    const std::string& dir, absl::Duration valid_for) {
  KV_ASSIGN_OR_RETURN(std::string cert_pem, ReadFileToString(dir + "/ca.pem"));
  KV_ASSIGN_OR_RETURN(std::string key_pem, ReadFileToString(dir + "/ca.key"));
  auto keys = std::make_unique<Keys>();
  BioPtr cert_bio(BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size())), &BIO_free);
  BioPtr key_bio(BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size())), &BIO_free);
  if (cert_bio == nullptr || key_bio == nullptr) return OpenSslError("BIO_new_mem_buf");
  keys->ca_cert.reset(PEM_read_bio_X509(cert_bio.get(), nullptr, nullptr, nullptr));
  keys->ca_key.reset(PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  if (keys->ca_cert == nullptr || keys->ca_key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(dir, ": ca.pem / ca.key are not a PEM CA"));
  }
  return std::unique_ptr<DevCertificateAuthority>(
      new DevCertificateAuthority(dir, valid_for, std::move(keys)));
}

absl::StatusOr<SecurityOptions> DevCertificateAuthority::Issue(
    PeerRole role, absl::string_view id, const std::vector<std::string>& hosts) {
  const std::string uri = SpiffeUri(role, id);
  KV_RETURN_IF_ERROR(ParseSpiffeUri(uri).status());
  KV_ASSIGN_OR_RETURN(PkeyPtr key, NewKey());
  X509* ca = keys_->ca_cert.get();
  KV_ASSIGN_OR_RETURN(X509Ptr cert, NewCertificate(key.get(), absl::StrCat(RoleName(role), " ", id),
                                                   ca, valid_for_));
  std::string san = absl::StrCat("URI:", uri);
  for (const std::string& host : hosts) {
    absl::StrAppend(&san, ",", IsIpAddress(host) ? "IP:" : "DNS:", host);
  }
  KV_RETURN_IF_ERROR(AddExtension(cert.get(), ca, NID_basic_constraints, "critical,CA:FALSE"));
  KV_RETURN_IF_ERROR(
      AddExtension(cert.get(), ca, NID_key_usage, "critical,digitalSignature,keyAgreement"));
  KV_RETURN_IF_ERROR(AddExtension(cert.get(), ca, NID_ext_key_usage, "serverAuth,clientAuth"));
  KV_RETURN_IF_ERROR(AddExtension(cert.get(), ca, NID_subject_alt_name, san));
  KV_RETURN_IF_ERROR(AddExtension(cert.get(), ca, NID_authority_key_identifier, "keyid"));
  if (X509_sign(cert.get(), keys_->ca_key.get(), EVP_sha256()) == 0) {
    return OpenSslError("X509_sign");
  }
  SecurityOptions options;
  options.insecure = false;
  const std::string base = absl::StrCat(dir_, "/", RoleName(role), "-", id);
  options.cert_file = base + ".pem";
  options.key_file = base + ".key";
  options.ca_file = ca_file_;
  KV_ASSIGN_OR_RETURN(std::string cert_pem, ToPem(cert.get()));
  KV_ASSIGN_OR_RETURN(std::string key_pem, ToPem(key.get()));
  KV_RETURN_IF_ERROR(WriteFileAtomically(options.cert_file, cert_pem));
  KV_RETURN_IF_ERROR(WritePrivate(options.key_file, key_pem));
  return options;
}

std::vector<std::string> DevCertificateAuthority::Flags(const SecurityOptions& options) {
  return {"--tls-cert",     options.cert_file, "--tls-key",
          options.key_file, "--tls-ca",        options.ca_file};
}

}  // namespace kvrelay::server
