// kvs_e2e_worker: a model-worker stand-in for the reclaim tests. Attaches to the sidecar with the
// client library (arena mapped, Watch stream open, heartbeats running) with a long lease, writes
// a sequence through the mapped arena, leaves a second reservation pending, prints
//   READY session=<id> shm=<path>
// and waits to be killed. Usage: kvs_e2e_worker <target> <lease_ms>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "kvsidecar/client.h"
#include "tests/e2e/e2e_util.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s <target> <lease_ms>\n", argv[0]);
    return 2;
  }
  using namespace kvs_e2e;
  auto client = kvsidecar::Client::Connect(argv[1], TestClientOptions());
  if (!client.ok()) {
    std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
    return 1;
  }
  auto session = (*client)->Attach(MakeLayout(4, 2, 4, 64, v1::DTYPE_FLOAT16), "e2e-worker",
                                   /*num_blocks=*/64, std::atoi(argv[2]));
  if (!session.ok()) {
    std::fprintf(stderr, "attach: %s\n", session.status().ToString().c_str());
    return 1;
  }
  auto created = (*session)->CreateSequence(KeyDiffPolicy(), MakeBudget(32), "doomed");
  auto committed = created.ok() ? WriteTokens(**session, "doomed", 48, 3) : created.status();
  auto pending = committed.ok() ? (*session)->Reserve("doomed", 16) : committed.status();
  if (!pending.ok()) {
    std::fprintf(stderr, "write: %s\n", pending.status().ToString().c_str());
    return 1;
  }
  std::printf("READY session=%s shm=%s\n", (*session)->session_id().c_str(),
              (*session)->arena().shm_path().c_str());
  std::fflush(stdout);
  while (true) pause();
}
