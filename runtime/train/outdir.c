// outdir.c: a run's output folder OUT: claiming it for one run (OUT/lock), and what a run clears
// there before its first step (a resumed run's log lines past its checkpoint, writes cut short).
#include "runtime.h"
#include "train_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

void out_files(const char *dir, OutFiles *f) {
  snprintf(f->ckpt, sizeof f->ckpt, "%s/checkpoint.safetensors", dir);
  snprintf(f->log, sizeof f->log, "%s/log.jsonl", dir);
  snprintf(f->svg, sizeof f->svg, "%s/loss.svg", dir);
}

// OUT/lock, held (flock) while a run writes into OUT: a second run into the same folder would
// interleave its checkpoints and log lines with the first's. The file holds the holder's pid, for
// the message; the lock itself goes with the process, however it ends.
int train_claim_out(const char *dir, bool resume, bool *created) {
  *created = false;
  if (mkdir(dir, 0777) == 0)
    *created = true;
  else if (errno != EEXIST) {
    diag_file_error(dir, "cannot create the directory: %s", strerror(errno));
    return -1;
  }
  char path[PATH_MAX + 16];
  snprintf(path, sizeof path, "%s/lock", dir);
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (fd < 0) {
    diag_file_error(path, "cannot open the folder's lock: %s", strerror(errno));
    return -1;
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    int why = errno;
    char pid[32] = "";
    ssize_t got = pread(fd, pid, sizeof pid - 1, 0);
    pid[got > 0 ? got : 0] = 0;
    pid[strcspn(pid, "\n")] = 0;
    if (why == EWOULDBLOCK)
      diag_file_error(dir, "another run (pid %s) is writing into this folder: wait for it to end, or choose another "
                      "--out", *pid ? pid : "unknown");
    else
      diag_file_error(path, "cannot lock: %s", strerror(why));
    close(fd);
    return -1;
  }
  char pid[32];
  int len = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
  if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, (size_t)len, 0) != len) {
    // (the pid is only for another run's message: a full disk does not stop this one here)
  }
  OutFiles out;
  out_files(dir, &out);
  struct stat st;
  const char *refused = NULL;
  if (!resume && access(out.ckpt, F_OK) == 0)
    diag_file_error(refused = out.ckpt,
                    "a checkpoint is already here: continue it with --resume, or choose another --out");
  else if (!resume && stat(out.log, &st) == 0 && st.st_size > 0)
    diag_file_error(refused = out.log, "the log of another run is already here, with no checkpoint to continue: "
                    "remove it, or choose another --out");
  if (refused) {
    train_release_out(fd, dir, *created);
    return -1;
  }
  return fd;
}

void train_release_out(int fd, const char *dir, bool remove) {
  if (fd < 0)
    return;
  if (remove) { // (a folder this run made and wrote nothing into but its lock)
    char path[PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/lock", dir);
    unlink(path);
    rmdir(dir);
  }
  close(fd);
}

// On --resume: log.jsonl cut back to the lines of the steps up to the checkpoint's, so that the steps
// a killed run logged after its last checkpoint are not there twice once they run again. A line cut
// short (a kill in the middle of its write) goes too.
bool truncate_log(const char *path, int64_t step) {
  char why[256];
  int64_t size;
  FILE *f = file_fopen(path, "r+", &size, why, sizeof why);
  if (!f)
    return errno == ENOENT || (diag_file_error(path, "%s", why), false);
  char *line = NULL;
  size_t cap = 0;
  ssize_t len;
  off_t keep = 0;
  while ((len = getline(&line, &cap, f)) > 0) {
    long long s = 0;
    const char *k = strstr(line, "\"step\":");
    if (line[len - 1] != '\n' || (k && sscanf(k + 7, "%lld", &s) == 1 && s > step))
      break;
    keep += len;
  }
  free(line);
  bool ok = ftruncate(fileno(f), keep) == 0;
  if (!ok)
    diag_file_error(path, "cannot cut the log back to step %lld: %s", (long long)step, strerror(errno));
  fclose(f);
  return ok;
}
// A write cut short (kill -9) leaves its temporary file; the checkpoint itself is whole.
void remove_partial_writes(const char *ckpt) {
  char pattern[PATH_MAX + 48];
  snprintf(pattern, sizeof pattern, "%s.tmp.*", ckpt);
  glob_t gl;
  if (glob(pattern, 0, NULL, &gl) == 0)
    for (size_t i = 0; i < gl.gl_pathc; i++)
      unlink(gl.gl_pathv[i]);
  globfree(&gl);
}
