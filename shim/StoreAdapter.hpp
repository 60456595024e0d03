// StoreAdapter: the group's c10d store, seen from the core as an rpl_store (set/get by key)
// for its rendezvous. Store exceptions become core statuses: an expired wait for a key
// RPL_ERR_TIMEOUT, a lost connection to the store RPL_ERR_PEER, anything else RPL_ERR_SYSTEM;
// nothing is thrown across the C boundary.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "ripples.h"

namespace ripples __attribute__((visibility("hidden"))) {

class StoreAdapter {
 public:
  explicit StoreAdapter(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}

  // The core's view; valid while this adapter lives (the core uses it only inside
  // rpl_comm_create).
  rpl_store view();

 private:
  static rpl_status set(void* ctx, const char* key, const void* val, size_t len, rpl_error* err);
  static rpl_status get(
      void* ctx,
      const char* key,
      void* buf,
      size_t cap,
      size_t* len,
      rpl_error* err);

  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace ripples
