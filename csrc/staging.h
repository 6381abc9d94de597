// The staging record: the one upload of a decode step. This file is the single
// definition of its layout. bindings.cpp exports every constant below (and
// total_words, capacity_words) as zos._C.staging; zos/staging.py takes its
// constants from there, and the Triton kernels and the numba host builder get
// them from zos/staging.py. tests/test_staging.py pins every value.
//
// A record is a flat int32 array, written by StepPacker::pack into pinned host
// memory; the prep kernels read it there directly (a ring of such records in mapped
// pinned memory, zos/staging_ring.py) or from the device after one H2D copy of
// `total_words(C, M, L)` words (the copy path, PinnedUpload):
//
//   word                      field
//   [0]                       NUM_REQS      N, request rows this step
//   [1]                       NUM_TOKENS    N * q, token rows this step
//   [2]                       PREV_REQS     P, request rows of the previous step
//   [3]                       NUM_RECORDS   M, row records below
//   [4]                       NUM_BLOCK_IDS L, block ids below
//   [5]                       Q             token rows per request row (1 + draft tokens)
//   [6]                       NUM_LISTED    C, listed rows below
//   [7]                       SEQ           the record's sequence number (ring slot check)
//   [8, 8+3C)                 LISTED   C entries of 3 words: (row, src, rec)
//   [8+3C, 8+3C+5M)           RECORDS  M records of 5 words: (token, pos0, col0, count, blk_off)
//   [8+3C+5M, 8+3C+5M+L)      BLOCKS   block ids referenced by the records
//
// Only rows that change are listed (the sparse record): a row whose request is
// new or not where it was, or that gets blocks. Entry (row, src, rec): row `row`
// holds row `src` of the previous step (-1: a new row) and applies record `rec`
// (-1: none). A row r < N that is not listed holds, in place, the request it held
// in the previous step and gets nothing: it costs no word. With
// StepPacker.list_every_row every row r < N is listed (the dense record, a
// reference and fallback); the kernels and the host builder read both alike.
//
// A record of a new row (src = -1) carries its input token, the position of
// that token (pos0), and its whole block-table row: col0 = 0, `count` block ids
// at BLOCKS[blk_off:]. A record of a carried row carries only the blocks appended
// this step: token = pos0 = -1, they land at columns [col0, col0 + count), where
// col0 is the row's block count before the append; or, when the row's earlier
// blocks changed (rewrite_rows), its whole block list: col0 = 0, token = pos0 = -1.
// Size: 8 + 3C + 5M + L words,
// independent of N, context length and block-table width for unchanged rows.
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
  kNumListed = 6,
  kSeq = 7,
};
constexpr int64_t kListWords = 3;
enum ListField : int64_t { kListRow = 0, kListSrc = 1, kListRec = 2 };
// A SEQ is in [0, kSeqMask]; the next one after s is (s + 1) & kSeqMask.
constexpr int32_t kSeqMask = (1 << 30) - 1;
enum RecordField : int64_t { kToken = 0, kPos0 = 1, kCol0 = 2, kCount = 3, kBlkOff = 4 };

static_assert(kSeq < kHeaderWords, "every header word must fit in the header");
static_assert(kBlkOff < kRecordWords, "every record field must fit in a record");
static_assert(kListRec < kListWords, "every listed-row field must fit in an entry");

// Words of a record with c listed rows, m row records and l block ids.
inline int64_t total_words(int64_t c, int64_t m, int64_t l) {
  return kHeaderWords + kListWords * c + kRecordWords * m + l;
}

// Largest record for max_num_reqs rows of at most max_num_blocks_per_req blocks:
// every row listed and new, each with a full block-table row.
inline int64_t capacity_words(int64_t max_num_reqs, int64_t max_num_blocks_per_req) {
  return total_words(max_num_reqs, max_num_reqs, max_num_reqs * max_num_blocks_per_req);
}
}  // namespace staging
}  // namespace zos
