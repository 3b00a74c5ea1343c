#include "storage/redis/redis_client.h"

#include <hiredis/hiredis.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvs::storage::redis {
namespace {

constexpr int kSlots = 16384;

// Debian's Abseil has its own string_view type.
absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

Reply Convert(const redisReply* r) {
  Reply out;
  switch (r->type) {
    case REDIS_REPLY_STRING:
      out.type = Reply::Type::kString;
      out.str.assign(r->str, r->len);
      break;
    case REDIS_REPLY_STATUS:
      out.type = Reply::Type::kStatus;
      out.str.assign(r->str, r->len);
      break;
    case REDIS_REPLY_ERROR:
      out.type = Reply::Type::kError;
      out.str.assign(r->str, r->len);
      break;
    case REDIS_REPLY_INTEGER:
      out.type = Reply::Type::kInteger;
      out.integer = r->integer;
      break;
    case REDIS_REPLY_ARRAY:
      out.type = Reply::Type::kArray;
      out.elements.reserve(r->elements);
      for (size_t i = 0; i < r->elements; ++i) out.elements.push_back(Convert(r->element[i]));
      break;
    default:
      out.type = Reply::Type::kNil;
  }
  return out;
}

// Hands a top-level bulk string that a BulkSink takes straight from hiredis' read buffer: the
// reader makes an empty reply for it instead of one the value's size (each multi-MiB chunk was
// allocated and copied once more, only to be copied into its place and freed). The reader's
// privdata points at the connection's Delivery; hiredis gives it to every task.
struct Delivery {
  const redisReplyObjectFunctions* base = nullptr;  // hiredis' own functions
  const Client::BulkSink* sink = nullptr;           // null: every string becomes a reply
  size_t index = 0;                                 // what the sink is told
  bool delivered = false;
  size_t length = 0;
};

void* CreateStringOrDeliver(const redisReadTask* task, char* str, size_t len) {
  auto* d = static_cast<Delivery*>(task->privdata);
  if (d->sink != nullptr && task->parent == nullptr && task->type == REDIS_REPLY_STRING) {
    (*d->sink)(d->index, std::string_view(str, len));
    d->delivered = true;
    d->length = len;
    return d->base->createString(task, str, 0);
  }
  return d->base->createString(task, str, len);
}

// hiredis' functions with CreateStringOrDeliver for strings. Every reader starts with the same
// hiredis defaults, so one table serves every connection.
// (Not const: hiredis 0.14's reader holds a mutable pointer; nothing writes through it.)
redisReplyObjectFunctions* DeliveringFunctions(const redisReplyObjectFunctions* base) {
  static redisReplyObjectFunctions table = [base] {
    redisReplyObjectFunctions t = *base;
    t.createString = CreateStringOrDeliver;
    return t;
  }();
  return &table;
}

// "MOVED 3999 127.0.0.1:6381" / "ASK 3999 127.0.0.1:6381" -> the address.
bool Redirection(const Reply& reply, bool* ask, std::string* address) {
  if (!reply.is_error()) return false;
  const bool moved = absl::StartsWith(reply.str, "MOVED ");
  const bool asked = absl::StartsWith(reply.str, "ASK ");
  if (!moved && !asked) return false;
  std::vector<std::string> parts = absl::StrSplit(reply.str, ' ');
  if (parts.size() != 3) return false;
  *ask = asked;
  *address = parts[2];
  return true;
}

// A transport failure worth a retry on another connection (the node restarted, failed over, or
// its slots moved), as opposed to a reply the server sent.
bool Retryable(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnavailable;
}

}  // namespace

struct Client::Node {
  std::string address;
  std::string host;
  int port = 0;
  redisContext* context = nullptr;
  Delivery delivery;  // the reader's privdata while `context` lives
  ~Node() {
    if (context != nullptr) redisFree(context);
  }
  void Drop() {
    if (context != nullptr) redisFree(context);
    context = nullptr;
  }
};

absl::StatusOr<std::vector<std::string>> ParseRedisUrl(std::string_view url,
                                                       std::string_view flag) {
  absl::string_view rest = Sv(url);
  if (!absl::ConsumePrefix(&rest, "redis://")) {
    return absl::InvalidArgumentError(absl::StrCat(
        Sv(flag), ": must be redis://host:port[,host:port...] (the seed nodes)"));
  }
  std::vector<std::string> seeds;
  for (absl::string_view part : absl::StrSplit(rest, ',')) {
    part = absl::StripTrailingAsciiWhitespace(absl::StripLeadingAsciiWhitespace(part));
    const size_t colon = part.rfind(':');
    int port = 0;
    if (part.empty() || colon == absl::string_view::npos || colon == 0 ||
        !absl::SimpleAtoi(part.substr(colon + 1), &port) || port <= 0 || port > 65535 ||
        part.find('@') != absl::string_view::npos || part.find('/') != absl::string_view::npos) {
      // A part with '@' may hold a password: never echoed.
      const bool secret = part.find('@') != absl::string_view::npos;
      return absl::InvalidArgumentError(absl::StrCat(
          Sv(flag), ": ", secret ? "a seed" : absl::StrCat("\"", part.substr(0, 200), "\""),
          " is not host:port (credentials go in --remote_tier_user and "
          "--remote_tier_password_file, never in the URL)"));
    }
    seeds.emplace_back(part);
  }
  return seeds;
}

uint16_t KeySlot(std::string_view key) {
  // Hash tag: the part between the first '{' and the next '}', when non-empty.
  if (const size_t open = key.find('{'); open != std::string_view::npos) {
    if (const size_t close = key.find('}', open + 1);
        close != std::string_view::npos && close > open + 1) {
      key = key.substr(open + 1, close - open - 1);
    }
  }
  // CRC16-CCITT (XMODEM): polynomial 0x1021, initial value 0, as Redis Cluster specifies.
  uint16_t crc = 0;
  for (unsigned char c : key) {
    crc ^= static_cast<uint16_t>(c) << 8;
    for (int bit = 0; bit < 8; ++bit) {
      crc = (crc & 0x8000) ? static_cast<uint16_t>((crc << 1) ^ 0x1021)
                           : static_cast<uint16_t>(crc << 1);
    }
  }
  return crc % kSlots;
}

absl::Status ErrorReplyStatus(std::string_view what, std::string_view error) {
  const absl::string_view e = Sv(error);
  if (absl::StartsWith(e, "OOM")) {
    return absl::ResourceExhaustedError(absl::StrCat(
        Sv(what), ": the Redis remote tier is out of memory (", e,
        "); free space there, raise its maxmemory, or spill to another tier"));
  }
  if (absl::StartsWith(e, "WRONGPASS")) {
    return absl::UnauthenticatedError(absl::StrCat(
        Sv(what), ": Redis refused the remote tier's credentials (WRONGPASS): check "
                  "--remote_tier_user and the password in --remote_tier_password_file"));
  }
  if (absl::StartsWith(e, "NOAUTH")) {
    return absl::UnauthenticatedError(absl::StrCat(
        Sv(what), ": Redis requires authentication (NOAUTH): set --remote_tier_password_file "
                  "(and --remote_tier_user for an ACL user)"));
  }
  if (absl::StartsWith(e, "NOPERM")) {
    return absl::PermissionDeniedError(absl::StrCat(
        Sv(what), ": the remote tier's Redis user lacks a permission (", e,
        "); it needs the commands and keys ~kvs:* of the remote tier"));
  }
  if (absl::StartsWith(e, "CLUSTERDOWN") || absl::StartsWith(e, "TRYAGAIN") ||
      absl::StartsWith(e, "LOADING") || absl::StartsWith(e, "MASTERDOWN")) {
    return absl::UnavailableError(absl::StrCat(Sv(what), ": Redis is not serving (", e, ")"));
  }
  return absl::InternalError(absl::StrCat(Sv(what), ": Redis answered an error: ", e));
}

Client::Client(ClientOptions options) : options_(std::move(options)) {}

Client::~Client() = default;

absl::Status Client::Connect(Node& node) {
  if (node.context != nullptr) return absl::OkStatus();
  redisContext* c = redisConnectWithTimeout(node.host.c_str(), node.port,
                                            absl::ToTimeval(options_.connect_timeout));
  if (c == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot connect to Redis at ", node.address, ": out of memory"));
  }
  if (c->err != 0) {
    absl::Status status = absl::UnavailableError(
        absl::StrCat("cannot connect to Redis at ", node.address, ": ", c->errstr));
    redisFree(c);
    return status;
  }
  redisSetTimeout(c, absl::ToTimeval(options_.io_timeout));
  node.delivery = Delivery{};
  node.delivery.base = c->reader->fn;
  c->reader->fn = DeliveringFunctions(c->reader->fn);
  c->reader->privdata = &node.delivery;
  node.context = c;
  if (!options_.password.empty()) {
    std::vector<std::string> auth = {"AUTH"};
    if (!options_.user.empty()) auth.push_back(options_.user);
    auth.push_back(options_.password);
    absl::StatusOr<std::vector<Reply>> replies = Exchange(node, {auth}, false);
    if (!replies.ok()) {
      node.Drop();
      return replies.status();
    }
    if ((*replies)[0].is_error()) {
      node.Drop();
      return ErrorReplyStatus(absl::StrCat("AUTH at ", node.address), (*replies)[0].str);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Client::Node*> Client::NodeAt(const std::string& address) {
  auto it = nodes_.find(address);
  if (it == nodes_.end()) {
    auto node = std::make_unique<Node>();
    node->address = address;
    const size_t colon = address.rfind(':');
    if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &node->port)) {
      return absl::InternalError(absl::StrCat("Redis named a bad node address ", address));
    }
    node->host = address.substr(0, colon);
    it = nodes_.emplace(address, std::move(node)).first;
  }
  if (absl::Status status = Connect(*it->second); !status.ok()) return status;
  return it->second.get();
}

absl::Status Client::RefreshSlots() {
  // Ask the seeds first, then every node known: whichever answers.
  std::vector<std::string> candidates = options_.seeds;
  for (const auto& [address, node] : nodes_) {
    if (std::find(candidates.begin(), candidates.end(), address) == candidates.end()) {
      candidates.push_back(address);
    }
  }
  absl::Status last = absl::UnavailableError("no Redis seed node is configured");
  for (const std::string& address : candidates) {
    absl::StatusOr<Node*> node = NodeAt(address);
    if (!node.ok()) {
      last = node.status();
      if (!Retryable(last)) return last;  // credentials: no other node will differ
      continue;
    }
    absl::StatusOr<std::vector<Reply>> replies = Exchange(**node, {{"CLUSTER", "SLOTS"}}, false);
    if (!replies.ok()) {
      last = replies.status();
      continue;
    }
    const Reply& reply = (*replies)[0];
    if (reply.is_error()) {
      if (absl::StrContains(reply.str, "cluster support disabled")) {
        // A single Redis: it serves every slot.
        cluster_ = false;
        slots_.assign(kSlots, address);
        return absl::OkStatus();
      }
      last = ErrorReplyStatus(absl::StrCat("CLUSTER SLOTS at ", address), reply.str);
      if (last.code() != absl::StatusCode::kUnavailable) return last;
      continue;
    }
    std::vector<std::string> slots(kSlots);
    for (const Reply& range : reply.elements) {
      if (range.elements.size() < 3 || range.elements[2].elements.size() < 2) continue;
      const Reply& master = range.elements[2];
      std::string host = master.elements[0].str;
      if (host.empty() || host == "?") host = (*node)->host;  // "announce" not set: same host
      const std::string where = absl::StrCat(host, ":", master.elements[1].integer);
      for (int64_t s = range.elements[0].integer; s <= range.elements[1].integer && s < kSlots;
           ++s) {
        if (s >= 0) slots[s] = where;
      }
    }
    cluster_ = true;
    slots_ = std::move(slots);
    return absl::OkStatus();
  }
  return last;
}

absl::StatusOr<Client::Node*> Client::NodeForSlot(uint16_t slot) {
  if (slots_.empty() || slots_[slot].empty()) {
    if (absl::Status status = RefreshSlots(); !status.ok()) return status;
  }
  if (slots_[slot].empty()) {
    return absl::UnavailableError(
        absl::StrCat("no Redis Cluster node serves slot ", slot, " (the cluster is incomplete)"));
  }
  return NodeAt(slots_[slot]);
}

absl::StatusOr<std::vector<Reply>> Client::Exchange(
    Node& node, const std::vector<std::vector<std::string>>& commands, bool asking,
    const BulkSink* sink) {
  redisContext* c = node.context;
  std::vector<const char*> argv;
  std::vector<size_t> lens;
  std::vector<bool> asking_reply;  // per command sent: an ASKING whose OK is dropped
  auto append = [&](const std::vector<std::string>& command, bool is_asking) {
    argv.clear();
    lens.clear();
    for (const std::string& arg : command) {
      argv.push_back(arg.data());
      lens.push_back(arg.size());
    }
    asking_reply.push_back(is_asking);
    return redisAppendCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data());
  };
  // ASKING holds for the next command; inside MULTI, until EXEC.
  const bool transaction = !commands.empty() && commands[0].size() == 1 &&
                           (commands[0][0] == "MULTI" || commands[0][0] == "multi");
  for (size_t i = 0; i < commands.size(); ++i) {
    bool ok = true;
    if (asking && (!transaction || i == 0)) ok = append({"ASKING"}, true) == REDIS_OK;
    if (!ok || append(commands[i], false) != REDIS_OK) {
      const std::string why = c->errstr;
      node.Drop();
      return absl::UnavailableError(absl::StrCat("Redis at ", node.address, ": ", why));
    }
  }
  // Send everything, then read with large reads: hiredis' own redisGetReply reads 16 KiB at a
  // time, which for multi-MiB chunk values costs hundreds of reads and buffer regrowths each.
  auto lost = [&](const std::string& why) {
    node.Drop();
    return absl::UnavailableError(absl::StrCat("Redis at ", node.address, ": ", why));
  };
  int done = 0;
  while (done == 0) {
    if (redisBufferWrite(c, &done) != REDIS_OK) {
      return lost(c->errstr[0] != '\0' ? c->errstr : "write failed");
    }
  }
  std::vector<Reply> replies;
  replies.reserve(commands.size());
  std::vector<char> buffer;
  // The sink is named only while this call reads its replies.
  struct SinkScope {
    Delivery& d;
    ~SinkScope() { d.sink = nullptr; }
  } scope{node.delivery};
  for (size_t i = 0; i < asking_reply.size(); ++i) {
    void* raw = nullptr;
    Delivery& delivery = node.delivery;
    delivery.sink = sink != nullptr && *sink && !asking_reply[i] ? sink : nullptr;
    delivery.index = replies.size();
    delivery.delivered = false;
    while (true) {
      if (redisReaderGetReply(c->reader, &raw) != REDIS_OK) return lost("protocol error");
      if (raw != nullptr) break;
      if (buffer.empty()) buffer.resize(size_t{4} << 20);
      const ssize_t n = read(c->fd, buffer.data(), buffer.size());
      if (n == 0) return lost("the server closed the connection");
      if (n < 0) {
        if (errno == EINTR) continue;
        return lost(errno == EAGAIN || errno == EWOULDBLOCK ? "timed out" : std::strerror(errno));
      }
      if (redisReaderFeed(c->reader, buffer.data(), static_cast<size_t>(n)) != REDIS_OK) {
        return lost("protocol error");
      }
    }
    const redisReply* r = static_cast<const redisReply*>(raw);
    Reply reply;
    if (delivery.delivered) {
      reply.type = Reply::Type::kString;
      reply.integer = static_cast<int64_t>(delivery.length);
    } else {
      reply = Convert(r);
    }
    freeReplyObject(raw);
    if (!asking_reply[i]) replies.push_back(std::move(reply));
  }
  return replies;
}

absl::StatusOr<std::vector<Reply>> Client::Run(
    std::string_view slot_key, const std::vector<std::vector<std::string>>& commands,
    const BulkSink& sink) {
  const uint16_t slot = KeySlot(slot_key);
  const absl::Time deadline = absl::Now() + options_.deadline;
  absl::MutexLock lock(&mu_);
  absl::Status last = absl::UnavailableError("not attempted");
  std::string redirect;  // ASK target for the next attempt
  bool ask = false;
  for (int attempt = 0; attempt < options_.max_attempts + 4; ++attempt) {
    if (attempt >= options_.max_attempts && !ask) break;
    if (attempt > 0 && absl::Now() >= deadline) break;
    absl::StatusOr<Node*> node = ask ? NodeAt(redirect) : NodeForSlot(slot);
    absl::StatusOr<std::vector<Reply>> replies =
        node.ok() ? Exchange(**node, commands, ask, &sink) : node.status();
    ask = false;
    if (!replies.ok()) {
      last = replies.status();
      if (!Retryable(last)) return last;
      // The node failed: forget the map (a replica may take over its slots) and retry.
      slots_.clear();
      std::this_thread::sleep_for(absl::ToChronoNanoseconds(
          std::min(options_.retry_backoff * (1 << std::min(attempt, 5)), deadline - absl::Now())));
      continue;
    }
    // A redirection answers the first command of the pipeline (or, in a transaction, the
    // commands queued after MULTI): follow it with the whole pipeline.
    bool redirected = false;
    for (const Reply& reply : *replies) {
      bool is_ask = false;
      std::string address;
      if (Redirection(reply, &is_ask, &address)) {
        redirected = true;
        if (is_ask) {
          ask = true;
          redirect = address;
        } else {
          slots_.clear();  // the map changed: reload it
        }
        last = absl::UnavailableError(
            absl::StrCat("Redis kept redirecting slot ", slot, " (", reply.str, ")"));
        break;
      }
    }
    if (!redirected) return replies;
    // A transaction a redirection cut short was discarded by EXEC (EXECABORT): nothing ran.
  }
  return absl::UnavailableError(absl::StrCat("the Redis remote tier is unavailable after ",
                                             options_.max_attempts, " attempts: ", last.message()));
}

absl::StatusOr<Reply> Client::Command(std::string_view slot_key,
                                      const std::vector<std::string>& argv) {
  absl::StatusOr<std::vector<Reply>> replies = Run(slot_key, {argv});
  if (!replies.ok()) return replies.status();
  Reply reply = std::move((*replies)[0]);
  if (reply.is_error()) return ErrorReplyStatus(argv[0], reply.str);
  return reply;
}

std::string Client::Describe() {
  absl::MutexLock lock(&mu_);
  if (slots_.empty()) {
    if (absl::Status status = RefreshSlots(); !status.ok()) {
      return absl::StrCat("not reachable yet: ", status.message());
    }
  }
  if (!cluster_) return absl::StrCat("single node ", slots_[0]);
  std::vector<std::string> masters = slots_;
  std::sort(masters.begin(), masters.end());
  masters.erase(std::unique(masters.begin(), masters.end()), masters.end());
  masters.erase(std::remove(masters.begin(), masters.end(), std::string()), masters.end());
  return absl::StrCat("cluster of ", masters.size(), " masters");
}

}  // namespace kvs::storage::redis
