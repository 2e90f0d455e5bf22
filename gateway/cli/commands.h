#pragma once

// Entry points of the kvrelay subcommands. Each returns the process exit code: 0 on success,
// 1 on a runtime failure, 2 on bad usage (with a one-line message on stderr).

#include <string>
#include <vector>

namespace kvrelay::cli {

int RunCacheStoreCommand(const std::vector<std::string>& args);  // cachestore/server
int RunDecodeCommand(const std::vector<std::string>& args);  // decode/
int RunGatewayCommand(const std::vector<std::string>& args);  // gateway/
int RunGenerateCommand(const std::vector<std::string>& args);  // gateway/cli
int RunPrefillCommand(const std::vector<std::string>& args);  // prefill/
int RunLayoutCommand(const std::vector<std::string>& args);
int RunUpCommand(const std::vector<std::string>& args);  // gateway/cli
int RunTransferBenchCommand(const std::vector<std::string>& args);  // transfer/ucx
// model/test_model.cc
int RunMakeTestModelCommand(const std::vector<std::string>& args);

}  // namespace kvrelay::cli
