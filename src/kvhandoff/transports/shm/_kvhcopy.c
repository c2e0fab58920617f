/* kvhandoff's native copy helper for the shm transport's map lane (see _native.py).
 *
 * kvh_copy copies n pieces, dst[i] <- src[i] (len[i] bytes each), in one call, so that the
 * caller (ctypes, GIL released for the whole call) pays one foreign call per batch instead of
 * one per piece. With `update` set it first feeds each source piece to update(state, ...)
 * (XXH3's streaming update, from python-xxhash or libxxhash, passed in by the caller) and then
 * copies it while it is still in cache: the fused copy+hash pass. Returns 0, or the first nonzero update result.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int (*kvh_update_fn)(void *state, const void *data, size_t len);

int kvh_copy(const int64_t *src, const int64_t *dst, const int64_t *len, int64_t n,
             kvh_update_fn update, void *state)
{
    for (int64_t i = 0; i < n; i++) {
        const void *s = (const void *)(intptr_t)src[i];
        size_t k = (size_t)len[i];
        if (update != NULL) {
            int rc = update(state, s, k);
            if (rc != 0)
                return rc;
        }
        memcpy((void *)(intptr_t)dst[i], s, k);
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
