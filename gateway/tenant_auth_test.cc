#include "gateway/tenant_auth.h"

#include "absl/strings/escaping.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::gateway {
namespace {

using ::kvrelay::testing::StatusIs;

MATCHER_P(IsOkAndHolds, value, "is OK and holds " + ::testing::PrintToString(value)) {
  if (!arg.ok()) {
    *result_listener << "status " << arg.status();
    return false;
  }
  return *arg == value;
}

const std::string kKey = "0123456789abcdef-key-one";
const absl::Time kNow = absl::FromUnixSeconds(1'800'000'000);

TEST(TenantToken, SignedTokenNamesItsTenantUntilItExpires) {
  TenantTokenVerifier verifier({"another-key-of-16+", kKey});  // rotation: any key verifies
  const std::string token = TenantTokenVerifier::Sign(kKey, "alice", kNow + absl::Minutes(5));
  KV_ASSERT_OK_AND_ASSIGN(std::string tenant, verifier.Verify(token, kNow));
  EXPECT_EQ(tenant, "alice");
  EXPECT_THAT(verifier.Verify(token, kNow + absl::Minutes(5)),
              StatusIs(absl::StatusCode::kUnauthenticated));
}

TEST(TenantToken, ForgedOrTamperedTokensAreRefused) {
  TenantTokenVerifier verifier({kKey});
  const std::string forged =
      TenantTokenVerifier::Sign("attacker-key-0123456", "alice", kNow + absl::Hours(1));
  EXPECT_THAT(verifier.Verify(forged, kNow), StatusIs(absl::StatusCode::kUnauthenticated));
  // Same signature, claims swapped for another tenant's.
  const std::string good = TenantTokenVerifier::Sign(kKey, "bob", kNow + absl::Hours(1));
  const std::string other = TenantTokenVerifier::Sign(kKey, "alice", kNow + absl::Hours(1));
  const size_t claims = other.find('.');
  const std::string spliced = good.substr(0, good.find('.')) +
                              other.substr(claims, other.rfind('.') - claims) +
                              good.substr(good.rfind('.'));
  EXPECT_THAT(verifier.Verify(spliced, kNow), StatusIs(absl::StatusCode::kUnauthenticated));
  // alg "none" with no signature.
  const std::string none = absl::WebSafeBase64Escape(R"({"alg":"none"})") + "." +
                           absl::WebSafeBase64Escape(R"({"sub":"alice","exp":9999999999})") + ".";
  EXPECT_THAT(verifier.Verify(none, kNow), StatusIs(absl::StatusCode::kUnauthenticated));
  for (const char* bad : {"", "a.b", "a.b.c.d", "!!!.???.***"}) {
    EXPECT_THAT(verifier.Verify(bad, kNow), StatusIs(absl::StatusCode::kUnauthenticated)) << bad;
  }
}

TEST(ResolveTenant, CredentialDecidesNeverTheRequestField) {
  TenantTokenVerifier verifier({kKey});
  const server::Peer alice_cert{
      .authenticated = true, .role = server::PeerRole::kClient, .id = "alice"};
  const server::Peer admin{.authenticated = true, .role = server::PeerRole::kAdmin, .id = "ops"};
  const std::string bob_token =
      "Bearer " + TenantTokenVerifier::Sign(kKey, "bob", kNow + absl::Hours(1));

  EXPECT_THAT(ResolveTenant(alice_cert, true, "", "", &verifier, kNow), IsOkAndHolds("alice"));
  EXPECT_THAT(ResolveTenant(alice_cert, true, "", "alice", &verifier, kNow), IsOkAndHolds("alice"));
  EXPECT_THAT(ResolveTenant(alice_cert, true, "", "bob", &verifier, kNow),
              StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(ResolveTenant(admin, true, bob_token, "", &verifier, kNow), IsOkAndHolds("bob"));
  EXPECT_THAT(ResolveTenant(admin, true, "", "bob", &verifier, kNow),
              StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_THAT(ResolveTenant(admin, true, bob_token, "", nullptr, kNow),
              StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_THAT(ResolveTenant(admin, true, "Basic abc", "", &verifier, kNow),
              StatusIs(absl::StatusCode::kUnauthenticated));
  // --insecure: the field as sent (the development mode every other test uses).
  EXPECT_THAT(ResolveTenant(server::Peer{}, false, "", "carol", nullptr, kNow),
              IsOkAndHolds("carol"));
}

}  // namespace
}  // namespace kvrelay::gateway
