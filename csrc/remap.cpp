#include "remap.h"

#include <stdexcept>
#include <string>

namespace zos {
namespace {

[[noreturn]] void duplicate(const char* field, int64_t id, int32_t first, int64_t second) {
  throw std::invalid_argument(std::string(field) + ": request id " + std::to_string(id) +
                              " appears twice, at positions " + std::to_string(first) +
                              " and " + std::to_string(second));
}

}  // namespace

void RowIndex::reset(int64_t n) {
  uint64_t want = 16;
  while (want < static_cast<uint64_t>(2 * n)) want <<= 1;
  if (want > keys_.size()) {
    keys_.assign(want, 0);
    rows_.assign(want, -1);
    stamps_.assign(want, 0);
    mask_ = want - 1;
    stamp_ = 0;
  }
  if (++stamp_ == 0) {  // wrapped: old stamps could look current
    std::fill(stamps_.begin(), stamps_.end(), 0);
    stamp_ = 1;
  }
}

int32_t RowIndex::insert(int64_t key, uint64_t hash, int32_t row) {
  for (uint64_t h = hash & mask_;; h = (h + 1) & mask_) {
    if (stamps_[h] != stamp_) {
      stamps_[h] = stamp_;
      keys_[h] = key;
      rows_[h] = row;
      return -1;
    }
    if (keys_[h] == key) return rows_[h];
  }
}

int32_t RowIndex::find(int64_t key) const {
  for (uint64_t h = hash_id(key) & mask_;; h = (h + 1) & mask_) {
    if (stamps_[h] != stamp_) return -1;
    if (keys_[h] == key) return rows_[h];
  }
}

RequestIndex::RequestIndex(int64_t max_keys) {
  uint64_t cap = 16;
  while (cap < static_cast<uint64_t>(4 * max_keys)) cap <<= 1;
  slots_.assign(cap, Slot{0, -1, 0});
  mask_ = cap - 1;
}

int32_t RequestIndex::find(int64_t key, uint64_t hash) const {
  for (uint64_t h = hash & mask_;; h = (h + 1) & mask_) {
    const Slot& s = slots_[h];
    if (s.row < 0) return -1;
    if (s.key == key) return s.row;
  }
}

void RequestIndex::assign(int64_t key, uint64_t hash, int32_t row) {
  const uint64_t at = hash & mask_;
  uint64_t h = at;
  while (slots_[h].row >= 0 && slots_[h].key != key) h = (h + 1) & mask_;
  slots_[h] = Slot{key, row, static_cast<uint32_t>(at)};
}

void RequestIndex::erase(int64_t key, uint64_t hash) {
  uint64_t i = hash & mask_;
  while (true) {
    if (slots_[i].row < 0) return;
    if (slots_[i].key == key) break;
    i = (i + 1) & mask_;
  }
  // Backward shift: pull later entries of the probe run into the hole unless
  // their home lies cyclically in (hole, entry].
  for (uint64_t j = (i + 1) & mask_; slots_[j].row >= 0; j = (j + 1) & mask_) {
    const uint64_t k = slots_[j].home;
    const bool stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
    if (stays) continue;
    slots_[i] = slots_[j];
    i = j;
  }
  slots_[i].row = -1;
}

void RequestIndex::clear() {
  for (Slot& s : slots_) s.row = -1;
}

int64_t RemapTable::compute(const int64_t* prev, int64_t p, const int64_t* curr, int64_t n,
                            int32_t* out) {
  prev_index_.reset(p);
  for (int64_t j = 0; j < p; ++j) {
    int32_t first = prev_index_.insert(prev[j], static_cast<int32_t>(j));
    if (first >= 0) duplicate("prev_req_ids", prev[j], first, j);
  }
  curr_index_.reset(n);
  for (int64_t i = 0; i < n; ++i) {
    int32_t first = curr_index_.insert(curr[i], static_cast<int32_t>(i));
    if (first >= 0) duplicate("curr_req_ids", curr[i], first, i);
  }
  int64_t missing = 0;
  for (int64_t i = 0; i < n; ++i) {
    out[i] = prev_index_.find(curr[i]);
    missing += out[i] < 0;
  }
  return missing;
}

}  // namespace zos
