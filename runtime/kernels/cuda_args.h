// The kernels' arguments, as the CUDA modules and compiler/emit/emit_cuda.h (which includes this file)
// see them: the status a bad id or target is reported in, and the byte offsets of the buffers a kernel
// uses.
typedef struct {
  unsigned long long set;
  long long code, value, limit;
} MdlStatus;

typedef struct {
  int64_t b[48];
} MdlArgs;

