// StepPacker: all per-step host work that grows with the number of rows, in one
// O(N + M + A + X) pass: remap, validation and packing of the staging record
// (layout in staging.h). Keeps a small mirror of the previous step's rows
// (request id, first position, block count) so that bad input is caught on the
// host, before anything is written or uploaded.
#pragma once
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
  // into out[0, words) and returns words. Throws std::invalid_argument naming
  // the field, row and value; on a throw neither `out` nor the mirror changed.
  int64_t pack(const StepInput& in, int32_t* out, int64_t capacity);
  // Exact accepted counts (tokens each row kept, in [1, q]) of the last packed
  // step (steps_ago = 0) or of the one before it (steps_ago = 1), one per row of
  // that step. Until a step's counts arrive the mirror assumes every draft was
  // accepted (an upper bound of each position); they tighten it. Throws
  // std::invalid_argument (nothing changed) on a wrong length, a count outside
  // [1, q], or steps_ago not 0 or 1.
  void apply_accepted(const int32_t* accepted, int64_t n, int64_t steps_ago);
  // Forgets the previous step: every row of the next step must be new.
  void reset();
  int64_t prev_num_reqs() const { return static_cast<int64_t>(prev_ids_.size()); }
  const PackerConfig& config() const { return cfg_; }

 private:
  void remap(const StepInput& in);
  void commit_index(const StepInput& in);
  void validate_new_rows(const StepInput& in);
  void validate_appends(const StepInput& in);
  void validate_rewrites(const StepInput& in);

  PackerConfig cfg_;
  RequestIndex index_;  // request id -> row of the previous step
  RowIndex new_ids_;    // ids absent from the previous step, for duplicate checks
  std::vector<int32_t> remap_, rec_of_row_, app_count_, app_start_, app_order_;
  std::vector<int32_t> rw_of_row_;  // per row: its index in rewrite_rows, or -1
  std::vector<int32_t> taken_by_;  // per previous row: 1 + the row that holds it now, or 0
  std::vector<int32_t> moved_;     // rows whose request is not where it was
  std::vector<int64_t> prev_ids_;
  std::vector<int32_t> prev_pos0_, prev_nblocks_, curr_pos0_, curr_nblocks_;
  // Speculative decoding: per row of the last packed step, the advance to its next
  // position (q until its accepted count is known) and the row of the step before
  // whose count was assumed q when its position was set (-1: exact).
  std::vector<int32_t> prev_adv_, prev_assumed_src_, curr_assumed_src_;
  int64_t prev_prev_num_reqs_ = 0;
};

}  // namespace zos
