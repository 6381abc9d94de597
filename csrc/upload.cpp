#include "upload.h"

#include <dlfcn.h>

#include <algorithm>
#include <stdexcept>
#include <string>

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
  CUresult (*event_synchronize)(void*);
  CUresult (*memcpy_htod_async)(uint64_t, const void*, size_t, void*);
  CUresult (*get_error_string)(CUresult, const char**);
  CUresult (*event_query)(void*);
  CUresult (*mem_host_alloc)(void**, size_t, unsigned);
  CUresult (*mem_free_host)(void*);
  CUresult (*mem_host_get_device_pointer)(uint64_t*, void*, unsigned);
};

const Driver& driver() {
  static const Driver d = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) throw std::runtime_error(std::string("PinnedUpload: cannot load libcuda.so.1: ") + dlerror());
    auto sym = [lib](const char* name) {
      void* f = dlsym(lib, name);
      if (!f) throw std::runtime_error(std::string("PinnedUpload: libcuda.so.1 lacks ") + name);
      return f;
    };
    Driver r;
    r.ctx_get_current = reinterpret_cast<decltype(r.ctx_get_current)>(sym("cuCtxGetCurrent"));
    r.ctx_set_current = reinterpret_cast<decltype(r.ctx_set_current)>(sym("cuCtxSetCurrent"));
    r.event_create = reinterpret_cast<decltype(r.event_create)>(sym("cuEventCreate"));
    r.event_destroy = reinterpret_cast<decltype(r.event_destroy)>(sym("cuEventDestroy_v2"));
    r.event_record = reinterpret_cast<decltype(r.event_record)>(sym("cuEventRecord"));
    r.event_synchronize = reinterpret_cast<decltype(r.event_synchronize)>(sym("cuEventSynchronize"));
    r.memcpy_htod_async =
        reinterpret_cast<decltype(r.memcpy_htod_async)>(sym("cuMemcpyHtoDAsync_v2"));
    r.get_error_string = reinterpret_cast<decltype(r.get_error_string)>(sym("cuGetErrorString"));
    r.event_query = reinterpret_cast<decltype(r.event_query)>(sym("cuEventQuery"));
    r.mem_host_alloc = reinterpret_cast<decltype(r.mem_host_alloc)>(sym("cuMemHostAlloc"));
    r.mem_free_host = reinterpret_cast<decltype(r.mem_free_host)>(sym("cuMemFreeHost"));
    r.mem_host_get_device_pointer = reinterpret_cast<decltype(r.mem_host_get_device_pointer)>(
        sym("cuMemHostGetDevicePointer_v2"));
    return r;
  }();
  return d;
}

void check(CUresult rc, const char* what) {
  if (rc == 0) return;
  const char* msg = nullptr;
  driver().get_error_string(rc, &msg);
  throw std::runtime_error(std::string("PinnedUpload: ") + what + " failed: " +
                           (msg ? msg : "error " + std::to_string(rc)));
}

constexpr unsigned kEventDisableTiming = 0x2;
constexpr unsigned kMemHostAllocPortable = 0x1;   // CU_MEMHOSTALLOC_PORTABLE
constexpr unsigned kMemHostAllocDeviceMap = 0x2;  // CU_MEMHOSTALLOC_DEVICEMAP
constexpr CUresult kErrorNotReady = 600;          // CUDA_ERROR_NOT_READY

}  // namespace

PinnedUpload::PinnedUpload(uint64_t dst, uint64_t src0, uint64_t src1, int64_t capacity)
    : dst_(dst), src_{src0, src1}, capacity_(capacity) {
  const Driver& d = driver();
  check(d.ctx_get_current(&ctx_), "cuCtxGetCurrent");
  if (!ctx_) throw std::runtime_error("PinnedUpload: no CUDA context is current on this thread");
  for (auto& f : fence_) check(d.event_create(&f, kEventDisableTiming), "cuEventCreate");
}

PinnedUpload::~PinnedUpload() {
  for (auto* f : fence_)
    if (f) {
      driver().event_synchronize(f);  // errors ignored: nothing to report to in a destructor
      driver().event_destroy(f);
    }
}

void PinnedUpload::synchronize() {
  bind_context();
  for (auto* f : fence_) check(driver().event_synchronize(f), "cuEventSynchronize");
}

void PinnedUpload::bind_context() {
  void* cur = nullptr;
  check(driver().ctx_get_current(&cur), "cuCtxGetCurrent");
  if (cur != ctx_) check(driver().ctx_set_current(ctx_), "cuCtxSetCurrent");
}

int PinnedUpload::acquire() {
  bind_context();
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
  bind_context();
  void* s = reinterpret_cast<void*>(stream);
  check(driver().memcpy_htod_async(dst_, reinterpret_cast<const void*>(src_[k]),
                                   static_cast<size_t>(nbytes), s),
        "cuMemcpyHtoDAsync");
  check(driver().event_record(fence_[k], s), "cuEventRecord");
  turn_ = 1 - k;
}

MappedRing::MappedRing(int64_t num_slots, int64_t slot_words)
    : num_slots_(num_slots), slot_words_(slot_words) {
  if (num_slots < 1 || slot_words < 1)
    throw std::invalid_argument("MappedRing: num_slots and slot_words must be positive, got " +
                                std::to_string(num_slots) + " and " + std::to_string(slot_words));
  const Driver& d = driver();
  check(d.ctx_get_current(&ctx_), "cuCtxGetCurrent");
  if (!ctx_) throw std::runtime_error("MappedRing: no CUDA context is current on this thread");
  void* p = nullptr;
  const size_t bytes = static_cast<size_t>(num_slots * slot_words) * sizeof(int32_t);
  check(d.mem_host_alloc(&p, bytes, kMemHostAllocPortable | kMemHostAllocDeviceMap),
        "cuMemHostAlloc");
  host_ = static_cast<int32_t*>(p);
  std::fill_n(host_, num_slots * slot_words, 0);  // N = 0 and SEQ = 0 in every slot
  try {
    check(d.mem_host_get_device_pointer(&device_, p, 0), "cuMemHostGetDevicePointer");
    fence_.assign(static_cast<size_t>(num_slots), nullptr);
    for (auto& f : fence_) check(d.event_create(&f, kEventDisableTiming), "cuEventCreate");
  } catch (...) {
    for (auto* f : fence_)
      if (f) d.event_destroy(f);
    d.mem_free_host(p);
    throw;
  }
}

MappedRing::~MappedRing() {
  try {
    synchronize();
  } catch (...) {  // nothing to report to in a destructor; free anyway
  }
  for (auto* f : fence_)
    if (f) driver().event_destroy(f);
  if (host_) driver().mem_free_host(host_);
}

void MappedRing::bind_context() {
  void* cur = nullptr;
  check(driver().ctx_get_current(&cur), "cuCtxGetCurrent");
  if (cur != ctx_) check(driver().ctx_set_current(ctx_), "cuCtxSetCurrent");
}

int MappedRing::acquire(uint64_t stream) {
  bind_context();
  const Driver& d = driver();
  if (pending_ >= 0) {
    check(d.event_record(fence_[pending_], reinterpret_cast<void*>(stream)), "cuEventRecord");
    pending_ = -1;
  }
  last_stream_ = stream;
  const CUresult rc = d.event_query(fence_[next_]);
  if (rc == kErrorNotReady) {
    ++waits_;
    check(d.event_synchronize(fence_[next_]), "cuEventSynchronize");
  } else {
    check(rc, "cuEventQuery");
  }
  return next_;
}

void MappedRing::commit() {
  pending_ = next_;
  next_ = static_cast<int>((next_ + 1) % num_slots_);
}

void MappedRing::synchronize() {
  bind_context();
  const Driver& d = driver();
  if (pending_ >= 0) {
    check(d.event_record(fence_[pending_], reinterpret_cast<void*>(last_stream_)),
          "cuEventRecord");
    pending_ = -1;
  }
  for (auto* f : fence_) check(d.event_synchronize(f), "cuEventSynchronize");
}

}  // namespace zos
