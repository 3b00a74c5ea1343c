// Authentication and tenant isolation of the gRPC ports: TLS / mutual-TLS server credentials
// from PEM files, per-tenant bearer tokens for the data plane (`authorization: Bearer <token>`
// metadata) and a separate admin token for Admin. The standard health and reflection services
// stay open (probes carry no credentials).
//
// Errors: a call without a valid token gets UNAUTHENTICATED (the message never says whether a
// token exists for some other tenant); a call naming a session that is not the caller's gets
// PERMISSION_DENIED with the same text whether the session exists or not, so a tenant cannot
// probe for other tenants' sessions.
//
// Threading: immutable after construction; every method is const and thread-safe.
#ifndef KVSIDECAR_SERVICE_AUTH_H_
#define KVSIDECAR_SERVICE_AUTH_H_

#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace kvs {

struct AuthConfig {
  std::map<std::string, std::string> tenant_tokens;  // tenant -> token; empty = data plane open
  std::string admin_token;                           // "" = Admin open
};

class Authenticator {
 public:
  explicit Authenticator(AuthConfig config) : config_(std::move(config)) {}

  bool data_auth() const { return !config_.tenant_tokens.empty(); }
  bool admin_auth() const { return !config_.admin_token.empty(); }

  // The tenant the call's token belongs to; nullopt when the data plane is open.
  // UNAUTHENTICATED for a missing, malformed or unknown token.
  absl::StatusOr<std::optional<std::string>> DataTenant(
      const grpc::CallbackServerContext& context) const;
  // OK when Admin is open or the call carries the admin token; UNAUTHENTICATED otherwise.
  absl::Status CheckAdmin(const grpc::CallbackServerContext& context) const;

  // PERMISSION_DENIED unless `caller` is nullopt (auth off) or equals `owner` (the session's
  // tenant; an error status = no such session). Same message for both refusals.
  static absl::Status CheckOwner(const std::optional<std::string>& caller,
                                 const absl::StatusOr<std::string>& owner,
                                 absl::string_view session_id);

 private:
  const AuthConfig config_;
};

// The token of `authorization: Bearer <token>`; "" if absent or another scheme.
std::string BearerToken(const grpc::CallbackServerContext& context);
// Equal strings, in time independent of where they differ.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

struct TlsFiles {
  std::string cert_file;  // "" = plaintext (InsecureServerCredentials)
  std::string key_file;
  std::string client_ca_file;  // set = require and verify a client certificate (mTLS)
};
// Reads the PEM files; FAILED_PRECONDITION naming the config key of a file that cannot be read.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files);

}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_AUTH_H_
