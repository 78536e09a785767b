// test.h: the unit tests' tiny harness. Every check prints "[ok] name" or "[fail] name: why";
// tests/run.sh counts the lines. A test binary exits 1 when any of its checks failed.
#ifndef MDL_TEST_H
#define MDL_TEST_H
#include <stdio.h>

static int test_failures;

#define CHECK(cond, name, ...)                                                                     \
  do {                                                                                             \
    if (cond) {                                                                                    \
      printf("[ok] %s\n", name);                                                                   \
    } else {                                                                                       \
      printf("[fail] %s: ", name);                                                                 \
      printf(__VA_ARGS__);                                                                         \
      printf("  (%s:%d)\n", __FILE__, __LINE__);                                                   \
      test_failures++;                                                                             \
    }                                                                                              \
  } while (0)

#define TEST_EXIT() return test_failures ? 1 : 0
#endif
