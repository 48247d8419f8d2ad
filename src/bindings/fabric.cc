// Bindings of the transfer engine and of its pure helpers (address blobs,
// sharding), which the unit tests call without MPI.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "../fabric/engine.h"
#include "../fabric/imm.h"
#include "../fabric/sharding.h"
#include "../fabric/wire.h"

namespace nb = nanobind;
using namespace moe_a2a::fabric;

namespace {

nb::bytes to_py(const Bytes& b) { return nb::bytes(reinterpret_cast<const char*>(b.data()), b.size()); }
Bytes from_py(const nb::bytes& b) {
  const auto* p = static_cast<const uint8_t*>(b.data());
  return Bytes(p, p + b.size());
}

}  // namespace

void bind_fabric(nb::module_& m) {
  using release = nb::call_guard<nb::gil_scoped_release>;

  m.def("libfabric_providers", &libfabric_providers, "Provider names libfabric offers on this machine.");
  m.def("libfabric_domains", &libfabric_domains, nb::arg("provider"),
        "Domain (device) names a provider offers for the engine's endpoints, in libfabric's order.");
  m.def("make_imm", &make_imm, nb::arg("tag"), nb::arg("peer"));
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

  nb::class_<TransferEngine>(m, "TransferEngine")
      .def(
          "__init__",
          [](TransferEngine* e, int rank, int world, const std::string& provider, int num_nics,
             uint64_t split_threshold, const std::vector<std::string>& domains) {
            new (e) TransferEngine(rank, world, EngineOptions{provider, num_nics, split_threshold, domains});
          },
          nb::arg("rank"), nb::arg("world"), nb::arg("provider") = "tcp", nb::arg("num_nics") = 1,
          nb::arg("split_threshold") = 1ull << 20, nb::arg("domains") = std::vector<std::string>{})
      .def_prop_ro("rank", &TransferEngine::rank)
      .def_prop_ro("world", &TransferEngine::world)
      .def_prop_ro("num_nics", &TransferEngine::num_nics)
      .def_prop_ro("provider", &TransferEngine::provider)
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
      .def(
          "register_region",
          [](TransferEngine& e, uintptr_t ptr, uint64_t length) {
            return e.register_region(reinterpret_cast<void*>(ptr), length);
          },
          nb::arg("ptr"), nb::arg("length"), release())
      .def("region_descriptor", [](const TransferEngine& e, uint32_t r) { return to_py(e.region_descriptor(r)); })
      .def(
          "add_remote_region",
          [](TransferEngine& e, int peer, const nb::bytes& d) { return e.add_remote_region(peer, from_py(d)); },
          nb::arg("peer"), nb::arg("descriptor"))
      .def("create_group", &TransferEngine::create_group, nb::arg("peers"), nb::arg("remote_regions"))
      .def("release", &TransferEngine::release, nb::arg("region"), nb::arg("group"))
      .def("write", &TransferEngine::write, nb::arg("region"), nb::arg("src_offset"), nb::arg("length"),
           nb::arg("remote"), nb::arg("dst_offset"), nb::arg("tag") = nb::none(), release())
      .def(
          "scatter",
          [](TransferEngine& e, uint32_t group, uint32_t region, const std::vector<ScatterItem>& items,
             std::optional<uint32_t> tag) {
            nb::gil_scoped_release r;
            e.scatter(group, region, items.data(), items.size(), tag);
          },
          nb::arg("group"), nb::arg("region"), nb::arg("items"), nb::arg("tag") = nb::none())
      .def(
          "barrier", [](TransferEngine& e, uint32_t group, uint32_t tag, double timeout_s) { e.barrier(group, tag, timeout_s); },
          nb::arg("group"), nb::arg("tag"), nb::arg("timeout_s"), release())
      .def(
          "wait_imm",
          [](TransferEngine& e, uint32_t tag, int peer, uint64_t count, double timeout_s) {
            e.wait_imm(tag, peer, count, timeout_s);
          },
          nb::arg("tag"), nb::arg("peer"), nb::arg("count"),
           nb::arg("timeout_s"), release())
      .def("imm_count", &TransferEngine::imm_count, nb::arg("tag"), nb::arg("peer"))
      .def_prop_ro("tx_submitted", &TransferEngine::tx_submitted)
      .def_prop_ro("tx_completed", &TransferEngine::tx_completed)
      .def("wait_tx", &TransferEngine::wait_tx, nb::arg("timeout_s"), release())
      .def_prop_ro("error", &TransferEngine::error);
}
