// An all-reduce (sum) among the tensor-parallel ranks of one host, through a POSIX shared-memory
// segment that every rank maps, built with qrt's other CPU kernels by qrt/kernels/native_cpu.py
// into the `qrt_cpu` namespace. gloo's all-reduce goes through sockets and its own threads; a
// decode step's activation is a few KiB, so the time is all in the hand-offs, which a segment
// and a spin-wait on a counter reduce to a few cache-line transfers.
//
//   shm_all_reduce_open(name, rank, world_size, slot_bytes, create, timeout_s) -> handle
//     Maps the segment `name` (creating it, zero-filled, when `create`: rank 0 does, the others
//     open it once rank 0 has); the handle numbers the mapping in this process.
//   shm_all_reduce_unlink(name)
//     Removes the name; the mappings stay, so once every rank has mapped it nothing is left
//     behind when the processes end, however they end.
//   shm_all_reduce(x bf16 | fp32 [any shape], handle) -> the sum of every rank's x, x's shape,
//                                                         contiguous
//
// The segment: one counter per rank, each on a cache line of its own, then two sets (by the
// parity of the call's sequence number) of one slot of slot_bytes per rank. A call copies its x
// into its slot, publishes the sequence number (release), waits until every rank has published
// it (acquire), then sums the slots in rank order 0..n-1 in fp32 and rounds once to x's dtype:
// the same additions in the same order on every rank, so every rank gets the same bits. A tensor
// larger than a slot goes through in slot-sized chunks, one sequence number each.
//
// Reusing a slot is safe with two sets: a rank writes the set of call s + 2 only after every rank
// has published s + 1, and a rank publishes s + 1 only after it has finished reading the slots of
// call s.
//
// The wait spins with pause for a short while (the other ranks are usually microseconds away),
// then yields the core, then sleeps in short steps (a rank still compiling or in a long prefill
// must not have its core taken by the ranks waiting for it), and after timeout_s fails naming
// the rank that did not arrive. While it sleeps it also looks, every kLivenessEvery, whether the
// rank it waits for still exists (each rank writes its pid into the header when it maps the
// segment): a rank that was killed or crashed fails the call at once, so that a server can end its
// requests and stop instead of waiting out the timeout.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <fcntl.h>
#include <immintrin.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kCacheLine = 64;
constexpr int64_t kPage = 4096;
// Spin-wait phases: pause for the first spins (a pause is about 100 cycles), yield the core until
// this long has passed, then sleep in steps of kSleep.
constexpr int kPauseSpins = 2000;
constexpr auto kYieldFor = std::chrono::milliseconds(2);
constexpr auto kSleep = std::chrono::microseconds(50);
constexpr auto kLivenessEvery = std::chrono::milliseconds(100);

struct alignas(kCacheLine) Counter {
  std::atomic<uint64_t> published;  // the last sequence number whose slot this rank has filled
  std::atomic<int64_t> pid;         // this rank's process, once it has mapped the segment (0 before)
};
static_assert(sizeof(Counter) == kCacheLine, "one counter per cache line");

int64_t header_bytes(int64_t world_size) { return (world_size * kCacheLine + kPage - 1) / kPage * kPage; }

int64_t segment_bytes(int64_t world_size, int64_t slot_bytes) {
  return header_bytes(world_size) + 2 * world_size * slot_bytes;
}

std::string errno_text() { return std::strerror(errno); }

struct Segment {
  uint8_t* base;
  int64_t rank;
  int64_t world_size;
  int64_t slot_bytes;
  double timeout_s;
  uint64_t sequence = 0;  // this rank's last call's number; every rank counts its calls alike

  Counter* counters() const { return reinterpret_cast<Counter*>(base); }
  uint8_t* slot(uint64_t seq, int64_t of_rank) const {
    return base + header_bytes(world_size) + ((seq & 1) * world_size + of_rank) * slot_bytes;
  }
};

std::mutex segments_lock;
std::vector<std::unique_ptr<Segment>> segments;  // indexed by handle; mapped until the process ends

Segment& segment(int64_t handle) {
  std::lock_guard<std::mutex> guard(segments_lock);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(segments.size()),
              "qrt_cpu::shm_all_reduce: no shared-memory segment has handle ", handle, " in this process");
  return *segments[handle];
}

int64_t shm_all_reduce_open(const std::string& name, int64_t rank, int64_t world_size, int64_t slot_bytes,
                            bool create, double timeout_s) {
  TORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size && slot_bytes > 0 && slot_bytes % kCacheLine == 0,
              "qrt_cpu::shm_all_reduce_open: rank ", rank, " of ", world_size, ", slot of ", slot_bytes,
              " bytes (a positive multiple of ", kCacheLine, ") expected");
  const int64_t bytes = segment_bytes(world_size, slot_bytes);
  const int fd = shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, "qrt_cpu::shm_all_reduce_open: shm_open(", name, "): ", errno_text());
  if (create) {
    // posix_fallocate, not ftruncate alone: a /dev/shm too small fails here, not as SIGBUS later.
    const int failed = ftruncate(fd, bytes) != 0 ? errno : posix_fallocate(fd, 0, bytes);
    if (failed != 0) {
      close(fd);
      shm_unlink(name.c_str());
      TORCH_CHECK(false, "qrt_cpu::shm_all_reduce_open: cannot size ", name, " to ", bytes, " bytes: ",
                  std::strerror(failed));
    }
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const std::string map_error = base == MAP_FAILED ? errno_text() : "";
  close(fd);
  TORCH_CHECK(base != MAP_FAILED, "qrt_cpu::shm_all_reduce_open: mmap(", name, "): ", map_error);
  reinterpret_cast<Counter*>(base)[rank].pid.store(getpid(), std::memory_order_release);
  std::lock_guard<std::mutex> guard(segments_lock);
  segments.push_back(std::make_unique<Segment>(
      Segment{static_cast<uint8_t*>(base), rank, world_size, slot_bytes, timeout_s}));
  return static_cast<int64_t>(segments.size()) - 1;
}

void shm_all_reduce_unlink(const std::string& name) {
  TORCH_CHECK(shm_unlink(name.c_str()) == 0 || errno == ENOENT, "qrt_cpu::shm_all_reduce_unlink(", name,
              "): ", errno_text());
}

// Whether process `pid` has ended: gone, or a zombie its parent has not reaped yet (a killed
// torchrun worker stays one until torchrun polls it). Ranks of one segment share a host.
bool has_exited(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0) {
    return errno == ESRCH;
  }
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto comm_end = text.rfind(')');  // "pid (comm) state ...": comm may hold spaces
  if (comm_end == std::string::npos || comm_end + 2 >= text.size()) {
    return false;  // unreadable: assume alive, and let the timeout decide
  }
  const char state = text[comm_end + 2];
  return state == 'Z' || state == 'X';
}

void wait_for_every_rank(const Segment& s, uint64_t seq) {
  const auto started = std::chrono::steady_clock::now();
  auto next_liveness_check = started + kLivenessEvery;
  for (int64_t r = 0; r < s.world_size; ++r) {
    const std::atomic<uint64_t>& published = s.counters()[r].published;
    for (int spins = 0; published.load(std::memory_order_acquire) < seq; ++spins) {
      if (spins < kPauseSpins) {
        _mm_pause();
        continue;
      }
      const auto waited = std::chrono::steady_clock::now() - started;
      TORCH_CHECK(std::chrono::duration<double>(waited).count() < s.timeout_s, "qrt_cpu::shm_all_reduce: rank ",
                  s.rank, " waited ", s.timeout_s, " s for rank ", r, " to reach all-reduce call ", seq,
                  " ($QRT_DIST_TIMEOUT_S); rank ", r, " failed, stopped, or took another path through the model");
      if (waited < kYieldFor) {
        sched_yield();
        continue;
      }
      std::this_thread::sleep_for(kSleep);
      if (std::chrono::steady_clock::now() >= next_liveness_check) {
        next_liveness_check += kLivenessEvery;
        const int64_t pid = s.counters()[r].pid.load(std::memory_order_acquire);
        TORCH_CHECK(pid <= 0 || !has_exited(pid), "qrt_cpu::shm_all_reduce: rank ", r, " (pid ", pid,
                    ") has exited; rank ", s.rank, " cannot finish all-reduce call ", seq);
      }
    }
  }
}

// The sum of the world_size slots of call `seq`, n values from each, added in rank order.
// fp32: 16 lanes at a time, a masked load and store for the tail.
void sum_slots(const Segment& s, uint64_t seq, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    __m512 sum = _mm512_maskz_loadu_ps(lanes, reinterpret_cast<const float*>(s.slot(seq, 0)) + i);
    for (int64_t r = 1; r < s.world_size; ++r) {
      sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(lanes, reinterpret_cast<const float*>(s.slot(seq, r)) + i));
    }
    _mm512_mask_storeu_ps(out + i, lanes, sum);
  }
}

__m512 widen_bf16(__mmask16 lanes, const uint16_t* from) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, from)), 16));
}

// fp32 -> bf16 rounded to nearest even, NaN to 0x7FC0: c10::BFloat16's rounding, so the result is
// what torch's .to(torch.bfloat16) of the fp32 sum gives (vcvtneps2bf16 would flush denormals).
__m256i round_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i half_below = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));  // ties go to the even one
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, half_below), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC0)));
}

void sum_slots(const Segment& s, uint64_t seq, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    __m512 sum = widen_bf16(lanes, reinterpret_cast<const uint16_t*>(s.slot(seq, 0)) + i);
    for (int64_t r = 1; r < s.world_size; ++r) {
      sum = _mm512_add_ps(sum, widen_bf16(lanes, reinterpret_cast<const uint16_t*>(s.slot(seq, r)) + i));
    }
    _mm256_mask_storeu_epi16(out + i, lanes, round_to_bf16(sum));
  }
}

template <typename T>
void all_reduce_chunks(Segment& s, const T* in, T* out, int64_t numel) {
  const int64_t per_slot = s.slot_bytes / static_cast<int64_t>(sizeof(T));
  for (int64_t start = 0; start < numel; start += per_slot) {
    const int64_t n = std::min(per_slot, numel - start);
    const uint64_t seq = ++s.sequence;
    std::memcpy(s.slot(seq, s.rank), in + start, n * sizeof(T));
    s.counters()[s.rank].published.store(seq, std::memory_order_release);
    wait_for_every_rank(s, seq);
    sum_slots(s, seq, n, out + start);
  }
}

at::Tensor shm_all_reduce(const at::Tensor& x, int64_t handle) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "qrt_cpu::shm_all_reduce: a bf16 or fp32 CPU tensor expected, got ", x.scalar_type(), " on ",
              x.device());
  Segment& s = segment(handle);
  const at::Tensor in = x.contiguous();
  at::Tensor out = at::empty_like(in);
  if (x.scalar_type() == at::kFloat) {
    all_reduce_chunks(s, in.data_ptr<float>(), out.data_ptr<float>(), in.numel());
  } else {
    all_reduce_chunks(s, reinterpret_cast<const uint16_t*>(in.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()),
                      in.numel());
  }
  return out;
}

}  // namespace

// open and unlink take no tensor: registered for every dispatch key alike.
TORCH_LIBRARY_FRAGMENT(qrt_cpu, m) {
  m.def("shm_all_reduce_open(str name, int rank, int world_size, int slot_bytes, bool create, float timeout_s) -> int",
        &shm_all_reduce_open);
  m.def("shm_all_reduce_unlink(str name) -> ()", &shm_all_reduce_unlink);
  m.def("shm_all_reduce(Tensor x, int handle) -> Tensor");
}

TORCH_LIBRARY_IMPL(qrt_cpu, CPU, m) { m.impl("shm_all_reduce", &shm_all_reduce); }
