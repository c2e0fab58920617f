/* kvhandoff's native copy helper for the shm transport's map lane (see native.py).
 *
 * kvh_copy copies n pieces, dst[i] <- src[i] (len[i] bytes each), in one call, so that the
 * caller (ctypes, GIL released for the whole call) pays one foreign call per batch instead of
 * one per piece.
 *
 * kvh_copy_regions copies pieces that belong to one or several regions back to back (a write
 * job of one layer's regions, or of several layers'), and hashes each region on its own: it
 * feeds each source piece to update(state, ...) (XXH3's streaming update, from python-xxhash or
 * libxxhash, passed in by the caller), copies it while it is still in cache, and feeds the
 * destination piece it just wrote to update(landed, ...) while that is in cache: the fused
 * copy + hash + verification pass (one read of the source, one write and one cached read of
 * the destination per piece), one foreign call for the whole job.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int (*kvh_update_fn)(void *state, const void *data, size_t len);

/* a piece is hashed, copied and read back in steps of this many bytes, so that each step's
 * source and destination are still in L1/L2 when they are hashed (the streaming hash gives
 * the same digest however its input is cut) */
#define KVH_STEP ((size_t)32768)

/* one piece: its source hashed, copied and its destination hashed (landed may be NULL), step
 * by step; 0, or the first nonzero update result */
static int copy_hashed(const char *s, char *d, size_t k, kvh_update_fn update, void *state,
                       void *landed)
{
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
    return 0;
}

void kvh_copy(const int64_t *src, const int64_t *dst, const int64_t *len, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        memcpy((char *)(intptr_t)dst[i], (const char *)(intptr_t)src[i], (size_t)len[i]);
}

typedef int (*kvh_reset_fn)(void *state);
typedef uint64_t (*kvh_digest_fn)(const void *state);

/* Copies pieces lo..hi-1 (indices into src/dst/len) with the fused hashes, region by region: region r is pieces bounds[r]..bounds[r+1]-1 (nreg regions, bounds ascending). At
 * the first piece of a region both states are reset; after its last piece their digests go
 * to out_src[r] and out_landed[r] (out_landed and landed may be NULL: no read-back). A call
 * may stop inside a region (hi), and the next call on the same states (lo = the old hi) goes
 * on with it, so the caller can check for cancellation between calls. Empty regions are not
 * touched (the caller fills in the digest of no bytes). Returns 0, or the first nonzero
 * update or reset result. */
int kvh_copy_regions(const int64_t *src, const int64_t *dst, const int64_t *len, int64_t lo,
                     int64_t hi, const int64_t *bounds, int64_t nreg, kvh_update_fn update,
                     kvh_reset_fn reset, kvh_digest_fn digest, void *state, void *landed,
                     uint64_t *out_src, uint64_t *out_landed)
{
    int64_t r = 0;
    while (r < nreg && bounds[r + 1] <= lo)
        r++;
    for (int64_t i = lo; i < hi && r < nreg; i++) {
        if (i == bounds[r]) {
            int rc = reset(state);
            if (rc == 0 && landed != NULL)
                rc = reset(landed);
            if (rc != 0)
                return rc;
        }
        int rc = copy_hashed((const char *)(intptr_t)src[i], (char *)(intptr_t)dst[i],
                             (size_t)len[i], update, state, landed);
        if (rc != 0)
            return rc;
        if (i + 1 == bounds[r + 1]) {
            out_src[r] = digest(state);
            if (landed != NULL && out_landed != NULL)
                out_landed[r] = digest(landed);
            r++;
            while (r < nreg && bounds[r + 1] == bounds[r])
                r++;  /* empty regions: nothing to hash */
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
