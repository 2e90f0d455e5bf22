#pragma once

// The model module's offline tool, a `kvrelay` subcommand (registered in cli/main.cc):
//   make-test-model  write a small random-weight model (config.json + safetensors) for tests
//                    and demos (model/test_model.h)
// Exit status: 0 written, 2 bad flags (one line naming the flag), 1 a write that failed.

#include <string>
#include <vector>

namespace kvrelay::model::tools {

// kvrelay make-test-model --arch llama|deepseek_v3|gemma3|gpt2|mamba [--layers N ...] --seed S
//   --out DIR
int RunMakeTestModelCommand(const std::vector<std::string>& args);

}  // namespace kvrelay::model::tools
