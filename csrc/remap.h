// Request-id remap between two consecutive decode batches (O(N + P), no
// allocation in the steady state). See docs/ZOS.md, "One decode step, as data".
#pragma once
#include <cstdint>
#include <vector>

namespace zos {

// The hash of a request id (splitmix64's finaliser), for RowIndex and RequestIndex: a caller
// that looks one id up several times computes it once and passes it.
inline uint64_t hash_id(int64_t key) {
  uint64_t x = static_cast<uint64_t>(key);
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Open-addressing hash map int64 request id -> int32 row, cleared in O(1) by
// bumping a generation stamp instead of touching the slots.
class RowIndex {
 public:
  // Makes room for n keys (grows, never shrinks) and forgets every key.
  void reset(int64_t n);
  // Inserts key -> row; returns the row already stored for key, or -1 if new. hash =
  // hash_id(key).
  int32_t insert(int64_t key, int32_t row) { return insert(key, hash_id(key), row); }
  int32_t insert(int64_t key, uint64_t hash, int32_t row);
  // Row stored for key, or -1.
  int32_t find(int64_t key) const;

 private:
  std::vector<int64_t> keys_;
  std::vector<int32_t> rows_;
  std::vector<uint32_t> stamps_;
  uint64_t mask_ = 0;
  uint32_t stamp_ = 0;
};

// Persistent map request id -> row of the previous step, for the packer: a
// step updates only the rows that changed (arrivals, departures, moves), so a
// batch whose rows keep their places costs O(changed) hash work, not O(N).
// Linear probing with backward-shift deletion; fixed capacity (no growth).
class RequestIndex {
 public:
  explicit RequestIndex(int64_t max_keys);
  // Each with hash = hash_id(key), computed once by a caller that looks a key up again.
  int32_t find(int64_t key, uint64_t hash) const;  // row, or -1
  void assign(int64_t key, uint64_t hash, int32_t row);  // insert or overwrite
  void erase(int64_t key, uint64_t hash);  // no-op if absent
  void erase(int64_t key) { erase(key, hash_id(key)); }
  void clear();
  // Starts loading the home slot of the key of `hash`: a caller with many independent keys
  // prefetches them all first, so their cache misses overlap instead of following one another.
  void prefetch(uint64_t hash) const { __builtin_prefetch(&slots_[hash & mask_]); }

 private:
  struct Slot {
    int64_t key;
    int32_t row;    // -1: empty
    uint32_t home;  // hash_id(key) & mask_, kept so that erase's backward shift does not rehash
  };
  std::vector<Slot> slots_;  // a key and its row in one 16-byte slot: one cache line a probe
  uint64_t mask_;
};

// Computes remap[i] = j where curr[i] == prev[j], else -1, and returns the count
// of -1 rows. Throws std::invalid_argument (ValueError in Python) naming the id
// and both positions if an id repeats within prev or within curr; `out` is
// written only after both checks pass.
class RemapTable {
 public:
  int64_t compute(const int64_t* prev, int64_t p, const int64_t* curr, int64_t n,
                  int32_t* out);

 private:
  RowIndex prev_index_;
  RowIndex curr_index_;
};

}  // namespace zos
