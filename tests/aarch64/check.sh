#!/usr/bin/env bash
# The DGX Spark's processor (aarch64) on an x86-64 Linux host: cross-compiles the workspace for
# aarch64-unknown-linux-gnu and runs its whole CPU test suite (the README's test command) under
# qemu-user, so that every test binary, and every `ornith` process the end-to-end tests start,
# is an aarch64 program. The aarch64 `ornith` binary's dynamic needs are checked by the suite's
# own `the_binary_links_only_glibc` test. This is emulation: it proves the build and the CPU
# path on the Spark's instruction set and glibc ABI, not its speed, its GPU or DGX OS itself.
#
#   bash tests/aarch64/check.sh            # as root on Debian/Ubuntu (installs what it needs)
#   bash tests/aarch64/check.sh -- NAME    # only the tests whose names contain NAME
#
# The whole suite takes over an hour on 2 cores (emulated tests run 5-21 times slower); the last
# run's figures are in docs/TESTING.md.
# Needs: apt (gcc-aarch64-linux-gnu, libc6-dev-arm64-cross, qemu-user, qemu-user-binfmt), rustup, and binfmt_misc
# (so that an aarch64 test can start the aarch64 `ornith` binary as a child process).
set -euo pipefail
cd "$(dirname "$0")/../.."

TRIPLE=aarch64-unknown-linux-gnu
SYSROOT=/usr/aarch64-linux-gnu
CONF=/usr/lib/binfmt.d/qemu-aarch64.conf  # the aarch64 ELF magic and qemu's wrapper, as Debian ships them

if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null || [ ! -d "$SYSROOT/lib" ] \
    || [ ! -f "$CONF" ]; then
    echo "aarch64: installing the cross linker, the arm64 glibc and qemu-user" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user qemu-user-binfmt >/dev/null
fi
if ! rustup target list --installed | grep -qx "$TRIPLE"; then
    rustup target add "$TRIPLE"
fi

# binfmt_misc: the kernel hands aarch64 ELF files to qemu, so that std::process::Command on an
# aarch64 binary works from inside an emulated test. Registered once per boot.
BINFMT=/proc/sys/fs/binfmt_misc
if [ ! -e "$BINFMT/register" ]; then
    mount binfmt_misc -t binfmt_misc "$BINFMT"
fi
if [ ! -e "$BINFMT/qemu-aarch64" ]; then
    [ -f "$CONF" ] || { echo "aarch64: $CONF missing: apt-get install qemu-user-binfmt" >&2; exit 1; }
    cat "$CONF" >"$BINFMT/register"
fi
echo "aarch64: binfmt $(head -1 "$BINFMT/qemu-aarch64") ($(sed -n 2p "$BINFMT/qemu-aarch64"))" >&2

export QEMU_LD_PREFIX="$SYSROOT"
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L $SYSROOT"
# A target directory of its own: the host's build stays as it is.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/aarch64-check"

cargo xtask gen
FILTER=()
if [ "${1:-}" = "--" ]; then
    shift
    FILTER=("$@")
fi
cargo test --workspace --no-fail-fast --target "$TRIPLE" -- "${FILTER[@]}"
