// zos._C.VllmMirror: the mirror of vLLM 0.26's scheduler outputs (zos/integrations/vllm_steps.py
// holds the contract: which fields are read, which step is zos's, the row order). One call per
// scheduler output reads vLLM's Python objects through the C API (no Python loop, no numpy call)
// and returns the arrays of the zos decode step, or None. zos._C.vllm_batch_arrays: the host
// arrays of runner v2's InputBatch for such a step, from vLLM's request state, in one call.
//
// State per request slot: its block ids (a row of max_num_blocks_per_req; blocks past it are
// counted, not kept: a row holding them is vLLM's to prepare), block count, computed tokens,
// prefill length, and its zos id, position and block count in the last zos step. A request's
// slot is found through a dict (vLLM's request id -> slot), so a step costs one dict lookup per
// row and plain loops over the rows.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "numpy_checks.h"

namespace py = pybind11;

namespace {

// A Python int as int64, else the field named in a TypeError / OverflowError.
int64_t as_int(PyObject* obj, const std::string& field) {
  if (!PyLong_Check(obj))
    throw py::type_error(field + " must hold ints, got " + Py_TYPE(obj)->tp_name);
  const long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

// obj as a list or tuple (its items read with PySequence_Fast_ITEMS), else TypeError naming
// field.
py::object fast_seq(PyObject* obj, const char* field) {
  if (!PyList_Check(obj) && !PyTuple_Check(obj))
    throw py::type_error(std::string("scheduler_output: ") + field +
                         " must be a list or tuple, got " + Py_TYPE(obj)->tp_name);
  return py::reinterpret_borrow<py::object>(obj);
}

py::object attr(PyObject* obj, const py::str& name) {
  PyObject* v = PyObject_GetAttr(obj, name.ptr());
  if (v == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(v);
}

template <typename T>
py::array_t<T> array_of(const std::vector<T>& v) {
  py::array_t<T> a(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
}

class VllmMirror {
 public:
  VllmMirror(int64_t block_size, int64_t max_num_reqs, int64_t width, bool speculative)
      : block_size_(block_size), max_num_reqs_(max_num_reqs), width_(width),
        speculative_(speculative) {
    for (auto [name, v] : {std::pair{"block_size", block_size}, {"max_num_reqs", max_num_reqs},
                           {"max_num_blocks_per_req", width}})
      if (v < 1 || v > INT32_MAX)
        throw py::value_error(std::string(name) + " must be in [1, 2^31), got " +
                              std::to_string(v));
    if (width * block_size > INT32_MAX)  // positions are int32
      throw py::value_error("max_num_blocks_per_req * block_size must be < 2^31, got " +
                            std::to_string(width) + " * " + std::to_string(block_size));
    grow(max_num_reqs);
  }

  // Reads one scheduler output (every one, in order) and returns None or the zos step:
  // ((zos ids int64[N], new_rows, new_tokens (0), new_positions, new_block_indptr,
  //   new_block_ids, append_rows, append_block_ids: int32), list of vLLM's ids in batch order).
  py::object step(const py::handle& so) {
    observe(so.ptr());
    return build(so.ptr());
  }

  void forget() { prev_ = 0; }

  py::ssize_t num_requests() const { return PyDict_Size(slot_of_.ptr()); }

 private:
  int64_t block_size_, max_num_reqs_, width_;
  bool speculative_, single_group_ = true;
  py::dict slot_of_;  // vLLM request id (str) -> slot (int)
  std::vector<int64_t> free_;
  int64_t slots_ = 0;
  std::vector<int32_t> blocks_;  // [slots, width]
  std::vector<int64_t> num_blocks_, computed_, prefill_len_, zid_, last_stamp_, last_pos_,
      last_num_blocks_;
  int64_t stamp_ = 0;  // counts builds: a step's stamp is >= 1
  // the stamp of the last zos step, 0 after a step that is not zos's: a row carries over
  // only from that step
  int64_t prev_ = 0;
  int64_t next_id_ = 0;
  std::vector<int64_t> cached_slots_;  // the last output's cached requests' slots
  std::vector<int64_t> cached_mark_;   // per slot: the observe that saw it cached last
  int64_t observed_ = 0;               // counts observes
  // scratch of one build
  std::vector<int64_t> slots_of_rows_;

  const py::str s_finished{"finished_req_ids"}, s_preempted{"preempted_req_ids"},
      s_new{"scheduled_new_reqs"}, s_cached{"scheduled_cached_reqs"}, s_req_id{"req_id"},
      s_block_ids{"block_ids"}, s_computed{"num_computed_tokens"},
      s_prefill{"prefill_token_ids"}, s_prompt{"prompt_token_ids"}, s_req_ids{"req_ids"},
      s_resumed{"resumed_req_ids"}, s_new_block_ids{"new_block_ids"},
      s_num_sched{"num_scheduled_tokens"}, s_total{"total_num_scheduled_tokens"},
      s_spec{"scheduled_spec_decode_tokens"};

  void grow(int64_t slots) {
    const int64_t old = slots_;
    slots_ = slots;
    blocks_.resize(slots * width_, 0);
    for (auto* v : {&num_blocks_, &computed_, &prefill_len_, &zid_, &last_stamp_, &last_pos_,
                    &last_num_blocks_, &cached_mark_})
      v->resize(slots, 0);
    for (int64_t s = slots - 1; s >= old; --s) free_.push_back(s);
  }

  // Block ids of the list `ids` at columns start.. of `slot` (past the table: counted only).
  void set_blocks(int64_t slot, int64_t start, PyObject* ids, const char* field) {
    py::object seq = fast_seq(ids, field);
    const Py_ssize_t len = PySequence_Fast_GET_SIZE(seq.ptr());
    PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
    const int64_t keep = std::min<int64_t>(start + len, width_);
    int32_t* row = blocks_.data() + slot * width_;
    for (int64_t c = start; c < keep; ++c) {
      const int64_t id = as_int(items[c - start], std::string("scheduler_output: ") + field);
      if (id < INT32_MIN || id > INT32_MAX)
        throw py::value_error(std::string("scheduler_output: ") + field + ": block id " +
                              std::to_string(id) + " does not fit int32");
      row[c] = static_cast<int32_t>(id);
    }
    num_blocks_[slot] = start + len;
  }

  int64_t slot_of(PyObject* rid) {
    PyObject* v = PyDict_GetItemWithError(slot_of_.ptr(), rid);
    if (v == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      throw py::value_error("scheduler_output: cached request " +
                            std::string(py::repr(rid)) +
                            " was never scheduled as new: step() must see every "
                            "SchedulerOutput, in order");
    }
    return PyLong_AsLongLong(v);
  }

  void observe(PyObject* so) {
    py::object cached = attr(so, s_cached);
    py::object cached_ids = fast_seq(attr(cached.ptr(), s_req_ids).ptr(), "cached req_ids");
    const Py_ssize_t nc = PySequence_Fast_GET_SIZE(cached_ids.ptr());
    PyObject** cids = PySequence_Fast_ITEMS(cached_ids.ptr());
    // before anything changes: every cached request known and staying (a missed output, or
    // one that finishes or preempts a request it also schedules, is an error)
    std::vector<int64_t> cslots(nc);
    ++observed_;
    for (Py_ssize_t i = 0; i < nc; ++i) {
      cslots[i] = slot_of(cids[i]);
      cached_mark_[cslots[i]] = observed_;
    }
    py::object gone[2] = {attr(so, s_finished), attr(so, s_preempted)};
    for (const py::object& ids : gone) {
      if (ids.is_none()) continue;
      for (py::handle rid : ids) {
        PyObject* v = PyDict_GetItemWithError(slot_of_.ptr(), rid.ptr());
        if (v == nullptr && PyErr_Occurred()) throw py::error_already_set();
        if (v != nullptr && cached_mark_[PyLong_AsLongLong(v)] == observed_)
          throw py::value_error("scheduler_output: request " + std::string(py::repr(rid)) +
                                " is finished or preempted and scheduled as cached in one "
                                "output");
      }
    }
    for (const py::object& ids : gone) {
      if (ids.is_none()) continue;
      for (py::handle rid : ids) {
        PyObject* v = PyDict_GetItemWithError(slot_of_.ptr(), rid.ptr());
        if (v == nullptr) {
          if (PyErr_Occurred()) throw py::error_already_set();
          continue;
        }
        free_.push_back(PyLong_AsLongLong(v));
        if (PyDict_DelItem(slot_of_.ptr(), rid.ptr()) != 0) throw py::error_already_set();
      }
    }
    py::object news = attr(so, s_new);
    for (py::handle req : news) {
      py::object rid = attr(req.ptr(), s_req_id);
      py::object groups = fast_seq(attr(req.ptr(), s_block_ids).ptr(), "block_ids");
      single_group_ &= PySequence_Fast_GET_SIZE(groups.ptr()) == 1;
      py::object tokens = attr(req.ptr(), s_prefill);
      if (tokens.is_none()) tokens = attr(req.ptr(), s_prompt);
      const Py_ssize_t prefill = PyObject_Length(tokens.ptr());
      if (prefill < 0) throw py::error_already_set();
      const int64_t computed = as_int(attr(req.ptr(), s_computed).ptr(),
                                      "scheduler_output: num_computed_tokens");
      if (PySequence_Fast_GET_SIZE(groups.ptr()) < 1)
        throw py::value_error("scheduler_output: a new request's block_ids has no group");
      PyObject* v = PyDict_GetItemWithError(slot_of_.ptr(), rid.ptr());
      if (v == nullptr && PyErr_Occurred()) throw py::error_already_set();
      const bool fresh = v == nullptr;  // else live and sent again as new: its slot is reused
      if (fresh && free_.empty()) grow(2 * slots_);
      const int64_t slot = fresh ? free_.back() : PyLong_AsLongLong(v);
      last_stamp_[slot] = -1;  // a new lifetime: in no zos step yet
      set_blocks(slot, 0, PySequence_Fast_GET_ITEM(groups.ptr(), 0), "block_ids");
      if (fresh) {  // taken once its blocks were read
        py::object key = py::int_(slot);
        if (PyDict_SetItem(slot_of_.ptr(), rid.ptr(), key.ptr()) != 0)
          throw py::error_already_set();
        free_.pop_back();
      }
      computed_[slot] = computed;
      prefill_len_[slot] = prefill;
    }
    py::object computed = fast_seq(attr(cached.ptr(), s_computed).ptr(), "num_computed_tokens");
    py::object new_blocks = fast_seq(attr(cached.ptr(), s_new_block_ids).ptr(), "new_block_ids");
    if (PySequence_Fast_GET_SIZE(computed.ptr()) != nc ||
        PySequence_Fast_GET_SIZE(new_blocks.ptr()) != nc)
      throw py::value_error("scheduler_output: cached num_computed_tokens and new_block_ids "
                            "must have one entry per cached request");
    PyObject** comp = PySequence_Fast_ITEMS(computed.ptr());
    PyObject** nb = PySequence_Fast_ITEMS(new_blocks.ptr());
    py::object resumed = attr(cached.ptr(), s_resumed);
    const int any_resumed = PyObject_IsTrue(resumed.ptr());
    if (any_resumed < 0) throw py::error_already_set();
    for (Py_ssize_t i = 0; i < nc; ++i) {
      const int64_t slot = cslots[i];
      computed_[slot] = as_int(comp[i], "scheduler_output: num_computed_tokens");
      if (nb[i] == Py_None) continue;
      py::object groups = fast_seq(nb[i], "new_block_ids");
      const Py_ssize_t ng = PySequence_Fast_GET_SIZE(groups.ptr());
      single_group_ &= ng == 1;
      if (ng < 1) continue;
      int64_t start = num_blocks_[slot];
      if (any_resumed) {  // runner v1's resume: a resumed request's blocks replaced
        const int hit = PySequence_Contains(resumed.ptr(), cids[i]);
        if (hit < 0) throw py::error_already_set();
        if (hit) start = 0;
      }
      set_blocks(slot, start, PySequence_Fast_GET_ITEM(groups.ptr(), 0), "new_block_ids");
    }
    cached_slots_ = std::move(cslots);
    cached_ids_ = std::move(cached_ids);
  }
  py::object cached_ids_;  // the last output's cached request ids

  py::object not_zos() {
    prev_ = 0;
    return py::none();
  }

  py::object build(PyObject* so) {
    ++stamp_;
    py::object sched = attr(so, s_num_sched);
    if (!PyDict_Check(sched.ptr()))
      throw py::type_error("scheduler_output: num_scheduled_tokens must be a dict");
    const Py_ssize_t n = PyDict_Size(sched.ptr());
    const int64_t total = as_int(attr(so, s_total).ptr(),
                                 "scheduler_output: total_num_scheduled_tokens");
    const int has_new = PyObject_IsTrue(attr(so, s_new).ptr());
    const int has_spec = PyObject_IsTrue(attr(so, s_spec).ptr());
    if (has_new < 0 || has_spec < 0) throw py::error_already_set();
    if (speculative_ || !single_group_ || n < 1 || n > max_num_reqs_ || total != n ||
        has_new || has_spec)
      return not_zos();
    // rows in the scheduler's order (vLLM's for a uniform step); the cached requests' slots
    // when that is the cached order
    py::list req_ids(n);
    const Py_ssize_t nc = PySequence_Fast_GET_SIZE(cached_ids_.ptr());
    PyObject** cids = PySequence_Fast_ITEMS(cached_ids_.ptr());
    bool same = nc == n;
    Py_ssize_t pos = 0, i = 0;
    PyObject *key, *value;
    while (PyDict_Next(sched.ptr(), &pos, &key, &value)) {
      Py_INCREF(key);
      PyList_SET_ITEM(req_ids.ptr(), i, key);
      if (same && key != cids[i]) {
        const int eq = PyObject_RichCompareBool(key, cids[i], Py_EQ);
        if (eq < 0) throw py::error_already_set();
        same = eq == 1;
      }
      ++i;
    }
    const int64_t* slots = cached_slots_.data();
    if (!same) {
      slots_of_rows_.resize(n);
      for (Py_ssize_t r = 0; r < n; ++r)
        slots_of_rows_[r] = slot_of(PyList_GET_ITEM(req_ids.ptr(), r));
      slots = slots_of_rows_.data();
    }
    for (Py_ssize_t r = 0; r < n; ++r) {
      const int64_t s = slots[r], p = computed_[s], nb = num_blocks_[s];
      if (p < prefill_len_[s] || p >= width_ * block_size_ || p / block_size_ >= nb ||
          nb > width_)
        return not_zos();
    }
    // carried: a row of the last zos step one position back (its block list can only have
    // grown since: vLLM replaces a request's blocks only when it prefills again)
    py::array_t<int64_t> zids(n);
    int64_t* z = zids.mutable_data();
    std::vector<int32_t> new_rows, new_positions, indptr{0}, flat, app_rows, app_blocks;
    for (Py_ssize_t r = 0; r < n; ++r) {
      const int64_t s = slots[r], p = computed_[s], nb = num_blocks_[s];
      const int32_t* row = blocks_.data() + s * width_;
      if (last_stamp_[s] == prev_ && last_pos_[s] == p - 1) {
        for (int64_t c = last_num_blocks_[s]; c < nb; ++c) {  // blocks got since
          app_rows.push_back(static_cast<int32_t>(r));
          app_blocks.push_back(row[c]);
        }
      } else {  // new to zos: a fresh zos id, every block
        zid_[s] = next_id_++;
        new_rows.push_back(static_cast<int32_t>(r));
        new_positions.push_back(static_cast<int32_t>(p));
        flat.insert(flat.end(), row, row + nb);
        indptr.push_back(static_cast<int32_t>(flat.size()));
      }
      z[r] = zid_[s];
      last_stamp_[s] = stamp_;  // a step's requests are distinct: no row reads these again
      last_pos_[s] = p;
      last_num_blocks_[s] = nb;
    }
    prev_ = stamp_;
    const std::vector<int32_t> tokens(new_rows.size(), 0);
    return py::make_tuple(
        py::make_tuple(zids, array_of(new_rows), array_of(tokens), array_of(new_positions),
                       array_of(indptr), array_of(flat), array_of(app_rows),
                       array_of(app_blocks)),
        req_ids);
  }
};

// The host arrays of runner v2's InputBatch for a uniform one-token step (vllm_prep.py), in one
// call: each row's request index looked up, vLLM's request state gathered. See the binding.
py::tuple batch_arrays(const py::list& req_ids, const py::dict& req_id_to_index,
                       const py::handle& num_computed_obj, const py::handle& prefill_len_obj,
                       const py::handle& computed_prefill_obj, int64_t padded,
                       const py::handle& idx_out_obj) {
  using zos::checked;
  const py::array num_computed = checked<int32_t>(num_computed_obj, "num_computed_tokens");
  const py::array prefill_len = checked<int32_t>(prefill_len_obj, "prefill_len");
  const py::array computed_prefill = checked<int32_t>(computed_prefill_obj,
                                                      "num_computed_prefill_tokens");
  py::array idx_out = checked<int32_t>(idx_out_obj, "idx_out", true);
  const int64_t n = PyList_GET_SIZE(req_ids.ptr());
  const int64_t reqs = std::min({num_computed.shape(0), prefill_len.shape(0),
                                 computed_prefill.shape(0)});
  if (n > idx_out.shape(0))
    throw py::value_error("idx_out holds " + std::to_string(idx_out.shape(0)) +
                          " rows, the step has " + std::to_string(n));
  if (padded < n)
    throw py::value_error("padded must be >= the step's rows " + std::to_string(n) +
                          ", got " + std::to_string(padded));
  py::array_t<int32_t> idx(n);
  int32_t* ix = idx.mutable_data();
  for (int64_t r = 0; r < n; ++r) {  // every check before anything is written
    PyObject* v = PyDict_GetItemWithError(req_id_to_index.ptr(), PyList_GET_ITEM(req_ids.ptr(), r));
    if (v == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      throw py::value_error("req_id_to_index has no request " +
                            std::string(py::repr(PyList_GET_ITEM(req_ids.ptr(), r))));
    }
    const int64_t i = as_int(v, "req_id_to_index's values");
    if (i < 0 || i >= reqs)
      throw py::value_error("req_id_to_index: request index " + std::to_string(i) +
                            " outside the request state's " + std::to_string(reqs) + " rows");
    ix[r] = static_cast<int32_t>(i);
  }
  std::copy(ix, ix + n, static_cast<int32_t*>(idx_out.mutable_data()));
  const auto* nc = static_cast<const int32_t*>(num_computed.data());
  const auto* pl = static_cast<const int32_t*>(prefill_len.data());
  const auto* cp = static_cast<const int32_t*>(computed_prefill.data());
  py::array_t<int32_t> computed(n), upper(padded), prefill(n), cprefill(n), scheduled(n),
      qsl(padded + 1), cu(n + 1);
  py::array_t<bool> prefilling(n);
  int32_t *c = computed.mutable_data(), *u = upper.mutable_data(), *p = prefill.mutable_data(),
          *q = cprefill.mutable_data();
  bool* f = prefilling.mutable_data();
  for (int64_t r = 0; r < n; ++r) {
    c[r] = nc[ix[r]];
    u[r] = c[r] + 1;
    p[r] = pl[ix[r]];
    q[r] = cp[ix[r]];
    f[r] = q[r] < p[r];
  }
  std::fill(u + n, u + padded, 0);
  std::fill(scheduled.mutable_data(), scheduled.mutable_data() + n, 1);
  int32_t* ql = qsl.mutable_data();
  for (int64_t r = 0; r <= padded; ++r) ql[r] = static_cast<int32_t>(std::min(r, n));
  int32_t* cl = cu.mutable_data();
  for (int64_t r = 0; r <= n; ++r) cl[r] = static_cast<int32_t>(r);
  return py::make_tuple(idx, computed, upper, prefill, cprefill, prefilling, scheduled, qsl, cu);
}

}  // namespace

void register_vllm_mirror(py::module_& m) {
  py::class_<VllmMirror>(m, "VllmMirror", R"doc(The mirror of vLLM 0.26's scheduler outputs
(zos.integrations.vllm_steps.VllmDecodeSteps holds it and documents its contract).

VllmMirror(block_size, max_num_reqs, max_num_blocks_per_req, speculative): ValueError for a size
outside [1, 2^31) or max_num_blocks_per_req * block_size >= 2^31.)doc")
      .def(py::init<int64_t, int64_t, int64_t, bool>(), py::arg("block_size"),
           py::arg("max_num_reqs"), py::arg("max_num_blocks_per_req"), py::arg("speculative"))
      .def("step", &VllmMirror::step, py::arg("scheduler_output"),
           R"doc(Read one SchedulerOutput and return None (not a zos step) or ((req_ids int64[N]
(zos's), new_rows, new_tokens (0), new_positions, new_block_indptr, new_block_ids, append_rows,
append_block_ids: int32 numpy arrays), vLLM's request ids in batch order (list)). ValueError,
before the mirror changes, for a cached request no earlier output brought or one the same output
finishes or preempts; ValueError / TypeError for a field of another type or length than vLLM
0.26's (the mirror may then be part-way through the output: the engine cannot go on).)doc")
      .def("forget", &VllmMirror::forget, "No row carries over to the next step.")
      .def_property_readonly("num_requests", &VllmMirror::num_requests,
                             "Requests the mirror holds.");
  m.def("vllm_batch_arrays", &batch_arrays, py::arg("req_ids"), py::arg("req_id_to_index"),
        py::arg("num_computed_tokens"), py::arg("prefill_len"),
        py::arg("num_computed_prefill_tokens"), py::arg("padded"), py::arg("idx_out"),
        R"doc(The host arrays of vLLM 0.26 runner v2's ``InputBatch`` for a uniform one-token step
of N = len(req_ids) rows padded to ``padded``, in one call (zos.integrations.vllm_prep).

Args: req_ids: list of N request ids (str); req_id_to_index: runner v2's
``req_states.req_id_to_index`` (request id -> index of its request state);
num_computed_tokens, prefill_len, num_computed_prefill_tokens: int32 [R], runner v2's request
state by index (``num_computed_tokens_np``, ``prefill_len.np``,
``num_computed_prefill_tokens``); padded: rows after padding (>= N); idx_out: writeable int32
[>= N], its first N words get the request indices (a pinned upload buffer).

Returns (numpy, new): idx_mapping int32 [N]; num_computed_tokens int32 [N]; the seq_lens upper
bound int32 [padded] (num_computed + 1, 0 for padded rows); prefill_len int32 [N];
num_computed_prefill_tokens int32 [N]; is_prefilling bool [N]; num_scheduled_tokens int32 [N]
(ones); query_start_loc int32 [padded + 1] (min(i, N)); cu_num_logits int32 [N + 1] (0..N).
Raises, before writing idx_out: TypeError for an array of another dtype; ValueError for one
not 1-D or not contiguous, a read-only idx_out, a request not in req_id_to_index, an index
outside the state arrays, idx_out shorter than N or padded < N.)doc");
}
