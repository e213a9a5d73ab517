// Point-to-point messages sent and received by the XLA:CPU programs themselves (FFI custom
// calls; jaxpar/parallel/p2p.py builds, registers and calls them): over a connected socket
// between processes (blocking, SO_SNDTIMEO / SO_RCVTIMEO set, so no call waits forever), or
// through an in-memory channel between two programs of one process (a send copies the message
// into the channel's queue and returns at once; a receive waits, at most timeout_s seconds).
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <sys/socket.h>
#include <sys/types.h>
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

// In-process channels: id -> queue of messages (the Python side opens and closes them).
struct Channel {
  std::mutex mu;
  std::condition_variable arrived;
  std::deque<std::vector<char>> messages;
};
static std::mutex channels_mu;
static std::map<int64_t, std::shared_ptr<Channel>> channels;
static int64_t next_channel = 1;

extern "C" int64_t JaxparChannelOpen() {
  std::lock_guard<std::mutex> lock(channels_mu);
  channels[next_channel] = std::make_shared<Channel>();
  return next_channel++;
}

extern "C" void JaxparChannelClose(int64_t id) {
  std::lock_guard<std::mutex> lock(channels_mu);
  channels.erase(id);
}

static std::shared_ptr<Channel> Find(int64_t id) {
  std::lock_guard<std::mutex> lock(channels_mu);
  auto it = channels.find(id);
  return it == channels.end() ? nullptr : it->second;
}

static ffi::Error ChanSend(ffi::AnyBuffer x, ffi::AnyBuffer order, ffi::Result<ffi::BufferR0<ffi::F32>> done,
                           int64_t channel) {
  auto c = Find(channel);
  if (!c) return ffi::Error::Internal("jaxpar p2p: a send on a closed channel");
  const char* p = static_cast<const char*>(x.untyped_data());
  std::vector<char> message(p, p + x.size_bytes());
  {
    std::lock_guard<std::mutex> lock(c->mu);
    c->messages.push_back(std::move(message));
  }
  c->arrived.notify_one();
  *done->typed_data() = 0.0f;
  return ffi::Error::Success();
}

static ffi::Error ChanRecv(ffi::AnyBuffer order, ffi::Result<ffi::AnyBuffer> out, int64_t channel,
                           int64_t timeout_s) {
  auto c = Find(channel);
  if (!c) return ffi::Error::Internal("jaxpar p2p: a receive on a closed channel");
  std::unique_lock<std::mutex> lock(c->mu);
  if (!c->arrived.wait_for(lock, std::chrono::seconds(timeout_s), [&] { return !c->messages.empty(); }))
    return ffi::Error::Internal("jaxpar p2p: a receive timed out (the sending program stopped?)");
  std::vector<char> message = std::move(c->messages.front());
  c->messages.pop_front();
  lock.unlock();
  if (message.size() != out->size_bytes())
    return ffi::Error::Internal("jaxpar p2p: a message of " + std::to_string(message.size()) +
                                " bytes where " + std::to_string(out->size_bytes()) + " were expected");
  std::memcpy(out->untyped_data(), message.data(), message.size());
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxparChanSend, ChanSend,
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::BufferR0<ffi::F32>>().Attr<int64_t>("channel"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxparChanRecv, ChanRecv,
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>("channel")
        .Attr<int64_t>("timeout_s"));
