#!/usr/bin/env bash
# Provision a loopback FLARE system with N sites, start server + sites, wait until all are connected,
# submit the given jobs through the FLARE API, wait, download the results, and stop everything
# (also on failure or Ctrl-C).  Everything is in fedssl.ops.deploy; this is the shell entry point.
#
#   provisioning/run_local.sh WORKSPACE N_SITES DATA_ROOT [JOB ...] [-- extra fedssl deploy-local options]
#   provisioning/run_local.sh /tmp/fl 2 "$PWD/data/acdc/{site}" jobs/fcl_acdc -- --profile quick
#   provisioning/run_local.sh /tmp/fl 2 "$PWD/data/acdc/{site}" -- --hold      # keep it up for fl_admin.sh
set -euo pipefail
if [ $# -lt 3 ]; then
  sed -n '2,9p' "$0"; exit 2
fi
ws=$1; n=$2; data=$3; shift 3
jobs=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do jobs+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
exec fedssl deploy-local "${jobs[@]}" -w "$ws" --sites "$n" --data-root "$data" "$@"
