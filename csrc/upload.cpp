#include "upload.h"

#include <dlfcn.h>

#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include "staging.h"

namespace zos {
namespace {

// The few driver entry points used, by their stable ABI names (cuda.h).
using CUresult = int;
struct Driver {
  CUresult (*ctx_get_current)(void**);
  CUresult (*ctx_set_current)(void*);
  CUresult (*event_create)(void**, unsigned);
  CUresult (*event_destroy)(void*);
  CUresult (*event_record)(void*, void*);
  CUresult (*stream_wait_event)(void*, void*, unsigned);
  CUresult (*event_synchronize)(void*);
  CUresult (*memcpy_htod_async)(uint64_t, const void*, size_t, void*);
  CUresult (*get_error_string)(CUresult, const char**);
  CUresult (*event_query)(void*);
  CUresult (*mem_host_alloc)(void**, size_t, unsigned);
  CUresult (*mem_free_host)(void*);
  CUresult (*mem_host_get_device_pointer)(uint64_t*, void*, unsigned);
  CUresult (*init)(unsigned);
  CUresult (*device_get)(int*, int);
  CUresult (*primary_ctx_retain)(void**, int);
  CUresult (*primary_ctx_release)(int);
  CUresult (*graph_launch)(void*, void*);
  CUresult (*stream_is_capturing)(void*, int*);
  CUresult (*thread_exchange_capture_mode)(int*);
};

const Driver& driver() {
  static const Driver d = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) throw std::runtime_error(std::string("zos (CUDA driver): cannot load libcuda.so.1: ") + dlerror());
    auto sym = [lib](const char* name) {
      void* f = dlsym(lib, name);
      if (!f) throw std::runtime_error(std::string("zos (CUDA driver): libcuda.so.1 lacks ") + name);
      return f;
    };
    Driver r;
    r.ctx_get_current = reinterpret_cast<decltype(r.ctx_get_current)>(sym("cuCtxGetCurrent"));
    r.ctx_set_current = reinterpret_cast<decltype(r.ctx_set_current)>(sym("cuCtxSetCurrent"));
    r.event_create = reinterpret_cast<decltype(r.event_create)>(sym("cuEventCreate"));
    r.event_destroy = reinterpret_cast<decltype(r.event_destroy)>(sym("cuEventDestroy_v2"));
    r.event_record = reinterpret_cast<decltype(r.event_record)>(sym("cuEventRecord"));
    r.stream_wait_event =
        reinterpret_cast<decltype(r.stream_wait_event)>(sym("cuStreamWaitEvent"));
    r.event_synchronize = reinterpret_cast<decltype(r.event_synchronize)>(sym("cuEventSynchronize"));
    r.memcpy_htod_async =
        reinterpret_cast<decltype(r.memcpy_htod_async)>(sym("cuMemcpyHtoDAsync_v2"));
    r.get_error_string = reinterpret_cast<decltype(r.get_error_string)>(sym("cuGetErrorString"));
    r.event_query = reinterpret_cast<decltype(r.event_query)>(sym("cuEventQuery"));
    r.mem_host_alloc = reinterpret_cast<decltype(r.mem_host_alloc)>(sym("cuMemHostAlloc"));
    r.mem_free_host = reinterpret_cast<decltype(r.mem_free_host)>(sym("cuMemFreeHost"));
    r.mem_host_get_device_pointer = reinterpret_cast<decltype(r.mem_host_get_device_pointer)>(
        sym("cuMemHostGetDevicePointer_v2"));
    r.init = reinterpret_cast<decltype(r.init)>(sym("cuInit"));
    r.device_get = reinterpret_cast<decltype(r.device_get)>(sym("cuDeviceGet"));
    r.primary_ctx_retain =
        reinterpret_cast<decltype(r.primary_ctx_retain)>(sym("cuDevicePrimaryCtxRetain"));
    r.primary_ctx_release =
        reinterpret_cast<decltype(r.primary_ctx_release)>(sym("cuDevicePrimaryCtxRelease_v2"));
    r.graph_launch = reinterpret_cast<decltype(r.graph_launch)>(sym("cuGraphLaunch"));
    r.stream_is_capturing =
        reinterpret_cast<decltype(r.stream_is_capturing)>(sym("cuStreamIsCapturing"));
    r.thread_exchange_capture_mode = reinterpret_cast<decltype(r.thread_exchange_capture_mode)>(
        sym("cuThreadExchangeStreamCaptureMode"));
    return r;
  }();
  return d;
}

void check(CUresult rc, const char* what) {
  if (rc == 0) return;
  const char* msg = nullptr;
  driver().get_error_string(rc, &msg);
  throw std::runtime_error(std::string("zos (CUDA driver): ") + what + " failed: " +
                           (msg ? msg : "error " + std::to_string(rc)));
}

// The context the driver calls of an object run in. device >= 0: that device's primary
// context (the one the CUDA runtime, and so torch, uses), retained here, so the object
// works on a thread that has not touched CUDA yet (a serving loop's background thread);
// *retained is then the device, else -1. device < 0: the context current on this thread.
void* context_of(int64_t device, int* retained, const char* who) {
  const Driver& d = driver();
  void* ctx = nullptr;
  *retained = -1;
  if (device >= 0) {
    check(d.init(0), "cuInit");
    int dev = 0;
    check(d.device_get(&dev, static_cast<int>(device)), "cuDeviceGet");
    check(d.primary_ctx_retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    *retained = dev;
    return ctx;
  }
  check(d.ctx_get_current(&ctx), "cuCtxGetCurrent");
  if (!ctx)
    throw std::runtime_error(std::string(who) + ": no CUDA context is current on this thread "
                             "(pass the device)");
  return ctx;
}

// Makes ctx current for one call and puts the thread's previous context back, so that
// a ring of device 0 used on a thread working on device 1 leaves that thread on device 1.
// A thread with no context keeps ctx (what the runtime would make current anyway).
class ContextScope {
 public:
  explicit ContextScope(void* ctx) {
    check(driver().ctx_get_current(&prev_), "cuCtxGetCurrent");
    if (prev_ != ctx) check(driver().ctx_set_current(ctx), "cuCtxSetCurrent");
    restore_ = prev_ != nullptr && prev_ != ctx;
  }
  ~ContextScope() {
    if (restore_) driver().ctx_set_current(prev_);  // errors ignored: nothing to report to
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  void* prev_ = nullptr;
  bool restore_ = false;
};

// This thread's stream-capture mode set for one scope (then put back). Per-step calls use the
// thread-local mode: an event query or synchronize, a "potentially unsafe" call, is then not
// refused because another thread captures a CUDA graph in the global mode (torch's default),
// and does not invalidate that capture; a capture of this thread's own still refuses it (zos's
// events are never part of a capture: a stage refuses a capturing stream). PyTorch's NCCL
// watchdog queries its events so (pytorch/pytorch#148594, #160398). Teardown (a destructor,
// or Python's garbage collector, which runs on whatever thread allocates, possibly inside that
// thread's own capture) uses the relaxed mode, in which the driver allows a wait on an event
// recorded outside any capture (zos's fences) on every thread and breaks no capture. Nested scopes keep
// the outermost scope's mode (a teardown that waits through synchronize stays relaxed). A
// failed exchange leaves the mode as it was. Not covered: construction (pinned allocation)
// and the host-built backend's torch events.
constexpr int kCaptureThreadLocal = 1;  // CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
constexpr int kCaptureRelaxed = 2;      // CU_STREAM_CAPTURE_MODE_RELAXED

class CaptureModeScope {
 public:
  explicit CaptureModeScope(int mode) : mode_(mode) {
    if (depth_ == 0) exchanged_ = driver().thread_exchange_capture_mode(&mode_) == 0;
    ++depth_;
  }
  ~CaptureModeScope() {
    --depth_;
    if (exchanged_) driver().thread_exchange_capture_mode(&mode_);  // errors ignored
  }
  CaptureModeScope(const CaptureModeScope&) = delete;
  CaptureModeScope& operator=(const CaptureModeScope&) = delete;

 private:
  static thread_local int depth_;
  int mode_;  // the mode set; then the mode it replaced
  bool exchanged_ = false;
};

thread_local int CaptureModeScope::depth_ = 0;

constexpr unsigned kEventDisableTiming = 0x2;
constexpr unsigned kMemHostAllocPortable = 0x1;   // CU_MEMHOSTALLOC_PORTABLE
constexpr unsigned kMemHostAllocDeviceMap = 0x2;  // CU_MEMHOSTALLOC_DEVICEMAP
constexpr CUresult kErrorNotReady = 600;          // CUDA_ERROR_NOT_READY

// The stream waits for the last build (recorded on whatever stream it ran), so what is
// enqueued next on it (a fence, a copy) comes after that build.
void wait_for_build(void* built, void* stream) {
  if (built) check(driver().stream_wait_event(stream, built, 0), "cuStreamWaitEvent");
}

// Marks the end of a stage on its stream: a build on another stream waits for it.
void mark_staged(void* staged, void* stream) {
  if (staged) check(driver().event_record(staged, stream), "cuEventRecord");
}

}  // namespace

PinnedUpload::PinnedUpload(uint64_t dst, uint64_t src0, uint64_t src1, int64_t capacity,
                           int64_t device)
    : dst_(dst), src_{src0, src1}, capacity_(capacity) {
  const Driver& d = driver();
  ctx_ = context_of(device, &retained_, "PinnedUpload");
  try {
    ContextScope scope(ctx_);
    for (auto& f : fence_) check(d.event_create(&f, kEventDisableTiming), "cuEventCreate");
  } catch (...) {
    for (auto* f : fence_)
      if (f) d.event_destroy(f);
    if (retained_ >= 0) d.primary_ctx_release(retained_);
    throw;
  }
}

PinnedUpload::~PinnedUpload() {
  try {
    ContextScope scope(ctx_);
    CaptureModeScope mode(kCaptureRelaxed);
    for (auto* f : fence_)
      if (f) {
        driver().event_synchronize(f);  // errors ignored: nothing to report to in a destructor
        driver().event_destroy(f);
      }
  } catch (...) {
  }
  if (retained_ >= 0) driver().primary_ctx_release(retained_);
}

void PinnedUpload::synchronize(bool teardown) {
  ContextScope scope(ctx_);
  CaptureModeScope mode(teardown ? kCaptureRelaxed : kCaptureThreadLocal);
  for (auto* f : fence_) check(driver().event_synchronize(f), "cuEventSynchronize");
}

bool PinnedUpload::ready() const {
  ContextScope scope(ctx_);
  CaptureModeScope mode(kCaptureThreadLocal);
  return driver().event_query(fence_[turn_]) == 0;
}

int PinnedUpload::acquire() {
  ContextScope scope(ctx_);
  CaptureModeScope mode(kCaptureThreadLocal);
  check(driver().event_synchronize(fence_[turn_]), "cuEventSynchronize");
  return turn_;
}

void PinnedUpload::submit(int k, int64_t nbytes, uint64_t stream) {
  if (k != turn_) throw std::invalid_argument("submit: buffer " + std::to_string(k) +
                                              " was not the one acquired (" +
                                              std::to_string(turn_) + ")");
  if (nbytes < 0 || nbytes > capacity_)
    throw std::invalid_argument("submit: nbytes " + std::to_string(nbytes) + " outside [0, " +
                                std::to_string(capacity_) + "]");
  ContextScope scope(ctx_);
  void* s = reinterpret_cast<void*>(stream);
  wait_for_build(built_, s);  // the copy overwrites the staging buffer the last build read
  check(driver().memcpy_htod_async(dst_, reinterpret_cast<const void*>(src_[k]),
                                   static_cast<size_t>(nbytes), s),
        "cuMemcpyHtoDAsync");
  check(driver().event_record(fence_[k], s), "cuEventRecord");
  mark_staged(staged_, s);
  turn_ = 1 - k;
}

void PinnedUpload::set_build_events(uint64_t built, uint64_t staged) {
  built_ = reinterpret_cast<void*>(built);
  staged_ = reinterpret_cast<void*>(staged);
}

MappedRing::MappedRing(int64_t num_slots, int64_t slot_words, int64_t device)
    : num_slots_(num_slots), slot_words_(slot_words) {
  if (num_slots < 1 || slot_words < 1)
    throw std::invalid_argument("MappedRing: num_slots and slot_words must be positive, got " +
                                std::to_string(num_slots) + " and " + std::to_string(slot_words));
  const Driver& d = driver();
  ctx_ = context_of(device, &retained_, "MappedRing");
  void* p = nullptr;
  try {
    ContextScope scope(ctx_);
    const int64_t words = done_offset() + kDoneWords;
    check(d.mem_host_alloc(&p, static_cast<size_t>(words) * sizeof(int32_t),
                           kMemHostAllocPortable | kMemHostAllocDeviceMap),
          "cuMemHostAlloc");
    host_ = static_cast<int32_t*>(p);
    std::fill_n(host_, words, 0);  // N = 0 and SEQ = 0 in every slot, done word 0
    check(d.mem_host_get_device_pointer(&device_, p, 0), "cuMemHostGetDevicePointer");
    check(d.event_create(&fence_, kEventDisableTiming), "cuEventCreate");
  } catch (...) {
    if (fence_) d.event_destroy(fence_);
    if (p) d.mem_free_host(p);
    if (retained_ >= 0) d.primary_ctx_release(retained_);
    throw;
  }
}

MappedRing::~MappedRing() {
  try {
    synchronize(true);
  } catch (...) {  // nothing to report to in a destructor; free anyway (unless kept)
  }
  try {
    ContextScope scope(ctx_);
    CaptureModeScope mode(kCaptureRelaxed);  // freeing pinned memory synchronizes
    if (!keep_ && fence_) driver().event_destroy(fence_);
    if (!keep_ && host_) driver().mem_free_host(host_);
  } catch (...) {  // nothing to report to in a destructor
  }
  if (retained_ >= 0) driver().primary_ctx_release(retained_);
}

int32_t MappedRing::seq_of(int64_t slot) const {
  return host_[slot * slot_words_ + staging::kSeq];
}

int32_t MappedRing::newest_seq() const { return seq_of((next_ + num_slots_ - 1) % num_slots_); }

bool MappedRing::applied(int32_t seq, int32_t newest) const {
  // The done word lies in [seq, newest] (mod kSeqMask + 1) once seq's build has finished:
  // builds apply records in SEQ order, and none is ahead of the record committed last.
  const int32_t done = done_seq();
  return ((done - seq) & staging::kSeqMask) <= ((newest - seq) & staging::kSeqMask);
}

void MappedRing::wait_applied(int32_t seq, int32_t newest, uint64_t stream) {
  ContextScope scope(ctx_);
  CaptureModeScope mode(kCaptureThreadLocal);
  const Driver& d = driver();
  void* s = reinterpret_cast<void*>(stream);
  wait_for_build(built_, s);  // the fence below then comes after the last build, wherever it ran
  check(d.event_record(fence_, s), "cuEventRecord");
  for (int64_t spin = 0; !applied(seq, newest); ++spin) {
    const CUresult rc = d.event_query(fence_);
    if (rc == 0) {
      // Every build enqueued before the fence has finished, and its writes to the done word
      // are visible with the fence; give a late write of the word a moment all the same.
      for (int i = 0; i < 1000 && !applied(seq, newest); ++i) std::this_thread::yield();
      if (applied(seq, newest)) return;
      throw std::runtime_error(
          "zos: the record with SEQ " + std::to_string(seq) + " was staged but no build read "
          "it (the device finished everything enqueued before this stage, and the done word "
          "is at SEQ " + std::to_string(done_seq()) + "): every stage must be followed by its "
          "build before the next stage (docs/ZOS.md, \"The runner contract\", rule 2)");
    }
    if (rc != kErrorNotReady) check(rc, "cuEventQuery");
    if (spin >= 64) std::this_thread::yield();
  }
}

void MappedRing::drain(uint64_t stream) {
  ContextScope scope(ctx_);
  CaptureModeScope mode(kCaptureThreadLocal);
  void* s = reinterpret_cast<void*>(stream);
  wait_for_build(built_, s);
  check(driver().event_record(fence_, s), "cuEventRecord");
  check(driver().event_synchronize(fence_), "cuEventSynchronize");
  fence_repeat_ = false;
}

bool MappedRing::ready() const {
  if (fence_repeat_) return false;
  if (commits_ < num_slots_) return true;
  return applied(seq_of(next_), newest_seq());
}

int MappedRing::acquire(uint64_t stream) {
  last_stream_ = stream;
  if (fence_repeat_) drain(stream);  // a repeated build may still read any slot it applied
  if (commits_ >= num_slots_) {  // slot next_ holds a record: wait for its build to finish
    const int32_t seq = seq_of(next_);
    const int32_t newest = newest_seq();
    if (!applied(seq, newest)) {
      ++waits_;
      wait_applied(seq, newest, stream);
    }
  }
  return next_;
}

void MappedRing::set_build_events(uint64_t built, uint64_t /*staged*/) {
  built_ = reinterpret_cast<void*>(built);
}

void MappedRing::commit() {
  ++commits_;
  next_ = static_cast<int>((next_ + 1) % num_slots_);
}

void MappedRing::synchronize(bool teardown) {
  if (teardown) {
    ContextScope scope(ctx_);
    CaptureModeScope mode(kCaptureRelaxed);  // the nested waits below keep it
    keep_ = false;
    const bool pending = fence_repeat_ || (commits_ > 0 && !applied(newest_seq(), newest_seq()));
    if (!pending) return;
    int status = 0;
    if (driver().stream_is_capturing(reinterpret_cast<void*>(last_stream_), &status) != 0 ||
        status != 0) {
      keep_ = true;  // a fence recorded there would join the capture (or break it)
      return;
    }
    synchronize(false);
    return;
  }
  if (fence_repeat_) drain(last_stream_);
  if (commits_ == 0) return;
  const int32_t newest = newest_seq();
  if (!applied(newest, newest)) wait_applied(newest, newest, last_stream_);
}

namespace {

// Device `device`'s primary context, retained on first use and kept for good.
void* primary_context(int64_t device, const char* who) {
  static std::mutex mu;
  static std::vector<void*> primary;  // device -> its primary context
  std::lock_guard<std::mutex> lock(mu);
  if (device < 0) throw std::invalid_argument(std::string(who) + ": device must be >= 0, got " +
                                              std::to_string(device));
  if (primary.size() <= static_cast<size_t>(device)) primary.resize(device + 1, nullptr);
  if (!primary[device]) {
    int retained = -1;
    primary[device] = context_of(device, &retained, who);
  }
  return primary[device];
}

}  // namespace

void launch_graph(uint64_t graph_exec, uint64_t stream, int64_t device) {
  ContextScope scope(primary_context(device, "launch_graph"));
  check(driver().graph_launch(reinterpret_cast<void*>(graph_exec), reinterpret_cast<void*>(stream)),
        "cuGraphLaunch");
}

void call_with_relaxed_capture_mode(const std::function<void()>& fn) {
  bool loaded = true;
  try {
    driver();
  } catch (const std::runtime_error&) {  // no driver: no capture to keep intact
    loaded = false;
  }
  if (!loaded) return fn();
  CaptureModeScope mode(kCaptureRelaxed);
  fn();
}

bool stream_capturing(uint64_t stream, int64_t device) {
  if (stream == 0) return false;  // the legacy default stream cannot be captured
  ContextScope scope(primary_context(device, "stream_capturing"));
  int status = 0;  // CU_STREAM_CAPTURE_STATUS_NONE
  check(driver().stream_is_capturing(reinterpret_cast<void*>(stream), &status),
        "cuStreamIsCapturing");
  return status != 0;  // active, or invalidated (a capture that failed and was not ended)
}

}  // namespace zos
