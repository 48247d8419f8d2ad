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

}  // namespace moe_a2a::a2a
