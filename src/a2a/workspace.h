// A rank's workspace in POSIX shared memory, plus the mappings of the
// workspaces of the other ranks of its node. Start-up is three steps that the
// bootstrap drives: create ours, map the peers' by name, unlink.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "config.h"
#include "layout.h"
#include "shm.h"

namespace moe_a2a::a2a {

class Workspace {
 public:
  // share_rows=false: the row sections (between the routing rows and the
  // abort records) are private memory of ours, which same-node peers do not
  // read (the CUDA backend, whose same-node rows go through GPU memory, and
  // any rank without same-node peers); the rest stays shared.
  Workspace(const A2AConfig& cfg, const std::string& name, bool share_rows = true);

  const A2AConfig& config() const { return cfg_; }
  const Layout& layout() const { return layout_; }
  uint8_t* self() const { return own_->data(); }
  size_t size() const { return layout_.total; }
  const std::string& name() const { return own_->name(); }
  // names[r]: the segment of rank r, for every rank of our node (others "").
  void map_node(const std::vector<std::string>& names);
  void unlink() { own_->unlink(); }
  // Our segment's path for a process of this host once its name is gone
  // (ShmSegment::reopen_path): what a rejoin hands the replacement.
  std::string reopen_path() const { return own_->reopen_path(); }
  // Same-node rank `rank` was replaced (moe_a2a.rejoin): its old mapping
  // goes, `name` (a reopen_path) is mapped in its place. Callers first stop
  // everything that reads the old one.
  void remap_peer(int rank, const std::string& name);
  // Rank `sender`'s old process may have left an abort record in ours (a
  // failure it announced before it went): its replacement starts with none.
  void forget_sender(int sender);
  // index = rank; nullptr for ranks of other nodes.
  const std::vector<uint8_t*>& node() const { return node_; }

 private:
  A2AConfig cfg_;
  Layout layout_;
  std::unique_ptr<ShmSegment> own_;
  std::vector<std::unique_ptr<ShmSegment>> peers_;
  std::vector<uint8_t*> node_;
};

}  // namespace moe_a2a::a2a
