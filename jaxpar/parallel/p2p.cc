// Point-to-point messages sent and received by the XLA:CPU programs themselves (FFI custom
// calls; jaxpar/parallel/p2p.py builds, registers and calls them): over a connected socket
// between processes (blocking, SO_SNDTIMEO / SO_RCVTIMEO set, so no call waits forever), or
// through an in-memory channel between two programs of one process (a send copies the message
// and returns at once; a receive returns a future the send completes, failed after timeout_s
// seconds, so no thread blocks on it).
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <sys/socket.h>
#include <sys/types.h>
#include <thread>
#include <vector>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static std::string Why(const char* what, int error) {
  if (error == EAGAIN || error == EWOULDBLOCK)
    return std::string("jaxpar p2p: a ") + what + " timed out (the peer process stopped?)";
  return std::string("jaxpar p2p: ") + what + " failed: " + std::strerror(error);
}

// Send(x, order) -> 0.0f: x's bytes to the peer; `order` (unused) makes the call wait for
// what the caller computed before it, the result lets the caller order later work after it.
static ffi::Error Send(ffi::AnyBuffer x, ffi::AnyBuffer order, ffi::Result<ffi::BufferR0<ffi::F32>> done,
                       int64_t fd) {
  const char* p = static_cast<const char*>(x.untyped_data());
  size_t n = x.size_bytes();
  while (n > 0) {
    ssize_t w = ::send(static_cast<int>(fd), p, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return ffi::Error::Internal(Why("send", errno));
    }
    p += w; n -= static_cast<size_t>(w);
  }
  *done->typed_data() = 0.0f;
  return ffi::Error::Success();
}

// Recv(order) -> the next message from the peer, of the result's shape and type; `order`
// (unused) makes the call wait for what the caller computed before it.
static ffi::Error Recv(ffi::AnyBuffer order, ffi::Result<ffi::AnyBuffer> out, int64_t fd) {
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
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::BufferR0<ffi::F32>>().Attr<int64_t>("fd"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxparRecv, Recv,
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>("fd"));

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
  std::shared_ptr<Channel> c;
  {
    std::lock_guard<std::mutex> lock(channels_mu);
    auto it = channels.find(id);
    if (it == channels.end()) return;
    c = it->second;
    channels.erase(it);
  }
  FailWaiting(*c, true, "jaxpar p2p: a receive on a channel closed while it waited");
}

static std::shared_ptr<Channel> Find(int64_t id) {
  std::lock_guard<std::mutex> lock(channels_mu);
  auto it = channels.find(id);
  return it == channels.end() ? nullptr : it->second;
}

// ChanSend(x, order) -> 0.0f: x's bytes straight into a waiting receive's result (completed
// on the pool, so the receiving program goes on there, not on this program's thread), else
// into the channel's queue. Returns at once either way.
static ffi::Error ChanSend(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer order,
                           ffi::Result<ffi::BufferR0<ffi::F32>> done, int64_t channel) {
  auto c = Find(channel);
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
  auto c = Find(channel);
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
