// The CUDA modules' types (LP64, as on the Linux hosts NVRTC runs on: long is 64 bits) and constants.
typedef long int64_t;
typedef unsigned long uint64_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef unsigned short uint16_t;
typedef unsigned char uint8_t;

#define MDL_INF __int_as_float(0x7f800000)
#define MDL_NAN __int_as_float(0x7fffffff)
#define MDL_FULL 0xffffffffu
// Threads an SM holds (a kernel that asks for all of them in __launch_bounds__): 2048 on sm_80, sm_90,
// sm_100 and sm_103; 1536 on the others since sm_80 (sm_86, sm_87, sm_89, sm_110, sm_120, ...), as
// ptxas says when asked for more.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ == 800 || __CUDA_ARCH__ == 900 || __CUDA_ARCH__ == 1000 || \
    __CUDA_ARCH__ == 1030
#define MDL_SM_THREADS 2048
#else
#define MDL_SM_THREADS 1536
#endif
#define MDL_ERR_EMBED_ID 1 // MdlStatus.code: an id outside the embedding table
#define MDL_ERR_TARGET 2   // a cross-entropy target >= the number of classes

