#!/usr/bin/env bash
# Build the slapo-ae image on its CPU path and run its default command (kick_the_tires) offline.
#
#   bash docker/ci_test.sh            # from the repository root; as root on a fresh machine
#
# Steps, each timed and skipped when its result is already there:
#   1. a Docker engine: installs Debian's docker.io (and debootstrap) when missing, starts
#      dockerd in the background when none answers, and stops it again at the end;
#   2. the base image slapo-ae-base:bookworm: debootstrap --variant=minbase bookworm with
#      Python 3.11 (venv, headers) and g++, imported with `docker import`; the root file system
#      is kept as a tarball under .cache/docker/ so that reruns only import it;
#   3. a wheelhouse of CPU wheels for every pin of pyproject.toml (made while step 2 runs) with
#      `pip wheel` (pip in a build cannot verify PyPI's certificate here), under
#      .cache/docker/wheelhouse, remade only when pyproject.toml or docker/requirements.py change;
#   4. `docker build` of docker/Dockerfile from that base, pip reading only that wheelhouse
#      (served on loopback; the wheels are no layer of the image);
#   5. `docker run --rm --network none IMAGE` and a check for the line KICK-THE-TIRES: PASS.
#
# Exit status: 0 pass, 1 fail, 77 no Docker engine can run here (the reason is printed).
# Environment: IMAGE (slapo-ae:cpu), BASE_IMAGE (slapo-ae-base:bookworm), DEBIAN_MIRROR,
# PYTHON (python3, must be 3.11), RUN_TIMEOUT (seconds, 1800), KEEP_DOCKERD=1 (leave a dockerd
# this script started running), SKIP_RUN=1 (build only).
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin      # dockerd and debootstrap live there

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

IMAGE=${IMAGE:-slapo-ae:cpu}
BASE_IMAGE=${BASE_IMAGE:-slapo-ae-base:bookworm}
SUITE=bookworm
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE_PACKAGES=python3,python3-venv,python3-dev,g++
PYTHON=${PYTHON:-python3}
RUN_TIMEOUT=${RUN_TIMEOUT:-1800}
CACHE=$ROOT/.cache/docker
WHEELHOUSE=$CACHE/wheelhouse
mkdir -p "$CACHE"
TIMINGS=$CACHE/timings.txt
: > "$TIMINGS"

log() { printf '[ci_test %(%H:%M:%S)T] %s\n' -1 "$*"; }
skip() { log "SKIP: $*"; echo "DOCKER-TEST: SKIP ($*)"; exit 77; }
fail() { log "FAIL: $*"; echo "DOCKER-TEST: FAIL ($*)"; exit 1; }
STEP_START=0
step() { STEP_NAME=$1; STEP_START=$SECONDS; log "== $1"; }
done_step() {
    local took=$((SECONDS - STEP_START))
    printf '%-10s %5d s  %s\n' "$STEP_NAME" "$took" "${1:-}" >> "$TIMINGS"
    log "== $STEP_NAME: ${took} s ${1:-}"
}

# ------------------------------------------------------------------------------------------
# 1. a Docker engine
DOCKERD_PID=
HTTP_PID=
cleanup() {
    [[ -z $HTTP_PID ]] || kill "$HTTP_PID" 2>/dev/null || true
    [[ -z ${WHEEL_PID:-} ]] || kill "$WHEEL_PID" 2>/dev/null || true
    if [[ -n $DOCKERD_PID && ${KEEP_DOCKERD:-0} != 1 ]]; then
        log "stopping the dockerd this script started (pid $DOCKERD_PID)"
        kill "$DOCKERD_PID" 2>/dev/null || true
        for _ in $(seq 30); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 1; done
    fi
}
trap cleanup EXIT

apt_install() {
    [[ $(id -u) == 0 ]] || return 1
    command -v apt-get >/dev/null || return 1
    log "apt-get install $*"
    if [[ ! -e $CACHE/.apt-updated ]]; then
        apt-get update -qq && touch "$CACHE/.apt-updated" || return 1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

step engine
if [[ -x /usr/bin/docker ]]; then
    DOCKER=/usr/bin/docker      # the client that came with the engine (Debian's docker.io)
else
    DOCKER=$(command -v docker || true)
fi
if [[ -z $DOCKER ]] || ! "$DOCKER" info >/dev/null 2>&1; then
    if ! command -v dockerd >/dev/null; then
        apt_install docker.io || skip "no Docker engine: dockerd is not installed and cannot be (needs root and apt-get)"
        DOCKER=/usr/bin/docker
    fi
    if ! "$DOCKER" info >/dev/null 2>&1; then
        [[ $(id -u) == 0 ]] || skip "dockerd is installed but not running, and starting it needs root"
        log "starting dockerd in the background (log: $CACHE/dockerd.log)"
        dockerd > "$CACHE/dockerd.log" 2>&1 &
        DOCKERD_PID=$!
        for _ in $(seq 60); do
            "$DOCKER" info >/dev/null 2>&1 && break
            kill -0 "$DOCKERD_PID" 2>/dev/null || break
            sleep 1
        done
        if ! "$DOCKER" info >/dev/null 2>&1; then
            tail -n 20 "$CACHE/dockerd.log" || true
            DOCKERD_PID=
            skip "dockerd did not start (see $CACHE/dockerd.log)"
        fi
    fi
fi
# The engine must also run a container: a kernel without namespaces, cgroups or overlay
# answers `docker info` but fails here (checked below, on the base image).
done_step "$("$DOCKER" version --format 'client {{.Client.Version}}, server {{.Server.Version}}' 2>/dev/null)"

# ------------------------------------------------------------------------------------------
# 3. the wheelhouse (CPU wheels, made on the host). Defined first: when it must be made, it is
# made in the background while step 2 runs debootstrap (both wait mostly on the network).
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || fail "$PYTHON is not Python 3.11: the wheelhouse must match the image's Python 3.11"
wkey=$(cat pyproject.toml docker/requirements.py | sha256sum | cut -c1-16)
make_wheelhouse() {
    local t0=$SECONDS
    rm -rf "$WHEELHOUSE"
    mkdir -p "$WHEELHOUSE"
    "$PYTHON" docker/requirements.py --extras all --keep torch --build-system > "$CACHE/requirements.txt"
    log "pip wheel $(paste -sd' ' "$CACHE/requirements.txt")"
    # DeepSpeed is an sdist: its wheel is built here, with no ops (they compile on first use).
    if ! DS_BUILD_OPS=0 "$PYTHON" -m pip wheel --no-cache-dir --progress-bar off -q \
        --wheel-dir "$WHEELHOUSE" -r "$CACHE/requirements.txt" > "$CACHE/wheelhouse.log" 2>&1; then
        grep -v "^WARNING: Location" "$CACHE/wheelhouse.log" | tail -n 30
        return 1
    fi
    if ! ls "$WHEELHOUSE"/torch-*+cpu-*.whl >/dev/null 2>&1; then
        log "warning: no CPU build of torch in the wheelhouse ($(ls "$WHEELHOUSE"/torch-*.whl)): a large image"
    fi
    echo "$wkey" > "$WHEELHOUSE/.key"
    printf '%-10s %5d s  %s\n' wheelhouse $((SECONDS - t0)) \
        "$(find "$WHEELHOUSE" -name '*.whl' | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1)" >> "$TIMINGS"
}
WHEEL_PID=
if [[ -f $WHEELHOUSE/.key && $(cat "$WHEELHOUSE/.key") == "$wkey" ]]; then
    printf '%-10s %5d s  %s\n' wheelhouse 0 "up to date ($(du -sh "$WHEELHOUSE" | cut -f1))" >> "$TIMINGS"
else
    log "== wheelhouse (in the background; log: $CACHE/wheelhouse.log)"
    make_wheelhouse &
    WHEEL_PID=$!
fi

# ------------------------------------------------------------------------------------------
# 2. the base image (debootstrap minbase + docker import), cached as a tarball
step base
key=$(printf '%s %s %s' "$SUITE" "$BASE_PACKAGES" 1 | sha256sum | cut -c1-12)
BASE_TAR=$CACHE/base-$SUITE-$key.tar
if "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1 \
    && [[ $("$DOCKER" image inspect --format '{{index .Config.Labels "slapo-ae.base-key"}}' "$BASE_IMAGE" 2>/dev/null) == "$key" ]]; then
    done_step "present ($BASE_IMAGE)"
else
    if [[ ! -s $BASE_TAR ]]; then
        command -v debootstrap >/dev/null || apt_install debootstrap \
            || skip "debootstrap is missing and cannot be installed"
        [[ $(id -u) == 0 ]] || skip "debootstrap needs root"
        rootfs=$CACHE/rootfs
        rm -rf "$rootfs"
        log "debootstrap --variant=minbase $SUITE (+ $BASE_PACKAGES) from $DEBIAN_MIRROR"
        debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$rootfs" "$DEBIAN_MIRROR" \
            > "$CACHE/debootstrap.log" 2>&1 || { tail -n 30 "$CACHE/debootstrap.log"; fail "debootstrap failed"; }
        # No package caches, documentation or locales in the image.
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin \
            "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* \
            "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/* "$rootfs"/tmp/* \
            "$rootfs"/var/log/*.log
        tar --numeric-owner -C "$rootfs" -cf "$BASE_TAR.part" . && mv "$BASE_TAR.part" "$BASE_TAR"
        rm -rf "$rootfs"
        find "$CACHE" -maxdepth 1 -name "base-$SUITE-*.tar" ! -name "$(basename "$BASE_TAR")" -delete
    fi
    log "docker import $BASE_TAR"
    "$DOCKER" import --change "LABEL slapo-ae.base-key=$key" --change 'CMD ["/bin/bash"]' \
        "$BASE_TAR" "$BASE_IMAGE" >/dev/null
    done_step "$(du -h "$BASE_TAR" | cut -f1) tarball"
fi
"$DOCKER" run --rm --network none "$BASE_IMAGE" python3.11 -c 'import sys; print(sys.version)' \
    || fail "the engine cannot run a container from $BASE_IMAGE"

if [[ -n $WHEEL_PID ]]; then
    step wheel-wait
    wait "$WHEEL_PID" || { WHEEL_PID=; fail "pip wheel failed (log: $CACHE/wheelhouse.log)"; }
    WHEEL_PID=
    done_step "waited for the wheelhouse"
fi

# ------------------------------------------------------------------------------------------
# 4. the image, built from the base and the wheelhouse alone: pip in the build reads the
# wheelhouse over loopback (python -m http.server on the host, `docker build --network host`)
# and has no index (PIP_NO_INDEX=1), so nothing else can be fetched; the wheels are no layer of
# the image. A fixed port keeps the build arguments, hence Docker's layer cache, stable.
step build
port=${WHEELHOUSE_PORT:-8765}
"$PYTHON" -c "import socket,sys; s=socket.socket(); s.bind(('127.0.0.1', $port))" 2>/dev/null \
    || port=$("$PYTHON" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
"$PYTHON" -m http.server --bind 127.0.0.1 --directory "$WHEELHOUSE" "$port" > "$CACHE/http.log" 2>&1 &
HTTP_PID=$!
for _ in $(seq 50); do
    "$PYTHON" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/', timeout=1)" 2>/dev/null && break
    sleep 0.2
done
TORCH_SPEC=$("$PYTHON" docker/requirements.py --extras "" --keep torch | grep -E '^torch([=<>!~ ]|$)')
log "docker build $IMAGE (base $BASE_IMAGE, $TORCH_SPEC; wheels from http://127.0.0.1:$port/)"
set +e
DOCKER_BUILDKIT=0 "$DOCKER" build --network host -f docker/Dockerfile -t "$IMAGE" \
    --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg TORCH_SPEC="$TORCH_SPEC" \
    --build-arg TORCH_INDEX= \
    --build-arg PIP_FIND_LINKS="http://127.0.0.1:$port/" \
    --build-arg PIP_NO_INDEX=1 \
    . > "$CACHE/build.log" 2>&1
rc=$?
set -e
kill "$HTTP_PID" 2>/dev/null || true
HTTP_PID=
if [[ $rc != 0 ]]; then
    tail -n 40 "$CACHE/build.log"
    fail "docker build failed (log: $CACHE/build.log)"
fi
size=$("$DOCKER" image inspect --format '{{.Size}}' "$IMAGE")
done_step "$IMAGE, $((size / 1024 / 1024)) MiB"

if [[ ${SKIP_RUN:-0} == 1 ]]; then
    log "SKIP_RUN=1: not running the image"
    cat "$TIMINGS"
    exit 0
fi

# ------------------------------------------------------------------------------------------
# 5. the default command, offline, as the image's non-root user
step run
out=$CACHE/run
rm -rf "$out"
mkdir -p "$out/results"
chmod -R a+rwX "$out"      # the container's user (uid 1000) writes there
log "docker run --rm --network none -v $out/results:/work/slapo-ae/results $IMAGE"
set +e
timeout --kill-after=30 "$RUN_TIMEOUT" "$DOCKER" run --rm --network none --name slapo-ae-ci-$$ \
    -v "$out/results:/work/slapo-ae/results" "$IMAGE" 2>&1 | tee "$CACHE/run.log"
rc=${PIPESTATUS[0]}
set -e
if [[ $rc == 124 || $rc == 137 ]]; then
    "$DOCKER" rm -f "slapo-ae-ci-$$" >/dev/null 2>&1 || true
fi
verdict=$(grep -ahoE 'KICK-THE-TIRES: (PASS|FAIL.*)' "$CACHE/run.log" "$out"/results/kick_the_tires.txt 2>/dev/null | tail -n 1 || true)
done_step "exit $rc, ${verdict:-no verdict line}"

# The documented form for keeping results on the host: an arbitrary --user with mounted
# results/ and .snakemake/; a dry run of the experiments' DAG is enough to check it.
step user
mkdir -p "$out/user/results" "$out/user/snakemake"
chown -R 4321:4321 "$out/user" 2>/dev/null || chmod -R a+rwX "$out/user"
user_rc=0
"$DOCKER" run --rm --network none --user 4321:4321 \
    -v "$out/user/results:/work/slapo-ae/results" -v "$out/user/snakemake:/work/slapo-ae/.snakemake" \
    "$IMAGE" snakemake --cores 2 --dry-run > "$CACHE/run-user.log" 2>&1 || user_rc=$?
done_step "docker run --user 4321:4321 snakemake --dry-run: exit $user_rc"

log "timings:"
cat "$TIMINGS"
[[ $user_rc == 0 ]] || { tail -n 20 "$CACHE/run-user.log"; fail "snakemake --dry-run as --user 4321:4321 failed (log: $CACHE/run-user.log)"; }
[[ $rc == 0 ]] || fail "docker run exited $rc (${verdict:-no verdict line}; log: $CACHE/run.log)"
[[ $verdict == "KICK-THE-TIRES: PASS" ]] || fail "no KICK-THE-TIRES: PASS line (${verdict:-none})"
echo "DOCKER-TEST: PASS ($IMAGE)"
