// The in-process Communicator of ring_local.h.
#include "ring_local.h"

#include <chrono>
#include <cstring>
#include <limits>
#include <thread>

namespace sdpa_test {

int LocalComm::size() const { return world_.size(); }

LocalWorld::LocalWorld(int size)
    : size_(size),
      gather_round_(static_cast<size_t>(size), 0),
      sends_(static_cast<size_t>(size), 0),
      stop_after_(static_cast<size_t>(size), std::numeric_limits<int64_t>::max()),
      gather_stopped_(static_cast<size_t>(size), false) {
  for (int r = 0; r < size; ++r) comms_.push_back(std::make_unique<LocalComm>(*this, r));
}

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

sdpa::Communicator::Request LocalComm::isend(const void* data, size_t bytes, int to, int tag) {
  LocalWorld& w = world_;
  std::lock_guard<std::mutex> lock(w.mu_);
  const auto key = std::make_tuple(rank_, to, tag);
  const int64_t seq = w.sent_[key]++;
  if (w.sends_[static_cast<size_t>(rank_)]++ < w.stop_after_[static_cast<size_t>(rank_)]) {
    const auto* p = static_cast<const std::byte*>(data);
    w.mail_[key][seq] = std::vector<std::byte>(p, p + bytes);
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
  const int64_t id = w.next_request_++;
  w.requests_[id] = req;
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
  const int64_t id = w.next_request_++;
  w.requests_[id] = req;
  return id;
}

bool LocalComm::wait(Request request, double seconds) {
  LocalWorld& w = world_;
  std::unique_lock<std::mutex> lock(w.mu_);
  const auto it = w.requests_.find(request);
  if (it == w.requests_.end()) throw sdpa::Error("LocalComm::wait: unknown request " + std::to_string(request));
  const LocalWorld::Req req = it->second;
  const auto ready = [&] {
    if (req.kind == LocalWorld::Req::kDone) return true;
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
    w.requests_.erase(request);  // abandoned
    return false;
  }
  w.requests_.erase(request);
  if (req.kind == LocalWorld::Req::kRecv) {
    auto& box = w.mail_[req.key];
    std::vector<std::byte> msg = std::move(box[req.seq]);
    box.erase(req.seq);
    if (msg.size() != req.bytes) {
      throw sdpa::Error("LocalComm::wait: rank " + std::to_string(std::get<0>(req.key)) + " sent " +
                        std::to_string(msg.size()) + " bytes where rank " + std::to_string(rank_) + " expected " +
                        std::to_string(req.bytes));
    }
    if (!msg.empty()) std::memcpy(req.data, msg.data(), msg.size());
  } else if (req.kind == LocalWorld::Req::kGather) {
    const auto& slots = w.gathers_[req.seq];
    for (size_t r = 0; r < slots.size(); ++r) {
      if (slots[r].size() != req.bytes) throw sdpa::Error("LocalComm::wait: all-gather sizes differ");
      if (req.bytes != 0) std::memcpy(static_cast<std::byte*>(req.data) + r * req.bytes, slots[r].data(), req.bytes);
    }
  }
  return true;
}

}  // namespace sdpa_test
