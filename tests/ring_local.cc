// The in-process Communicator of ring_local.h, and the watch of buffers that requests not waited
// to completion may still touch.
#include "ring_local.h"

#include <malloc.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <thread>

namespace sdpa_test {
namespace {

// The watched ranges. The global operator delete below consults them; a thread that changes
// them (which may allocate or free) sets in_watch, so that its own frees are not checked (and
// the mutex is not taken twice).
struct Watch {
  int64_t id;
  const void* owner;
  int rank;
  const std::byte* data;
  size_t bytes;
  bool freed;
};
std::mutex watch_mu;
std::vector<Watch>* watches = nullptr;  // never freed (the operator delete may run at exit)
std::atomic<int64_t> watch_count{0};
int64_t next_watch = 1;
thread_local bool in_watch = false;

struct InWatch {
  InWatch() { in_watch = true; }
  ~InWatch() { in_watch = false; }
};

void check_free(void* p) {
  if (p == nullptr || watch_count.load(std::memory_order_acquire) == 0 || in_watch) return;
  const auto* b = static_cast<const std::byte*>(p);
  const size_t n = malloc_usable_size(p);
  std::lock_guard<std::mutex> lock(watch_mu);
  for (Watch& w : *watches) {
    if (!w.freed && w.data < b + n && b < w.data + w.bytes) w.freed = true;
  }
}

}  // namespace

int64_t watch_buffer(const void* owner, int rank, void* data, size_t bytes) {
  if (bytes == 0) return 0;
  std::lock_guard<std::mutex> lock(watch_mu);
  const InWatch guard;
  if (!watches) watches = new std::vector<Watch>;
  watches->push_back({next_watch, owner, rank, static_cast<const std::byte*>(data), bytes, false});
  watch_count.fetch_add(1, std::memory_order_release);
  return next_watch++;
}

void unwatch_buffer(int64_t id) {
  if (id == 0) return;
  std::lock_guard<std::mutex> lock(watch_mu);
  const InWatch guard;
  for (size_t i = 0; i < watches->size(); ++i) {
    if ((*watches)[i].id == id) {
      watches->erase(watches->begin() + static_cast<int64_t>(i));
      watch_count.fetch_sub(1, std::memory_order_release);
      return;
    }
  }
}

bool write_if_alive(int64_t id, const void* src, size_t bytes) {
  std::lock_guard<std::mutex> lock(watch_mu);
  for (const Watch& w : *watches) {
    if (w.id == id) {
      if (w.freed) return false;
      std::memcpy(const_cast<std::byte*>(w.data), src, std::min(bytes, w.bytes));
      return true;
    }
  }
  return false;
}

int64_t watched_frees(const void* owner, int rank) {
  std::lock_guard<std::mutex> lock(watch_mu);
  int64_t n = 0;
  if (watches) {
    for (const Watch& w : *watches) n += w.owner == owner && w.rank == rank && w.freed;
  }
  return n;
}

void forget_buffers(const void* owner) {
  std::lock_guard<std::mutex> lock(watch_mu);
  const InWatch guard;
  if (!watches) return;
  const auto before = watches->size();
  std::erase_if(*watches, [&](const Watch& w) { return w.owner == owner; });
  watch_count.fetch_sub(static_cast<int64_t>(before - watches->size()), std::memory_order_release);
}

int LocalComm::size() const { return world_.size(); }

LocalWorld::LocalWorld(int size, Delivery delivery)
    : size_(size),
      delivery_(delivery),
      gather_round_(static_cast<size_t>(size), 0),
      sends_(static_cast<size_t>(size), 0),
      stop_after_(static_cast<size_t>(size), std::numeric_limits<int64_t>::max()),
      gather_stopped_(static_cast<size_t>(size), false) {
  for (int r = 0; r < size; ++r) comms_.push_back(std::make_unique<LocalComm>(*this, r));
}

LocalWorld::~LocalWorld() { forget_buffers(this); }

void LocalWorld::stop_sends(int rank, int after) {
  std::lock_guard<std::mutex> lock(mu_);
  stop_after_[static_cast<size_t>(rank)] = after;
}
void LocalWorld::stop_allgathers(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  gather_stopped_[static_cast<size_t>(rank)] = true;
}

int64_t LocalWorld::open_requests(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const auto& [id, req] : requests_) n += req.owner == rank;
  return n;
}
int64_t LocalWorld::abandoned_requests(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const auto& [id, req] : abandoned_) n += req.owner == rank;
  return n;
}

std::vector<std::exception_ptr> LocalWorld::run(const std::function<void(int, sdpa::Communicator&)>& f) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(size_));
  std::vector<std::thread> threads;
  for (int r = 0; r < size_; ++r) {
    threads.emplace_back([&, r] {
      try {
        f(r, comm(r));
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return errors;
}

void LocalWorld::deliver_eagerly(const std::tuple<int, int, int>& key, int64_t seq) {
  const auto box = mail_.find(key);
  if (box == mail_.end() || box->second.count(seq) == 0) return;
  for (auto* reqs : {&requests_, &abandoned_}) {
    for (auto& [id, req] : *reqs) {
      if (req.kind != Req::kRecv || req.delivered || req.key != key || req.seq != seq) continue;
      std::vector<std::byte>& msg = box->second[seq];
      req.delivered = true;
      req.got = msg.size();
      // An abandoned receive's buffer: written only while it is alive (a freed one is counted).
      if (msg.size() == req.bytes && !msg.empty()) write_if_alive(req.watch, msg.data(), msg.size());
      box->second.erase(seq);
      return;
    }
  }
}

sdpa::Communicator::Request LocalComm::isend(const void* data, size_t bytes, int to, int tag) {
  LocalWorld& w = world_;
  std::lock_guard<std::mutex> lock(w.mu_);
  const auto key = std::make_tuple(rank_, to, tag);
  const int64_t seq = w.sent_[key]++;
  if (w.sends_[static_cast<size_t>(rank_)]++ < w.stop_after_[static_cast<size_t>(rank_)]) {
    const auto* p = static_cast<const std::byte*>(data);
    w.mail_[key][seq] = std::vector<std::byte>(p, p + bytes);
    if (w.delivery_ == Delivery::kEager) w.deliver_eagerly(key, seq);
    w.cv_.notify_all();
  }
  const int64_t id = w.next_request_++;
  LocalWorld::Req req;
  req.owner = rank_;
  w.requests_[id] = req;
  return id;
}

sdpa::Communicator::Request LocalComm::irecv(void* data, size_t bytes, int from, int tag) {
  LocalWorld& w = world_;
  std::lock_guard<std::mutex> lock(w.mu_);
  LocalWorld::Req req;
  req.owner = rank_, req.kind = LocalWorld::Req::kRecv, req.data = data, req.bytes = bytes;
  req.key = std::make_tuple(from, rank_, tag);
  req.seq = w.posted_[req.key]++;
  req.watch = watch_buffer(&w, rank_, data, bytes);
  const int64_t id = w.next_request_++;
  w.requests_[id] = req;
  if (w.delivery_ == Delivery::kEager) w.deliver_eagerly(req.key, req.seq);
  return id;
}

sdpa::Communicator::Request LocalComm::iallgather(const void* in, void* out, size_t bytes) {
  LocalWorld& w = world_;
  std::lock_guard<std::mutex> lock(w.mu_);
  const int64_t round = w.gather_round_[static_cast<size_t>(rank_)]++;
  auto& slots = w.gathers_[round];
  slots.resize(static_cast<size_t>(w.size_));
  if (!w.gather_stopped_[static_cast<size_t>(rank_)]) {
    const auto* p = static_cast<const std::byte*>(in);
    slots[static_cast<size_t>(rank_)] = std::vector<std::byte>(p, p + bytes);
    w.cv_.notify_all();
  }
  LocalWorld::Req req;
  req.owner = rank_, req.kind = LocalWorld::Req::kGather, req.data = out, req.bytes = bytes;
  req.seq = round;
  req.watch = watch_buffer(&w, rank_, out, bytes * static_cast<size_t>(w.size_));
  const int64_t id = w.next_request_++;
  w.requests_[id] = req;
  return id;
}

bool LocalComm::wait(Request request, double seconds) {
  LocalWorld& w = world_;
  std::unique_lock<std::mutex> lock(w.mu_);
  const auto it = w.requests_.find(request);
  if (it == w.requests_.end()) throw sdpa::Error("LocalComm::wait: unknown request " + std::to_string(request));
  const auto ready = [&] {
    const LocalWorld::Req& req = w.requests_.at(request);
    if (req.kind == LocalWorld::Req::kDone || req.delivered) return true;
    if (req.kind == LocalWorld::Req::kRecv) {
      const auto box = w.mail_.find(req.key);
      return box != w.mail_.end() && box->second.count(req.seq) != 0;
    }
    const auto& slots = w.gathers_[req.seq];
    for (const auto& s : slots)
      if (s.empty() && req.bytes != 0) return false;
    return true;
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  if (!w.cv_.wait_until(lock, deadline, ready)) {
    w.abandoned_[request] = w.requests_.at(request);  // its buffer stays watched
    w.requests_.erase(request);
    return false;
  }
  const LocalWorld::Req req = w.requests_.at(request);
  w.requests_.erase(request);
  const auto failed = [&](const std::string& what) {
    w.abandoned_[request] = req;
    throw sdpa::Error(what);
  };
  const auto size_error = [&](size_t got) {
    failed("LocalComm::wait: rank " + std::to_string(std::get<0>(req.key)) + " sent " + std::to_string(got) +
           " bytes where rank " + std::to_string(rank_) + " expected " + std::to_string(req.bytes));
  };
  if (req.kind == LocalWorld::Req::kRecv && req.delivered) {
    if (req.got != req.bytes) size_error(req.got);
  } else if (req.kind == LocalWorld::Req::kRecv) {
    auto& box = w.mail_[req.key];
    std::vector<std::byte> msg = std::move(box[req.seq]);
    box.erase(req.seq);
    if (msg.size() != req.bytes) size_error(msg.size());
    if (!msg.empty()) std::memcpy(req.data, msg.data(), msg.size());
  } else if (req.kind == LocalWorld::Req::kGather) {
    const auto& slots = w.gathers_[req.seq];
    for (size_t r = 0; r < slots.size(); ++r) {
      if (slots[r].size() != req.bytes) failed("LocalComm::wait: all-gather sizes differ");
      if (req.bytes != 0) std::memcpy(static_cast<std::byte*>(req.data) + r * req.bytes, slots[r].data(), req.bytes);
    }
  }
  unwatch_buffer(req.watch);
  return true;
}

}  // namespace sdpa_test

// Every free is checked against the watched ranges (sdpa_test::watch_buffer): the test
// programs' operator delete, paired with an operator new of malloc here (both replaced, so that
// a sanitizer's own new is never freed by this delete: ASan calls that an alloc-dealloc
// mismatch). The aligned forms stay the runtime's, new and delete alike.
void* operator new(std::size_t n) {
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return ::operator new(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return std::malloc(n ? n : 1); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return std::malloc(n ? n : 1); }
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void operator delete(void* p) noexcept {
  sdpa_test::check_free(p);
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  sdpa_test::check_free(p);
  std::free(p);
}
void operator delete[](void* p) noexcept {
  sdpa_test::check_free(p);
  std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  sdpa_test::check_free(p);
  std::free(p);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
  sdpa_test::check_free(p);
  std::free(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  sdpa_test::check_free(p);
  std::free(p);
}
#pragma GCC diagnostic pop
