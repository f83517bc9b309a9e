#pragma once

// <cblas.h> for the builds against PyPI's scipy-openblas32 (FLASHATTN_BLAS=scipy-openblas, the
// wheel; cmake/Dependencies.cmake puts this folder before the package's include folder). That
// OpenBLAS names every symbol with a scipy_ prefix (scipy_cblas_sgemm), so that it never clashes
// with another OpenBLAS in the process (numpy's, the system's): the sources keep the plain CBLAS
// names, and this header maps the few they call.
//
// It is also the pthread build of OpenBLAS, where the system's is the OpenMP build: sgemm runs on
// OpenBLAS's own threads, as many as it was last told. Each call here tells it what the OpenMP
// build would take (docs/design.md, "Dependencies"): inside one of the library's parallel
// regions one thread, the caller's, as each thread there runs sgemms of its own; outside, the
// calling thread's OpenMP thread count (the call's num_threads, else OMP_NUM_THREADS or
// torch.set_num_threads). The count is global to that OpenBLAS (this build does not export
// openblas_set_num_threads_local), which is safe because the library's BLAS calls take turns
// (util/blas_lock.hpp) and every thread of one call's parallel region sets the same count, 1.

#include_next <cblas.h>
#include <omp.h>

#define openblas_get_config scipy_openblas_get_config
#define openblas_get_corename scipy_openblas_get_corename

inline void flashattn_scipy_cblas_sgemm(
    const enum CBLAS_ORDER order, const enum CBLAS_TRANSPOSE trans_a,
    const enum CBLAS_TRANSPOSE trans_b, const blasint m, const blasint n, const blasint k,
    const float alpha, const float* a, const blasint lda, const float* b, const blasint ldb,
    const float beta, float* c, const blasint ldc) {
  scipy_openblas_set_num_threads(omp_in_parallel() ? 1 : omp_get_max_threads());
  scipy_cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
#define cblas_sgemm flashattn_scipy_cblas_sgemm
