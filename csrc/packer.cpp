#include "packer.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "staging.h"

namespace zos {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

// Entry k of a row list (new_rows, append_rows, rewrite_rows) must be a row of this step.
void check_row(const char* field, int64_t k, int64_t row, int64_t n) {
  if (row < 0 || row >= n)
    fail(std::string(field) + "[" + std::to_string(k) + "] = " + std::to_string(row) +
         " is outside [0, " + std::to_string(n) + ")");
}

uint64_t differ_mask_scalar(const int64_t* c, const int64_t* p, int64_t len) {
  uint64_t m = 0;
  for (int64_t b = 0; b < len; ++b) m |= uint64_t{c[b] != p[b]} << b;
  return m;
}

uint64_t due_mask_scalar(const uint32_t* dl, int64_t len, uint32_t now) {
  uint64_t m = 0;
  for (int64_t b = 0; b < len; ++b) m |= uint64_t{dl[b] == now} << b;
  return m;
}

// Index of the first of ids[0, count) outside [lo, hi), or -1: one branch-free pass (an
// unsigned compare per id, OR-reduced), compiled for AVX2 too where the CPU has it; the
// offender is looked for only on failure.
#if defined(__x86_64__) && defined(__linux__) && defined(__GLIBC__)  // ifunc
__attribute__((target_clones("avx2", "default")))
#endif
int64_t first_outside(const int32_t* __restrict ids, int64_t count, int64_t lo, int64_t hi) {
  hi = std::min<int64_t>(hi, int64_t{1} << 31);  // int32 ids: any larger bound admits them all
  const auto base = static_cast<uint32_t>(lo), span = static_cast<uint32_t>(hi - lo);
  uint32_t bad = 0;
  for (int64_t e = 0; e < count; ++e) bad |= static_cast<uint32_t>(ids[e]) - base >= span;
  if (!bad) return -1;
  int64_t e = 0;
  while (static_cast<uint32_t>(ids[e]) - base < span) ++e;
  return e;
}

// Masks of 64 rows without a branch per row: bit b set where c[b] != p[b] (request ids), or
// where dl[b] == now (deadlines); len <= 64. An AVX2 version for whole chunks of 64 where the
// CPU has it (GCC/Clang function multiversioning picks it at load time; `unused` quiets
// Clang, which does not see the resolver's use), plain loops elsewhere and for a last
// chunk of fewer than 64 rows.
#if defined(__x86_64__) && defined(__linux__) && defined(__GLIBC__)
__attribute__((target("avx2"), unused))
uint64_t differ_mask(const int64_t* c, const int64_t* p, int64_t len) {
  if (len < 64) return differ_mask_scalar(c, p, len);
  uint64_t same = 0;
  for (int b = 0; b < 64; b += 4) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + b));
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + b));
    const int m = _mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(x, y)));
    same |= static_cast<uint64_t>(m) << b;
  }
  return ~same;
}
__attribute__((target("avx2"), unused))
uint64_t due_mask(const uint32_t* dl, int64_t len, uint32_t now) {
  if (len < 64) return due_mask_scalar(dl, len, now);
  const __m256i v = _mm256_set1_epi32(static_cast<int>(now));
  uint64_t due = 0;
  for (int b = 0; b < 64; b += 8) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(dl + b));
    const int m = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(x, v)));
    due |= static_cast<uint64_t>(static_cast<uint32_t>(m)) << b;
  }
  return due;
}
#define ZOS_DEFAULT __attribute__((target("default")))
#else
#define ZOS_DEFAULT
#endif
ZOS_DEFAULT uint64_t differ_mask(const int64_t* c, const int64_t* p, int64_t len) {
  return differ_mask_scalar(c, p, len);
}
ZOS_DEFAULT uint64_t due_mask(const uint32_t* dl, int64_t len, uint32_t now) {
  return due_mask_scalar(dl, len, now);
}
#undef ZOS_DEFAULT

std::string row_str(int64_t row, int64_t id) {
  return "row " + std::to_string(row) + " (request " + std::to_string(id) + ")";
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
  // Positions and seq_lens are int32 (a row's seq_len reaches max_num_blocks_per_req *
  // block_size), and check_deadlines compares deadlines modulo 2^32: both hold because a
  // request spans fewer than 2^31 tokens.
  if (cfg.max_num_blocks_per_req > ((int64_t{1} << 31) - 1) / cfg.block_size)
    fail("max_num_blocks_per_req * block_size must be < 2^31 tokens (int32 seq_lens), got " +
         std::to_string(cfg.max_num_blocks_per_req) + " * " + std::to_string(cfg.block_size));
  if (cfg.null_block != 0 && cfg.null_block < cfg.num_kv_blocks)
    fail("null_block must be 0 or >= num_kv_blocks = " + std::to_string(cfg.num_kv_blocks) +
         " (a block handed to requests cannot be the null block), got " +
         std::to_string(cfg.null_block));
  if (cfg.num_kv_blocks < cfg.first_block_id() + 1)
    fail("num_kv_blocks must be >= " + std::to_string(cfg.first_block_id() + 1) +
         (cfg.null_block == 0 ? " (block 0 is reserved)" : "") + ", got " +
         std::to_string(cfg.num_kv_blocks));
  const size_t r = static_cast<size_t>(cfg.max_num_reqs);
  rows_.assign(r, RowState{});
  ids_.assign(r, 0);
  for (RowState& row : rows_) row.adv = static_cast<int32_t>(cfg.q);
  deadline_.assign(r, 0);
  for (auto* v : {&moved_, &app_rows_, &app_cursor_, &touched_, &listed_}) v->reserve(r);
  hash_curr_.reserve(r);
  hash_prev_.reserve(r);
  for (auto* b : {&new_bits_, &app_bits_, &rw_bits_, &claimed_bits_, &touch_bits_})
    b->assign((r + 63) / 64, 0);
}

void StepPacker::reset() {
  prev_n_ = 0;
  prev_prev_n_ = 0;
  index_.clear();
}

// With q > 1 a carried row advances by its accepted count, which reaches the host
// one or two packs late. Until then the mirror advances it by q (every draft
// accepted): an upper bound, so validation asks for the worst case's blocks. The
// counts, when they arrive, replace the bound by the exact position.
void StepPacker::apply_accepted(const int32_t* accepted, int64_t n, int64_t steps_ago) {
  const int64_t want = steps_ago == 0 ? prev_num_reqs() : prev_prev_n_;
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
  if (cfg_.q == 1) return;  // every count is 1: the mirror is exact already
  if (steps_ago == 0) {
    for (int64_t i = 0; i < n; ++i) rows_[i].adv = accepted[i];
    return;
  }
  for (int64_t i = 0; i < prev_n_; ++i) {
    RowState& r = rows_[i];
    if (r.assumed >= 0) {
      r.key -= cfg_.q - accepted[r.assumed];
      r.assumed = -1;
    }
  }
}

void StepPacker::prefetch_rows(const int32_t* rows, int64_t count) const {
  for (int64_t k = 0; k < count; ++k)
    if (static_cast<uint64_t>(rows[k]) < rows_.size()) __builtin_prefetch(&rows_[rows[k]]);
}

// moved_: rows whose request is not the one the row held in the previous step
// (new, or moved in), rows_[i].remap for them = the previous row of that request, or -1.
// Rows that keep their request are found by a block compare of the request ids,
// without a per-row branch. Duplicate ids in curr are caught: a previous row
// claimed twice (or claimed while its request stays in place), or a new id seen
// twice. Writes only scratch.
void StepPacker::find_changed(const StepInput& in) {
  const int64_t n = in.n, common = std::min(n, prev_n_);
  const int64_t* curr = in.req_ids;
  const int64_t* prev = ids_.data();
  // 64 rows at a time: a mask of the rows whose id changed, then one iteration per changed
  // row (a changed row lies anywhere, so a branch per row would mispredict).
  // moved_ has capacity max_num_reqs (constructor): no allocation, no fill.
  moved_.clear();
  for (int64_t i0 = 0; i0 < common; i0 += 64)
    for (uint64_t m = differ_mask(curr + i0, prev + i0, std::min<int64_t>(64, common - i0)); m;
         m &= m - 1)
      moved_.push_back(static_cast<int32_t>(i0 + __builtin_ctzll(m)));
  for (int64_t i = common; i < n; ++i) moved_.push_back(static_cast<int32_t>(i));
  // Found above: their lookups (and the erases and inserts in commit) follow, each with the
  // id's hash computed here once.
  hash_curr_.resize(moved_.size());
  hash_prev_.resize(moved_.size());
  for (size_t k = 0; k < moved_.size(); ++k) {
    const int32_t i = moved_[k];
    index_.prefetch(hash_curr_[k] = hash_id(curr[i]));
    if (i < prev_n_) index_.prefetch(hash_prev_[k] = hash_id(prev[i]));
    __builtin_prefetch(&rows_[i]);
  }
  new_ids_.reset(static_cast<int64_t>(moved_.size()));
  auto duplicate = [&](int64_t id, int64_t a, int64_t b) {
    fail("req_ids: request id " + std::to_string(id) + " appears twice, at positions " +
         std::to_string(std::min(a, b)) + " and " + std::to_string(std::max(a, b)));
  };
  for (size_t k = 0; k < moved_.size(); ++k) {
    const int32_t i = moved_[k];
    const int32_t j = index_.find(curr[i], hash_curr_[k]);
    if (j >= 0) {
      if (j < n && same_request(in, j)) duplicate(curr[i], j, i);
      if (bit(claimed_bits_, j))  // the row that claimed j first holds remap j
        for (int32_t first : moved_)
          if (first < i && rows_[first].remap == j) duplicate(curr[i], first, i);
      set_bit(claimed_bits_, j);
    } else {
      const int32_t first = new_ids_.insert(curr[i], hash_curr_[k], i);
      if (first >= 0) duplicate(curr[i], first, i);
    }
    rows_[i].remap = j;  // read for moved rows only
    set_bit(touch_bits_, i);
  }
}

void StepPacker::validate_new_rows(const StepInput& in) {
  const int64_t max_len = cfg_.max_num_blocks_per_req * cfg_.block_size;
  if (in.new_block_indptr[0] != 0) fail("new_block_indptr[0] must be 0, got " +
                                        std::to_string(in.new_block_indptr[0]));
  if (in.new_block_indptr[in.m] != in.l)
    fail("new_block_indptr[-1] must equal len(new_block_ids) = " + std::to_string(in.l) +
         ", got " + std::to_string(in.new_block_indptr[in.m]));
  for (int64_t k = 0; k < in.m; ++k) {
    const int64_t row = in.new_rows[k];
    check_row("new_rows", k, row, in.n);
    RowState& r = rows_[row];
    if (is_new(row))
      fail("new_rows: row " + std::to_string(row) + " appears twice, at positions " +
           std::to_string(r.rec) + " and " + std::to_string(k));
    set_bit(new_bits_, row);
    r.rec = static_cast<int32_t>(k);
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
    if (hi < lo) fail("new_block_indptr must be non-decreasing, drops at " + std::to_string(k));
    if (hi - lo > cfg_.max_num_blocks_per_req)
      fail("new_block_ids: " + who() + " has " + std::to_string(hi - lo) +
           " blocks, more than max_num_blocks_per_req = " + std::to_string(cfg_.max_num_blocks_per_req));
    if (pos + cfg_.q > (hi - lo) * cfg_.block_size)
      fail("new_block_ids: " + who() + " at position " + std::to_string(pos) + " needs " +
           std::to_string((pos + cfg_.q - 1) / cfg_.block_size + 1) + " blocks, got " + std::to_string(hi - lo));
    r.next_key = pos - cfg_.q * (step_ + 1);  // its state after this pack (commit)
    r.next_nb = static_cast<int32_t>(hi - lo);
    r.next_assumed = -1;
    r.src = -1;
  }
  const int64_t first = cfg_.first_block_id();
  const int64_t e = first_outside(in.new_block_ids, in.l, first, cfg_.num_kv_blocks);
  if (e >= 0) {
    const int32_t* ids = in.new_block_ids;
    const int64_t k = std::upper_bound(in.new_block_indptr, in.new_block_indptr + in.m + 1, e) -
                      in.new_block_indptr - 1;
    fail("new_block_ids: " + row_str(in.new_rows[k], in.req_ids[in.new_rows[k]]) +
         " has block id " + std::to_string(ids[e]) + " outside [" + std::to_string(first) +
         ", " + std::to_string(cfg_.num_kv_blocks) + ") (the null block is " +
         std::to_string(cfg_.null_block) + ")");
  }
}

void StepPacker::validate_appends(const StepInput& in) {
  app_rows_.clear();
  for (int64_t e = 0; e < in.a; ++e) {
    const int64_t row = in.append_rows[e];
    check_row("append_rows", e, row, in.n);
    auto who = [&] { return row_str(row, in.req_ids[row]); };  // built only on failure
    if (is_new(row))
      fail("append_rows: " + who() + " is a new row; put the block in its new_block_ids");
    const int64_t b = in.append_block_ids[e];
    if (b < cfg_.first_block_id() || b >= cfg_.num_kv_blocks)
      fail("append_block_ids: " + who() + " gets block id " + std::to_string(b) + " outside [" +
           std::to_string(cfg_.first_block_id()) + ", " + std::to_string(cfg_.num_kv_blocks) + ")");
    if (!bit(app_bits_, row)) {
      set_bit(app_bits_, row);
      rows_[row].apps = 0;
    }
    ++rows_[row].apps;
  }
  // Records of appended rows in row order.
  for (size_t w = 0; w < words_; ++w)
    for (uint64_t bits = app_bits_[w]; bits; bits &= bits - 1)
      app_rows_.push_back(static_cast<int32_t>(w * 64 + __builtin_ctzll(bits)));
}

// A rewritten row is a carried row (checked with the others in compute_carried) that is
// neither new nor appended to, listed once, with at most W block ids in [first,
// num_kv_blocks); its position is checked against its new list in compute_carried, where
// the position is known.
void StepPacker::validate_rewrites(const StepInput& in) {
  if (in.rewrite_block_indptr == nullptr && in.x == 0 && in.y == 0) return;  // none given
  const int32_t* indptr = in.rewrite_block_indptr;
  if (indptr[0] != 0) fail("rewrite_block_indptr[0] must be 0, got " + std::to_string(indptr[0]));
  if (indptr[in.x] != in.y)
    fail("rewrite_block_indptr[-1] must equal len(rewrite_block_ids) = " + std::to_string(in.y) +
         ", got " + std::to_string(indptr[in.x]));
  for (int64_t k = 0; k < in.x; ++k)
    if (indptr[k + 1] < indptr[k])
      fail("rewrite_block_indptr must be non-decreasing, drops at " + std::to_string(k));
  for (int64_t k = 0; k < in.x; ++k) {
    const int64_t row = in.rewrite_rows[k];
    check_row("rewrite_rows", k, row, in.n);
    auto who = [&] { return row_str(row, in.req_ids[row]); };  // built only on failure
    if (is_new(row))
      fail("rewrite_rows: " + who() + " is a new row; its new_block_ids are its whole list");
    if (apps(row) > 0)
      fail("rewrite_rows: " + who() + " also has append_rows entries; end its "
           "rewrite_block_ids with the appended blocks instead");
    if (bit(rw_bits_, row))
      fail("rewrite_rows: row " + std::to_string(row) + " appears twice, at positions " +
           std::to_string(rows_[row].rw) + " and " + std::to_string(k));
    set_bit(rw_bits_, row);
    rows_[row].rw = static_cast<int32_t>(k);
    const int64_t count = indptr[k + 1] - indptr[k];
    if (count > cfg_.max_num_blocks_per_req)
      fail("rewrite_block_ids: " + who() + " has " + std::to_string(count) +
           " blocks, more than max_num_blocks_per_req = " +
           std::to_string(cfg_.max_num_blocks_per_req));
  }
  const int64_t first = cfg_.first_block_id();
  const int64_t e = first_outside(in.rewrite_block_ids, in.y, first, cfg_.num_kv_blocks);
  if (e >= 0) {
    const int64_t k = std::upper_bound(indptr, indptr + in.x + 1, e) - indptr - 1;
    fail("rewrite_block_ids: " + row_str(in.rewrite_rows[k], in.req_ids[in.rewrite_rows[k]]) +
         " has block id " + std::to_string(in.rewrite_block_ids[e]) + " outside [" +
         std::to_string(first) + ", " + std::to_string(cfg_.num_kv_blocks) +
         ") (the null block is " + std::to_string(cfg_.null_block) + ")");
  }
}

// The rows whose mirror this pack rewrites, in row order, into touch_bits_ and touched_: with
// q = 1 the changed rows (moved in: their bits are set by find_changed; new; given blocks or a
// new list), with draft tokens every row (positions advance by per-row accepted counts). One
// word per 64 rows (16 words at N = 1,024): no sort.
void StepPacker::collect_touched(const StepInput& in) {
  touched_.clear();
  const size_t full = static_cast<size_t>(in.n) >> 6;
  for (size_t w = 0; w < words_; ++w) {
    uint64_t t;
    if (cfg_.q > 1)  // every row < n
      t = w < full ? ~uint64_t{0} : w == full ? (uint64_t{1} << (in.n & 63)) - 1 : 0;
    else
      t = touch_bits_[w] | new_bits_[w] | app_bits_[w] | rw_bits_[w];
    touch_bits_[w] = t;
    for (; t; t &= t - 1) touched_.push_back(static_cast<int32_t>(w * 64 + __builtin_ctzll(t)));
  }
}

[[noreturn]] void StepPacker::fail_blocks(const StepInput& in, int64_t row, int64_t pos,
                                          int64_t nb, bool rewritten) const {
  const int64_t q = cfg_.q, bs = cfg_.block_size, w = cfg_.max_num_blocks_per_req;
  const std::string who = row_str(row, in.req_ids[row]);
  if (nb > w)
    fail("append_rows: " + who + " would hold " + std::to_string(nb) +
         " blocks, more than max_num_blocks_per_req = " + std::to_string(w));
  if (pos + q > w * bs)
    fail("req_ids: " + who + " reaches position " + std::to_string(pos + q - 1) +
         ", beyond max_num_blocks_per_req * block_size = " + std::to_string(w * bs));
  if (rewritten)
    fail("rewrite_block_ids: " + who + " at position " + std::to_string(pos + q - 1) +
         " needs " + std::to_string((pos + q - 1) / bs + 1) + " blocks, got " +
         std::to_string(nb));
  fail("append_rows: " + who + " at position " + std::to_string(pos + q - 1) +
       " needs block column " + std::to_string((pos + q - 1) / bs) + " but holds " +
       std::to_string(nb) + " blocks; append a block");
}

// The next state of every touched row that is not new (a new row's is set by
// validate_new_rows), in row order: rows_[row].next_*, and src = its previous row.
void StepPacker::compute_carried(const StepInput& in) {
  const int64_t q = cfg_.q, bs = cfg_.block_size, w = cfg_.max_num_blocks_per_req;
  const int64_t s = step_ + 1;
  for (size_t wd = 0; wd < words_; ++wd) {
    for (uint64_t bits = touch_bits_[wd] & ~new_bits_[wd]; bits; bits &= bits - 1) {
      const auto i = static_cast<int32_t>(wd * 64 + __builtin_ctzll(bits));
      RowState& row = rows_[i];
      const int32_t j = same_request(in, i) ? i : row.remap;
      if (j < 0)
        fail("new_rows: " + row_str(i, in.req_ids[i]) +
             " was not in the previous step and has no new-row payload");
      const RowState& prev = rows_[j];
      const int64_t pos = prev.key + q * step_ + prev.adv;
      const int32_t kw = rewrite_of(i);  // a rewritten row brings its whole list
      const int64_t nb = kw >= 0 ? in.rewrite_block_indptr[kw + 1] - in.rewrite_block_indptr[kw]
                                 : prev.nb + apps(i);
      if (nb > w || pos + q > nb * bs) fail_blocks(in, i, pos, nb, kw >= 0);  // no division
      row.next_key = pos - q * s;
      row.next_nb = static_cast<int32_t>(nb);
      // q > 1: a count still assumed (q) is corrected when it arrives, steps_ago = 1.
      row.next_assumed = (q > 1 && prev.adv == q) ? j : -1;
      row.src = j;
    }
  }
}

// q = 1: rows that keep their request and get no block are not visited above; those whose
// blocks run out at this pack are found by a vector compare of deadline_ and must have been
// touched (the lowest that was not is refused). Returns the count of rows whose deadline is now.
int64_t StepPacker::check_deadlines(const StepInput& in) {
  if (cfg_.q > 1) return 0;
  const int64_t s = step_ + 1, common = std::min(in.n, prev_n_);
  // A carried row's deadline lies in [s, s + max_num_blocks_per_req * block_size), and the
  // constructor holds that span to < 2^31: a compare modulo 2^32 is exact.
  const auto now = static_cast<uint32_t>(s);
  const uint32_t* dl = deadline_.data();
  int64_t visited = 0;
  // Per 64 rows (one word of touch_bits_): a mask of the rows whose deadline is now, built
  // without a branch; any of them not touched this pack got no block.
  for (int64_t i0 = 0; i0 < common; i0 += 64) {
    const uint64_t due = due_mask(dl + i0, std::min<int64_t>(64, common - i0), now);
    visited += __builtin_popcountll(due);
    const uint64_t missed = due & ~touch_bits_[static_cast<size_t>(i0) >> 6];
    if (missed) {
      const int64_t row = i0 + __builtin_ctzll(missed);
      fail_blocks(in, row, rows_[row].key + s, rows_[row].nb);  // kept its request, got no block
    }
  }
  return visited;
}

void StepPacker::write_record(const StepInput& in, int32_t* out, int32_t seq,
                              const std::vector<int32_t>& listed) {
  namespace st = staging;
  const int64_t n = in.n, m_app = in.m + static_cast<int64_t>(app_rows_.size());
  const int64_t m_total = m_app + in.x;
  const int64_t c = list_every_row ? n : static_cast<int64_t>(listed.size());
  int32_t* list = out + st::kHeaderWords;
  int32_t* records = list + st::kListWords * c;
  int32_t* blocks = records + st::kRecordWords * m_total;
  out[st::kNumReqs] = static_cast<int32_t>(n);
  out[st::kNumTokens] = static_cast<int32_t>(n * cfg_.q);
  out[st::kPrevReqs] = static_cast<int32_t>(prev_n_);
  out[st::kNumRecords] = static_cast<int32_t>(m_total);
  out[st::kNumBlockIds] = static_cast<int32_t>(in.l + in.a + in.y);
  out[st::kQ] = static_cast<int32_t>(cfg_.q);
  out[st::kNumListed] = static_cast<int32_t>(c);
  out[st::kSeq] = seq;
  std::copy_n(in.new_block_ids, in.l, blocks);
  for (int64_t k = 0; k < in.m; ++k) {
    int32_t* r = records + st::kRecordWords * k;
    r[st::kToken] = in.new_tokens[k];
    r[st::kPos0] = in.new_positions[k];
    r[st::kCol0] = 0;
    r[st::kCount] = in.new_block_indptr[k + 1] - in.new_block_indptr[k];
    r[st::kBlkOff] = in.new_block_indptr[k];
  }
  // Appended blocks, grouped by row (rows in row order, blocks in input order).
  int64_t off = in.l;
  app_cursor_.resize(app_rows_.size());
  for (size_t e = 0; e < app_rows_.size(); ++e) {
    RowState& row = rows_[app_rows_[e]];
    row.rec = static_cast<int32_t>(in.m + e);
    app_cursor_[e] = static_cast<int32_t>(off);
    int32_t* r = records + st::kRecordWords * (in.m + e);
    r[st::kToken] = -1;
    r[st::kPos0] = -1;
    r[st::kCol0] = rows_[row.src].nb;
    r[st::kCount] = row.apps;
    r[st::kBlkOff] = static_cast<int32_t>(off);
    off += row.apps;
  }
  for (int64_t e = 0; e < in.a; ++e)
    blocks[app_cursor_[rows_[in.append_rows[e]].rec - in.m]++] = in.append_block_ids[e];
  // Rewritten rows: each one's whole list (col0 = 0, token = pos0 = -1), in rewrite_rows order.
  std::copy_n(in.rewrite_block_ids, in.y, blocks + in.l + in.a);
  for (int64_t k = 0; k < in.x; ++k) {
    const int32_t i = in.rewrite_rows[k];
    rows_[i].rec = static_cast<int32_t>(m_app + k);
    int32_t* r = records + st::kRecordWords * (m_app + k);
    r[st::kToken] = -1;
    r[st::kPos0] = -1;
    r[st::kCol0] = 0;
    r[st::kCount] = in.rewrite_block_indptr[k + 1] - in.rewrite_block_indptr[k];
    r[st::kBlkOff] = static_cast<int32_t>(in.l + in.a + in.rewrite_block_indptr[k]);
  }
  auto entry = [&](int64_t k, int32_t row, int32_t src, int32_t rec) {
    int32_t* e = list + st::kListWords * k;
    e[st::kListRow] = row;
    e[st::kListSrc] = src;
    e[st::kListRec] = rec;
  };
  // rec: set above or in validate_new_rows.
  auto rec_of = [&](int32_t row) { return has_record(row) ? rows_[row].rec : -1; };
  if (list_every_row) {  // dense: every row, an unchanged one as (row, row, -1)
    for (int64_t i = 0; i < n; ++i) {
      const auto row = static_cast<int32_t>(i);
      entry(i, row, bit(touch_bits_, row) ? rows_[row].src : row, rec_of(row));
    }
  } else {
    for (size_t k = 0; k < listed.size(); ++k)
      entry(k, listed[k], rows_[listed[k]].src, rec_of(listed[k]));
  }
}

// Everything is valid and written: the mirror, the deadlines and the index follow.
void StepPacker::commit(const StepInput& in) {
  const int64_t n = in.n, p = prev_n_, q = cfg_.q;
  const int64_t s = step_ + 1;
  for (const int32_t i : touched_) {
    RowState& r = rows_[i];
    r.key = r.next_key;
    r.nb = r.next_nb;
    r.adv = static_cast<int32_t>(q);  // worst case until counts arrive
    r.assumed = r.next_assumed;
    // The first pack at which key + s + 1 > nb * bs (modulo 2^32: check_deadlines).
    deadline_[i] = static_cast<uint32_t>(deadline(r));
  }
  // The index: requests that left (their row changed and nobody claimed it) go, moved
  // and new requests take their rows.
  for (size_t k = 0; k < moved_.size(); ++k) {
    const int32_t j = moved_[k];
    if (j < p && !bit(claimed_bits_, j)) index_.erase(ids_[j], hash_prev_[k]);
  }
  for (int64_t j = n; j < p; ++j)
    if (!bit(claimed_bits_, j)) index_.erase(ids_[j]);
  for (size_t k = 0; k < moved_.size(); ++k) {
    const int32_t i = moved_[k];
    index_.assign(in.req_ids[i], hash_curr_[k], i);
    ids_[i] = in.req_ids[i];
  }
  prev_prev_n_ = p;
  prev_n_ = n;
  step_ = s;
}

int64_t StepPacker::pack(const StepInput& in, int32_t* out, int64_t capacity, int32_t seq) {
  namespace st = staging;
  const int64_t n = in.n;
  if (n > cfg_.max_num_reqs)
    fail("req_ids: " + std::to_string(n) + " rows exceed max_num_reqs = " +
         std::to_string(cfg_.max_num_reqs));
  // This pack's bitmaps, cleared up to the rows it reads (< max(n, prev_n)); a failed
  // pack's bits above that are cleared by the first pack that reads them.
  words_ = static_cast<size_t>((std::max(n, prev_n_) + 63) >> 6);
  for (auto* b : {&new_bits_, &app_bits_, &rw_bits_, &claimed_bits_, &touch_bits_})
    std::fill_n(b->begin(), words_, 0);
  // The rows and request ids this pack will look up lie anywhere in the packer's state, which
  // the scheduler's work since the last step has likely evicted: start loading them all
  // at once, so that their cache misses overlap (they cost ~0.1 us each one after another).
  prefetch_rows(in.new_rows, in.m);
  prefetch_rows(in.append_rows, in.a);
  prefetch_rows(in.rewrite_rows, in.x);
  find_changed(in);
  validate_new_rows(in);
  validate_appends(in);
  validate_rewrites(in);
  collect_touched(in);
  compute_carried(in);
  const int64_t deadline_visits = check_deadlines(in);

  // Listed rows: those whose request is new or moved, or that get blocks or a new list. With
  // q = 1 those are exactly the touched rows.
  const std::vector<int32_t>* listed = &touched_;
  if (cfg_.q > 1 && !list_every_row) {
    listed_.clear();
    for (int32_t i : touched_)
      if (rows_[i].src != i || has_record(i)) listed_.push_back(i);
    listed = &listed_;
  }
  const int64_t c = list_every_row ? n : static_cast<int64_t>(listed->size());
  const int64_t words = st::total_words(c, in.m + static_cast<int64_t>(app_rows_.size()) + in.x,
                                        in.l + in.a + in.y);
  if (words > capacity)
    fail("out: the staging record needs " + std::to_string(words) + " words, capacity is " +
         std::to_string(capacity));
  write_record(in, out, seq, *listed);
  commit(in);
  rows_visited_ = static_cast<int64_t>(touched_.size()) + deadline_visits;
  return words;
}

}  // namespace zos
