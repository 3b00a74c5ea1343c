#include "tests/e2e/e2e_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "gpu/base/dtype.h"
#include "tests/test_backend.h"

namespace kvs_e2e {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// Value after "key=" up to the next whitespace, or empty.
std::string FieldOf(const std::string& line, const std::string& key) {
  const size_t at = line.find(key + "=");
  if (at == std::string::npos) return "";
  const size_t start = at + key.size() + 1;
  const size_t end = line.find_first_of(" \t\r\n", start);
  return line.substr(start, end == std::string::npos ? std::string::npos : end - start);
}

uint64_t Mix(uint64_t x, uint64_t part) {
  x = (x ^ part) * 0x9e3779b97f4a7c15ull;
  return x ^ (x >> 29);
}

}  // namespace

std::string BuildDir() {
  if (const char* dir = getenv("KVS_BUILD_DIR"); dir != nullptr && dir[0] != '\0') return dir;
  std::error_code error;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", error);
  // <build>/tests/e2e/<binary>
  return exe.parent_path().parent_path().parent_path().string();
}

namespace {

// The directories MakeTempDir made in this process. They hold the servers' logs, certificates
// and tokens: kept when a test failed (the logs are what explains it), removed at exit otherwise,
// so that a passing suite leaves nothing behind.
std::vector<std::string>& TempDirs() {
  static auto* dirs = new std::vector<std::string>();
  return *dirs;
}

void RemoveTempDirsIfPassed() {
  if (!::testing::UnitTest::GetInstance()->Passed()) return;
  for (const std::string& dir : TempDirs()) {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  }
}

}  // namespace

std::string MakeTempDir(const std::string& prefix) {
  const char* base = getenv("TEST_TMPDIR");
  std::string pattern =
      absl::StrCat(base != nullptr && base[0] != '\0' ? base : "/tmp", "/", prefix, "XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) return "";
  static const bool registered = (std::atexit(RemoveTempDirsIfPassed), true);
  (void)registered;
  TempDirs().push_back(pattern);
  return pattern;
}

// ---------------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Spawn(
    const std::vector<std::string>& argv, const std::string& log_dir, const std::string& name,
    int run_as_uid, const std::vector<std::string>& env) {
  if (argv.empty()) return absl::InvalidArgumentError("argv is empty");
  if (access(argv[0].c_str(), X_OK) != 0) {
    return absl::NotFoundError(
        absl::StrCat(argv[0], " is not an executable: ", std::strerror(errno)));
  }
  std::unique_ptr<ChildProcess> child(new ChildProcess());
  child->stdout_path_ = absl::StrCat(log_dir, "/", name, ".stdout");
  child->stderr_path_ = absl::StrCat(log_dir, "/", name, ".stderr");
  const int out = open(child->stdout_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int err = open(child->stderr_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out < 0 || err < 0) {
    if (out >= 0) close(out);
    if (err >= 0) close(err);
    return absl::InternalError(absl::StrCat("cannot create logs in ", log_dir));
  }
  // Everything the child needs is prepared before fork: only async-signal-safe calls after it.
  std::vector<char*> args;
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  // The inherited environment less the names `env` sets, then `env`.
  std::vector<char*> environment;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const absl::string_view inherited(*entry);
    const bool replaced = std::any_of(env.begin(), env.end(), [&](const std::string& set) {
      const size_t equals = set.find('=');
      return absl::StartsWith(inherited, set.substr(0, equals + 1));
    });
    if (!replaced) environment.push_back(*entry);
  }
  for (const std::string& entry : env) environment.push_back(const_cast<char*>(entry.c_str()));
  environment.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    close(out);
    close(err);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    if (run_as_uid >= 0) {
      const uid_t uid = static_cast<uid_t>(run_as_uid);
      if (setgroups(0, nullptr) != 0 || setgid(uid) != 0 || setuid(uid) != 0) _exit(126);
    }
    // Never outlive the test: a crashed or killed test must not leave a server behind. (Set
    // after setuid, which clears it.)
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    dup2(out, STDOUT_FILENO);
    dup2(err, STDERR_FILENO);
    execve(args[0], args.data(), environment.data());
    _exit(127);
  }
  close(out);
  close(err);
  child->pid_ = pid;
  return child;
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0 && !reaped_) {
    kill(pid_, SIGKILL);
    waitpid(pid_, &wait_status_, 0);
  }
}

std::string ChildProcess::Stdout() const { return ReadFile(stdout_path_); }
std::string ChildProcess::Stderr() const { return ReadFile(stderr_path_); }

bool ChildProcess::Running() {
  if (reaped_) return false;
  const pid_t done = waitpid(pid_, &wait_status_, WNOHANG);
  if (done == pid_ || (done < 0 && errno == ECHILD)) reaped_ = true;
  return !reaped_;
}

int ChildProcess::Wait(absl::Duration timeout) {
  if (!PollUntil([this] { return !Running(); }, timeout)) return -1;
  return wait_status_;
}

int ChildProcess::Stop(int signal, absl::Duration timeout) {
  if (Running()) kill(pid_, signal);
  return Wait(timeout);
}

// ---------------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(const Options& options) {
  std::unique_ptr<ServerProcess> server(new ServerProcess());
  server->dir_ = MakeTempDir("kvs-e2e-server-");
  if (server->dir_.empty()) return absl::InternalError("cannot create a temporary directory");
  const std::string binary = BuildDir() + "/service/kvsidecar";
  std::vector<std::string> argv = {binary, "--listen=127.0.0.1:0", "--admin_listen=127.0.0.1:0",
                                   "--data_dir=" + server->dir_ + "/data",
                                   absl::StrCat("--lease_ms=", options.lease_ms)};
  argv.insert(argv.end(), options.extra_args.begin(), options.extra_args.end());
  // The /device_sim and /cuda runs of the e2e tests (tests/e2e/CMakeLists.txt) serve on that
  // backend unless the test chose one itself.
  if (const std::string backend = kvs::testing_util::TestBackendName();
      backend != "cpu" &&
      std::none_of(options.extra_args.begin(), options.extra_args.end(),
                   [](const std::string& arg) { return arg.rfind("--backend", 0) == 0; })) {
    argv.push_back("--backend=" + backend);
  }
  if (options.run_as_uid >= 0) {
    // The server writes its data directory (and arena socket) under its own directory.
    const uid_t uid = static_cast<uid_t>(options.run_as_uid);
    if (chown(server->dir_.c_str(), uid, uid) != 0) {
      return absl::InternalError(absl::StrCat("chown ", server->dir_, ": ", std::strerror(errno)));
    }
  }
  auto process =
      ChildProcess::Spawn(argv, server->dir_, "kvsidecar", options.run_as_uid, options.env);
  if (!process.ok()) return process.status();
  server->process_ = std::move(*process);

  std::string line;
  const bool listening = PollUntil(
      [&] {
        const std::string out = server->process_->Stdout();
        const size_t at = out.find("kvsidecar listening");
        if (at != std::string::npos) {
          const size_t end = out.find('\n', at);
          if (end != std::string::npos) {
            line = out.substr(at, end - at);
            return true;
          }
        }
        return !server->process_->Running();
      },
      kStartTimeout);
  if (!listening || line.empty()) {
    return absl::UnavailableError(absl::StrCat(
        "the server did not report listening within ", absl::FormatDuration(kStartTimeout),
        " (running: ", server->process_->Running(), ")\n", server->Logs()));
  }
  server->data_target_ = FieldOf(line, "data");
  server->admin_target_ = FieldOf(line, "admin");
  server->metrics_target_ = FieldOf(line, "metrics");
  if (server->data_target_.empty() || server->admin_target_.empty()) {
    return absl::InternalError("cannot parse the listening line: " + line);
  }
  return server;
}

ServerProcess::~ServerProcess() {
  if (process_ != nullptr && process_->Stop(SIGTERM, absl::Seconds(20)) == -1) {
    process_->Stop(SIGKILL, absl::Seconds(20));
  }
  process_.reset();
  if (!dir_.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
}

std::string ServerProcess::Logs() const {
  if (process_ == nullptr) return "";
  return absl::StrCat("--- server stdout ---\n", process_->Stdout(), "--- server stderr ---\n",
                      process_->Stderr());
}

absl::StatusOr<std::unique_ptr<kvsidecar::Client>> ServerProcess::Connect() const {
  return kvsidecar::Client::Connect(data_target_, TestClientOptions());
}

absl::StatusOr<std::unique_ptr<kvsidecar::AdminClient>> ServerProcess::ConnectAdmin() const {
  return kvsidecar::AdminClient::Connect(admin_target_, TestClientOptions());
}

kvsidecar::ClientOptions TestClientOptions() {
  kvsidecar::ClientOptions options;
  options.connect_timeout = absl::Seconds(30);
  options.rpc_timeout = absl::Seconds(120);
  options.worker_name = "e2e";
  return options;
}

int CountArenaMemfds(pid_t pid) {
  const std::string directory = absl::StrCat("/proc/", pid, "/fd");
  DIR* dir = opendir(directory.c_str());
  if (dir == nullptr) return -1;
  int count = 0;
  while (const dirent* entry = readdir(dir)) {
    char target[256];
    const std::string link = absl::StrCat(directory, "/", entry->d_name);
    const ssize_t n = readlink(link.c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    target[n] = '\0';
    if (std::strncmp(target, "/memfd:kvsidecar", 16) == 0) ++count;
  }
  closedir(dir);
  return count;
}

bool PollUntil(const std::function<bool()>& condition, absl::Duration timeout,
               absl::Duration interval) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (condition()) return true;
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(interval);
  }
}

// ---------------------------------------------------------------------------------------------

v1::ModelLayout MakeLayout(int layers, int kv_heads, int q_heads, int head_dim, v1::DType dtype,
                           int block_tokens) {
  v1::ModelLayout layout;
  layout.set_num_layers(layers);
  layout.set_num_kv_heads(kv_heads);
  layout.set_num_q_heads(q_heads);
  layout.set_head_dim(head_dim);
  layout.set_dtype(dtype);
  layout.set_block_tokens(block_tokens);
  return layout;
}

v1::PolicySpec KeyDiffPolicy() {
  v1::PolicySpec policy;
  policy.set_name("keydiff");
  policy.mutable_keydiff();
  return policy;
}

v1::PolicySpec StreamingPolicy(int n_sink) {
  v1::PolicySpec policy;
  policy.set_name("streaming_llm");
  policy.mutable_streaming_llm()->set_n_sink(n_sink);
  return policy;
}

v1::Budget MakeBudget(int tokens_per_layer) {
  v1::Budget budget;
  budget.set_tokens_per_layer(tokens_per_layer);
  return budget;
}

std::vector<uint8_t> PatternRow(const v1::ModelLayout& layout, uint64_t seed, int layer, int kv,
                                int head, int position) {
  const auto dtype = static_cast<kvs::DType>(layout.dtype());
  std::vector<uint8_t> row(static_cast<size_t>(layout.head_dim()) * kvs::DTypeBytes(dtype));
  uint64_t base = Mix(Mix(Mix(Mix(seed + 0x51ed27, layer), kv), head), position);
  for (int d = 0; d < layout.head_dim(); ++d) {
    const uint64_t x = Mix(base, d);
    const float value = static_cast<float>(x >> 40) / static_cast<float>(1 << 24) * 4.0f - 2.0f;
    kvs::StoreFromFloat(row.data(), dtype, d, value);
  }
  return row;
}

std::string PatternPayload(const v1::ModelLayout& layout, uint64_t seed,
                           const std::vector<int>& layers, const std::vector<int>& positions) {
  std::vector<int> all;
  if (layers.empty()) {
    for (int layer = 0; layer < layout.num_layers(); ++layer) all.push_back(layer);
  }
  std::string payload;
  for (int layer : layers.empty() ? all : layers) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int head = 0; head < layout.num_kv_heads(); ++head) {
        for (int position : positions) {
          const auto row = PatternRow(layout, seed, layer, kv, head, position);
          payload.append(reinterpret_cast<const char*>(row.data()), row.size());
        }
      }
    }
  }
  return payload;
}

absl::Status WritePattern(kvsidecar::Session& session, const kvsidecar::Reservation& reservation,
                          uint64_t seed) {
  for (const v1::LayerSlots& slots : reservation.response().layers()) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int head = 0; head < session.layout().num_kv_heads(); ++head) {
        for (int i = 0; i < reservation.num_tokens(); ++i) {
          const auto row = PatternRow(session.layout(), seed, slots.layer(), kv, head,
                                      reservation.positions()[i]);
          absl::Status status = session.WriteReserved(reservation, slots.layer(), kv, head, i, row);
          if (!status.ok()) return status;
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::CommitResponse> WriteTokens(kvsidecar::Session& session, const std::string& seq,
                                               int num_tokens, uint64_t seed,
                                               bool compress_if_over_budget) {
  auto reservation = session.Reserve(seq, num_tokens);
  if (!reservation.ok()) return reservation.status();
  absl::Status written = WritePattern(session, *reservation, seed);
  if (!written.ok()) return written;
  return session.Commit(*reservation, compress_if_over_budget);
}

absl::StatusOr<Verified> VerifySequence(kvsidecar::Session& session, const std::string& seq,
                                        uint64_t seed) {
  const v1::ModelLayout& layout = session.layout();
  const int heads = layout.num_kv_heads();
  auto in_place = session.GetLayout(seq);
  if (!in_place.ok()) return in_place.status();
  auto exported = session.Export(seq);
  if (!exported.ok()) return exported.status();
  if (exported->header.layers_size() != in_place->layers_size()) {
    return absl::DataLossError("Export and GetLayout list different layers");
  }
  Verified verified;
  for (int li = 0; li < in_place->layers_size(); ++li) {
    const v1::LayerLayout& layer = in_place->layers(li);
    const v1::LayerLayout& header = exported->header.layers(li);
    const int count = layer.count();
    const std::string where = absl::StrCat("sequence ", seq, " layer ", layer.layer());
    if (header.layer() != layer.layer() || header.count() != count) {
      return absl::DataLossError(absl::StrCat(where, ": Export header disagrees with GetLayout"));
    }
    if (layer.positions_size() != heads * count || header.positions_size() != heads * count) {
      return absl::DataLossError(absl::StrCat(where, ": position table has ",
                                              layer.positions_size(), " entries, expected ",
                                              heads * count));
    }
    const int block_tokens = layout.block_tokens();
    if (layer.block_table_size() < (count + block_tokens - 1) / block_tokens) {
      return absl::DataLossError(absl::StrCat(where, ": block table too short"));
    }
    verified.counts.push_back(count);
    verified.positions.emplace_back(heads);
    for (int head = 0; head < heads; ++head) {
      std::set<int> seen;
      for (int slot = 0; slot < count; ++slot) {
        const int position = layer.positions(head * count + slot);
        if (header.positions(head * count + slot) != position) {
          return absl::DataLossError(
              absl::StrCat(where, " head ", head, " slot ", slot, ": Export position differs"));
        }
        if (!seen.insert(position).second) {
          return absl::DataLossError(
              absl::StrCat(where, " head ", head, ": position ", position, " held twice"));
        }
        verified.positions.back()[head].push_back(position);
        for (int kv = 0; kv < 2; ++kv) {
          const auto expected = PatternRow(layout, seed, layer.layer(), kv, head, position);
          // ReadRowInto: a copy, which a device (CUDA IPC) arena needs; ReadRow is a host view.
          std::vector<uint8_t> in_place(expected.size());
          if (absl::Status read =
                  session.ReadRowInto(layer, kv, head, slot, absl::MakeSpan(in_place));
              !read.ok()) {
            return read;
          }
          auto streamed = exported->Row(li, kv, head, slot);
          if (!streamed.ok()) return streamed.status();
          const std::string what = absl::StrCat(where, " head ", head, " slot ", slot, " position ",
                                                position, kv == 0 ? " K" : " V");
          if (in_place != expected) {
            return absl::DataLossError(what + ": the row read in place differs from the write");
          }
          if (streamed->size() != expected.size() ||
              std::memcmp(streamed->data(), expected.data(), expected.size()) != 0) {
            return absl::DataLossError(what + ": the exported row differs from the write");
          }
        }
        ++verified.rows;
      }
    }
  }
  return verified;
}

std::string MessageOf(const absl::Status& status) { return std::string(status.message()); }

}  // namespace kvs_e2e
