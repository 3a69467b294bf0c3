#!/usr/bin/env bash
# Entry point of the slapo-ae image: runs its arguments (default: snakemake kick_the_tires).
#
# 1. Under `docker run --network none` the container's hostname resolves to no address, and
#    torchrun would hand that name to its ranks as the rendezvous address (they then wait for
#    it until their timeout). When the name does not resolve, use the loopback address: the
#    image runs one node, so its ranks meet on 127.0.0.1.
# 2. Under `docker run --user UID:GID` with a user id the image does not know, give the user a
#    name (Snakemake asks for one) and a writable home.
# Values set with `docker run -e` win.
if ! getent hosts "${HOSTNAME:-$(hostname)}" >/dev/null 2>&1; then
    export PET_LOCAL_ADDR=${PET_LOCAL_ADDR:-127.0.0.1}      # torchrun --local-addr
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
fi
if ! name=$(id -un 2>/dev/null); then
    name=uid$(id -u)
fi
export USER=${USER:-$name} LOGNAME=${LOGNAME:-$name}
if [[ ! -w ${HOME:-/} ]]; then
    HOME=/tmp/home-$(id -u)
    export HOME
    mkdir -p "$HOME"
fi
exec "$@"
