#include "workspace.h"

#include <stdexcept>

#include "memory_plan.h"

namespace moe_a2a::a2a {

Workspace::Workspace(const A2AConfig& cfg, const std::string& name, bool share_rows)
    : cfg_(cfg), layout_(Layout::of(cfg)) {
  cfg_.validate();
  own_ = std::make_unique<ShmSegment>(name, layout_.total, true, private_rows_range(layout_, share_rows));
  node_.assign(cfg.world, nullptr);
  node_[cfg.rank] = own_->data();
}

void Workspace::map_node(const std::vector<std::string>& names) {
  if (static_cast<int>(names.size()) != cfg_.world)
    throw std::invalid_argument("map_node: got " + std::to_string(names.size()) + " names for a world of " +
                                std::to_string(cfg_.world));
  for (int r = 0; r < cfg_.world; ++r) {
    if (r == cfg_.rank || !cfg_.same_node(r)) continue;
    if (names[r].empty()) throw std::invalid_argument("map_node: no segment name for same-node rank " + std::to_string(r));
    peers_.push_back(std::make_unique<ShmSegment>(names[r], layout_.total, false));
    node_[r] = peers_.back()->data();
  }
}

void Workspace::remap_peer(int rank, const std::string& name) {
  if (rank < 0 || rank >= cfg_.world || rank == cfg_.rank || !cfg_.same_node(rank))
    throw std::invalid_argument("remap_peer: rank " + std::to_string(rank) + " is not another rank of our node");
  auto fresh = std::make_unique<ShmSegment>(name, layout_.total, false);
  for (auto& seg : peers_)
    if (seg->data() == node_[rank]) {
      seg = std::move(fresh);
      node_[rank] = seg->data();
      return;
    }
  peers_.push_back(std::move(fresh));
  node_[rank] = peers_.back()->data();
}

void Workspace::forget_sender(int sender) {
  if (sender < 0 || sender >= cfg_.world || sender == cfg_.rank)
    throw std::invalid_argument("forget_sender: rank " + std::to_string(sender) + " is not a peer");
  AbortRecord* rec = abort_at(self(), layout_, sender);
  rec->done = 0;
  rec->state.store(0, std::memory_order_release);
}

}  // namespace moe_a2a::a2a
