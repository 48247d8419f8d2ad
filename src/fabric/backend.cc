// The backend factory: names to implementations. Adding a transport (an
// ibverbs RC backend, say) is one entry here and a file beside
// libfabric_backend.cc; nothing above src/fabric changes.

#include "backend.h"
#include "error.h"

namespace moe_a2a::fabric {
namespace {

struct Entry {
  const char* name;
  std::unique_ptr<Backend> (*open)(const BackendOptions&);
};

constexpr Entry kBackends[] = {{"libfabric", &open_libfabric}};

// Named in plans and docs but not built: a clear error instead of "unknown".
constexpr const char* kPlanned[][2] = {
    {"ibverbs",
     "a direct libibverbs RC backend is planned (docs/transport.md) and not built: these machines have no "
     "RDMA device to test it on; use backend 'libfabric' with provider 'verbs' for InfiniBand/RoCE"},
};

}  // namespace

const char* memory_kind_name(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost:
      return "host";
    case MemoryKind::kCuda:
      return "cuda";
  }
  return "?";
}

std::vector<std::string> backend_names() {
  std::vector<std::string> names;
  for (const auto& e : kBackends) names.emplace_back(e.name);
  return names;
}

std::unique_ptr<Backend> open_backend(const BackendOptions& opts) {
  for (const auto& e : kBackends)
    if (opts.backend == e.name) return e.open(opts);
  std::string built;
  for (const auto& n : backend_names()) built += (built.empty() ? "'" : ", '") + n + "'";
  for (const auto& p : kPlanned)
    if (opts.backend == p[0]) throw FabricError("backend '" + opts.backend + "': " + p[1]);
  throw FabricError("backend: got '" + opts.backend + "'; expected one of the backends built: " + built);
}

}  // namespace moe_a2a::fabric
