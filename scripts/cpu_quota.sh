#!/usr/bin/env bash
# Run a command with a CPU quota: a stand-in for a slower host when timing the test suite.
#
#   sudo bash scripts/cpu_quota.sh 0.8 make test        # the suite with 0.8 of one core's time in all
#
# The suite's time target is set on the project's slower 2-core host kind (AVX2-only), which a
# session may not be given. On a faster host, a quota on the total CPU time gives about the same
# throughput: commit 5f2de7d's `bash .ci/run` took 18 min 17 s on the slower kind, and on 2026-11-28
# 19 min 07 s to 24 min 12 s on a 2-core AVX-512 Zen 4 under a quota of 0.8 cores (1.05-1.32x; a
# shared host's speed changes by the hour). So compare a change back to back
# with 5f2de7d and scale by 18 min 17 s, rather than reading one figure. It is a model, not that
# host: threads run at full speed in bursts (the quota is spent per 100 ms).
#
# Needs root and the cpu controller: cgroup v2 (cpu.max) or v1 (cpu.cfs_quota_us). The cgroup is
# removed when the command ends; the command's exit status is this script's.
set -euo pipefail

if [[ $# -lt 2 ]]; then
    echo "usage: $0 CORES COMMAND [ARGS...]   (CORES: the quota in cores, e.g. 0.8)" >&2
    exit 2
fi
cores=$1
shift
period=100000
quota=$(awk -v c="$cores" -v p="$period" 'BEGIN { q = int(c * p); if (q < 1000) exit 1; print q }') || {
    echo "cpu_quota: CORES must be a number of cores of at least 0.01, not '$cores'" >&2
    exit 2
}
name="bionemo-export-quota-$$"
if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then  # cgroup v2
    group=/sys/fs/cgroup/$name
    grep -qw cpu /sys/fs/cgroup/cgroup.subtree_control || echo +cpu > /sys/fs/cgroup/cgroup.subtree_control
    mkdir "$group"
    echo "$quota $period" > "$group/cpu.max"
elif [[ -d /sys/fs/cgroup/cpu ]]; then  # cgroup v1
    group=/sys/fs/cgroup/cpu/$name
    mkdir "$group"
    echo "$period" > "$group/cpu.cfs_period_us"
    echo "$quota" > "$group/cpu.cfs_quota_us"
else
    echo "cpu_quota: no cgroup cpu controller under /sys/fs/cgroup (needs root and cgroups mounted)" >&2
    exit 1
fi

cleanup() {
    # Processes still in the group (none once the command has ended) go back to the root group first.
    if [[ -f "$group/cgroup.procs" ]]; then
        while read -r pid; do echo "$pid" > "$(dirname "$group")/cgroup.procs" 2>/dev/null || true; done < "$group/cgroup.procs"
    fi
    rmdir "$group" 2>/dev/null || true
}
trap cleanup EXIT

echo "cpu_quota: $cores cores ($quota us every $period us) for: $*" >&2
# A subshell joins the group, then runs the command; this shell stays outside to clean up.
( echo "$BASHPID" > "$group/cgroup.procs"; exec "$@" )
