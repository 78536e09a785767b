// The C library a module of the C back end uses: it includes nothing else.
#define _DEFAULT_SOURCE // mmap's MAP_ANONYMOUS and madvise's MADV_HUGEPAGE under -std=c11
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

