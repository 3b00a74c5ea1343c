// The instruction-set levels the CPU kernels are built for, picked at run time per process: the
// binary itself stays baseline x86-64 and each vector kernel enables its ISA with a function
// attribute (KVS_AVX2 in gpu/cpu/avx2_util.h, KVS_AVX512 here), so one build runs everywhere and
// uses AVX-512 where the CPU has it. The environment variable KVS_CPU_ISA (scalar, avx2, avx512)
// caps the level for the whole process, so one binary can be measured at each level; tests and
// benchmarks can also pass a cap per call (e.g. RunAttentionProbsWithIsa).
//
// Threading: pure functions; the detection runs once per process.
#ifndef KVSIDECAR_GPU_CPU_CPU_ISA_H_
#define KVSIDECAR_GPU_CPU_CPU_ISA_H_

#include <cstdlib>
#include <cstring>

// AVX-512 Foundation with the BW/VL/DQ extensions (Skylake-SP and later), plus FMA and F16C for
// the 256-bit helpers such code may inline. fp32 arithmetic only: no AVX512-FP16/BF16 or AMX.
#define KVS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

namespace kvs {

// Ordered: a level includes the ones below it.
enum class CpuIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

inline const char* CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kScalar:
      break;
  }
  return "scalar";
}

// The best level this CPU supports, ignoring KVS_CPU_ISA.
inline CpuIsa HardwareCpuIsa() {
  static const CpuIsa isa = [] {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    if (!avx2) return CpuIsa::kScalar;
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    return avx512 ? CpuIsa::kAvx512 : CpuIsa::kAvx2;
  }();
  return isa;
}

// The level the kernels use: HardwareCpuIsa(), lowered by KVS_CPU_ISA when it names a lower
// level (an unknown or higher value changes nothing: the hardware is the limit).
inline CpuIsa DetectedCpuIsa() {
  static const CpuIsa isa = [] {
    CpuIsa best = HardwareCpuIsa();
    if (const char* cap = std::getenv("KVS_CPU_ISA"); cap != nullptr) {
      for (CpuIsa level : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
        if (std::strcmp(cap, CpuIsaName(level)) == 0 && level < best) best = level;
      }
    }
    return best;
  }();
  return isa;
}

// `requested` where this CPU (and KVS_CPU_ISA) allows it, else the best level below it.
inline CpuIsa UsableCpuIsa(CpuIsa requested) {
  return requested < DetectedCpuIsa() ? requested : DetectedCpuIsa();
}

}  // namespace kvs

#endif  // KVSIDECAR_GPU_CPU_CPU_ISA_H_
