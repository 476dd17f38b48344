# Versions the end-to-end test builds and runs. The sidecar versions are read
# from deploy/, so that the test always runs exactly what the manifests pin
# (deploy/validate.sh checks that every sidecar image deploy/ names is one of
# SIDECAR_VERSIONS, at that version).
# shellcheck shell=bash
# Read by the scripts that source this file.
# shellcheck disable=SC2034
E2E_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

KUBERNETES_VERSION=v1.37.2
ETCD_VERSION=v3.6.5
CONTAINERD_VERSION=v2.4.2
# What the External Storage suite deploys for its "any volume data source"
# test, under the image names it asks for.
POPULATOR_VERSION=v3.2.0
VALIDATOR_VERSION=v1.7.0
# The reference driver the cluster benchmark measures beside this one.
HOSTPATH_VERSION=v1.18.0
# The release before this build: the upgrade scenario installs it from its
# own deploy/ and binary (built from its commit), then upgrades to this build
# and rolls back. Each release is tagged vVERSION at that commit.
PREVIOUS_RELEASE=0.1.0
PREVIOUS_RELEASE_COMMIT=f4f1f4a9e7be2d9cdfbf91040bd8870d50a2ee2d
HELM_VERSION=$(sed -n 's/^HELM_VERSION="\(.*\)".*/\1/p' "$E2E_ROOT/deploy/validate.sh")

# image tag pinned in deploy/ for a sidecar, e.g. pinned_tag csi-provisioner
pinned_tag() {
    grep -rhoE "registry.k8s.io/sig-storage/$1:v[0-9.]+" "$E2E_ROOT/deploy/overlays" "$E2E_ROOT/deploy/components" \
        | sort -u | sed 's/.*://' | head -1
}
PROVISIONER_VERSION=$(pinned_tag csi-provisioner)
ATTACHER_VERSION=$(pinned_tag csi-attacher)
RESIZER_VERSION=$(pinned_tag csi-resizer)
SNAPSHOTTER_VERSION=$(pinned_tag csi-snapshotter)
REGISTRAR_VERSION=$(pinned_tag csi-node-driver-registrar)
LIVENESSPROBE_VERSION=$(pinned_tag livenessprobe)
SNAPSHOT_METADATA_VERSION=$(pinned_tag csi-snapshot-metadata)

# Every registry.k8s.io/sig-storage image deploy/ runs, by name, at the version
# the test builds it.
# shellcheck disable=SC2034
declare -A SIDECAR_VERSIONS=(
    [csi-provisioner]=$PROVISIONER_VERSION
    [csi-attacher]=$ATTACHER_VERSION
    [csi-resizer]=$RESIZER_VERSION
    [csi-snapshotter]=$SNAPSHOTTER_VERSION
    [csi-node-driver-registrar]=$REGISTRAR_VERSION
    [livenessprobe]=$LIVENESSPROBE_VERSION
    [csi-snapshot-metadata]=$SNAPSHOT_METADATA_VERSION
)

# The released source archives e2e/build.sh falls back to when the module
# proxy refuses a module, by file name (each upstream repository at its tag).
# shellcheck disable=SC2034
declare -A UPSTREAM_SHA256=(
    [node-driver-registrar-v2.17.0.tar.gz]=35558318a510686b4f95a9a44f94b00ccb5246fb45e03f3c8fc7f9c8903a1d57
    [livenessprobe-v2.19.0.tar.gz]=7946efd0898818ee2b4879ee0141eca94349beade8785f36beb58f7fe34e1728
    [external-snapshot-metadata-v1.1.0.tar.gz]=6564a7750052b4564f250d60cd43caa3ebf80a20934b7c959b272ba636baca8a
    [lib-volume-populator-v3.2.0.tar.gz]=75eb7514a52ebd4630715ebcf40fbcbe8beafc2e89333a187b57febc5ddb5557
    [volume-data-source-validator-v1.7.0.tar.gz]=2727163f56f9dd78f05051a267882c97bf815d8829185f4291556bfc47015ebb
    [csi-driver-host-path-v1.18.0.tar.gz]=70abe33fb0f97dfba6f15bc62ff5b973e29e00b3ccf6124f3ad82874258c2692
)

E2E_CACHE=${EXAMPLE_CSI_E2E_CACHE:-$HOME/.cache/example-csi-e2e}
