// StepPacker: all per-step host work of a decode step: remap, validation and
// packing of the staging record (layout in staging.h), in O(changed rows + M + L
// + A + X + Y) when q = 1 (plus vector compares of the request ids and the rows'
// deadlines, 4 and 8 rows per instruction), O(N + M + L + A)
// with draft tokens. Keeps a mirror of the previous step's rows (request id,
// first position, block count), updated in place for the rows that change, so
// that bad input is caught on the host, before anything is written.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "remap.h"

namespace zos {

struct PackerConfig {
  int64_t max_num_reqs;            // request rows the device buffers hold
  int64_t q;                   // token rows per request row (1 + draft tokens)
  int64_t block_size;          // tokens per KV block
  int64_t max_num_blocks_per_req;  // block-table width W
  int64_t num_kv_blocks;          // KV blocks; ids in [first_block_id(), num_kv_blocks)
  int64_t vocab_size;          // token ids in [0, vocab_size)
  int64_t null_block = 0;      // the padding profile's null block: 0 (reserved inside the pool,
                               // vLLM / SGLang) or >= num_kv_blocks (outside it, transformers)
  // Smallest block id a request may hold: 1 when the null block 0 is inside the pool, else 0.
  int64_t first_block_id() const { return null_block == 0 ? 1 : 0; }
};

struct StepInput {
  const int64_t* req_ids;  // [n]
  int64_t n;
  const int32_t* new_rows;       // [m] rows starting (or restarting) here
  const int32_t* new_tokens;     // [m] input token of that row
  const int32_t* new_positions;  // [m] position of that token
  const int32_t* new_block_indptr;  // [m + 1] CSR offsets into new_block_ids
  const int32_t* new_block_ids;     // [l] whole block-table rows of the new rows
  int64_t m;
  int64_t l;
  const int32_t* append_rows;       // [a] carried rows that got a block this step
  const int32_t* append_block_ids;  // [a] the block, appended after the row's last one
  int64_t a;
  // Carried rows whose block list changed other than by an append (prefix-sharing swaps,
  // copy-on-write, swap-in, defragmentation): each row's whole block list after this step.
  const int32_t* rewrite_rows = nullptr;          // [x]
  const int32_t* rewrite_block_indptr = nullptr;  // [x + 1] CSR offsets into rewrite_block_ids
  const int32_t* rewrite_block_ids = nullptr;     // [y]
  int64_t x = 0;
  int64_t y = 0;
};

class StepPacker {
 public:
  explicit StepPacker(const PackerConfig& cfg);
  // Validates `in` against the previous step, then writes its staging record
  // into out[0, words) and returns words; `seq` goes to the record's SEQ word.
  // Throws std::invalid_argument naming the field, row and value; on a throw
  // neither `out` nor the mirror changed. With q = 1 the host work is
  // O(changed rows): a row that keeps its request and gets no block is neither
  // visited nor listed (docs/ZOS.md, "The staging record").
  int64_t pack(const StepInput& in, int32_t* out, int64_t capacity, int32_t seq = 0);
  // Exact accepted counts (tokens each row kept, in [1, q]) of the last packed
  // step (steps_ago = 0) or of the one before it (steps_ago = 1), one per row of
  // that step. Until a step's counts arrive the mirror assumes every draft was
  // accepted (an upper bound of each position); they tighten it. Throws
  // std::invalid_argument (nothing changed) on a wrong length, a count outside
  // [1, q], or steps_ago not 0 or 1.
  void apply_accepted(const int32_t* accepted, int64_t n, int64_t steps_ago);
  // Forgets the previous step: every row of the next step must be new.
  void reset();
  int64_t prev_num_reqs() const { return prev_n_; }
  const PackerConfig& config() const { return cfg_; }
  // Rows the last successful pack visited: the changed rows (all rows when q > 1)
  // plus the rows whose deadline is this pack. Tests use it to check O(changed).
  int64_t rows_visited() const { return rows_visited_; }
  // The dense record: list every row, changed or not (a reference and fallback).
  bool list_every_row = false;

 private:
  void prefetch_rows(const int32_t* rows, int64_t count) const;
  void find_changed(const StepInput& in);
  void validate_new_rows(const StepInput& in);
  void validate_appends(const StepInput& in);
  void validate_rewrites(const StepInput& in);
  void collect_touched(const StepInput& in);
  void compute_carried(const StepInput& in);
  int64_t check_deadlines(const StepInput& in);
  void write_record(const StepInput& in, int32_t* out, int32_t seq,
                    const std::vector<int32_t>& listed);
  void commit(const StepInput& in);
  [[noreturn]] void fail_blocks(const StepInput& in, int64_t row, int64_t pos, int64_t nb,
                                bool rewritten = false) const;
  // Everything else the packer keeps about one row, in one cache line: a touched row costs one
  // line, wherever it lies (one array per field would cost ~15 lines per row, which a
  // scheduler's work between two steps evicts).
  struct alignas(64) RowState {
    // The mirror of the last packed step (with ids_): the position as a key: the
    // row's first position at pack number s is key + q * s (s = step_ for the last step).
    // A carried row that advances by q keeps its key, so an unchanged row costs nothing per
    // step. adv: its advance to the next step (q until the accepted counts arrive);
    // assumed: the row of the step before whose count was assumed q when its position was
    // set (-1: exact). nb: its block count.
    int64_t key = 0;
    int32_t nb = 0, adv = 0, assumed = -1;
    // Per-pack scratch, valid while the row's bit in the matching bitmap is set (the bitmaps
    // are cleared at each pack, one word per 64 rows: no per-row clears): rec (a new row:
    // its index in new_rows; once written, its record), apps (blocks appended), remap (the
    // previous row of a moved request, or -1), src (the previous row of a touched row, -1 if
    // new), rw (its index in rewrite_rows), next_* (a touched row's state after this pack,
    // copied into the mirror by commit).
    int32_t rec = 0, apps = 0, remap = 0, src = 0, rw = 0;
    int32_t next_nb = 0, next_assumed = -1;
    int64_t next_key = 0;
  };
  static_assert(sizeof(RowState) == 64, "RowState grew past one cache line");
  // Row `row`'s bit in one of the per-pack bitmaps (new_bits_ ...).
  static bool bit(const std::vector<uint64_t>& bits, int64_t row) {
    return bits[static_cast<size_t>(row) >> 6] >> (row & 63) & 1;
  }
  static void set_bit(std::vector<uint64_t>& bits, int64_t row) {
    bits[static_cast<size_t>(row) >> 6] |= uint64_t{1} << (row & 63);
  }
  bool same_request(const StepInput& in, int64_t i) const {
    return i < prev_n_ && in.req_ids[i] == ids_[static_cast<size_t>(i)];
  }
  bool is_new(int64_t row) const { return bit(new_bits_, row); }
  int32_t apps(int64_t row) const { return bit(app_bits_, row) ? rows_[row].apps : 0; }
  // Row's index in rewrite_rows this pack, or -1.
  int32_t rewrite_of(int64_t row) const { return bit(rw_bits_, row) ? rows_[row].rw : -1; }
  // A row has a record when it is new, appended to or rewritten.
  bool has_record(int64_t row) const {
    const size_t w = static_cast<size_t>(row) >> 6;
    return (new_bits_[w] | app_bits_[w] | rw_bits_[w]) >> (row & 63) & 1;
  }
  int64_t deadline(const RowState& r) const { return r.nb * cfg_.block_size - r.key; }

  PackerConfig cfg_;
  RequestIndex index_;  // request id -> row of the previous step
  RowIndex new_ids_;    // ids absent from the previous step, for duplicate checks
  std::vector<RowState> rows_;  // [max_num_reqs]
  // [max_num_reqs] the request id of each row of the last packed step, apart from rows_: a
  // step's ids are compared with them 64 rows per mask (find_changed).
  std::vector<int64_t> ids_;
  int64_t prev_n_ = 0, prev_prev_n_ = 0, step_ = 0;

  // q = 1: [max_num_reqs] each row's deadline (deadline(r)) modulo 2^32, apart from rows_:
  // a pack finds the rows whose deadline is now with one vector compare per 8 rows.
  std::vector<uint32_t> deadline_;

  std::vector<int32_t> moved_, app_rows_, app_cursor_, touched_, listed_;
  // hash_id of moved_[k]'s request id in this step and in the previous one (k < moved_.size();
  // the latter only for rows of the previous step).
  std::vector<uint64_t> hash_curr_, hash_prev_;
  // [(max_num_reqs + 63) / 64] one bit per row, cleared at each pack up to max(N, previous N):
  // new rows, appended rows, rewritten rows, rows of the previous step claimed by a moved
  // request, and touched rows (the rows whose mirror this pack rewrites).
  std::vector<uint64_t> new_bits_, app_bits_, rw_bits_, claimed_bits_, touch_bits_;
  size_t words_ = 0;  // bitmap words this pack uses: (max(n, prev_n) + 63) / 64
  int64_t rows_visited_ = 0;
};

}  // namespace zos
