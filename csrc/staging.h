// The staging record: the one upload of a decode step. This file is the single
// definition of its layout. bindings.cpp exports every constant below (and
// total_words, capacity_words) as zos._C.staging; zos/staging.py takes its
// constants from there, and the Triton kernels and the numba host builder get
// them from zos/staging.py. tests/test_staging.py pins every value.
//
// A record is a flat int32 array, written by StepPacker::pack into pinned host
// memory and copied to the device in one H2D copy of `total_words(N, M, L)` words:
//
//   word                      field
//   [0]                       NUM_REQS      N, request rows this step
//   [1]                       NUM_TOKENS    N * q, token rows this step
//   [2]                       PREV_REQS     P, request rows of the previous step
//   [3]                       NUM_RECORDS   M, row records below
//   [4]                       NUM_BLOCK_IDS L, block ids below
//   [5]                       Q             token rows per request row (1 + draft tokens)
//   [6..7]                    reserved, 0
//   [8, 8+N)                  ROW_SRC  row i holds row ROW_SRC[i] of the previous step, or -1 (new)
//   [8+N, 8+2N)               ROW_REC  index of row i's record, or -1 (nothing to apply)
//   [8+2N, 8+2N+5M)           RECORDS  M records of 5 words: (token, pos0, col0, count, blk_off)
//   [8+2N+5M, 8+2N+5M+L)      BLOCKS   block ids referenced by the records
//
// A record of a new row (ROW_SRC = -1) carries its input token, the position of
// that token (pos0), and its whole block-table row: col0 = 0, `count` block ids
// at BLOCKS[blk_off:]. A record of a carried row carries only the blocks appended
// this step: token = pos0 = -1, they land at columns [col0, col0 + count), where
// col0 is the row's block count before the append; or, when the row's earlier blocks
// changed (rewrite_rows), its whole block list: col0 = 0, token = pos0 = -1. Size: 8 + 2N + 5M + L words,
// independent of context length and block-table width for carried rows.
#pragma once
#include <cstdint>

namespace zos {
namespace staging {
constexpr int64_t kHeaderWords = 8;
constexpr int64_t kRecordWords = 5;
enum Header : int64_t {
  kNumReqs = 0,
  kNumTokens = 1,
  kPrevReqs = 2,
  kNumRecords = 3,
  kNumBlockIds = 4,
  kQ = 5,
};
enum RecordField : int64_t { kToken = 0, kPos0 = 1, kCol0 = 2, kCount = 3, kBlkOff = 4 };

static_assert(kQ < kHeaderWords, "every header word must fit in the header");
static_assert(kBlkOff < kRecordWords, "every record field must fit in a record");

// Words of a record with n rows, m row records and l block ids.
inline int64_t total_words(int64_t n, int64_t m, int64_t l) {
  return kHeaderWords + 2 * n + kRecordWords * m + l;
}

// Largest record for max_num_reqs rows of at most max_num_blocks_per_req blocks:
// every row new, each with a full block-table row.
inline int64_t capacity_words(int64_t max_num_reqs, int64_t max_num_blocks_per_req) {
  return total_words(max_num_reqs, max_num_reqs, max_num_reqs * max_num_blocks_per_req);
}
}  // namespace staging
}  // namespace zos
