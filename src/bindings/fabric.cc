// Bindings of the transfer engine and of its pure helpers (address blobs,
// sharding), which the unit tests call without MPI.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "../fabric/engine.h"
#include "../fabric/error.h"
#include "../fabric/imm.h"
#include "../fabric/memory_engine.h"
#include "../fabric/sharding.h"
#include "../fabric/wire.h"
#include "a2a/wait.h"
#include "keep_signals.h"

namespace nb = nanobind;
using namespace moe_a2a::fabric;
using moe_a2a::bindings::KeepSignals;

namespace {

nb::bytes to_py(const Bytes& b) { return nb::bytes(reinterpret_cast<const char*>(b.data()), b.size()); }
Bytes from_py(const nb::bytes& b) {
  const auto* p = static_cast<const uint8_t*>(b.data());
  return Bytes(p, p + b.size());
}

// A handle class: built from its number, compared and hashed by it, so
// Python can keep handles in sets and dicts; only its own kind is accepted.
template <typename H>
void bind_handle(nb::module_& m, const char* name, const char* doc) {
  nb::class_<H>(m, name, doc)
      .def("__init__", [](H* h, uint32_t value) { new (h) H{value}; }, nb::arg("value"))
      .def_prop_ro("value", [](const H& h) { return h.value; })
      .def("__eq__", [](const H& a, const H& b) { return a.value == b.value; }, nb::is_operator())
      .def("__hash__", [](const H& h) { return nb::hash(nb::int_(h.value)); })
      .def("__repr__", [name](const H& h) { return std::string(name) + "(" + std::to_string(h.value) + ")"; });
}

nb::dict capabilities_dict(const Capabilities& c) {
  nb::dict d;
  d["backend"] = c.backend;
  d["provider"] = c.provider;
  d["device"] = c.device;
  d["gpu_memory"] = c.gpu_memory;
  d["gpu_memory_why"] = c.gpu_memory_why;
  d["gpu_dmabuf"] = c.gpu_dmabuf;
  d["ordered_writes"] = c.ordered_writes;
  d["max_message_size"] = c.max_message_size;
  d["inject_size"] = c.inject_size;
  d["imm_bytes"] = c.imm_bytes;
  d["max_in_flight"] = c.max_in_flight;
  d["blocking_wait"] = c.blocking_wait;
  return d;
}

Delivery delivery(const std::string& order) {
  if (order == "posted") return Delivery::kPosted;
  if (order == "reversed") return Delivery::kReversed;
  if (order == "shuffled") return Delivery::kShuffled;
  throw FabricError("release: order: got '" + order + "'; expected 'posted', 'reversed' or 'shuffled'");
}

MemoryKind memory_kind(const std::string& kind) {
  if (kind == "host") return MemoryKind::kHost;
  if (kind == "cuda") return MemoryKind::kCuda;
  throw FabricError("register_region: kind: got '" + kind + "'; expected 'host' or 'cuda'");
}

// What libfabric and the backends offer here, and the immediate's layout.
void bind_probes(nb::module_& m) {
  // Calls that may start libfabric or a provider keep the signal dispositions (keep_signals.h).
  m.def(
      "libfabric_providers", [] { KeepSignals keep; return libfabric_providers(); },
      "Provider names libfabric offers on this machine.");
  m.def(
      "libfabric_domains", [](const std::string& p) { KeepSignals keep; return libfabric_domains(p); }, nb::arg("provider"),
        "Domain (device) names a provider offers for the engine's endpoints, in libfabric's order.");
  m.def("backend_names", &backend_names, "Backends built into this module (open_backend's names).");
  m.def(
      "backend_capabilities",
      [](const std::string& provider, const std::string& domain, const std::string& backend, bool gpu_memory) {
        Capabilities c;
        {
          nb::gil_scoped_release r;
          KeepSignals keep;
          c = open_backend({backend, provider, 0, domain, gpu_memory})->capabilities();
        }
        return capabilities_dict(c);
      },
      nb::arg("provider"), nb::arg("domain") = "", nb::arg("backend") = "libfabric", nb::arg("gpu_memory") = false,
      "Opens one endpoint of `provider` (on `domain`, default the first) and returns what its backend reports "
      "(`gpu_memory`: as a CUDA rank opens it, asking for FI_HMEM).");
  m.def("make_imm", &make_imm, nb::arg("tag"), nb::arg("peer"));
  m.attr("IMM_PIECE_BIT") = kImmPieceBit;
  m.attr("MAX_RANKS") = kMaxRanks;
}

// The receiver's counters, for unit tests of piece counting without a fabric.
void bind_imm_counters(nb::module_& m) {
  nb::class_<ImmCounters>(m, "ImmCounters")
      .def(nb::init<int>(), nb::arg("num_nics"))
      .def("add", &ImmCounters::add, nb::arg("wire_imm"), "Counts one arrival as it came off the wire.")
      .def("count", &ImmCounters::peek, nb::arg("imm"), "Whole writes of `imm` counted.")
      .def(
          "wait",
          [](ImmCounters& c, uint32_t imm, uint64_t n, double timeout_s) {
            uint64_t seen = 0;
            return c.wait(imm, n, std::chrono::nanoseconds(static_cast<int64_t>(timeout_s * 1e9)), [] {}, &seen);
          },
          nb::arg("imm"), nb::arg("count"), nb::arg("timeout_s"), nb::call_guard<nb::gil_scoped_release>(),
          "Waits for and consumes `count` writes; False on timeout.");
}

// The handles, and the pure helpers of a write: its pieces, its NIC, the peers' address blobs.
void bind_write_plan(nb::module_& m) {
  bind_handle<RegionId>(m, "Region", "A memory region registered with this rank's engine.");
  bind_handle<RemoteRegionId>(m, "RemoteRegion", "A peer's region, as its descriptor told us.");
  bind_handle<GroupId>(m, "Group", "Peers bound to their remote regions, with the requests built once.");
  m.def(
      "split_write",
      [](int slot, uint64_t length, int num_nics, uint64_t threshold) {
        std::vector<std::tuple<int, uint64_t, uint64_t>> out;
        for (const auto& p : split_write(slot, length, num_nics, threshold)) out.emplace_back(p.nic, p.offset, p.length);
        return out;
      },
      nb::arg("slot"), nb::arg("length"), nb::arg("num_nics"), nb::arg("threshold"),
      "Pieces (nic, offset, length) of one write.");
  m.def("nic_for_peer", &nic_for_peer, nb::arg("slot"), nb::arg("num_nics"));
  m.def("peer_slot", &peer_slot, nb::arg("rank"), nb::arg("peer"), nb::arg("world"));
  m.def("rail_slot", &rail_slot, nb::arg("rank"), nb::arg("peer"), nb::arg("world"), nb::arg("per_node"));
  m.def(
      "encode_address",
      [](const std::string& provider, const std::vector<nb::bytes>& nics) {
        AddressBlob a{provider, {}};
        for (const auto& n : nics) a.nics.push_back(from_py(n));
        return to_py(encode_address(a));
      },
      nb::arg("provider"), nb::arg("nics"));
  m.def(
      "decode_address",
      [](const nb::bytes& blob) {
        AddressBlob a = decode_address(from_py(blob), "address blob");
        std::vector<nb::bytes> nics;
        for (const auto& n : a.nics) nics.push_back(to_py(n));
        return std::make_pair(a.provider, nics);
      },
      nb::arg("blob"));
}

void bind_scatter_item(nb::module_& m) {
  nb::class_<ScatterItem>(m, "ScatterItem")
      .def(nb::init<>())
      .def(
          "__init__",
          [](ScatterItem* s, uint32_t peer, uint64_t src_offset, uint64_t length, uint64_t dst_offset) {
            new (s) ScatterItem{peer, src_offset, length, dst_offset};
          },
          nb::arg("peer"), nb::arg("src_offset"), nb::arg("length"), nb::arg("dst_offset"))
      .def_rw("peer", &ScatterItem::peer)
      .def_rw("src_offset", &ScatterItem::src_offset)
      .def_rw("length", &ScatterItem::length)
      .def_rw("dst_offset", &ScatterItem::dst_offset);
}

// The proxy's view of an engine (proxy_engine.h): what CpuAllToAll and
// CudaAllToAll take, a TransferEngine or a MemoryEngine alike.
void bind_proxy_engine(nb::module_& m) {
  using release = nb::call_guard<nb::gil_scoped_release>;
  nb::class_<ProxyEngine>(m, "ProxyEngine")
      .def_prop_ro("rank", &ProxyEngine::rank)
      .def_prop_ro("world", &ProxyEngine::world)
      .def("write", &ProxyEngine::write, nb::arg("region"), nb::arg("src_offset"), nb::arg("length"),
           nb::arg("remote"), nb::arg("dst_offset"), nb::arg("tag") = nb::none(), release())
      .def(
          "scatter",
          [](ProxyEngine& e, GroupId group, RegionId region, const std::vector<ScatterItem>& items,
             std::optional<uint32_t> tag) {
            nb::gil_scoped_release r;
            e.scatter(group, region, items.data(), items.size(), tag);
          },
          nb::arg("group"), nb::arg("region"), nb::arg("items"), nb::arg("tag") = nb::none())
      .def(
          "barrier",
          [](ProxyEngine& e, GroupId group, uint32_t tag, double timeout_s) {
            moe_a2a::a2a::Backoff looks;  // Ctrl-C ends the wait (wait.h)
            e.barrier(group, tag, timeout_s, [&looks] { looks.poll_interrupt(); });
          },
          nb::arg("group"), nb::arg("tag"), nb::arg("timeout_s"), release())
      .def(
          "wait_imm",
          [](ProxyEngine& e, uint32_t tag, int peer, uint64_t count, double timeout_s) {
            moe_a2a::a2a::Backoff looks;  // Ctrl-C ends the wait (wait.h)
            e.wait_imm(tag, peer, count, timeout_s, [&looks] { looks.poll_interrupt(); });
          },
          nb::arg("tag"), nb::arg("peer"), nb::arg("count"), nb::arg("timeout_s"), release())
      .def("imm_count", &ProxyEngine::imm_count, nb::arg("tag"), nb::arg("peer"))
      .def("wait_tx", &ProxyEngine::wait_tx, nb::arg("timeout_s"), release())
      .def_prop_ro("tx_submitted", &ProxyEngine::tx_submitted)
      .def_prop_ro("tx_completed", &ProxyEngine::tx_completed)
      .def_prop_ro("error", &ProxyEngine::error);
}

void bind_transfer_engine(nb::module_& m) {
  nb::class_<TransferEngine, ProxyEngine>(m, "TransferEngine")
      .def(
          "__init__",
          [](TransferEngine* e, int rank, int world, const std::string& provider, int num_nics,
             uint64_t split_threshold, const std::vector<std::string>& domains, const std::string& backend,
             bool gpu_memory) {
            KeepSignals keep;
            new (e) TransferEngine(rank, world,
                                   EngineOptions{backend, provider, num_nics, split_threshold, domains, gpu_memory});
          },
          nb::arg("rank"), nb::arg("world"), nb::arg("provider") = "tcp", nb::arg("num_nics") = 1,
          nb::arg("split_threshold") = 1ull << 20, nb::arg("domains") = std::vector<std::string>{},
          nb::arg("backend") = "libfabric", nb::arg("gpu_memory") = false)
      .def_prop_ro("num_nics", &TransferEngine::num_nics)
      .def_prop_ro("provider", &TransferEngine::provider)
      .def_prop_ro("backend", &TransferEngine::backend)
      .def(
          "capabilities", [](const TransferEngine& e, int nic) { return capabilities_dict(e.capabilities(nic)); },
          nb::arg("nic") = 0, "What NIC `nic`'s backend reports it can do.")
      .def("address", [](const TransferEngine& e) { return to_py(e.address()); })
      .def(
          "connect",
          [](TransferEngine& e, const std::vector<nb::bytes>& addrs) {
            std::vector<Bytes> v;
            for (const auto& a : addrs) v.push_back(from_py(a));
            nb::gil_scoped_release r;
            e.connect(v);
          },
          nb::arg("addresses"))
      .def("watch_peers", &TransferEngine::watch_peers, nb::arg("fds"),
           "Connected sockets, one per peer on another host (index = rank, -1 for none), whose EOF means "
           "the peer is gone; the engine owns and closes them.")
      .def("peer_gone", &TransferEngine::peer_gone, nb::arg("peer"),
           "Whether the peer's control connection (watch_peers) has closed.")
      .def("leave", &TransferEngine::leave,
           "This process is ending after its writes were handed over (wait_tx first): tell the peers on "
           "other hosts, whose waits then let those writes land after its control connection closes.")
      .def("peer_left", &TransferEngine::peer_left, nb::arg("peer"),
           "Whether the peer said goodbye (leave) on its control connection before it went.")
      .def("forgive_peer", &TransferEngine::forgive_peer, nb::arg("peer"),
           "The peer is gone and every survivor masked it: failures of writes to it, past and future, no "
           "longer fail the engine (every instance that shares it).")
      .def(
          "reconnect_peer",
          [](TransferEngine& e, int peer, const nb::bytes& address) { e.reconnect_peer(peer, from_py(address)); },
          nb::arg("peer"), nb::arg("address"),
          "Rank `peer` is a new process (moe_a2a.rejoin): writes go to its `address` and its failures count "
          "again; nothing where the address is unchanged.")
      .def("watch_peer", &TransferEngine::watch_peer, nb::arg("peer"), nb::arg("fd"),
           "A replaced peer's liveness connection (as watch_peers); the old one closes.")
      .def("forget_peer_imm", &TransferEngine::forget_peer_imm, nb::arg("peer"), nb::arg("tag"), nb::arg("mask"),
           "Drop the counted arrivals from `peer` whose tag & mask == tag (a replaced rank's old process's).")
      .def(
          "register_region",
          [](TransferEngine& e, uintptr_t ptr, uint64_t length, const std::string& kind, int device,
             const std::string& name) {
            MemoryKind k = memory_kind(kind);
            nb::gil_scoped_release r;
            return e.register_region(reinterpret_cast<void*>(ptr), length, k, device, name);
          },
          nb::arg("ptr"), nb::arg("length"), nb::arg("kind") = "host", nb::arg("device") = -1,
          nb::arg("name") = "region")
      .def("region_descriptor", [](const TransferEngine& e, RegionId r) { return to_py(e.region_descriptor(r)); })
      .def(
          "add_remote_region",
          [](TransferEngine& e, int peer, const nb::bytes& d) { return e.add_remote_region(peer, from_py(d)); },
          nb::arg("peer"), nb::arg("descriptor"))
      .def("create_group", &TransferEngine::create_group, nb::arg("peers"), nb::arg("remote_regions"),
           nb::arg("rails") = 0,
           "rails: ranks per node where the group's data goes only to the peers with our local index on "
           "other nodes (rows per node), whose NICs are then spread by node distance (0: by plain distance).")
      .def("release", &TransferEngine::release, nb::arg("region"), nb::arg("group").none())
      .def("arrivals", &TransferEngine::arrivals, nb::arg("nic"), "Immediates that arrived on NIC `nic` (debug).")
      .def_prop_ro("hot_path_allocations", &TransferEngine::hot_path_allocations,
                   "Times a queue of the write path grew (a heap allocation); 0 once the groups are registered.");
}

}  // namespace

// The in-memory fabric (memory_engine.h): every rank of a world in this
// process, for the protocol tests in tests/protocol.
void bind_memory_fabric(nb::module_& m) {
  using release = nb::call_guard<nb::gil_scoped_release>;
  nb::class_<MemoryEngine, ProxyEngine>(m, "MemoryEngine")
      .def(
          "register_region",
          [](MemoryEngine& e, uintptr_t ptr, uint64_t length) {
            return e.register_region(reinterpret_cast<void*>(ptr), length);
          },
          nb::arg("ptr"), nb::arg("length"))
      .def("add_remote_region", &MemoryEngine::add_remote_region, nb::arg("peer"), nb::arg("peer_region"),
           "Peer's region, by the Region its own engine returned.")
      .def("create_group", &MemoryEngine::create_group, nb::arg("peers"), nb::arg("remote_regions"))
      .def("release", &MemoryEngine::release, nb::arg("region"), nb::arg("group").none());

  nb::class_<MemoryFabric>(m, "MemoryFabric", "Every rank of a world in this process; writes delivered in memory.")
      .def(nb::init<int>(), nb::arg("world"))
      .def_prop_ro("world", &MemoryFabric::world)
      .def("engine", &MemoryFabric::engine, nb::arg("rank"), nb::rv_policy::reference_internal)
      .def("hold", &MemoryFabric::hold, nb::arg("src"), nb::arg("dst") = -1,
           "Writes from src (to dst; -1: anyone) are held from now on.")
      .def(
          "release",
          [](MemoryFabric& f, int src, int dst, const std::string& order, uint64_t seed) {
            Delivery d = delivery(order);
            nb::gil_scoped_release r;
            return f.release(src, dst, d, seed);
          },
          nb::arg("src"), nb::arg("dst") = -1, nb::arg("order") = "posted", nb::arg("seed") = 0,
          "Delivers the held writes from src (to dst) in order 'posted', 'reversed' or 'shuffled' (by seed) and "
          "stops holding them; returns how many.")
      .def("held", &MemoryFabric::held, nb::arg("src") = -1, nb::arg("dst") = -1)
      .def("wait_held", &MemoryFabric::wait_held, nb::arg("src"), nb::arg("dst"), nb::arg("count"),
           nb::arg("timeout_s") = 30.0, release(), "True once count writes from src (to dst; -1: any) are held.")
      .def("fail_writes", &MemoryFabric::fail_writes, nb::arg("src"), nb::arg("dst"), nb::arg("why"),
           "Every later write from src to dst (-1: anyone) fails its sender's engine with `why`.")
      .def("kill", &MemoryFabric::kill, nb::arg("rank"), release(),
           "The rank is gone: its held writes are lost, its engine fails, writes to it fail.")
      .def("wait_blocked", &MemoryFabric::wait_blocked, nb::arg("rank"), nb::arg("peer") = -1,
           nb::arg("timeout_s") = 30.0, release(),
           "True once rank waits for peer (-1: anyone) and found nothing; False after timeout_s.")
      .def("log", [](const MemoryFabric& f) {
        std::vector<std::tuple<int, int, int, uint64_t>> out;
        for (const Delivered& d : f.log()) out.emplace_back(d.src, d.dst, d.tag, d.length);
        return out;
      }, "Every write delivered so far, in order: (src, dst, tag or -1, length).");
}

void bind_fabric(nb::module_& m) {
  // In this order: ProxyEngine before the engines derived from it; the stub (_core.pyi) follows it.
  bind_probes(m);
  bind_imm_counters(m);
  bind_write_plan(m);
  bind_scatter_item(m);
  bind_proxy_engine(m);
  bind_transfer_engine(m);
  bind_memory_fabric(m);
}
