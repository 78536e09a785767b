// scratch_dir.h: the data tests' scratch folder (tmp, made by the test's main with mkdtemp and
// removed with nftw and remove_entry), files written into it, and stderr captured while a call runs
// (inline: a test that uses only some of them compiles without warnings).
#ifndef MDL_SCRATCH_DIR_H
#define MDL_SCRATCH_DIR_H
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

static char tmp[64];

// A path in the scratch folder; the last 16 stay valid.
static inline char *path_in(const char *name) {
  static char buf[16][512];
  static int i;
  i = (i + 1) % 16;
  snprintf(buf[i], sizeof buf[i], "%s/%s", tmp, name);
  return buf[i];
}

static inline void write_file(const char *path, const void *data, size_t n) {
  FILE *f = fopen(path, "wb");
  fwrite(data, 1, n, f);
  fclose(f);
}

static inline int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st, (void)flag, (void)ftw;
  return remove(path);
}

// stderr into a buffer while a call runs.
static int saved_stderr = -1;
static char captured[8192], capture_path[128];

static inline void capture_begin(void) {
  fflush(stderr);
  saved_stderr = dup(2);
  snprintf(capture_path, sizeof capture_path, "%s/stderr.txt", tmp);
  int fd = open(capture_path, O_CREAT | O_TRUNC | O_WRONLY, 0644);
  dup2(fd, 2);
  close(fd);
}

static inline const char *capture_end(void) {
  fflush(stderr);
  dup2(saved_stderr, 2);
  close(saved_stderr);
  FILE *f = fopen(capture_path, "rb");
  size_t n = fread(captured, 1, sizeof captured - 1, f);
  fclose(f);
  captured[n] = 0;
  return captured;
}
#endif
