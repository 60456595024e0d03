// StoreAdapter: see StoreAdapter.hpp.
#include "StoreAdapter.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "Errors.hpp"

namespace ripples {

namespace {
rpl_status storeErrorStatus(const std::exception& e) {
  if (dynamic_cast<const c10::DistStoreError*>(&e) != nullptr) {
    return RPL_ERR_TIMEOUT;  // TCPStore reports an expired wait for a key this way
  }
  if (dynamic_cast<const c10::DistNetworkError*>(&e) != nullptr) {
    return RPL_ERR_PEER;
  }
  return RPL_ERR_SYSTEM;
}
}  // namespace

rpl_store StoreAdapter::view() {
  rpl_store rs;
  rs.ctx = this;
  rs.set = &StoreAdapter::set;
  rs.get = &StoreAdapter::get;
  return rs;
}

rpl_status StoreAdapter::set(
    void* ctx,
    const char* key,
    const void* val,
    size_t len,
    rpl_error* err) {
  try {
    auto* a = static_cast<StoreAdapter*>(ctx);
    const auto* p = static_cast<const uint8_t*>(val);
    a->store_->set(std::string(key), std::vector<uint8_t>(p, p + len));
    return RPL_OK;
  } catch (const std::exception& e) {
    rpl_status st = storeErrorStatus(e);
    fillError(err, st, std::string("c10d store set('") + key + "') failed: " + e.what());
    return st;
  } catch (...) {
    fillError(err, RPL_ERR_SYSTEM, std::string("c10d store set('") + key + "') failed");
    return RPL_ERR_SYSTEM;
  }
}

rpl_status StoreAdapter::get(
    void* ctx,
    const char* key,
    void* buf,
    size_t cap,
    size_t* len,
    rpl_error* err) {
  try {
    auto* a = static_cast<StoreAdapter*>(ctx);
    std::vector<uint8_t> v = a->store_->get(std::string(key));  // blocks until the key exists
    if (len != nullptr) {
      *len = v.size();
    }
    if (buf != nullptr && cap > 0 && !v.empty()) {
      std::memcpy(buf, v.data(), std::min(cap, v.size()));
    }
    return RPL_OK;
  } catch (const std::exception& e) {
    rpl_status st = storeErrorStatus(e);
    fillError(
        err, st,
        std::string("c10d store get('") + key +
            "') failed (did every rank of the group create it?): " + e.what());
    return st;
  } catch (...) {
    fillError(err, RPL_ERR_SYSTEM, std::string("c10d store get('") + key + "') failed");
    return RPL_ERR_SYSTEM;
  }
}

}  // namespace ripples
