/* A stand-in for the CUDA driver (libcuda.so.1) for CPU tests of zos._C's driver paths
 * (tests/test_native_stage.py): "device" memory is host memory, streams, events and contexts
 * are opaque tokens, every call succeeds at once (an event is complete unless fake_event_busy
 * says otherwise), and a test sets the faults and reads the counters below through ctypes. Only the entry points zos._C loads
 * (csrc/upload.cpp, Driver) exist. It checks zos's bookkeeping around the driver, not CUDA's
 * semantics: nothing here is asynchronous. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
static int primary_context;
static void* current_context;

int fake_capturing = 0;      /* cuStreamIsCapturing reports this status (1: active) */
int fake_launch_error = 0;   /* cuGraphLaunch returns this */
int fake_copy_error = 0;     /* cuMemcpyHtoDAsync returns this */
long fake_capture_queries = 0, fake_launches = 0, fake_copies = 0;
uint64_t fake_last_graph = 0, fake_last_stream = 0;
int fake_event_busy = 0;     /* cuEventQuery reports CUDA_ERROR_NOT_READY this many more times */
long fake_with_gil = 0, fake_without_gil = 0;  /* stream and event calls, by the caller's GIL */
long fake_unsafe_in_capture = 0;  /* event queries and waits while fake_capturing: on CUDA they
                                     invalidate a capture in the global mode (torch's default) */
int fake_other_thread_capturing = 0;  /* another thread captures in the global mode: an event
                                         query or wait from a thread in the global mode is
                                         refused (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) and
                                         breaks that capture (counted) */
int fake_own_capture = 0;  /* this thread captures (on a stream of its own, in the global
                              mode): an event query or wait is refused and breaks that capture
                              unless the thread's mode is relaxed */
long fake_captures_broken = 0;
static __thread int capture_mode = 0;  /* this thread's CUstreamCaptureMode: 0 global (CUDA's
                                          default), 1 thread-local, 2 relaxed */

static int refused_by_capture(void) {
  if (!(fake_other_thread_capturing && capture_mode == 0) &&
      !(fake_own_capture && capture_mode != 2))
    return 0;
  ++fake_captures_broken;
  return 1;
}

/* Counts a call by whether its thread holds the GIL (PyGILState_Check of the process's
 * Python, which exports its C API to extension modules). */
static void note_gil(void) {
  static int (*held)(void);
  if (!held) held = (int (*)(void))dlsym(RTLD_DEFAULT, "PyGILState_Check");
  if (held && held()) ++fake_with_gil; else ++fake_without_gil;
}

CUresult cuInit(unsigned flags) { return 0; }
CUresult cuDeviceGet(int* dev, int ordinal) { *dev = ordinal; return 0; }
CUresult cuDevicePrimaryCtxRetain(void** ctx, int dev) { *ctx = &primary_context; return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(int dev) { return 0; }
CUresult cuCtxGetCurrent(void** ctx) { *ctx = current_context; return 0; }
CUresult cuCtxSetCurrent(void* ctx) { current_context = ctx; return 0; }
CUresult cuEventCreate(void** ev, unsigned flags) { *ev = malloc(1); return 0; }
CUresult cuEventDestroy_v2(void* ev) { free(ev); return 0; }
CUresult cuEventRecord(void* ev, void* stream) { note_gil(); return 0; }
CUresult cuEventQuery(void* ev) {
  note_gil();
  if (fake_capturing) ++fake_unsafe_in_capture;
  if (refused_by_capture()) return 900;  /* CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED */
  if (fake_event_busy > 0) { --fake_event_busy; return 600; /* CUDA_ERROR_NOT_READY */ }
  return 0;
}
CUresult cuEventSynchronize(void* ev) {
  note_gil();
  if (fake_capturing) ++fake_unsafe_in_capture;
  if (refused_by_capture()) return 900;
  return 0;
}
CUresult cuStreamWaitEvent(void* stream, void* ev, unsigned flags) { note_gil(); return 0; }
CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned flags) { *p = calloc(1, bytes); return 0; }
long fake_host_frees = 0;
CUresult cuMemFreeHost(void* p) { ++fake_host_frees; free(p); return 0; }
CUresult cuMemHostGetDevicePointer_v2(uint64_t* d, void* p, unsigned flags) {
  *d = (uint64_t)p;
  return 0;
}
CUresult cuMemcpyHtoDAsync_v2(uint64_t dst, const void* src, size_t bytes, void* stream) {
  note_gil();
  ++fake_copies;
  if (fake_copy_error) return fake_copy_error;
  memcpy((void*)dst, src, bytes);
  return 0;
}
CUresult cuGraphLaunch(void* graph, void* stream) {
  note_gil();
  ++fake_launches;
  if (fake_launch_error) return fake_launch_error;
  fake_last_graph = (uint64_t)graph;
  fake_last_stream = (uint64_t)stream;
  return 0;
}
CUresult cuStreamIsCapturing(void* stream, int* status) {
  note_gil();
  ++fake_capture_queries;
  *status = fake_capturing;
  return 0;
}
CUresult cuThreadExchangeStreamCaptureMode(int* mode) {
  int previous = capture_mode;
  capture_mode = *mode;
  *mode = previous;
  return 0;
}
CUresult cuGetErrorString(CUresult rc, const char** msg) {
  *msg = "fake driver error";
  return 0;
}
