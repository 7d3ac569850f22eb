#include "cpu/async_call.h"

#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cpu/handlers.h"

namespace jmo::cpu {
namespace {

XLA_FFI_Error* MakeError(const XLA_FFI_Api* api, const std::string& message) {
  XLA_FFI_Error_Create_Args args{XLA_FFI_Error_Create_Args_STRUCT_SIZE, nullptr, message.c_str(),
                                 XLA_FFI_Error_Code_INTERNAL};
  return api->XLA_FFI_Error_Create(&args);
}

// Bytes of a scalar attribute's value (the workspace calls' attributes are booleans and integers).
int ScalarBytes(XLA_FFI_DataType dtype) {
  switch (dtype) {
    case XLA_FFI_DataType_PRED:
    case XLA_FFI_DataType_S8:
    case XLA_FFI_DataType_U8:
      return 1;
    case XLA_FFI_DataType_S16:
    case XLA_FFI_DataType_U16:
    case XLA_FFI_DataType_F16:
    case XLA_FFI_DataType_BF16:
      return 2;
    case XLA_FFI_DataType_S32:
    case XLA_FFI_DataType_U32:
    case XLA_FFI_DataType_F32:
      return 4;
    case XLA_FFI_DataType_S64:
    case XLA_FFI_DataType_U64:
    case XLA_FFI_DataType_F64:
      return 8;
    default:
      return 0;
  }
}

// A call frame that owns everything the handler reads: XLA lends the frame's arrays (the buffer descriptors, their
// dimensions, the attribute names and values) only until the handler returns, and hands them to the next execution
// of the same thunk (another device's) after that. The buffers themselves stay valid until the future completes.
// Built in place and never moved: the frame points into the vectors.
class OwnedFrame {
 public:
  // Copies `src`; an argument or result other than a buffer, or an attribute other than a scalar, leaves `error`
  // set and the frame unusable.
  explicit OwnedFrame(const XLA_FFI_CallFrame& src) {
    for (int64_t i = 0; i < src.args.size; ++i)
      if (src.args.types[i] != XLA_FFI_ArgType_BUFFER) error = "argument " + std::to_string(i) + " is not a buffer";
    for (int64_t i = 0; i < src.rets.size; ++i)
      if (src.rets.types[i] != XLA_FFI_RetType_BUFFER) error = "result " + std::to_string(i) + " is not a buffer";
    if (!error.empty()) return;
    CopyBuffers(src.args.size, src.args.args, &args_, &arg_dims_, &arg_ptrs_);
    CopyBuffers(src.rets.size, src.rets.rets, &rets_, &ret_dims_, &ret_ptrs_);
    arg_types_.assign(src.args.types, src.args.types + src.args.size);
    ret_types_.assign(src.rets.types, src.rets.types + src.rets.size);
    const int64_t n = src.attrs.size;
    names_.reserve(n);
    name_spans_.reserve(n);
    scalars_.reserve(n);
    values_.reserve(n);
    for (int64_t i = 0; i < n; ++i) {
      const XLA_FFI_ByteSpan* name = src.attrs.names[i];
      names_.emplace_back(name->ptr, name->len);
      if (src.attrs.types[i] != XLA_FFI_AttrType_SCALAR) {
        error = "attribute '" + names_.back() + "' is not a scalar";
        return;
      }
      const auto* scalar = static_cast<const XLA_FFI_Scalar*>(src.attrs.attrs[i]);
      const int bytes = ScalarBytes(scalar->dtype);
      if (bytes == 0) {
        error = "attribute '" + names_.back() + "' has a scalar type this copy does not know";
        return;
      }
      values_.push_back(0);
      std::memcpy(&values_.back(), scalar->value, bytes);
      scalars_.push_back(XLA_FFI_Scalar{scalar->dtype, &values_.back()});
      name_spans_.push_back(XLA_FFI_ByteSpan{names_.back().data(), names_.back().size()});
    }
    attr_types_.assign(src.attrs.types, src.attrs.types + n);
    for (int64_t i = 0; i < n; ++i) {
      name_ptrs_.push_back(&name_spans_[i]);
      attr_ptrs_.push_back(&scalars_[i]);
    }
    frame = src;
    frame.extension_start = nullptr;  // XLA's internal extensions of an execute frame live as long as XLA's frame
    frame.ctx = nullptr;  // the handlers read no execution context; XLA's is gone once the handler returned
    frame.future = nullptr;
    frame.args.types = arg_types_.data();
    frame.args.args = arg_ptrs_.data();
    frame.rets.types = ret_types_.data();
    frame.rets.rets = ret_ptrs_.data();
    frame.attrs.types = attr_types_.data();
    frame.attrs.names = name_ptrs_.data();
    frame.attrs.attrs = attr_ptrs_.data();
  }
  OwnedFrame(const OwnedFrame&) = delete;
  OwnedFrame& operator=(const OwnedFrame&) = delete;

  XLA_FFI_CallFrame frame{};
  std::string error;

 private:
  static void CopyBuffers(int64_t n, void* const* src, std::vector<XLA_FFI_Buffer>* bufs,
                          std::vector<std::vector<int64_t>>* dims, std::vector<void*>* ptrs) {
    bufs->reserve(n);
    dims->reserve(n);
    for (int64_t i = 0; i < n; ++i) {
      const auto* b = static_cast<const XLA_FFI_Buffer*>(src[i]);
      dims->emplace_back(b->dims, b->dims + b->rank);
      bufs->push_back(*b);
      bufs->back().dims = dims->back().data();
    }
    for (XLA_FFI_Buffer& b : *bufs) ptrs->push_back(&b);
  }

  std::vector<XLA_FFI_Buffer> args_, rets_;
  std::vector<std::vector<int64_t>> arg_dims_, ret_dims_;
  std::vector<void*> arg_ptrs_, ret_ptrs_;
  std::vector<XLA_FFI_ArgType> arg_types_;
  std::vector<XLA_FFI_RetType> ret_types_;
  std::vector<std::string> names_;
  std::vector<XLA_FFI_ByteSpan> name_spans_;
  std::vector<XLA_FFI_ByteSpan*> name_ptrs_;
  std::vector<uint64_t> values_;
  std::vector<XLA_FFI_Scalar> scalars_;
  std::vector<XLA_FFI_AttrType> attr_types_;
  std::vector<void*> attr_ptrs_;
};

// Threads that run the calls' bodies: a task starts at once on an idle thread, or on a new one when every thread is
// busy (running a body, or kept by XLA for the thunks after a call). Threads are reused, never ended: there are at
// most as many as tasks were ever running at once. The pool lives as long as the process.
class WaitThreads {
 public:
  // Throws std::system_error, queueing nothing, when a new thread is needed and cannot be started.
  void Post(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu_);
    // Every queued task has a thread on its way: an idle thread no other task has woken yet, or a new one (which
    // takes the lock, hence the task, once this returns).
    if (idle_ > wakeups_) {
      ++wakeups_;
      cv_.notify_one();
    } else {
      std::thread([this] { Loop(); }).detach();
    }
    tasks_.push_back(std::move(task));
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      // A thread woken for a task that a thread finishing its own took first waits again.
      while (tasks_.empty()) {
        ++idle_;
        cv_.wait(lock, [this] { return wakeups_ > 0; });
        --wakeups_;
        --idle_;
      }
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  int idle_ = 0;     // threads waiting for a task
  int wakeups_ = 0;  // of those, the ones woken by Post that have not taken their wake-up yet
};

WaitThreads& Threads() {
  static auto* threads = new WaitThreads();  // never destroyed: its threads may outlive static destruction
  return *threads;
}

// Hands the body's result to XLA. XLA cannot be told otherwise that the call ended, so a failure here ends the
// process with the reason, as XLA's own ffi::Future does.
void Complete(const XLA_FFI_Api* api, XLA_FFI_Future* future, XLA_FFI_Error* result) {
  XLA_FFI_Error* failed;
  if (result != nullptr) {
    XLA_FFI_Future_SetError_Args args{XLA_FFI_Future_SetError_Args_STRUCT_SIZE, nullptr, future, result};
    failed = api->XLA_FFI_Future_SetError(&args);
  } else {
    XLA_FFI_Future_SetAvailable_Args args{XLA_FFI_Future_SetAvailable_Args_STRUCT_SIZE, nullptr, future};
    failed = api->XLA_FFI_Future_SetAvailable(&args);
  }
  if (failed != nullptr) {
    std::fprintf(stderr, "jax_moe_overlap: could not complete a workspace call's XLA FFI future\n");
    std::abort();
  }
}

}  // namespace

XLA_FFI_Error* CallOffXlaThreads(XLA_FFI_Handler* body, XLA_FFI_CallFrame* frame) {
  const bool metadata = frame->extension_start != nullptr && frame->extension_start->type == XLA_FFI_Extension_Metadata;
  if (metadata || frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return body(frame);
  const XLA_FFI_Api* api = frame->api;
  auto owned = std::make_shared<OwnedFrame>(*frame);
  if (!owned->error.empty())
    return MakeError(api, "jax_moe_overlap: internal: a workspace call's call frame cannot be copied: " + owned->error);
  XLA_FFI_Future_Create_Args create{XLA_FFI_Future_Create_Args_STRUCT_SIZE, nullptr, nullptr};
  if (XLA_FFI_Error* err = api->XLA_FFI_Future_Create(&create)) return err;
  XLA_FFI_Future* future = create.future;
  try {
    Threads().Post([body, api, future, owned] {
      XLA_FFI_Error* result;
      try {
        result = body(&owned->frame);
      } catch (const std::exception& e) {  // as XLA treats a handler that throws on its own threads
        result = MakeError(api, std::string("jax_moe_overlap: a workspace call's handler failed: ") + e.what());
      }
      Complete(api, future, result);
    });
  } catch (const std::exception& e) {
    Complete(api, future, MakeError(api, std::string("jax_moe_overlap: cannot start a thread for a workspace "
                                                     "call (nothing ran): ") + e.what()));
  }
  frame->future = future;
  return nullptr;
}

}  // namespace jmo::cpu

// The workspace calls as XLA registers them: each one's synchronous handler (handlers.cc, dispatch_gemm.cc) run off
// XLA's threads.
extern "C" {
XLA_FFI_Error* JmoDispatchCpu(XLA_FFI_CallFrame* frame) {
  return jmo::cpu::CallOffXlaThreads(JmoDispatchCpuBody, frame);
}
XLA_FFI_Error* JmoExpertCombineCpu(XLA_FFI_CallFrame* frame) {
  return jmo::cpu::CallOffXlaThreads(JmoExpertCombineCpuBody, frame);
}
XLA_FFI_Error* JmoDispatchGemmCpu(XLA_FFI_CallFrame* frame) {
  return jmo::cpu::CallOffXlaThreads(JmoDispatchGemmCpuBody, frame);
}
XLA_FFI_Error* JmoExchangeCountsCpu(XLA_FFI_CallFrame* frame) {
  return jmo::cpu::CallOffXlaThreads(JmoExchangeCountsCpuBody, frame);
}
XLA_FFI_Error* JmoGatherRsCpu(XLA_FFI_CallFrame* frame) {
  return jmo::cpu::CallOffXlaThreads(JmoGatherRsCpuBody, frame);
}
}
