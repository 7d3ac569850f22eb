// The workspace calls on XLA:CPU wait for their peers off XLA's threads.
//
// XLA:CPU runs the independent thunks of one device's program concurrently on one intra-op pool, about as many
// threads as there are devices, shared by all the devices of the process, and an XLA collective holds its pool thread
// while it waits for its peers. A workspace call waits for its peers too (protocol.h). Had it waited on a pool
// thread, a workspace call and an XLA collective in flight on every device (the psum of a layer's dropped count
// beside its dispatch, the weight gradients' psum over a batch axis beside the last expert_combine of the backward
// pass) would take two threads per device: the pool runs out, and every waiter waits for a peer whose call is queued
// behind the waiters.
//
// So each workspace call's FFI handler copies its call frame, starts the synchronous handler on a wait thread of
// this library, and returns an XLA FFI future that the wait thread completes with the handler's result. XLA runs the
// thunks that depend on the call on that thread once the future completes, as it would have after a synchronous
// call; while it does, the next call's body starts on another wait thread, so a call never waits behind XLA's work.
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jmo::cpu {

// Runs the synchronous FFI handler `body` for `frame` on a wait thread and returns through `frame->future` (see
// above). Metadata queries and every stage but execute go to `body` on the caller's thread. Fails synchronously,
// running nothing, when the frame holds an attribute other than a scalar (the workspace calls take scalars only).
XLA_FFI_Error* CallOffXlaThreads(XLA_FFI_Handler* body, XLA_FFI_CallFrame* frame);

}  // namespace jmo::cpu
