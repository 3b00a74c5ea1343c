// A tiny structured logger: one line per event on stderr,
//   2025-01-02T03:04:05.678Z INFO attach session=s-1 tenant=default msg="free text"
// Values with spaces, quotes, '=' or control characters are quoted and escaped, so every line
// splits unambiguously into key=value fields.
//
// Threading: the level is an atomic; each line is written with one fwrite, so lines from
// different threads never interleave.
#ifndef KVSIDECAR_SERVICE_LOG_H_
#define KVSIDECAR_SERVICE_LOG_H_

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvs {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
// "debug", "info", "warning", "error"; false on anything else.
bool ParseLogLevel(absl::string_view text, LogLevel* level);
absl::string_view LogLevelName(LogLevel level);

// The request id of the call this thread is serving (x-request-id metadata), added to every line
// logged while it is set as request_id=...; "" = none. Set by RunUnary around a unary handler.
class ScopedRequestId {
 public:
  explicit ScopedRequestId(std::string id);
  ~ScopedRequestId();
  ScopedRequestId(const ScopedRequestId&) = delete;
  ScopedRequestId& operator=(const ScopedRequestId&) = delete;

 private:
  std::string previous_;
};
const std::string& CurrentRequestId();

// `value` as it appears after "key=": bare when safe, else double-quoted with \" \\ \n \t \xNN.
std::string QuoteLogValue(absl::string_view value);

// Builds one line and writes it when destroyed (if `level` is enabled). Use through KVS_LOG:
//   KVS_LOG(kInfo, "attach")("session", id)("blocks", n);
class LogLine {
 public:
  LogLine(LogLevel level, absl::string_view event);
  ~LogLine();
  LogLine(const LogLine&) = delete;
  LogLine& operator=(const LogLine&) = delete;

  template <typename T>
  LogLine& operator()(absl::string_view key, const T& value) {
    if (enabled_) AddField(key, absl::StrCat(value));
    return *this;
  }
  LogLine& operator()(absl::string_view key, absl::string_view value) {
    if (enabled_) AddField(key, value);
    return *this;
  }
  LogLine& operator()(absl::string_view key, const char* value) {
    return (*this)(key, absl::string_view(value));
  }
  LogLine& operator()(absl::string_view key, const std::string& value) {
    return (*this)(key, absl::string_view(value));
  }
  LogLine& operator()(absl::string_view key, bool value) {
    return (*this)(key, absl::string_view(value ? "true" : "false"));
  }

 private:
  void AddField(absl::string_view key, absl::string_view value);

  const bool enabled_;
  std::string line_;
};

}  // namespace kvs

#define KVS_LOG(severity, event) ::kvs::LogLine(::kvs::LogLevel::severity, (event))

#endif  // KVSIDECAR_SERVICE_LOG_H_
