/* Hash pages on a second core while a NIXL read is still landing later ones.
 *
 * Used only by probe_landed_pipeline.py (compiled there with `cc -O2 -shared -fPIC`): the
 * probe's question is whether a verified fetch could hide its hash pass under the copy, and a
 * Python hasher might lose that race to the GIL alone. This loop holds no GIL (ctypes releases
 * it around the call) and waits by spinning, so nothing but the machine stands between it and
 * the overlap.
 *
 * The hash is the one the tier seals with: the caller passes the address of the xxhash
 * extension's own 128-bit XXH3 function, so the digests equal xxhash.xxh3_128_intdigest's.
 */
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

typedef struct {
    uint64_t low;
    uint64_t high;
} digest128;

typedef digest128 (*hash128_fn)(const void *data, size_t len, uint64_t seed);

static double monotonic_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* The reader's I/O thread calls it after each request completes: pages [0, landed) are in. A
 * negative value tells the hasher the read failed. The release store orders the copy's bytes
 * before the count on every architecture, not only on x86. */
void landed_publish(int64_t *landed, int64_t value) {
    __atomic_store_n(landed, value, __ATOMIC_RELEASE);
}

/* Hash pages 0..n-1 (page i at base + slots[i] * page_bytes) as soon as *landed covers them,
 * writing low and high words of page i's digest to out[2i], out[2i + 1]. Returns n when all
 * are hashed, -1 - hashed when the read failed, and the count hashed so far on timeout. */
int64_t landed_hash(void *fn, const uint8_t *base, uint64_t page_bytes, const int64_t *slots,
                    int64_t n, uint64_t seed, const int64_t *landed, uint64_t *out,
                    double timeout_s) {
    hash128_fn hash = (hash128_fn)fn;
    double deadline = monotonic_s() + timeout_s;
    int64_t done = 0;
    unsigned spins = 0;
    while (done < n) {
        int64_t ready = __atomic_load_n(landed, __ATOMIC_ACQUIRE);
        if (ready < 0)
            return -1 - done;
        if (ready > done) {
            for (; done < ready && done < n; done++) {
                digest128 d = hash(base + (uint64_t)slots[done] * page_bytes, page_bytes, seed);
                out[2 * done] = d.low;
                out[2 * done + 1] = d.high;
            }
            spins = 0;
            continue;
        }
        /* Spin a while (a request lands every ~100 us), then yield the core so a stalled read
         * does not starve the thread that would complete it. */
        if (++spins < 4096)
            continue;
        spins = 0;
        if (monotonic_s() > deadline)
            return done;
        sched_yield();
    }
    return done;
}
