// StepPacker: all per-step host work on the rows, in O(N) comparisons of request
// ids plus O(K + M + L + A) for the rows that change: remap, validation and
// packing of the staging record (layout in staging.h). Keeps a mirror of the
// previous step's rows (request id, first position, block count) so that bad
// input is caught on the host, before anything is written or uploaded; the
// mirror is updated only for rows that change.
#pragma once
#include <cstdint>
#include <vector>

#include "remap.h"

namespace zos {

struct PackerConfig {
  int64_t max_num_reqs;            // request rows the device buffers hold
  int64_t q;                       // token rows per request row (1 + draft tokens)
  int64_t block_size;              // tokens per KV block
  int64_t max_num_blocks_per_req;  // block-table width W
  int64_t num_kv_blocks;           // KV blocks; ids in [1, num_kv_blocks), 0 is the null block
  int64_t vocab_size;              // token ids in [0, vocab_size)
};

struct StepInput {
  const int64_t* req_ids;  // [n]
  int64_t n;
  const int32_t* new_rows;          // [m] rows starting (or restarting) here
  const int32_t* new_tokens;        // [m] input token of that row
  const int32_t* new_positions;     // [m] position of that token
  const int32_t* new_block_indptr;  // [m + 1] CSR offsets into new_block_ids
  const int32_t* new_block_ids;     // [l] whole block-table rows of the new rows
  int64_t m;
  int64_t l;
  const int32_t* append_rows;       // [a] carried rows that got a block this step
  const int32_t* append_block_ids;  // [a] the block, appended after the row's last one
  int64_t a;
};

class StepPacker {
 public:
  explicit StepPacker(const PackerConfig& cfg);
  // Validates `in` against the previous step, then writes its staging record
  // into out[0, words) and returns words. Throws std::invalid_argument naming
  // the field, row and value; on a throw neither `out` nor the mirror changed.
  int64_t pack(const StepInput& in, int32_t* out, int64_t capacity);
  // Forgets the previous step: every row of the next step must be new.
  void reset();
  int64_t prev_num_reqs() const { return static_cast<int64_t>(prev_ids_.size()); }
  const PackerConfig& config() const { return cfg_; }

 private:
  // Per-row scratch of one pack call, valid while epoch == epoch_ (so nothing is
  // cleared per call): a stale slot reads as the defaults below.
  struct RowScratch {
    uint64_t epoch = 0;
    int32_t rec = -1;       // new rows: index in new_rows
    int32_t apps = 0;       // blocks appended to the row
    int32_t app_rec = -1;   // record of the appended blocks
    int32_t taken_by = -1;  // previous rows: the moved row that holds it now
    int32_t app_start = 0;  // next slot of the row's appended blocks in BLOCKS
  };
  // A listed row: its entry, and its mirror after this step.
  struct Entry {
    int32_t row, src, rec, nblocks;
    int64_t base, deadline;
  };

  struct Rows {
    const int32_t *b, *e;
    const int32_t* begin() const { return b; }
    const int32_t* end() const { return e; }
  };
  Rows moved() const { return {moved_.data(), moved_.data() + num_moved_}; }
  RowScratch& touch(int64_t row);
  RowScratch peek(int64_t row) const { return rows_[row].epoch == epoch_ ? rows_[row] : RowScratch{}; }
  void remap(const StepInput& in);
  void validate_new_rows(const StepInput& in);
  void validate_appends(const StepInput& in);
  Entry carried(const StepInput& in, int32_t row, int32_t src, int32_t apps, int32_t rec) const;
  int64_t deadline(int64_t pos0, int64_t nblocks) const;
  void commit_index(const StepInput& in);
  void link(int32_t row, int64_t deadline);
  void unlink(int32_t row);

  PackerConfig cfg_;
  RequestIndex index_;  // request id -> row of the previous step
  RowIndex new_ids_;    // ids absent from the previous step, for duplicate checks
  uint64_t epoch_ = 0;  // pack calls
  int64_t step_ = 0;    // successful packs: this pack is step `step_`
  std::vector<RowScratch> rows_;
  std::vector<int32_t> remap_;      // previous row of each moved row, or -1
  std::vector<int32_t> moved_;      // [0, num_moved_): rows whose request is not where it
  int64_t num_moved_ = 0;           // was, ascending (moved_ holds max_num_reqs: no resize)
  std::vector<int32_t> app_order_;  // rows with appended blocks, by first append
  std::vector<Entry> entries_;
  // The mirror of the previous step's rows: ids, and per row its first position
  // base_ + q * step (no update while a row keeps its place) and block count.
  std::vector<int64_t> prev_ids_;
  std::vector<int64_t> base_;
  std::vector<int32_t> nblocks_;
  // Deadlines: the last step at which each row's blocks still hold its position,
  // as intrusive lists per step modulo a ring larger than any deadline's distance,
  // so that each step visits only the rows whose blocks run out now.
  std::vector<int32_t> heads_, next_, prev_;
  std::vector<int64_t> slot_;  // bucket of each row, or -1
  uint64_t mask_ = 0;
};

}  // namespace zos
