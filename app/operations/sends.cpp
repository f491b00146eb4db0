// Many sockets' sends in one call, for app/operations/sends.py: ctypes releases the GIL around it,
// so the engine thread runs Python while a step's chunks go out, instead of waiting on each send.

#include <errno.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>

#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0
#endif

extern "C" {

// Entry i is lengths[i] bytes of `data` (the entries back to back) for socket fds[i]; sent[i] is how
// many of them the kernel took (0 where it took none: a full buffer or an error, which the caller's
// transport meets again and handles). After a short send to a socket its later entries are not
// tried, so whatever is left can follow in order through the transport.
void sl_send_all(int64_t n, const int32_t* fds, const char* data, const int64_t* lengths, int64_t* sent) {
  const char* entry = data;
  int64_t short_sends = 0;
  for (int64_t i = 0; i < n; entry += lengths[i], ++i) {
    sent[i] = 0;
    bool blocked = false;
    for (int64_t j = 0; short_sends > 0 && j < i && !blocked; ++j) blocked = fds[j] == fds[i] && sent[j] < lengths[j];
    if (blocked) continue;
    ssize_t taken;
    do {
      taken = send(fds[i], entry, static_cast<size_t>(lengths[i]), MSG_DONTWAIT | MSG_NOSIGNAL);
    } while (taken < 0 && errno == EINTR);
    if (taken > 0) sent[i] = taken;
    short_sends += sent[i] < lengths[i];
  }
}

}  // extern "C"
