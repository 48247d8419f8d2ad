// Byte blobs that ranks exchange at start-up through the bootstrap: a rank's
// fabric address (one per NIC) and a registered region's keys. Versioned and
// checked, so a rank built or configured differently fails with a message
// instead of writing to garbage.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "backend.h"
#include "error.h"

namespace moe_a2a::fabric {

constexpr uint32_t kAddressMagic = 0x4d414431;  // "MAD1"
constexpr uint32_t kRegionMagic = 0x4d524731;   // "MRG1"

struct AddressBlob {
  std::string provider;
  std::vector<Bytes> nics;
};

struct RegionBlob {
  uint64_t length = 0;
  std::vector<RemoteKey> nics;
};

namespace detail {

class Writer {
 public:
  template <typename T>
  void put(const T& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    out.insert(out.end(), p, p + sizeof(T));
  }
  void put_bytes(const Bytes& b) {
    put<uint32_t>(static_cast<uint32_t>(b.size()));
    out.insert(out.end(), b.begin(), b.end());
  }
  Bytes out;
};

class Reader {
 public:
  Reader(const Bytes& in, std::string what) : in_(in), what_(std::move(what)) {}
  template <typename T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  Bytes get_bytes() {
    auto n = get<uint32_t>();
    need(n);
    Bytes b(in_.begin() + pos_, in_.begin() + pos_ + n);
    pos_ += n;
    return b;
  }
  void done() const {
    if (pos_ != in_.size()) throw FabricError(what_ + ": " + std::to_string(in_.size() - pos_) + " trailing bytes");
  }

 private:
  void need(size_t n) const {
    if (pos_ + n > in_.size())
      throw FabricError(what_ + ": truncated (" + std::to_string(in_.size()) + " bytes, needed more at offset " +
                        std::to_string(pos_) + ")");
  }
  const Bytes& in_;
  size_t pos_ = 0;
  std::string what_;
};

}  // namespace detail

inline Bytes encode_address(const AddressBlob& a) {
  detail::Writer w;
  w.put(kAddressMagic);
  w.put_bytes(Bytes(a.provider.begin(), a.provider.end()));
  w.put<uint32_t>(static_cast<uint32_t>(a.nics.size()));
  for (const auto& n : a.nics) w.put_bytes(n);
  return w.out;
}

inline AddressBlob decode_address(const Bytes& in, const std::string& what) {
  detail::Reader r(in, what);
  if (r.get<uint32_t>() != kAddressMagic) throw FabricError(what + ": not a moe-a2a fabric address");
  AddressBlob a;
  Bytes prov = r.get_bytes();
  a.provider.assign(prov.begin(), prov.end());
  auto n = r.get<uint32_t>();
  for (uint32_t i = 0; i < n; ++i) a.nics.push_back(r.get_bytes());
  r.done();
  return a;
}

inline Bytes encode_region(const RegionBlob& g) {
  detail::Writer w;
  w.put(kRegionMagic);
  w.put(g.length);
  w.put<uint32_t>(static_cast<uint32_t>(g.nics.size()));
  for (const auto& k : g.nics) {
    w.put(k.base);
    w.put(k.key);
  }
  return w.out;
}

inline RegionBlob decode_region(const Bytes& in, const std::string& what) {
  detail::Reader r(in, what);
  if (r.get<uint32_t>() != kRegionMagic) throw FabricError(what + ": not a moe-a2a region descriptor");
  RegionBlob g;
  g.length = r.get<uint64_t>();
  auto n = r.get<uint32_t>();
  for (uint32_t i = 0; i < n; ++i) {
    RemoteKey k;
    k.base = r.get<uint64_t>();
    k.key = r.get<uint64_t>();
    g.nics.push_back(k);
  }
  r.done();
  return g;
}

}  // namespace moe_a2a::fabric
