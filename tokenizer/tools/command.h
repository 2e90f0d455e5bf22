#pragma once

#include <string>
#include <vector>

namespace kvrelay::tokenizer::tools {

// `kvrelay tokenize --tokenizer PATH (--text T | --ids 1,2,3 | --user T [--system T])`:
// prints the ids of a text (or chat prompt), or the text of ids, as one JSON object.
int RunTokenizeCommand(const std::vector<std::string>& args);

}  // namespace kvrelay::tokenizer::tools
