// ReflectionV1Service: gRPC server reflection, protocol version v1 (grpc.reflection.v1), served
// from the process's generated descriptor pool. The gRPC release the project builds on (Debian
// bookworm's 1.51) ships only the v1alpha service (grpc++_reflection), which the servers keep
// serving too; current clients (grpcurl, grpcui, Postman) ask for v1 first.
//
// Answers list_services (the names given at construction), file_by_filename,
// file_containing_symbol (messages, enums, services, methods, fields), file_containing_extension
// and all_extension_numbers_of_type. A file descriptor response carries the file and every file
// it imports, transitively, each once per stream. A request that cannot be answered gets an
// error_response (NOT_FOUND, INVALID_ARGUMENT) on the stream, which stays open, as in v1alpha.
//
// Threading: the service is stateless apart from its constant service list; every stream keeps
// its own state. Thread-safe.
#ifndef KVSIDECAR_SERVICE_REFLECTION_V1_H_
#define KVSIDECAR_SERVICE_REFLECTION_V1_H_

#include <string>
#include <vector>

#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace kvs {

class ReflectionV1Service final : public grpc::reflection::v1::ServerReflection::Service {
 public:
  // `services`: the full names of the services the server registers (listed by list_services).
  explicit ReflectionV1Service(std::vector<std::string> services);

  grpc::Status ServerReflectionInfo(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<grpc::reflection::v1::ServerReflectionResponse,
                               grpc::reflection::v1::ServerReflectionRequest>* stream) override;

  static constexpr char kServiceName[] = "grpc.reflection.v1.ServerReflection";

 private:
  const std::vector<std::string> services_;
};

}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_REFLECTION_V1_H_
