#include "upload.h"

#include <dlfcn.h>

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

}  // namespace zos
