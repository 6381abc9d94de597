// The pack's floor: zos's StepPacker against a lean pack of the same steps, in one process,
// step by step (bench/NOTES.md, "the pack's floor").
//
// The lean pack does only what these steps need (q = 1, rows replaced in place by new
// requests, appended blocks; bench/workload.py) and writes a byte-identical staging record:
// the request-id compare as 64-row masks, one hash per changed id (index find, then erase and
// insert), duplicate new ids, block ids in range, positions against block counts, appended
// rows against their block counts, rows whose blocks run out this step against the appended
// rows (a deadline mask), the record (list, records, block ids) and its state (SoA arrays).
// Like StepPacker it writes nothing (record or state) before every check has passed. It leaves
// out what StepPacker also does: moved rows, rewritten block lists, draft tokens, the dense
// record, the prefetches of rows and the error messages (it returns false). So it bounds from
// below what a pack of these steps with StepPacker's checks costs; it is no replacement.
//
// x86-64 with AVX2 only. Build and run from the repository root:
//   python bench/dump_steps.py --n 1024 --steps 400 --out /tmp/steps1024.bin
//   g++ -O3 -std=c++17 -Icsrc bench/pack_floor.cpp csrc/packer.cpp csrc/remap.cpp -o /tmp/pack_floor
//   /tmp/pack_floor /tmp/steps1024.bin [repetitions] [evict_kib]
// With evict_kib > 0, before each pack (of either) the harness writes a buffer of that many KiB,
// as a scheduler's work between two steps would: the packers' state is then cold in the caches
// that buffer covers.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "packer.h"
#include "remap.h"
#include "staging.h"

namespace {

struct Step {
  std::vector<int64_t> req_ids;
  std::vector<int32_t> field[7];  // new_rows ... append_block_ids, as bench/dump_steps.py writes
  zos::StepInput input() const {
    const auto& f = field;
    zos::StepInput in{req_ids.data(), static_cast<int64_t>(req_ids.size()), f[0].data(),
                      f[1].data(), f[2].data(), f[3].data(), f[4].data(),
                      static_cast<int64_t>(f[0].size()), static_cast<int64_t>(f[4].size()),
                      f[5].data(), f[6].data(), static_cast<int64_t>(f[5].size())};
    return in;
  }
};

template <class T>
void read_array(FILE* f, std::vector<T>& v) {
  int64_t len = 0;
  if (fread(&len, 8, 1, f) != 1) std::exit(1);
  v.resize(static_cast<size_t>(len));
  if (len && fread(v.data(), sizeof(T), v.size(), f) != v.size()) std::exit(1);
}

volatile int64_t sink;
std::vector<int64_t> evict;  // written before each pack when evict_kib > 0
// The scheduler has just built the step: its arrays are in the host's caches (after the
// eviction buffer, if any).
void touch(const Step& s) {
  for (size_t k = 0; k < evict.size(); k += 8) evict[k] += 1;  // one store per 64-byte line
  int64_t acc = 0;
  for (int64_t v : s.req_ids) acc += v;
  for (const auto& f : s.field)
    for (int32_t v : f) acc += v;
  sink = acc;
}

__attribute__((target("avx2"))) uint64_t differ_mask(const int64_t* c, const int64_t* p) {
  uint64_t same = 0;
  for (int b = 0; b < 64; b += 4) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + b));
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + b));
    same |= uint64_t(_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(x, y)))) << b;
  }
  return ~same;
}

__attribute__((target("avx2"))) uint64_t due_mask(const uint32_t* dl, uint32_t now) {
  const __m256i v = _mm256_set1_epi32(static_cast<int>(now));
  uint64_t due = 0;
  for (int b = 0; b < 64; b += 8) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(dl + b));
    due |= uint64_t(uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(x, v)))))
           << b;
  }
  return due;
}

class LeanPack {
 public:
  LeanPack(int64_t rows, int64_t bs, int64_t w, int64_t kv)
      : bs_(bs), w_(w), kv_(kv), ids_(rows), key_(rows), nb_(rows), rec_(rows), dl_(rows),
        index_(rows), fresh_bits_((rows + 63) / 64), app_bits_((rows + 63) / 64) {}

  bool pack(const zos::StepInput& in, int32_t* out) {
    const int64_t n = in.n, common = std::min(n, n_), s = s_ + 1;
    // Rows whose request changed, and their ids' hashes (this step's and the previous one's).
    changed_.clear();
    for (int64_t i0 = 0; i0 + 64 <= common; i0 += 64)
      for (uint64_t m = differ_mask(in.req_ids + i0, ids_.data() + i0); m; m &= m - 1)
        changed_.push_back(static_cast<int32_t>(i0 + __builtin_ctzll(m)));
    for (int64_t i = common & ~int64_t{63}; i < common; ++i)
      if (in.req_ids[i] != ids_[i]) changed_.push_back(static_cast<int32_t>(i));
    for (int64_t i = common; i < n; ++i) changed_.push_back(static_cast<int32_t>(i));
    hash_new_.resize(changed_.size());
    hash_old_.resize(changed_.size());
    for (size_t k = 0; k < changed_.size(); ++k) {
      const int32_t i = changed_[k];
      index_.prefetch(hash_new_[k] = zos::hash_id(in.req_ids[i]));
      if (i < n_) index_.prefetch(hash_old_[k] = zos::hash_id(ids_[i]));
    }
    fresh_.reset(static_cast<int64_t>(changed_.size()));
    for (size_t k = 0; k < changed_.size(); ++k) {  // these steps: every changed row is new
      const int64_t id = in.req_ids[changed_[k]];
      if (index_.find(id, hash_new_[k]) >= 0) return false;
      if (fresh_.insert(id, hash_new_[k], changed_[k]) >= 0) return false;
    }
    // New rows and appended rows.
    uint32_t bad = 0;
    for (int64_t e = 0; e < in.l; ++e) bad |= uint32_t(in.new_block_ids[e]) - 1u >= uint32_t(kv_ - 1);
    for (int64_t e = 0; e < in.a; ++e)
      bad |= uint32_t(in.append_block_ids[e]) - 1u >= uint32_t(kv_ - 1);
    if (bad || in.new_block_indptr[0] != 0 || in.new_block_indptr[in.m] != in.l) return false;
    std::fill(fresh_bits_.begin(), fresh_bits_.end(), 0);
    std::fill(app_bits_.begin(), app_bits_.end(), 0);
    for (int64_t k = 0; k < in.m; ++k) {
      const int32_t r = in.new_rows[k];
      const int64_t pos = in.new_positions[k];
      const int64_t count = in.new_block_indptr[k + 1] - in.new_block_indptr[k];
      if (uint32_t(r) >= uint32_t(n) || fresh_bits_[r >> 6] >> (r & 63) & 1) return false;
      if (count > w_ || pos < 0 || pos + 1 > count * bs_ || in.new_tokens[k] < 0) return false;
      fresh_bits_[r >> 6] |= uint64_t{1} << (r & 63);
    }
    for (int64_t e = 0; e < in.a; ++e) {  // these steps: one block per appended row
      const int32_t r = in.append_rows[e];
      if (uint32_t(r) >= uint32_t(n) || (fresh_bits_[r >> 6] | app_bits_[r >> 6]) >> (r & 63) & 1)
        return false;
      if (key_[r] + s + 1 > (nb_[r] + 1) * bs_ || nb_[r] + 1 > w_) return false;
      app_bits_[r >> 6] |= uint64_t{1} << (r & 63);
    }
    for (int64_t i0 = 0; i0 + 64 <= common; i0 += 64)  // blocks run out: must have been given one
      if (due_mask(dl_.data() + i0, uint32_t(s)) & ~(fresh_bits_[i0 >> 6] | app_bits_[i0 >> 6]))
        return false;
    for (int64_t i = common & ~int64_t{63}; i < common; ++i)
      if (dl_[i] == uint32_t(s) && !((fresh_bits_[i >> 6] | app_bits_[i >> 6]) >> (i & 63) & 1))
        return false;
    write_record(in, out);
    // The state.
    for (int64_t k = 0; k < in.m; ++k) {
      const int32_t r = in.new_rows[k];
      key_[r] = in.new_positions[k] - s;
      nb_[r] = in.new_block_indptr[k + 1] - in.new_block_indptr[k];
      dl_[r] = uint32_t(nb_[r] * bs_ - key_[r]);
    }
    for (int64_t e = 0; e < in.a; ++e) {
      const int32_t r = in.append_rows[e];
      nb_[r] += 1;
      dl_[r] = uint32_t(nb_[r] * bs_ - key_[r]);
    }
    for (size_t k = 0; k < changed_.size(); ++k)
      if (changed_[k] < n_) index_.erase(ids_[changed_[k]], hash_old_[k]);
    for (size_t k = 0; k < changed_.size(); ++k) {
      const int32_t r = changed_[k];
      index_.assign(in.req_ids[r], hash_new_[k], r);
      ids_[r] = in.req_ids[r];
    }
    n_ = n;
    s_ = s;
    return true;
  }

 private:
  void write_record(const zos::StepInput& in, int32_t* out) {
    namespace st = zos::staging;
    listed_.clear();
    for (size_t w = 0; w < fresh_bits_.size(); ++w)
      for (uint64_t b = fresh_bits_[w] | app_bits_[w]; b; b &= b - 1)
        listed_.push_back(static_cast<int32_t>(w * 64 + __builtin_ctzll(b)));
    const int64_t c = static_cast<int64_t>(listed_.size()), m = in.m + in.a;
    int32_t* list = out + st::kHeaderWords;
    int32_t* records = list + st::kListWords * c;
    int32_t* blocks = records + st::kRecordWords * m;
    out[st::kNumReqs] = static_cast<int32_t>(in.n);
    out[st::kNumTokens] = static_cast<int32_t>(in.n);
    out[st::kPrevReqs] = static_cast<int32_t>(n_);
    out[st::kNumRecords] = static_cast<int32_t>(m);
    out[st::kNumBlockIds] = static_cast<int32_t>(in.l + in.a);
    out[st::kQ] = 1;
    out[st::kNumListed] = static_cast<int32_t>(c);
    out[st::kSeq] = 0;
    std::memcpy(blocks, in.new_block_ids, 4 * static_cast<size_t>(in.l));
    for (int64_t k = 0; k < in.m; ++k) {
      int32_t* r = records + st::kRecordWords * k;
      r[st::kToken] = in.new_tokens[k];
      r[st::kPos0] = in.new_positions[k];
      r[st::kCol0] = 0;
      r[st::kCount] = in.new_block_indptr[k + 1] - in.new_block_indptr[k];
      r[st::kBlkOff] = in.new_block_indptr[k];
      rec_[in.new_rows[k]] = static_cast<int32_t>(k);
    }
    for (int64_t e = 0; e < in.a; ++e) {  // appends in row order, one block each
      const int32_t row = in.append_rows[e];
      int32_t* r = records + st::kRecordWords * (in.m + e);
      r[st::kToken] = -1;
      r[st::kPos0] = -1;
      r[st::kCol0] = nb_[row];
      r[st::kCount] = 1;
      r[st::kBlkOff] = static_cast<int32_t>(in.l + e);
      blocks[in.l + e] = in.append_block_ids[e];
      rec_[row] = static_cast<int32_t>(in.m + e);
    }
    for (int64_t k = 0; k < c; ++k) {
      const int32_t row = listed_[k];
      int32_t* e = list + st::kListWords * k;
      e[st::kListRow] = row;
      e[st::kListSrc] = (fresh_bits_[row >> 6] >> (row & 63) & 1) ? -1 : row;
      e[st::kListRec] = rec_[row];
    }
  }

  int64_t bs_, w_, kv_, n_ = 0, s_ = 0;
  std::vector<int64_t> ids_, key_;
  std::vector<int32_t> nb_, rec_;
  std::vector<uint32_t> dl_;
  zos::RequestIndex index_;
  zos::RowIndex fresh_;
  std::vector<int32_t> changed_, listed_;
  std::vector<uint64_t> hash_new_, hash_old_, fresh_bits_, app_bits_;
};

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s STEPS_FILE [repetitions] [evict_kib]\n", argv[0]);
    return 2;
  }
  FILE* f = std::fopen(argv[1], "rb");
  int64_t hdr[5];
  if (!f || std::fread(hdr, 8, 5, f) != 5) return 1;
  const int64_t n = hdr[0], bs = hdr[1], w = hdr[2], kv = hdr[3];
  std::vector<Step> steps(static_cast<size_t>(hdr[4]));
  for (Step& s : steps) {
    read_array(f, s.req_ids);
    for (auto& field : s.field) read_array(f, field);
  }
  const int reps = argc > 2 ? std::atoi(argv[2]) : 5;
  evict.assign(static_cast<size_t>(argc > 3 ? std::atoi(argv[3]) : 0) * 128, 0);
  const size_t words = zos::staging::kHeaderWords + 8 * n + n * w + 64;
  std::vector<int32_t> out(words), lean_out(words);
  for (int rep = 0; rep < reps; ++rep) {
    zos::StepPacker packer({n, 1, bs, w, kv, 32000});
    LeanPack lean(n, bs, w, kv);
    std::vector<double> t_pack, t_lean;
    int differ = 0;
    for (size_t i = 0; i < steps.size(); ++i) {
      const zos::StepInput in = steps[i].input();
      touch(steps[i]);
      auto t0 = std::chrono::steady_clock::now();
      const int64_t used = packer.pack(in, out.data(), static_cast<int64_t>(out.size()), 0);
      auto t1 = std::chrono::steady_clock::now();
      touch(steps[i]);
      auto t2 = std::chrono::steady_clock::now();
      const bool ok = lean.pack(in, lean_out.data());
      auto t3 = std::chrono::steady_clock::now();
      differ += !ok || std::memcmp(out.data(), lean_out.data(), 4 * static_cast<size_t>(used));
      if (i > 10) {  // past the first steps (every row new)
        t_pack.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        t_lean.push_back(std::chrono::duration<double, std::micro>(t3 - t2).count());
      }
    }
    std::printf("N = %ld, evict %zu KiB: StepPacker.pack %.2f us, lean pack %.2f us (medians of "
                "%zu steps); records differ in %d of %zu steps\n",
                static_cast<long>(n), evict.size() / 128, median(t_pack), median(t_lean),
                t_pack.size(), differ, steps.size());
  }
  return 0;
}
