// RedisClient: the little a client of Redis (single node or Redis Cluster) must do, on top of
// hiredis 0.14 (Debian packages no maintained C/C++ cluster client, and hiredis-vip /
// hiredis-cluster are not in Debian): the key slot (CRC16 with hash tags), the slot -> node map
// from CLUSTER SLOTS, MOVED / ASK redirections (ASKING), reconnects and bounded retries on
// node failure, and AUTH with an ACL user and password. No cluster logic of its own beyond that:
// Redis places, replicates and fails over the data.
//
// Every call runs a pipeline of commands whose keys all hash to one slot (the callers give all
// the keys of one copy one hash tag), so the pipeline goes to one node and a MULTI/EXEC in it is
// a transaction. Replies come back as plain values; Redis errors become absl::Status here, at
// the edge: a refused connection or a node that stays down -> UNAVAILABLE, -OOM ->
// RESOURCE_EXHAUSTED, -WRONGPASS / -NOAUTH -> UNAUTHENTICATED, -NOPERM -> PERMISSION_DENIED.
// The password is never part of a message, a log line or a metric.
//
// Threading: thread-safe; calls are serialised on one mutex (one connection per node).
#ifndef KVSIDECAR_STORAGE_REDIS_REDIS_CLIENT_H_
#define KVSIDECAR_STORAGE_REDIS_REDIS_CLIENT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

struct redisContext;

namespace kvs::storage::redis {

// One reply. Errors inside a pipeline (a command refused by the server) are kept as kError
// values so that callers can inspect EXEC results; transport failures fail the whole call.
struct Reply {
  enum class Type { kNil, kString, kInteger, kArray, kStatus, kError };
  Type type = Type::kNil;
  std::string str;  // kString, kStatus, kError
  int64_t integer = 0;
  std::vector<Reply> elements;  // kArray
  bool is_error() const { return type == Type::kError; }
  bool is_nil() const { return type == Type::kNil; }
};

struct ClientOptions {
  // Seed nodes, "host:port". With one seed that is not in cluster mode, every slot is served by
  // it (a single Redis).
  std::vector<std::string> seeds;
  std::string user;      // ACL user; "" = AUTH with the password only (requirepass)
  std::string password;  // "" = no AUTH
  absl::Duration connect_timeout = absl::Seconds(2);
  absl::Duration io_timeout = absl::Seconds(30);
  // A call gives up (UNAVAILABLE) after this many attempts or this much time, whichever first.
  int max_attempts = 4;
  absl::Duration deadline = absl::Seconds(60);
  absl::Duration retry_backoff = absl::Milliseconds(100);
};

// "redis://host:port,host:port,..." -> seeds. INVALID_ARGUMENT naming `flag` otherwise.
absl::StatusOr<std::vector<std::string>> ParseRedisUrl(std::string_view url, std::string_view flag);

// The cluster slot of `key` (CRC16-CCITT of the key or of its {hash tag}, mod 16384).
uint16_t KeySlot(std::string_view key);

// A Redis error reply as a status: OOM -> RESOURCE_EXHAUSTED, WRONGPASS / NOAUTH ->
// UNAUTHENTICATED, NOPERM -> PERMISSION_DENIED, anything else -> INTERNAL. `what` starts the
// message.
absl::Status ErrorReplyStatus(std::string_view what, std::string_view error);

class Client {
 public:
  explicit Client(ClientOptions options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Receives the bytes of the bulk-string reply to command `index` straight from hiredis' reply
  // (one copy fewer than Reply::str, for multi-MiB values); the Reply then holds the size in
  // `integer` and no bytes. Called again for the same index when the pipeline is retried.
  using BulkSink = std::function<void(size_t index, std::string_view bytes)>;

  // Runs `commands` (a pipeline) on the node serving the slot of `slot_key`, following
  // MOVED/ASK and retrying on connection failures within the options' bounds. Returns one reply
  // per command (error replies included, except redirections, which are followed).
  absl::StatusOr<std::vector<Reply>> Run(std::string_view slot_key,
                                         const std::vector<std::vector<std::string>>& commands,
                                         const BulkSink& sink = nullptr);
  // One command (an error reply becomes its status).
  absl::StatusOr<Reply> Command(std::string_view slot_key, const std::vector<std::string>& argv);

  // "cluster (3 masters)" / "single node" / the last connection error, for the start-up log.
  std::string Describe();

 private:
  struct Node;
  absl::StatusOr<Node*> NodeForSlot(uint16_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Node*> NodeAt(const std::string& address) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Connect(Node& node) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status RefreshSlots() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends the pipeline to `node` (with ASKING first when `asking`) and reads every reply.
  absl::StatusOr<std::vector<Reply>> Exchange(Node& node,
                                              const std::vector<std::vector<std::string>>& commands,
                                              bool asking, const BulkSink* sink = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ClientOptions options_;
  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<Node>> nodes_ ABSL_GUARDED_BY(mu_);  // by "host:port"
  // slot -> "host:port"; empty until the map is known. Single node: every slot -> the seed.
  std::vector<std::string> slots_ ABSL_GUARDED_BY(mu_);
  bool cluster_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvs::storage::redis

#endif  // KVSIDECAR_STORAGE_REDIS_REDIS_CLIENT_H_
