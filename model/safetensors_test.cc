#include "model/safetensors.h"

#include <fstream>
#include <string>
#include <vector>

#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/numeric.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::model {
namespace {

using ::kvrelay::testing::StatusIs;
using ::testing::HasSubstr;

std::vector<TensorToWrite> SampleTensors() {
  std::vector<TensorToWrite> t(3);
  t[0] = {"a.bf16", TensorDType::kBf16, {2, 3}, {1.0f, -2.5f, 3.140625f, 0.1f, 1e-3f, -7.0f}};
  t[1] = {"b.f16", TensorDType::kFp16, {4}, {0.5f, -1.25f, 65504.0f, 6e-8f}};
  t[2] = {"c.f32", TensorDType::kFp32, {1, 2}, {1.2345678f, -9.87654321f}};
  return t;
}

TEST(NumericTest, Bf16AndFp16RoundTripRepresentableValues) {
  for (float v : {0.0f, 1.0f, -2.0f, 0.5f, 3.140625f, -1024.0f}) {
    EXPECT_EQ(Bf16ToFloat(FloatToBf16(v)), v);
    EXPECT_EQ(Fp16ToFloat(FloatToFp16(v)), v);
  }
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(65504.0f)), 65504.0f);
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(5.9604645e-08f)), 5.9604645e-08f);  // smallest subnormal
  EXPECT_TRUE(std::isinf(Fp16ToFloat(FloatToFp16(1e6f))));
  // Round to nearest even: 1 + 2^-8 lies halfway between two bf16 values, goes to 1.
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
  // Relative error bounds for arbitrary values.
  for (float v : {0.1f, 1e-3f, 123.456f, -7.77f}) {
    EXPECT_NEAR(Bf16ToFloat(FloatToBf16(v)), v, std::abs(v) * (1.0f / 256));
    EXPECT_NEAR(Fp16ToFloat(FloatToFp16(v)), v, std::abs(v) * (1.0f / 2048));
  }
}

TEST(SafetensorsTest, RoundTripKeepsNamesShapesAndValues) {
  testing::TempDir dir;
  const std::vector<TensorToWrite> tensors = SampleTensors();
  KV_ASSERT_OK(WriteSafetensors(dir.File("x.safetensors"), tensors));
  KV_ASSERT_OK_AND_ASSIGN(auto file, SafetensorsFile::Open(dir.File("x.safetensors")));
  ASSERT_EQ(file->tensors().size(), 3u);
  EXPECT_EQ(file->metadata().at("format"), "pt");
  for (const TensorToWrite& t : tensors) {
    const TensorView* view = file->Find(t.name);
    ASSERT_NE(view, nullptr) << t.name;
    EXPECT_EQ(view->dtype, t.dtype);
    EXPECT_EQ(view->shape, t.shape);
    const std::vector<float> got = view->ToFloat();
    ASSERT_EQ(got.size(), t.values.size());
    for (size_t i = 0; i < got.size(); ++i) {
      float want = t.values[i];
      if (t.dtype == TensorDType::kBf16) want = Bf16ToFloat(FloatToBf16(want));
      if (t.dtype == TensorDType::kFp16) want = Fp16ToFloat(FloatToFp16(want));
      EXPECT_EQ(got[i], want) << t.name << "[" << i << "]";
    }
  }
}

TEST(SafetensorsTest, ZeroElementTensorConvertsToNothing) {
  // Found by safetensors_fuzzer under UBSan: a zero dimension means no bytes and a null data
  // pointer, which memcpy must not be given.
  for (TensorDType dtype : {TensorDType::kFp32, TensorDType::kBf16, TensorDType::kFp16}) {
    TensorView view;
    view.dtype = dtype;
    view.shape = {0, 99511627776, 16777216};
    EXPECT_EQ(view.num_elements(), 0);
    EXPECT_TRUE(view.ToFloat().empty());
  }
}

TEST(SafetensorsTest, ShardedModelOpensThroughIndex) {
  testing::TempDir dir;
  KV_ASSERT_OK(WriteSafetensorsModel(dir.path(), SampleTensors(), 2));
  KV_ASSERT_OK_AND_ASSIGN(auto model, SafetensorsModel::Open(dir.path()));
  EXPECT_EQ(model->num_files(), 2u);
  EXPECT_THAT(model->Names(), ::testing::ElementsAre("a.bf16", "b.f16", "c.f32"));
  ASSERT_NE(model->Find("c.f32"), nullptr);
  EXPECT_EQ(model->Find("c.f32")->ToFloat()[0], 1.2345678f);
}

TEST(SafetensorsTest, SingleFileModel) {
  testing::TempDir dir;
  KV_ASSERT_OK(WriteSafetensorsModel(dir.path(), SampleTensors(), 1));
  KV_ASSERT_OK_AND_ASSIGN(auto model, SafetensorsModel::Open(dir.path()));
  EXPECT_EQ(model->num_files(), 1u);
  EXPECT_EQ(model->Find("missing"), nullptr);
}

class BadFileTest : public ::testing::Test {
 protected:
  std::string Write(const std::string& bytes) {
    const std::string path = dir_.File("bad.safetensors");
    EXPECT_TRUE(WriteFileAtomically(path, bytes).ok());
    return path;
  }
  std::string Good() {
    absl::StatusOr<std::string> bytes = SerializeSafetensors(SampleTensors());
    EXPECT_TRUE(bytes.ok());
    return *bytes;
  }
  static std::string WithHeader(const std::string& header, size_t data_bytes) {
    std::string out(8, '\0');
    const uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return out + header + std::string(data_bytes, '\0');
  }
  testing::TempDir dir_;
};

TEST_F(BadFileTest, MissingFileIsNotFound) {
  EXPECT_THAT(SafetensorsFile::Open(dir_.File("nope.safetensors")),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(BadFileTest, ShorterThanLengthPrefix) {
  EXPECT_THAT(SafetensorsFile::Open(Write("abc")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("truncated")));
}

TEST_F(BadFileTest, TruncatedData) {
  const std::string good = Good();
  EXPECT_THAT(SafetensorsFile::Open(Write(good.substr(0, good.size() - 3))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("truncated")));
}

TEST_F(BadFileTest, TruncatedHeader) {
  const std::string good = Good();
  EXPECT_THAT(SafetensorsFile::Open(Write(good.substr(0, 20))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("truncated: header")));
}

TEST_F(BadFileTest, HugeHeaderLength) {
  std::string bytes(16, '\0');
  bytes[7] = 0x7f;
  EXPECT_THAT(SafetensorsFile::Open(Write(bytes)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceeds")));
}

TEST_F(BadFileTest, HeaderNotJson) {
  EXPECT_THAT(SafetensorsFile::Open(Write(WithHeader("{not json", 0))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a JSON object")));
}

TEST_F(BadFileTest, OffsetsDisagreeWithShape) {
  const std::string header = R"({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}})";
  EXPECT_THAT(
      SafetensorsFile::Open(Write(WithHeader(header, 16))),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("tensor w: data_offsets span 12 bytes but shape and dtype need 16")));
}

TEST_F(BadFileTest, UnknownDtypeNamed) {
  const std::string header = R"({"w": {"dtype": "I8", "shape": [4], "data_offsets": [0, 4]}})";
  EXPECT_THAT(SafetensorsFile::Open(Write(WithHeader(header, 4))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor w: dtype I8")));
}

// [2^40, 2^24] elements wrap to 0 in 64 bits; once that passed with data_offsets [0, 0].
TEST_F(BadFileTest, ShapeWhoseElementCountOverflowsIsRefused) {
  const std::string header =
      R"({"w": {"dtype": "F32", "shape": [1099511627776, 16777216], "data_offsets": [0, 0]}})";
  const std::string bytes = WithHeader(header, 0);
  EXPECT_THAT(SafetensorsFile::FromBytes(bytes, "overflow.safetensors"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shape too large")));
  EXPECT_THAT(SafetensorsFile::Open(Write(bytes)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shape too large")));
}

TEST_F(BadFileTest, OverlappingTensors) {
  const std::string header =
      R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})";
  EXPECT_THAT(SafetensorsFile::Open(Write(WithHeader(header, 12))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlap")));
}

TEST_F(BadFileTest, IndexNamingAbsentTensor) {
  KV_ASSERT_OK(WriteSafetensorsModel(dir_.path(), SampleTensors(), 2));
  KV_ASSERT_OK(
      WriteFileAtomically(dir_.File("model.safetensors.index.json"),
                          R"({"weight_map": {"ghost": "model-00001-of-00002.safetensors"}})"));
  EXPECT_THAT(SafetensorsModel::Open(dir_.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor ghost")));
}

TEST(SerializeTest, RejectsValueCountMismatch) {
  TensorToWrite t{"w", TensorDType::kFp32, {2, 2}, {1, 2, 3}};
  EXPECT_THAT(SerializeSafetensors({t}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor w")));
}

}  // namespace
}  // namespace kvrelay::model
