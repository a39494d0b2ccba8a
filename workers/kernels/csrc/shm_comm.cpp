// Shared-memory all-reduce and all-gather of a tensor-parallel group on one node
// (workers/communicator.py: ShmCommunicator, which maps the segment and keeps the call counter).
//
// Segment (a /dev/shm file every rank maps; zero-filled at creation):
//   header: one 64-byte line per rank (at most kMaxRanks), its first 8 bytes the rank's arrival
//           counter: the sequence number of the last round it has written its data for;
//   data:   two sets (by the round's parity) of `world` slots of `slot_bytes` each.
// A round (seq = 1, 2, ...): each rank copies its part into slot [seq & 1][rank], stores seq into
// its counter (release), waits until every counter reached seq (acquire), then reads every
// rank's slot. Two sets suffice: a rank can only start round n + 2 after every rank arrived at
// round n + 1, i.e. finished reading round n's slots. Tensors larger than a slot take several
// rounds. The reduction sums the ranks in rank order, in float32, on every rank: every rank gets
// the same bits (the ranks must hold identical hidden states).
//
// Waiting spins with a pause, yields the CPU after a few thousand spins (ranks may outnumber
// cores), and raises after `timeout_s` seconds naming the ranks that did not arrive (a dead rank
// does not hang the others forever).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/ArrayRef.h>
#include <torch/library.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#define KVMESH_PAUSE() _mm_pause()
#else
#define KVMESH_PAUSE() ((void)0)
#endif

namespace {

constexpr int64_t kMaxRanks = 64;
constexpr int64_t kLine = 64;
constexpr int64_t kHeaderBytes = kMaxRanks * kLine;

struct Segment {
  uint8_t* base;
  int64_t rank, world, slot_bytes;
  double timeout_s;

  uint64_t* counter(int64_t r) const { return reinterpret_cast<uint64_t*>(base + r * kLine); }
  uint8_t* slot(int64_t seq, int64_t r) const {
    return base + kHeaderBytes + ((seq & 1) * world + r) * slot_bytes;
  }

  // publish this rank's data of round `seq`, then wait for every rank's
  void arrive_and_wait(int64_t seq) const {
    __atomic_store_n(counter(rank), static_cast<uint64_t>(seq), __ATOMIC_RELEASE);
    const auto start = std::chrono::steady_clock::now();
    for (int64_t spins = 0;; ++spins) {
      bool all = true;
      for (int64_t r = 0; r < world && all; ++r)
        all = __atomic_load_n(counter(r), __ATOMIC_ACQUIRE) >= static_cast<uint64_t>(seq);
      if (all) return;
      if (spins < 4096) {
        KVMESH_PAUSE();
        continue;
      }
      sched_yield();
      if ((spins & 1023) == 0) {
        const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (waited > timeout_s) {
          std::string late;
          for (int64_t r = 0; r < world; ++r)
            if (__atomic_load_n(counter(r), __ATOMIC_ACQUIRE) < static_cast<uint64_t>(seq))
              late += (late.empty() ? "" : ", ") + std::to_string(r);
          TORCH_CHECK(false, "tensor-parallel rank ", rank, ": rank(s) ", late, " did not reach round ", seq,
                      " of the shared-memory group within ", timeout_s, " s (dead or hung)");
        }
      }
    }
  }
};

Segment segment_of(const at::Tensor& seg, int64_t rank, int64_t world, int64_t slot_bytes, double timeout_s) {
  TORCH_CHECK(seg.scalar_type() == at::kByte && seg.is_contiguous() && seg.device().is_cpu(),
              "shm segment must be a contiguous CPU uint8 tensor");
  TORCH_CHECK(world >= 1 && world <= kMaxRanks && rank >= 0 && rank < world, "bad rank ", rank, " of ", world);
  TORCH_CHECK(slot_bytes > 0 && slot_bytes % 64 == 0, "slot_bytes must be a positive multiple of 64");
  TORCH_CHECK(seg.numel() >= kHeaderBytes + 2 * world * slot_bytes, "shm segment too small");
  return {seg.data_ptr<uint8_t>(), rank, world, slot_bytes, timeout_s};
}

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even (NaN kept a NaN)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// out[i] = sum over ranks (in rank order) of slot_r[i], n elements of T
template <typename T>
void reduce_slots(const Segment& s, int64_t seq, T* out, int64_t n);

template <>
void reduce_slots<float>(const Segment& s, int64_t seq, float* out, int64_t n) {
  const float* first = reinterpret_cast<const float*>(s.slot(seq, 0));
  std::memcpy(out, first, n * sizeof(float));
  for (int64_t r = 1; r < s.world; ++r) {
    const float* src = reinterpret_cast<const float*>(s.slot(seq, r));
    for (int64_t i = 0; i < n; ++i) out[i] += src[i];
  }
}

template <>
void reduce_slots<at::BFloat16>(const Segment& s, int64_t seq, at::BFloat16* out, int64_t n) {
  constexpr int64_t kBlock = 256;
  float acc[kBlock];
  uint16_t* dst = reinterpret_cast<uint16_t*>(out);
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t m = std::min(kBlock, n - b);
    const uint16_t* first = reinterpret_cast<const uint16_t*>(s.slot(seq, 0)) + b;
    for (int64_t i = 0; i < m; ++i) acc[i] = bf16_to_f32(first[i]);
    for (int64_t r = 1; r < s.world; ++r) {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(s.slot(seq, r)) + b;
      for (int64_t i = 0; i < m; ++i) acc[i] += bf16_to_f32(src[i]);
    }
    for (int64_t i = 0; i < m; ++i) dst[b + i] = f32_to_bf16(acc[i]);
  }
}

template <>
void reduce_slots<at::Half>(const Segment& s, int64_t seq, at::Half* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float acc = 0.f;
    for (int64_t r = 0; r < s.world; ++r) acc += static_cast<float>(reinterpret_cast<const at::Half*>(s.slot(seq, r))[i]);
    out[i] = static_cast<at::Half>(acc);
  }
}

template <typename T>
int64_t all_reduce_impl(const Segment& s, T* data, int64_t n, int64_t seq) {
  const int64_t per = s.slot_bytes / static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < n || (n == 0 && off == 0); off += per) {
    const int64_t m = std::min(per, n - off);
    ++seq;
    if (m > 0) std::memcpy(s.slot(seq, s.rank), data + off, m * sizeof(T));
    s.arrive_and_wait(seq);
    if (m > 0) reduce_slots<T>(s, seq, data + off, m);
    if (n == 0) break;
  }
  return seq;
}

}  // namespace

namespace kvmesh {

// x (contiguous float32, bfloat16 or float16) becomes the sum of every rank's x, in place.
// Returns the last round's sequence number (the caller's next call starts after it).
int64_t shm_all_reduce_cpu(at::Tensor& x, const at::Tensor& segment, int64_t rank, int64_t world,
                           int64_t slot_bytes, int64_t seq, double timeout_s) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "shm_all_reduce: x must be a contiguous CPU tensor");
  const Segment s = segment_of(segment, rank, world, slot_bytes, timeout_s);
  switch (x.scalar_type()) {
    case at::kFloat: return all_reduce_impl<float>(s, x.data_ptr<float>(), x.numel(), seq);
    case at::kBFloat16: return all_reduce_impl<at::BFloat16>(s, x.data_ptr<at::BFloat16>(), x.numel(), seq);
    case at::kHalf: return all_reduce_impl<at::Half>(s, x.data_ptr<at::Half>(), x.numel(), seq);
    default: TORCH_CHECK(false, "shm_all_reduce: dtype ", x.scalar_type(), " (float32, bfloat16, float16 only)");
  }
}

// out (uint8, sum(nbytes)) receives every rank's bytes, rank after rank; x holds this rank's
// nbytes[rank] bytes. Returns the last round's sequence number.
int64_t shm_all_gather_cpu(const at::Tensor& x, at::Tensor& out, at::IntArrayRef nbytes,
                           const at::Tensor& segment, int64_t rank, int64_t world, int64_t slot_bytes, int64_t seq,
                           double timeout_s) {
  const Segment s = segment_of(segment, rank, world, slot_bytes, timeout_s);
  TORCH_CHECK(static_cast<int64_t>(nbytes.size()) == world, "shm_all_gather: one byte count per rank");
  TORCH_CHECK(x.is_contiguous() && x.nbytes() == static_cast<size_t>(nbytes[rank]),
              "shm_all_gather: x must be contiguous with this rank's byte count");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kByte, "shm_all_gather: out must be contiguous uint8");
  int64_t total = 0, most = 0;
  for (int64_t b : nbytes) total += b, most = std::max(most, b);
  TORCH_CHECK(out.numel() == total, "shm_all_gather: out holds ", out.numel(), " bytes, the ranks ", total);
  const uint8_t* src = static_cast<const uint8_t*>(x.data_ptr());
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t off = 0; off < most || off == 0; off += s.slot_bytes) {
    ++seq;
    const int64_t mine = std::min(s.slot_bytes, nbytes[rank] - off);
    if (mine > 0) std::memcpy(s.slot(seq, rank), src + off, mine);
    s.arrive_and_wait(seq);
    int64_t base = 0;
    for (int64_t r = 0; r < world; ++r) {
      const int64_t m = std::min(s.slot_bytes, nbytes[r] - off);
      if (m > 0) std::memcpy(dst + base + off, s.slot(seq, r), m);
      base += nbytes[r];
    }
    if (most == 0) break;
  }
  return seq;
}

}  // namespace kvmesh

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("shm_all_reduce(Tensor(a!) x, Tensor segment, int rank, int world, int slot_bytes, int seq, "
        "float timeout_s) -> int");
  m.def("shm_all_gather(Tensor x, Tensor(a!) out, int[] nbytes, Tensor segment, int rank, int world, "
        "int slot_bytes, int seq, float timeout_s) -> int");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("shm_all_reduce", &kvmesh::shm_all_reduce_cpu);
  m.impl("shm_all_gather", &kvmesh::shm_all_gather_cpu);
}
