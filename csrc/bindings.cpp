// Python bindings of the native core (module zos._C). Arrays are numpy arrays
// (a pinned torch tensor passes as tensor.numpy(), sharing its memory); every
// check runs before anything is written.
//
// The GIL is released only by a call that waits on the device (a ring slot or pinned buffer
// still in use, a synchronize; a stage that must wait runs all its work in that one release),
// never by one that does microseconds of work alone: a thread that drops the GIL
// takes it back only when the thread holding it lets go, which a busy Python thread does
// every switch interval (5 ms by default). In a serving process (transformers' server: the
// generation loop beside the thread that sends outputs) each release on the step's path
// could cost up to that.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <climits>
#include <memory>
#include <string>

#include "numpy_checks.h"
#include "packer.h"
#include "remap.h"
#include "staging.h"
#include "upload.h"

namespace py = pybind11;

void register_vllm_mirror(py::module_& m);  // csrc/vllm_mirror.cpp

namespace {

using zos::checked;

template <typename T>
const T* ptr(const py::array& a) {
  return static_cast<const T*>(a.data());
}

int64_t compute_remap(const py::handle& prev_obj, const py::handle& curr_obj,
                      const py::handle& out_obj) {
  auto prev = checked<int64_t>(prev_obj, "prev_req_ids");
  auto curr = checked<int64_t>(curr_obj, "curr_req_ids");
  auto out = checked<int32_t>(out_obj, "out", true);
  if (out.size() < curr.size())
    throw py::value_error("out has " + std::to_string(out.size()) + " elements, needs at least " +
                          std::to_string(curr.size()));
  thread_local zos::RemapTable table;
  return table.compute(ptr<int64_t>(prev), prev.size(), ptr<int64_t>(curr), curr.size(),
                       static_cast<int32_t*>(out.mutable_data()));
}

// The arrays of one DecodeStep, checked (dtype, 1-D, contiguous, matching lengths): the
// rules of this layer, what the native code needs to read the arrays at all; the StepInput
// over them and the references that keep them alive while the GIL is released. Each field's
// own values (ints that fit) are DecodeStep's to check (zos/step.py), every rule on values
// and on the previous step the packer's (packer.cpp); zos/step.py's docstring lists them.
struct CheckedStep {
  py::object keep[11];  // the arrays (the last three: none when there are no rewritten rows)
  zos::StepInput in{};
};

// Checks obj as a 1-D contiguous array of T named field (as `checked`), keeps a reference
// in *keep and returns its data and size.
template <typename T>
const T* view(const py::handle& obj, const char* field, py::object* keep, int64_t* size) {
  py::array a = checked<T>(obj, field);
  *size = a.size();
  const T* p = ptr<T>(a);
  *keep = std::move(a);
  return p;
}

CheckedStep check_step(const py::handle& req_ids, const py::handle& new_rows,
                       const py::handle& new_tokens, const py::handle& new_positions,
                       const py::handle& new_block_indptr, const py::handle& new_block_ids,
                       const py::handle& append_rows, const py::handle& append_block_ids,
                       const py::handle& rewrite_rows, const py::handle& rewrite_block_indptr,
                       const py::handle& rewrite_block_ids) {
  CheckedStep c;
  zos::StepInput& in = c.in;
  int64_t m = 0, ntoks = 0, npos = 0, nindptr = 0, nablks = 0;
  in.req_ids = view<int64_t>(req_ids, "req_ids", &c.keep[0], &in.n);
  in.new_rows = view<int32_t>(new_rows, "new_rows", &c.keep[1], &m);
  in.new_tokens = view<int32_t>(new_tokens, "new_tokens", &c.keep[2], &ntoks);
  in.new_positions = view<int32_t>(new_positions, "new_positions", &c.keep[3], &npos);
  in.new_block_indptr = view<int32_t>(new_block_indptr, "new_block_indptr", &c.keep[4],
                                      &nindptr);
  in.new_block_ids = view<int32_t>(new_block_ids, "new_block_ids", &c.keep[5], &in.l);
  in.append_rows = view<int32_t>(append_rows, "append_rows", &c.keep[6], &in.a);
  in.append_block_ids = view<int32_t>(append_block_ids, "append_block_ids", &c.keep[7],
                                      &nablks);
  in.m = m;
  if (ntoks != m || npos != m)
    throw py::value_error("new_tokens and new_positions must have len(new_rows) = " +
                          std::to_string(m) + " elements, got " + std::to_string(ntoks) +
                          " and " + std::to_string(npos));
  if (nindptr != m + 1)
    throw py::value_error("new_block_indptr must have len(new_rows) + 1 = " +
                          std::to_string(m + 1) + " elements, got " + std::to_string(nindptr));
  if (nablks != in.a)
    throw py::value_error("append_block_ids must have len(append_rows) = " +
                          std::to_string(in.a) + " elements, got " + std::to_string(nablks));
  // Rewritten rows (optional: none when all three are None).
  static const int32_t kZero = 0;
  in.rewrite_block_indptr = &kZero;  // no rewritten rows: indptr = [0]
  if (!rewrite_rows.is_none() || !rewrite_block_indptr.is_none() ||
      !rewrite_block_ids.is_none()) {
    int64_t nwindptr = 0;
    in.rewrite_rows = view<int32_t>(rewrite_rows, "rewrite_rows", &c.keep[8], &in.x);
    in.rewrite_block_indptr = view<int32_t>(rewrite_block_indptr, "rewrite_block_indptr",
                                            &c.keep[9], &nwindptr);
    in.rewrite_block_ids = view<int32_t>(rewrite_block_ids, "rewrite_block_ids", &c.keep[10],
                                         &in.y);
    if (nwindptr != in.x + 1)
      throw py::value_error("rewrite_block_indptr must have len(rewrite_rows) + 1 = " +
                            std::to_string(in.x + 1) + " elements, got " +
                            std::to_string(nwindptr));
  }
  return c;
}

// The same checks on a zos.step.DecodeStep (or any object with those attributes), its
// arrays read by attribute name (names interned once: no Python argument tuple per step).
CheckedStep check_step_object(const py::handle& step) {
  static const char* const kFields[11] = {
      "req_ids", "new_rows", "new_tokens", "new_positions", "new_block_indptr",
      "new_block_ids", "append_rows", "append_block_ids", "rewrite_rows",
      "rewrite_block_indptr", "rewrite_block_ids"};
  static PyObject** names = [] {  // leaked on purpose: used until the interpreter exits
    auto** n = new PyObject*[11];
    for (int i = 0; i < 11; ++i) n[i] = PyUnicode_InternFromString(kFields[i]);
    return n;
  }();
  py::object a[11];
  for (int i = 0; i < 11; ++i) {
    PyObject* v = PyObject_GetAttr(step.ptr(), names[i]);
    if (v == nullptr) {
      PyErr_Clear();
      throw py::type_error(std::string("step must be a zos.DecodeStep (no attribute ") +
                           kFields[i] + "), got " + std::string(py::str(py::type::of(step))));
    }
    a[i] = py::reinterpret_steal<py::object>(v);
  }
  return check_step(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10]);
}

int64_t pack_checked(zos::StepPacker& self, const CheckedStep& c, const py::handle& out_obj,
                     int32_t seq) {
  auto out = checked<int32_t>(out_obj, "out", true);
  return self.pack(c.in, static_cast<int32_t*>(out.mutable_data()), out.size(), seq);
}

int64_t pack(zos::StepPacker& self, const py::handle& req_ids, const py::handle& new_rows,
             const py::handle& new_tokens, const py::handle& new_positions,
             const py::handle& new_block_indptr, const py::handle& new_block_ids,
             const py::handle& append_rows, const py::handle& append_block_ids,
             const py::handle& out_obj, const py::handle& rewrite_rows,
             const py::handle& rewrite_block_indptr, const py::handle& rewrite_block_ids,
             int32_t seq) {
  const CheckedStep c = check_step(req_ids, new_rows, new_tokens, new_positions,
                                   new_block_indptr, new_block_ids, append_rows,
                                   append_block_ids, rewrite_rows, rewrite_block_indptr,
                                   rewrite_block_ids);
  return pack_checked(self, c, out_obj, seq);
}

int64_t pack_step(zos::StepPacker& self, const py::handle& step, const py::handle& out_obj,
                  int32_t seq) {
  return pack_checked(self, check_step_object(step), out_obj, seq);
}

// The device backend's per-step call (StepPacker.stage_call): stage(step, seq[, graph_exec]),
// bound once to a packer, the MappedRing or PinnedUpload its records go to, the stage's stream
// and the device. A plain CPython function called by vectorcall (arguments as an array, no
// tuple, no pybind11 dispatch: about 1 us less per step on the H200's host than a bound
// method with the six arguments, cold after the scheduler). Its self is a capsule of this.
struct StageCall {
  zos::StepPacker* packer = nullptr;
  zos::MappedRing* ring = nullptr;      // records go into the ring's slots, or
  zos::PinnedUpload* upload = nullptr;  // into the upload's pinned buffers, then copied
  uint64_t stream = 0;
  int64_t device = 0;
  // The packer and the ring (upload) objects, alive while the call is. A PinnedUpload's pinned
  // buffers and its destination are the backend's tensors: the call must not outlive them.
  py::object keep[2];
};
constexpr const char* kStageCallName = "zos._C.StageCall";

// sink.acquire(args...), the GIL released only if it must wait.
template <typename Sink, typename... Args>
int acquire_released_if_waiting(Sink& sink, Args... args) {
  if (sink.ready()) return sink.acquire(args...);
  py::gil_scoped_release release;
  return sink.acquire(args...);
}

// Whether the stage's sink would wait for the device (its next slot or buffer still in use),
// after refusing (RuntimeError, nothing done) a stream that is capturing a CUDA graph: a stage
// is host work outside any graph (docs/ZOS.md, "The runner contract"), its fences, copy or
// launch would be captured instead of done, and the upload's event query would invalidate
// the capture.
bool sink_ready(const StageCall& s) {
  if (zos::stream_capturing(s.stream, s.device))
    throw std::runtime_error(
        "stage: the backend's stream is capturing a CUDA graph; a stage is host work outside "
        "any graph (capture build, and stage before each replay)");
  return s.ring != nullptr ? s.ring->ready() : s.upload->ready();
}

// One stage, after sink_ready: the next slot (after the build of the record it holds has
// finished) or pinned buffer (after its copy), the pack, on the copy path the copy, with a
// graph_exec the prep graph's launch, on the ring the slot's commit. On a throw from the
// packer nothing was written where the device reads and no slot committed; on a device error
// (a slot whose record no build read, a failed copy or launch) the packer is reset, since the
// device may not get this step: the next step's rows must all be new.
int64_t stage_step(const StageCall& s, const zos::StepInput& in, int32_t seq,
                   uint64_t graph_exec) {
  try {  // the packer throws std::invalid_argument, the driver and the ring std::runtime_error
    if (s.ring != nullptr) {
      zos::MappedRing& ring = *s.ring;
      const int slot = ring.acquire(s.stream);
      int32_t* out = reinterpret_cast<int32_t*>(ring.host_ptr()) + slot * ring.slot_words();
      const int64_t words = s.packer->pack(in, out, ring.slot_words(), seq);
      if (graph_exec) zos::launch_graph(graph_exec, s.stream, s.device);
      ring.commit();
      return words;
    }
    zos::PinnedUpload& up = *s.upload;
    const int k = up.acquire();
    const int64_t words = s.packer->pack(in, up.host_buffer(k), up.capacity() / 4, seq);
    up.submit(k, 4 * words, s.stream);
    if (graph_exec) zos::launch_graph(graph_exec, s.stream, s.device);
    return words;
  } catch (const std::runtime_error&) {
    s.packer->reset();
    throw;
  }
}

// An int argument of the stage call in [lo, hi], else TypeError/ValueError naming it.
int64_t int_arg(PyObject* obj, const char* field, int64_t lo, int64_t hi) {
  if (!PyLong_Check(obj) || PyBool_Check(obj))
    throw py::type_error(std::string(field) + " must be an int, got " +
                         Py_TYPE(obj)->tp_name);
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
  if (overflow || v < lo || v > hi)
    throw py::value_error(std::string(field) + " must be in [" + std::to_string(lo) + ", " +
                          std::to_string(hi) + "], got " + std::string(py::str(obj)));
  return v;
}

// The exception in flight as a Python error, as pybind11's default translator does.
void set_python_error() {
  try {
    throw;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::out_of_range& e) {
    PyErr_SetString(PyExc_IndexError, e.what());
  } catch (const std::overflow_error& e) {
    PyErr_SetString(PyExc_OverflowError, e.what());
  } catch (const std::logic_error& e) {  // invalid_argument, length_error, domain_error
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::range_error& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "zos._C: unknown C++ exception");
  }
}

PyObject* stage_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  try {
    const auto* s = static_cast<const StageCall*>(PyCapsule_GetPointer(self, kStageCallName));
    if (nargs != 2 && nargs != 3)
      throw py::type_error("stage(step, seq, graph_exec=0, /) takes 2 or 3 arguments, got " +
                           std::to_string(nargs));
    const auto seq = static_cast<int32_t>(int_arg(args[1], "seq", 0, zos::staging::kSeqMask));
    const auto graph_exec =
        static_cast<uint64_t>(nargs == 3 ? int_arg(args[2], "graph_exec", 0, INT64_MAX) : 0);
    const CheckedStep c = check_step_object(args[0]);
    int64_t words;
    if (sink_ready(*s)) {
      words = stage_step(*s, c.in, seq, graph_exec);
    } else {
      py::gil_scoped_release release;
      words = stage_step(*s, c.in, seq, graph_exec);
    }
    return PyLong_FromLongLong(words);
  } catch (...) {
    set_python_error();
    return nullptr;
  }
}

PyMethodDef stage_call_def = {
    "stage", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(&stage_call)),
    METH_FASTCALL,
    "stage(step, seq, graph_exec=0, /) -> words (see StepPacker.stage_call)."};

py::object make_stage_call(py::object packer, py::object sink, uint64_t stream,
                           int64_t device) {
  if (device < 0)
    throw py::value_error("device must be >= 0, got " + std::to_string(device));
  auto s = std::make_unique<StageCall>();
  s->packer = &packer.cast<zos::StepPacker&>();
  if (py::isinstance<zos::MappedRing>(sink))
    s->ring = &sink.cast<zos::MappedRing&>();
  else if (py::isinstance<zos::PinnedUpload>(sink))
    s->upload = &sink.cast<zos::PinnedUpload&>();
  else
    throw py::type_error("sink must be a zos._C.MappedRing or zos._C.PinnedUpload, got " +
                         std::string(py::str(py::type::of(sink))));
  s->stream = stream;
  s->device = device;
  s->keep[0] = std::move(packer);
  s->keep[1] = std::move(sink);
  PyObject* cap = PyCapsule_New(s.get(), kStageCallName, [](PyObject* c) {
    delete static_cast<StageCall*>(PyCapsule_GetPointer(c, kStageCallName));
  });
  if (cap == nullptr) throw py::error_already_set();
  s.release();  // owned by the capsule now
  auto capsule = py::reinterpret_steal<py::object>(cap);
  PyObject* fn = PyCFunction_NewEx(&stage_call_def, capsule.ptr(), nullptr);
  if (fn == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

void apply_accepted(zos::StepPacker& self, const py::handle& accepted, int64_t steps_ago) {
  auto acc = checked<int32_t>(accepted, "accepted");
  self.apply_accepted(ptr<int32_t>(acc), acc.size(), steps_ago);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "zos native core: request remap and the packing of a decode step's staging record.";
  register_vllm_mirror(m);

  m.def(
      "call_with_relaxed_capture_mode",
      [](const py::function& fn) { zos::call_with_relaxed_capture_mode([&fn] { fn(); }); },
      py::arg("fn"),
      R"doc(Call ``fn()`` with this thread's stream-capture mode relaxed
(``cuThreadExchangeStreamCaptureMode``), then restore the mode, also when ``fn`` raises.

A potentially unsafe call that CUDA refuses while a graph capture is open in the global mode
(torch's default) or in this thread's thread-local mode, such as a CUDA graph's destruction
(``cudaGraphExecDestroy``: torch's ``CUDAGraph.reset``), then runs and leaves that capture
intact (work enqueued on a capturing stream still joins its capture);
:class:`zos.graphs.CaptureSafeGraph` resets itself so when it is freed. Without a loadable
CUDA driver ``fn`` just runs.

Raises:
    whatever ``fn`` raises.)doc");

  m.def("launch_graph", &zos::launch_graph, py::arg("graph_exec"), py::arg("stream"),
        py::arg("device"),
        R"doc(Launch an instantiated CUDA graph on a stream (``cuGraphLaunch``), in the device's
primary context (the one torch uses), whichever context the calling thread has current.

Args:
    graph_exec (int): a ``cudaGraphExec_t`` of ``device``, e.g.
        ``torch.cuda.CUDAGraph.raw_cuda_graph_exec()`` (torch >= 2.9); the graph must outlive
        the launch's completion (do not ``reset()`` it).
    stream (int): a ``cudaStream_t`` of ``device`` (0: the legacy default stream); not one
        that is capturing (a graph launch cannot be captured this way).
    device (int): the CUDA device ordinal.

It skips what ``torch.cuda.CUDAGraph.replay`` adds around the launch: the refill of each
registered random generator's state (two small fill kernels), which only a graph that draws
random numbers needs. zos's prep graphs draw none.

Raises:
    ValueError: ``device`` < 0.
    RuntimeError: the driver cannot be loaded, or rejects the launch (message from
        cuGetErrorString).)doc");

  m.def("compute_remap", &compute_remap, py::arg("prev_req_ids"), py::arg("curr_req_ids"),
        py::arg("out"),
        R"doc(Remap between two consecutive decode batches.

Writes ``out[i] = j`` where ``curr_req_ids[i] == prev_req_ids[j]``, else -1, for
i in [0, N), and returns the number of -1 rows. O(N + P) through a hash table
kept per thread across calls (no allocation once it is large enough); holds
the GIL (microseconds of work). Rule from docs/ZOS.md ("One decode step, as data").

Args:
    prev_req_ids: numpy int64 [P], request ids of the previous step's rows.
    curr_req_ids: numpy int64 [N], request ids of this step's rows.
    out: numpy int32 with at least N elements (normally ``pinned_tensor.numpy()``);
        written in place, elements past N untouched.

Raises:
    TypeError: an argument is not a numpy array or has the wrong dtype.
    ValueError: not 1-D, not contiguous, ``out`` read-only or shorter than N, or a
        request id appears twice in either batch (the id and both positions are
        named). Nothing is written when an error is raised.)doc");

  py::class_<zos::StepPacker>(m, "StepPacker",
                              R"doc(Packs one decode step into a staging record (layout: csrc/staging.h).

Computes the remap to the previous step, validates the step against a mirror of
the previous rows (request id, first position, block count), and writes the
record into a caller-owned int32 buffer, normally a pinned tensor's numpy view.
Raises ValueError (naming field, row, request and value) before writing anything.
Which layer checks which rule of a step (DecodeStep, these bindings, the packer):
the module docstring of zos.step.)doc")
      .def(py::init([](int64_t max_num_reqs, int64_t uniform_decode_query_len, int64_t block_size, int64_t max_num_blocks_per_req,
                       int64_t num_kv_blocks, int64_t vocab_size, int64_t null_block) {
             return zos::StepPacker(
                 {max_num_reqs, uniform_decode_query_len, block_size, max_num_blocks_per_req, num_kv_blocks,
                  vocab_size, null_block});
           }),
           py::arg("max_num_reqs"), py::arg("uniform_decode_query_len"), py::arg("block_size"),
           py::arg("max_num_blocks_per_req"), py::arg("num_kv_blocks"), py::arg("vocab_size"),
           py::arg("null_block") = 0,
           R"doc(null_block: the padding profile's null block (zos.buffers.PaddingProfile): 0, reserved
inside the pool (request block ids in [1, num_kv_blocks)), or >= num_kv_blocks, outside it
(request block ids in [0, num_kv_blocks), as transformers hands them out). ValueError otherwise.)doc")
      .def("pack", &pack, py::arg("req_ids"), py::arg("new_rows"), py::arg("new_tokens"),
           py::arg("new_positions"), py::arg("new_block_indptr"), py::arg("new_block_ids"),
           py::arg("append_rows"), py::arg("append_block_ids"), py::arg("out"),
           py::arg("rewrite_rows") = py::none(), py::arg("rewrite_block_indptr") = py::none(),
           py::arg("rewrite_block_ids") = py::none(), py::arg("seq") = 0,
           R"doc(Validate one step and write its staging record into ``out``; returns its length in words.

Args (numpy, 1-D, contiguous): req_ids int64 [N]; new_rows int32 [M] (rows whose
request starts, resumes or restarts here); new_tokens int32 [M] (input token);
new_positions int32 [M] (position of that token); new_block_indptr int32 [M+1]
and new_block_ids int32 [L] (CSR: each new row's whole block-table row);
append_rows int32 [A] and append_block_ids int32 [A] (a block appended after the
last block of a carried row); out int32 [capacity], written in place; seq: the
record's SEQ word (a ring slot's sequence number, zos.staging_ring; 0 otherwise).
Optional, all three or none: rewrite_rows int32 [X] (carried rows whose block list
changed other than by an append: prefix-sharing swaps, copy-on-write, swap-in,
defragmentation), rewrite_block_indptr int32 [X+1] and rewrite_block_ids int32 [Y]
(CSR: each such row's whole block list after this step, appended blocks included;
its token and position still carry over). A rewritten row is listed, with a record
of its whole list (col0 = 0).

Only the rows that change are listed (the sparse record, csrc/staging.h), unless
``list_every_row`` is set. With q = 1 the work is O(changed rows + M + L + A): a
row that keeps its request and gets no block is neither visited nor listed.

Rows not in new_rows must hold a request of the previous step; their position
advances by q and their blocks carry over (or are replaced by their rewrite_block_ids).
Raises ValueError on any inconsistency
(unknown request without payload, block ids outside [first, num_kv_blocks) with first 1
when null_block is 0 and 0 otherwise, a position
not covered by the row's blocks, beyond max_num_blocks_per_req * block_size, more than
max_num_reqs rows, record larger than ``out``); TypeError on wrong dtypes.)doc")
      .def("pack_step", &pack_step, py::arg("step"), py::arg("out"), py::arg("seq") = 0,
           R"doc(``pack`` of a :class:`zos.DecodeStep` (its arrays read by attribute name, the
rewritten rows included): the same checks, record and errors, and a TypeError naming the
missing attribute when ``step`` is not a DecodeStep.)doc")
      .def("stage_call", &make_stage_call, py::arg("sink"), py::arg("stream"),
           py::arg("device"),
           R"doc(The per-step stage of the device backend, bound to this packer, ``sink`` (a
:class:`MappedRing` or :class:`PinnedUpload`), ``stream`` (a ``cudaStream_t`` as an int, on
which the copy, the fences and the launch are enqueued) and ``device`` (the CUDA ordinal,
>= 0: ValueError otherwise; TypeError for another ``sink``). Returns a function
``stage(step, seq, graph_exec=0, /) -> int`` (positional arguments only), called without
pybind11's dispatch, which does in
one call, holding the GIL unless the slot or buffer is still in use, when the whole call
(the wait, then the rest) runs with the GIL released (``graph_exec``: a ``cudaGraphExec_t``
of the prep graph, or 0):

- on a ring: ``acquire(stream)`` (wait until the build of the record in the next slot has
  finished), ``pack_step`` into that slot with SEQ ``seq``, with ``graph_exec``
  ``launch_graph(graph_exec, stream, device)``, ``commit()``;
- on an upload: ``acquire()`` (wait for that buffer's previous copy), ``pack_step`` with
  ``seq``, ``submit`` (the H2D copy and its fence), with ``graph_exec`` the launch after it;

and returns the record's words. Raises, before anything: TypeError/ValueError for ``seq`` not
an int in [0, SEQ_MASK] (``zos._C.staging``) or ``graph_exec`` not an int in [0, 2^63);
RuntimeError while ``stream``
is capturing a CUDA graph (a stage is host work outside any graph; the legacy default stream,
0, cannot capture and is not asked); as ``pack_step`` (no slot or buffer is then written
where the device reads, none committed, nothing enqueued or launched). RuntimeError on a
device error (``MappedRing.acquire`` finding a record no build read, a failed copy or
launch): the packer is then reset, since the device may not get this step (the next step's
rows must all be new). The function keeps the packer and ``sink`` alive, not what a
``PinnedUpload`` copies from and to: it must not outlive those buffers.)doc")
      .def("apply_accepted", &apply_accepted, py::arg("accepted"), py::arg("steps_ago"),
           R"doc(Exact accepted counts of an earlier step (speculative decoding, q > 1).

Until a step's counts arrive, the mirror advances each carried row by q (every draft
accepted), an upper bound of its position: validation then asks for the worst case's
blocks. ``accepted`` int32 [P] (numpy, one count in [1, q] per row of that step) of
the last packed step (``steps_ago`` = 0: the next pack advances each row by its count)
or of the step before it (``steps_ago`` = 1: the last step's positions are lowered by
q - count). Counts given twice change nothing more. Raises ValueError (nothing
changed) on a wrong length, a count outside [1, q] or steps_ago not 0 or 1.)doc")
      .def_readwrite("list_every_row", &zos::StepPacker::list_every_row,
                     "List every row in the record (the dense record: a reference and fallback; "
                     "default False, the sparse record listing only rows that change).")
      .def_property_readonly("rows_visited", &zos::StepPacker::rows_visited,
                             "Rows the last successful pack visited: the changed rows (every "
                             "row with draft tokens) and the rows whose blocks ran out then.")
      .def("reset", &zos::StepPacker::reset,
           "Forget the previous step; every row of the next step must then be new.")
      .def_property_readonly("prev_num_reqs", &zos::StepPacker::prev_num_reqs,
                             "Request rows of the last packed step.");

  py::class_<zos::PinnedUpload>(m, "PinnedUpload",
                                R"doc(The step's one H2D copy, issued natively through the CUDA driver API.

Two pinned host buffers alternate, each fenced by an event recorded after its
copy (docs/ZOS.md, "Kernels inside the graph"). The driver (libcuda.so.1) is loaded
at first use, so the extension builds without a CUDA toolkit.

Args:
    dst: device address of the staging buffer (``tensor.data_ptr()``).
    src0, src1: addresses of two pinned host buffers of ``capacity`` bytes.
    capacity: bytes each buffer holds.
    device: the CUDA device ordinal: its primary context (torch's) is retained and made
        current for each driver call, on any thread; -1 (default): the context current
        on the constructing thread.

Raises:
    RuntimeError: the driver cannot be loaded, or device is -1 and no CUDA context is
        current.)doc")
      .def(py::init<uint64_t, uint64_t, uint64_t, int64_t, int64_t>(), py::arg("dst"),
           py::arg("src0"), py::arg("src1"), py::arg("capacity"), py::arg("device") = -1)
      .def("acquire", [](zos::PinnedUpload& up) { return acquire_released_if_waiting(up); },
           "Wait until the next buffer's previous copy is done; returns its index (0 or 1).")
      .def("ready", &zos::PinnedUpload::ready,
           "Whether acquire would return without waiting (the next buffer's copy is done).")
      .def("submit", &zos::PinnedUpload::submit, py::arg("k"), py::arg("nbytes"),
           py::arg("stream"),
           "Enqueue the copy of nbytes of buffer k on stream (a raw CUstream) and fence it.\n\n"
           "Raises ValueError if k is not the acquired buffer or nbytes exceeds capacity.")
      .def("synchronize", &zos::PinnedUpload::synchronize, py::arg("teardown") = false,
           py::call_guard<py::gil_scoped_release>(),
           "Wait until both buffers' copies are done (before freeing the pinned buffers).\n\n"
           "``teardown=True`` (a ``__del__``, which the garbage collector may run inside this "
           "thread's own CUDA graph capture): in the relaxed capture mode, so the driver "
           "allows the wait (the fences are recorded outside any capture) and that capture "
           "stays intact; otherwise the thread-local mode "
           "(a capture of this thread's own refuses the wait).\n\n"
           "Raises RuntimeError if the driver reports an error.")
      .def("set_build_events", &zos::PinnedUpload::set_build_events, py::arg("built"),
           py::arg("staged"),
           "Build ordering (docs/ZOS.md, \"The runner contract\"): from now on each submit "
           "makes its stream wait for the CUevent ``built`` (recorded after each build that may "
           "run on another stream) and records the CUevent ``staged`` on it, which such a build "
           "waits for; raw handles, 0, 0 turns it off.");

  py::class_<zos::MappedRing>(m, "MappedRing",
                              R"doc(The zero-copy staging ring: records in mapped pinned host memory, and a done word.

``num_slots`` records of ``slot_words`` int32 words and, after them, the done word, allocated
with cuMemHostAlloc (DEVICEMAP | PORTABLE) and zeroed; the prep kernels read the records at
``device_ptr`` (cuMemHostGetDevicePointer) inside the graph, no copy, and write into the done
word (``done_device_ptr``) the SEQ of each record they have finished reading. Per step:
``acquire(stream)`` returns the next slot once the build of the record it holds has finished
(the done word has reached its SEQ: no driver call while the device keeps up; otherwise it
waits); the record is packed into ``array()[slot]``; ``commit()``. docs/ZOS.md, "The staging
record" and "The done word".

``device``: the CUDA device ordinal; its primary context (torch's) is retained and made
current for each driver call (the thread's own context is put back after), so the ring
can be built and used on a thread that never touched CUDA; -1 (default): the context
current on the constructing thread.

Raises:
    RuntimeError: the driver cannot be loaded, device is -1 and no CUDA context is
        current, or the memory cannot be allocated or mapped.
    ValueError: num_slots or slot_words < 1.)doc")
      .def(py::init<int64_t, int64_t, int64_t>(), py::arg("num_slots"), py::arg("slot_words"),
           py::arg("device") = -1)
      .def("acquire",
           [](zos::MappedRing& ring, uint64_t stream) {
             return acquire_released_if_waiting(ring, stream);
           },
           py::arg("stream"),
           R"doc(The next slot, once the build of the record it holds (if any) has finished.

No driver call when the done word shows that build finished. Otherwise (the host
``num_slots`` steps ahead of the device) ``stream`` (a raw CUstream: the stage's) first waits
for the last build's ``built`` event (``set_build_events``), a fence is recorded on it, and the
host spins on the done word, polling the fence; counts one wait.

Raises:
    RuntimeError: the fence completed and the done word never reached the record's SEQ (it
        was staged and never built: rule 2 of docs/ZOS.md, "The runner contract"), or the
        driver reports an error.)doc")
      .def("ready", &zos::MappedRing::ready,
           "Whether acquire would return without waiting, read from the done word (no driver "
           "call).")
      .def("commit", &zos::MappedRing::commit,
           "The acquired slot holds a staged record: the next acquire takes the following slot.")
      .def("fence_repeat", &zos::MappedRing::fence_repeat,
           "A build that applies the record applied last again (no stage since the previous "
           "build) was enqueued: the done word cannot tell it from the first, so the next "
           "``acquire`` (or ``synchronize``) first waits for a fence recorded on its stream "
           "after ``built``, i.e. for every build enqueued so far.")
      .def("set_build_events", &zos::MappedRing::set_build_events, py::arg("built"),
           py::arg("staged"),
           "Build ordering (docs/ZOS.md, \"The runner contract\"): from now on the fence of a "
           "waiting acquire comes after the CUevent ``built`` (recorded after each build that "
           "may run on another stream); ``staged`` is unused (the record is in host memory). "
           "Raw handles; 0, 0 turns it off.")
      .def("synchronize", &zos::MappedRing::synchronize, py::arg("teardown") = false,
           py::call_guard<py::gil_scoped_release>(),
           "Wait until the build of the record committed last has finished (as ``acquire`` "
           "waits, with its errors).\n\n"
           "``teardown=True`` (a ``__del__``, before the build events die; the garbage collector "
           "may run it inside this thread's own CUDA graph capture): in the relaxed capture "
           "mode; if a build may still read the records while the stage's stream is capturing "
           "(a fence recorded there would join the capture), no wait: the memory is kept "
           "(not freed) unless a later teardown wait succeeds.")
      .def("array", [](py::object self) {
             auto& ring = self.cast<zos::MappedRing&>();
             return py::array_t<int32_t>({ring.num_slots(), ring.slot_words()},
                                         reinterpret_cast<int32_t*>(ring.host_ptr()), self);
           },
           "The slots as a writable numpy int32 array [num_slots, slot_words] over the "
           "mapped memory (it keeps the ring alive).")
      .def_property_readonly("host_ptr", &zos::MappedRing::host_ptr)
      .def_property_readonly("device_ptr", &zos::MappedRing::device_ptr,
                             "The device address of slot 0 (unified addressing).")
      .def_property_readonly("done_device_ptr", &zos::MappedRing::done_device_ptr,
                             "The device address of the done word (int32).")
      .def_property_readonly("done_seq", &zos::MappedRing::done_seq,
                             "The done word: the SEQ of the record whose build finished last.")
      .def("done_array", [](py::object self) {
             auto& ring = self.cast<zos::MappedRing&>();
             return py::array_t<int32_t>({int64_t{1}},
                                         reinterpret_cast<int32_t*>(ring.done_host_ptr()), self);
           },
           "The done word as a writable numpy int32 array [1] over the mapped memory (it keeps "
           "the ring alive).")
      .def_property_readonly("num_slots", &zos::MappedRing::num_slots)
      .def_property_readonly("slot_words", &zos::MappedRing::slot_words)
      .def_property_readonly("waits", &zos::MappedRing::waits,
                             "Acquires that had to wait for their slot's build.");

  namespace st = zos::staging;
  auto staging = m.def_submodule("staging", R"doc(Layout of the staging record (csrc/staging.h).

Word offsets and sizes in int32 words. A record is: a header of HEADER_WORDS
words (NUM_REQS, NUM_TOKENS, PREV_REQS, NUM_RECORDS, NUM_BLOCK_IDS, Q, NUM_LISTED
and SEQ are the indices of its fields), C listed rows of LIST_WORDS words (L_ROW,
L_SRC, L_REC the offsets of their fields), M row records of RECORD_WORDS words
(R_TOKEN, R_POS0, R_COL0, R_COUNT and R_BLK_OFF are the offsets of their fields)
and L block ids. SEQ_MASK bounds a sequence number. zos.staging re-exports these.)doc");
  staging.attr("HEADER_WORDS") = st::kHeaderWords;
  staging.attr("RECORD_WORDS") = st::kRecordWords;
  staging.attr("NUM_REQS") = static_cast<int64_t>(st::kNumReqs);
  staging.attr("NUM_TOKENS") = static_cast<int64_t>(st::kNumTokens);
  staging.attr("PREV_REQS") = static_cast<int64_t>(st::kPrevReqs);
  staging.attr("NUM_RECORDS") = static_cast<int64_t>(st::kNumRecords);
  staging.attr("NUM_BLOCK_IDS") = static_cast<int64_t>(st::kNumBlockIds);
  staging.attr("Q") = static_cast<int64_t>(st::kQ);
  staging.attr("NUM_LISTED") = static_cast<int64_t>(st::kNumListed);
  staging.attr("SEQ") = static_cast<int64_t>(st::kSeq);
  staging.attr("SEQ_MASK") = static_cast<int64_t>(st::kSeqMask);
  staging.attr("LIST_WORDS") = st::kListWords;
  staging.attr("L_ROW") = static_cast<int64_t>(st::kListRow);
  staging.attr("L_SRC") = static_cast<int64_t>(st::kListSrc);
  staging.attr("L_REC") = static_cast<int64_t>(st::kListRec);
  staging.attr("R_TOKEN") = static_cast<int64_t>(st::kToken);
  staging.attr("R_POS0") = static_cast<int64_t>(st::kPos0);
  staging.attr("R_COL0") = static_cast<int64_t>(st::kCol0);
  staging.attr("R_COUNT") = static_cast<int64_t>(st::kCount);
  staging.attr("R_BLK_OFF") = static_cast<int64_t>(st::kBlkOff);
  staging.def("total_words", &st::total_words, py::arg("c"), py::arg("m"), py::arg("l"),
              "Words of a record with c listed rows, m row records and l block ids: "
              "HEADER_WORDS + LIST_WORDS * c + RECORD_WORDS * m + l.");
  staging.def("capacity_words", &st::capacity_words, py::arg("max_num_reqs"),
              py::arg("max_num_blocks_per_req"),
              "Largest record for max_num_reqs rows of at most max_num_blocks_per_req blocks "
              "(every row listed and new, each with a full block-table row): "
              "total_words(R, R, R * W).");
}
