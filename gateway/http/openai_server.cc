#include "gateway/http/openai_server.h"

#include <httplib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <memory>
#include <optional>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "nlohmann/json.hpp"
#include "proto/grpc_status.h"
#include "proto/limits.h"
#include "tokenizer/byte_tokenizer.h"

namespace kvrelay::gateway {
namespace {

using Json = nlohmann::json;

constexpr int kMaxStops = 4;
constexpr size_t kMaxStopBytes = 256;

// Best-effort text of generated ids: ids without text in this tokenizer (a random-weight demo
// model's upper half, padding rows of an embedding) are left out; special tokens too, as
// OpenAI-compatible servers do by default.
std::string DecodeGenerated(const tokenizer::Tokenizer& tokenizer,
                            absl::Span<const int32_t> tokens) {
  std::vector<int32_t> known;
  known.reserve(tokens.size());
  for (int32_t t : tokens) {
    if (t >= 0 && t < tokenizer.vocab_size()) known.push_back(t);
  }
  absl::StatusOr<std::string> text = tokenizer.Decode(known, {.skip_special_tokens = true});
  return text.ok() ? *std::move(text) : std::string();
}

// An OpenAI-shaped error.
struct HttpError {
  int status = 400;
  std::string type = "invalid_request_error";
  std::string message;
  std::string param;  // the offending field, when one is
  std::string code;
  int64_t retry_after_s = 0;  // 429: the Retry-After header (whole seconds, >= 1)
};

HttpError FromStatus(const absl::Status& s) {
  HttpError e;
  e.message = std::string(s.message());
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      e.status = 400;
      break;
    case absl::StatusCode::kUnauthenticated:
      e.status = 401;
      e.type = "authentication_error";
      break;
    case absl::StatusCode::kPermissionDenied:
      e.status = 403;
      e.type = "permission_error";
      break;
    case absl::StatusCode::kNotFound:
      e.status = 404;
      e.type = "not_found_error";
      break;
    case absl::StatusCode::kResourceExhausted: {
      e.status = 429;
      // A quota of the caller's own is a rate limit; a full tier is overload. Either way the
      // client may come back: after the predicted wait when the refusal carries one, else 1 s.
      std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(s);
      const bool quota = info.has_value() && info->role() == kvrelay::v1::ROLE_CLIENT;
      e.type = quota ? "rate_limit_error" : "overloaded_error";
      e.code = quota ? "rate_limit_exceeded" : "overloaded";
      const int64_t wait_ms = info.has_value() ? info->retry_after_ms() : 0;
      e.retry_after_s = std::max<int64_t>(1, (wait_ms + 999) / 1000);
      break;
    }
    case absl::StatusCode::kUnavailable:
      e.status = 503;
      e.type = "service_unavailable";
      break;
    case absl::StatusCode::kDeadlineExceeded:
      e.status = 504;
      e.type = "timeout";
      break;
    default:
      e.status = 500;
      e.type = "server_error";
  }
  // Gateway validation messages start with the field name ("tokens: ...", "max_tokens must").
  if (e.status == 400) {
    const std::string_view m = e.message;
    for (const char* field : {"max_tokens", "temperature", "top_p", "tokens", "model"}) {
      if (m.rfind(field, 0) == 0 || m.find(std::string("sampling.") + field) == 0) {
        e.param = std::string(field) == "tokens" ? "prompt" : field;
      }
    }
  }
  return e;
}

std::string ErrorBody(const HttpError& e) {
  Json j;
  j["error"]["message"] = e.message;
  j["error"]["type"] = e.type;
  j["error"]["param"] = e.param.empty() ? Json(nullptr) : Json(e.param);
  j["error"]["code"] = e.code.empty() ? Json(nullptr) : Json(e.code);
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

void SendError(httplib::Response& res, const HttpError& e) {
  res.status = e.status;
  if (e.retry_after_s > 0) res.set_header("Retry-After", absl::StrCat(e.retry_after_s));
  res.set_content(ErrorBody(e), "application/json");
}

HttpError Bad(std::string param, std::string message) {
  HttpError e;
  e.param = std::move(param);
  e.message = std::move(message);
  return e;
}

struct Parsed {
  bool chat = false;
  std::vector<int32_t> prompt;
  int32_t max_tokens = 16;
  float temperature = 1.0f;
  float top_p = 1.0f;
  uint64_t seed = 0;
  std::vector<std::string> stops;
  bool stream = false;
  bool include_usage = false;
};

// Reads an optional number field; false (with `error`) when present but not a number in range.
bool ReadNumber(const Json& body, const char* field, double lo, double hi, double* out,
                HttpError* error) {
  auto it = body.find(field);
  if (it == body.end() || it->is_null()) return true;
  if (!it->is_number()) {
    *error = Bad(field, absl::StrCat(field, " must be a number"));
    return false;
  }
  const double v = it->get<double>();
  if (!(v >= lo && v <= hi)) {
    *error = Bad(field, absl::StrCat(field, " must be in [", lo, ", ", hi, "], got ", v));
    return false;
  }
  *out = v;
  return true;
}

// The served model must be the one named; a 404 as OpenAI answers for an unknown model.
std::optional<HttpError> CheckModel(const Json& body, const OpenAiHttpOptions& options) {
  auto model = body.find("model");
  if (model == body.end() || !model->is_string()) {
    return Bad("model", "model is required and must be a string");
  }
  if (model->get<std::string>() != options.model_name) {
    HttpError e;
    e.status = 404;
    e.type = "invalid_request_error";
    e.param = "model";
    e.code = "model_not_found";
    e.message = absl::StrCat("The model '", model->get<std::string>(),
                             "' does not exist; this server serves '", options.model_name, "'");
    return e;
  }
  return std::nullopt;
}

// One chat message's text: a string, or an array of text parts.
std::optional<HttpError> ReadMessage(const Json& m, const std::string& where,
                                     tokenizer::ChatMessage* out) {
  if (!m.is_object()) return Bad(where, absl::StrCat(where, " must be an object"));
  auto role = m.find("role");
  auto content = m.find("content");
  if (role == m.end() || !role->is_string()) {
    return Bad(where + ".role", absl::StrCat(where, ".role must be a string"));
  }
  const std::string r = role->get<std::string>();
  if (r != "system" && r != "user" && r != "assistant" && r != "developer" && r != "tool") {
    return Bad(where + ".role", absl::StrCat(where, ".role '", r, "' is not a known role"));
  }
  std::string text;
  if (content != m.end() && content->is_string()) {
    text = content->get<std::string>();
  } else if (content != m.end() && content->is_array()) {
    for (const Json& part : *content) {
      if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
          !part["text"].is_string()) {
        return Bad(where + ".content", "only text content parts are supported");
      }
      text += part["text"].get<std::string>();
    }
  } else {
    return Bad(where + ".content", absl::StrCat(where, ".content must be a string"));
  }
  *out = {r, std::move(text)};
  return std::nullopt;
}

// /v1/chat/completions: the messages through the model's chat template.
std::optional<HttpError> ParseChatPrompt(const Json& body, const tokenizer::Tokenizer& tokenizer,
                                         std::vector<int32_t>* prompt) {
  auto messages = body.find("messages");
  if (messages == body.end() || !messages->is_array() || messages->empty()) {
    return Bad("messages", "messages must be a non-empty array");
  }
  std::vector<tokenizer::ChatMessage> turns(messages->size());
  for (size_t i = 0; i < messages->size(); ++i) {
    if (std::optional<HttpError> e =
            ReadMessage((*messages)[i], absl::StrCat("messages[", i, "]"), &turns[i])) {
      return e;
    }
  }
  absl::StatusOr<std::string> text = tokenizer.ApplyChatTemplate(turns, true);
  if (!text.ok()) return Bad("messages", std::string(text.status().message()));
  // The template already holds whatever BOS the model wants.
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer.Encode(*text, {.add_special_tokens = false});
  if (!ids.ok()) return Bad("messages", std::string(ids.status().message()));
  *prompt = *std::move(ids);
  return std::nullopt;
}

// /v1/completions: the prompt as text or as token ids (one prompt).
std::optional<HttpError> ParseCompletionPrompt(const Json& body,
                                               const tokenizer::Tokenizer& tokenizer,
                                               std::vector<int32_t>* out) {
  auto prompt = body.find("prompt");
  if (prompt == body.end()) return Bad("prompt", "prompt is required");
  if (prompt->is_string()) {
    absl::StatusOr<std::vector<int32_t>> ids = tokenizer.Encode(prompt->get<std::string>());
    if (!ids.ok()) return Bad("prompt", std::string(ids.status().message()));
    *out = *std::move(ids);
  } else if (prompt->is_array() && !prompt->empty() && (*prompt)[0].is_number_integer()) {
    for (const Json& t : *prompt) {
      if (!t.is_number_integer()) return Bad("prompt", "prompt token ids must be integers");
      const int64_t id = t.get<int64_t>();
      if (id < 0 || id > INT32_MAX)
        return Bad("prompt", absl::StrCat("token id ", id, " is out of range"));
      out->push_back(static_cast<int32_t>(id));
    }
  } else {
    return Bad("prompt", "prompt must be a string or an array of token ids (one prompt)");
  }
  return std::nullopt;
}

// max_tokens (or max_completion_tokens), temperature, top_p, seed.
std::optional<HttpError> ParseSampling(const Json& body, Parsed* out) {
  HttpError error;
  double v = out->max_tokens;
  const char* max_field =
      body.contains("max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  if (!ReadNumber(body, max_field, 1, limits::kMaxGenerateTokens, &v, &error)) return error;
  if (v != static_cast<int32_t>(v))
    return Bad(max_field, absl::StrCat(max_field, " must be an integer"));
  out->max_tokens = static_cast<int32_t>(v);
  v = out->temperature;
  if (!ReadNumber(body, "temperature", 0, 2, &v, &error)) return error;
  out->temperature = static_cast<float>(v);
  v = out->top_p;
  if (!ReadNumber(body, "top_p", 0, 1, &v, &error)) return error;
  if (v <= 0) return Bad("top_p", "top_p must be in (0, 1]");
  out->top_p = static_cast<float>(v);
  if (auto seed = body.find("seed"); seed != body.end() && !seed->is_null()) {
    if (!seed->is_number_integer()) return Bad("seed", "seed must be an integer");
    out->seed = static_cast<uint64_t>(seed->get<int64_t>());
  }
  return std::nullopt;
}

// stop: a string or up to kMaxStops strings.
std::optional<HttpError> ParseStops(const Json& body, Parsed* out) {
  auto stop = body.find("stop");
  if (stop == body.end() || stop->is_null()) return std::nullopt;
  if (stop->is_string()) {
    out->stops.push_back(stop->get<std::string>());
  } else if (stop->is_array() && stop->size() <= kMaxStops) {
    for (const Json& s : *stop) {
      if (!s.is_string()) return Bad("stop", "stop entries must be strings");
      out->stops.push_back(s.get<std::string>());
    }
  } else {
    return Bad("stop", absl::StrCat("stop must be a string or up to ", kMaxStops, " strings"));
  }
  for (const std::string& s : out->stops) {
    if (s.empty() || s.size() > kMaxStopBytes) {
      return Bad("stop", absl::StrCat("stop strings must be 1-", kMaxStopBytes, " bytes"));
    }
  }
  return std::nullopt;
}

// stream, stream_options.include_usage, and n (only 1).
std::optional<HttpError> ParseDelivery(const Json& body, Parsed* out) {
  if (auto stream = body.find("stream"); stream != body.end() && !stream->is_null()) {
    if (!stream->is_boolean()) return Bad("stream", "stream must be a boolean");
    out->stream = stream->get<bool>();
  }
  if (auto so = body.find("stream_options"); so != body.end() && !so->is_null()) {
    if (!so->is_object()) return Bad("stream_options", "stream_options must be an object");
    if (auto iu = so->find("include_usage"); iu != so->end()) {
      if (!iu->is_boolean()) {
        return Bad("stream_options.include_usage", "include_usage must be a boolean");
      }
      out->include_usage = iu->get<bool>();
    }
  }
  if (auto n = body.find("n");
      n != body.end() && !n->is_null() && !(n->is_number_integer() && n->get<int64_t>() == 1)) {
    return Bad("n", "only n = 1 is supported");
  }
  return std::nullopt;
}

std::optional<HttpError> Parse(const Json& body, bool chat, const OpenAiHttpOptions& options,
                               const tokenizer::Tokenizer& tokenizer, Parsed* out) {
  out->chat = chat;
  out->max_tokens = options.default_max_tokens;
  if (!body.is_object()) return Bad("", "the request body must be a JSON object");
  if (std::optional<HttpError> e = CheckModel(body, options)) return e;
  if (std::optional<HttpError> e = chat ? ParseChatPrompt(body, tokenizer, &out->prompt)
                                        : ParseCompletionPrompt(body, tokenizer, &out->prompt)) {
    return e;
  }
  if (out->prompt.empty()) return Bad(chat ? "messages" : "prompt", "the prompt is empty");
  if (std::optional<HttpError> e = ParseSampling(body, out)) return e;
  if (std::optional<HttpError> e = ParseStops(body, out)) return e;
  return ParseDelivery(body, out);
}

// Follows the generated text: holds back what could still be the start of a stop string or an
// unfinished UTF-8 character, and ends the text at the first stop string.
class TextTracker {
 public:
  TextTracker(const tokenizer::Tokenizer* tokenizer, std::vector<std::string> stops)
      : tokenizer_(tokenizer), stops_(std::move(stops)) {
    for (const std::string& s : stops_) hold_ = std::max(hold_, s.size() - 1);
  }
  // Adds tokens; returns the text that can be released now.
  std::string Add(absl::Span<const int32_t> tokens) {
    tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
    const std::string text = DecodeGenerated(*tokenizer_, tokens_);
    size_t end = text.size();
    for (const std::string& s : stops_) {
      const size_t at = text.find(s);
      if (at != std::string::npos && at < end) {
        end = at;
        stopped_ = true;
      }
    }
    if (!stopped_) {
      end = text.size() > hold_ ? text.size() - hold_ : 0;
      // A trailing U+FFFD may be a character whose last bytes (byte-fallback ids) are still to
      // come: hold it back until the next token settles it.
      if (absl::EndsWith(text, kReplacementCharacter)) {
        end = std::min(end, text.size() - kReplacementCharacter.size());
      }
      // Never split a UTF-8 character.
      while (end > released_ && end < text.size() &&
             (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) {
        --end;
      }
    }
    return Release(text, end);
  }
  std::string Finish() {
    if (stopped_) return "";
    const std::string text = DecodeGenerated(*tokenizer_, tokens_);
    return Release(text, text.size());
  }
  bool stopped() const { return stopped_; }
  const std::vector<int32_t>& tokens() const { return tokens_; }

 private:
  std::string Release(const std::string& text, size_t end) {
    if (end <= released_) return "";
    std::string out = text.substr(released_, end - released_);
    released_ = end;
    return out;
  }
  static constexpr absl::string_view kReplacementCharacter = "\xEF\xBF\xBD";
  const tokenizer::Tokenizer* tokenizer_;
  const std::vector<std::string> stops_;
  size_t hold_ = 0;
  std::vector<int32_t> tokens_;
  size_t released_ = 0;
  bool stopped_ = false;
};

int64_t NowSeconds() { return absl::ToUnixSeconds(absl::Now()); }

std::string NewId(const char* prefix) {
  static std::atomic<uint64_t> next{1};
  return absl::StrCat(prefix, absl::ToUnixMicros(absl::Now()), "-", next.fetch_add(1));
}

Json Usage(int32_t prompt_tokens, int32_t completion_tokens, int32_t cached_tokens) {
  Json usage;
  usage["prompt_tokens"] = prompt_tokens;
  usage["completion_tokens"] = completion_tokens;
  usage["total_tokens"] = prompt_tokens + completion_tokens;
  usage["prompt_tokens_details"]["cached_tokens"] = cached_tokens;
  return usage;
}

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

// GET /v1/models: the one model this gateway serves.
void AnswerModels(const OpenAiHttpOptions& options, const httplib::Request& req,
                  httplib::Response& res) {
  if (absl::StatusOr<std::string> tenant =
          options.resolve_tenant(req.get_header_value("Authorization"));
      !tenant.ok()) {
    SendError(res, FromStatus(tenant.status()));
    return;
  }
  Json model;
  model["id"] = options.model_name;
  model["object"] = "model";
  model["created"] = 0;
  model["owned_by"] = "kvrelay";
  Json list;
  list["object"] = "list";
  list["data"] = Json::array({model});
  res.set_content(Dump(list), "application/json");
}

// What httplib answers on its own (no route, body too large): OpenAI-shaped too.
void AnswerHttpError(const httplib::Request& req, httplib::Response& res) {
  if (!res.body.empty()) return;  // a handler already answered
  HttpError e;
  e.status = res.status;
  e.type = res.status == 404 ? "not_found_error" : "invalid_request_error";
  e.message = res.status == 404 ? absl::StrCat("no route ", req.method, " ", req.path)
                                : absl::StrCat("HTTP ", res.status);
  if (res.status == 413) e.message = "the request body is too large";
  res.set_content(ErrorBody(e), "application/json");
}

// One completion request, parsed and admitted: what its answer needs.
struct Completion {
  Parsed parsed;
  std::shared_ptr<kvrelay::v1::GenerateRequest> request;
  std::string client;  // for the gateway's per-client quotas ("" in --insecure mode)
  std::string id;
  int64_t created = 0;
  absl::Time deadline;
};

// One streamed answer between the thread that runs Generate and the HTTP writer. The stream is
// committed (200, text/event-stream) only once its first event came, so a request refused
// before any token gets its own status (429 with Retry-After, 503, ...) like an unstreamed one,
// not a 200 carrying an error event.
//
// Thread-safe. The gateway must outlive the feed's thread; Join (idempotent) ends it: the
// response's releaser calls it once the answer is written or abandoned.
class StreamFeed {
 public:
  StreamFeed() = default;
  StreamFeed(const StreamFeed&) = delete;
  StreamFeed& operator=(const StreamFeed&) = delete;
  // A response dropped without its releaser (the server stopping) still ends the call: a
  // joinable thread left behind would terminate the process.
  ~StreamFeed() {
    Cancel();
    Join();
  }
  // Runs Generate for `c` on a thread of its own.
  void Start(Gateway* gateway, const Completion& c) {
    thread_ = std::thread([this, gateway, c] {
      absl::Status s = gateway->Generate(
          *c.request, c.deadline,
          [this](const kvrelay::v1::GenerateResponse& r) {
            absl::MutexLock lock(&mu_);
            events_.push_back(r);
            return !stop_.load(std::memory_order_relaxed);
          },
          [this] { return gone_.load(std::memory_order_relaxed); }, c.client);
      absl::MutexLock lock(&mu_);
      status_ = std::move(s);
      done_ = true;
    });
  }
  // Waits for the first event or the end; true when the call ended without any (refused or
  // failed before its first token): status() says why.
  bool EndedEmpty() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &StreamFeed::Ready));
    return events_.empty();
  }
  // The next event, waiting for it; nullopt once the call ended (then status()).
  std::optional<kvrelay::v1::GenerateResponse> Next() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &StreamFeed::Ready));
    if (events_.empty()) return std::nullopt;
    kvrelay::v1::GenerateResponse r = std::move(events_.front());
    events_.pop_front();
    return r;
  }
  absl::Status status() {
    absl::MutexLock lock(&mu_);
    return status_;
  }
  // The writer has what it wants (a stop string): generation ends, OK, with its summary.
  void Stop() { stop_.store(true, std::memory_order_relaxed); }
  // The client went away: the call is cancelled (relaxed: a flag polled between chunks).
  void Cancel() { gone_.store(true, std::memory_order_relaxed); }
  void Join() {
    absl::MutexLock lock(&join_mu_);
    if (thread_.joinable()) thread_.join();
  }

 private:
  bool Ready() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_ || !events_.empty(); }

  absl::Mutex mu_;
  std::deque<kvrelay::v1::GenerateResponse> events_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> stop_{false};
  std::atomic<bool> gone_{false};
  absl::Mutex join_mu_;  // Join may be called from several copies of the response
  std::thread thread_;
};

// A choice, whole (`message` / `text`) or as a streamed `delta`.
Json ChoiceJson(bool chat, const std::string& text, const std::vector<int32_t>& ids, bool streaming,
                const Json& finish_reason, bool first) {
  Json choice;
  choice["index"] = 0;
  if (chat) {
    Json message;
    if (!streaming || first) message["role"] = "assistant";
    message["content"] = text;
    choice[streaming ? "delta" : "message"] = message;
  } else {
    choice["text"] = text;
    choice["logprobs"] = nullptr;
  }
  choice["token_ids"] = ids;
  choice["finish_reason"] = finish_reason;
  return choice;
}

std::string FinishReason(const TextTracker& tracker, const kvrelay::v1::GenerateSummary& summary,
                         int32_t max_tokens) {
  if (tracker.stopped()) return "stop";
  return summary.generated_tokens() >= max_tokens ? "length" : "stop";
}

// Answers POST /v1/completions and /v1/chat/completions over the gateway, at once or as
// server-sent events. Stateless: copies run on httplib's threads; the options, the gateway and
// the tokenizer must outlive them.
class CompletionHandler {
 public:
  CompletionHandler(const OpenAiHttpOptions* options, Gateway* gateway,
                    const tokenizer::Tokenizer* tokenizer)
      : options_(options), gateway_(gateway), tokenizer_(tokenizer) {}

  void Handle(bool chat, const httplib::Request& req, httplib::Response& res) const {
    Completion c;
    if (std::optional<HttpError> e = Prepare(chat, req, &c)) {
      SendError(res, *e);
      return;
    }
    if (!c.parsed.stream) {
      AnswerOnce(c, res);
      return;
    }
    auto feed = std::make_shared<StreamFeed>();
    feed->Start(gateway_, c);
    if (feed->EndedEmpty()) {
      feed->Join();
      SendError(res, FromStatus(feed->status()));
      return;
    }
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [handler = *this, c, feed](size_t, httplib::DataSink& sink) {
          return handler.Stream(c, *feed, sink);
        },
        [feed](bool) {
          feed->Cancel();  // no-op when the call already ended
          feed->Join();
        });
  }

 private:
  // The tenant from the credential, the body parsed, the gateway's request made.
  std::optional<HttpError> Prepare(bool chat, const httplib::Request& req, Completion* c) const {
    absl::StatusOr<std::string> tenant =
        options_->resolve_tenant(req.get_header_value("Authorization"));
    if (!tenant.ok()) return FromStatus(tenant.status());
    Json body = Json::parse(req.body, nullptr, /*allow_exceptions=*/false);
    if (body.is_discarded()) return Bad("", "the request body is not valid JSON");
    if (std::optional<HttpError> e = Parse(body, chat, *options_, *tokenizer_, &c->parsed)) {
      return e;
    }
    const Parsed& p = c->parsed;
    c->request = std::make_shared<kvrelay::v1::GenerateRequest>();
    for (int32_t t : p.prompt) c->request->add_tokens(t);
    c->request->set_model(options_->model_name);
    c->request->set_tenant(*tenant);
    // Over HTTP the only credential is the verified bearer token: its subject is the client
    // of the per-client quotas (none in --insecure mode).
    c->client = options_->security.insecure ? std::string() : absl::StrCat("bearer:", *tenant);
    c->request->set_max_tokens(p.max_tokens);
    c->request->mutable_sampling()->set_temperature(p.temperature);
    c->request->mutable_sampling()->set_top_p(p.top_p);
    c->request->mutable_sampling()->set_seed(p.seed);
    c->request->set_eos_token(-1);
    c->id = NewId(chat ? "chatcmpl-" : "cmpl-");
    c->created = NowSeconds();
    c->deadline = absl::Now() + options_->request_timeout;
    return std::nullopt;
  }

  void AnswerOnce(const Completion& c, httplib::Response& res) const {
    const Parsed& p = c.parsed;
    TextTracker tracker(tokenizer_, p.stops);
    std::string text;
    kvrelay::v1::GenerateSummary summary;
    absl::Status s = gateway_->Generate(
        *c.request, c.deadline,
        [&](const kvrelay::v1::GenerateResponse& r) {
          if (r.has_summary()) summary = r.summary();
          text += tracker.Add(r.tokens());
          return !tracker.stopped();
        },
        [] { return false; }, c.client);
    if (!s.ok()) {
      SendError(res, FromStatus(s));
      return;
    }
    text += tracker.Finish();
    Json out;
    out["id"] = c.id;
    out["object"] = p.chat ? "chat.completion" : "text_completion";
    out["created"] = c.created;
    out["model"] = options_->model_name;
    out["choices"] = Json::array({ChoiceJson(p.chat, text, tracker.tokens(), false,
                                             FinishReason(tracker, summary, p.max_tokens), true)});
    out["usage"] =
        Usage(static_cast<int32_t>(p.prompt.size()), static_cast<int32_t>(tracker.tokens().size()),
              summary.prefix_hit_tokens());
    res.set_content(Dump(out), "application/json");
  }

  // The events of one streamed answer, as `feed` delivers them; false when the client went away.
  bool Stream(const Completion& c, StreamFeed& feed, httplib::DataSink& sink) const {
    const Parsed& p = c.parsed;
    bool client_gone = false;
    bool first = true;
    auto send = [&](const Json& event) {
      if (client_gone) return false;
      const std::string line = absl::StrCat("data: ", Dump(event), "\n\n");
      if (!sink.write(line.data(), line.size())) client_gone = true;
      return !client_gone;
    };
    auto envelope = [&](Json choices) {
      Json event;
      event["id"] = c.id;
      event["object"] = p.chat ? "chat.completion.chunk" : "text_completion";
      event["created"] = c.created;
      event["model"] = options_->model_name;
      event["choices"] = std::move(choices);
      return event;
    };
    TextTracker tracker(tokenizer_, p.stops);
    kvrelay::v1::GenerateSummary summary;
    while (std::optional<kvrelay::v1::GenerateResponse> r = feed.Next()) {
      if (r->has_summary()) {
        summary = r->summary();
        continue;
      }
      // Tokens that came after a stop string, before the call saw Stop(): not the answer's.
      if (tracker.stopped()) continue;
      const std::string delta = tracker.Add(r->tokens());
      const std::vector<int32_t> ids(r->tokens().begin(), r->tokens().end());
      if (!send(envelope(Json::array({ChoiceJson(p.chat, delta, ids, true, nullptr, first)})))) {
        feed.Cancel();
        return false;
      }
      first = false;
      if (tracker.stopped()) feed.Stop();
    }
    const absl::Status s = feed.status();
    if (!s.ok()) {
      // Headers are gone already: the error travels as an event, as OpenAI does.
      const std::string line = absl::StrCat("data: ", ErrorBody(FromStatus(s)), "\n\n");
      sink.write(line.data(), line.size());
    } else {
      const std::string rest = tracker.Finish();
      send(envelope(Json::array({ChoiceJson(
          p.chat, rest, {}, true, FinishReason(tracker, summary, p.max_tokens), first)})));
      if (p.include_usage) {
        Json usage = envelope(Json::array());
        usage["usage"] =
            Usage(static_cast<int32_t>(p.prompt.size()),
                  static_cast<int32_t>(tracker.tokens().size()), summary.prefix_hit_tokens());
        send(usage);
      }
    }
    const std::string done = "data: [DONE]\n\n";
    sink.write(done.data(), done.size());
    sink.done();
    return true;
  }

  const OpenAiHttpOptions* options_;
  Gateway* gateway_;
  const tokenizer::Tokenizer* tokenizer_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> LoadServedTokenizer(
    const std::string& model_dir) {
  for (const char* file : {"/tokenizer.json", "/tokenizer.json.gz"}) {
    if (::access((model_dir + file).c_str(), F_OK) == 0) return tokenizer::LoadTokenizer(model_dir);
  }
  return std::unique_ptr<tokenizer::Tokenizer>(new tokenizer::ByteTokenizer());
}

OpenAiHttpServer::OpenAiHttpServer(OpenAiHttpOptions options, Gateway* gateway,
                                   const tokenizer::Tokenizer* tokenizer)
    : options_(std::move(options)), gateway_(gateway), tokenizer_(tokenizer) {}

absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> OpenAiHttpServer::Start(
    OpenAiHttpOptions options, Gateway* gateway, const tokenizer::Tokenizer* tokenizer) {
  if (!options.resolve_tenant) {
    return absl::InvalidArgumentError("OpenAiHttpServer needs a tenant resolver");
  }
  auto server = std::unique_ptr<OpenAiHttpServer>(
      new OpenAiHttpServer(std::move(options), gateway, tokenizer));
  const ::kvrelay::server::SecurityOptions& tls = server->options_.security;
  if (!tls.insecure && !tls.cert_file.empty()) {
    auto https = std::make_unique<httplib::SSLServer>(tls.cert_file.c_str(), tls.key_file.c_str());
    if (!https->is_valid()) {
      return absl::InvalidArgumentError(absl::StrCat("HTTPS: cannot load --tls-cert ",
                                                     tls.cert_file, " / --tls-key ", tls.key_file));
    }
    server->http_ = std::move(https);
  } else {
    server->http_ = std::make_unique<httplib::Server>();
  }
  server->http_->set_payload_max_length(server->options_.max_body_bytes);
  server->http_->set_read_timeout(10, 0);
  server->Routes();
  const std::string& host = server->options_.host;
  if (server->options_.port == 0) {
    server->port_ = server->http_->bind_to_any_port(host);
  } else if (server->http_->bind_to_port(host, server->options_.port)) {
    server->port_ = server->options_.port;
  }
  if (server->port_ <= 0) {
    return absl::UnavailableError(
        absl::StrCat("http-port: cannot listen on ", host, ":", server->options_.port));
  }
  httplib::Server* http = server->http_.get();
  server->thread_ = std::thread([http] { http->listen_after_bind(); });
  return server;
}

OpenAiHttpServer::~OpenAiHttpServer() {
  if (http_ != nullptr) http_->stop();
  if (thread_.joinable()) thread_.join();
}

void OpenAiHttpServer::Routes() {
  http_->Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
    AnswerModels(options_, req, res);
  });
  const CompletionHandler completions(&options_, gateway_, tokenizer_);
  http_->Post("/v1/completions",
              [completions](const httplib::Request& req, httplib::Response& res) {
                completions.Handle(/*chat=*/false, req, res);
              });
  http_->Post("/v1/chat/completions",
              [completions](const httplib::Request& req, httplib::Response& res) {
                completions.Handle(/*chat=*/true, req, res);
              });
  http_->set_error_handler(AnswerHttpError);
}

}  // namespace kvrelay::gateway
