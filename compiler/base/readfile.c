// readfile.c: files opened to be read. Every reader of a user's file (a model's text, weights,
// checkpoints, arrays, shards, tokenizers, prep's records) comes through here, so that each one
// reads a regular file only and knows its size before it reads a byte: a FIFO would block the
// reader forever, /dev/zero would feed it until memory runs out, a folder reads as garbage. The
// file is opened without blocking (a FIFO then waits for no writer), checked with fstat, and only
// then read, never past the size fstat gave.
#include "mdl.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *kind(mode_t m) {
  return S_ISDIR(m) ? "a folder" : S_ISFIFO(m) ? "a FIFO" : S_ISCHR(m) ? "a character device, such as /dev/zero"
       : S_ISBLK(m) ? "a block device" : S_ISSOCK(m) ? "a socket" : "not a file";
}

int file_open(const char *path, int flags, int64_t *size, char *why, size_t n) {
  int fd = open(path, flags | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    if (e == EISDIR) // (opened to be written)
      snprintf(why, n, "not a regular file (a folder)");
    else
      snprintf(why, n, "cannot open: %s", strerror(e));
    errno = e;
    return -1;
  }
  struct stat st;
  if (fstat(fd, &st)) {
    snprintf(why, n, "cannot stat: %s", strerror(errno));
  } else if (!S_ISREG(st.st_mode)) {
    snprintf(why, n, "not a regular file (%s)", kind(st.st_mode));
  } else if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK)) {
    snprintf(why, n, "cannot open: %s", strerror(errno));
  } else {
    *size = (int64_t)st.st_size;
    return fd;
  }
  close(fd);
  errno = EINVAL;
  return -1;
}

FILE *file_fopen(const char *path, const char *mode, int64_t *size, char *why, size_t n) {
  int fd = file_open(path, mode[1] == '+' ? O_RDWR : O_RDONLY, size, why, n);
  FILE *f = fd >= 0 ? fdopen(fd, mode) : NULL;
  if (fd >= 0 && !f) {
    snprintf(why, n, "cannot open: %s", strerror(errno));
    close(fd);
  }
  return f;
}

char *file_read(const char *path, size_t *n, size_t limit, char *why, size_t wn) {
  int64_t size;
  int fd = file_open(path, O_RDONLY, &size, why, wn);
  if (fd < 0)
    return NULL;
  char *buf = NULL;
  if (limit && (uint64_t)size > limit)
    snprintf(why, wn, "%lld bytes, more than the %zu such a file may have", (long long)size, limit);
  else if ((uint64_t)size >= SIZE_MAX)
    snprintf(why, wn, "%lld bytes: more than this machine can address", (long long)size);
  else
    buf = xmalloc((size_t)size + 1, "a file's contents");
  for (size_t done = 0; buf && done < (size_t)size;) {
    ssize_t k = read(fd, buf + done, (size_t)size - done);
    if (k < 0 && errno == EINTR)
      continue;
    if (k <= 0) {
      snprintf(why, wn, "cannot read: %s", k ? strerror(errno) : "the file grew shorter while it was read");
      free(buf);
      buf = NULL;
    }
    done += k > 0 ? (size_t)k : 0;
  }
  close(fd);
  if (buf) {
    buf[size] = 0;
    *n = (size_t)size;
  }
  return buf;
}
