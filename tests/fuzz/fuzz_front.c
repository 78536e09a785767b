// fuzz_front.c: a libFuzzer target for the front end. Any bytes go through mdl_compile_bytes, as
// `mdlc check` reads a file; a text that compiles has its graph validated as well. A crash, a
// sanitizer report, an input that runs past -timeout or memory past -rss_limit_mb is a finding.
// tests/cli/fuzz.sh builds it with clang and runs it; tests/fuzz/corpus/ holds the inputs it found.
#include "mdl.h"

#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  Arena *a = arena_new();
  Graph *g = mdl_compile_bytes(a, "fuzz.mdl", (const char *)data, size, NULL, 0);
  char why[512];
  if (g && !ir_validate(g, why, sizeof why)) {
    fprintf(stderr, "the front end built a broken graph: %s\n", why);
    abort();
  }
  arena_free(a);
  return 0;
}
