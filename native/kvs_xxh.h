/* XXH3-64 for native/checksum.pyx: the runtime-dispatched build (SSE2 / AVX2 / AVX-512 chosen
 * by CPUID once) on x86-64, the portable inline one elsewhere.  Same output either way. */
#ifndef KVS_XXH_H
#define KVS_XXH_H
#define XXH_STATIC_LINKING_ONLY
#include "xxhash.h"
#if defined(KVS_XXH_DISPATCH)
#include "xxh_x86dispatch.h"
#define kvs_xxh3_64(p, n) XXH3_64bits_dispatch((p), (n))
#define kvs_xxh3_64_seed(p, n, s) XXH3_64bits_withSeed_dispatch((p), (n), (s))
#else
#define kvs_xxh3_64(p, n) XXH3_64bits((p), (n))
#define kvs_xxh3_64_seed(p, n, s) XXH3_64bits_withSeed((p), (n), (s))
#endif
#endif
