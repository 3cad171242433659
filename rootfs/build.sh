#!/usr/bin/env bash
# Builds an initramfs (uncompressed newc cpio) from Debian's busybox-static plus the overlay
# directory beside this script, and caches it by a hash of its inputs.
#
#   rootfs/build.sh [guest|rig-l1]
#
#   guest (default)  the microVM's root: busybox init, mounts proc/sys/dev, prints the readiness
#                    line "mayfly-guest: ready", keeps a shell on the serial console and runs
#                    the guest agent (/usr/bin/mayfly-agent, built here, statically linked)
#   rig-l1           the test rig's L1 machine: mounts the host's root over 9p and runs a command
#
# Inputs hashed: the busybox-static package version, every file of the overlay, RECIPE below
# and, for guest, the agent binary's sha256 (cargo rebuilds it only when its sources change).
# Output: $MAYFLY_CACHE/rootfs/<flavour>-<hash>/initramfs.cpio (default cache ~/.cache/mayfly) and
# the link $MAYFLY_CACHE/rootfs/<flavour>.current to it. The last line printed is the directory.
set -euo pipefail

RECIPE=3

flavour=${1:-guest}
here=$(cd "$(dirname "$0")" && pwd)
cache=${MAYFLY_CACHE:-$HOME/.cache/mayfly}
overlay=$here/$flavour
busybox=/bin/busybox

die() { echo "rootfs: $*" >&2; exit 1; }
say() { echo "rootfs: $*" >&2; }

[ -d "$overlay" ] || die "no overlay directory $overlay (flavours: guest, rig-l1)"
dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q "install ok installed" \
    || die "busybox-static is not installed: apt-get install busybox-static cpio"
command -v cpio >/dev/null || die "cpio is missing: apt-get install cpio"

# The guest agent: a static binary, so it runs on busybox (no shared glibc in the image).
# Built from the repository root into its own target dir so the workspace's cache (built
# without +crt-static) is untouched; --target keeps the flag away from build scripts.
agent=
agent_sum=none
if [ "$flavour" = guest ]; then
    command -v cargo >/dev/null \
        || die "cargo is missing, and the guest image needs mayfly-agent built from source: install Rust (https://rustup.rs) and rerun"
    repo=$(cd "$here/.." && pwd)
    say "building mayfly-agent (static, release)"
    (cd "$repo" && RUSTFLAGS='-C target-feature=+crt-static' \
        CARGO_PROFILE_RELEASE_OPT_LEVEL=s CARGO_PROFILE_RELEASE_DEBUG=false \
        CARGO_PROFILE_RELEASE_STRIP=symbols CARGO_PROFILE_RELEASE_LTO=true \
        CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1 \
        cargo build --release -p mayfly-agent --target x86_64-unknown-linux-gnu \
        --target-dir target/agent) >&2 \
        || die "building mayfly-agent failed (see cargo's output above)"
    agent=$repo/target/agent/x86_64-unknown-linux-gnu/release/mayfly-agent
    [ -x "$agent" ] || die "cargo succeeded but $agent is missing"
    # A dynamic binary lists its libraries as "name => path"; a static one has none.
    if ldd "$agent" 2>&1 | grep -q '=>'; then
        die "$agent is dynamically linked; it must be static to run in the busybox guest"
    fi
    agent_sum=$(sha256sum "$agent" | cut -d' ' -f1)
fi

bbver=$(dpkg-query -W -f='${Version}' busybox-static)
hash=$( {
    echo "recipe $RECIPE busybox $bbver agent $agent_sum"
    (cd "$overlay" && find . -type f | LC_ALL=C sort | xargs sha256sum)
    (cd "$overlay" && find . -type f -perm -u+x | LC_ALL=C sort)
} | sha256sum | cut -c1-16)

out=$cache/rootfs/$flavour-$hash
if [ -f "$out/initramfs.cpio" ]; then
    ln -sfn "$flavour-$hash" "$cache/rootfs/$flavour.current"
    say "$flavour initramfs is cached"
    echo "$out"
    exit 0
fi

staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
mkdir -p "$staging"/{bin,sbin,usr/bin,usr/sbin,etc,proc,sys,dev,tmp,run,root,mnt,var/log}
cp "$busybox" "$staging/bin/busybox"
# One link per applet, where busybox itself would install it.
"$busybox" --list-full | while read -r applet; do
    [ -e "$staging/$applet" ] || ln -s /bin/busybox "$staging/$applet"
done
cp -a "$overlay"/. "$staging"/
if [ -n "$agent" ]; then
    install -m 0755 "$agent" "$staging/usr/bin/mayfly-agent"
    # Hook directories of the refresh op (the overlay keeps them with .keep files).
    mkdir -p "$staging/etc/mayfly/on-restore.d" "$staging/etc/mayfly/on-fork.d"
fi
# The kernel runs /init from an initramfs: busybox init, unless the overlay brings its own.
[ -e "$staging/init" ] || ln -s /bin/busybox "$staging/init"
chmod 1777 "$staging/tmp"
# The kernel opens /dev/console for init before anything mounts devtmpfs.
mknod -m 600 "$staging/dev/console" c 5 1
mknod -m 666 "$staging/dev/null" c 1 3

mkdir -p "$out.tmp"
(cd "$staging" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc -R 0:0 --quiet) > "$out.tmp/initramfs.cpio"
rm -rf "$out"
mv "$out.tmp" "$out"
ln -sfn "$flavour-$hash" "$cache/rootfs/$flavour.current"
say "built $flavour initramfs: $out/initramfs.cpio ($(du -h "$out/initramfs.cpio" | cut -f1))"
echo "$out"
