// End to end: TLS, mutual TLS and bearer tokens on the real kvsidecar binary, with certificates
// made at test time by openssl. Calls without valid credentials get UNAUTHENTICATED; a tenant
// touching another tenant's session gets PERMISSION_DENIED, worded exactly as for a session that
// does not exist; Admin wants its own token.
#include <grpcpp/grpcpp.h>
#include <grpcpp/security/credentials.h>
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvsidecar/v1/admin.grpc.pb.h"
#include "kvsidecar/v1/sidecar.grpc.pb.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

using ::testing::HasSubstr;

std::string ReadAll(const std::string& path) {
  std::ifstream file(path);
  return std::string((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
}

void Write(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

// A CA, a server certificate for localhost / 127.0.0.1 and a client certificate, all signed by
// the CA (P-256 keys: fast to make).
bool MakeCertificates(const std::string& dir) {
  Write(dir + "/server.ext", "subjectAltName=DNS:localhost,IP:127.0.0.1\n");
  const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  const std::string cmd = absl::StrCat(
      "cd '", dir, "' && ", "openssl req -x509 ", ec,
      " -keyout ca.key -out ca.pem -days 2 -subj /CN=kvs-test-ca && ", "openssl req ", ec,
      " -keyout server.key -out server.csr -subj /CN=localhost && ",
      "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 ",
      "-extfile server.ext -out server.pem && ", "openssl req ", ec,
      " -keyout client.key -out client.csr -subj /CN=kvs-test-client && ",
      "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 ",
      "-out client.pem", " > openssl.log 2>&1");
  return std::system(cmd.c_str()) == 0;
}

class AuthE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("kvs-auth-e2e-");
    ASSERT_TRUE(MakeCertificates(dir_)) << ReadAll(dir_ + "/openssl.log");
    Write(dir_ + "/tokens.yaml", "team-a: token-aaaa\nteam-b: token-bbbb\n");
    Write(dir_ + "/admin.token", "admin-secret-1\n");
  }

  std::unique_ptr<ServerProcess> StartServer(bool mtls) {
    ServerProcess::Options options;
    options.extra_args = {"--tls_cert_file=" + dir_ + "/server.pem",
                          "--tls_key_file=" + dir_ + "/server.key",
                          "--tenant_tokens_file=" + dir_ + "/tokens.yaml",
                          "--admin_token_file=" + dir_ + "/admin.token"};
    if (mtls) options.extra_args.push_back("--tls_client_ca_file=" + dir_ + "/ca.pem");
    auto server = ServerProcess::Start(options);
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? std::move(*server) : nullptr;
  }

  std::shared_ptr<grpc::Channel> TlsChannel(const std::string& target, bool client_cert) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = ReadAll(dir_ + "/ca.pem");
    if (client_cert) {
      ssl.pem_private_key = ReadAll(dir_ + "/client.key");
      ssl.pem_cert_chain = ReadAll(dir_ + "/client.pem");
    }
    grpc::ChannelArguments args;
    args.SetSslTargetNameOverride("localhost");
    return grpc::CreateCustomChannel(target, grpc::SslCredentials(ssl), args);
  }

  static void Prepare(grpc::ClientContext* context, const std::string& token) {
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    if (!token.empty()) context->AddMetadata("authorization", "Bearer " + token);
  }

  static grpc::Status ReserveAs(v1::Sidecar::Stub& data, const std::string& token,
                                const v1::ReserveRequest& request, v1::ReserveResponse* reserved) {
    grpc::ClientContext context;
    Prepare(&context, token);
    return data.Reserve(&context, request, reserved);
  }

  // The layout `request` names, read as `token` and serialised: what must not change.
  static std::string LayoutAs(v1::Sidecar::Stub& data, const std::string& token,
                              const v1::GetLayoutRequest& request) {
    grpc::ClientContext context;
    Prepare(&context, token);
    v1::GetLayoutResponse response;
    EXPECT_TRUE(data.GetLayout(&context, request, &response).ok());
    return response.SerializeAsString();
  }

  // A refusal of a foreign or missing session `id`: PERMISSION_DENIED, with the same message
  // (`id` left out) as the first refusal, kept in *first, so the two cannot be told apart.
  static void ExpectRefusedAlike(const grpc::Status& status, const std::string& id,
                                 const char* what, std::string* first) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED)
        << what << ": " << status.error_message();
    const std::string message = absl::StrReplaceAll(status.error_message(), {{id, "ID"}});
    if (first->empty()) *first = message;
    EXPECT_EQ(message, *first) << what;
  }

  grpc::Status Attach(v1::Sidecar::Stub& stub, const std::string& token, const std::string& tenant,
                      std::string* session_id) {
    grpc::ClientContext context;
    Prepare(&context, token);
    v1::AttachRequest request;
    *request.mutable_layout() = MakeLayout(2, 2, 4, 16, v1::DTYPE_FLOAT16, 4);
    request.set_num_blocks(16);
    request.set_tenant(tenant);
    v1::AttachResponse response;
    grpc::Status status = stub.Attach(&context, request, &response);
    if (session_id != nullptr) *session_id = response.session_id();
    return status;
  }

  grpc::Status Heartbeat(v1::Sidecar::Stub& stub, const std::string& token,
                         const std::string& session_id) {
    grpc::ClientContext context;
    Prepare(&context, token);
    v1::HeartbeatRequest request;
    request.set_session_id(session_id);
    v1::HeartbeatResponse response;
    return stub.Heartbeat(&context, request, &response);
  }

  std::string dir_;
};

TEST_F(AuthE2eTest, TlsWithTenantTokensAndAdminToken) {
  auto server = StartServer(/*mtls=*/false);
  ASSERT_NE(server, nullptr);
  auto data = v1::Sidecar::NewStub(TlsChannel(server->data_target(), false));
  auto admin = v1::Admin::NewStub(TlsChannel(server->admin_target(), false));

  // No token, a wrong token, another scheme: UNAUTHENTICATED.
  EXPECT_EQ(Attach(*data, "", "", nullptr).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Attach(*data, "token-zzzz", "", nullptr).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Basic token-aaaa");
    v1::HeartbeatRequest request;
    request.set_session_id("x");
    v1::HeartbeatResponse response;
    EXPECT_EQ(data->Heartbeat(&context, request, &response).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }

  // Team A attaches; the token's tenant wins over the request's tenant field.
  std::string session_a;
  const grpc::Status attached = Attach(*data, "token-aaaa", "team-b", &session_a);
  ASSERT_TRUE(attached.ok()) << attached.error_message();
  EXPECT_TRUE(Heartbeat(*data, "token-aaaa", session_a).ok());

  // Team B on team A's session, and on a session that does not exist: the same refusal.
  const grpc::Status foreign = Heartbeat(*data, "token-bbbb", session_a);
  EXPECT_EQ(foreign.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  const std::string missing_id(session_a.size(), '0');
  const grpc::Status missing = Heartbeat(*data, "token-bbbb", missing_id);
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(absl::StrReplaceAll(foreign.error_message(), {{session_a, "ID"}}),
            absl::StrReplaceAll(missing.error_message(), {{missing_id, "ID"}}));
  {
    grpc::ClientContext context;
    Prepare(&context, "token-bbbb");
    v1::CreateSequenceRequest request;
    request.set_session_id(session_a);
    v1::CreateSequenceResponse response;
    EXPECT_EQ(data->CreateSequence(&context, request, &response).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext context;
    Prepare(&context, "token-bbbb");
    v1::DetachRequest request;
    request.set_session_id(session_a);
    v1::DetachResponse response;
    EXPECT_EQ(data->Detach(&context, request, &response).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  // Streams and batches: the same refusal.
  {
    grpc::ClientContext context;
    Prepare(&context, "token-bbbb");
    v1::AppendResponse response;
    auto writer = data->Append(&context, &response);
    v1::AppendChunk chunk;
    chunk.mutable_header()->set_session_id(session_a);
    chunk.mutable_header()->set_sequence_id("s");
    chunk.mutable_header()->set_num_tokens(1);
    writer->Write(chunk);
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext context;
    Prepare(&context, "token-bbbb");
    v1::ExportRequest request;
    request.set_session_id(session_a);
    request.set_sequence_id("s");
    auto reader = data->Export(&context, request);
    v1::ExportChunk chunk;
    while (reader->Read(&chunk)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext context;
    Prepare(&context, "token-bbbb");
    v1::DecodeStepRequest request;
    request.add_items()->set_session_id(session_a);
    v1::DecodeStepResponse response;
    EXPECT_EQ(data->DecodeStep(&context, request, &response).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  // Team A's own calls go through.
  {
    grpc::ClientContext context;
    Prepare(&context, "token-aaaa");
    v1::CreateSequenceRequest request;
    request.set_session_id(session_a);
    request.set_sequence_id("s");
    v1::CreateSequenceResponse response;
    const grpc::Status status = data->CreateSequence(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
  }

  // Admin: tenant tokens are not admin credentials.
  auto list = [&](const std::string& token, v1::ListSessionsResponse* response) {
    grpc::ClientContext context;
    Prepare(&context, token);
    return admin->ListSessions(&context, v1::ListSessionsRequest(), response);
  };
  v1::ListSessionsResponse sessions;
  EXPECT_EQ(list("", &sessions).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(list("token-aaaa", &sessions).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  const grpc::Status listed = list("admin-secret-1", &sessions);
  ASSERT_TRUE(listed.ok()) << listed.error_message();
  ASSERT_EQ(sessions.sessions_size(), 1);
  EXPECT_EQ(sessions.sessions(0).tenant(), "team-a");
  {
    grpc::ClientContext context;
    Prepare(&context, "admin-secret-1");
    v1::GetConfigResponse config;
    ASSERT_TRUE(admin->GetConfig(&context, v1::GetConfigRequest(), &config).ok());
    EXPECT_TRUE(config.tls());
    EXPECT_FALSE(config.mtls());
    EXPECT_TRUE(config.data_auth());
    EXPECT_TRUE(config.admin_auth());
    EXPECT_THAT(config.effective_config_yaml(), ::testing::Not(HasSubstr("token-aaaa")));
    EXPECT_THAT(config.effective_config_yaml(), ::testing::Not(HasSubstr("admin-secret-1")));
  }

  // A plaintext client cannot talk to the TLS port.
  auto plain = v1::Sidecar::NewStub(
      grpc::CreateChannel(server->data_target(), grpc::InsecureChannelCredentials()));
  EXPECT_EQ(Attach(*plain, "token-aaaa", "", nullptr).error_code(), grpc::StatusCode::UNAVAILABLE);
}

// In the tests below: unary call `Method` on the stub `data` as `token`, its response dropped.
#define KVS_CALL(Method, token, request)               \
  [&] {                                                \
    grpc::ClientContext context;                       \
    Prepare(&context, token);                          \
    v1::Method##Response response;                     \
    return data->Method(&context, request, &response); \
  }()

// Every call that checks the caller's tenant on the session handle it then uses: team B naming
// team A's session (alone, or beside its own session in a batch) is refused as for a missing
// session and changes nothing of A's: the layout, the pending reservation, the sequences.
TEST_F(AuthE2eTest, AForeignSessionOnEveryCallThatUsesItsHandleChangesNothing) {
  auto server = StartServer(/*mtls=*/false);
  ASSERT_NE(server, nullptr);
  auto data = v1::Sidecar::NewStub(TlsChannel(server->data_target(), false));
  std::string session_a, session_b;
  ASSERT_TRUE(Attach(*data, "token-aaaa", "", &session_a).ok());
  ASSERT_TRUE(Attach(*data, "token-bbbb", "", &session_b).ok());
  const std::string a = "token-aaaa", b = "token-bbbb";
  // Team A: a sequence of 4 committed tokens and one reservation pending, in each session.
  for (const auto& [token, session] : {std::pair{a, session_a}, std::pair{b, session_b}}) {
    v1::CreateSequenceRequest create;
    create.set_session_id(session);
    create.set_sequence_id("s");
    ASSERT_TRUE(KVS_CALL(CreateSequence, token, create).ok());
  }
  v1::ReserveRequest reserve;
  reserve.set_session_id(session_a);
  reserve.set_sequence_id("s");
  reserve.set_num_tokens(4);
  v1::ReserveResponse reserved;
  ASSERT_TRUE(ReserveAs(*data, a, reserve, &reserved).ok());
  v1::CommitRequest commit;
  commit.set_session_id(session_a);
  commit.set_sequence_id("s");
  commit.set_reservation_id(reserved.reservation_id());
  ASSERT_TRUE(KVS_CALL(Commit, a, commit).ok());
  reserve.set_num_tokens(1);
  ASSERT_TRUE(ReserveAs(*data, a, reserve, &reserved).ok());
  commit.set_reservation_id(reserved.reservation_id());
  v1::GetLayoutRequest get_layout;
  get_layout.set_session_id(session_a);
  get_layout.set_sequence_id("s");
  auto layout_of_a = [&] { return LayoutAs(*data, a, get_layout); };
  const std::string before = layout_of_a();

  // What team B sends, each with A's session id and with an id no session has.
  const std::string missing_id(session_a.size(), '0');
  std::string foreign_message;
  auto refused = [&](const grpc::Status& status, const std::string& id, const char* what) {
    ExpectRefusedAlike(status, id, what, &foreign_message);
  };
  for (const std::string& id : {session_a, missing_id}) {
    v1::ReserveRequest r = reserve;
    r.set_session_id(id);
    refused(KVS_CALL(Reserve, b, r), id, "Reserve");
    r.add_layers(0);
    refused(KVS_CALL(Reserve, b, r), id, "Reserve(layers)");
    v1::CommitRequest c = commit;
    c.set_session_id(id);
    refused(KVS_CALL(Commit, b, c), id, "Commit");
    v1::CancelReservationRequest cancel;
    cancel.set_session_id(id);
    cancel.set_sequence_id("s");
    cancel.set_reservation_id(reserved.reservation_id());
    refused(KVS_CALL(CancelReservation, b, cancel), id, "CancelReservation");
    v1::BatchReserveRequest batch_reserve;  // B's own session first, then the foreign one
    v1::ReserveRequest* own = batch_reserve.add_requests();
    *own = reserve;
    own->set_session_id(session_b);
    *batch_reserve.add_requests() = r;
    batch_reserve.mutable_requests(1)->clear_layers();
    refused(KVS_CALL(BatchReserve, b, batch_reserve), id, "BatchReserve");
    v1::BatchCommitRequest batch_commit;
    *batch_commit.add_requests() = c;
    refused(KVS_CALL(BatchCommit, b, batch_commit), id, "BatchCommit");
    v1::CompressRequest compress;
    compress.set_session_id(id);
    compress.set_sequence_id("s");
    compress.set_budget_tokens(1);
    refused(KVS_CALL(Compress, b, compress), id, "Compress");
    v1::BatchCompressRequest batch_compress;
    *batch_compress.add_requests() = compress;
    refused(KVS_CALL(BatchCompress, b, batch_compress), id, "BatchCompress");
    v1::ScoreRequest score;
    score.set_session_id(id);
    score.set_sequence_id("s");
    score.set_budget_tokens(1);
    refused(KVS_CALL(Score, b, score), id, "Score");
    v1::SelectRequest select;
    select.add_items()->set_session_id(id);
    select.mutable_items(0)->set_sequence_id("s");
    refused(KVS_CALL(Select, b, select), id, "Select");
    v1::DecodeStepRequest decode;
    decode.add_items()->set_session_id(id);
    decode.mutable_items(0)->set_sequence_id("s");
    refused(KVS_CALL(DecodeStep, b, decode), id, "DecodeStep");
    v1::CreateSequenceRequest create;
    create.set_session_id(id);
    create.set_sequence_id("planted");
    refused(KVS_CALL(CreateSequence, b, create), id, "CreateSequence");
    create.mutable_budget()->add_per_layer_tokens(4);
    create.mutable_budget()->add_per_layer_tokens(4);
    refused(KVS_CALL(CreateSequence, b, create), id, "CreateSequence(per_layer_tokens)");
    v1::GetLayoutRequest layout = get_layout;
    layout.set_session_id(id);
    refused(KVS_CALL(GetLayout, b, layout), id, "GetLayout");
    {
      grpc::ClientContext context;
      Prepare(&context, b);
      v1::ExportRequest request;
      request.set_session_id(id);
      request.set_sequence_id("s");
      auto reader = data->Export(&context, request);
      v1::ExportChunk chunk;
      while (reader->Read(&chunk)) {
      }
      refused(reader->Finish(), id, "Export");
    }
  }
  // Restore into B's own session from A's live session: the answer a missing copy gets.
  v1::RestoreRequest restore;
  restore.set_session_id(session_b);
  restore.set_sequence_id("s");
  restore.set_from_session_id(session_a);
  const grpc::Status adopted = KVS_CALL(Restore, b, restore);
  EXPECT_EQ(adopted.error_code(), grpc::StatusCode::NOT_FOUND) << adopted.error_message();
  EXPECT_THAT(adopted.error_message(), HasSubstr("no spilled copy of sequence s"));

  // Nothing of A's changed: the same layout, the reservation still pending (A commits it), no
  // sequence "planted", and B's own item of the refused BatchReserve reserved nothing.
  EXPECT_EQ(layout_of_a(), before);
  {
    grpc::ClientContext context;
    Prepare(&context, a);
    v1::CommitResponse response;
    const grpc::Status status = data->Commit(&context, commit, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.counts(0), 5);
  }
  {
    grpc::ClientContext context;
    Prepare(&context, a);
    v1::GetLayoutRequest request = get_layout;
    request.set_sequence_id("planted");
    v1::GetLayoutResponse response;
    EXPECT_EQ(data->GetLayout(&context, request, &response).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext context;
    Prepare(&context, b);
    v1::ReserveRequest request = reserve;
    request.set_session_id(session_b);
    v1::ReserveResponse response;
    const grpc::Status status = data->Reserve(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
  }
}

// The session and tier calls, which use the handle of the tenant check's lookup: team B naming
// team A's session (or a missing one) is refused as for a missing session, before any parameter
// is looked at (a bad target, prefix key or query window with a foreign or missing session is
// PERMISSION_DENIED too), and nothing of A's changes: its sequence, its published prefix, its
// lease, its Watch stream.
TEST_F(AuthE2eTest, AForeignSessionOnTheSessionAndTierCallsChangesNothing) {
  auto server = StartServer(/*mtls=*/false);
  ASSERT_NE(server, nullptr);
  auto data = v1::Sidecar::NewStub(TlsChannel(server->data_target(), false));
  std::string session_a, session_b;
  ASSERT_TRUE(Attach(*data, "token-aaaa", "", &session_a).ok());
  ASSERT_TRUE(Attach(*data, "token-bbbb", "", &session_b).ok());
  const std::string a = "token-aaaa", b = "token-bbbb";
  // Team A: a sequence of 4 committed tokens, published under `key`.
  v1::CreateSequenceRequest create;
  create.set_session_id(session_a);
  create.set_sequence_id("s");
  ASSERT_TRUE(KVS_CALL(CreateSequence, a, create).ok());
  v1::ReserveRequest reserve;
  reserve.set_session_id(session_a);
  reserve.set_sequence_id("s");
  reserve.set_num_tokens(4);
  v1::ReserveResponse reserved;
  ASSERT_TRUE(ReserveAs(*data, a, reserve, &reserved).ok());
  v1::CommitRequest commit;
  commit.set_session_id(session_a);
  commit.set_sequence_id("s");
  commit.set_reservation_id(reserved.reservation_id());
  ASSERT_TRUE(KVS_CALL(Commit, a, commit).ok());
  const std::string key(64, 'a');
  v1::PublishRequest publish;
  publish.set_session_id(session_a);
  publish.set_sequence_id("s");
  publish.set_prefix_key(key);
  const grpc::Status published = KVS_CALL(Publish, a, publish);
  ASSERT_TRUE(published.ok()) << published.error_message();
  v1::GetLayoutRequest get_layout;
  get_layout.set_session_id(session_a);
  get_layout.set_sequence_id("s");
  auto layout_of_a = [&] { return LayoutAs(*data, a, get_layout); };
  const std::string before = layout_of_a();
  // A's Watch stream, which B's Watch or Detach must not end.
  grpc::ClientContext watch_context;
  Prepare(&watch_context, a);
  v1::WatchRequest watch_a;
  watch_a.set_session_id(session_a);
  auto watcher = data->Watch(&watch_context, watch_a);

  const std::string missing_id(session_a.size(), '0');
  std::string foreign_message;
  auto refused = [&](const grpc::Status& status, const std::string& id, const char* what) {
    ExpectRefusedAlike(status, id, what, &foreign_message);
  };
  for (const std::string& id : {session_a, missing_id}) {
    v1::ReleaseSequenceRequest release;
    release.set_session_id(id);
    release.set_sequence_id("s");
    refused(KVS_CALL(ReleaseSequence, b, release), id, "ReleaseSequence");
    v1::GetRetainedRequest retained;
    retained.set_session_id(id);
    retained.set_sequence_id("s");
    refused(KVS_CALL(GetRetained, b, retained), id, "GetRetained");
    v1::SpillRequest spill;
    spill.set_session_id(id);
    spill.set_sequence_id("s");
    spill.set_target(v1::TIER_HOST);
    refused(KVS_CALL(Spill, b, spill), id, "Spill");
    spill.set_target(v1::TIER_ARENA);
    refused(KVS_CALL(Spill, b, spill), id, "Spill(bad target)");
    v1::RestoreRequest restore;
    restore.set_session_id(id);
    restore.set_sequence_id("s");
    refused(KVS_CALL(Restore, b, restore), id, "Restore");
    restore.set_adopt_any_session(true);
    refused(KVS_CALL(Restore, b, restore), id, "Restore(adopt_any_session)");
    v1::PublishRequest p = publish;
    p.set_session_id(id);
    p.set_prefix_key(std::string(64, 'b'));
    refused(KVS_CALL(Publish, b, p), id, "Publish");
    p.set_prefix_key("not-a-key");
    refused(KVS_CALL(Publish, b, p), id, "Publish(bad prefix_key)");
    p.set_prefix_key(key);
    p.set_query_window(-1);
    refused(KVS_CALL(Publish, b, p), id, "Publish(bad query_window)");
    v1::UnpublishRequest unpublish;
    unpublish.set_session_id(id);
    unpublish.set_prefix_key(key);
    refused(KVS_CALL(Unpublish, b, unpublish), id, "Unpublish");
    unpublish.set_prefix_key("not-a-key");
    refused(KVS_CALL(Unpublish, b, unpublish), id, "Unpublish(bad prefix_key)");
    v1::HeartbeatRequest heartbeat;
    heartbeat.set_session_id(id);
    refused(KVS_CALL(Heartbeat, b, heartbeat), id, "Heartbeat");
    v1::DetachRequest detach;
    detach.set_session_id(id);
    refused(KVS_CALL(Detach, b, detach), id, "Detach");
    {
      grpc::ClientContext context;
      Prepare(&context, b);
      v1::WatchRequest request;
      request.set_session_id(id);
      auto reader = data->Watch(&context, request);
      v1::SessionEvent event;
      while (reader->Read(&event)) {
      }
      refused(reader->Finish(), id, "Watch");
    }
  }

  // Nothing of A's changed: the same layout, the prefix still there (A deletes it), the session
  // and its Watch stream still open until A detaches it, with its one sequence.
  EXPECT_EQ(layout_of_a(), before);
  v1::UnpublishRequest unpublish;
  unpublish.set_session_id(session_a);
  unpublish.set_prefix_key(key);
  const grpc::Status unpublished = KVS_CALL(Unpublish, a, unpublish);
  EXPECT_TRUE(unpublished.ok()) << unpublished.error_message();
  EXPECT_TRUE(Heartbeat(*data, a, session_a).ok());
  {
    grpc::ClientContext context;
    Prepare(&context, a);
    v1::DetachRequest request;
    request.set_session_id(session_a);
    v1::DetachResponse response;
    const grpc::Status status = data->Detach(&context, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.sequences_released(), 1);
  }
  v1::SessionEvent event;
  while (watcher->Read(&event)) {
  }
  // A's own Detach ends A's stream with OK; a foreign Watch or Detach would have ended it first.
  const grpc::Status watch_end = watcher->Finish();
  EXPECT_TRUE(watch_end.ok()) << watch_end.error_message();
}

TEST_F(AuthE2eTest, MutualTlsRefusesClientsWithoutACertificate) {
  auto server = StartServer(/*mtls=*/true);
  ASSERT_NE(server, nullptr);
  auto without = v1::Sidecar::NewStub(TlsChannel(server->data_target(), false));
  EXPECT_EQ(Attach(*without, "token-aaaa", "", nullptr).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  auto with = v1::Sidecar::NewStub(TlsChannel(server->data_target(), true));
  const grpc::Status status = Attach(*with, "token-aaaa", "", nullptr);
  EXPECT_TRUE(status.ok()) << status.error_message();
  auto admin = v1::Admin::NewStub(TlsChannel(server->admin_target(), true));
  grpc::ClientContext context;
  Prepare(&context, "admin-secret-1");
  v1::GetConfigResponse config;
  ASSERT_TRUE(admin->GetConfig(&context, v1::GetConfigRequest(), &config).ok());
  EXPECT_TRUE(config.mtls());
}

TEST_F(AuthE2eTest, UnreadableCertificateExits2NamingTheKey) {
  std::vector<std::string> argv = {BuildDir() + "/service/kvsidecar",
                                   "--listen=127.0.0.1:0",
                                   "--admin_listen=127.0.0.1:0",
                                   "--data_dir=" + dir_ + "/data",
                                   "--tls_cert_file=" + dir_ + "/nope.pem",
                                   "--tls_key_file=" + dir_ + "/server.key"};
  auto process = ChildProcess::Spawn(argv, dir_, "kvsidecar");
  ASSERT_TRUE(process.ok()) << process.status();
  const int status = (*process)->Wait(kStartTimeout);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 2);
  EXPECT_THAT((*process)->Stderr(), HasSubstr("tls.cert_file"));
}

#undef KVS_CALL

}  // namespace
}  // namespace kvs_e2e
