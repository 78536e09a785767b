// test_prelude: each prelude of the emitted modules (runtime/prelude.h, prelude_bf16.h, prelude.cuh) compiles
// on its own, as mdlc embeds it, so that an error in one shows here without a model: the C ones with
// cc -fsyntax-only and the warnings the C back end's tests ask for, the CUDA one with NVRTC for sm_80 and sm_90
// without a warning.
#include "emit_common.h"
#include "emit_cuda.h"
#include "test.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

// src compiles as C without a warning; else the compiler's first error is in why.
static bool c_compiles_clean(const char *src, char *why, size_t n) {
  char path[] = "/tmp/mdl-prelude-XXXXXX.c", log[] = "/tmp/mdl-prelude-XXXXXX.log", cmd[512];
  int fd = mkstemps(path, 2), lfd = mkstemps(log, 4);
  if (fd < 0 || lfd < 0)
    return false;
  close(lfd);
  FILE *f = fdopen(fd, "w");
  fputs(src, f);
  fclose(f);
  snprintf(cmd, sizeof cmd, "cc -std=c11 -fopenmp -fsyntax-only -Wall -Wextra -Werror -x c %s >%s 2>&1", path, log);
  int rc = system(cmd);
  snprintf(why, n, "?");
  f = fopen(log, "r");
  while (f && fgets(why, (int)n, f) && !strstr(why, "error"))
    ;
  if (f)
    fclose(f);
  unlink(path);
  unlink(log);
  return rc == 0;
}

int main(void) {
  char why[1024];
  CHECK(c_compiles_clean(ec_prelude_c, why, sizeof why), "prelude: runtime/prelude.h compiles as C11 without a warning",
        "%s", why);
  size_t n = strlen(ec_prelude_c), nb = strlen(ec_prelude_c_bf16);
  char *both = malloc(n + nb + 1);
  memcpy(both, ec_prelude_c, n);
  memcpy(both + n, ec_prelude_c_bf16, nb + 1);
  CHECK(c_compiles_clean(both, why, sizeof why),
        "prelude: runtime/prelude_bf16.h after prelude.h compiles as C11 without a warning", "%s", why);
  free(both);

  if (!nvrtc_available(why, sizeof why)) {
    printf("[skip] prelude: runtime/prelude.cuh with NVRTC: %s\n", why);
    TEST_EXIT();
  }
  const char *archs[] = {"sm_80", "sm_90"};
  for (int i = 0; i < 2; i++) {
    NvrtcResult r = {0};
    bool ok = nvrtc_compile(ec_prelude_cuda, archs[i], &r, why, sizeof why);
    char name[128];
    snprintf(name, sizeof name, "prelude: runtime/prelude.cuh compiles with NVRTC for %s without a warning", archs[i]);
    CHECK(ok && !r.log, name, "%.600s", ok ? r.log : why);
    free(r.cubin);
    free(r.log);
  }
  TEST_EXIT();
}
