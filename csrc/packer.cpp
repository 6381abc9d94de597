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

}  // namespace

// The two loops over whole arrays, compiled twice on x86-64 (AVX2 and baseline,
// picked at load time) since the build targets baseline x86-64.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__AVX2__) && !defined(__clang__)
#define ZOS_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define ZOS_SIMD_CLONES
#endif
namespace detail {

// Smallest and largest of ids[0, n).
ZOS_SIMD_CLONES void id_range(const int32_t* __restrict ids, int64_t n, int32_t* lo,
                              int32_t* hi) {
  int32_t a = INT32_MAX, b = INT32_MIN;
  for (int64_t e = 0; e < n; ++e) {
    a = std::min(a, ids[e]);
    b = std::max(b, ids[e]);
  }
  *lo = a;
  *hi = b;
}

// Writes the positions i < n where x[i] != y[i] to out (ascending); returns their count.
// Blocks of 16 are compared branch-free; only a block with a difference is searched.
ZOS_SIMD_CLONES int64_t mismatches(const int64_t* __restrict x, const int64_t* __restrict y,
                                   int64_t n, int32_t* __restrict out) {
  int64_t k = 0, i = 0;
  for (; i + 16 <= n; i += 16) {
    uint64_t diff = 0;
    for (int j = 0; j < 16; ++j) diff |= static_cast<uint64_t>(x[i + j] ^ y[i + j]);
    if (diff)
      for (int j = 0; j < 16; ++j)
        if (x[i + j] != y[i + j]) out[k++] = static_cast<int32_t>(i + j);
  }
  for (; i < n; ++i)
    if (x[i] != y[i]) out[k++] = static_cast<int32_t>(i);
  return k;
}

}  // namespace detail

StepPacker::StepPacker(const PackerConfig& cfg) : cfg_(cfg), index_(cfg.max_num_reqs) {
  auto positive = [](int64_t v, const char* name) {
    if (v <= 0) fail(std::string(name) + " must be positive, got " + std::to_string(v));
  };
  positive(cfg.max_num_reqs, "max_num_reqs");
  positive(cfg.q, "q");
  positive(cfg.block_size, "block_size");
  positive(cfg.max_num_blocks_per_req, "max_num_blocks_per_req");
  positive(cfg.vocab_size, "vocab_size");
  if (cfg.num_kv_blocks < 2) fail("num_kv_blocks must be >= 2 (block 0 is reserved), got " +
                               std::to_string(cfg.num_kv_blocks));
  const size_t r = static_cast<size_t>(cfg.max_num_reqs);
  rows_.assign(r, RowScratch{});
  remap_.assign(r, -1);
  base_.assign(r, 0);
  nblocks_.assign(r, 0);
  next_.assign(r, -1);
  prev_.assign(r, -1);
  slot_.assign(r, -1);
  app_order_.reserve(r);
  moved_.assign(r, 0);
  entries_.reserve(r);
  prev_ids_.reserve(r);
  // A deadline lies at most max_len / q steps after the step that set it.
  const uint64_t span = static_cast<uint64_t>(cfg.max_num_blocks_per_req * cfg.block_size / cfg.q);
  uint64_t ring = 16;
  while (ring < span + 2) ring <<= 1;
  heads_.assign(ring, -1);
  mask_ = ring - 1;
}

void StepPacker::reset() {
  for (int64_t j = 0; j < prev_num_reqs(); ++j) unlink(static_cast<int32_t>(j));
  prev_ids_.clear();
  index_.clear();
}

StepPacker::RowScratch& StepPacker::touch(int64_t row) {
  RowScratch& s = rows_[row];
  if (s.epoch != epoch_) {
    s = RowScratch{};
    s.epoch = epoch_;
  }
  return s;
}

void StepPacker::link(int32_t row, int64_t deadline) {
  const int64_t b = static_cast<int64_t>(static_cast<uint64_t>(deadline) & mask_);
  next_[row] = heads_[b];
  prev_[row] = -1;
  if (heads_[b] >= 0) prev_[heads_[b]] = row;
  heads_[b] = row;
  slot_[row] = b;
}

void StepPacker::unlink(int32_t row) {
  if (slot_[row] < 0) return;
  if (prev_[row] >= 0) next_[prev_[row]] = next_[row];
  else heads_[slot_[row]] = next_[row];
  if (next_[row] >= 0) prev_[next_[row]] = prev_[row];
  slot_[row] = -1;
}

// The last step at which a row at position pos0 now (step step_) with nblocks blocks
// still has its blocks: pos0 + q advances by q per step and must stay <= nblocks * bs.
int64_t StepPacker::deadline(int64_t pos0, int64_t nblocks) const {
  return step_ + (nblocks * cfg_.block_size - cfg_.q - pos0) / cfg_.q;
}

// moved_ = rows whose request is not where it was (ascending); remap_[i] for
// those rows = row of the previous step holding curr[i], or -1. A row whose
// request is where it was costs one comparison, in a tight loop; only the others
// touch the index. Duplicate ids in curr are caught: a previous row claimed
// twice, or a new id seen twice. Writes only scratch.
void StepPacker::remap(const StepInput& in) {
  const int64_t n = in.n, p = prev_num_reqs(), c = std::min(n, p);
  const int64_t* curr = in.req_ids;
  const int64_t* prev = prev_ids_.data();
  int64_t count = detail::mismatches(curr, prev, c, moved_.data());
  for (int64_t i = c; i < n; ++i) moved_[count++] = static_cast<int32_t>(i);
  num_moved_ = count;

  new_ids_.reset(num_moved_);
  for (int32_t i : moved()) {
    const int32_t j = index_.find(curr[i]);
    if (j >= 0) {
      int32_t holder = -1;
      if (j < n && curr[j] == prev[j]) {
        holder = j;  // still in its row
      } else {
        RowScratch& t = touch(j);
        if (t.taken_by >= 0) holder = t.taken_by;
        else t.taken_by = i;
      }
      if (holder >= 0)
        fail("req_ids: request id " + std::to_string(curr[i]) + " appears twice, at positions " +
             std::to_string(std::min(holder, i)) + " and " + std::to_string(std::max(holder, i)));
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

// After a successful pack: the index maps this step's ids to their rows. Only
// rows that changed are touched: a previous row that nobody took is a mismatch
// row (in moved_) or a row past n.
void StepPacker::commit_index(const StepInput& in) {
  const int64_t n = in.n, p = prev_num_reqs();
  for (int32_t i : moved()) {
    if (i >= p) break;
    if (peek(i).taken_by < 0) index_.erase(prev_ids_[i]);
  }
  for (int64_t j = n; j < p; ++j)
    if (peek(j).taken_by < 0) index_.erase(prev_ids_[j]);
  for (int32_t i : moved()) index_.assign(in.req_ids[i], i);
  prev_ids_.resize(n);
  for (int32_t i : moved()) prev_ids_[i] = in.req_ids[i];
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
    if (row < 0 || row >= in.n)
      fail("new_rows[" + std::to_string(k) + "] = " + std::to_string(row) + " is outside [0, " +
           std::to_string(in.n) + ")");
    RowScratch& t = touch(row);
    if (t.rec >= 0)
      fail("new_rows: row " + std::to_string(row) + " appears twice, at positions " +
           std::to_string(t.rec) + " and " + std::to_string(k));
    t.rec = static_cast<int32_t>(k);
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
           " blocks, more than max_num_blocks_per_req = " +
           std::to_string(cfg_.max_num_blocks_per_req));
    if (pos + cfg_.q > (hi - lo) * cfg_.block_size)
      fail("new_block_ids: " + who() + " at position " + std::to_string(pos) + " needs " +
           std::to_string((pos + cfg_.q - 1) / cfg_.block_size + 1) + " blocks, got " +
           std::to_string(hi - lo));
  }
  // Block ids: one branch-free min/max pass; the offender is looked up only on failure.
  int32_t lo_id, hi_id;
  const int32_t* ids = in.new_block_ids;
  detail::id_range(ids, in.l, &lo_id, &hi_id);
  if (in.l > 0 && (lo_id < 1 || hi_id >= cfg_.num_kv_blocks)) {
    int64_t e = 0;
    while (ids[e] >= 1 && ids[e] < cfg_.num_kv_blocks) ++e;
    const int64_t k = std::upper_bound(in.new_block_indptr, in.new_block_indptr + in.m + 1, e) -
                      in.new_block_indptr - 1;
    fail("new_block_ids: " + row_str(in.new_rows[k], in.req_ids[in.new_rows[k]]) +
         " has block id " + std::to_string(ids[e]) + " outside [1, " +
         std::to_string(cfg_.num_kv_blocks) + ") (block 0 is the reserved null block)");
  }
}

// Appended rows get records m, m + 1, ... in the order of their first append.
void StepPacker::validate_appends(const StepInput& in) {
  app_order_.clear();
  for (int64_t e = 0; e < in.a; ++e) {
    const int64_t row = in.append_rows[e];
    if (row < 0 || row >= in.n)
      fail("append_rows[" + std::to_string(e) + "] = " + std::to_string(row) +
           " is outside [0, " + std::to_string(in.n) + ")");
    auto who = [&] { return row_str(row, in.req_ids[row]); };  // built only on failure
    RowScratch& t = touch(row);
    if (t.rec >= 0)
      fail("append_rows: " + who() + " is a new row; put the block in its new_block_ids");
    const int64_t b = in.append_block_ids[e];
    if (b < 1 || b >= cfg_.num_kv_blocks)
      fail("append_block_ids: " + who() + " gets block id " + std::to_string(b) +
           " outside [1, " + std::to_string(cfg_.num_kv_blocks) + ")");
    if (t.apps++ == 0) {
      t.app_rec = static_cast<int32_t>(in.m + static_cast<int64_t>(app_order_.size()));
      app_order_.push_back(static_cast<int32_t>(row));
    }
  }
}

// Row `row` carries row `src` of the previous step, with `apps` blocks appended:
// checks that its blocks hold its next position, and returns its entry.
StepPacker::Entry StepPacker::carried(const StepInput& in, int32_t row, int32_t src,
                                      int32_t apps, int32_t rec) const {
  const int64_t max_len = cfg_.max_num_blocks_per_req * cfg_.block_size;
  const int64_t q = cfg_.q, bs = cfg_.block_size, w = cfg_.max_num_blocks_per_req;
  const int64_t pos = base_[src] + q * step_;
  const int64_t nb = nblocks_[src] + apps;
  if (nb > w || pos + q > max_len || pos + q > nb * bs) {
    const std::string who = row_str(row, in.req_ids[row]);
    if (nb > w)
      fail("append_rows: " + who + " would hold " + std::to_string(nb) +
           " blocks, more than max_num_blocks_per_req = " + std::to_string(w));
    if (pos + q > max_len)
      fail("req_ids: " + who + " reaches position " + std::to_string(pos + q - 1) +
           ", beyond max_num_blocks_per_req * block_size = " + std::to_string(max_len));
    fail("append_rows: " + who + " at position " + std::to_string(pos + q - 1) +
         " needs block column " + std::to_string((pos + q - 1) / bs) + " but holds " +
         std::to_string(nb) + " blocks; append a block");
  }
  return {row, src, rec, static_cast<int32_t>(nb), base_[src], deadline(pos, nb)};
}

int64_t StepPacker::pack(const StepInput& in, int32_t* out, int64_t capacity) {
  namespace st = staging;
  const int64_t n = in.n;
  if (n > cfg_.max_num_reqs)
    fail("req_ids: " + std::to_string(n) + " rows exceed max_num_reqs = " +
         std::to_string(cfg_.max_num_reqs));
  const int64_t p = prev_num_reqs(), q = cfg_.q;
  ++epoch_;
  remap(in);
  validate_new_rows(in);
  validate_appends(in);

  // The listed rows: new rows (entry k = record k), moved rows, rows appended in place.
  entries_.clear();
  for (int64_t k = 0; k < in.m; ++k) {
    const int64_t pos = in.new_positions[k];
    const int64_t nb = in.new_block_indptr[k + 1] - in.new_block_indptr[k];
    entries_.push_back({in.new_rows[k], -1, static_cast<int32_t>(k), static_cast<int32_t>(nb),
                        pos - q * step_, deadline(pos, nb)});
  }
  for (int32_t i : moved()) {
    const RowScratch t = peek(i);
    if (t.rec >= 0) continue;  // a new row
    if (remap_[i] < 0)
      fail("new_rows: " + row_str(i, in.req_ids[i]) +
           " was not in the previous step and has no new-row payload");
    entries_.push_back(carried(in, i, remap_[i], t.apps, t.app_rec));
  }
  for (int32_t i : app_order_) {
    if (i >= p || in.req_ids[i] != prev_ids_[i]) continue;  // moved: listed above
    const RowScratch t = peek(i);
    entries_.push_back(carried(in, i, i, t.apps, t.app_rec));
  }
  // Rows kept in place with nothing to apply whose blocks ran out at the last step.
  for (int32_t r = heads_[static_cast<uint64_t>(step_ - 1) & mask_]; r >= 0; r = next_[r]) {
    if (r >= n || in.req_ids[r] != prev_ids_[r]) continue;
    const RowScratch t = peek(r);
    if (t.rec < 0 && t.apps == 0) carried(in, r, r, 0, -1);  // throws
  }

  const int64_t k_total = static_cast<int64_t>(entries_.size());
  const int64_t m_total = in.m + static_cast<int64_t>(app_order_.size());
  const int64_t l_total = in.l + in.a;
  const int64_t words = st::total_words(k_total, m_total, l_total);
  if (words > capacity)
    fail("out: the staging record needs " + std::to_string(words) + " words, capacity is " +
         std::to_string(capacity));

  // Everything is valid: write the record, then commit the mirror.
  int32_t* ents = out + st::kHeaderWords;
  int32_t* records = ents + st::kEntryWords * k_total;
  int32_t* blocks = records + st::kRecordWords * m_total;
  std::fill_n(out, st::kHeaderWords, 0);
  out[st::kNumReqs] = static_cast<int32_t>(n);
  out[st::kNumTokens] = static_cast<int32_t>(n * q);
  out[st::kPrevReqs] = static_cast<int32_t>(p);
  out[st::kNumRecords] = static_cast<int32_t>(m_total);
  out[st::kNumBlockIds] = static_cast<int32_t>(l_total);
  out[st::kQ] = static_cast<int32_t>(q);
  out[st::kNumEntries] = static_cast<int32_t>(k_total);
  for (int64_t e = 0; e < k_total; ++e) {
    const Entry& en = entries_[e];
    int32_t* x = ents + st::kEntryWords * e;
    x[st::kRow] = en.row;
    x[st::kSrc] = en.src;
    x[st::kRec] = en.rec;
    if (en.rec >= in.m) {  // appended blocks of a carried row: col0 = its previous count
      int32_t* r = records + st::kRecordWords * en.rec;
      r[st::kToken] = -1;
      r[st::kPos0] = -1;
      r[st::kCol0] = nblocks_[en.src];
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
  // Appended blocks, grouped by row in order of first append (a counting sort).
  int64_t off = in.l;
  for (int32_t i : app_order_) {
    RowScratch& t = touch(i);
    int32_t* r = records + st::kRecordWords * t.app_rec;
    r[st::kCount] = t.apps;
    r[st::kBlkOff] = static_cast<int32_t>(off);
    t.app_start = static_cast<int32_t>(off);
    off += t.apps;
  }
  for (int64_t e = 0; e < in.a; ++e) blocks[touch(in.append_rows[e]).app_start++] = in.append_block_ids[e];

  commit_index(in);
  for (int64_t j = n; j < p; ++j) unlink(static_cast<int32_t>(j));
  for (const Entry& en : entries_) {
    base_[en.row] = en.base;
    nblocks_[en.row] = en.nblocks;
    unlink(en.row);
    link(en.row, en.deadline);
  }
  ++step_;
  return words;
}

}  // namespace zos
