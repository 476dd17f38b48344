# shellcheck shell=bash
# The container images of the end-to-end test, made without a registry or a
# container engine and imported into each node's containerd under the names
# the manifests use:
#   - the driver: the Dockerfile's runtime stage rebuilt from Debian's packages
#     (a minbase root filesystem by mmdebstrap with exactly the packages the
#     Dockerfile installs) plus the release binary;
#   - each sidecar: its static binary alone;
#   - busybox from Debian's busybox-static; the pause image from pause.c;
#   - external-snapshot-metadata's lister on the busybox layer (a backup
#     client for the scenarios).
#
# Needs: E2E_ROOT, E2E_CACHE, W, the *_VERSION variables, BIN_SIDECARS (name -> dir).

PAUSE_IMAGE=registry.k8s.io/pause:3.10
BUSYBOX_IMAGE=registry.k8s.io/e2e-test-images/busybox:1.36.1-1
SIDECAR_REGISTRY=registry.k8s.io/sig-storage
# The changed block tracking scenario's backup client.
LISTER_IMAGE=example-csi-e2e/snapshot-metadata-lister:$SNAPSHOT_METADATA_VERSION

# The tools the driver runs; the image must hold each of them.
DRIVER_TOOLS=(mount umount losetup blkid findmnt fsfreeze mkfs.ext4 e2fsck resize2fs tune2fs
              mkfs.xfs xfs_growfs xfs_admin xfs_repair mkfs.btrfs btrfs)

# The packages the Dockerfile's runtime stage installs with apt-get.
dockerfile_packages() {
    awk '/^FROM debian/ {rt=1} rt && /apt-get install/ {on=1; next}
         on && /^[[:space:]]+[a-z0-9][a-z0-9.+-]*[[:space:]]*\\$/ {print $1; next}
         on {on=0}' "$E2E_ROOT/Dockerfile" | sort -u
}

driver_version() {
    sed -n '/^\[package\]/,/^\[/ s/^version = "\(.*\)"/\1/p' "$E2E_ROOT/Cargo.toml" | head -1
}

driver_image() { echo "example-csi/csi-driver:v$(driver_version)"; }

# The release before this build (PREVIOUS_RELEASE at PREVIOUS_RELEASE_COMMIT):
# its csi-driver and its deploy/, built once from its commit into
# $E2E_CACHE/release-VERSION-COMMIT. Sets PREVIOUS_DIR to that folder, or
# PREVIOUS_WHY to why it cannot be had (a clone without the commit).
PREVIOUS_DIR=""
# shellcheck disable=SC2034  # read by the upgrade scenario
PREVIOUS_WHY=""
previous_release() {
    local commit=$PREVIOUS_RELEASE_COMMIT
    local out=$E2E_CACHE/release-$PREVIOUS_RELEASE-${commit:0:12}
    local target=${CARGO_TARGET_DIR:-$E2E_ROOT/target}
    if [ ! -x "$out/csi-driver" ]; then
        if ! git -C "$E2E_ROOT" cat-file -e "$commit^{commit}" 2>/dev/null; then
            # shellcheck disable=SC2034  # read by the upgrade scenario
            PREVIOUS_WHY="release v$PREVIOUS_RELEASE (commit ${commit:0:12}) is not in this clone's history"
            return 0
        fi
        log "building release v$PREVIOUS_RELEASE from its commit ${commit:0:12}"
        rm -rf "$out" "$out.tmp"; mkdir -p "$out.tmp/src"
        git -C "$E2E_ROOT" archive "$commit" | tar -x -C "$out.tmp/src" || die "cannot unpack v$PREVIOUS_RELEASE"
        # the same target folder: the dependencies are built once for both
        (cd "$out.tmp/src" && CARGO_TARGET_DIR=$target cargo build --release --locked --quiet --bin csi-driver) \
            || die "cannot build v$PREVIOUS_RELEASE"
        install -m 0755 "$target/release/csi-driver" "$out.tmp/csi-driver"
        mv "$out.tmp/src/deploy" "$out.tmp/deploy"
        rm -rf "$out.tmp/src"
        mv "$out.tmp" "$out"
    fi
    "$out/csi-driver" --version | grep -qw "$PREVIOUS_RELEASE" \
        || die "$out/csi-driver is not v$PREVIOUS_RELEASE: $("$out/csi-driver" --version)"
    PREVIOUS_DIR=$out
}

previous_image() { echo "example-csi/csi-driver:v$PREVIOUS_RELEASE"; }

# The Debian root filesystem of the driver's image, cached by its package list.
driver_rootfs() {
    local pkgs key out
    pkgs=$(dockerfile_packages | paste -sd, -)
    [ -n "$pkgs" ] || die "no packages found in the Dockerfile's runtime stage"
    key=$(echo "bookworm minbase $pkgs" | sha256sum | cut -c1-16)
    out=$E2E_CACHE/rootfs-$key.tar
    if [ ! -f "$out" ]; then
        log "making the driver's root filesystem (bookworm minbase + $pkgs)"
        mmdebstrap --quiet --format=tar --variant=minbase --include="$pkgs" \
            --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
            --dpkgopt='path-exclude=/usr/share/locale/*' \
            bookworm "$out.tmp" </dev/null >"$W/logs/mmdebstrap.log" 2>&1 \
            || die "mmdebstrap failed (logs/mmdebstrap.log)"
        mv "$out.tmp" "$out"
    fi
    echo "$out"
}

# check_driver_rootfs TAR: every tool the driver runs is in the image.
check_driver_rootfs() {
    local listing missing=()
    listing=$(tar -tf "$1")
    local t
    for t in "${DRIVER_TOOLS[@]}"; do
        grep -qE "^\./(usr/)?s?bin/$t\$" <<<"$listing" || missing+=("$t")
    done
    [ ${#missing[@]} -eq 0 ] || die "the driver's image lacks: ${missing[*]}"
    log "driver image holds every tool the driver runs (${#DRIVER_TOOLS[@]}: ${DRIVER_TOOLS[*]})"
}

build_images() {
    local dir=$W/images
    mkdir -p "$dir"
    local mk=$E2E_ROOT/e2e/lib/mkimage.py

    # pause
    mkdir -p "$dir/pause"
    gcc -static -O2 -o "$dir/pause/pause" "$E2E_ROOT/e2e/lib/pause.c" || die "cannot build pause"
    python3 "$mk" "$dir/pause.tar" "$PAUSE_IMAGE" --layer "$dir/pause" --entrypoint '["/pause"]'

    # busybox
    rm -rf "$dir/busybox"; mkdir -p "$dir/busybox/bin" "$dir/busybox/tmp" "$dir/busybox/etc"
    cp /bin/busybox "$dir/busybox/bin/busybox"
    local a
    for a in $(/bin/busybox --list); do [ "$a" = busybox ] || ln -s busybox "$dir/busybox/bin/$a"; done
    echo "root:x:0:0:root:/root:/bin/sh" >"$dir/busybox/etc/passwd"
    echo "root:x:0:" >"$dir/busybox/etc/group"
    chmod 1777 "$dir/busybox/tmp"
    python3 "$mk" "$dir/busybox.tar" "$BUSYBOX_IMAGE" --layer "$dir/busybox" --cmd '["sh"]'

    # a backup client: the lister, with a shell to run it from
    rm -rf "$dir/lister"; cp -a "$dir/busybox" "$dir/lister"
    cp "$E2E_CACHE/snapshot-metadata-lister-$SNAPSHOT_METADATA_VERSION/snapshot-metadata-lister" "$dir/lister/bin/"
    python3 "$mk" "$dir/lister.tar" "$LISTER_IMAGE" --layer "$dir/lister" --cmd '["sh"]'

    # sidecars: one static binary each
    local name bin image
    for name in "${!SIDECAR_BINS[@]}"; do
        bin=${SIDECAR_BINS[$name]}
        rm -rf "${dir:?}/$name"; mkdir -p "$dir/$name"
        cp "$bin" "$dir/$name/$name"
        image=$SIDECAR_REGISTRY/$name:${SIDECAR_TAGS[$name]}
        python3 "$mk" "$dir/$name.tar" "$image" --layer "$dir/$name" --entrypoint "[\"/$name\"]"
    done

    # the driver
    local rootfs; rootfs=$(driver_rootfs)
    check_driver_rootfs "$rootfs"
    rm -rf "$dir/driver"; mkdir -p "$dir/driver/usr/local/bin"
    install -m 0755 "$DRIVER_BIN" "$dir/driver/usr/local/bin/csi-driver"
    python3 "$mk" "$dir/driver.tar" "$(driver_image)" --layer "$rootfs" --layer "$dir/driver" \
        --entrypoint '["/usr/local/bin/csi-driver"]'

    # the release before, its binary on this build's root filesystem
    if [ -n "$PREVIOUS_DIR" ]; then
        rm -rf "$dir/previous"; mkdir -p "$dir/previous/usr/local/bin"
        install -m 0755 "$PREVIOUS_DIR/csi-driver" "$dir/previous/usr/local/bin/csi-driver"
        python3 "$mk" "$dir/previous.tar" "$(previous_image)" --layer "$rootfs" --layer "$dir/previous" \
            --entrypoint '["/usr/local/bin/csi-driver"]'
    fi
}

# import_images SOCKET: every image built above into one containerd.
import_images() {
    local sock=$1 t
    for t in "$W"/images/*.tar; do
        ctr_ --address "$sock" -n k8s.io images import --no-unpack=false "$t" >/dev/null 2>>"$W/logs/ctr.log" \
            || die "cannot import $t"
    done
}
