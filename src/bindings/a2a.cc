// Bindings of the dispatch/combine core: configuration, the shared-memory
// workspace and the CPU implementation. Tensors stay in Python; only their
// data pointers cross.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <cstring>

#include "a2a/cpu/convert.h"
#include "a2a/cpu/cpu_all_to_all.h"
#include "a2a/errors.h"
#include "a2a/live_ranks.h"
#include "a2a/peer_watch.h"
#include "a2a/memory_plan.h"
#include "a2a/signals.h"
#include "a2a/workspace.h"
#include "pointers.h"

namespace nb = nanobind;
using namespace moe_a2a::a2a;

namespace {

using moe_a2a::bindings::ptr;
using moe_a2a::bindings::row_math;

// Below bind_a2a, which calls it.
void bind_cpu_all_to_all(nb::module_& m);

// The CPU number formats, exposed so tests can hold them against torch.
void bind_number_formats(nb::module_& m) {
  m.def(
      "f32_to_e4m3",
      [](const nb::bytes& f32) {
        size_t n = f32.size() / sizeof(float);
        std::string out(n, '\0');
        const auto* in = static_cast<const float*>(f32.data());
        for (size_t i = 0; i < n; ++i) out[i] = static_cast<char>(cpu::f32_to_e4m3(in[i]));
        return nb::bytes(out.data(), out.size());
      },
      nb::arg("f32"), "fp32 values (bytes) to e4m3fn codes (bytes), as the CPU dispatch quantises.");
  m.def(
      "quantize_fp8_rows",
      [](const nb::bytes& f32, int hidden) {
        A2AConfig cfg;
        cfg.hidden = hidden;
        cfg.dispatch_dtype = DType::kFp8;
        size_t rows = f32.size() / (sizeof(float) * hidden);
        std::string q(rows * hidden, '\0'), scales(rows * cfg.num_scales() * sizeof(float), '\0');
        std::vector<uint8_t> row(cfg.dispatch_row_bytes());
        std::vector<float> scratch(hidden);
        for (size_t r = 0; r < rows; ++r) {
          const auto* x = static_cast<const float*>(f32.data()) + r * hidden;
          cpu::encode_row(x, DType::kFp32, nullptr, cfg, row.data(), scratch.data());
          std::memcpy(q.data() + r * hidden, row.data(), hidden);
          std::memcpy(scales.data() + r * cfg.num_scales() * sizeof(float), row.data() + hidden,
                      cfg.num_scales() * sizeof(float));
        }
        return std::make_pair(nb::bytes(q.data(), q.size()), nb::bytes(scales.data(), scales.size()));
      },
      nb::arg("f32"), nb::arg("hidden"),
      "fp32 rows (bytes) to (e4m3 codes, fp32 block scales), as dispatch packs them.");
  m.def(
      "f32_to_bf16",
      [](const nb::bytes& f32) {
        size_t n = f32.size() / sizeof(float);
        std::string out(n * 2, '\0');
        const auto* in = static_cast<const float*>(f32.data());
        auto* o = reinterpret_cast<uint16_t*>(out.data());
        for (size_t i = 0; i < n; ++i) o[i] = cpu::f32_to_bf16(in[i]);
        return nb::bytes(out.data(), out.size());
      },
      nb::arg("f32"));
}

}  // namespace

void bind_a2a(nb::module_& m) {
  nb::exception<CapacityError>(m, "CapacityError", PyExc_RuntimeError);
  nb::exception<StaleGraphError>(m, "StaleGraphError", PyExc_RuntimeError);
  nb::exception<PeerFailedError>(m, "PeerFailedError", PyExc_RuntimeError);
  // Facts the Python side shares with the kernels, exported from their one home (config.h).
  m.attr("FP8_BLOCK") = kFp8Block;
  m.attr("FP8_MAX") = kFp8Max;
  m.attr("MASKED_EXPERT") = moe_a2a::a2a::kMaskedExpert;
  m.def(
      "instance_tags",
      [](int instance) {
        return std::make_pair(moe_a2a::a2a::wire_tag(instance, static_cast<moe_a2a::a2a::Tag>(0)),
                              moe_a2a::a2a::kInstanceTagMask);
      },
      nb::arg("instance"), "(tag, mask) that every immediate tag of instance slot `instance` matches (signals.h).");
  m.def(
      "fence_tag", [](int instance) { return moe_a2a::a2a::wire_tag(instance, moe_a2a::a2a::kTagFence); },
      nb::arg("instance"),
      "The fence tag of instance slot `instance`: the survivors' zero-byte write after a loss (moe_a2a.masking).");
  bind_number_formats(m);

  nb::enum_<DType>(m, "DType").value("bf16", DType::kBf16).value("fp32", DType::kFp32).value("fp8", DType::kFp8);
  nb::enum_<FabricRows>(m, "FabricRows")
      .value("expert", FabricRows::kExpert)
      .value("rank", FabricRows::kRank)
      .value("node", FabricRows::kNode);

  nb::class_<A2AConfig>(m, "A2AConfig")
      .def(nb::init<>())
      .def_rw("rank", &A2AConfig::rank)
      .def_rw("world", &A2AConfig::world)
      .def_rw("ranks_per_node", &A2AConfig::ranks_per_node)
      .def_rw("max_tokens", &A2AConfig::max_tokens)
      .def_rw("hidden", &A2AConfig::hidden)
      .def_rw("num_experts", &A2AConfig::num_experts)
      .def_rw("topk", &A2AConfig::topk)
      .def_rw("dispatch_dtype", &A2AConfig::dispatch_dtype)
      .def_rw("combine_dtype", &A2AConfig::combine_dtype)
      .def_rw("expert_padding", &A2AConfig::expert_padding)
      .def_rw("max_private_tokens", &A2AConfig::max_private_tokens)
      .def_rw("max_recv_tokens", &A2AConfig::max_recv_tokens)
      .def_rw("timeout_s", &A2AConfig::timeout_s)
      .def_rw("instance", &A2AConfig::instance)
      .def_rw("slice_bytes", &A2AConfig::slice_bytes)
      .def_rw("fabric_rows", &A2AConfig::fabric_rows)
      .def_prop_ro("routing_width", &A2AConfig::routing_width)
      .def_prop_ro("max_output_rows", &A2AConfig::max_output_rows)
      .def_prop_ro_static("max_instances", [](nb::handle) { return kMaxInstances; })
      .def_prop_ro("dispatch_row_bytes", &A2AConfig::dispatch_row_bytes)
      .def_prop_ro("combine_row_bytes", &A2AConfig::combine_row_bytes)
      .def_prop_ro("workspace_bytes", [](const A2AConfig& c) { return Layout::of(c).total; })
      .def_prop_ro("caller_timeout_s", &A2AConfig::caller_timeout_s,
                   "How long a rank waits for its proxy, and a closed instance's memory stays (the deadline rule).")
      .def("validate", &A2AConfig::validate);

  // Bytes one rank allocates for a configuration, before anything is (memory_plan.h).
  m.def(
      "plan_memory",
      [](const A2AConfig& c, bool cuda, bool share_rows, bool has_remote) {
        c.validate();
        const MemoryPlan p = plan_memory(c, cuda, share_rows, has_remote);
        return std::map<std::string, size_t>{
            {"workspace", p.workspace},        {"host_shared", p.host_shared},
            {"host_private", p.host_private},  {"fabric_registered", p.fabric_registered},
            {"cuda_pinned", p.cuda_pinned},    {"peer_mapped", p.peer_mapped},
            {"device_workspace", p.device_workspace}, {"device_scratch", p.device_scratch}};
      },
      nb::arg("config"), nb::arg("cuda"), nb::arg("share_rows"), nb::arg("has_remote"),
      "Bytes per rank by kind (memory_plan.h), for config as this rank would open it.");

  nb::class_<Workspace>(m, "Workspace")
      .def(nb::init<const A2AConfig&, const std::string&, bool>(), nb::arg("config"), nb::arg("name"),
           nb::arg("share_rows") = true)
      .def_prop_ro("name", &Workspace::name)
      .def_prop_ro("ptr", [](const Workspace& w) { return reinterpret_cast<uintptr_t>(w.self()); })
      .def_prop_ro("size", &Workspace::size)
      .def_prop_ro("routing_offset", [](const Workspace& w) { return w.layout().routing; })
      .def("map_node", &Workspace::map_node, nb::arg("names"))
      .def("unlink", &Workspace::unlink)
      .def("reopen_path", &Workspace::reopen_path)
      .def("remap_peer", &Workspace::remap_peer, nb::arg("rank"), nb::arg("name"),
           "Same-node `rank` was replaced (moe_a2a.rejoin): map `name` (its reopen_path) in its place.")
      .def("forget_sender", &Workspace::forget_sender, nb::arg("sender"),
           "Drop the abort record a replaced rank's old process left in our workspace.");

  bind_cpu_all_to_all(m);

  // Mask and continue (live_ranks.h): every survivor of the node gets the same answer.
  m.def(
      "agree_on_live",
      [](const Workspace& ws, const std::vector<int>& pids, const std::vector<uint8_t>& dead, uint64_t epoch,
         uint64_t first_round, double timeout_s) {
        const A2AConfig& c = ws.config();
        for (int r = 0; r < c.world; ++r)
          if (!c.same_node(r))
            throw std::invalid_argument("agree_on_live: rank " + std::to_string(r) +
                                        " is on another node; survivors agree over the node's shared memory only");
        auto gone = [&pids](int r) {
          return r < static_cast<int>(pids.size()) && pids[r] > 0 && PeerWatch::gone(pids[r]);
        };
        Agreement a;
        {
          nb::gil_scoped_release unlocked;
          a = agree_on_live(c, ws.layout(), ws.node(), dead, epoch, first_round, timeout_s, gone);
        }
        return std::make_tuple(a.dead, a.epoch, a.round);
      },
      nb::arg("workspace"), nb::arg("pids"), nb::arg("dead"), nb::arg("epoch"), nb::arg("first_round"),
      nb::arg("timeout_s"),
      "Rounds of proposals in each rank's own workspace until every survivor proposes the same dead ranks; "
      "returns (dead per rank, the most dispatches any survivor started, the deciding round).");
}

namespace {

void bind_cpu_all_to_all(nb::module_& m) {
  using release = nb::call_guard<nb::gil_scoped_release>;
  nb::class_<cpu::CpuAllToAll>(m, "CpuAllToAll")
      // region and group are None where no peer is remote (no engine).
      .def(
          "__init__",
          [](cpu::CpuAllToAll* a, Workspace* ws, moe_a2a::fabric::ProxyEngine* engine,
             std::optional<moe_a2a::fabric::RegionId> region, std::optional<moe_a2a::fabric::GroupId> group,
             const std::vector<int>& remote_peers, const std::vector<int>& pids, const std::vector<uint8_t>& masked,
             uint64_t first_epoch) {
            new (a) cpu::CpuAllToAll(ws, engine, region.value_or(moe_a2a::fabric::RegionId{}),
                                     group.value_or(moe_a2a::fabric::GroupId{}), remote_peers, pids, masked,
                                     first_epoch);
          },
          nb::arg("workspace"), nb::arg("engine").none(), nb::arg("region").none(), nb::arg("group").none(),
          nb::arg("remote_peers"), nb::arg("pids"), nb::arg("masked") = std::vector<uint8_t>{},
          nb::arg("first_epoch") = 0, nb::keep_alive<1, 2>(), nb::keep_alive<1, 3>(),
          "masked: per rank, 1 for a lost rank nobody waits for or sends to (empty: none); first_epoch: "
          "dispatches already started (the next call is epoch first_epoch + 1).")
      .def("announce_failure", &cpu::CpuAllToAll::announce_failure, nb::arg("text"), release())
      .def(
          "dispatch_send",
          [](cpu::CpuAllToAll& a, uintptr_t x, DType x_dtype, uintptr_t x_scale, uintptr_t topk_ids, int num_tokens,
             uintptr_t routing, uintptr_t weights) {
            a.dispatch_send({ptr<const void>(x), x_dtype, ptr<const float>(x_scale), ptr<const int32_t>(topk_ids),
                             num_tokens, ptr<const uint32_t>(routing), ptr<const float>(weights)});
          },
          nb::arg("x"), nb::arg("x_dtype"), nb::arg("x_scale"), nb::arg("topk_ids"), nb::arg("num_tokens"),
          nb::arg("routing") = 0, nb::arg("weights") = 0, release(),
          "routing: a cached call's matrix (0: exchange the routing rows); weights: [T, topk] fp32, each copy's "
          "weight into its row's tail (0: zeros).")
      .def("dispatch_wait", &cpu::CpuAllToAll::dispatch_wait, release())
      .def("unpack_order", &cpu::CpuAllToAll::unpack_order)
      .def(
          "dispatch_unpack",
          [](cpu::CpuAllToAll& a, uintptr_t out_x, uintptr_t out_scale, uintptr_t out_weight, uintptr_t row_scale,
             uintptr_t dot_y, DType dot_y_dtype, uintptr_t dot_out) {
            cpu::DispatchUnpackArgs args;
            args.out_x = ptr<void>(out_x);
            args.out_scale = ptr<float>(out_scale);
            args.out_weight = ptr<float>(out_weight);
            args.math = row_math(row_scale, dot_y, dot_y_dtype, dot_out);
            a.dispatch_unpack(args);
          },
          nb::arg("out_x"), nb::arg("out_scale"), nb::arg("out_weight") = 0, nb::arg("row_scale") = 0,
          nb::arg("dot_y") = 0, nb::arg("dot_y_dtype") = DType::kBf16, nb::arg("dot_out") = 0, release(),
          "out_weight: [output rows] fp32, each row's weight from its tail (0: not wanted); row_scale ([rows] "
          "fp32): rows delivered times it; dot_y ([rows, hidden], dot_y_dtype): dot_out[r] = <row r as "
          "received, dot_y[r]>.")
      .def(
          "combine_send",
          [](cpu::CpuAllToAll& a, uintptr_t y, DType y_dtype, uintptr_t row_values, bool weighted) {
            a.combine_send({ptr<const void>(y), y_dtype, ptr<const float>(row_values), weighted});
          },
          nb::arg("y"), nb::arg("y_dtype"), nb::arg("row_values") = 0, nb::arg("weighted") = true, release(),
          "row_values: [output rows] fp32, one per row back in its tail (0: zeros); weighted: rows per rank "
          "are summed with the dispatch's weights (False: plainly), as the combine that follows.")
      .def(
          "combine_recv",
          [](cpu::CpuAllToAll& a, uintptr_t weights, uintptr_t out, uintptr_t values_out) {
            a.combine_recv({ptr<const float>(weights), ptr<void>(out), ptr<float>(values_out)});
          },
          nb::arg("weights"), nb::arg("out"), nb::arg("values_out") = 0, release(),
          "values_out: [T, topk] fp32, each copy's returned value, unreduced (0: not wanted).")
      .def_prop_ro("tokens_per_expert", &cpu::CpuAllToAll::tokens_per_expert)
      .def(
          "copy_routing", [](const cpu::CpuAllToAll& a, uintptr_t out) { a.copy_routing(ptr<uint32_t>(out)); },
          nb::arg("out"), "The last dispatch's routing matrix [world][num_experts + world] (uint32) into out.")
      .def_prop_ro("routing_rows_sent", &cpu::CpuAllToAll::routing_rows_sent)
      .def_prop_ro("routing_rows_received", &cpu::CpuAllToAll::routing_rows_received)
      .def("sent_counts", &cpu::CpuAllToAll::sent_counts,
           "Wire rows sent to each rank in the last dispatch (copies, but rows per rank).")
      .def("received_counts", &cpu::CpuAllToAll::received_counts,
           "Wire rows received from each rank in the last dispatch (copies, but rows per rank).")
      .def("forwarded_traffic", &cpu::CpuAllToAll::forwarded_traffic,
           "Rows per node in the last call, per node peer: the rows we forwarded that hold its entries "
           "(it read them from us), and the bytes of its outputs and row values our combine read.")
      .def_prop_ro("epoch", &cpu::CpuAllToAll::epoch);
}

}  // namespace
