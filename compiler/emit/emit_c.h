// emit_c.h: the C back end's compiler side. emit_c (compiler/emit/emit_c.c) turns a step plan into one
// C11 + OpenMP translation unit; runtime/engine/cpu.c compiles, loads and runs it (runtime/engine/
// backend.h: the ABI between the runtime and such a module).
#ifndef MDL_EMIT_C_H
#define MDL_EMIT_C_H
#include "mdl.h"

//
// emit_c.c: the C emitter.
//
// The whole training step of f's graph as C11 + OpenMP source, laid out on m's arena. The text is
// allocated in f->g's arena; NULL (after a message on stderr) when a step cannot be emitted.
// source_path only appears in the file's first comment.
char *emit_c(const Fusion *f, const MemPlan *m, const char *source_path);
#endif
