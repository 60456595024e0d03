// Errors: core statuses as the exceptions Python users see, and the messages they carry.
//
// One table (Errors.cpp) for every path. The backend's paths — a refused submission, an
// operation that failed in the core, the group's creation — raise torch's types: invalid or
// mismatched arguments ValueError, unsupported ones TypeError, timeouts, peers, aborts and
// system errors DistBackendError, anything else (a closed group, no memory) a plain c10::Error
// (RuntimeError). The Group Generator's (ripples_pg._C.gg, coordinator queries) raise Python's:
// ValueError, TimeoutError, ConnectionError (coordinator unreachable or gone), MemoryError,
// else RuntimeError.
#pragma once

#include <exception>
#include <string>

#include "ripples.h"

namespace ripples __attribute__((visibility("hidden"))) {

// Which column of the table a call raises from.
enum class StatusUser { kBackend, kCoordinator };

// Raises the backend's exception that corresponds to a core status.
[[noreturn]] void throwStatus(rpl_status st, const std::string& msg);
// Raises `user`'s exception for a core status; kCoordinator needs the GIL held.
[[noreturn]] void throwStatus(StatusUser user, rpl_status st, const std::string& msg);
// The same exception, captured (to complete a future with).
std::exception_ptr statusError(rpl_status st, const std::string& msg);

// The message of a call on a group that was shut down; `group` is GroupShared::name.
std::string closedMessage(const std::string& group, const std::string& opName);
// The message of an operation the core failed with `st`.
std::string failureMessage(
    const std::string& group,
    const std::string& opName,
    rpl_status st,
    const std::string& coreMsg);
// Raises for a call the core refused outright (nothing reached it).
[[noreturn]] void throwRefused(
    const std::string& group,
    const std::string& opName,
    rpl_status st,
    const std::string& coreMsg);

// Fills the core's error out-parameter (when given) from C++.
void fillError(rpl_error* err, rpl_status st, const std::string& msg);

}  // namespace ripples
