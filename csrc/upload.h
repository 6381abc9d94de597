// PinnedUpload: the one host-to-device copy of a step's staging record, issued
// from native code through the CUDA driver API, which is loaded at run time
// (dlopen of libcuda.so.1): the extension needs no CUDA toolkit to build and
// imports on machines without a GPU. Two pinned buffers alternate; each is
// fenced by an event recorded after its copy, so the host never rewrites a
// buffer that an enqueued copy has not read yet (docs/ZOS.md, "Kernels inside the graph").
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

namespace zos {

class PinnedUpload {
 public:
  // dst: device address of the staging buffer; src0/src1: the two pinned host
  // buffers; capacity: bytes each holds; device: the CUDA device ordinal, whose
  // primary context is retained and used on any thread (-1: the context current on
  // this thread). Throws std::runtime_error if the driver cannot be loaded, or
  // device is -1 and no CUDA context is current on this thread.
  PinnedUpload(uint64_t dst, uint64_t src0, uint64_t src1, int64_t capacity,
               int64_t device = -1);
  ~PinnedUpload();
  PinnedUpload(const PinnedUpload&) = delete;
  PinnedUpload& operator=(const PinnedUpload&) = delete;

  // Index (0 or 1) of the buffer to fill next, after its previous copy finished.
  int acquire();
  // Whether acquire would return without waiting (the next buffer's copy has finished; a
  // failed query reads as not ready, for acquire to report).
  bool ready() const;
  // Enqueues the copy of nbytes of buffer k on `stream` (a CUstream / cudaStream_t)
  // and records k's fence after it; the next acquire returns the other buffer.
  void submit(int k, int64_t nbytes, uint64_t stream);
  // Waits until both buffers' copies are done (before the pinned buffers are freed).
  // teardown: in the relaxed capture mode (a destructor or Python's garbage collector, which
  // may run inside the calling thread's own graph capture): the driver allows the wait (the
  // fences are recorded outside any capture) and that capture stays intact. Otherwise the
  // thread-local mode of every per-step call.
  void synchronize(bool teardown = false);
  // Pinned buffer k (0 or 1), as int32 words, and the bytes each buffer holds.
  int32_t* host_buffer(int k) const { return reinterpret_cast<int32_t*>(src_[k]); }
  int64_t capacity() const { return capacity_; }
  // Build ordering (docs/ZOS.md, "The runner contract"): from now on each submit makes its
  // stream wait for `built` (a CUevent recorded after each build that may run on another
  // stream) before the copy, and records `staged` after the copy, which such a build
  // waits for. 0, 0 turns it off.
  void set_build_events(uint64_t built, uint64_t staged);

 private:
  uint64_t dst_;
  uint64_t src_[2];
  int64_t capacity_;
  void* ctx_ = nullptr;
  int retained_ = -1;  // the device whose primary context ctx_ is (retained), else -1
  void* fence_[2] = {nullptr, nullptr};
  int turn_ = 0;
  void* built_ = nullptr;
  void* staged_ = nullptr;
};

// MappedRing: the zero-copy staging ring (docs/ZOS.md, "The staging record").
// num_slots records of slot_words int32 words in pinned host memory that is
// mapped into the device's address space (cuMemHostAlloc with DEVICEMAP; the
// prep kernels read it through device_ptr()), followed by the done word: the
// prep kernels write into it the SEQ of each record they have finished reading
// (docs/ZOS.md, "The done word"). The host writes slot k only after the build
// that last read slot k has finished, which it learns by reading the done word:
// no driver call while the device keeps up; a host num_slots steps ahead waits.
class MappedRing {
 public:
  // device: the CUDA device ordinal; its primary context (the CUDA runtime's and
  // torch's) is retained and made current for every driver call, so the ring can be
  // built and used on any thread, one that never touched CUDA included (-1: the
  // context current on this thread). Throws std::runtime_error if the driver cannot
  // be loaded, device is -1 and no CUDA context is current on this thread, or the
  // memory cannot be allocated and mapped.
  MappedRing(int64_t num_slots, int64_t slot_words, int64_t device = -1);
  ~MappedRing();
  MappedRing(const MappedRing&) = delete;
  MappedRing& operator=(const MappedRing&) = delete;

  // Returns the next slot once the build of the record it holds (if any) has finished,
  // i.e. once the done word has reached that record's SEQ; until then it waits (see
  // wait_applied), counting one wait. `stream` is the stage's stream: on it the wait
  // places its fallback fence.
  int acquire(uint64_t stream);
  // Whether acquire would return without waiting (no driver call): the done word shows the
  // build of the next slot's record finished, and no repeated build is to be drained.
  bool ready() const;
  // The acquired slot holds a staged record now: the next acquire takes the following slot.
  void commit();
  // A build was enqueued that applies the record applied last again (no stage since the
  // previous build, e.g. a warm-up): the done word cannot tell it from the first, so the next
  // acquire (or synchronize) first waits for a fence recorded on its stream after `built`,
  // i.e. for every build enqueued so far.
  void fence_repeat() { fence_repeat_ = true; }
  // Waits until the build of the record committed last (and a repeated build) has finished
  // (before the memory is freed); the same errors as acquire. teardown (the destructor, a
  // Python __del__ before the build events die): in the relaxed capture mode; and if a build
  // may still read the records while the stage's stream is capturing a graph (a fence
  // recorded there would join the capture) or cannot be asked, no wait, and the memory is
  // kept (leaked) unless a later teardown wait succeeds.
  void synchronize(bool teardown = false);
  // Build ordering (docs/ZOS.md, "The runner contract"): when a wait falls back to its
  // fence, the stage's stream first waits for `built` (a CUevent recorded after each build
  // that may run on another stream), so the fence comes after the last build wherever it
  // ran. `staged` is unused here (the record is in host memory: a build waits for no
  // device work of its stage). 0, 0 turns it off.
  void set_build_events(uint64_t built, uint64_t staged);
  uint64_t host_ptr() const { return reinterpret_cast<uint64_t>(host_); }
  uint64_t device_ptr() const { return device_; }
  // The done word's host and device addresses (an int32 after the last slot).
  uint64_t done_host_ptr() const { return reinterpret_cast<uint64_t>(done_word()); }
  uint64_t done_device_ptr() const { return device_ + 4 * done_offset(); }
  int32_t done_seq() const { return __atomic_load_n(done_word(), __ATOMIC_ACQUIRE); }
  int64_t num_slots() const { return num_slots_; }
  int64_t slot_words() const { return slot_words_; }
  int64_t waits() const { return waits_; }  // acquires that found their slot still in use

 private:
  // The done word gets a 64-byte line of its own (the GPU writes it, the host reads it; no
  // slot's words share it): at the slots' end rounded up to kDoneWords words.
  static constexpr int64_t kDoneWords = 16;
  int64_t done_offset() const {
    return (num_slots_ * slot_words_ + kDoneWords - 1) / kDoneWords * kDoneWords;
  }
  int32_t* done_word() const { return host_ + done_offset(); }
  int32_t seq_of(int64_t slot) const;
  int32_t newest_seq() const;  // the SEQ of the newest committed record (commits_ > 0)
  // Whether the build of the record with SEQ `seq` has finished, given that `newest` is the
  // SEQ of the record committed last (records are applied in SEQ order).
  bool applied(int32_t seq, int32_t newest) const;
  // Blocks until applied(seq, newest): spins on the done word while polling a fence
  // recorded now on `stream` (after `built`). Throws std::runtime_error when the fence
  // completes and the done word has not reached seq (the record was staged but its build
  // was never enqueued: rule 2 of the runner contract), or when the driver reports an error.
  void wait_applied(int32_t seq, int32_t newest, uint64_t stream);
  // Waits for a fence recorded now on `stream` after `built` (fence_repeat).
  void drain(uint64_t stream);

  int64_t num_slots_, slot_words_;
  void* ctx_ = nullptr;
  int retained_ = -1;  // the device whose primary context ctx_ is (retained), else -1
  int32_t* host_ = nullptr;
  uint64_t device_ = 0;
  void* fence_ = nullptr;
  int next_ = 0;
  int64_t commits_ = 0;
  bool fence_repeat_ = false;
  bool keep_ = false;  // the last teardown wait could not wait: the memory is not freed
  uint64_t last_stream_ = 0;
  int64_t waits_ = 0;
  void* built_ = nullptr;
};

// Launches an instantiated CUDA graph (a CUgraphExec, i.e. a cudaGraphExec_t) of `device` on
// `stream`, in that device's primary context (the runtime's, torch's; retained on first use,
// made current for the call and the thread's own context put back): the one driver call of a
// graph replay, without torch's per-replay RNG prologue (two fills of its generator state),
// which a graph that draws no random numbers does not need. Throws std::invalid_argument for
// a negative device, std::runtime_error if the driver fails (e.g. the stream is capturing).
void launch_graph(uint64_t graph_exec, uint64_t stream, int64_t device);

// Runs fn with this thread's stream-capture mode relaxed (cuThreadExchangeStreamCaptureMode),
// then restores the mode, fn throwing or not: a call CUDA refuses while a capture is open in
// the global or this thread's thread-local mode (a graph's destruction: cudaGraphExecDestroy)
// runs and leaves that capture intact. If the driver cannot be loaded or refuses the
// exchange, fn runs in the mode as it is. Called from Python only, never inside another
// capture-mode scope of this thread (nested scopes keep the outermost scope's mode).
void call_with_relaxed_capture_mode(const std::function<void()>& fn);

// Whether `stream` (a CUstream of `device`) is capturing a CUDA graph (or holds a capture
// that was invalidated and not ended): a graph launched on it would be refused. The legacy
// default stream (0) cannot be captured: false without a driver call. Throws as launch_graph.
bool stream_capturing(uint64_t stream, int64_t device);

}  // namespace zos
