#include "gateway/gateway.h"

#include "gtest/gtest.h"

namespace kvrelay::gateway {
namespace {

// RFC 4231 test case 2: HMAC-SHA256(key "Jefe", "what do ya want for nothing?").
TEST(TenantSalt, IsHmacSha256OfTheTenant) {
  const std::string salt = DeriveTenantSalt("Jefe", "what do ya want for nothing?");
  ASSERT_EQ(salt.size(), 16u);
  const unsigned char expected[16] = {0x5b, 0xdc, 0xc1, 0x46, 0xbf, 0x60, 0x75, 0x4e,
                                      0x6a, 0x04, 0x24, 0x26, 0x08, 0x95, 0x75, 0xc7};
  EXPECT_EQ(salt, std::string(reinterpret_cast<const char*>(expected), 16));
}

TEST(TenantSalt, SeparatesTenantsAndSecrets) {
  EXPECT_EQ(DeriveTenantSalt("s", "alice"), DeriveTenantSalt("s", "alice"));
  EXPECT_NE(DeriveTenantSalt("s", "alice"), DeriveTenantSalt("s", "bob"));
  EXPECT_NE(DeriveTenantSalt("s1", "alice"), DeriveTenantSalt("s2", "alice"));
}

}  // namespace
}  // namespace kvrelay::gateway
