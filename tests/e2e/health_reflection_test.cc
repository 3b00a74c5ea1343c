// End to end: the real server answers standard gRPC health checks (grpc.health.v1) and server
// reflection on both ports. The calls are raw (generic stub, hand-encoded protobuf) so the test
// needs neither service's generated code.
#include <google/protobuf/unknown_field_set.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <set>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

using ::google::protobuf::UnknownField;
using ::google::protobuf::UnknownFieldSet;

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  for (const grpc::Slice& slice : slices) {
    out.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return out;
}

grpc::ByteBuffer BufferOf(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

void SetDeadline(grpc::ClientContext* context) {
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
}

// Waits for the completion queue event tagged `tag`; the calls below run one op at a time.
bool Await(grpc::CompletionQueue* cq, intptr_t tag) {
  void* got = nullptr;
  bool ok = false;
  if (!cq->Next(&got, &ok)) return false;
  return ok && reinterpret_cast<intptr_t>(got) == tag;
}

void Drain(grpc::CompletionQueue* cq) {
  cq->Shutdown();
  void* tag;
  bool ok;
  while (cq->Next(&tag, &ok)) {
  }
}

// grpc.health.v1.Health/Check for `service`; the HealthCheckResponse.status value.
absl::StatusOr<int> HealthStatus(const std::string& target, const std::string& service) {
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  SetDeadline(&context);
  grpc::CompletionQueue cq;
  std::string request;  // HealthCheckRequest { string service = 1; }
  if (!service.empty()) {
    request.push_back(0x0a);
    request.push_back(static_cast<char>(service.size()));
    request += service;
  }
  auto call =
      stub.PrepareUnaryCall(&context, "/grpc.health.v1.Health/Check", BufferOf(request), &cq);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  const bool done = Await(&cq, 1);
  Drain(&cq);
  if (!done) return absl::InternalError("health call did not complete");
  if (!status.ok()) return kvsidecar::ToStatus(status);
  UnknownFieldSet fields;
  if (!fields.ParseFromString(Flatten(response))) {
    return absl::InternalError("cannot parse HealthCheckResponse");
  }
  for (int i = 0; i < fields.field_count(); ++i) {
    if (fields.field(i).number() == 1 && fields.field(i).type() == UnknownField::TYPE_VARINT) {
      return static_cast<int>(fields.field(i).varint());
    }
  }
  return 0;  // proto3 default: UNKNOWN
}

// ServerReflectionInfo with list_services; the service names. `version` is "v1alpha" or "v1".
absl::StatusOr<std::set<std::string>> ListServices(const std::string& target,
                                                   const std::string& version) {
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  SetDeadline(&context);
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(
      &context, "/grpc.reflection." + version + ".ServerReflection/ServerReflectionInfo", &cq);
  call->StartCall(reinterpret_cast<void*>(1));
  bool ok = Await(&cq, 1);
  // ServerReflectionRequest { string list_services = 7; } = "*"
  const std::string request = {0x3a, 0x01, '*'};
  grpc::ByteBuffer response;
  if (ok) {
    call->Write(BufferOf(request), reinterpret_cast<void*>(2));
    ok = Await(&cq, 2);
  }
  bool have_response = false;
  if (ok) {
    call->Read(&response, reinterpret_cast<void*>(3));
    have_response = Await(&cq, 3);
    call->WritesDone(reinterpret_cast<void*>(4));
    Await(&cq, 4);
  }
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  Await(&cq, 5);
  Drain(&cq);
  if (!status.ok()) return kvsidecar::ToStatus(status);
  if (!have_response) return absl::InternalError("no reflection response");
  // ServerReflectionResponse { ListServiceResponse list_services_response = 6; }
  // ListServiceResponse { repeated ServiceResponse service = 1; } ServiceResponse { name = 1 }
  UnknownFieldSet top;
  if (!top.ParseFromString(Flatten(response))) return absl::InternalError("bad response");
  std::set<std::string> names;
  for (int i = 0; i < top.field_count(); ++i) {
    if (top.field(i).number() != 6) continue;
    UnknownFieldSet list;
    if (!list.ParseFromString(top.field(i).length_delimited())) continue;
    for (int j = 0; j < list.field_count(); ++j) {
      if (list.field(j).number() != 1) continue;
      UnknownFieldSet service;
      if (!service.ParseFromString(list.field(j).length_delimited())) continue;
      for (int k = 0; k < service.field_count(); ++k) {
        if (service.field(k).number() == 1) names.insert(service.field(k).length_delimited());
      }
    }
  }
  return names;
}

absl::StatusOr<std::set<std::string>> ListServicesAnyVersion(const std::string& target) {
  auto names = ListServices(target, "v1alpha");
  if (names.ok() || names.status().code() != absl::StatusCode::kUnimplemented) return names;
  return ListServices(target, "v1");
}

constexpr int kServing = 1;

class HealthReflectionTest : public SharedServerTest<HealthReflectionTest> {};

TEST_F(HealthReflectionTest, HealthCheckIsServingOnBothPorts) {
  ASSERT_NE(server_, nullptr);
  auto overall = HealthStatus(server_->data_target(), "");
  ASSERT_TRUE(overall.ok()) << overall.status();
  EXPECT_EQ(*overall, kServing);
  auto sidecar = HealthStatus(server_->data_target(), "kvsidecar.v1.Sidecar");
  ASSERT_TRUE(sidecar.ok()) << sidecar.status();
  EXPECT_EQ(*sidecar, kServing);
  auto admin = HealthStatus(server_->admin_target(), "kvsidecar.v1.Admin");
  ASSERT_TRUE(admin.ok()) << admin.status();
  EXPECT_EQ(*admin, kServing);
  auto unknown = HealthStatus(server_->data_target(), "no.such.Service");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
}

TEST_F(HealthReflectionTest, ReflectionListsTheServices) {
  ASSERT_NE(server_, nullptr);
  auto data = ListServicesAnyVersion(server_->data_target());
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_TRUE(data->count("kvsidecar.v1.Sidecar")) << ::testing::PrintToString(*data);
  EXPECT_TRUE(data->count("grpc.health.v1.Health")) << ::testing::PrintToString(*data);
  auto admin = ListServicesAnyVersion(server_->admin_target());
  ASSERT_TRUE(admin.ok()) << admin.status();
  EXPECT_TRUE(admin->count("kvsidecar.v1.Admin")) << ::testing::PrintToString(*admin);
}

}  // namespace
}  // namespace kvs_e2e
