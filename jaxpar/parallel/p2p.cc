// Point-to-point messages over a connected socket, sent and received by the XLA:CPU program
// itself (FFI custom calls; jaxpar/parallel/p2p.py builds, registers and calls them). The
// socket is blocking with SO_SNDTIMEO / SO_RCVTIMEO set, so no call waits forever.
#include <cerrno>
#include <cstring>
#include <string>
#include <sys/socket.h>
#include <sys/types.h>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static std::string Why(const char* what, int error) {
  if (error == EAGAIN || error == EWOULDBLOCK)
    return std::string("jaxpar p2p: a ") + what + " timed out (the peer process stopped?)";
  return std::string("jaxpar p2p: ") + what + " failed: " + std::strerror(error);
}

// Send(x) -> 0.0f: x's bytes to the peer; the result lets the caller order later work after
// the call by data dependence.
static ffi::Error Send(ffi::AnyBuffer x, ffi::Result<ffi::BufferR0<ffi::F32>> done, int64_t fd) {
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
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::BufferR0<ffi::F32>>().Attr<int64_t>("fd"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxparRecv, Recv,
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>("fd"));
