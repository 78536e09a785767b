// harness.h: what the unit tests share: a scratch cache folder made and removed, ... (static inline,
// so that each test stays one translation unit and one that uses only some of them compiles without
// warnings).
#ifndef MDL_HARNESS_H
#define MDL_HARNESS_H
#include <dirent.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mdl.h"
#include "test.h"

// Makes the folder dir (a mkdtemp template) and points MDL_CACHE at it, so that the modules a test
// builds stay out of the user's cache; false after a failed check named name.
static inline bool cache_dir_make(char *dir, const char *name) {
  if (!mkdtemp(dir)) {
    CHECK(false, name, "mkdtemp failed");
    return false;
  }
  setenv("MDL_CACHE", dir, 1);
  return true;
}

// Removes dir and everything in it.
static inline void remove_dir(const char *dir) {
  DIR *d = opendir(dir);
  struct dirent *ent;
  char path[1200];
  while (d && (ent = readdir(d)))
    if (strcmp(ent->d_name, ".") && strcmp(ent->d_name, "..")) {
      bool fits = snprintf(path, sizeof path, "%s/%s", dir, ent->d_name) < (int)sizeof path;
      if (fits && unlink(path))
        remove_dir(path);
    }
  if (d)
    closedir(d);
  rmdir(dir);
}
#endif
