#!/usr/bin/env bash
# Builds the test rig's QEMU (qemu-system-x86_64, TCG only) from Debian's qemu source package
# with the patches beside this script, and caches it by a hash of its inputs.
#
#   tests/rig/qemu/build.sh           build (as root when build dependencies are missing), or
#                                     find the cached build
#   tests/rig/qemu/build.sh --check   only look for the cached build (what mayfly-rig does):
#                                     exits 1 when it is missing or out of date
#
# Why: QEMU's TCG emulation of AMD SVM (Debian's 7.2 and bookworm-backports' 10.0) can deliver
# an injected interrupt twice, ignoring RFLAGS.IF, which deadlocks the rig's L2 guests; see
# patches/0001-*.patch.
#
# Source: the orig tarball of the source package of the installed qemu-system-data (from
# bookworm-backports on Debian 12), fetched with `apt-get source --tar-only`: the mirror serves
# only that part of the bpo package (its .dsc and .debian.tar.xz are missing), so Debian's own
# debian/patches are not applied, only ours. Firmware comes from the installed qemu-system-data,
# seabios and ipxe-qemu packages (compiled-in firmware path, as in Debian's own build).
#
# Inputs hashed: the source package version, this script and patches/*.patch. Output:
# $MAYFLY_CACHE/qemu/rig-<hash>/bin/qemu-system-x86_64 (default cache ~/.cache/mayfly), and the
# link $MAYFLY_CACHE/qemu/rig.current to its directory. A second run with the same inputs returns
# at once. The last line printed is the path of the binary.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache=${MAYFLY_CACHE:-$HOME/.cache/mayfly}
# Package whose source version is built: it ships the firmware the binary loads.
anchor=qemu-system-data
# Firmware search path compiled in (Debian's: its packages put the BIOS and option ROMs there).
firmwarepath=/usr/share/qemu:/usr/share/seabios:/usr/lib/ipxe/qemu
# The machine is shared: two compile jobs at most.
jobs=2

die() { echo "rig-qemu: $*" >&2; exit 1; }
say() { echo "rig-qemu: $*" >&2; }

mode=build
case "${1:-}" in
    "") ;;
    --check) mode=check ;;
    *) die "usage: $0 [--check]" ;;
esac

install_hint="apt-get install -t bookworm-backports qemu-system-x86 qemu-system-data seabios ipxe-qemu (scripts/setup.sh does it)"
srcver=$(dpkg-query -W -f='${source:Version}' "$anchor" 2>/dev/null) || srcver=
[ -n "$srcver" ] || die "$anchor is not installed: $install_hint"

patches=$(find "$here/patches" -name '*.patch' 2>/dev/null | sort || true)
hash=$( {
    echo "source qemu $srcver"
    sha256sum < "$here/build.sh"
    for p in $patches; do sha256sum < "$p"; done
} | sha256sum | cut -c1-16)

out=$cache/qemu/rig-$hash
bin=$out/bin/qemu-system-x86_64

if [ "$mode" = check ]; then
    [ -x "$bin" ] || die "$bin is missing: no build yet for qemu $srcver and these patches"
    echo "$bin"
    exit 0
fi

mkdir -p "$cache/qemu"
# One build at a time; the second one then finds the first one's result.
exec 9>"$cache/qemu/.build.lock"
flock 9

if [ -x "$bin" ]; then
    ln -sfn "rig-$hash" "$cache/qemu/rig.current"
    say "patched QEMU is cached"
    echo "$bin"
    exit 0
fi

# Build dependencies, and the firmware the binary loads at run time.
need=(build-essential ninja-build pkgconf libglib2.0-dev zlib1g-dev python3-venv xz-utils
      seabios ipxe-qemu)
missing=()
for p in "${need[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# QEMU 10's configure needs meson >= 1.5 (Debian 12 has 1.0) and pycotap (not in Debian 12), and
# Debian's tarball drops the wheels QEMU would install them from: take both from bookworm-backports.
bpo_missing=()
meson_ver=$(dpkg-query -W -f='${Status} ${Version}' meson 2>/dev/null | sed -n 's/^install ok installed //p' || true)
if [ -z "$meson_ver" ] || dpkg --compare-versions "$meson_ver" lt 1.5.0; then
    bpo_missing+=(meson)
fi
dpkg-query -W -f='${Status}' python3-pycotap 2>/dev/null | grep -q "install ok installed" || bpo_missing+=(python3-pycotap)
backports_src=/etc/apt/sources.list.d/bookworm-backports-src.sources
have_source() { grep -qxF "Version: $srcver" <<< "$(apt-cache showsrc qemu 2>/dev/null || true)"; }
need_source=0
have_source || need_source=1

if [ ${#missing[@]} -gt 0 ] || [ ${#bpo_missing[@]} -gt 0 ] || [ "$need_source" = 1 ]; then
    wanted="${missing[*]} ${bpo_missing[*]}"
    [ "$need_source" = 0 ] || wanted="$wanted deb-src:bookworm-backports"
    [ "$(id -u)" -eq 0 ] || die "needs root to install what is missing (${wanted# }): run this as root, or scripts/setup.sh"
    export DEBIAN_FRONTEND=noninteractive
    if [ "$need_source" = 1 ] && [ ! -e "$backports_src" ]; then
        say "adding $backports_src (deb-src for the qemu source package)"
        cat > "$backports_src" <<'EOF'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    fi
    apt-get update -qq
    if [ ${#missing[@]} -gt 0 ]; then
        say "installing ${missing[*]}"
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
    if [ ${#bpo_missing[@]} -gt 0 ]; then
        say "installing ${bpo_missing[*]} from bookworm-backports"
        apt-get install -y -qq --no-install-recommends -t bookworm-backports "${bpo_missing[@]}" >/dev/null
    fi
fi
have_source || die "apt has no source package qemu $srcver (apt-cache showsrc qemu): add a deb-src entry for the suite $anchor came from (see $backports_src), apt-get update, or upgrade the QEMU packages: $install_hint"

# The orig tarball, fetched (and checked against the signed index) by apt.
upver=${srcver#*:}
upver=${upver%-*}
dl=$cache/src/qemu-download
mkdir -p "$dl"
tarball=$(find "$dl" -maxdepth 1 -name "qemu_${upver}.orig.tar.*" | head -1)
if [ -z "$tarball" ]; then
    say "fetching the qemu $srcver source package (apt-get source --tar-only, 40 MB)"
    # apt warns that root downloads unsandboxed; only show its output when it fails.
    if ! (cd "$dl" && apt-get source -q --tar-only "qemu=$srcver") >"$dl/apt.log" 2>&1; then
        cat "$dl/apt.log" >&2
        die "apt-get source --tar-only qemu=$srcver failed"
    fi
    tarball=$(find "$dl" -maxdepth 1 -name "qemu_${upver}.orig.tar.*" | head -1)
    [ -n "$tarball" ] || die "apt-get source left no qemu_${upver}.orig.tar.* in $dl"
fi

# One extracted, patched source tree per source version and set of patches.
patch_hash=$(for p in $patches; do sha256sum < "$p"; done | sha256sum | cut -c1-8)
src=$cache/src/qemu-$upver-$patch_hash
if [ ! -f "$src/.mayfly-ready" ]; then
    say "extracting $(basename "$tarball")"
    rm -rf "$src" "$src.tmp"
    mkdir -p "$src.tmp"
    tar -xf "$tarball" -C "$src.tmp" --strip-components=1
    for p in $patches; do
        say "applying $(basename "$p")"
        patch -d "$src.tmp" -p1 --quiet --forward < "$p" \
            || die "$(basename "$p") does not apply to qemu $srcver: update it"
    done
    touch "$src.tmp/.mayfly-ready"
    mv "$src.tmp" "$src"
fi

# Only what the rig uses: TCG, -M pc, serial ports on stdio and file chardevs, -kernel/-initrd,
# -virtfs local (virtio-9p, which needs xattr support). --without-default-features turns off
# every optional feature (GUIs, VNC, SPICE, OpenGL, USB redirection, slirp, KVM, tools, ...).
# The install is relocatable: the binary finds its data relative to itself, so the prefix is only
# a name, and a build tree serves every output directory (changes to this script that keep the
# flags reuse it).
prefix=/opt/mayfly-rig-qemu
configure_flags=(
    --prefix="$prefix"
    # Debian's Python, which has the meson and pycotap packages (not one from PATH, e.g. pyenv's).
    --python=/usr/bin/python3
    --firmwarepath="$firmwarepath"
    --target-list=x86_64-softmmu
    --without-default-features
    --enable-tcg
    --enable-virtfs
    --enable-attr
    --disable-docs
    --disable-werror
    --disable-install-blobs
    --disable-download
    "--with-pkgversion=Debian $srcver + mayfly rig patches $patch_hash"
)
# A build tree that got as far as build.ninja is reused.
build_key=$(printf '%s\n' "$srcver" "$patch_hash" "${configure_flags[@]}" | sha256sum | cut -c1-16)
build=$cache/build/qemu-$build_key
log=$build/build.log
if [ ! -f "$build/build.ninja" ]; then
    rm -rf "$build"
    mkdir -p "$build"
    say "configuring: ${configure_flags[*]}"
    (cd "$build" && "$src/configure" "${configure_flags[@]}") >"$log" 2>&1 \
        || { tail -30 "$log" >&2; die "configure failed, log: $log"; }
fi

# Only what gets installed (qemu-system-x86_64, trace-events-all), not the default targets (unit
# tests and the like).
mapfile -t targets < <("$build/pyvenv/bin/meson" introspect --installed "$build" | /usr/bin/python3 -c '
import json, os, sys
build = os.path.realpath(sys.argv[1])
for path in json.load(sys.stdin):
    path = os.path.realpath(path)
    if path.startswith(build + "/"):
        print(os.path.relpath(path, build))' "$build")
[ ${#targets[@]} -gt 0 ] || die "meson introspect --installed lists nothing to build in $build"
say "building ${targets[*]} with $jobs jobs (about 4 min on 2 cores); log: $log"
start=$(date +%s)
set +e
ninja -C "$build" -j"$jobs" "${targets[@]}" 2>&1 | tee -a "$log" | awk '
    /^\[[0-9]+\/[0-9]+\]/ { n++; if (n % 250 == 0) { split($1, a, "/"); sub(/\]/, "", a[2]); printf "rig-qemu:   %d of %d steps...\n", n, a[2] > "/dev/stderr" } }'
status=${PIPESTATUS[0]}
set -e
[ "$status" -eq 0 ] || { tail -30 "$log" >&2; die "build failed, log: $log"; }

# Install into a staging directory, check the result, then move it into place in one step.
stage=$build/stage
rm -rf "$stage"
DESTDIR=$stage "$build/pyvenv/bin/meson" install -C "$build" --no-rebuild --quiet >>"$log" 2>&1 \
    || { tail -30 "$log" >&2; die "install failed, log: $log"; }
staged=$stage$prefix
[ -x "$staged/bin/qemu-system-x86_64" ] || die "install left no $staged/bin/qemu-system-x86_64"
grep -q '"virtio-9p-pci"' <<< "$("$staged/bin/qemu-system-x86_64" -device help)" \
    || die "the build has no virtio-9p-pci device (virtfs): check the configure summary in $log"
# Starting the pc machine loads its BIOS from the firmware path.
echo quit | "$staged/bin/qemu-system-x86_64" -M pc -accel tcg -nodefaults -no-user-config \
    -display none -S -monitor stdio >>"$log" 2>&1 \
    || { tail -5 "$log" >&2; die "the built QEMU cannot start a pc machine (firmware in $firmwarepath?), log: $log"; }

rm -rf "$out"
mkdir -p "$(dirname "$out")"
mv "$staged" "$out"
ln -sfn "rig-$hash" "$cache/qemu/rig.current"
# Source and build trees are large; keep only this build's (outputs stay in qemu/).
find "$cache/build" -maxdepth 1 -name 'qemu-*' ! -name "qemu-$build_key" -exec rm -rf {} +
find "$cache/src" -maxdepth 1 -name 'qemu-*' ! -name "qemu-$upver-$patch_hash" ! -name qemu-download -exec rm -rf {} +
rm -rf "$stage"
say "built in $(( $(date +%s) - start )) s: $bin ($("$bin" -version | head -1))"
echo "$bin"
