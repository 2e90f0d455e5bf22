#include "common/server/credentials.h"

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/status_macros.h"

namespace kvrelay::server {
namespace {

struct PemFiles {
  std::string cert, key, ca;
};

absl::StatusOr<PemFiles> LoadPem(const SecurityOptions& security) {
  if (security.cert_file.empty() || security.key_file.empty() || security.ca_file.empty()) {
    return absl::InvalidArgumentError(
        "TLS needs --tls-cert, --tls-key and --tls-ca (or --insecure for plain text)");
  }
  PemFiles pem;
  KV_ASSIGN_OR_RETURN(pem.cert, ReadFileToString(security.cert_file));
  KV_ASSIGN_OR_RETURN(pem.key, ReadFileToString(security.key_file));
  KV_ASSIGN_OR_RETURN(pem.ca, ReadFileToString(security.ca_file));
  return pem;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const SecurityOptions& security) {
  if (security.insecure) return grpc::InsecureServerCredentials();
  KV_ASSIGN_OR_RETURN(PemFiles pem, LoadPem(security));
  grpc::SslServerCredentialsOptions options(
      GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = pem.ca;
  options.pem_key_cert_pairs.push_back({pem.key, pem.cert});
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const SecurityOptions& security) {
  if (security.insecure) return grpc::InsecureChannelCredentials();
  KV_ASSIGN_OR_RETURN(PemFiles pem, LoadPem(security));
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = pem.ca;
  options.pem_private_key = pem.key;
  options.pem_cert_chain = pem.cert;
  return grpc::SslCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& address,
                                                           const SecurityOptions& security,
                                                           const ChannelOptions& options) {
  KV_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                      ChannelCredentialsFor(security));
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS,
              static_cast<int>(absl::ToInt64Milliseconds(options.keepalive_time)));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
              static_cast<int>(absl::ToInt64Milliseconds(options.keepalive_timeout)));
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // Reconnect quickly after a peer returns instead of backing off for up to two minutes.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  if (options.own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  return grpc::CreateCustomChannel(address, credentials, args);
}

}  // namespace kvrelay::server
