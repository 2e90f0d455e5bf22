#include "common/server/auth.h"

#include "common/server/dev_certs.h"
#include "common/server/service_host.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "kvrelay/v1/cachestore.grpc.pb.h"
#include "kvrelay/v1/decode.grpc.pb.h"
#include "kvrelay/v1/gateway.grpc.pb.h"
#include "kvrelay/v1/prefill.grpc.pb.h"
#include "kvrelay/v1/replication.grpc.pb.h"
#include "proto/grpc_status.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::server {
namespace {

using ::kvrelay::testing::StatusIs;
using ::testing::HasSubstr;

TEST(Auth, EveryKvrelayMethodIsInTheTable) {
  // One message of each service's file, so its descriptor is linked and found.
  const google::protobuf::FileDescriptor* files[] = {
      kvrelay::v1::RegisterNodeRequest::descriptor()->file(),
      kvrelay::v1::PrefillRequest::descriptor()->file(),
      kvrelay::v1::ReserveRequest::descriptor()->file(),
      kvrelay::v1::GenerateRequest::descriptor()->file(),
      kvrelay::v1::FollowRequest::descriptor()->file()};
  size_t methods = 0;
  for (const google::protobuf::FileDescriptor* file : files) {
    ASSERT_GE(file->service_count(), 1) << file->name();
    for (int s = 0; s < file->service_count(); ++s) {
      const google::protobuf::ServiceDescriptor* service = file->service(s);
      for (int i = 0; i < service->method_count(); ++i) {
        const std::string method =
            absl::StrCat("/", service->full_name(), "/", service->method(i)->name());
        EXPECT_NE(FindRule(method), nullptr) << method << " has no authorization rule";
        ++methods;
      }
    }
  }
  EXPECT_EQ(methods, AuthorizationTable().size()) << "the table names a method that is gone";
}

TEST(Auth, ParsesSpiffeIdentities) {
  KV_ASSERT_OK_AND_ASSIGN(Peer peer, ParseSpiffeUri("spiffe://kvrelay/decode/decode-0"));
  EXPECT_TRUE(peer.authenticated);
  EXPECT_EQ(peer.role, PeerRole::kDecode);
  EXPECT_EQ(peer.id, "decode-0");
  EXPECT_EQ(SpiffeUri(PeerRole::kClient, "alice"), "spiffe://kvrelay/client/alice");
  for (const char* bad : {"spiffe://other/decode/x", "spiffe://kvrelay/root/x",
                          "spiffe://kvrelay/decode/", "spiffe://kvrelay/decode", "",
                          "spiffe://kvrelay/client/a/b", "spiffe://kvrelay/client/a b"}) {
    EXPECT_THAT(ParseSpiffeUri(bad), StatusIs(absl::StatusCode::kInvalidArgument)) << bad;
  }
}

// A Prefill service whose Status answers with the caller's identity as the authorizer saw it.
class WhoAmI final : public kvrelay::v1::Prefill::Service {
 public:
  explicit WhoAmI(Authorizer authorizer) : authorizer_(authorizer) {}
  grpc::Status Status(grpc::ServerContext* context, const kvrelay::v1::PrefillStatusRequest*,
                      kvrelay::v1::PrefillStatusResponse* response) override {
    absl::StatusOr<Peer> peer = authorizer_.Authorize(*context, "/kvrelay.v1.Prefill/Status");
    if (!peer.ok()) return proto::ToGrpcStatus(peer.status());
    response->set_node_id(absl::StrCat(RoleName(peer->role), "/", peer->id));
    return grpc::Status::OK;
  }

 private:
  const Authorizer authorizer_;
};

class AuthOverTls : public ::testing::Test {
 protected:
  void SetUp() override {
    KV_ASSERT_OK_AND_ASSIGN(ca_, DevCertificateAuthority::Create(dir_.path()));
    KV_ASSERT_OK_AND_ASSIGN(server_security_, ca_->Issue(PeerRole::kPrefill, "prefill-0"));
    ServiceHostOptions options;
    options.name = "test";
    options.security = server_security_;
    KV_ASSERT_OK_AND_ASSIGN(host_, ServiceHost::Start(options, {&service_}, &metrics_));
  }

  grpc::Status CallStatus(const SecurityOptions& security, std::string* who) {
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
        MakeChannel(host_->address(), security);
    EXPECT_TRUE(channel.ok()) << channel.status();
    auto stub = kvrelay::v1::Prefill::NewStub(*channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    kvrelay::v1::PrefillStatusResponse response;
    grpc::Status status = stub->Status(&context, {}, &response);
    *who = response.node_id();
    return status;
  }

  testing::TempDir dir_;
  std::unique_ptr<DevCertificateAuthority> ca_;
  SecurityOptions server_security_;
  MetricsRegistry metrics_;
  WhoAmI service_{Authorizer(SecurityOptions{.insecure = false})};
  std::unique_ptr<ServiceHost> host_;
};

TEST_F(AuthOverTls, RoleAndIdComeFromTheClientCertificate) {
  KV_ASSERT_OK_AND_ASSIGN(SecurityOptions gateway, ca_->Issue(PeerRole::kGateway, "gw-1"));
  std::string who;
  grpc::Status status = CallStatus(gateway, &who);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(who, "gateway/gw-1");
  KV_ASSERT_OK_AND_ASSIGN(Peer own, IdentityOfCertificateFile(gateway.cert_file));
  EXPECT_EQ(own.role, PeerRole::kGateway);
  EXPECT_EQ(own.id, "gw-1");
}

TEST_F(AuthOverTls, WrongRoleIsPermissionDeniedWithErrorInfo) {
  KV_ASSERT_OK_AND_ASSIGN(SecurityOptions decode, ca_->Issue(PeerRole::kDecode, "decode-0"));
  std::string who;
  grpc::Status status = CallStatus(decode, &who);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(status.error_message(), HasSubstr("not decode 'decode-0'"));
  std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(proto::FromGrpcStatus(status));
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->role(), kvrelay::v1::ROLE_CLIENT);
  EXPECT_EQ(info->reason(), kvrelay::v1::FAILURE_UNAUTHORIZED);
}

TEST_F(AuthOverTls, ClientsWithoutACertificateOrFromAnotherCaCannotConnect) {
  std::string who;
  grpc::Status plain = CallStatus(SecurityOptions{}, &who);
  EXPECT_EQ(plain.error_code(), grpc::StatusCode::UNAVAILABLE) << plain.error_message();

  testing::TempDir other_dir;
  KV_ASSERT_OK_AND_ASSIGN(auto other_ca, DevCertificateAuthority::Create(other_dir.path()));
  KV_ASSERT_OK_AND_ASSIGN(SecurityOptions forged, other_ca->Issue(PeerRole::kGateway, "gw-1"));
  forged.ca_file = ca_->ca_file();  // trusts the server, but the server does not trust it
  grpc::Status rejected = CallStatus(forged, &who);
  EXPECT_EQ(rejected.error_code(), grpc::StatusCode::UNAVAILABLE) << rejected.error_message();
  EXPECT_EQ(who, "");
}

TEST(Auth, NodeScopedMethodsNeedTheCallersOwnId) {
  const MethodRule* commit = FindRule("/kvrelay.v1.CacheStore/Commit");
  ASSERT_NE(commit, nullptr);
  EXPECT_TRUE(commit->node_scoped);
  EXPECT_TRUE(commit->roles.Contains(PeerRole::kPrefill));
  EXPECT_FALSE(commit->roles.Contains(PeerRole::kGateway));
  EXPECT_FALSE(commit->roles.Contains(PeerRole::kClient));
  const MethodRule* reserve = FindRule("/kvrelay.v1.Decode/Reserve");
  ASSERT_NE(reserve, nullptr);
  EXPECT_EQ(reserve->roles.ToString(), "gateway");
  EXPECT_EQ(FindRule("/kvrelay.v1.Decode/Unknown"), nullptr);
}

}  // namespace
}  // namespace kvrelay::server
