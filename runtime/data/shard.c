// shard.c: llm.c token shards: atomic writing, memory-mapped reading with validation, and the
// list of one split's shards in a folder.
//
// A shard is a header of 256 little-endian int32 ([0] = 20240520, [1] = 1, [2] = token count)
// followed by the tokens as uint16. The writer streams tokens through a temporary file and fills
// in the count at the end; nothing appears under the real name until the file is complete and
// on disk. The reader maps the file and checks every token against the model's vocabulary up
// front: one sequential pass over memory that is about to be read anyway.
#include "data.h"
#include "rt_util.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "shards are little-endian and read in place: a big-endian host needs byte swapping here"
#endif

//
// Atomic files.
//
bool datafile_open(DataFile *d, const char *path) {
  memset(d, 0, sizeof *d);
  const char *slash = strrchr(path, '/');
  size_t dirlen = slash ? (size_t)(slash - path + 1) : 0;
  d->path = xstrdup(path, "a shard's path");
  d->tmp = xmalloc(strlen(path) + 64, "a shard's path");
  snprintf(d->tmp, strlen(path) + 64, "%.*s.%s.tmp%ld", (int)dirlen, path, path + dirlen, (long)getpid());
  d->f = fopen(d->tmp, "wb");
  if (!d->f) {
    diag_file_error(path, "cannot create: %s", strerror(errno));
    free(d->path);
    free(d->tmp);
    memset(d, 0, sizeof *d);
    return false;
  }
  return true;
}

static void fsync_folder(const char *path) {
  const char *slash = strrchr(path, '/');
  char *dir = slash ? xstrndup(path, (size_t)(slash - path + 1), "a folder's path") : xstrdup(".", "a folder's path");
  int fd = open(dir, O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    fsync(fd);
    close(fd);
  }
  free(dir);
}

bool datafile_commit(DataFile *d) {
  bool ok = fflush(d->f) == 0 && fsync(fileno(d->f)) == 0;
  ok = fclose(d->f) == 0 && ok;
  if (ok && rename(d->tmp, d->path) == 0) {
    fsync_folder(d->path);
  } else {
    diag_file_error(d->path, "cannot write: %s", strerror(errno));
    remove(d->tmp);
    ok = false;
  }
  free(d->path);
  free(d->tmp);
  memset(d, 0, sizeof *d);
  return ok;
}

void datafile_abort(DataFile *d) {
  fclose(d->f);
  remove(d->tmp);
  free(d->path);
  free(d->tmp);
  memset(d, 0, sizeof *d);
}

//
// Writing.
//
bool shard_writer_open(ShardWriter *w, const char *path) {
  w->n = 0;
  if (!datafile_open(&w->file, path))
    return false;
  int32_t header[256] = {SHARD_MAGIC, SHARD_VERSION, 0};
  if (fwrite(header, sizeof header, 1, w->file.f) != 1) {
    diag_file_error(path, "cannot write: %s", strerror(errno));
    datafile_abort(&w->file);
    return false;
  }
  return true;
}

bool shard_writer_put(ShardWriter *w, const uint16_t *tokens, size_t n) {
  if (n && fwrite(tokens, sizeof *tokens, n, w->file.f) != n) {
    diag_file_error(w->file.path, "cannot write: %s", strerror(errno));
    datafile_abort(&w->file);
    return false;
  }
  w->n += (int64_t)n;
  return true;
}

bool shard_writer_finish(ShardWriter *w) {
  if (w->n > INT32_MAX) {
    diag_file_error(w->file.path, "%lld tokens: a shard holds at most %d", (long long)w->n, INT32_MAX);
    datafile_abort(&w->file);
    return false;
  }
  int32_t count = (int32_t)w->n;
  if (fseek(w->file.f, 2 * sizeof(int32_t), SEEK_SET) || fwrite(&count, sizeof count, 1, w->file.f) != 1) {
    diag_file_error(w->file.path, "cannot write: %s", strerror(errno));
    datafile_abort(&w->file);
    return false;
  }
  return datafile_commit(&w->file);
}

bool shard_write(const char *path, const uint16_t *tokens, int64_t n) {
  ShardWriter w;
  return shard_writer_open(&w, path) && shard_writer_put(&w, tokens, (size_t)n) && shard_writer_finish(&w);
}

//
// Reading.
//
bool shard_map(Shard *s, const char *path, int64_t vocab, char *why, size_t n) {
  memset(s, 0, sizeof *s);
  int64_t size;
  int fd = file_open(path, O_RDONLY, &size, why, n);
  if (fd < 0)
    return false;
  if (size < SHARD_HEADER_BYTES) {
    rt_fail(why, n, "truncated: %lld bytes, a shard's header alone is %d", (long long)size, SHARD_HEADER_BYTES);
    close(fd);
    return false;
  }
  void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (map == MAP_FAILED) {
    rt_fail(why, n, "cannot map: %s", strerror(errno));
    return false;
  }
  const int32_t *h = map;
  int64_t holds = (size - SHARD_HEADER_BYTES) / 2;
  bool ok = false;
  if (h[0] != SHARD_MAGIC) {
    rt_fail(why, n, "bad magic %d: not a token shard (want %d)", h[0], SHARD_MAGIC);
  } else if (h[1] != SHARD_VERSION) {
    rt_fail(why, n, "version %d: only version %d (uint16 tokens) is read", h[1], SHARD_VERSION);
  } else if (h[2] < 0 || h[2] > holds) {
    rt_fail(why, n, "truncated: header says %d tokens, file holds %lld", h[2], (long long)holds);
  } else if (h[2] < holds || (size - SHARD_HEADER_BYTES) % 2) {
    rt_fail(why, n, "header says %d tokens, file holds %lld bytes after the header", h[2],
            (long long)(size - SHARD_HEADER_BYTES));
  } else {
    ok = true;
    const uint16_t *tok = (const uint16_t *)((const char *)map + SHARD_HEADER_BYTES);
    for (int64_t i = 0; vocab > 0 && i < h[2]; i++)
      if (tok[i] >= vocab) {
        rt_fail(why, n, "token %d at index %lld is outside the model's vocabulary (V = %lld)", tok[i],
                (long long)i, (long long)vocab);
        ok = false;
        break;
      }
  }
  if (!ok) {
    munmap(map, (size_t)size);
    return false;
  }
  s->path = xstrdup(path, "a shard's path");
  s->map = map;
  s->map_bytes = (size_t)size;
  s->n = h[2];
  s->tokens = (const uint16_t *)((const char *)map + SHARD_HEADER_BYTES);
  return true;
}

bool shard_open(Shard *s, const char *path, int64_t vocab) {
  char why[200];
  bool ok = shard_map(s, path, vocab, why, sizeof why);
  if (!ok)
    diag_file_error(path, "%s", why);
  return ok;
}

void shard_close(Shard *s) {
  if (s->map)
    munmap(s->map, s->map_bytes);
  free(s->path);
  memset(s, 0, sizeof *s);
}

// "SPLIT_*.bin", "*_SPLIT_*.bin" or "*_SPLIT.bin".
static bool is_shard_of(const char *name, const char *split) {
  size_t n = strlen(name), k = strlen(split);
  if (n < 4 || strcmp(name + n - 4, ".bin"))
    return false;
  if (!strncmp(name, split, k) && name[k] == '_')
    return true;
  for (const char *p = strchr(name, '_'); p; p = strchr(p + 1, '_'))
    if (!strncmp(p + 1, split, k) && (p[1 + k] == '_' || p[1 + k] == '.'))
      return true;
  return false;
}

static int compare_paths(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

int shard_list(const char *dir, const char *split, char ***out) {
  *out = NULL;
  DIR *d = opendir(dir);
  if (!d) {
    diag_file_error(dir, "cannot open the folder: %s", strerror(errno));
    return -1;
  }
  char **paths = NULL;
  int n = 0, cap = 0;
  for (struct dirent *e; (e = readdir(d));) {
    if (!is_shard_of(e->d_name, split))
      continue;
    if (n == cap) {
      cap = cap ? 2 * cap : 16;
      paths = xrealloc(paths, (size_t)cap * sizeof *paths, "the list of shards");
    }
    size_t len = strlen(dir) + strlen(e->d_name) + 2;
    paths[n] = xmalloc(len, "the list of shards");
    snprintf(paths[n++], len, "%s/%s", dir, e->d_name);
  }
  closedir(d);
  if (n)
    qsort(paths, (size_t)n, sizeof *paths, compare_paths);
  *out = paths;
  return n;
}

void shard_list_free(char **paths, int n) {
  for (int i = 0; i < n; i++)
    free(paths[i]);
  free(paths);
}
