#include "service/log.h"

#include <atomic>
#include <cstdio>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvs {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};

bool NeedsQuoting(absl::string_view value) {
  if (value.empty()) return true;
  for (char c : value) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u >= 0x7f || c == '"' || c == '=' || c == '\\') return true;
  }
  return false;
}

}  // namespace

void SetLogLevel(LogLevel level) { g_level.store(static_cast<int>(level)); }
LogLevel GetLogLevel() { return static_cast<LogLevel>(g_level.load()); }

bool ParseLogLevel(absl::string_view text, LogLevel* level) {
  const std::string lower = absl::AsciiStrToLower(text);
  if (lower == "debug") {
    *level = LogLevel::kDebug;
  } else if (lower == "info") {
    *level = LogLevel::kInfo;
  } else if (lower == "warning" || lower == "warn") {
    *level = LogLevel::kWarning;
  } else if (lower == "error") {
    *level = LogLevel::kError;
  } else {
    return false;
  }
  return true;
}

absl::string_view LogLevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "DEBUG";
    case LogLevel::kInfo:
      return "INFO";
    case LogLevel::kWarning:
      return "WARNING";
    case LogLevel::kError:
      return "ERROR";
  }
  return "UNKNOWN";
}

std::string QuoteLogValue(absl::string_view value) {
  if (!NeedsQuoting(value)) return std::string(value);
  std::string out = "\"";
  for (char c : value) {
    const auto u = static_cast<unsigned char>(c);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        // UTF-8 bytes (>= 0x80) pass through; other control characters are escaped.
        if (u < 0x20 || u == 0x7f) {
          static constexpr char kHex[] = "0123456789abcdef";
          out += "\\x";
          out += kHex[u >> 4];
          out += kHex[u & 0xf];
        } else {
          out += c;
        }
    }
  }
  out += '"';
  return out;
}

LogLine::LogLine(LogLevel level, absl::string_view event)
    : enabled_(static_cast<int>(level) >= g_level.load()) {
  if (!enabled_) return;
  line_ = absl::StrCat(absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()),
                       " ", LogLevelName(level), " ", QuoteLogValue(event));
}

namespace {
thread_local std::string t_request_id;
}  // namespace

ScopedRequestId::ScopedRequestId(std::string id) : previous_(std::move(t_request_id)) {
  t_request_id = std::move(id);
}
ScopedRequestId::~ScopedRequestId() { t_request_id = std::move(previous_); }
const std::string& CurrentRequestId() { return t_request_id; }

LogLine::~LogLine() {
  if (!enabled_) return;
  if (!t_request_id.empty()) AddField("request_id", t_request_id);
  line_ += '\n';
  std::fwrite(line_.data(), 1, line_.size(), stderr);
}

void LogLine::AddField(absl::string_view key, absl::string_view value) {
  absl::StrAppend(&line_, " ", key, "=", QuoteLogValue(value));
}

}  // namespace kvs
