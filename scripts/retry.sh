#!/usr/bin/env bash
# retry.sh CMD...: run CMD up to KVH_INSTALL_TRIES times (3), waiting 10 s, then 20 s, between
# tries. make setup wraps its downloads in it: a registry download can break off mid-file
# (seen: a 286 MB wheel cut at 229 MB, pip's resumes getting no further). A command that fails
# every try fails with its own exit status.
tries=${KVH_INSTALL_TRIES:-3}
for ((n = 1; ; n++)); do
  "$@" && exit 0
  rc=$?
  if ((n >= tries)); then
    echo "retry.sh: failed $tries times (exit $rc): $*" >&2
    exit "$rc"
  fi
  echo "retry.sh: try $n of $tries failed (exit $rc), trying again in $((10 * n)) s: $*" >&2
  sleep $((10 * n))
done
