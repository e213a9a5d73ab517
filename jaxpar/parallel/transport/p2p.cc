// Point-to-point messages sent and received by the XLA:CPU programs themselves (FFI custom
// calls; jaxpar/parallel/p2p.py builds, registers and calls them): over a connected socket
// between processes, or through an in-memory channel between two programs of one process. A
// send never waits for its receiver either way: over a socket it copies the message into the
// connection's outbox, which a thread of its own writes out (a flush waits until it has); in
// a channel it copies the message into the queue. A socket receive blocks its thread (one
// device per process), a channel receive returns a future the send completes. Every wait is
// bounded: SO_SNDTIMEO / SO_RCVTIMEO on the sockets, timeout_s on channel receives and flushes.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fcntl.h>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <sys/socket.h>
#include <sys/types.h>
#include <thread>
#include <unistd.h>
#include <vector>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static std::string Why(const char* what, int error) {
  if (error == EAGAIN || error == EWOULDBLOCK)
    return std::string("jaxpar p2p: a ") + what + " timed out (the peer process stopped?)";
  return std::string("jaxpar p2p: ") + what + " failed: " + std::strerror(error);
}

// The entry of a registry (outboxes, channels: id -> state, under its mutex), or null; Take
// also removes it.
template <typename T>
static std::shared_ptr<T> Lookup(std::mutex& mu, std::map<int64_t, std::shared_ptr<T>>& registry, int64_t id) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = registry.find(id);
  return it == registry.end() ? nullptr : it->second;
}

template <typename T>
static std::shared_ptr<T> Take(std::mutex& mu, std::map<int64_t, std::shared_ptr<T>>& registry, int64_t id) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = registry.find(id);
  if (it == registry.end()) return nullptr;
  std::shared_ptr<T> taken = it->second;
  registry.erase(it);
  return taken;
}

// A connection's outbox: messages sent and not yet written, written in order by a thread of
// its own on a duplicate of the socket's descriptor (so closing the socket in Python never
// leaves it writing to a reused descriptor number). The first failed write is kept and
// reported by the sends and flushes after it.
struct Outbox {
  std::mutex mu;
  std::condition_variable changed;
  std::deque<std::vector<char>> queue;
  bool writing = false;  // a message taken off the queue and not yet all written
  bool closing = false;
  std::string error;
  int fd = -1;
};
static std::mutex& outboxes_mu = *new std::mutex;
static std::map<int64_t, std::shared_ptr<Outbox>>& outboxes = *new std::map<int64_t, std::shared_ptr<Outbox>>;
static int64_t next_outbox = 1;

// Writes [p, p + n) to the socket, advancing p and n: all of it (`wait`: blocking, up to
// SO_SNDTIMEO), or what its buffer takes now. "" or why it failed.
static std::string Write(int fd, const char*& p, size_t& n, bool wait) {
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL | (wait ? 0 : MSG_DONTWAIT));
    if (w < 0) {
      if (errno == EINTR) continue;
      if (!wait && (errno == EAGAIN || errno == EWOULDBLOCK)) return "";  // the buffer is full
      return Why("send", errno);
    }
    p += w; n -= static_cast<size_t>(w);
  }
  return "";
}

// The outbox's thread: writes each message as it comes; once closed, what is left, then ends.
static void Drain(std::shared_ptr<Outbox> box) {
  std::unique_lock<std::mutex> lock(box->mu);
  for (;;) {
    box->changed.wait(lock, [&] { return !box->queue.empty() || box->closing; });
    if (box->queue.empty()) break;
    std::vector<char> message = std::move(box->queue.front());
    box->queue.pop_front();
    bool failed = !box->error.empty();  // after a failure the rest is dropped, not written
    box->writing = true;
    lock.unlock();
    const char* p = message.data();
    size_t n = message.size();
    std::string why = failed ? "" : Write(box->fd, p, n, true);
    lock.lock();
    box->writing = false;
    if (!why.empty()) box->error = why;
    box->changed.notify_all();
  }
  ::close(box->fd);
}

// An outbox for a connected socket (its descriptor duplicated); its id, or -errno.
extern "C" int64_t JaxparOutboxOpen(int fd) {
  int own = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) return -errno;
  auto box = std::make_shared<Outbox>();
  box->fd = own;
  std::thread(Drain, box).detach();
  std::lock_guard<std::mutex> lock(outboxes_mu);
  outboxes[next_outbox] = box;
  return next_outbox++;
}

// Closes an outbox: its thread writes what is queued (each write bounded by SO_SNDTIMEO), then
// closes its descriptor and ends.
extern "C" void JaxparOutboxClose(int64_t id) {
  auto box = Take(outboxes_mu, outboxes, id);
  if (!box) return;
  std::lock_guard<std::mutex> lock(box->mu);
  box->closing = true;
  box->changed.notify_all();
}

// Nanoseconds this process's programs have spent in socket receives and flushes: a rank of one
// thread does nothing else meanwhile, so over a step it is that rank's idle time (its share of
// the bubble, and its messages' time on the wire), which bench reads (`p2p.waited`).
static std::atomic<int64_t> waited_ns{0};
static std::atomic<int64_t> receives{0};  // socket receives made: none, and a run messaged nothing

struct Waited {  // adds the time from its making to its end to waited_ns
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  ~Waited() {
    waited_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now() - start).count();
  }
};

extern "C" int64_t JaxparWaitedNs() { return waited_ns.load(); }
extern "C" int64_t JaxparReceives() { return receives.load(); }

// Stamps: the steady clock (CLOCK_MONOTONIC: one clock for every process of a host) read by a
// program where it calls Stamp, with the call's mark, kept until taken. bench's timeline of a
// step run as one program per process (`p2p.stamp`): when each action began and ended
// inside it, where a host callback would wait for the interpreter. At most kMaxStamps are
// kept (a run that never takes them holds 16 MiB at most).
static std::mutex& stamps_mu = *new std::mutex;
static std::vector<int64_t>& stamps = *new std::vector<int64_t>;  // mark, ns, mark, ns, ...
static constexpr size_t kMaxStamps = 1 << 20;

// Stamp(order) -> 0.0f once `order` exists, the clock read then kept with `mark`.
static ffi::Error Stamp(ffi::AnyBuffer order, ffi::Result<ffi::BufferR0<ffi::F32>> done, int64_t mark) {
  int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now().time_since_epoch()).count();
  *done->typed_data() = 0.0f;
  std::lock_guard<std::mutex> lock(stamps_mu);
  if (stamps.size() < 2 * kMaxStamps) {
    stamps.push_back(mark);
    stamps.push_back(ns);
  }
  return ffi::Error::Success();
}

// Copies the stamps kept (mark, ns pairs; at most `capacity` int64s) into `out` and forgets
// them all; returns how many int64s it copied.
extern "C" int64_t JaxparStampsTake(int64_t* out, int64_t capacity) {
  std::lock_guard<std::mutex> lock(stamps_mu);
  int64_t n = std::min<int64_t>(capacity, static_cast<int64_t>(stamps.size()));
  std::memcpy(out, stamps.data(), n * sizeof(int64_t));
  stamps.clear();
  return n;
}

extern "C" int64_t JaxparStampsKept() {
  std::lock_guard<std::mutex> lock(stamps_mu);
  return static_cast<int64_t>(stamps.size());
}

// Send(x, order) -> 0.0f, at once: x's bytes written straight into the socket as far as its
// buffer takes them without waiting (nothing queued before them), the rest into the
// connection's outbox for its thread to write. Writing here first spares the usual message,
// which the buffer holds whole, a copy and a hand-over to another thread (with a core per
// rank, that thread waited for a core while the message was on the critical path). `order`
// (unused) makes the call wait for what the caller computed before it, the result lets the
// caller order later work after it.
static ffi::Error Send(ffi::AnyBuffer x, ffi::AnyBuffer order, ffi::Result<ffi::BufferR0<ffi::F32>> done,
                       int64_t outbox) {
  auto box = Lookup(outboxes_mu, outboxes, outbox);
  if (!box) return ffi::Error::Internal("jaxpar p2p: a send on a closed connection");
  const char* p = static_cast<const char*>(x.untyped_data());
  size_t n = x.size_bytes();
  *done->typed_data() = 0.0f;
  std::lock_guard<std::mutex> lock(box->mu);
  if (!box->error.empty()) return ffi::Error::Internal(box->error);
  if (box->queue.empty() && !box->writing) {  // nothing before it: straight into the socket
    box->error = Write(box->fd, p, n, false);
    if (!box->error.empty()) return ffi::Error::Internal(box->error);
  }
  if (n > 0) {  // what the buffer did not take: the thread writes it
    box->queue.emplace_back(p, p + n);
    box->changed.notify_all();
  }
  return ffi::Error::Success();
}

// Flush(order) -> 0.0f once every message sent before it is written out (the peer has read
// all but what the kernel's buffers hold), or fails: a failed write, or timeout_s seconds.
static ffi::Error Flush(ffi::AnyBuffer order, ffi::Result<ffi::BufferR0<ffi::F32>> done, int64_t outbox,
                        int64_t timeout_s) {
  Waited waited;
  auto box = Lookup(outboxes_mu, outboxes, outbox);
  if (!box) return ffi::Error::Internal("jaxpar p2p: a flush on a closed connection");
  *done->typed_data() = 0.0f;
  std::unique_lock<std::mutex> lock(box->mu);
  bool written = box->changed.wait_for(lock, std::chrono::seconds(timeout_s), [&] {
    return !box->error.empty() || (box->queue.empty() && !box->writing);
  });
  if (!box->error.empty()) return ffi::Error::Internal(box->error);
  if (!written) return ffi::Error::Internal("jaxpar p2p: a flush timed out (the peer process stopped reading?)");
  return ffi::Error::Success();
}

// Recv(order) -> the next message from the peer, of the result's shape and type; `order`
// (unused) makes the call wait for what the caller computed before it.
static ffi::Error Recv(ffi::AnyBuffer order, ffi::Result<ffi::AnyBuffer> out, int64_t fd) {
  Waited waited;
  ++receives;
  char* p = static_cast<char*>(out->untyped_data());
  size_t n = out->size_bytes();
  while (n > 0) {
    ssize_t r = ::recv(static_cast<int>(fd), p, n, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return ffi::Error::Internal(Why("receive", errno));
    }
    if (r == 0) return ffi::Error::Internal("jaxpar recv: the peer closed the connection");
    p += r; n -= static_cast<size_t>(r);
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxparSend, Send,
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::BufferR0<ffi::F32>>().Attr<int64_t>("outbox"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxparFlush, Flush,
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::BufferR0<ffi::F32>>().Attr<int64_t>("outbox")
        .Attr<int64_t>("timeout_s"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxparRecv, Recv,
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>("fd"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxparStamp, Stamp,
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::BufferR0<ffi::F32>>().Attr<int64_t>("mark"));

// In-process channels: id -> messages sent and not yet received, or receives waiting for a
// message. A receive that finds no message does not block its thread: it returns a future
// that the matching send completes. XLA:CPU runs every simulated device's programs on one
// intra-op pool of as many threads as cores, so a receive blocking a pool thread would leave
// the other devices' programs fewer cores (measured: 1F1B's last stage, waiting most of the
// step, held one of 2 threads while stage 0 computed).
struct Waiting {
  void* out;
  size_t bytes;
  ffi::Promise done;
  std::chrono::steady_clock::time_point deadline;
};
struct Channel {
  std::mutex mu;
  std::deque<std::vector<char>> messages;
  std::deque<Waiting> receivers;
};
// Never destroyed: the deadline thread may still look at them while the process exits.
static std::mutex& channels_mu = *new std::mutex;
static std::map<int64_t, std::shared_ptr<Channel>>& channels = *new std::map<int64_t, std::shared_ptr<Channel>>;
static int64_t next_channel = 1;

// A message's bytes into a receive's result, if they are as many as it expects.
static ffi::Error CopyMessage(const char* message, size_t bytes, void* out, size_t expected) {
  if (bytes != expected)
    return ffi::Error::Internal("jaxpar p2p: a message of " + std::to_string(bytes) + " bytes where " +
                                std::to_string(expected) + " were expected");
  std::memcpy(out, message, bytes);
  return ffi::Error::Success();
}

// Fails every waiting receive past its deadline (or every one, on a closed channel): no
// program waits forever on a sender that stopped.
static void FailWaiting(Channel& c, bool all, const char* why) {
  std::vector<Waiting> failed;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    auto now = std::chrono::steady_clock::now();
    for (auto it = c.receivers.begin(); it != c.receivers.end();) {
      if (all || it->deadline <= now) { failed.push_back(std::move(*it)); it = c.receivers.erase(it); }
      else ++it;
    }
  }
  for (auto& w : failed) w.done.SetError(ffi::Error::Internal(why));
}

static void WatchDeadlines() {
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    std::vector<std::shared_ptr<Channel>> open;
    {
      std::lock_guard<std::mutex> lock(channels_mu);
      for (auto& [id, c] : channels) open.push_back(c);
    }
    for (auto& c : open) FailWaiting(*c, false, "jaxpar p2p: a receive timed out (the sending program stopped?)");
  }
}

extern "C" int64_t JaxparChannelOpen() {
  static std::once_flag watching;
  std::call_once(watching, [] { std::thread(WatchDeadlines).detach(); });
  std::lock_guard<std::mutex> lock(channels_mu);
  channels[next_channel] = std::make_shared<Channel>();
  return next_channel++;
}

extern "C" void JaxparChannelClose(int64_t id) {
  auto c = Take(channels_mu, channels, id);
  if (!c) return;
  FailWaiting(*c, true, "jaxpar p2p: a receive on a channel closed while it waited");
}

// ChanSend(x, order) -> 0.0f: x's bytes straight into a waiting receive's result (completed
// on the pool, so the receiving program goes on there, not on this program's thread), else
// into the channel's queue. Returns at once either way.
static ffi::Error ChanSend(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer order,
                           ffi::Result<ffi::BufferR0<ffi::F32>> done, int64_t channel) {
  auto c = Lookup(channels_mu, channels, channel);
  if (!c) return ffi::Error::Internal("jaxpar p2p: a send on a closed channel");
  const char* p = static_cast<const char*>(x.untyped_data());
  *done->typed_data() = 0.0f;
  std::unique_lock<std::mutex> lock(c->mu);
  if (c->receivers.empty()) {
    c->messages.emplace_back(p, p + x.size_bytes());
    return ffi::Error::Success();
  }
  Waiting w = std::move(c->receivers.front());
  c->receivers.pop_front();
  lock.unlock();
  ffi::Error copied = CopyMessage(p, x.size_bytes(), w.out, w.bytes);
  if (!copied.success()) w.done.SetError(copied);
  else pool.Schedule([done = std::move(w.done)]() mutable { done.SetAvailable(); });
  return ffi::Error::Success();
}

// ChanRecv(order) -> the channel's next message; a future completed by the send that
// delivers it, or failed after timeout_s seconds.
static ffi::Future ChanRecv(ffi::AnyBuffer order, ffi::Result<ffi::AnyBuffer> out, int64_t channel,
                            int64_t timeout_s) {
  ffi::Promise promise;
  ffi::Future future(promise);
  auto c = Lookup(channels_mu, channels, channel);
  if (!c) {
    promise.SetError(ffi::Error::Internal("jaxpar p2p: a receive on a closed channel"));
    return future;
  }
  std::unique_lock<std::mutex> lock(c->mu);
  if (c->messages.empty()) {
    c->receivers.push_back({out->untyped_data(), out->size_bytes(), std::move(promise),
                            std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s)});
    return future;
  }
  std::vector<char> message = std::move(c->messages.front());
  c->messages.pop_front();
  lock.unlock();
  ffi::Error copied = CopyMessage(message.data(), message.size(), out->untyped_data(), out->size_bytes());
  if (!copied.success()) promise.SetError(copied);
  else promise.SetAvailable();
  return future;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxparChanSend, ChanSend,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::BufferR0<ffi::F32>>().Attr<int64_t>("channel"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxparChanRecv, ChanRecv,
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>("channel")
        .Attr<int64_t>("timeout_s"));
