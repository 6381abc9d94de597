#include "packer.h"

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>

#include "staging.h"

namespace zos {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

std::string row_str(int64_t row, int64_t id) {
  return "row " + std::to_string(row) + " (request " + std::to_string(id) + ")";
}


// CSR offsets of a block list per row: start at 0, end at len(ids), never drop.
void check_indptr(const char* field, const char* ids_field, const int32_t* indptr, int64_t m,
                  int64_t l) {
  if (indptr[0] != 0) fail(std::string(field) + "[0] must be 0, got " + std::to_string(indptr[0]));
  if (indptr[m] != l)
    fail(std::string(field) + "[-1] must equal len(" + ids_field + ") = " + std::to_string(l) +
         ", got " + std::to_string(indptr[m]));
  for (int64_t k = 0; k < m; ++k)
    if (indptr[k + 1] < indptr[k])
      fail(std::string(field) + " must be non-decreasing, drops at " + std::to_string(k));
}

// Block ids of a CSR list of rows (new rows, rewritten rows) against [first, num_kv_blocks):
// one branch-free min/max pass; the offender and its row are looked up only on failure.
void check_block_ids(const PackerConfig& cfg, const int64_t* req_ids, const char* field,
                     const int32_t* rows, const int32_t* indptr, const int32_t* ids, int64_t m,
                     int64_t l) {
  int32_t lo_id = INT32_MAX, hi_id = INT32_MIN;
  for (int64_t e = 0; e < l; ++e) {
    lo_id = std::min(lo_id, ids[e]);
    hi_id = std::max(hi_id, ids[e]);
  }
  const int64_t first = cfg.first_block_id();
  if (l > 0 && (lo_id < first || hi_id >= cfg.num_kv_blocks)) {
    int64_t e = 0;
    while (ids[e] >= first && ids[e] < cfg.num_kv_blocks) ++e;
    const int64_t k = std::upper_bound(indptr, indptr + m + 1, e) - indptr - 1;
    fail(std::string(field) + ": " + row_str(rows[k], req_ids[rows[k]]) + " has block id " +
         std::to_string(ids[e]) + " outside [" + std::to_string(first) + ", " +
         std::to_string(cfg.num_kv_blocks) + ") (the null block is " +
         std::to_string(cfg.null_block) + ")");
  }
}

}  // namespace

StepPacker::StepPacker(const PackerConfig& cfg) : cfg_(cfg), index_(cfg.max_num_reqs) {
  auto positive = [](int64_t v, const char* name) {
    if (v <= 0) fail(std::string(name) + " must be positive, got " + std::to_string(v));
  };
  positive(cfg.max_num_reqs, "max_num_reqs");
  positive(cfg.q, "uniform_decode_query_len");
  positive(cfg.block_size, "block_size");
  positive(cfg.max_num_blocks_per_req, "max_num_blocks_per_req");
  positive(cfg.vocab_size, "vocab_size");
  if (cfg.null_block != 0 && cfg.null_block < cfg.num_kv_blocks)
    fail("null_block must be 0 or >= num_kv_blocks = " + std::to_string(cfg.num_kv_blocks) +
         " (a block handed to requests cannot be the null block), got " +
         std::to_string(cfg.null_block));
  if (cfg.num_kv_blocks < cfg.first_block_id() + 1)
    fail("num_kv_blocks must be >= " + std::to_string(cfg.first_block_id() + 1) +
         (cfg.null_block == 0 ? " (block 0 is reserved)" : "") + ", got " +
         std::to_string(cfg.num_kv_blocks));
  const size_t r = static_cast<size_t>(cfg.max_num_reqs);
  for (auto* v : {&remap_, &rec_of_row_, &app_count_, &app_start_, &rw_of_row_, &prev_pos0_,
                  &prev_nblocks_,
                  &curr_pos0_, &curr_nblocks_, &taken_by_, &prev_assumed_src_,
                  &curr_assumed_src_})
    v->assign(r, 0);
  prev_adv_.assign(r, static_cast<int32_t>(cfg.q));
  app_order_.reserve(r);
  moved_.reserve(r);
  prev_ids_.reserve(r);
}

void StepPacker::reset() {
  prev_ids_.clear();
  index_.clear();
  prev_prev_num_reqs_ = 0;
}

// With q > 1 a carried row advances by its accepted count, which reaches the host
// one or two packs late. Until then the mirror advances it by q (every draft
// accepted): an upper bound, so validation asks for the worst case's blocks. The
// counts, when they arrive, replace the bound by the exact position.
void StepPacker::apply_accepted(const int32_t* accepted, int64_t n, int64_t steps_ago) {
  const int64_t want = steps_ago == 0 ? prev_num_reqs() : prev_prev_num_reqs_;
  if (steps_ago != 0 && steps_ago != 1)
    fail("steps_ago must be 0 (the last packed step) or 1 (the one before), got " +
         std::to_string(steps_ago));
  if (n != want)
    fail("accepted: the step " + std::to_string(steps_ago) + " pack(s) ago had " +
         std::to_string(want) + " rows, got " + std::to_string(n) + " counts");
  for (int64_t j = 0; j < n; ++j)
    if (accepted[j] < 1 || accepted[j] > cfg_.q)
      fail("accepted[" + std::to_string(j) + "] = " + std::to_string(accepted[j]) +
           " is outside [1, q = " + std::to_string(cfg_.q) + "]");
  if (steps_ago == 0) {
    std::copy_n(accepted, n, prev_adv_.begin());
    return;
  }
  const int64_t p = prev_num_reqs();
  for (int64_t i = 0; i < p; ++i) {
    const int32_t j = prev_assumed_src_[i];
    if (j >= 0) {
      prev_pos0_[i] -= static_cast<int32_t>(cfg_.q) - accepted[j];
      prev_assumed_src_[i] = -1;
    }
  }
}

// remap_[i] = row of the previous step holding curr[i], or -1. A row whose
// request is where it was costs one comparison; only the others touch the
// index. Duplicate ids in curr are caught: a previous row claimed twice, or a
// new id seen twice. Writes only scratch (remap_, taken_by_, moved_, new_ids_).
void StepPacker::remap(const StepInput& in) {
  const int64_t n = in.n, p = prev_num_reqs();
  const int64_t* curr = in.req_ids;
  std::fill_n(taken_by_.begin(), p, 0);
  moved_.clear();
  for (int64_t i = 0; i < n; ++i) {
    if (i < p && curr[i] == prev_ids_[i]) {
      remap_[i] = static_cast<int32_t>(i);
      taken_by_[i] = static_cast<int32_t>(i + 1);
    } else {
      moved_.push_back(static_cast<int32_t>(i));
    }
  }
  new_ids_.reset(static_cast<int64_t>(moved_.size()));
  for (int32_t i : moved_) {
    const int32_t j = index_.find(curr[i]);
    if (j >= 0) {
      if (taken_by_[j])
        fail("req_ids: request id " + std::to_string(curr[i]) + " appears twice, at positions " +
             std::to_string(std::min(taken_by_[j] - 1, i)) + " and " +
             std::to_string(std::max(taken_by_[j] - 1, i)));
      taken_by_[j] = i + 1;
    } else {
      const int32_t first = new_ids_.insert(curr[i], i);
      if (first >= 0)
        fail("req_ids: request id " + std::to_string(curr[i]) +
             " appears twice, at positions " + std::to_string(first) + " and " +
             std::to_string(i));
    }
    remap_[i] = j;
  }
}

// After a successful pack: the index now maps this step's ids to their rows.
void StepPacker::commit_index(const StepInput& in) {
  const int64_t p = prev_num_reqs();
  for (int64_t j = 0; j < p; ++j)
    if (!taken_by_[j]) index_.erase(prev_ids_[j]);
  for (int32_t i : moved_) index_.assign(in.req_ids[i], i);
  prev_ids_.assign(in.req_ids, in.req_ids + in.n);
}

void StepPacker::validate_new_rows(const StepInput& in) {
  const int64_t max_len = cfg_.max_num_blocks_per_req * cfg_.block_size;
  check_indptr("new_block_indptr", "new_block_ids", in.new_block_indptr, in.m, in.l);
  for (int64_t k = 0; k < in.m; ++k) {
    const int64_t row = in.new_rows[k];
    if (row < 0 || row >= in.n)
      fail("new_rows[" + std::to_string(k) + "] = " + std::to_string(row) + " is outside [0, " +
           std::to_string(in.n) + ")");
    if (rec_of_row_[row] >= 0)
      fail("new_rows: row " + std::to_string(row) + " appears twice, at positions " +
           std::to_string(rec_of_row_[row]) + " and " + std::to_string(k));
    rec_of_row_[row] = static_cast<int32_t>(k);
    auto who = [&] { return row_str(row, in.req_ids[row]); };  // built only on failure
    const int64_t tok = in.new_tokens[k], pos = in.new_positions[k];
    if (tok < 0 || tok >= cfg_.vocab_size)
      fail("new_tokens: " + who() + " has token " + std::to_string(tok) + " outside [0, " +
           std::to_string(cfg_.vocab_size) + ")");
    if (pos < 0 || pos + cfg_.q > max_len)
      fail("new_positions: " + who() + " has position " + std::to_string(pos) +
           "; positions must lie in [0, max_num_blocks_per_req * block_size - q] = [0, " +
           std::to_string(max_len - cfg_.q) + "]");
    const int64_t lo = in.new_block_indptr[k], hi = in.new_block_indptr[k + 1];
    if (hi - lo > cfg_.max_num_blocks_per_req)
      fail("new_block_ids: " + who() + " has " + std::to_string(hi - lo) +
           " blocks, more than max_num_blocks_per_req = " + std::to_string(cfg_.max_num_blocks_per_req));
    if (pos + cfg_.q > (hi - lo) * cfg_.block_size)
      fail("new_block_ids: " + who() + " at position " + std::to_string(pos) + " needs " +
           std::to_string((pos + cfg_.q - 1) / cfg_.block_size + 1) + " blocks, got " + std::to_string(hi - lo));
  }
  check_block_ids(cfg_, in.req_ids, "new_block_ids", in.new_rows, in.new_block_indptr,
                  in.new_block_ids, in.m, in.l);
}

void StepPacker::validate_appends(const StepInput& in) {
  for (int64_t e = 0; e < in.a; ++e) {
    const int64_t row = in.append_rows[e];
    if (row < 0 || row >= in.n)
      fail("append_rows[" + std::to_string(e) + "] = " + std::to_string(row) +
           " is outside [0, " + std::to_string(in.n) + ")");
    auto who = [&] { return row_str(row, in.req_ids[row]); };  // built only on failure
    if (rec_of_row_[row] >= 0)
      fail("append_rows: " + who() + " is a new row; put the block in its new_block_ids");
    const int64_t b = in.append_block_ids[e];
    if (b < cfg_.first_block_id() || b >= cfg_.num_kv_blocks)
      fail("append_block_ids: " + who() + " gets block id " + std::to_string(b) + " outside [" +
           std::to_string(cfg_.first_block_id()) + ", " + std::to_string(cfg_.num_kv_blocks) + ")");
    ++app_count_[row];
  }
}

// A rewritten row is a carried row (checked with the others in pack) that is neither new nor
// appended to, listed once, with at most W blocks; its position is checked against its new
// list in pack, where the position is known.
void StepPacker::validate_rewrites(const StepInput& in) {
  check_indptr("rewrite_block_indptr", "rewrite_block_ids", in.rewrite_block_indptr, in.x, in.y);
  for (int64_t k = 0; k < in.x; ++k) {
    const int64_t row = in.rewrite_rows[k];
    if (row < 0 || row >= in.n)
      fail("rewrite_rows[" + std::to_string(k) + "] = " + std::to_string(row) +
           " is outside [0, " + std::to_string(in.n) + ")");
    auto who = [&] { return row_str(row, in.req_ids[row]); };  // built only on failure
    if (rec_of_row_[row] >= 0)
      fail("rewrite_rows: " + who() + " is a new row; its new_block_ids are its whole list");
    if (app_count_[row] > 0)
      fail("rewrite_rows: " + who() + " also has append_rows entries; end its "
           "rewrite_block_ids with the appended blocks instead");
    if (rw_of_row_[row] >= 0)
      fail("rewrite_rows: row " + std::to_string(row) + " appears twice, at positions " +
           std::to_string(rw_of_row_[row]) + " and " + std::to_string(k));
    rw_of_row_[row] = static_cast<int32_t>(k);
    const int64_t count = in.rewrite_block_indptr[k + 1] - in.rewrite_block_indptr[k];
    if (count > cfg_.max_num_blocks_per_req)
      fail("rewrite_block_ids: " + who() + " has " + std::to_string(count) +
           " blocks, more than max_num_blocks_per_req = " +
           std::to_string(cfg_.max_num_blocks_per_req));
  }
  check_block_ids(cfg_, in.req_ids, "rewrite_block_ids", in.rewrite_rows,
                  in.rewrite_block_indptr, in.rewrite_block_ids, in.x, in.y);
}

int64_t StepPacker::pack(const StepInput& in, int32_t* out, int64_t capacity) {
  namespace st = staging;
  const int64_t n = in.n;
  if (n > cfg_.max_num_reqs)
    fail("req_ids: " + std::to_string(n) + " rows exceed max_num_reqs = " +
         std::to_string(cfg_.max_num_reqs));
  const int64_t p = prev_num_reqs();
  remap(in);
  std::fill_n(rec_of_row_.begin(), n, -1);
  std::fill_n(app_count_.begin(), n, 0);
  std::fill_n(rw_of_row_.begin(), n, -1);
  validate_new_rows(in);
  validate_appends(in);
  validate_rewrites(in);

  // Rows and their records: new rows take records [0, m), appended rows follow.
  const int64_t max_len = cfg_.max_num_blocks_per_req * cfg_.block_size;
  const int64_t q = cfg_.q, bs = cfg_.block_size, w = cfg_.max_num_blocks_per_req;
  int32_t* __restrict rec = rec_of_row_.data();
  const int32_t* __restrict rm = remap_.data();
  const int32_t* __restrict apps = app_count_.data();
  const int32_t* __restrict prev_pos = prev_pos0_.data();
  const int32_t* __restrict prev_nb = prev_nblocks_.data();
  int32_t* __restrict pos0 = curr_pos0_.data();
  int32_t* __restrict nblocks = curr_nblocks_.data();
  int64_t m_total = in.m;
  app_order_.clear();
  for (int64_t i = 0; i < n; ++i) {
    if (rec[i] >= 0) {
      const int32_t k = rec[i];
      pos0[i] = in.new_positions[k];
      nblocks[i] = in.new_block_indptr[k + 1] - in.new_block_indptr[k];
      curr_assumed_src_[i] = -1;
      continue;
    }
    const int32_t j = rm[i];
    if (j < 0)
      fail("new_rows: " + row_str(i, in.req_ids[i]) +
           " was not in the previous step and has no new-row payload");
    const int64_t pos = prev_pos[j] + prev_adv_[j];
    const int32_t kw = rw_of_row_[i];  // a rewritten row brings its whole list
    const int64_t nb = kw >= 0 ? in.rewrite_block_indptr[kw + 1] - in.rewrite_block_indptr[kw]
                               : prev_nb[j] + apps[i];
    if (nb > w || pos + q > max_len || pos + q > nb * bs) {  // no division on this path
      const std::string who = row_str(i, in.req_ids[i]);
      if (nb > w)
        fail("append_rows: " + who + " would hold " + std::to_string(nb) +
             " blocks, more than max_num_blocks_per_req = " + std::to_string(w));
      if (pos + q > max_len)
        fail("req_ids: " + who + " reaches position " + std::to_string(pos + q - 1) +
             ", beyond max_num_blocks_per_req * block_size = " + std::to_string(max_len));
      if (kw >= 0)
        fail("rewrite_block_ids: " + who + " at position " + std::to_string(pos + q - 1) +
             " needs " + std::to_string((pos + q - 1) / bs + 1) + " blocks, got " +
             std::to_string(nb));
      fail("append_rows: " + who + " at position " + std::to_string(pos + q - 1) +
           " needs block column " + std::to_string((pos + q - 1) / bs) + " but holds " +
           std::to_string(nb) + " blocks; append a block");
    }
    pos0[i] = static_cast<int32_t>(pos);
    nblocks[i] = static_cast<int32_t>(nb);
    // q > 1: a count still assumed (q) is corrected when it arrives, steps_ago = 1.
    curr_assumed_src_[i] = (q > 1 && prev_adv_[j] == q) ? j : -1;
    if (apps[i] > 0 || kw >= 0) {
      rec[i] = static_cast<int32_t>(m_total++);
      app_order_.push_back(static_cast<int32_t>(i));
    }
  }
  const int64_t l_total = in.l + in.a + in.y;
  const int64_t words = st::total_words(n, m_total, l_total);
  if (words > capacity)
    fail("out: the staging record needs " + std::to_string(words) + " words, capacity is " +
         std::to_string(capacity));

  // Everything is valid: write the record, then commit the mirror.
  int32_t* row_src = out + st::kHeaderWords;
  int32_t* row_rec = row_src + n;
  int32_t* records = row_rec + n;
  int32_t* blocks = records + st::kRecordWords * m_total;
  std::fill_n(out, st::kHeaderWords, 0);
  out[st::kNumReqs] = static_cast<int32_t>(n);
  out[st::kNumTokens] = static_cast<int32_t>(n * cfg_.q);
  out[st::kPrevReqs] = static_cast<int32_t>(p);
  out[st::kNumRecords] = static_cast<int32_t>(m_total);
  out[st::kNumBlockIds] = static_cast<int32_t>(l_total);
  out[st::kQ] = static_cast<int32_t>(cfg_.q);
  {
    const int32_t* __restrict rec = rec_of_row_.data();
    const int32_t* __restrict rm = remap_.data();
    const int32_t m = static_cast<int32_t>(in.m);
    for (int64_t i = 0; i < n; ++i) {  // records [0, m) belong to new rows
      row_src[i] = (rec[i] >= 0 && rec[i] < m) ? -1 : rm[i];
      row_rec[i] = rec[i];
    }
  }
  std::copy_n(in.new_block_ids, in.l, blocks);
  for (int64_t k = 0; k < in.m; ++k) {
    int32_t* r = records + st::kRecordWords * k;
    r[st::kToken] = in.new_tokens[k];
    r[st::kPos0] = in.new_positions[k];
    r[st::kCol0] = 0;
    r[st::kCount] = in.new_block_indptr[k + 1] - in.new_block_indptr[k];
    r[st::kBlkOff] = in.new_block_indptr[k];
  }
  // Carried rows' records in row order: a rewritten row's whole list (col0 = 0), else its
  // appended blocks, grouped by row in input order (a counting sort).
  int64_t off = in.l;
  for (int32_t i : app_order_) {
    int32_t* r = records + st::kRecordWords * rec_of_row_[i];
    r[st::kToken] = -1;
    r[st::kPos0] = -1;
    r[st::kBlkOff] = static_cast<int32_t>(off);
    const int32_t kw = rw_of_row_[i];
    if (kw >= 0) {
      const int32_t lo = in.rewrite_block_indptr[kw], count = in.rewrite_block_indptr[kw + 1] - lo;
      r[st::kCol0] = 0;
      r[st::kCount] = count;
      std::copy_n(in.rewrite_block_ids + lo, count, blocks + off);
      off += count;
    } else {
      app_start_[i] = static_cast<int32_t>(off);
      r[st::kCol0] = prev_nblocks_[remap_[i]];
      r[st::kCount] = app_count_[i];
      off += app_count_[i];
    }
  }
  for (int64_t e = 0; e < in.a; ++e) blocks[app_start_[in.append_rows[e]]++] = in.append_block_ids[e];

  prev_prev_num_reqs_ = p;
  commit_index(in);
  std::fill_n(prev_adv_.begin(), n, static_cast<int32_t>(q));  // worst case until counts arrive
  std::swap(prev_assumed_src_, curr_assumed_src_);
  std::swap(prev_pos0_, curr_pos0_);
  std::swap(prev_nblocks_, curr_nblocks_);
  return words;
}

}  // namespace zos
