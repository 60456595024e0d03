// Errors: core statuses as the exceptions torch users see, and the messages they carry.
//
// One mapping for every path — a refused submission, an operation that failed in the core, the
// group's creation: invalid or mismatched arguments raise ValueError, unsupported ones
// TypeError, timeouts, peers, aborts and system errors DistBackendError, anything else (a
// closed group, no memory) a plain c10::Error (RuntimeError).
#pragma once

#include <exception>
#include <string>

#include "ripples.h"

namespace ripples __attribute__((visibility("hidden"))) {

// Raises the torch exception that corresponds to a core status.
[[noreturn]] void throwStatus(rpl_status st, const std::string& msg);
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
