// Bindings of the CUDA implementation. Pointers and streams cross as
// integers (tensor.data_ptr(), torch.cuda.current_stream().cuda_stream);
// Python owns every tensor. Without nvcc the module still builds and says so
// through HAVE_CUDA.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

namespace nb = nanobind;

#ifdef MOE_A2A_HAVE_CUDA

#include <map>

#include "a2a/cuda/cuda_all_to_all.h"
#include "a2a/cuda/tuning.h"
#include "pointers.h"

using moe_a2a::a2a::A2AConfig;
using moe_a2a::a2a::DType;
using moe_a2a::a2a::Layout;
using moe_a2a::a2a::ProxySignals;
using moe_a2a::a2a::Workspace;
using moe_a2a::a2a::cuda::CombineRecvArgs;
using moe_a2a::a2a::cuda::CombineSendArgs;
using moe_a2a::a2a::cuda::CudaAllToAll;
using moe_a2a::a2a::cuda::DispatchRecvArgs;
using moe_a2a::a2a::cuda::DispatchSendArgs;

namespace {

using moe_a2a::bindings::ptr;
using moe_a2a::bindings::row_math;

cudaStream_t stream_of(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

std::map<std::string, size_t> layout_dict(const Layout& l) {
  return {{"flags", l.flags},
          {"routing", l.routing},
          {"private_rows", l.private_rows},
          {"shared_rows", l.shared_rows},
          {"send", l.send},
          {"combine_send", l.combine_send},
          {"combine_recv", l.combine_recv},
          {"y_stage", l.y_stage},
          {"y_values", l.y_values},
          {"y_stride", l.y_stride},
          {"total", l.total},
          {"dispatch_row", l.dispatch_row},
          {"combine_row", l.combine_row}};
}

// Host addresses of the proxy's flags, for tests that play the proxy.
std::map<std::string, uintptr_t> signal_addresses(const ProxySignals* s) {
  auto a = [](const auto& seq) { return reinterpret_cast<uintptr_t>(&seq.value); };
  return {{"route_ready", a(s->route_ready)},
          {"packed", a(s->packed)},
          {"combine_packed", a(s->combine_packed)},
          {"dispatch_done", a(s->dispatch_done)},
          {"combine_done", a(s->combine_done)},
          {"overflow", a(s->overflow)},
          {"failed", a(s->failed)}};
}

// The four halves: each builds its call's arguments from integers (pointers
// and streams) and DTypes.
void def_halves(nb::class_<CudaAllToAll>& cls) {
  using release = nb::call_guard<nb::gil_scoped_release>;
  cls.def(
         "dispatch_send",
         [](CudaAllToAll& a, uintptr_t x, DType x_dtype, uintptr_t x_scale, uintptr_t topk_ids, bool ids_64bit,
            int num_tokens, uintptr_t num_tokens_device, uintptr_t stream, uintptr_t routing, bool in_place,
            uintptr_t weights, bool dequant_recv) {
           DispatchSendArgs args;
           args.x = ptr<const void>(x);
           args.x_dtype = x_dtype;
           args.x_scale = ptr<const float>(x_scale);
           args.topk_ids = ptr<const void>(topk_ids);
           args.ids_64bit = ids_64bit;
           args.num_tokens = num_tokens;
           args.num_tokens_device = ptr<const int32_t>(num_tokens_device);
           args.routing = ptr<const uint32_t>(routing);
           args.in_place = in_place;
           args.weights = ptr<const float>(weights);
           args.dequant_recv = dequant_recv;
           a.dispatch_send(args, stream_of(stream));
         },
         nb::arg("x"), nb::arg("x_dtype"), nb::arg("x_scale"), nb::arg("topk_ids"), nb::arg("ids_64bit"),
         nb::arg("num_tokens"), nb::arg("num_tokens_device"), nb::arg("stream"), nb::arg("routing") = 0,
         nb::arg("in_place") = false, nb::arg("weights") = 0, nb::arg("dequant_recv") = false,
         "routing: a cached call's matrix in pinned host memory (0: exchange the routing rows). "
         "dequant_recv: the receive half dequantises fp8 rows (then in_place holds for a bf16/fp32 x too). "
         "in_place: x stays unchanged until the receive half, which reads this rank's own copies from it. "
         "weights: [T, topk] fp32, each copy's weight into its row's tail (0: zeros).")
      .def(
          "dispatch_recv",
          [](CudaAllToAll& a, uintptr_t out_x, uintptr_t out_scale, uintptr_t tokens_per_expert, bool host_wait,
             uintptr_t stream, uintptr_t routing_out, uintptr_t row_scale, uintptr_t dot_y, DType dot_y_dtype,
             uintptr_t dot_out, uintptr_t out_weight, bool dequant, DType out_dtype) {
            DispatchRecvArgs args;
            args.out_x = ptr<void>(out_x);
            args.out_scale = ptr<float>(out_scale);
            args.tokens_per_expert = ptr<int32_t>(tokens_per_expert);
            args.host_wait = host_wait;
            args.routing_out = ptr<uint32_t>(routing_out);
            args.math = row_math(row_scale, dot_y, dot_y_dtype, dot_out);
            args.out_weight = ptr<float>(out_weight);
            args.dequant = dequant;
            args.out_dtype = out_dtype;
            a.dispatch_recv(args, stream_of(stream));
          },
          nb::arg("out_x"), nb::arg("out_scale"), nb::arg("tokens_per_expert"), nb::arg("host_wait"), nb::arg("stream"),
          nb::arg("routing_out") = 0, nb::arg("row_scale") = 0, nb::arg("dot_y") = 0,
          nb::arg("dot_y_dtype") = DType::kBf16, nb::arg("dot_out") = 0, nb::arg("out_weight") = 0,
          nb::arg("dequant") = false, nb::arg("out_dtype") = DType::kBf16, release(),
          "row_scale (fp32, one per output row): rows delivered times it; dot_y ([rows, hidden], dot_y_dtype): "
          "dot_out[r] = <row r as received, dot_y[r]> in fp32; out_weight ([rows] fp32): each row's weight; "
          "dequant: fp8 rows delivered as out_dtype (bf16 or fp32) rows in out_x.")
      .def(
          "combine_send",
          [](CudaAllToAll& a, uintptr_t y, DType y_dtype, int64_t y_rows, uintptr_t stream, bool in_place,
             uintptr_t row_values, bool weighted) {
            a.combine_send({ptr<const void>(y), y_dtype, y_rows, in_place, ptr<const float>(row_values), weighted},
                           stream_of(stream));
          },
          nb::arg("y"), nb::arg("y_dtype"), nb::arg("y_rows"), nb::arg("stream"), nb::arg("in_place") = false,
          nb::arg("row_values") = 0, nb::arg("weighted") = true, release(),
          "in_place: y stays unchanged until the receive half, which reads this rank's own rows from it. "
          "row_values: [y_rows] fp32, one per row back in its tail (0: zeros). weighted: rows per rank "
          "or node are summed where the experts are times the dispatch's weights (false: plainly). With "
          "fabric_rows='node' it blocks until every same-node peer staged its outputs.")
      .def(
          "combine_recv",
          [](CudaAllToAll& a, uintptr_t weights, uintptr_t out, bool host_wait, uintptr_t stream,
             uintptr_t values_out) {
            a.combine_recv({ptr<const float>(weights), ptr<void>(out), host_wait, ptr<float>(values_out)},
                           stream_of(stream));
          },
          nb::arg("weights"), nb::arg("out"), nb::arg("host_wait"), nb::arg("stream"), nb::arg("values_out") = 0,
          release(), "values_out: [T, topk] fp32, each copy's returned value, unreduced (0: not wanted).");
}

// The launch tuning this build's kernels use (tuning.h), for traces and
// bench headers: {"cuda": True, "architectures": "90", family: {name: value}}.
nb::dict cuda_tuning() {
  nb::dict out;
  out["cuda"] = true;
  out["architectures"] = MOE_A2A_CUDA_ARCHITECTURES;
  for (const auto& e : moe_a2a::a2a::cuda::tuning_table()) {
    if (!out.contains(e.family.c_str())) out[e.family.c_str()] = nb::dict();
    nb::dict family = nb::borrow<nb::dict>(out[e.family.c_str()]);
    family[e.name.c_str()] = e.value;
  }
  return out;
}

}  // namespace

void bind_cuda(nb::module_& m) {
  using release = nb::call_guard<nb::gil_scoped_release>;
  m.attr("HAVE_CUDA") = true;
  m.def("cuda_tuning", &cuda_tuning,
        "The launch tuning of this build's CUDA kernels, one dict per kernel family (src/a2a/cuda/tuning.h).");
  m.def("cuda_pooled_workspace_bytes", &moe_a2a::a2a::cuda::pooled_workspace_bytes,
        "Bytes of device workspaces kept for reuse: one registered for GPU-direct is never freed while "
        "the process lives (a peer's libfabric may still map it), and a later instance takes it back.");
  nb::class_<CudaAllToAll> cls(m, "CudaAllToAll");
  cls  // region and group are None where no peer is remote (no engine).
      .def(
          "__init__",
          [](CudaAllToAll* a, Workspace* ws, moe_a2a::fabric::ProxyEngine* engine,
             std::optional<moe_a2a::fabric::RegionId> region, std::optional<moe_a2a::fabric::GroupId> group,
             const std::vector<int>& remote_peers, const std::vector<int>& pids) {
            new (a) CudaAllToAll(ws, engine, region.value_or(moe_a2a::fabric::RegionId{}),
                                 group.value_or(moe_a2a::fabric::GroupId{}), remote_peers, pids);
          },
          nb::arg("workspace"), nb::arg("engine").none(), nb::arg("region").none(), nb::arg("group").none(),
          nb::arg("remote_peers"), nb::arg("pids") = std::vector<int>{}, nb::keep_alive<1, 2>(), nb::keep_alive<1, 3>())
      .def(nb::init<const A2AConfig&>(), nb::arg("config"),
           "A rank without fabric or proxy, for tests that run several ranks in one process.")
      .def("ipc_handle",
           [](const CudaAllToAll& a) {
             std::string h = a.ipc_handle();
             return nb::bytes(h.data(), h.size());
           })
      .def(
          "open_node",
          [](CudaAllToAll& a, const std::vector<nb::bytes>& handles) {
            std::vector<std::string> hs;
            for (const auto& h : handles) hs.emplace_back(static_cast<const char*>(h.data()), h.size());
            a.open_node(hs);
          },
          nb::arg("handles"))
      .def("release_peer", &CudaAllToAll::release_peer, nb::arg("rank"),
           "A masked same-node rank is being replaced (moe_a2a.rejoin): let go of its old mappings, before "
           "the workspace remaps it.")
      .def(
          "replace_peer",
          [](CudaAllToAll& a, int rank, const nb::bytes& handle, const Workspace& ws, int pid) {
            std::string h(static_cast<const char*>(handle.data()), handle.size());
            uint8_t* host = rank >= 0 && rank < static_cast<int>(ws.node().size()) ? ws.node()[rank] : nullptr;
            a.replace_peer(rank, h, host, pid);
          },
          nb::arg("rank"), nb::arg("handle"), nb::arg("workspace"), nb::arg("pid"),
          "A masked rank's replacement (proxy stopped): its IPC handle (same node; b'' elsewhere), the "
          "workspace's new mapping of it, its pid. The next mask() without it reaches it.")
      // No keep_alive: peers would keep each other alive in a cycle; the caller holds them all.
      .def("connect_local", &CudaAllToAll::connect_local, nb::arg("peer"))
      .def("rows_on_device", &CudaAllToAll::rows_on_device, nb::arg("region"), nb::arg("group"),
           nb::arg("nic_writes"),
           "GPU-direct, before the first call: the proxy writes rows from and into the registered device workspace.")
      .def("kernel_waits", &CudaAllToAll::kernel_waits, release(),
           "Graph-safe instances, before the first call: every receive waits in kernels, and rows per node are "
           "forwarded in the stream.")
      .def("maskable", &CudaAllToAll::maskable, release(),
           "Instances that may be masked (on_peer_loss='mask'), before the first call: every kernel checks that "
           "its graph was not captured before a mask.")
      .def("stop_proxy", &CudaAllToAll::stop_proxy, release(), "Stop the proxy thread (a retired close).")
      .def(
          "mask",
          [](CudaAllToAll& a, const std::vector<uint8_t>& masked, uint64_t first_epoch,
             std::optional<moe_a2a::fabric::GroupId> group, std::optional<moe_a2a::fabric::GroupId> rows_group,
             const std::vector<int>& remote_peers) {
            a.mask(masked, first_epoch, group.value_or(moe_a2a::fabric::GroupId{}),
                   rows_group.value_or(moe_a2a::fabric::GroupId{}), remote_peers);
          },
          nb::arg("masked"), nb::arg("first_epoch"), nb::arg("group").none(), nb::arg("rows_group").none(),
          nb::arg("remote_peers"), release(),
          "Mask and continue, after a loss the survivors agreed on (device synchronised, proxy stopped): "
          "masked per rank (1: lost), the next call is epoch first_epoch + 1, the proxy serves the live "
          "remote_peers through group (rows_group: GPU-direct's). No collective.")
      .def_prop_ro("gpu_direct", &CudaAllToAll::gpu_direct)
      .def_prop_ro("device_epoch", &CudaAllToAll::device_epoch,
                   "The device's epoch counter (a D2H copy): graph replays raise it, not the host's epoch.");
  def_halves(cls);
  cls.def("check", &CudaAllToAll::check, "Raise the outcome of the last call (after synchronising its stream).")
      .def("announce_failure", &CudaAllToAll::announce_failure, nb::arg("text"), release(),
           "Tell every peer that this rank failed, so their waits end at once.")
      .def("wait_planned", &CudaAllToAll::wait_planned,
           "Eager dispatch: wait until the plan of this call is final (no stream synchronisation), then check().",
           release())
      .def_prop_ro("status", &CudaAllToAll::status)
      .def_prop_ro("output_rows", &CudaAllToAll::output_rows)
      .def_prop_ro("max_output_rows", &CudaAllToAll::max_output_rows)
      .def("wire_received", &CudaAllToAll::wire_received, release(),
           "Wire rows each sender sent us in the last planned dispatch (synchronises with the device).")
      .def("forwarded_traffic", &CudaAllToAll::forwarded_traffic, release(),
           "Rows per node, the last planned dispatch, per node peer: the rows we forwarded that it read entries "
           "from, and the bytes of its outputs and row values our combine read (synchronises with the device).")
      .def_prop_ro("fused_recv", &CudaAllToAll::fused_recv,
                   "Eager dispatch_recv plans and copies in one launch (no other rank of the node on our GPU).")
      .def_prop_ro("epoch", &CudaAllToAll::epoch)
      .def_prop_ro("routing_rows_sent", &CudaAllToAll::routing_rows_sent)
      .def_prop_ro("routing_rows_received", &CudaAllToAll::routing_rows_received)
      .def_prop_ro("layout", [](const CudaAllToAll& a) { return layout_dict(a.layout()); })
      .def_prop_ro("device_workspace", &CudaAllToAll::device_workspace)
      .def_prop_ro("host_workspace", &CudaAllToAll::host_workspace)
      .def_prop_ro("signals", [](const CudaAllToAll& a) { return signal_addresses(a.signals()); });
}

#else

void bind_cuda(nb::module_& m) {
  m.attr("HAVE_CUDA") = false;
  m.def(
      "cuda_tuning",
      []() {
        nb::dict out;
        out["cuda"] = false;  // built without nvcc: no kernels, no tuning
        return out;
      },
      "The launch tuning of this build's CUDA kernels: {'cuda': False} in a build without them.");
}

#endif
