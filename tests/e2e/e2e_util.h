#pragma once

// Shared pieces of the end-to-end tests: test models, prompts, concurrent gateway calls and the
// co-located reference.

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cli/colocated.h"
#include "gateway/client/gateway_client.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "kvrelay/v1/cachestore.grpc.pb.h"
#include "model/test_model.h"

namespace kvrelay::e2e {

// `n` token ids in [0, 512) (the tiny models' vocabulary), reproducible per seed.
inline std::vector<int32_t> RandomPrompt(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, 511);
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  for (int32_t& t : tokens) t = dist(rng);
  return tokens;
}

inline absl::Status WriteModel(const std::string& dir, const std::string& arch) {
  model::TestModelOptions options;
  options.arch = arch;
  options.seed = 11;
  return model::WriteTestModel(dir, options);
}

// Runs every request on its own thread against the gateway; results in request order.
inline std::vector<absl::StatusOr<cli::GenerationResult>> GenerateConcurrently(
    const std::string& gateway,
    const std::vector<::kvrelay::gateway::client::GatewayRequest>& requests,
    absl::Duration timeout) {
  ::kvrelay::gateway::client::GatewayClient client(gateway);
  std::vector<absl::StatusOr<cli::GenerationResult>> results(requests.size(),
                                                             absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < requests.size(); ++i) {
    threads.emplace_back([&, i] { results[i] = client.Generate(requests[i], timeout); });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

inline absl::StatusOr<v1::StatsResponse> CacheStoreStats(const std::string& address) {
  auto stub =
      v1::CacheStore::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  v1::StatsResponse response;
  grpc::Status s = stub->Stats(&context, v1::StatsRequest(), &response);
  if (!s.ok()) return absl::UnavailableError(absl::StrCat("Stats: ", s.error_message()));
  return response;
}

}  // namespace kvrelay::e2e
