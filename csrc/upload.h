// PinnedUpload: the one host-to-device copy of a step's staging record, issued
// from native code through the CUDA driver API, which is loaded at run time
// (dlopen of libcuda.so.1): the extension needs no CUDA toolkit to build and
// imports on machines without a GPU. Two pinned buffers alternate; each is
// fenced by an event recorded after its copy, so the host never rewrites a
// buffer that an enqueued copy has not read yet (docs/ZOS.md, "Kernels inside the graph").
#pragma once
#include <cstdint>

namespace zos {

class PinnedUpload {
 public:
  // dst: device address of the staging buffer; src0/src1: the two pinned host
  // buffers; capacity: bytes each holds. Throws std::runtime_error if the
  // driver cannot be loaded or no CUDA context is current on this thread.
  PinnedUpload(uint64_t dst, uint64_t src0, uint64_t src1, int64_t capacity);
  ~PinnedUpload();
  PinnedUpload(const PinnedUpload&) = delete;
  PinnedUpload& operator=(const PinnedUpload&) = delete;

  // Index (0 or 1) of the buffer to fill next, after its previous copy finished.
  int acquire();
  // Enqueues the copy of nbytes of buffer k on `stream` (a CUstream / cudaStream_t)
  // and records k's fence after it; the next acquire returns the other buffer.
  void submit(int k, int64_t nbytes, uint64_t stream);
  // Waits until both buffers' copies are done (before the pinned buffers are freed).
  void synchronize();

 private:
  void bind_context();
  uint64_t dst_;
  uint64_t src_[2];
  int64_t capacity_;
  void* ctx_ = nullptr;
  void* fence_[2] = {nullptr, nullptr};
  int turn_ = 0;
};

}  // namespace zos
