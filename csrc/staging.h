// The staging record: the one upload of a decode step. This file is the single
// definition of its layout. bindings.cpp exports every constant below (and
// total_words, capacity_words) as zos._C.staging; zos/staging.py takes its
// constants from there, and the Triton kernels and the numba host builder get
// them from zos/staging.py. tests/test_staging.py pins every value.
//
// A record is a flat int32 array, written by StepPacker::pack into pinned host
// memory and copied to the device in one H2D copy of `total_words(K, M, L)` words:
//
//   word                      field
//   [0]                       NUM_REQS      N, request rows this step
//   [1]                       NUM_TOKENS    N * q, token rows this step
//   [2]                       PREV_REQS     P, request rows of the previous step
//   [3]                       NUM_RECORDS   M, row records below
//   [4]                       NUM_BLOCK_IDS L, block ids below
//   [5]                       Q             token rows per request row (1 + draft tokens)
//   [6]                       NUM_ENTRIES   K, row entries below
//   [7]                       reserved, 0
//   [8, 8+3K)                 ENTRIES  K row entries of 3 words: (row, src, rec)
//   [8+3K, 8+3K+5M)           RECORDS  M records of 5 words: (token, pos0, col0, count, blk_off)
//   [8+3K+5M, 8+3K+5M+L)      BLOCKS   block ids referenced by the records
//
// Only rows that change are listed. A row entry (row, src, rec) says: row `row`
// holds row `src` of the previous step (-1: a new row), and its record is
// RECORDS[rec] (-1: none). Every row r < N without an entry keeps its place with
// nothing to apply: src = r, rec = -1. Rows are listed at most once, in no
// particular order: new rows (src = -1), moved rows (src != r) and rows with
// appended blocks (rec >= 0). In a steady batch K is the number of arrivals plus
// rows that cross into a new block, independent of N.
//
// A record of a new row carries its input token, the position of that token
// (pos0), and its whole block-table row: col0 = 0, `count` block ids at
// BLOCKS[blk_off:]. A record of a carried row carries only the blocks appended
// this step: token = pos0 = -1, they land at columns [col0, col0 + count), where
// col0 is the row's block count before the append. Size: 8 + 3K + 5M + L words,
// independent of N, context length and block-table width for carried rows.
//
// The device staging buffer holds capacity_words(R, W): room for the largest
// record, then the ROW MAP, ROW_MAP_WORDS * R words at the buffer's end that are
// never uploaded: the prep kernels scatter the entries into it (per row: src - r
// and rec + 1, so all zero is a kept row with nothing to apply) and the rebuild
// kernel zeroes each row's words after reading them.
#pragma once
#include <cstdint>

namespace zos {
namespace staging {
constexpr int64_t kHeaderWords = 8;
constexpr int64_t kEntryWords = 3;
constexpr int64_t kRecordWords = 5;
constexpr int64_t kRowMapWords = 2;
enum Header : int64_t {
  kNumReqs = 0,
  kNumTokens = 1,
  kPrevReqs = 2,
  kNumRecords = 3,
  kNumBlockIds = 4,
  kQ = 5,
  kNumEntries = 6,
};
enum EntryField : int64_t { kRow = 0, kSrc = 1, kRec = 2 };
enum RecordField : int64_t { kToken = 0, kPos0 = 1, kCol0 = 2, kCount = 3, kBlkOff = 4 };

static_assert(kNumEntries < kHeaderWords, "every header word must fit in the header");
static_assert(kRec < kEntryWords, "every entry field must fit in an entry");
static_assert(kBlkOff < kRecordWords, "every record field must fit in a record");

// Words of a record with k row entries, m row records and l block ids.
inline int64_t total_words(int64_t k, int64_t m, int64_t l) {
  return kHeaderWords + kEntryWords * k + kRecordWords * m + l;
}

// Words of the staging buffer for max_num_reqs rows of at most max_num_blocks_per_req
// blocks: the largest record (every row listed and new, each with a full
// block-table row), then the row map.
inline int64_t capacity_words(int64_t max_num_reqs, int64_t max_num_blocks_per_req) {
  return total_words(max_num_reqs, max_num_reqs, max_num_reqs * max_num_blocks_per_req) +
         kRowMapWords * max_num_reqs;
}
}  // namespace staging
}  // namespace zos
