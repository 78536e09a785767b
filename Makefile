# mdl: `make` builds bin/mdlc; `make test` runs every test and ends with "N passed, N failed, N skipped";
# `make install PREFIX=DIR` copies bin/mdlc to DIR/bin (default /usr/local).
CC      ?= cc
CFLAGS  ?= -O2 -g
# the source folders, one layer each (docs/internals.md, tests/cli/layers.sh); headers are found by name
SRC_DIRS := compiler $(wildcard compiler/*/) runtime $(wildcard runtime/*/)
CFLAGS  += -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror $(patsubst %/,-I%,$(addsuffix /,$(SRC_DIRS:/=))) -Ibuild
LDLIBS  += -lm -ldl -lpthread
PREFIX  ?= /usr/local

LIB_SRC   := $(filter-out compiler/driver/main.c,$(wildcard $(addsuffix /*.c,$(SRC_DIRS:/=))))
LIB_OBJ   := $(patsubst %.c,build/%.o,$(LIB_SRC)) build/mdl.tab.o build/lex.yy.o build/preludes.o
# each prelude of the emitted modules: its pieces in runtime/kernels/, joined by + in order (tools/embed.c);
# the CUDA one by kernel family: types, the kernels' arguments (emit_cuda.h includes them too), common
# helpers, tensor cores, fp8, reductions, attention, cross-entropy, the optimizer
K         := runtime/kernels
CUDA_PIECES := cuda_base.cuh cuda_args.h cuda_common.cuh cuda_mma.cuh fp8_bits.h cuda_fp8.cuh cuda_reduce.cuh \
               cuda_attention.cuh cuda_ce.cuh cuda_opt.cuh
PRELUDES  := ec_prelude_c=$(K)/prelude_libc.h+$(K)/abi.h+$(K)/prelude.h ec_prelude_c_bf16=$(K)/prelude_bf16.h \
             ec_prelude_fp8=$(K)/fp8_bits.h ec_prelude_c_fp8=$(K)/prelude_c_fp8.h \
             ec_prelude_cuda=$(subst $() ,+,$(addprefix $(K)/,$(CUDA_PIECES)))
UNIT_SRC  := $(wildcard tests/unit/test_*.c)
UNIT_BIN  := $(patsubst tests/unit/%.c,build/tests/%,$(UNIT_SRC))
HEADERS   := $(wildcard $(addsuffix /*.h,$(SRC_DIRS:/=)))

all: bin/mdlc build/tools/blobs

bin/mdlc: build/compiler/driver/main.o build/libmdl.a
	@mkdir -p bin
	$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS)

build/libmdl.a: $(LIB_OBJ)
	rm -f $@
	ar rcs $@ $^

build/%.o: %.c $(HEADERS) build/mdl.tab.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c -o $@ $<

build/mdl.tab.c build/mdl.tab.h &: grammar/mdl.y
	@mkdir -p build
	bison -Wall -Werror --defines=build/mdl.tab.h -o build/mdl.tab.c $<

build/lex.yy.c: grammar/mdl.l build/mdl.tab.h
	flex -o $@ $<

build/mdl.tab.o: build/mdl.tab.c $(HEADERS)
	$(CC) $(CFLAGS) -Igrammar -c -o $@ $<

build/lex.yy.o: build/lex.yy.c $(HEADERS)
	$(CC) $(CFLAGS) -Igrammar -c -o $@ $<

# the preludes of emitted modules (runtime/kernels/prelude*), as C arrays in mdlc (emit_common.h)
build/tools/embed: tools/embed.c
	@mkdir -p build/tools
	$(CC) $(CFLAGS) -o $@ $<

build/preludes.c: build/tools/embed Makefile $(wildcard $(K)/*.h $(K)/*.cuh)
	build/tools/embed $@ $(PRELUDES)

build/preludes.o: build/preludes.c
	$(CC) $(CFLAGS) -c -o $@ $<

build/tests/%: tests/unit/%.c tests/unit/test.h tests/unit/draw_checks.h tests/unit/cubin_syms.h \
                tests/unit/cuda_emu_host.h tests/unit/cuda_emu.h tests/unit/scratch_dir.h tests/unit/harness.h \
                build/libmdl.a
	@mkdir -p build/tests
	$(CC) $(CFLAGS) -Itests/unit -o $@ $< build/libmdl.a $(LDLIBS)

# an allocator that fails from the N-th allocation on, preloaded by tests/cli/alloc.sh
build/tests/failalloc.so: tests/alloc/failalloc.c
	@mkdir -p build/tests
	$(CC) $(CFLAGS) -fPIC -shared -o $@ $< -ldl

# a synthetic classification set as .npy files, for models/mlp.mdl (README, tests/cli/arrays.sh)
build/tools/blobs: tools/blobs.c build/libmdl.a
	@mkdir -p build/tools
	$(CC) $(CFLAGS) -o $@ $< build/libmdl.a $(LDLIBS)

install: bin/mdlc build/tools/blobs
	install -d $(DESTDIR)$(PREFIX)/bin
	install -m 755 bin/mdlc $(DESTDIR)$(PREFIX)/bin/mdlc

test: bin/mdlc build/tools/blobs $(UNIT_BIN) build/tests/failalloc.so
	@tests/run.sh

# generated/ from models/ (tests/cli/golden.sh fails when it is stale)
regen: bin/mdlc
	tools/regen.sh

# tokens/s, compile times and peak memory against PyTorch from PyPI, eager and torch.compile (not a
# test: timings vary); bench/threads.sh measures OpenMP's wait policy idle and loaded
bench: bin/mdlc
	bench/run.sh
	bench/checkpoint.sh

# the checkpoint part alone: none, auto and all side by side; the largest batch within a budget
bench-checkpoint: bin/mdlc
	bench/checkpoint.sh

# on a machine with a GPU: build, GPU vs CPU gradients, GPT-2 124M tokens/s and MFU (< 8 minutes)
gpu-check:
	tools/gpu-check.sh

# the front end under libFuzzer for FUZZ_SECONDS (600) seconds; `make test` runs it for 60
fuzz: bin/mdlc
	FUZZ_SECONDS=$${FUZZ_SECONDS:-600} tests/cli/fuzz.sh

# the test suite on a build under AddressSanitizer and UBSan, in a copy of the tree
sanitize:
	tools/sanitize.sh

# for a GPU machine where nothing can be installed: mdlc with OpenBLAS linked in, and gpu-check's helper
gpu-bundle:
	tools/gpu-check.sh --bundle

clean:
	rm -rf build bin

.PHONY: all install test regen bench bench-checkpoint gpu-check gpu-bundle sanitize fuzz clean
