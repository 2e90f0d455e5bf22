#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/errno_status.h"
#include "common/file_util.h"
#include "common/scoped_fd.h"
#include "common/status_macros.h"
#include "model/numeric.h"

namespace kvrelay::model {
namespace {

using Json = nlohmann::json;

absl::StatusOr<TensorDType> ParseTensorDType(const std::string& name) {
  if (name == "BF16") return TensorDType::kBf16;
  if (name == "F16") return TensorDType::kFp16;
  if (name == "F32") return TensorDType::kFp32;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype ", name, " is not supported (supported: BF16, F16, F32)"));
}

absl::Status Bad(const std::string& path, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", std::string(what)));
}

}  // namespace

std::string_view TensorDTypeName(TensorDType dtype) {
  switch (dtype) {
    case TensorDType::kBf16:
      return "BF16";
    case TensorDType::kFp16:
      return "F16";
    case TensorDType::kFp32:
      return "F32";
  }
  return "?";
}

int32_t TensorDTypeBytes(TensorDType dtype) { return dtype == TensorDType::kFp32 ? 4 : 2; }

int64_t TensorView::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

void TensorView::ToFloat(float* out) const {
  const int64_t n = num_elements();
  // A tensor with a zero dimension has no bytes; `out` and `data` may then be null.
  if (n == 0) return;
  switch (dtype) {
    case TensorDType::kFp32:
      std::memcpy(out, data, static_cast<size_t>(n) * 4);
      break;
    case TensorDType::kBf16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, data + 2 * i, 2);
        out[i] = Bf16ToFloat(v);
      }
      break;
    case TensorDType::kFp16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, data + 2 * i, 2);
        out[i] = Fp16ToFloat(v);
      }
      break;
  }
}

std::vector<float> TensorView::ToFloat() const {
  std::vector<float> out(static_cast<size_t>(num_elements()));
  ToFloat(out.data());
  return out;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return ErrnoToStatus(errno, absl::StrCat("open ", path));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("fstat ", path));
  }
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes < 8) {
    return Bad(path, absl::StrCat("truncated: ", file_bytes,
                                  " bytes is shorter than the 8-byte header length"));
  }
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (map == MAP_FAILED) {
    return ErrnoToStatus(errno, absl::StrCat("mmap ", path));
  }
  file->mapping_ = map;
  file->mapping_bytes_ = file_bytes;
  KV_RETURN_IF_ERROR(file->Index(static_cast<const uint8_t*>(map), file_bytes));
  return file;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromBytes(
    std::string_view bytes, const std::string& name) {
  if (bytes.size() < 8) {
    return Bad(name, absl::StrCat("truncated: ", bytes.size(),
                                  " bytes is shorter than the 8-byte header length"));
  }
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = name;
  KV_RETURN_IF_ERROR(file->Index(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
  return file;
}

absl::Status SafetensorsFile::Index(const uint8_t* base, uint64_t file_bytes) {
  const std::string& path = path_;
  SafetensorsFile* file = this;
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | base[i];
  if (header_bytes > kMaxSafetensorsHeaderBytes) {
    return Bad(path, absl::StrCat("header length ", header_bytes, " exceeds the limit of ",
                                  kMaxSafetensorsHeaderBytes, " bytes"));
  }
  if (header_bytes > file_bytes - 8) {
    return Bad(path, absl::StrCat("truncated: header length ", header_bytes, " but only ",
                                  file_bytes - 8, " bytes follow"));
  }
  const char* header_begin = reinterpret_cast<const char*>(base + 8);
  Json header = Json::parse(header_begin, header_begin + header_bytes, nullptr, false);
  if (header.is_discarded() || !header.is_object()) {
    return Bad(path, "header is not a JSON object");
  }
  const uint8_t* data = base + 8 + header_bytes;
  const uint64_t data_bytes = file_bytes - 8 - header_bytes;

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const Json& entry = it.value();
    if (name == "__metadata__") {
      if (!entry.is_object()) return Bad(path, "__metadata__ must be an object");
      for (auto m = entry.begin(); m != entry.end(); ++m) {
        if (!m.value().is_string()) {
          return Bad(path, absl::StrCat("__metadata__.", m.key(), " must be a string"));
        }
        file->metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = absl::StrCat("tensor ", name);
    if (!entry.is_object()) return Bad(path, absl::StrCat(where, ": entry must be an object"));
    auto dtype_it = entry.find("dtype");
    auto shape_it = entry.find("shape");
    auto offsets_it = entry.find("data_offsets");
    if (dtype_it == entry.end() || !dtype_it->is_string()) {
      return Bad(path, absl::StrCat(where, ": dtype missing or not a string"));
    }
    if (shape_it == entry.end() || !shape_it->is_array()) {
      return Bad(path, absl::StrCat(where, ": shape missing or not a list"));
    }
    if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2 ||
        !(*offsets_it)[0].is_number_unsigned() || !(*offsets_it)[1].is_number_unsigned()) {
      return Bad(path, absl::StrCat(where, ": data_offsets must be [begin, end]"));
    }
    TensorView view;
    view.name = name;
    absl::StatusOr<TensorDType> dtype = ParseTensorDType(dtype_it->get<std::string>());
    if (!dtype.ok()) return Bad(path, absl::StrCat(where, ": ", dtype.status().message()));
    view.dtype = *dtype;
    uint64_t elements = 1;
    for (const Json& d : *shape_it) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > (1ull << 40)) {
        return Bad(path, absl::StrCat(where, ": shape entry ", d.dump(), " is not a valid size"));
      }
      const uint64_t dim = d.get<uint64_t>();
      view.shape.push_back(static_cast<int64_t>(dim));
      // Checked before multiplying: [2^40, 2^40] would wrap to 0 elements and pass.
      if (dim != 0 && elements > (1ull << 40) / dim) {
        return Bad(path, absl::StrCat(where, ": shape too large"));
      }
      elements *= dim;
    }
    const uint64_t begin = (*offsets_it)[0].get<uint64_t>();
    const uint64_t end = (*offsets_it)[1].get<uint64_t>();
    if (end < begin) return Bad(path, absl::StrCat(where, ": data_offsets end < begin"));
    const uint64_t expected = elements * static_cast<uint64_t>(TensorDTypeBytes(view.dtype));
    if (end - begin != expected) {
      return Bad(path, absl::StrCat(where, ": data_offsets span ", end - begin,
                                    " bytes but shape and dtype need ", expected));
    }
    if (end > data_bytes) {
      return Bad(path, absl::StrCat("truncated: ", where, " ends at data byte ", end,
                                    " but the data section holds ", data_bytes, " bytes"));
    }
    view.data = data + begin;
    view.size_bytes = static_cast<size_t>(expected);
    file->tensors_.emplace(name, std::move(view));
  }
  // Ranges must not overlap (the format requires a packed, non-overlapping buffer).
  std::vector<std::pair<const uint8_t*, size_t>> ranges;
  for (const auto& [name, view] : file->tensors_) ranges.emplace_back(view.data, view.size_bytes);
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i - 1].first + ranges[i - 1].second > ranges[i].first) {
      return Bad(path, "tensor byte ranges overlap");
    }
  }
  return absl::OkStatus();
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_bytes_);
}

const TensorView* SafetensorsFile::Find(std::string_view name) const {
  auto it = tensors_.find(std::string(name));
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::StatusOr<std::unique_ptr<SafetensorsModel>> SafetensorsModel::Open(const std::string& dir) {
  auto model = std::make_unique<SafetensorsModel>();
  const std::string index_path = dir + "/model.safetensors.index.json";
  absl::StatusOr<std::string> index_text = ReadFileToString(index_path);
  if (index_text.ok()) {
    Json index = Json::parse(*index_text, nullptr, false);
    if (index.is_discarded() || !index.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": not a JSON object"));
    }
    auto map_it = index.find("weight_map");
    if (map_it == index.end() || !map_it->is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": weight_map missing"));
    }
    std::map<std::string, std::vector<std::string>> by_file;
    for (auto it = map_it->begin(); it != map_it->end(); ++it) {
      if (!it.value().is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path, ": weight_map.", it.key(), " must be a file name"));
      }
      const std::string file = it.value().get<std::string>();
      if (file.empty() || file.find('/') != std::string::npos || file[0] == '.') {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path, ": weight_map.", it.key(), " names a bad file '", file, "'"));
      }
      by_file[file].push_back(it.key());
    }
    for (const auto& [file_name, names] : by_file) {
      KV_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                          SafetensorsFile::Open(dir + "/" + file_name));
      for (const std::string& name : names) {
        if (file->Find(name) == nullptr) {
          return absl::InvalidArgumentError(absl::StrCat(
              index_path, ": tensor ", name, " is mapped to ", file_name, " which lacks it"));
        }
      }
      model->files_.push_back(std::move(file));
    }
  } else if (absl::IsNotFound(index_text.status())) {
    KV_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                        SafetensorsFile::Open(dir + "/model.safetensors"));
    model->files_.push_back(std::move(file));
  } else {
    return index_text.status();
  }
  for (const auto& file : model->files_) {
    for (const auto& [name, view] : file->tensors()) {
      if (!model->index_.emplace(name, &view).second) {
        return absl::InvalidArgumentError(
            absl::StrCat(dir, ": tensor ", name, " appears in more than one shard"));
      }
    }
  }
  return model;
}

const TensorView* SafetensorsModel::Find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second;
}

std::vector<std::string> SafetensorsModel::Names() const {
  std::vector<std::string> names;
  for (const auto& [name, view] : index_) names.push_back(name);
  return names;
}

absl::StatusOr<std::string> SerializeSafetensors(
    absl::Span<const TensorToWrite> tensors, const std::map<std::string, std::string>& metadata) {
  std::vector<const TensorToWrite*> sorted;
  for (const TensorToWrite& t : tensors) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(),
            [](const TensorToWrite* a, const TensorToWrite* b) { return a->name < b->name; });
  Json header = Json::object();
  uint64_t offset = 0;
  for (size_t i = 0; i < sorted.size(); ++i) {
    const TensorToWrite& t = *sorted[i];
    if (i > 0 && sorted[i - 1]->name == t.name) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name, " given twice"));
    }
    if (t.name.empty() || t.name == "__metadata__") {
      return absl::InvalidArgumentError(absl::StrCat("bad tensor name '", t.name, "'"));
    }
    uint64_t elements = 1;
    for (int64_t d : t.shape) {
      if (d < 0) return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name, ": bad shape"));
      elements *= static_cast<uint64_t>(d);
    }
    if (elements != t.values.size()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name, ": shape holds ", elements,
                                                     " values, got ", t.values.size()));
    }
    const uint64_t bytes = elements * TensorDTypeBytes(t.dtype);
    header[t.name] = {{"dtype", std::string(TensorDTypeName(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string header_text = header.dump();
  while (header_text.size() % 8 != 0) header_text.push_back(' ');
  std::string out;
  out.reserve(8 + header_text.size() + offset);
  uint64_t n = header_text.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += header_text;
  for (const TensorToWrite* t : sorted) {
    const size_t start = out.size();
    out.resize(start + t->values.size() * TensorDTypeBytes(t->dtype));
    char* dst = out.data() + start;
    for (size_t i = 0; i < t->values.size(); ++i) {
      switch (t->dtype) {
        case TensorDType::kFp32:
          std::memcpy(dst + 4 * i, &t->values[i], 4);
          break;
        case TensorDType::kBf16: {
          const uint16_t v = FloatToBf16(t->values[i]);
          std::memcpy(dst + 2 * i, &v, 2);
          break;
        }
        case TensorDType::kFp16: {
          const uint16_t v = FloatToFp16(t->values[i]);
          std::memcpy(dst + 2 * i, &v, 2);
          break;
        }
      }
    }
  }
  return out;
}

absl::Status WriteSafetensors(const std::string& path, absl::Span<const TensorToWrite> tensors) {
  KV_ASSIGN_OR_RETURN(std::string bytes, SerializeSafetensors(tensors, {{"format", "pt"}}));
  return WriteFileAtomically(path, bytes);
}

absl::Status WriteSafetensorsModel(const std::string& dir, absl::Span<const TensorToWrite> tensors,
                                   int num_shards) {
  if (num_shards < 1 || num_shards > 99999) {
    return absl::InvalidArgumentError(
        absl::StrCat("shards must be in [1, 99999], got ", num_shards));
  }
  KV_RETURN_IF_ERROR(MakeDirectories(dir));
  if (num_shards == 1) return WriteSafetensors(dir + "/model.safetensors", tensors);
  // Round-robin by position so every shard gets a share; the index maps names to files.
  std::vector<std::vector<TensorToWrite>> shards(num_shards);
  Json weight_map = Json::object();
  uint64_t total_bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int s = static_cast<int>(i % num_shards);
    const std::string file = absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, num_shards);
    weight_map[tensors[i].name] = file;
    total_bytes += tensors[i].values.size() * TensorDTypeBytes(tensors[i].dtype);
    shards[s].push_back(tensors[i]);
  }
  for (int s = 0; s < num_shards; ++s) {
    KV_RETURN_IF_ERROR(WriteSafetensors(
        dir + "/" + absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, num_shards),
        shards[s]));
  }
  Json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
  return WriteFileAtomically(dir + "/model.safetensors.index.json", index.dump(2));
}

}  // namespace kvrelay::model
