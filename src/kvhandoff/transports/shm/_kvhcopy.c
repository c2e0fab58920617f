/* kvhandoff's native copy helper for the shm transport's map lane (see native.py).
 *
 * kvh_copy copies n pieces, dst[i] <- src[i] (len[i] bytes each), in one call, so that the
 * caller (ctypes, GIL released for the whole call) pays one foreign call per batch instead of
 * one per piece. With `update` set it feeds each source piece to update(state, ...) (XXH3's
 * streaming update, from python-xxhash or libxxhash, passed in by the caller), copies it while
 * it is still in cache, and, with `landed` set too, feeds the destination piece it just wrote
 * to update(landed, ...) while that is in cache: the fused copy + hash + verification pass
 * (one read of the source, one write and one cached read of the destination per piece).
 * Returns 0, or the first nonzero update result.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int (*kvh_update_fn)(void *state, const void *data, size_t len);

/* a piece is hashed, copied and read back in steps of this many bytes, so that each step's
 * source and destination are still in L1/L2 when they are hashed (the streaming hash gives
 * the same digest however its input is cut) */
#define KVH_STEP ((size_t)32768)

int kvh_copy(const int64_t *src, const int64_t *dst, const int64_t *len, int64_t n,
             kvh_update_fn update, void *state, void *landed)
{
    for (int64_t i = 0; i < n; i++) {
        const char *s = (const char *)(intptr_t)src[i];
        char *d = (char *)(intptr_t)dst[i];
        size_t k = (size_t)len[i];
        if (update == NULL) {
            memcpy(d, s, k);
            continue;
        }
        for (size_t at = 0; at < k; at += KVH_STEP) {
            size_t step = k - at < KVH_STEP ? k - at : KVH_STEP;
            int rc = update(state, s + at, step);
            if (rc != 0)
                return rc;
            memcpy(d + at, s + at, step);
            if (landed != NULL) {
                rc = update(landed, d + at, step);
                if (rc != 0)
                    return rc;
            }
        }
    }
    return 0;
}

/* kvh_hash feeds n pieces (ptr[i], len[i] bytes) to update(state, ...) in order: the writer's
 * read-back of what it just copied (its destination pieces, still in cache), in one call. */
int kvh_hash(const int64_t *ptr, const int64_t *len, int64_t n, kvh_update_fn update,
             void *state)
{
    for (int64_t i = 0; i < n; i++) {
        int rc = update(state, (const void *)(intptr_t)ptr[i], (size_t)len[i]);
        if (rc != 0)
            return rc;
    }
    return 0;
}
