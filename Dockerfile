# syntax=docker/dockerfile:1
#
# example-csi: the csi-driver binary and the tools it calls.
#
#   docker build -t example-csi/csi-driver:v0.2.0 .
#
# The tag matches the crate version in Cargo.toml (deploy/ pins it).

# ---- build ------------------------------------------------------------
# Same Debian release as the runtime image, so the binary's glibc matches.
FROM rust:1.95.0-bookworm AS builder
WORKDIR /src
# proto/build.rs compiles csi.proto with protox: no protoc is needed.
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin csi-driver \
    && install -D -m 0755 target/release/csi-driver /out/csi-driver

# ---- runtime ----------------------------------------------------------
FROM debian:bookworm-slim
ARG VERSION=0.2.0
LABEL org.opencontainers.image.title="example-csi" \
      org.opencontainers.image.description="Local-storage CSI driver (example.csi.k8s.io): image files on loop devices, directories, btrfs subvolumes" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
# util-linux: blkid, fsfreeze, findmnt, lsblk; mount: mount, umount,
# losetup; e2fsprogs: mkfs.ext4, e2fsck, resize2fs; xfsprogs: mkfs.xfs,
# xfs_growfs, xfs_admin, xfs_spaceman, xfs_db; btrfs-progs: mkfs.btrfs, btrfs.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
       util-linux \
       mount \
       e2fsprogs \
       xfsprogs \
       btrfs-progs \
    && rm -rf /var/lib/apt/lists/*
COPY --from=builder /out/csi-driver /usr/local/bin/csi-driver
# The driver runs as root: the node plugin needs it (loop devices, mounts),
# and the sidecars reach its 0660 socket as root too. The manifests drop
# every capability of the non-privileged containers.
ENTRYPOINT ["/usr/local/bin/csi-driver"]
